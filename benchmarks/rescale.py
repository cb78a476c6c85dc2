"""Pause of the surviving workers per live rescale, and recovery from a SIGKILL.

    python benchmarks/rescale.py --store etcd        # starts its own etcd on loopback
    python benchmarks/rescale.py --store embedded    # SQLite file in a temp dir
    python benchmarks/rescale.py --params 100M --repeats 2 --failures 0   # Adam, 1.2 GB
    python benchmarks/rescale.py --params 10M --write-calibration FILE

Real worker processes train an MLP on gloo (loopback): by default ~0.92M parameters with
SGD (momentum); ``--params N`` (e.g. 1M, 10M, 100M) sizes it (256-H-H-256) and takes
Adam (``--optimizer``), so the state is ~3 x 4 bytes x N. The driver plays the
coordinator: it writes the job's allocation and starts/kills workers.

* down: 4 -> 2 (two workers leave with exit 0); up: 2 -> 4 with the two newcomers started
  beforehand (prewarmed: waiting in ``next_round``); both repeated ``--repeats`` times.
  Pause = from the step boundary where a survivor sees the new version (``should_rescale``
  True) to the completion of the new group's first collective, as the elastic
  controller's: rank 0's decision broadcast, after the state transfer when newcomers
  joined (survivors send, newcomers receive and load: ``sync_state``); ``*_to_step_s``
  also report the pause up to the end of the first full training step.
* failure: SIGKILL one of 4 workers -> the end of the first training step of the 3-worker
  group (the driver's kill time to the last survivor's step), ``--failures`` times; a
  replacement worker then fills the vacancy (a "membership" round, same allocation).
* pids_kept: every survivor of every rescale kept its process (same PID, never exited),
  rank 0 was never replaced except by the failure of rank 0 itself, and every removed
  worker exited 0.
* the same run measures this machine: ``broadcast_gbps``, a plain gloo ``broadcast`` of
  one tensor of the state's size among 4 processes (median of warm repeats; the first,
  cold, as ``broadcast_cold_s``), and ``up_pause_vs_limit`` = up pause / (state bytes /
  that bandwidth); ``checkpoint_gbps``, the state through ``torch.save`` (fsync) and
  ``torch.load`` in a temp dir on this disk; ``start_s``, a newcomer's start-up (spawn
  to registered in the rendezvous: python, torch, store; its model is built after).
  ``--write-calibration FILE`` merges shrink_s, grow_s (up pause less the broadcast's
  time), broadcast_bps, start_s and checkpoint_bps into the rescale calibration FILE
  (``pollux_launch.calibration``), with the raw figures under ``measured``.

The worker side is chosen by ``--framework`` (``native``: torch.distributed through
``pollux_launch.rendezvous``; WORKERS). ``--framework horovod`` measures the same pauses
through Horovod Elastic (benchmarks/horovod_rescale.py ``measure()``: real horovodrun,
the same 4 -> 2 -> 4 cycles and model) right after the native run and prints both side
by side; its JSON keys are ``native_*`` and ``horovod_*``. Other frameworks join through
SIDES in the same style (e.g. ``deepspeed``: benchmarks/deepspeed_rebuild.py, with the
same ``--params`` and ``--optimizer``).
The LAST line printed is one JSON object, with ``"failed": {part: why}`` for a part that
failed (``native``, ``probes``, ``calibration``, the other framework; ``pids_kept``).
``--smoke``: one 4 -> 2 -> 4 cycle and one SIGKILL.

``--sharding fsdp`` measures a sharded model's live re-shard instead (2 -> 4 -> 2 cycles,
FSDP2 beside DDP, Adam): benchmarks/sharded_rescale.py, whose keys it prints.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
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
from typing import Any

from harness import Report, UsageError, run_benchmark  # beside this script
from local_etcd import LocalEtcd  # benchmarks/local_etcd.py, beside this script
from worker_events import read_events  # benchmarks/worker_events.py, beside this script

JOB = "bench"


# ======================================================================================
# worker side
# ======================================================================================


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def parse_count(text: str) -> int:
    """``"100M"``, ``"1.5k"``, ``"2000000"`` -> an integer count."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}
    t = text.strip().lower()
    try:
        n = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 1M, 10M, 100M)") from None
    if not 10_000 <= n <= 10**10:
        raise argparse.ArgumentTypeError(f"--params must be between 10k and 10G, got {text!r}")
    return int(n)


