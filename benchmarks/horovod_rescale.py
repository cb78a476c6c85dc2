"""Pause of the surviving workers per Horovod Elastic reset (the ``horovod`` side of
benchmarks/rescale.py).

    python benchmarks/horovod_rescale.py [--repeats 3] [--high 4] [--low 2] [--plain] [--cold]

Real ``horovodrun --gloo`` (elastic, ``--network-interface lo``) runs workers training
the same ~1M-parameter MLP as the native benchmark (batch 32, SGD with momentum). The
driver plays the coordinator: it rewrites the job's allocation in a real embedded store;
a :class:`HostsFileMirror` turns it into the hosts file that Horovod's discovery script
(``cat``) reports. Cycles ``high -> low -> high``, ``--repeats`` times. As pollux-run's
local mode does (adapters/horovod/launch/driver.py), newcomers are pre-started
(adapters/horovod/launch/warm.py): horovodrun runs each worker through the hand-off shim, the
first grow starts the job's warm zygote (torch and horovod imported), and the mirror
reports the grown hosts only once it is ready, so a newcomer is a fork that runs the
script from its first line with its imports done; horovodrun runs from its entry point
with the import guarded (``write_horovodrun_script``: its per-worker spawned middleman
then starts in ~0.15 s instead of 0.4-1 s). ``--cold`` measures without either (every
newcomer a fresh Python, started by the ``horovodrun`` console script, as before).

Pause, per survivor and reset, with the native benchmark's definition: from the step
boundary where the survivor learns of the change (Horovod raises ``HostsUpdatedInterrupt``
in ``state.check_host_updates()``, called every step) to the completion of its first
collective in the new group - the state broadcast (``state.sync()``) when workers were
added, else the first gradient all-reduce. ``*_to_step_s`` runs to the end of the first
full step; ``*_from_allocation_s`` from the driver's store write to that end (adds the
driver's ~1 s discovery polling, and on the first grow the zygote's start-up, during
which the survivors train on). Horovod's driver launches newcomers only once the
survivors have reset, so an up-scale's pause is the newcomers' start-up: with the warm
zygote, Horovod's own launch (its middleman process, the shim, a fork) plus the script
up to its state sync; cold, Python importing torch as well (seconds).

``horovod_up_newcomer_*_s`` give when (after the allocation write) the newcomers' script
began and their ``hvd.init()`` returned, ``*_reset_s`` when the survivors' Horovod reset
(``shutdown(); init()``) ended; ``horovod_up_warm_newcomers`` the share of newcomers
that found torch already imported (1.0 with the zygote, 0.0 with ``--cold``).

``--plain`` uses ``hvd.DistributedOptimizer`` instead of pollux_launch's drop-in.
:func:`measure` is the function benchmarks/rescale.py calls; the LAST line printed is one
JSON object with ``horovod_down_pause_s`` and ``horovod_up_pause_s`` (medians), and
``"failed"`` naming what failed (``discovery``, ``horovod``). ``--smoke``: one 2 -> 1 -> 2
cycle, 2 discovery calls per path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness import Report, UsageError, run_benchmark  # beside this script

JOB = "bench-horovod"


# ======================================================================================
# worker side (run by horovodrun)
# ======================================================================================


def worker(log_dir: Path, stop_file: Path, plain: bool) -> None:
    t_boot = time.time()  # the script runs; torch and horovod imported only if warm
    warm = "torch" in sys.modules  # forked by the warm zygote
    import horovod.torch as hvd
    import torch
    from horovod.common.exceptions import HostsUpdatedInterrupt

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    f = open(log_dir / f"w-{os.getpid()}.jsonl", "a", buffering=1)

    def log(event: str, **fields: object) -> None:
        f.write(
            json.dumps(
                {
                    "event": event,
                    "pid": os.getpid(),
                    "rank": hvd.rank(),
                    "size": hvd.size(),
                    "t": time.time(),
                    **fields,
                }
            )
            + "\n"
        )

    log("init", t_boot=t_boot, warm=warm)

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 256),
    )
    base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if plain:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        from pollux_launch.adapters.horovod import DistributedOptimizer

        opt = DistributedOptimizer(base, named_parameters=model.named_parameters(), local_bsz=32)
    state = hvd.elastic.TorchState(model, opt, step=0)
    state.register_reset_callbacks([lambda: log("reset")])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        log("enter", step=state.step)  # after reset + state.sync(): in the new group
        first = True
        while True:
            g = torch.Generator().manual_seed(state.step)
            x = torch.randn(32, 256, generator=g)
            opt.zero_grad()
            (model(x) - x).pow(2).mean().backward()
            opt.synchronize()
            t_sync = time.time()
            with opt.skip_synchronize():
                opt.step()
            state.step += 1
            if first:
                log("first_step", t_sync=t_sync, step=state.step)
                first = False
            if state.step % 20 == 0:
                stop = torch.tensor([float(hvd.rank() == 0 and stop_file.exists())])
                if hvd.allreduce(stop, op=hvd.Sum, name="stop")[0] > 0:
                    return
                log("step", step=state.step)
            if state.step % 100 == 0:
                state.commit()
            try:
                state.check_host_updates()
            except HostsUpdatedInterrupt:
                log("interrupt", step=state.step)
                raise

    train(state)
    log("done")


# ======================================================================================
# driver side
# ======================================================================================


def _records(log_dir: Path) -> list[dict]:
    out = []
    for path in log_dir.glob("w-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line still being written: it is read again next time
                pass
    return sorted(out, key=lambda r: r["t"])


def _wait(
    proc: subprocess.Popen, log_dir: Path, size: int, after: float, timeout: float = 180.0
) -> list[dict]:
    """Wait until ``size`` ranks logged a step at world size ``size`` after time ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"horovodrun exited with {proc.returncode}")
        recs = _records(log_dir)
        ranks = {
            r["rank"] for r in recs if r["event"] == "step" and r["size"] == size and r["t"] > after
        }
        if len(ranks) == size:
            return recs
        time.sleep(0.2)
    raise RuntimeError(f"no training at {size} workers within {timeout} s")


