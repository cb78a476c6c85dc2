"""Pause of surviving DeepSpeed workers per live rescale, through the real rendezvous.

    python benchmarks/deepspeed_rebuild.py [--stages 2,0] [--repeats 3]
    python benchmarks/deepspeed_rebuild.py --stages 2 --optimizer adam --params 100M

Real worker processes train ``benchmarks/rescale.py``'s MLP (~0.92M parameters, or
``--params N``, e.g. 100M; ``--optimizer``: ``sgd``, SGD with momentum 0.9, or ``adam``,
fused, a third more state per parameter - the native workers' model and optimizer, so
that both sides move the same state) with
``pollux_launch.adapters.deepspeed.initialize`` under the job environment pollux-run gives
them (``POLLUX_STORE``, ``POLLUX_JOB``...; embedded store, gloo on loopback). The driver
plays the coordinator: it writes the job's allocation and starts the workers. Per ZeRO
stage the job starts on ``--low`` workers and goes low -> high -> low (default 2 -> 4 -> 2,
the native adapter's cycle in ``benchmarks/rescale.py``) ``--repeats`` times; each newcomer
is started beforehand (prewarmed: DeepSpeed imported, registered with the rendezvous,
waiting in ``next_round``), the leaver exits 0.

Pause (as ``benchmarks/rescale.py`` defines it): on a survivor, from the step boundary
where the replicas' vote says the job has a new version to the completion of the first
collectives in the new group - here until the rebuilt engine has restored its state
(broadcast to the newcomer) and the batch decision was broadcast, i.e. the engine is
ready to train. Also reported: its parts (capture of the consolidated state on the old
group, rendezvous to the formed group, engine rebuild + restore) and the pause up to the
end of the first training step in the new group.

Failure (ZeRO-0, ``--failures`` times): at ``high`` workers the highest rank is
SIGKILLed; recovery is from the kill to the moment every survivor has re-formed the job
(rendezvous failure round, after the dead worker's lease runs out: 5 s by default) and
rebuilt its engine with rank 0's state. A survivor blocked in the failed gradient
all-reduce on *another survivor* (not on the dead worker) only leaves it at the gloo
timeout (``collective_timeout``, 60 s): the other survivor's connections stay open while
DeepSpeed references its group. ZeRO-1/2 cannot recover live: the dead replica's
optimizer partition is gone.

``measure(store_url, ...)`` is the entry point for ``benchmarks/rescale.py``. The LAST
line printed is one JSON object:
``{"deepspeed_down_pause_s": .., "deepspeed_up_pause_s": .., ...}`` (ZeRO-2 when measured,
else the first stage), with ``"failed": {"zero<stage>": why}`` for a stage that failed
(``"pids_kept"`` when a survivor lost its process). ``--smoke``: ZeRO-2, one 1 -> 2 -> 1
cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import Report, UsageError, run_benchmark  # beside this script
from worker_events import read_events  # benchmarks/worker_events.py, beside this script

JOB = "bench-deepspeed"  # + "-zero<stage>"


def emit(**fields: Any) -> None:
    print(json.dumps({"bench": 1, **fields}), flush=True)


# -- worker (a user-style DeepSpeed script) -------------------------------------------

def worker(stage: int) -> int:
    import torch

    from pollux_launch.adapters import deepspeed as pds

    torch.set_num_threads(1)
    pds.prewarm()  # DeepSpeed imported before the worker registers with the rendezvous
    emit(event="ready", pid=os.getpid())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rescale import build_mlp, build_optimizer  # the native workers' model, optimizer

    torch.manual_seed(0)
    params = int(os.environ.get("BENCH_PARAMS", "0")) or None
    model = build_mlp(torch, params)
    opt = build_optimizer(torch, model, os.environ.get("BENCH_OPTIMIZER", "sgd"))
    cfg = {"zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": True,  # torch SGD under ZeRO-1/2
           "pollux": {"enabled": True, "initial_batch_size": 32,
                      "micro_batch_size_range": [4, 32], "lr_scaling": "none"}}
    engine, _, _, _ = pds.initialize(model=model, optimizer=opt, config=cfg)
    job = engine.driver.job
    emit(event="round", pid=os.getpid(), rank=job.placement.rank, ws=job.placement.world_size,
         round=job.placement.round, newcomer=True)
    seen, step, last = len(engine.driver.rescales), 0, time.monotonic()
    g = torch.Generator().manual_seed(1)
    while True:  # until the allocation removes this worker (exit 0 inside engine.step())
        m = engine.train_micro_batch_size_per_gpu()
        x = torch.randn(m, 256, generator=g)
        engine.backward((engine(x) - x).pow(2).mean())
        engine.step()
        step += 1
        rescales = engine.driver.rescales
        if len(rescales) > seen:
            seen = len(rescales)
            timing = {k: v for k, v in rescales[-1].items() if k not in ("t0", "round")}
            emit(event="round", pid=os.getpid(), rank=job.placement.rank,
                 ws=job.placement.world_size, round=job.placement.round, **timing)
        elif step % 10 == 0 or time.monotonic() - last > 1.0:  # big models: slow steps
            last = time.monotonic()
            to_step = rescales[-1].get("pause_to_step_s") if rescales else None
            emit(event="step", step=step, round=job.placement.round,
                 **({"to_step": to_step} if to_step is not None else {}))


# -- driver -----------------------------------------------------------------------------

class _Job:
    """The driver's view: worker processes, their JSON events, the allocation."""

    def __init__(self, store_url: str, stage: int, optimizer: str = "sgd",
                 params: int | None = None) -> None:
        from pollux_launch.rendezvous.rounds import JobKeys
        from pollux_launch.rendezvous.store import open_store

        self.url, self.stage, self.optimizer = store_url, stage, optimizer
        self.params = params
        self.store = open_store(store_url)
        self.name = f"{JOB}-zero{stage}"
        self.keys = JobKeys(self.name)
        self.version = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: list[subprocess.Popen] = []
        self.events: queue.Queue[dict] = queue.Queue()
        self.backlog: list[dict] = []
        self.problems: list[str] = []
        self.next_id = 0
        self.log_dir = Path(tempfile.mkdtemp(prefix="ds-rescale-logs-"))

    def allocate(self, replicas: int) -> None:
        from pollux_launch.messages import Allocation, encode

        self.version += 1
        self.store.put(self.keys.allocation,
                       encode(Allocation(self.version, ("local",) * replicas, time.time())))

    def spawn(self) -> str:
        wid = f"ds{self.stage}-w{self.next_id}"
        self.next_id += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu",
               "BENCH_OPTIMIZER": self.optimizer, "BENCH_PARAMS": str(self.params or 0),
               "OMP_NUM_THREADS": "1", "POLLUX_STORE": self.url, "POLLUX_JOB": self.name,
               "POLLUX_NODE": "local", "POLLUX_WORKER_ID": wid, "POLLUX_ADDR": "127.0.0.1"}
        with open(self.log_dir / f"{wid}.log", "w") as err:
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(self.stage)],
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.procs[wid] = proc
        threading.Thread(target=self._read, args=(wid, proc), daemon=True).start()
        return wid

    def _read(self, wid: str, proc: subprocess.Popen) -> None:
        read_events(wid, proc, self.events, keep=lambda e: e.get("bench") == 1)

    def wait(self, count: int, timeout: float = 300.0, **match: Any) -> list[dict]:
        got, deadline = [], time.monotonic() + timeout

        def matches(e: dict) -> bool:
            return all(e.get(k) == v for k, v in match.items())

        for event in list(self.backlog):
            if len(got) < count and matches(event):
                got.append(event)
                self.backlog.remove(event)
        while len(got) < count:
            failed = {w: p.returncode for w, p in self.procs.items() if p.poll()}
            if failed:
                raise RuntimeError(f"worker(s) failed: {failed}; logs in {self.log_dir}")
            try:
                event = self.events.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                raise RuntimeError(f"timed out waiting for {count} x {match}; exit codes "
                                   f"{ {w: p.poll() for w, p in self.procs.items()} }; worker "
                                   f"logs in {self.log_dir}") from None
            if matches(event):
                got.append(event)
            elif event.get("event") != "step":
                self.backlog.append(event)
        return got

    def registered(self) -> int:
        return len(self.store.get_prefix(self.keys.workers))

    def round(self, ws: int, before: dict[str, dict] | None) -> dict[str, dict]:
        events = {e["worker"]: e for e in self.wait(ws, event="round", ws=ws)}
        for wid, e in events.items():
            if e["pid"] != self.procs[wid].pid or self.procs[wid].poll() is not None:
                self.problems.append(f"{wid} reported pid {e['pid']}")
        for wid in set(before or {}) & set(events):
            if events[wid]["pid"] != before[wid]["pid"]:
                self.problems.append(f"survivor {wid} changed its pid")
        return events

    def kill(self, wid: str) -> None:
        """SIGKILL a worker (it is then no longer expected to exit cleanly)."""
        proc = self.procs.pop(wid)
        proc.kill()
        proc.wait()
        self.killed.append(proc)

    def close(self) -> None:
        for proc in [*self.procs.values(), *self.killed]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.store.close()