def mlp_dims(params: int | None) -> tuple[int, ...]:
    """Layer widths: today's 256-1024-512-256 (~0.92M parameters), or 256-H-H-256 with H
    picked so that the MLP has about ``params`` parameters (H^2 + 514 H + 256)."""
    if params is None:
        return (256, 1024, 512, 256)
    h = int((-514 + math.sqrt(514**2 + 4 * (params - 256))) / 2)
    return (256, max(1, h), max(1, h), 256)


def param_count(dims: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(dims))


def build_mlp(torch: Any, params: int | None) -> Any:
    """The benchmarks' MLP (``mlp_dims``); the DeepSpeed side builds the same one."""
    dims = mlp_dims(params)
    layers: list[Any] = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def build_optimizer(torch: Any, model: Any, name: str) -> Any:
    """SGD with momentum (two words of state per parameter) or Adam (three); Adam fused:
    foreach Adam takes ~2 s a step at 100M parameters on one CPU thread, fused ~0.1 s."""
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def state_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state (what a state broadcast moves)."""
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


class NativeWorker:
    """torch.distributed training through ``pollux_launch.rendezvous`` (in-place rescale)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from pollux_launch.rendezvous.process_group import InMemoryCommit
        from pollux_launch.rendezvous.protocol import Rendezvous, RendezvousConfig
        from pollux_launch.rendezvous.store import open_store

        torch.set_num_threads(1)
        self.torch = torch
        cfg = RendezvousConfig(
            lease_ttl=args.lease_ttl,
            join_timeout=120,
            collective_timeout=30 if (args.params or 0) < 20_000_000 else 120,
            backend="gloo",
            addr="127.0.0.1",
        )
        # registered first: start-up (python, torch, store, registration) is measured
        # apart from building the model, which grows with its size
        self.rdzv = Rendezvous(
            open_store(args.store_url),
            JOB,
            args.worker_id,
            node="local",
            config=cfg,
            owns_store=True,
        )
        self.registered_at = time.time()
        torch.manual_seed(0)
        self.model = build_mlp(torch, args.params)
        self.opt = build_optimizer(torch, self.model, args.optimizer)
        self.params = [p for p in self.model.parameters()]
        self.step = 0
        # the last step's state, for failure recovery (only when failures are measured:
        # at 100M parameters with Adam it is another 1.2 GB per worker)
        self.commit = InMemoryCommit(self.get_state, self.set_state) if args.commit else None

    def get_state(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step}

    def set_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])

    def sync_state(self, info: Any) -> None:
        """Newcomers receive the survivors' state (in place where it fits), survivors
        keep theirs; after a failure everyone takes rank 0's (``sync_state``)."""
        from pollux_launch.rendezvous.process_group import sync_state

        got = sync_state(self.get_state(), info)
        if got is not None:
            self.set_state(got)

    def decide(self) -> None:
        """The new group's first collective, as the elastic controller's: rank 0's
        decision (a few numbers) broadcast to every rank; the pause ends with it."""
        decision = self.torch.zeros(5, dtype=self.torch.float64)
        self.torch.distributed.broadcast(decision, 0)

    def train_step(self, world_size: int) -> None:
        torch, dist = self.torch, self.torch.distributed
        g = torch.Generator().manual_seed(self.step)
        x = torch.randn(32, 256, generator=g)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        for p in self.params:  # in place, per tensor: no copy of the whole gradient
            dist.all_reduce(p.grad)
            p.grad /= world_size
        self.opt.step()
        self.step += 1

    def commit_step(self) -> None:
        if self.commit is not None:
            self.commit.commit()

    def run(self) -> int:
        from pollux_launch.rendezvous.protocol import RendezvousError, WorkerRemoved

        emit(event="ready", pid=os.getpid(), registered_at=self.registered_at)
        try:
            info, t0, failed = self.rdzv.next_round(), None, False
            t_formed = time.perf_counter()
            while True:
                if failed and self.commit is not None:
                    self.commit.restore()
                if info.needs_state_sync:
                    self.sync_state(info)
                t_synced = time.perf_counter()
                self.decide()
                t_first = time.perf_counter()
                try:
                    self.train_step(info.world_size)
                    t_step = time.perf_counter()
                    self.commit_step()
                    emit(
                        event="round",
                        round=info.round,
                        rank=info.rank,
                        ws=info.world_size,
                        reason=info.reason,
                        pid=os.getpid(),
                        step_time=time.time(),
                        pause_s=None if t0 is None else t_first - t0,
                        pause_to_step_s=None if t0 is None else t_step - t0,
                        rdzv_s=None if t0 is None else t_formed - t0,
                        sync_s=t_synced - t_formed,
                        state_bytes=state_nbytes(self.get_state()),
                    )
                    last = time.monotonic()
                    while not self.rdzv.should_rescale():
                        self.train_step(info.world_size)
                        self.commit_step()
                        # every 20 steps, or every second when steps are slow (big models)
                        if self.step % 20 == 0 or time.monotonic() - last > 1.0:
                            emit(event="step", step=self.step, round=info.round)
                            last = time.monotonic()
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
        self.spawned_at: dict[str, float] = {}  # wall clock just before Popen
        self.events: queue.Queue[dict] = queue.Queue()
        self.backlog: list[dict] = []  # events read but not yet asked for
        self.next_id = 0
        self.pids_kept = True
        self.problems: list[str] = []
        self.seen_rounds: list[dict] = []

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
            "--optimizer",
            self.args.optimizer,
            *(["--params", str(self.args.params)] if self.args.params else []),
            *(["--commit"] if self.args.failures else []),
        ]
        self.spawned_at[wid] = time.time()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        self.procs[wid] = proc
        threading.Thread(target=self._read, args=(wid, proc), daemon=True).start()
        return wid

    def _read(self, wid: str, proc: subprocess.Popen) -> None:
        read_events(wid, proc, self.events)

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
        self.seen_rounds += events.values()
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
    sync_up: list[float] = []  # a survivor's state transfer in a grow
    starts: list[float] = []  # a grow's newcomer: spawn -> registered in the rendezvous
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
                    ready = c.wait(1, event="ready", worker=wid)[0]
                    starts.append(ready["registered_at"] - c.spawned_at[wid])
                time.sleep(0.5)  # let them settle inside next_round
                c.wait(2, event="step")
                c.allocate(4)  # 2 -> 4
                rnd = c.round(4, new)
                up += [rnd[w]["pause_s"] for w in new]
                rdzv_up += [rnd[w]["rdzv_s"] for w in new]
                up_step += [rnd[w]["pause_to_step_s"] for w in new]
                sync_up += [rnd[w]["sync_s"] for w in new]
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
        "up_state_sync_s": round(med(sync_up), 4) if sync_up else None,
        "down_pause_max_s": round(max(down), 4) if down else None,
        "up_pause_max_s": round(max(up), 4) if up else None,
        "failure_recovery_max_s": round(max(recovery), 4) if recovery else None,
        "lease_ttl_s": args.lease_ttl,
        "repeats": args.repeats,
        "failures": args.failures,
        "framework": args.framework,
        "params": param_count(mlp_dims(args.params)),
        "optimizer": args.optimizer,
        "state_bytes": max((e.get("state_bytes") or 0) for e in c.seen_rounds),
        "start_s": round(med(starts), 4) if starts else None,
        **({"pids_kept_violations": c.problems} if c.problems else {}),
    }


