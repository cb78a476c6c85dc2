"""Restart-elastic jobs: from a change to the first step of the restarted group,
pollux-run side by side with torchrun's own restart of the same script.

    python benchmarks/restart_elastic.py [--repeats 3]

The script (``restart_worker.py`` of tests/e2e: env:// gloo group, DDP, its own
snapshot, no pollux API) logs every step with a wall-clock time. Measured, each
``--repeats`` times, interleaved:

* ``restart_s`` (pollux-run, local mode, 2 slots): a 1..2-replica restart-elastic job
  runs on both slots; a second job (``-np 1``) arrives, so the coordinator writes a new
  allocation (1 replica): from that allocation's timestamp to the first step of the
  restarted group. ``grow_s``: the second job ends, the allocation goes back to 2: from
  that allocation to the first step at 2 replicas.
* ``torchrun_restart_s``: torchrun's own restart of the same script: SIGKILL of one of
  its two workers (``torchrun --standalone --nproc-per-node 2 --max-restarts 1``) to the
  first step of the restarted group; ``pollux_failure_restart_s``: the same under
  ``pollux-run --nproc-per-node 2 --max-restarts 1``. (torchrun's other restart, on a
  new membership, needs a second agent on another host: two ``torchrun --nnodes 1:2``
  agents on one machine deadlock in its c10d rendezvous in torch 2.13 - the second waits
  for ``MASTER_ADDR``, the first for the second's ``role_info`` - so it is not measured.)

A launcher whose restart fails (torchrun's often does here, see ``failure_restart_tries``)
is tried again, up to ``--tries`` (3) times a sample; its failures are counted
(``failed_restarts``).

The LAST line printed is one JSON object:
``{"restart_s": x, "torchrun_restart_s": y, "grow_s": ..., "pollux_failure_restart_s": ...}``
(medians, seconds), with ``"failed": {case: why}`` for a case that failed (``allocation``,
``torchrun``, ``pollux-run``; a failed restart of pollux-run's is one, torchrun's are only
counted). ``--smoke``: one repeat, one try.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Report, run_benchmark  # beside this script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "e2e" / "restart_worker.py"
BIN = Path(sys.executable).parent
POLLUX_RUN, TORCHRUN = str(BIN / "pollux-run"), str(BIN / "torchrun")


class Run:
    """One launch of the script in its own folder (snapshot, stop file, step logs)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"restart-bench-{name}-"))
        (self.dir / "logs").mkdir()
        self.out = open(self.dir / "out.log", "w")
        env = {**os.environ, "LOG_DIR": str(self.dir / "logs"), "OMP_NUM_THREADS": "1"}
        self.args = ["--snapshot", str(self.dir / "snap.pt"), "--stop-file",
                     str(self.dir / "stop"), "--step-delay", "0.05"]
        self.procs = [subprocess.Popen(argv + self.args, cwd=self.dir, env=env,
                                       stdout=self.out, stderr=subprocess.STDOUT,
                                       start_new_session=True)]
        self.env = env

    def steps(self) -> list[dict]:
        out = []
        for f in (self.dir / "logs").glob("*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line being written
        return sorted(out, key=lambda s: s["t"])

    def first_step(self, after: float, world: int, timeout: float = 120.0) -> float:
        """Time of the first step at ``world`` replicas after ``after``."""
        end = time.time() + timeout
        while time.time() < end:
            for s in self.steps():
                if s["t"] > after and s["world"] == world:
                    return s["t"]
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"launcher ended ({proc.returncode}): "
                                       + (self.dir / "out.log").read_text()[-2000:])
            time.sleep(0.05)
        raise TimeoutError(f"no step at world {world}: "
                           + (self.dir / "out.log").read_text()[-2000:])

    def worker_pids(self, world: int) -> list[int]:
        latest: dict[int, int] = {}
        for s in self.steps():
            if s["world"] == world:
                latest[s["rank"]] = s["pid"]
        return list(latest.values())

    def close(self) -> None:
        (self.dir / "stop").touch()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.out.close()


def progress(text: str) -> None:
    print(f"[restart_elastic] {text}", flush=True)