def _grow(job: _Job, rnd: dict[str, dict], low: int, high: int) -> dict[str, dict]:
    """low -> high with prewarmed newcomers (registered, waiting in ``next_round``)."""
    for _ in range(high - low):
        job.wait(1, event="ready", worker=job.spawn())
    deadline = time.monotonic() + 120
    while job.registered() < high and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    job.wait(low, event="step")
    job.allocate(high)
    return job.round(high, rnd)


def measure(store_url: str, repeats: int = 3, stage: int = 2, progress: bool = True,
            high: int = 4, low: int = 2, optimizer: str = "sgd", failures: int = 0,
            params: int | None = None) -> dict[str, Any]:
    """Median pauses of DeepSpeed survivors over ``repeats`` low -> high -> low cycles (module
    docstring) on the store at ``store_url`` (e.g. ``embedded:///tmp/x/store.db``; the job
    is named ``bench-deepspeed-zero<stage>``). Returns ``{"deepspeed_down_pause_s",
    "deepspeed_up_pause_s", ...}``; raises RuntimeError if a worker fails or a phase times
    out."""
    from tqdm import tqdm

    if repeats < 1 or not 1 <= low < high:
        raise ValueError(f"need repeats >= 1 and 1 <= low < high, got {repeats}, {low}, {high}")
    if failures and stage != 0:
        raise ValueError("failure recovery needs ZeRO stage 0 (at 1/2 a partition is lost)")
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"optimizer must be sgd or adam, got {optimizer!r}")
    job = _Job(store_url, stage, optimizer, params)
    up: list[dict] = []
    down: list[dict] = []
    recovery: list[float] = []
    try:
        with tqdm(total=1 + 2 * repeats + failures, desc=f"deepspeed ZeRO-{stage} rescale",
                  unit="phase", file=sys.stderr, disable=not progress) as bar:
            job.allocate(low)
            for _ in range(low):
                job.spawn()
            rnd = job.round(low, None)
            job.wait(low, event="step")
            bar.update()
            for _ in range(repeats):
                grown = _grow(job, rnd, low, high)
                up += [grown[w] for w in rnd]
                job.wait(high, event="step")
                bar.update()
                job.allocate(low)
                rnd = job.round(low, grown)
                down += list(rnd.values())
                for leaver in (w for w in grown if w not in rnd):
                    code = job.procs[leaver].wait(timeout=120)
                    if code != 0:
                        job.problems.append(f"leaver {leaver} exited {code}")
                job.wait(low, event="step")
                bar.update()
            for _ in range(failures):
                rnd = _grow(job, rnd, low, high)
                victim = max(rnd, key=lambda w: rnd[w]["rank"])  # never rank 0
                job.wait(high, event="step")
                t_kill = time.time()
                job.kill(victim)
                survivors = job.round(high - 1, rnd)
                recovery.append(max(e["done_at"] for e in survivors.values()) - t_kill)
                job.allocate(low)
                rnd = job.round(low, survivors)
                for leaver in (w for w in survivors if w not in rnd):
                    if job.procs[leaver].wait(timeout=120) != 0:
                        job.problems.append(f"leaver {leaver} exited {job.procs[leaver].poll()}")
                job.wait(low, event="step")
                bar.update()
            job.allocate(0)  # the end: everyone leaves with exit 0
            for wid in rnd:
                if job.procs[wid].wait(timeout=120) != 0:
                    job.problems.append(f"{wid} exited {job.procs[wid].returncode}")
    finally:
        job.close()

    def med(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    out: dict[str, Any] = {
        "deepspeed_down_pause_s": med(down, "pause_s"),
        "deepspeed_up_pause_s": med(up, "pause_s"),
        "zero_stage": stage,
        "optimizer": optimizer,
        "params": params,
        "pids_kept": not job.problems,
        "repeats": repeats,
    }
    if recovery:
        out["deepspeed_failure_recovery_s"] = round(statistics.median(recovery), 4)
        out["failures"] = len(recovery)
    for name, rows in (("down", down), ("up", up)):
        out[f"deepspeed_{name}_pause_max_s"] = round(max(r["pause_s"] for r in rows), 4)
        out[f"deepspeed_{name}_capture_s"] = med(rows, "captured_s")
        out[f"deepspeed_{name}_rendezvous_s"] = round(statistics.median(
            r["formed_s"] - r["captured_s"] for r in rows), 4)
        out[f"deepspeed_{name}_rebuild_s"] = round(statistics.median(
            r["rebuilt_s"] - r["formed_s"] for r in rows), 4)
    for why in job.problems:
        print(f"pids_kept violated: {why}", file=sys.stderr)
    return out


def bench(opts: argparse.Namespace, report: Report) -> None:
    try:
        stages = [int(s) for s in opts.stages.split(",")]
    except ValueError:
        raise UsageError(f"--stages must be comma-separated integers, got {opts.stages!r}") \
            from None
    if opts.repeats < 1 or any(s not in (0, 1, 2) for s in stages):
        raise UsageError("--repeats must be >= 1 and --stages among 0, 1, 2")
    if not 1 <= opts.low < opts.high:
        raise UsageError("need 1 <= --low < --high")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rescale import parse_count

    try:
        params = parse_count(opts.params) if opts.params else None
    except argparse.ArgumentTypeError as exc:
        raise UsageError(str(exc)) from None
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ds-rescale-") as tmp:
        for stage in stages:
            url = opts.store or f"embedded://{Path(tmp)}/store{stage}.db"
            with report.case(f"zero{stage}"):
                results[stage] = measure(url, opts.repeats, stage, high=opts.high, low=opts.low,
                                         optimizer=opts.optimizer, params=params,
                                         failures=opts.failures if stage == 0 else 0)
                r = results[stage]
                print(f"ZeRO-{stage}: down {r['deepspeed_down_pause_s']:.3f} s, up "
                      f"{r['deepspeed_up_pause_s']:.3f} s (median over survivors and repeats)",
                      flush=True)
    if not results:
        return
    main_stage = 2 if 2 in results else min(results)
    report.update(results[main_stage])
    for stage, r in results.items():
        for key in ("deepspeed_down_pause_s", "deepspeed_up_pause_s"):
            report[f"zero{stage}_{key.removeprefix('deepspeed_')}"] = r[key]
    if 0 in results and "deepspeed_failure_recovery_s" in results[0]:
        report["zero0_failure_recovery_s"] = results[0]["deepspeed_failure_recovery_s"]
    report["pids_kept"] = all(r["pids_kept"] for r in results.values())
    report.check("pids_kept", report["pids_kept"], "a survivor did not keep its process "
                 "(see stderr)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,0", help="ZeRO stages, comma separated")
    parser.add_argument("--repeats", type=int, default=3, help="low->high->low cycles per stage")
    parser.add_argument("--failures", type=int, default=0,
                        help="SIGKILLs of a worker at ZeRO-0, recovered live (default 0)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                        help="sgd (momentum, like the native workers) or adam")
    parser.add_argument("--params", default=None, metavar="N",
                        help="model size, e.g. 1M, 10M, 100M (default: the ~0.92M MLP)")
    parser.add_argument("--low", type=int, default=2, help="workers before a grow (default 2)")
    parser.add_argument("--high", type=int, default=4, help="workers after a grow (default 4)")
    parser.add_argument("--store", default=None,
                        help="store URL (default: an embedded store in a temp dir)")
    parser.add_argument("--worker", type=int, metavar="STAGE", help=argparse.SUPPRESS)
    if "--worker" in sys.argv[1:]:  # a worker started by the driver: no report of its own
        return worker(parser.parse_args().worker)
    return run_benchmark(parser, bench, smoke={"stages": "2", "repeats": 1, "low": 1,
                                               "high": 2})


if __name__ == "__main__":
    sys.exit(main())
