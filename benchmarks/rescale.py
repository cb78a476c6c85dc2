"""Pause of the surviving workers per live rescale, and recovery from a SIGKILL.

    python benchmarks/rescale.py --store etcd        # starts its own etcd on loopback
    python benchmarks/rescale.py --store embedded    # SQLite file in a temp dir

Real worker processes train a ~1M-parameter MLP on gloo (loopback). The driver plays
the coordinator: it writes the job's allocation and starts/kills workers.

* down: 4 -> 2 (two workers leave with exit 0); up: 2 -> 4 with the two newcomers started
  beforehand (prewarmed: waiting in ``next_round``); both repeated ``--repeats`` times.
  Pause = from the step boundary where a survivor sees the new version (``should_rescale``
  True) to the completion of its first collective in the new group (the state broadcast
  when newcomers joined, else the first gradient all-reduce); ``*_to_step_s`` also report
  the pause up to the end of the first full training step.
* failure: SIGKILL one of 4 workers -> the end of the first training step of the 3-worker
  group (the driver's kill time to the last survivor's step), ``--failures`` times; a
  replacement worker then fills the vacancy (a "membership" round, same allocation).
* pids_kept: every survivor of every rescale kept its process (same PID, never exited),
  rank 0 was never replaced except by the failure of rank 0 itself, and every removed
  worker exited 0.

The worker side is chosen by ``--framework`` (``native``: torch.distributed through
``pollux_launch.rendezvous``; WORKERS). ``--framework horovod`` measures the same pauses
through Horovod Elastic (benchmarks/horovod_rescale.py ``measure()``: real horovodrun,
the same 4 -> 2 -> 4 cycles and model) right after the native run and prints both side
by side; its JSON keys are ``native_*`` and ``horovod_*``. Other frameworks join through
SIDES in the same style (e.g. ``deepspeed``: benchmarks/deepspeed_rebuild.py).
The LAST line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from local_etcd import LocalEtcd  # benchmarks/local_etcd.py, beside this script

JOB = "bench"


# ======================================================================================
# worker side
# ======================================================================================


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


class NativeWorker:
    """torch.distributed training through ``pollux_launch.rendezvous`` (in-place rescale)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from pollux_launch.rendezvous.process_group import InMemoryCommit
        from pollux_launch.rendezvous.protocol import Rendezvous, RendezvousConfig
        from pollux_launch.rendezvous.store import open_store

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.torch = torch
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 256),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.params = [p for p in self.model.parameters()]
        self.step = 0
        self.commit = InMemoryCommit(self.get_state, self.set_state)
        cfg = RendezvousConfig(
            lease_ttl=args.lease_ttl,
            join_timeout=120,
            collective_timeout=30,
            backend="gloo",
            addr="127.0.0.1",
        )
        self.rdzv = Rendezvous(
            open_store(args.store_url),
            JOB,
            args.worker_id,
            node="local",
            config=cfg,
            owns_store=True,
        )

    def get_state(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step}

    def set_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])

    def sync_state(self) -> None:
        from pollux_launch.rendezvous.process_group import broadcast_state

        self.set_state(broadcast_state(self.get_state()))

    def train_step(self, world_size: int) -> None:
        torch, dist = self.torch, self.torch.distributed
        g = torch.Generator().manual_seed(self.step)
        x = torch.randn(32, 256, generator=g)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat)  # one bucket: the whole gradient
        flat /= world_size
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n
        self.opt.step()
        self.step += 1

    def run(self) -> int:
        from pollux_launch.rendezvous.protocol import RendezvousError, WorkerRemoved

        emit(event="ready", pid=os.getpid())
        try:
            info, t0, failed = self.rdzv.next_round(), None, False
            t_formed = time.perf_counter()
            while True:
                if failed:
                    self.commit.restore()
                t_first = None
                if info.needs_state_sync:
                    self.sync_state()
                    t_first = time.perf_counter()
                try:
                    self.train_step(info.world_size)
                    t_step = time.perf_counter()
                    self.commit.commit()
                    emit(
                        event="round",
                        round=info.round,
                        rank=info.rank,
                        ws=info.world_size,
                        reason=info.reason,
                        pid=os.getpid(),
                        step_time=time.time(),
                        pause_s=None if t0 is None else (t_first or t_step) - t0,
                        pause_to_step_s=None if t0 is None else t_step - t0,
                        rdzv_s=None if t0 is None else t_formed - t0,
                    )
                    while not self.rdzv.should_rescale():
                        self.train_step(info.world_size)
                        self.commit.commit()
                        if self.step % 20 == 0:
                            emit(event="step", step=self.step, round=info.round)
                    t0, failed = time.perf_counter(), False
                except RuntimeError as exc:  # a peer died in a collective
                    emit(event="error", error=str(exc).splitlines()[0][:160])
                    t0, failed = None, True
                info = self.rdzv.next_round()
                t_formed = time.perf_counter()
        except WorkerRemoved:
            emit(event="removed", pid=os.getpid())
            return 0
        except RendezvousError as exc:
            print(f"worker {self.rdzv.worker}: {exc}", file=sys.stderr)
            return 2