def _newcomers(recs: list[dict], t_alloc: float) -> list[tuple[float, float, float]]:
    """(script started, Horovod initialised, warm) after the allocation write, per
    newcomer."""
    return [(r["t_boot"] - t_alloc, r["t"] - t_alloc, float(r["warm"]))
            for r in recs if r["event"] == "init" and r["t_boot"] > t_alloc]


def _pauses(recs: list[dict], t_alloc: float, up: bool) -> list[tuple[float, ...]]:
    """(pause, pause to first step, allocation write to first step, interrupt to the end
    of Horovod's reset) per survivor."""
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for r in recs:
        by_pid[r["pid"]].append(r)
    out = []
    for events in by_pid.values():
        interrupts = [r for r in events if r["event"] == "interrupt" and r["t"] > t_alloc]
        if not interrupts:
            continue  # a newcomer, or a worker that was removed
        t0 = interrupts[0]["t"]
        after = [r for r in events if r["t"] > t0]
        enter = next((r for r in after if r["event"] == "enter"), None)
        first = next((r for r in after if r["event"] == "first_step"), None)
        reset = next((r for r in after if r["event"] == "reset"), None)
        if enter is None or first is None or reset is None:
            continue  # removed by this reset
        t_collective = enter["t"] if up else first["t_sync"]
        out.append((t_collective - t0, first["t"] - t0, first["t"] - t_alloc,
                    reset["t"] - t0))
    return out


def discovery_cost(runs: int = 10) -> dict:
    """Median seconds per call of the two discovery paths Horovod's driver could poll:
    ``cat`` of a mirrored hosts file, and the Python entry point reading the store."""
    from pollux_launch import keys
    from pollux_launch.adapters.horovod.launch.hosts import write_discovery_script, write_hosts_file
    from pollux_launch.messages import Allocation, encode
    from pollux_launch.rendezvous.store import open_store

    with tempfile.TemporaryDirectory(prefix="pollux-hvd-discover-") as tmp_name:
        tmp = Path(tmp_name)
        url = f"embedded://{tmp / 'store.db'}"
        with open_store(url) as store:
            store.put(keys.job(JOB, "allocation"), encode(Allocation(1, ("localhost",) * 4)))
        write_hosts_file(tmp / "hosts", "localhost:4\n")
        script = write_discovery_script(tmp / "discover.sh", tmp / "hosts")
        cmds = {
            "discovery_cat_s": [str(script)],
            "discovery_python_s": [sys.executable, "-m",
                                   "pollux_launch.adapters.horovod.launch.discover",
                                   "--store", url, "--job", JOB],
        }
        out = {}
        for name, cmd in cmds.items():
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                times.append(time.perf_counter() - t0)
                assert res.stdout == "localhost:4\n", res.stdout
            out[name] = round(statistics.median(times), 4)
        return out