# ======================================================================================
# probes: this machine's plain gloo broadcast and checkpoint round trip, in the same run
# ======================================================================================


def probe_broadcast(args: argparse.Namespace) -> int:
    """One rank of a plain ``dist.broadcast`` of one float32 tensor of ``--nbytes`` among
    ``--world`` gloo processes on loopback (rank 0 prints the max over ranks per repeat)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.probe_file}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    n = max(1, args.nbytes // 4)
    x = torch.ones(n) if args.rank == 0 else torch.empty(n)
    times = []
    for _ in range(args.probe_repeats + 1):  # the first also faults the receivers' pages in
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(x, 0)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    if args.rank == 0:
        emit(event="broadcast", nbytes=n * 4, cold_s=times[0], seconds=times[1:])
    dist.destroy_process_group()
    return 0


def probe_checkpoint(args: argparse.Namespace) -> int:
    """The workers' state (model and optimizer after a step) through ``torch.save`` (fsync,
    as the elastic checkpoints do) and ``torch.load`` on this disk, ``--probe-repeats``
    times."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_mlp(torch, args.params)
    opt = build_optimizer(torch, model, args.optimizer)
    x = torch.randn(32, 256)
    (model(x) - x).pow(2).mean().backward()
    opt.step()  # the optimizer's state exists from the first step on
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 1}
    path = Path(args.probe_dir) / "state.pt"
    save, load = [], []
    for _ in range(args.probe_repeats):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        t1 = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        load.append(time.perf_counter() - t1)
        save.append(t1 - t0)
        del loaded
    emit(event="checkpoint", nbytes=path.stat().st_size, save_s=save, load_s=load)
    return 0


