"""Three adaptation policies (KungFu-style) run for real, and what per-step monitoring costs.

    python benchmarks/adaptation_policies.py [--repeats 3] [--quick]

Every job is a real ``pollux-run`` on this machine (its own embedded store in a temp
dir, the in-process coordinator, gloo worker processes), training an MLP on
scikit-learn's bundled digits with one thread per worker:

* ``gns_batch`` (examples/policies/gns_batch.py, 2 replicas, a 1024-wide MLP): wall
  seconds from the first step to a validation accuracy of ``--target`` with KungFu's
  noise-scale batch policy (batch 32 doubled while the gradient noise scale exceeds it,
  up to 512; LR by AdaScale), and with the batch fixed at 32 (``small_fixed_s``) and at
  512 (``large_fixed_s``, LR x sqrt(16)); the median of ``--repeats`` runs of each,
  interleaved. The default target, 0.98, takes several epochs: at 0.97 the small batch
  gets there in about 4, mostly before the noise scale passes the batch, and the
  adaptive run is the small one;
* ``replica_search`` (examples/policies/replica_search.py): the cost-aware search from 1
  replica, allowed 3 (``-H localhost:3``: this machine has 2 cores, so the third replica
  adds little - what the search should find) against a static job at 3 replicas doing
  the same work (the same epochs, the same total batch). Replica-hours integrate the
  replicas held (a requested grow counts from the request, a shrink until done) over each
  job's steps, first to last; ``replica_hours_ratio_vs_static`` = search / static,
  ``finish_time_ratio`` = search's first-to-last-step time / static's;
* ``straggler`` (examples/policies/straggler.py, 2 replicas): rank 1 sleeps an extra
  20 ms in every forward from step 150 on; ``detect_s`` = wall seconds from that
  injection to the policy's verdict naming rank 1 (``detected``: it named rank 1 and no
  other, never before the injection);
* ``monitor_overhead_pct``: benchmarks/agent_overhead.py ``--policy
  adaptation_policies:SNRMonitor``, a policy reading the gradient SNR and noise scale
  every step through a real controller, against plain DDP (its ``overhead_pct``; the
  measurement hooks alone are budgeted at 0.5 % of step time). The hooks-only figure is
  printed beside it.

Progress lines first; the LAST line is one JSON object::

    {"gns_batch": {"time_to_target_s", "small_fixed_s", "large_fixed_s"},
     "replica_search": {"replica_hours_ratio_vs_static", "finish_time_ratio"},
     "straggler": {"detected", "detect_s"}, "monitor_overhead_pct"}

About 4-5 minutes on an idle 2-core machine (``--quick``: fewer repeats, shorter jobs;
``--smoke``: one run of each, a 0.5 target, 10-epoch searches, a 120-step straggler
job, 2 overhead pairs with the policy only). A case that fails is named under
``"failed"``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import Report, run_benchmark  # beside this script

from pollux_launch.elastic import AdaptationPolicy, PolicyContext

REPO = Path(__file__).resolve().parents[1]
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))


class SNRMonitor(AdaptationPolicy):
    """KungFu's gradient monitor: the noise scale and SNR read every step (``ctx.record``)."""

    name = "snr-monitor"

    def after_step(self, ctx: PolicyContext) -> None:
        gns, snr = ctx.gns, ctx.grad_snr
        if gns is not None:
            ctx.record("gns", gns)
        if snr is not None:
            ctx.record("grad_snr", snr)