def pollux_allocation_restarts() -> tuple[float, float]:
    """(shrink, grow): from the new allocation's timestamp to the first step after it."""
    from pollux_launch import keys
    from pollux_launch.messages import Allocation, decode
    from pollux_launch.rendezvous.store import open_store

    store_dir = Path(tempfile.mkdtemp(prefix="restart-bench-store-"))
    url = f"embedded://{store_dir}/store.db"
    common = ["--store", url, "-H", "localhost:2", "--interval", "2"]
    run = Run("pollux", [POLLUX_RUN, *common, "--job-name", "long", "-np", "1", "--max-np",
                         "2", sys.executable, str(SCRIPT)])
    store = open_store(url)
    try:
        run.first_step(0, 2)
        while not (run.dir / "snap.pt").exists():
            time.sleep(0.05)
        short = subprocess.Popen([POLLUX_RUN, *common, "--job-name", "short", "-np", "1",
                                  sys.executable, "-c", "import time; time.sleep(8)"],
                                 cwd=store_dir, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        alloc = _wait_allocation(store, keys.job("long", "allocation"), 1, Allocation, decode)
        shrink = run.first_step(alloc.timestamp, 1) - alloc.timestamp
        short.wait(timeout=120)
        alloc = _wait_allocation(store, keys.job("long", "allocation"), 2, Allocation, decode)
        grow = run.first_step(alloc.timestamp, 2) - alloc.timestamp
        return shrink, grow
    finally:
        run.close()
        store.close()


def _wait_allocation(store, key, replicas, cls, decode, timeout=120.0):
    end = time.time() + timeout
    while time.time() < end:
        kv = store.get(key)
        if kv is not None:
            alloc = decode(cls, kv.value)
            if alloc.num_replicas == replicas:
                return alloc
        time.sleep(0.02)
    raise TimeoutError(f"no allocation of {replicas}")


class RestartFailed(RuntimeError):
    """The launcher's restart itself failed: it ended, or no step came after it in time."""


def failure_restart(launcher: str, timeout: float) -> float:
    """SIGKILL one of two workers -> the first step of the restarted group (within
    ``timeout`` seconds, else ``RestartFailed``)."""
    if launcher == "pollux-run":
        store = tempfile.mkdtemp(prefix="restart-bench-store-")
        argv = [POLLUX_RUN, "--store", f"embedded://{store}/store.db", "--nproc-per-node",
                "2", "--max-restarts", "1", str(SCRIPT)]
    else:
        argv = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                str(SCRIPT)]
    run = Run(launcher, argv)
    try:
        run.first_step(0, 2)
        while not (run.dir / "snap.pt").exists():
            time.sleep(0.05)
        victim = max(run.worker_pids(2))
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        try:
            return run.first_step(t_kill, 2, timeout) - t_kill
        except (RuntimeError, TimeoutError) as exc:
            raise RestartFailed(str(exc)) from None
    finally:
        run.close()


def failure_restart_tries(launcher: str, failed: dict[str, int], timeout: float,
                          tries: int = 3) -> float:
    """``failure_restart``, tried again when the launcher's restart itself failed (torchrun
    in torch 2.13 with gloo often does: its restarted workers read the previous attempt's
    gloo addresses from its agent store, and end or hang); every failure is counted in
    ``failed``."""
    for attempt in range(tries):
        try:
            return failure_restart(launcher, timeout)
        except RestartFailed as exc:
            failed[launcher] = failed.get(launcher, 0) + 1
            progress(f"{launcher}: restart try {attempt + 1} failed: "
                     f"{str(exc).splitlines()[0][:120]}")
    raise RestartFailed(f"{launcher}: {tries} restarts failed in a row")


def bench(args: argparse.Namespace, report: Report) -> None:
    got: dict[str, list[float]] = {k: [] for k in (
        "restart_s", "grow_s", "torchrun_restart_s", "pollux_failure_restart_s")}
    failed: dict[str, int] = {"torchrun": 0, "pollux-run": 0}  # restarts that failed
    for i in range(args.repeats):
        with report.case("allocation"):
            shrink, grow = pollux_allocation_restarts()
            got["restart_s"].append(shrink)
            got["grow_s"].append(grow)
        for launcher, key in (("torchrun", "torchrun_restart_s"),
                              ("pollux-run", "pollux_failure_restart_s")):
            with report.case(launcher):
                try:
                    got[key].append(failure_restart_tries(launcher, failed,
                                                          args.restart_timeout, args.tries))
                except RestartFailed as exc:
                    if launcher != "torchrun":
                        raise
                    # the baseline's own bug (above): a figure, not the benchmark failing
                    progress(f"{exc}: no torchrun sample this repeat")
        progress(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v[-1]:.2f}" for k, v in got.items() if v))
    report.check("pollux-run", not failed["pollux-run"],
                 f"{failed['pollux-run']} pollux-run restarts failed (see stdout)")
    med = {k: round(statistics.median(v), 3) if v else None for k, v in got.items()}
    report.update({
        "restart_s": med["restart_s"], "torchrun_restart_s": med["torchrun_restart_s"],
        "grow_s": med["grow_s"], "pollux_failure_restart_s": med["pollux_failure_restart_s"],
        "ratio_vs_torchrun": (round(med["restart_s"] / med["torchrun_restart_s"], 3)
                              if med["restart_s"] and med["torchrun_restart_s"] else None),
        "failed_restarts": failed, "repeats": args.repeats,
        "samples": {k: [round(x, 3) for x in v] for k, v in got.items()},
    })


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--restart-timeout", type=float, default=120.0,
                   help="seconds from a worker's kill to the restarted group's first step, "
                        "else that restart failed")
    p.add_argument("--tries", type=int, default=3,
                   help="launches per sample while the launcher's restart fails")
    return run_benchmark(p, bench, smoke={"repeats": 1, "restart_timeout": 30.0, "tries": 1})


if __name__ == "__main__":
    sys.exit(main())