WORKERS = {"native": NativeWorker}


# ======================================================================================
# driver side
# ======================================================================================


class Cluster:
    """The driver's view of the job: worker processes, their events, the allocation."""

    def __init__(self, args: argparse.Namespace, url: str) -> None:
        from pollux_launch.rendezvous.rounds import JobKeys
        from pollux_launch.rendezvous.store import open_store

        self.args, self.url = args, url
        self.store = open_store(url)
        self.keys = JobKeys(JOB)
        self.version = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.events: queue.Queue[dict] = queue.Queue()
        self.backlog: list[dict] = []  # events read but not yet asked for
        self.next_id = 0
        self.pids_kept = True
        self.problems: list[str] = []

    def allocate(self, replicas: int) -> None:
        from pollux_launch.messages import Allocation, encode

        self.version += 1
        alloc = Allocation(self.version, ("local",) * replicas, time.time())
        self.store.put(self.keys.allocation, encode(alloc))

    def spawn(self) -> str:
        wid = f"w{self.next_id}"
        self.next_id += 1
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--framework",
            self.args.framework,
            "--store-url",
            self.url,
            "--worker-id",
            wid,
            "--lease-ttl",
            str(self.args.lease_ttl),
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        self.procs[wid] = proc
        threading.Thread(target=self._read, args=(wid, proc), daemon=True).start()
        return wid

    def _read(self, wid: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            event["worker"] = wid
            self.events.put(event)

    def wait(self, count: int, timeout: float = 120.0, **match: object) -> list[dict]:
        """The first ``count`` events matching ``match``; others stay queued for later."""
        got, deadline = [], time.monotonic() + timeout

        def matches(e: dict) -> bool:
            return all(e.get(k) == v for k, v in match.items())

        for event in list(self.backlog):
            if len(got) < count and matches(event):
                got.append(event)
                self.backlog.remove(event)
        while len(got) < count:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(
                    f"error: timed out waiting for {count} x {match}; got "
                    f"{got}; exit codes {self.exit_codes()}"
                ) from None
            if matches(event):
                got.append(event)
            elif event.get("event") in ("ready", "round", "removed"):
                self.backlog.append(event)
        return got

    def exit_codes(self) -> dict[str, int | None]:
        return {w: p.poll() for w, p in self.procs.items()}

    def round(self, ws: int, before: dict[str, dict] | None, **match: object) -> dict[str, dict]:
        """Wait for a round of ``ws`` workers; check that survivors kept their process."""
        events = {e["worker"]: e for e in self.wait(ws, event="round", ws=ws, **match)}
        for wid, e in events.items():
            if e["pid"] != self.procs[wid].pid or self.procs[wid].poll() is not None:
                self._bad(f"{wid} reported pid {e['pid']} (started as {self.procs[wid].pid})")
        if before:
            for wid in set(before) & set(events):
                if events[wid]["pid"] != before[wid]["pid"]:
                    self._bad(f"survivor {wid} changed its pid")
            old0 = min(before, key=lambda w: before[w]["rank"])
            if old0 in events and events[old0]["rank"] != 0:
                self._bad(f"rank 0 ({old0}) survived but was given rank {events[old0]['rank']}")
        return events

    def removed(self, wids: list[str]) -> None:
        for wid in wids:
            code = self.procs[wid].wait(timeout=60)
            if code != 0:
                self._bad(f"removed worker {wid} exited {code}")

    def _bad(self, why: str) -> None:
        self.pids_kept = False
        self.problems.append(why)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.store.close()


def by_rank(events: dict[str, dict]) -> list[str]:
    return sorted(events, key=lambda w: events[w]["rank"])


def run(args: argparse.Namespace, url: str) -> dict:
    from tqdm import tqdm

    c = Cluster(args, url)
    down, up, down_step, up_step, recovery = [], [], [], [], []
    rdzv_down: list[float] = []
    rdzv_up: list[float] = []
    total = 1 + 2 * args.repeats + args.failures
    try:
        with tqdm(
            total=total, desc=f"rescale ({args.store})", unit="phase", file=sys.stderr
        ) as bar:
            c.allocate(4)
            for _ in range(4):
                c.spawn()
            rnd = c.round(4, None)
            c.wait(4, event="step")
            bar.update()
            for _ in range(args.repeats):
                ranks = by_rank(rnd)
                c.allocate(2)  # 4 -> 2: ranks 2 and 3 leave
                new = c.round(2, rnd)
                c.removed(ranks[2:])
                down += [e["pause_s"] for e in new.values()]
                rdzv_down += [e["rdzv_s"] for e in new.values()]
                down_step += [e["pause_to_step_s"] for e in new.values()]
                bar.update()
                for wid in (c.spawn(), c.spawn()):  # prewarm the newcomers
                    c.wait(1, event="ready", worker=wid)
                time.sleep(0.5)  # let them settle inside next_round
                c.wait(2, event="step")
                c.allocate(4)  # 2 -> 4
                rnd = c.round(4, new)
                up += [rnd[w]["pause_s"] for w in new]
                rdzv_up += [rnd[w]["rdzv_s"] for w in new]
                up_step += [rnd[w]["pause_to_step_s"] for w in new]
                c.wait(4, event="step")
                bar.update()
            for i in range(args.failures):
                ranks = by_rank(rnd)
                victim = ranks[[3, 0, 1, 2][i % 4]]
                c.wait(4, event="step")
                t_kill = time.time()
                c.procs[victim].send_signal(signal.SIGKILL)
                c.procs[victim].wait()
                new = c.round(3, None, reason="failure")
                if victim != ranks[0] and new[ranks[0]]["rank"] != 0:
                    c._bad("rank 0 survived a failure but lost rank 0")
                recovery.append(max(e["step_time"] for e in new.values()) - t_kill)
                # a replacement fills the vacancy (a "membership" round, same allocation)
                c.wait(1, event="ready", worker=c.spawn())
                rnd = c.round(4, new, reason="membership")
                bar.update()
    finally:
        c.close()
    for why in c.problems:
        print(f"pids_kept violated: {why}", file=sys.stderr)
    med = statistics.median
    return {
        "store": args.store,
        "down_pause_s": round(med(down), 4) if down else None,
        "up_pause_s": round(med(up), 4) if up else None,
        "failure_recovery_s": round(med(recovery), 4) if recovery else None,
        "pids_kept": c.pids_kept,
        "down_pause_to_step_s": round(med(down_step), 4) if down_step else None,
        "up_pause_to_step_s": round(med(up_step), 4) if up_step else None,
        "down_rendezvous_s": round(med(rdzv_down), 4) if rdzv_down else None,
        "up_rendezvous_s": round(med(rdzv_up), 4) if rdzv_up else None,
        "down_pause_max_s": round(max(down), 4) if down else None,
        "up_pause_max_s": round(max(up), 4) if up else None,
        "failure_recovery_max_s": round(max(recovery), 4) if recovery else None,
        "lease_ttl_s": args.lease_ttl,
        "repeats": args.repeats,
        "failures": args.failures,
        "framework": args.framework,
    }


# ======================================================================================
# other frameworks, measured next to the native path in the same run
# ======================================================================================


def _horovod_side(args: argparse.Namespace, url: str) -> dict:
    """Horovod Elastic's pauses (its own horovodrun and embedded store; ``url`` unused)."""
    from pollux_launch.adapters.horovod import horovod_available
    from pollux_launch.adapters.horovod.command import HOROVOD_INSTALL_HINT

    if not horovod_available():
        sys.exit(f"error: {HOROVOD_INSTALL_HINT}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from horovod_rescale import measure

    return measure(repeats=args.repeats, high=4, low=2)


def _deepspeed_side(args: argparse.Namespace, url: str) -> dict:
    """DeepSpeed engines (ZeRO-2) rebuilt live through the same rendezvous and store
    (benchmarks/deepspeed_rebuild.py: the same 4 -> 2 -> 4 cycles, ~1M-parameter model and
    SGD-with-momentum optimizer, so both sides move the same state)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from deepspeed_rebuild import measure

    return measure(url, repeats=args.repeats, stage=2, high=4, low=2)


# framework -> f(args, native store URL) returning {"<framework>_down_pause_s",
# "<framework>_up_pause_s", ...}
SIDES: dict[str, Callable[[argparse.Namespace, str], dict]] = {
    "horovod": _horovod_side, "deepspeed": _deepspeed_side}


def side_by_side(native: dict, framework: str, other: dict) -> str:
    """A small table of the median pauses (seconds)."""
    rows = [("native (" + native["store"] + ")", native["down_pause_s"], native["up_pause_s"]),
            (framework, other.get(f"{framework}_down_pause_s"),
             other.get(f"{framework}_up_pause_s"))]
    lines = [f"{'pause per rescale, median s':<30}{'down 4->2':>11}{'up 2->4':>10}"]
    for name, down, up in rows:
        cells = ["-" if v is None else f"{v:.3f}" for v in (down, up)]
        lines.append(f"{name:<30}{cells[0]:>11}{cells[1]:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", choices=["etcd", "embedded"], default="embedded")
    p.add_argument("--framework", choices=sorted({*WORKERS, *SIDES}), default="native",
                   help="native alone, or another framework measured next to it")
    p.add_argument("--repeats", type=int, default=5, help="4->2->4 cycles (default 5)")
    p.add_argument("--failures", type=int, default=3, help="SIGKILL trials (default 3)")
    p.add_argument(
        "--lease-ttl", type=float, default=2.0, help="worker lease TTL in seconds (default 2)"
    )
    # worker mode (started by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store-url", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if os.environ.get("POLLUX_LOG_LEVEL"):
            import logging

            logging.basicConfig(
                level=os.environ["POLLUX_LOG_LEVEL"].upper(),
                stream=sys.stderr,
                format=f"%(relativeCreated)d {args.worker_id} %(message)s",
            )
        return WORKERS[args.framework](args).run()
    if args.repeats < 1 or args.failures < 0 or not args.lease_ttl > 0:
        p.error("--repeats must be >= 1, --failures >= 0 and --lease-ttl > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up workers and etcd
    side = SIDES.get(args.framework)
    native_args = argparse.Namespace(**{**vars(args), "framework": "native"})
    with tempfile.TemporaryDirectory(prefix="pollux-rescale-") as tmp:
        etcd = LocalEtcd(Path(tmp)) if args.store == "etcd" else None
        url = etcd.url if etcd else f"embedded://{tmp}/store.db"
        try:
            result = run(native_args if side else args, url)
        finally:
            if etcd:
                etcd.stop()
        if side is not None:
            try:
                if etcd:  # the native run stopped its etcd: the other side gets its own
                    (Path(tmp) / "side").mkdir()
                    etcd = LocalEtcd(Path(tmp) / "side")
                    url = etcd.url
                other = side(args, url)
            except (RuntimeError, ValueError) as exc:
                print(f"rescale: {args.framework}: {exc}", file=sys.stderr)
                return 1
            finally:
                if etcd:
                    etcd.stop()
            print(side_by_side(result, args.framework, other), flush=True)
            result = {**other, **{f"native_{k}": v for k, v in result.items()
                                  if k not in ("framework", "repeats", "store")},
                      "store": result["store"], "repeats": args.repeats,
                      "framework": args.framework}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