def _probe(args: list[str], ranks: int = 1) -> dict:
    """Run ``ranks`` probe processes of this script; the last JSON line of rank 0."""
    from pollux_launch.rendezvous.network import transport_env

    env = {**os.environ, **transport_env("127.0.0.1"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, *args]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, text=True,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL)
             for r in range(ranks)]
    try:
        out, _ = procs[0].communicate(timeout=900)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"error: probe {args[:2]} failed: exit codes {codes}")
    return json.loads(out.strip().splitlines()[-1])


def measure_broadcast(nbytes: int, world: int, repeats: int) -> dict:
    """Plain gloo broadcast of ``nbytes`` among ``world`` processes: median seconds (warm:
    the receivers' buffer already touched) and bytes per second."""
    with tempfile.TemporaryDirectory(prefix="pollux-bcast-") as tmp:
        got = _probe(["--probe", "broadcast", "--world", str(world), "--nbytes", str(nbytes),
                      "--probe-repeats", str(repeats), "--probe-file", f"{tmp}/init"], world)
    secs = statistics.median(got["seconds"])
    return {"broadcast_bps": got["nbytes"] / secs, "broadcast_s": secs,
            "broadcast_cold_s": got["cold_s"], "broadcast_bytes": got["nbytes"]}


def measure_checkpoint(args: argparse.Namespace, repeats: int) -> dict:
    """torch.save (fsync) + torch.load of the workers' state in a temp dir on this disk."""
    with tempfile.TemporaryDirectory(prefix="pollux-ckpt-") as tmp:
        opts = ["--params", str(args.params)] if args.params else []
        got = _probe(["--probe", "checkpoint", "--optimizer", args.optimizer, *opts,
                      "--probe-repeats", str(repeats), "--probe-dir", tmp])
    trips = [a + b for a, b in zip(got["save_s"], got["load_s"], strict=True)]
    return {"checkpoint_bps": got["nbytes"] / statistics.median(trips),
            "checkpoint_bytes": got["nbytes"],
            "checkpoint_save_s": statistics.median(got["save_s"]),
            "checkpoint_load_s": statistics.median(got["load_s"])}