def say(line: str) -> None:
    print(line, flush=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pollux_run(tmp: Path, name: str, flags: list[str], script: str, args: list[str],
               timeout: float = 600) -> list[dict[str, Any]]:
    """Run ``script`` under pollux-run (its own embedded store); its ``--out`` records."""
    out = tmp / f"{name}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [POLLUX_RUN, "--store", f"embedded://{tmp}/{name}.db", "--job-name", name, *flags,
           sys.executable, script, *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        print(f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", file=sys.stderr)
        raise RuntimeError(f"{name} failed ({proc.returncode}): {last_line(proc.stderr)}")
    return read_jsonl(out)


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def result_of(records: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [r for r in records if r.get("event") == "result"]
    if not found:
        raise RuntimeError(f"{name}: no result record")
    return found[-1]


# -- a: the noise-scale batch policy ------------------------------------------------------
def bench_gns(tmp: Path, repeats: int, target: float) -> dict[str, float | None]:
    times: dict[str, list[float]] = {"adaptive": [], "small": [], "large": []}
    common = ["--target", str(target), "--hidden", "1024", "--batch-size", "32",
              "--max-batch-size", "512", "--max-epochs", "100"]
    for i in range(repeats):
        order = ["adaptive", "small", "large"]
        for mode in order[i % 3:] + order[:i % 3]:  # rotate: drifts of the machine cancel
            fixed = [] if mode == "adaptive" else ["--fixed", mode]
            rec = result_of(pollux_run(tmp, f"gns-{mode}-{i}", ["-np", "2"],
                                       "examples/policies/gns_batch.py", common + fixed),
                            mode)
            if rec["reached"]:
                times[mode].append(rec["time_to_target_s"])
            say(f"gns_batch {mode:8s} run {i + 1}/{repeats}: "
                + (f"{rec['time_to_target_s']:.2f} s" if rec["reached"] else "never")
                + f" to {target} in {rec['epochs']} epochs, {rec['steps']} steps, batch "
                f"{'->'.join(map(str, rec['batch_sizes']))}")

    def med(mode: str) -> float | None:  # (None: no run reached the target)
        return round(statistics.median(times[mode]), 3) if times[mode] else None

    return {"time_to_target_s": med("adaptive"), "small_fixed_s": med("small"),
            "large_fixed_s": med("large")}


# -- b: cost-aware replica search ---------------------------------------------------------
def replica_seconds(records: list[dict[str, Any]]) -> tuple[float, float, list[int]]:
    """(wall seconds first step to last, replica-seconds held, world sizes in order)."""
    steps = sorted((r for r in records if r.get("event") == "step"), key=lambda r: r["t"])
    if len(steps) < 2:
        raise RuntimeError("replica_search: fewer than 2 steps recorded")
    held = sum((b["t"] - a["t"]) * b["charged"] for a, b in itertools.pairwise(steps))
    worlds = [s["world"] for s in steps]
    return steps[-1]["t"] - steps[0]["t"], held, [w for i, w in enumerate(worlds)
                                                  if i == 0 or worlds[i - 1] != w]


def bench_replica_search(tmp: Path, epochs: int, threshold: float) -> dict[str, float]:
    script = "examples/policies/replica_search.py"
    common = ["--epochs", str(epochs)]
    search = pollux_run(tmp, "rs-search", ["-np", "1", "--max-np", "3", "-H", "localhost:3"],
                        script, [*common, "--max-replicas", "3", "--threshold", str(threshold)])
    for r in search:
        if r.get("event") in ("measure", "request", "settle", "not-granted"):
            say(f"replica_search: step {r['step']}: {r['event']} " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in r.items() if k in ("replicas", "samples_per_s", "gain")))
    static = pollux_run(tmp, "rs-static", ["-np", "3", "-H", "localhost:3"], script,
                        [*common, "--static"])
    s_wall, s_held, s_worlds = replica_seconds(search)
    b_wall, b_held, _ = replica_seconds(static)
    say(f"replica_search: search {s_wall:.1f} s, {s_held:.1f} replica-s (replicas "
        f"{'->'.join(map(str, s_worlds))}); static 3 replicas {b_wall:.1f} s, "
        f"{b_held:.1f} replica-s; same {epochs} epochs")
    return {"replica_hours_ratio_vs_static": round(s_held / b_held, 3),
            "finish_time_ratio": round(s_wall / b_wall, 3)}


# -- c: straggler detection ----------------------------------------------------------------
def bench_straggler(tmp: Path, steps: int, slow_from: int) -> dict[str, Any]:
    records = pollux_run(tmp, "straggler", ["-np", "2"], "examples/policies/straggler.py",
                         ["--slow-rank", "1", "--slow-from", str(slow_from), "--slow-delay",
                          "0.02", "--steps", str(steps), "--stop-after", "20"])
    rec = result_of(records, "straggler")
    ok = bool(rec["detected"]) and rec["false_positives"] == 0
    say(f"straggler: injected on rank 1 at step {slow_from}; "
        + (f"detected rank {rec['rank']} at step {rec['detected_ranks'][str(rec['rank'])]}, "
           f"{rec['detect_s']:.2f} s later" if rec["detected"] else "not detected")
        + f"; false positives {rec['false_positives']}")
    return {"detected": ok, "detect_s": round(rec["detect_s"], 3) if ok else None}


# -- d: monitoring overhead ----------------------------------------------------------------
def overhead(extra: list[str], pairs: int) -> dict[str, Any]:
    cmd = [sys.executable, str(REPO / "benchmarks" / "agent_overhead.py"), "--pairs",
           str(pairs), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        raise RuntimeError(f"agent_overhead failed ({proc.returncode}): "
                           + json.dumps(out.get("failed") or last_line(proc.stderr)))
    return out


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.quick:
        args.repeats, args.epochs, args.pairs = 1, 100, 20
    t0 = time.monotonic()
    say(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="pollux-ap-") as tmp_dir:
        tmp = Path(tmp_dir)
        with report.case("gns_batch"):
            report["gns_batch"] = bench_gns(tmp, args.repeats, args.target)
        with report.case("replica_search"):
            report["replica_search"] = bench_replica_search(tmp, args.epochs, args.threshold)
        with report.case("straggler"):
            report["straggler"] = bench_straggler(tmp, args.straggler_steps, args.slow_from)
    smoke = ["--smoke"] if args.smoke else []  # (agent_overhead's short blocks)
    with report.case("monitor_overhead"):
        if not args.smoke:  # (the hooks alone are agent_overhead.py's own smoke run)
            hooks = overhead([], args.pairs)
            say(f"agent_overhead: measurement hooks alone {hooks['overhead_pct']:.2f} % "
                f"(CPU {hooks['overhead_pct_cpu']:.2f} %)")
        monitored = overhead([*smoke, "--policy", "adaptation_policies:SNRMonitor"], args.pairs)
        say(f"agent_overhead: hooks + controller + SNRMonitor every step "
            f"{monitored['overhead_pct']:.2f} % (CPU {monitored['overhead_pct_cpu']:.2f} %)")
        report["monitor_overhead_pct"] = monitored["overhead_pct"]
    say(f"done in {time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each gns_batch mode")
    ap.add_argument("--target", type=float, default=0.98, help="gns_batch validation accuracy")
    ap.add_argument("--epochs", type=int, default=300, help="replica_search work (epochs)")
    ap.add_argument("--threshold", type=float, default=0.5,
                    help="replica_search: least marginal gain per added replica")
    ap.add_argument("--straggler-steps", type=int, default=1000,
                    help="straggler: steps of the job at most")
    ap.add_argument("--slow-from", type=int, default=150,
                    help="straggler: the step from which rank 1 is slowed down")
    ap.add_argument("--pairs", type=int, default=60, help="agent_overhead pairs")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 100 epochs, 20 pairs")
    return run_benchmark(ap, bench, smoke={"repeats": 1, "target": 0.5, "epochs": 10,
                                           "straggler_steps": 120, "slow_from": 30, "pairs": 2})


if __name__ == "__main__":
    sys.exit(main())