def measure(
    repeats: int = 3, high: int = 4, low: int = 2, plain: bool = False, progress: bool = True,
    warm: bool = True,
) -> dict:
    """Run ``high -> low -> high`` ``repeats`` times under horovodrun; medians in seconds.
    ``warm``: pre-started newcomers, as pollux-run's local mode (else cold ones)."""
    from tqdm import tqdm

    from pollux_launch import keys
    from pollux_launch.adapters.horovod.launch.command import (
        horovodrun_command,
        write_horovodrun_script,
    )
    from pollux_launch.adapters.horovod.launch.hosts import HostsFileMirror, write_discovery_script
    from pollux_launch.adapters.horovod.launch.warm import WarmStart
    from pollux_launch.messages import Allocation, encode
    from pollux_launch.rendezvous.store import open_store

    if not 1 <= low < high:
        raise ValueError(f"need 1 <= low < high, got low={low}, high={high}")
    down: list[tuple[float, ...]] = []
    up: list[tuple[float, ...]] = []
    newcomers: list[tuple[float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="pollux-hvd-rescale-") as tmp_name:
        tmp = Path(tmp_name)
        log_dir, stop, hosts = tmp / "logs", tmp / "stop", tmp / "hosts"
        log_dir.mkdir()
        store = open_store(f"embedded://{tmp / 'store.db'}")
        key = keys.job(JOB, "allocation")
        version = 1
        store.put(key, encode(Allocation(version, ("localhost",) * high)))
        script = write_discovery_script(tmp / "discover.sh", hosts)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--log-dir",
            str(log_dir),
            "--stop-file",
            str(stop),
            *(["--plain"] if plain else []),
        ]
        starter = WarmStart(JOB, cmd, {}) if warm else None
        argv = horovodrun_command(
            starter.command() if starter else cmd, discovery_script=str(script), np=high,
            min_np=1, max_np=high,
            horovodrun=write_horovodrun_script(tmp / "horovodrun") if warm else None)
        env = {**os.environ, **(starter.environment() if starter else {})}
        out = open(tmp / "horovodrun.out", "w")
        gate = starter.ready if starter else None
        with HostsFileMirror(store, JOB, hosts, newcomers_ready=gate):
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            try:
                with tqdm(
                    total=1 + 2 * repeats,
                    desc="horovod rescale",
                    unit="phase",
                    file=sys.stderr,
                    disable=not progress,
                ) as bar:
                    _wait(proc, log_dir, high, 0.0)
                    bar.update()
                    for _ in range(repeats):
                        for size, sink in ((low, down), (high, up)):
                            version += 1
                            t_alloc = time.time()
                            store.put(key, encode(Allocation(version, ("localhost",) * size)))
                            recs = _wait(proc, log_dir, size, t_alloc)
                            sink += _pauses(recs, t_alloc, up=sink is up)
                            if sink is up:
                                newcomers += _newcomers(recs, t_alloc)
                            bar.update()
                stop.touch()
                rc = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if starter is not None:
                    starter.stop()
                out.close()
                store.close()
        if rc != 0:
            tail = (tmp / "horovodrun.out").read_text()[-2000:]
            raise RuntimeError(f"horovodrun exited with {rc}:\n{tail}")

    def med(rows: list[tuple[float, ...]], i: int) -> float | None:
        return round(statistics.median(r[i] for r in rows), 4) if rows else None

    return {
        "horovod_down_pause_s": med(down, 0),
        "horovod_up_pause_s": med(up, 0),
        "horovod_down_pause_to_step_s": med(down, 1),
        "horovod_up_pause_to_step_s": med(up, 1),
        "horovod_down_from_allocation_s": med(down, 2),
        "horovod_up_from_allocation_s": med(up, 2),
        "horovod_down_reset_s": med(down, 3),
        "horovod_up_reset_s": med(up, 3),
        "horovod_up_newcomer_started_s": med(newcomers, 0),
        "horovod_up_newcomer_initialised_s": med(newcomers, 1),
        "horovod_up_warm_newcomers": (round(statistics.mean(r[2] for r in newcomers), 2)
                                      if newcomers else None),
        "horovod_down_pause_max_s": round(max(r[0] for r in down), 4) if down else None,
        "horovod_up_pause_max_s": round(max(r[0] for r in up), 4) if up else None,
        "horovod_samples": [len(down), len(up)],
        "horovod_sizes": [high, low],
        "horovod_optimizer": "hvd" if plain else "pollux",
        "horovod_newcomers": "warm" if warm else "cold",
        "repeats": repeats,
    }


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    with report.case("discovery"):
        report.update(discovery_cost(args.discovery_runs))
    with report.case("horovod"):
        report.update(measure(args.repeats, args.high, args.low, args.plain,
                              warm=not args.cold))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="high->low->high cycles")
    p.add_argument("--high", type=int, default=4)
    p.add_argument("--low", type=int, default=2)
    p.add_argument("--plain", action="store_true", help="hvd.DistributedOptimizer itself")
    p.add_argument("--cold", action="store_true",
                   help="no pre-started newcomers (each a fresh Python, as horovodrun's)")
    p.add_argument("--discovery-runs", type=int, default=10,
                   help="timed calls of each discovery path")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--stop-file", type=Path, help=argparse.SUPPRESS)
    if "--worker" in (sys.argv[1:] if argv is None else argv):  # run by horovodrun
        args = p.parse_args(argv)
        worker(args.log_dir, args.stop_file, args.plain)
        return 0
    return run_benchmark(p, bench, argv=argv, smoke={"repeats": 1, "high": 2, "low": 1,
                                                     "discovery_runs": 2})


if __name__ == "__main__":
    sys.exit(main())