def add_probes(result: dict, args: argparse.Namespace) -> dict:
    """The same run's broadcast bandwidth (state bytes among the job's 4 processes) and
    checkpoint bandwidth, and the grow pause against the broadcast's time."""
    repeats = 2 if result["state_bytes"] > 200e6 else 5
    bcast = measure_broadcast(result["state_bytes"], 4, repeats)
    ckpt = measure_checkpoint(args, repeats)
    limit = result["state_bytes"] / bcast["broadcast_bps"]
    return {**result, "broadcast_gbps": round(bcast["broadcast_bps"] / 1e9, 4),
            "up_pause_vs_limit": (round(result["up_pause_s"] / limit, 3)
                                  if result["up_pause_s"] is not None else None),
            "broadcast_s": round(bcast["broadcast_s"], 4),
            "broadcast_cold_s": round(bcast["broadcast_cold_s"], 4),
            "checkpoint_gbps": round(ckpt["checkpoint_bps"] / 1e9, 4),
            "checkpoint_save_s": round(ckpt["checkpoint_save_s"], 4),
            "checkpoint_load_s": round(ckpt["checkpoint_load_s"], 4),
            "_bps": (bcast["broadcast_bps"], ckpt["checkpoint_bps"])}


CALIBRATED = ("shrink_s", "grow_s", "broadcast_bps", "start_s", "checkpoint_bps")


def write_calibration(path: str, result: dict, args: argparse.Namespace) -> dict:
    """Merge this run's figures into the calibration file at ``path``
    (``pollux_launch.calibration``; ``restart_s``/``per_replica_s`` are other
    benchmarks')."""
    from pollux_launch.calibration import write_rescale_cost

    broadcast_bps, checkpoint_bps = result["_bps"]
    up, down = result["up_pause_s"], result["down_pause_s"]
    figures = {
        "shrink_s": round(down, 4),
        "grow_s": round(max(0.0, up - result["state_bytes"] / broadcast_bps), 4),
        "broadcast_bps": round(broadcast_bps),
        "start_s": round(result["start_s"], 4),
        "checkpoint_bps": round(checkpoint_bps),
    }
    date = time.strftime("%Y-%m-%d")
    command = "python benchmarks/rescale.py " + " ".join(sys.argv[1:])
    measured = {k: result[k] for k in (
        "params", "optimizer", "state_bytes", "down_pause_s", "up_pause_s",
        "down_pause_max_s", "up_pause_max_s", "up_pause_vs_limit", "broadcast_gbps",
        "broadcast_s", "broadcast_cold_s", "checkpoint_gbps", "checkpoint_save_s",
        "checkpoint_load_s", "start_s", "repeats", "store")}
    measured.update(date=date, machine={"cpu_count": os.cpu_count()}, command=command)
    label = f"params_{result['params']}_{result['optimizer']}"
    return write_rescale_cost(path, {**figures, "source": f"{command} ({date})"},
                              {label: measured})


# ======================================================================================
# other frameworks, measured next to the native path in the same run
# ======================================================================================


def _horovod_side(args: argparse.Namespace, url: str) -> dict:
    """Horovod Elastic's pauses (its own horovodrun and embedded store; ``url`` unused)."""
    from pollux_launch.adapters.horovod import horovod_available
    from pollux_launch.adapters.horovod.launch.command import HOROVOD_INSTALL_HINT

    if not horovod_available():
        sys.exit(f"error: {HOROVOD_INSTALL_HINT}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from horovod_rescale import measure

    return measure(repeats=args.repeats, high=4, low=2)


def _deepspeed_side(args: argparse.Namespace, url: str) -> dict:
    """DeepSpeed engines (ZeRO-2) rebuilt live through the same rendezvous and store
    (benchmarks/deepspeed_rebuild.py: the same 4 -> 2 -> 4 cycles, model and optimizer,
    so both sides move the same state)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from deepspeed_rebuild import measure

    return measure(url, repeats=args.repeats, stage=2, high=4, low=2,
                   optimizer=args.optimizer, params=args.params)


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


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.repeats < 1 or args.failures < 0 or not args.lease_ttl > 0:
        raise UsageError("--repeats must be >= 1, --failures >= 0 and --lease-ttl > 0")
    if args.sharding:  # a sharded model's live re-shard, beside DDP's (sharded_rescale.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import sharded_rescale

        sharded_rescale.bench(args, report)
        return
    if args.optimizer is None:
        args.optimizer = "adam" if args.params else "sgd"
    side = SIDES.get(args.framework)
    native_args = argparse.Namespace(**{**vars(args), "framework": "native"})
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pollux-rescale-") as tmp:
        etcd = None
        with report.case("native"):
            etcd = LocalEtcd(Path(tmp)) if args.store == "etcd" else None
            url = etcd.url if etcd else f"embedded://{tmp}/store.db"
            try:
                result = run(native_args if side else args, url)
            finally:
                if etcd:
                    etcd.stop()
            report.check("pids_kept", result["pids_kept"],
                         "; ".join(result.get("pids_kept_violations", [])))
        if result:
            with report.case("probes"):  # the workers are gone: their memory is free
                result = add_probes(result, args)
        if "_bps" in result and args.write_calibration:
            with report.case("calibration"):
                written = write_calibration(args.write_calibration, result, args)
                print(f"calibration written to {args.write_calibration}: "
                      + ", ".join(f"{k}={written[k]:.4g}" for k in CALIBRATED), flush=True)
        result.pop("_bps", None)
        if side is not None:
            with report.case(args.framework):
                try:
                    if etcd:  # the native run stopped its etcd: the other side gets its own
                        (Path(tmp) / "side").mkdir()
                        etcd = LocalEtcd(Path(tmp) / "side")
                        url = etcd.url
                    other = side(args, url)
                finally:
                    if etcd:
                        etcd.stop()
                if result:
                    print(side_by_side(result, args.framework, other), flush=True)
                result = {**other, **{f"native_{k}": v for k, v in result.items()
                                      if k not in ("framework", "repeats", "store")},
                          "store": args.store, "repeats": args.repeats,
                          "framework": args.framework}
    report.update(result)


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
    p.add_argument("--params", type=parse_count, default=None, metavar="N",
                   help="model size, e.g. 1M, 10M, 100M (default: today's ~0.92M MLP)")
    p.add_argument("--sharding", choices=["fsdp", "zero3"], default=None,
                   help="measure a sharded model's live re-shard instead, next to DDP's "
                        "(benchmarks/sharded_rescale.py; Adam)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                   help="sgd (momentum) or adam (default: adam with --params, else sgd)")
    p.add_argument("--write-calibration", metavar="FILE", default=None,
                   help="merge this run's shrink_s, grow_s, start_s, broadcast_bps and "
                        "checkpoint_bps into the rescale calibration FILE")
    # worker and probe modes (started by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store-url", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", help=argparse.SUPPRESS)
    p.add_argument("--commit", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", choices=["broadcast", "checkpoint"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--probe-repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--probe-file", help=argparse.SUPPRESS)
    p.add_argument("--probe-dir", help=argparse.SUPPRESS)
    given = sys.argv[1:] if argv is None else argv
    if "--worker" in given or "--probe" in given:  # started by the driver: no report
        args = p.parse_args(argv)  # (the driver gives them --optimizer)
        if args.probe:
            return (probe_broadcast if args.probe == "broadcast" else probe_checkpoint)(args)
        if os.environ.get("POLLUX_LOG_LEVEL"):
            import logging

            logging.basicConfig(
                level=os.environ["POLLUX_LOG_LEVEL"].upper(),
                stream=sys.stderr,
                format=f"%(relativeCreated)d {args.worker_id} %(message)s",
            )
        return WORKERS[args.framework](args).run()
    return run_benchmark(p, bench, argv=argv, smoke={"repeats": 1, "failures": 1})


if __name__ == "__main__":
    sys.exit(main())
