"""Rendezvous at scale: round formation with 2-32 real workers, and the coordinator at
1024 nodes (issue 17).

    python benchmarks/rendezvous_scale.py                      # everything (~15 min, 2 cores)
    python benchmarks/rendezvous_scale.py --sizes 2,4,8 --store etcd --skip-coordinator
    python benchmarks/rendezvous_scale.py --skip-rounds        # the coordinator alone

**Rounds.** N real worker processes (``--sizes``, default 2,4,8,16,32) of one job on this
machine, on each store (``--store``: etcd, a real etcd started on loopback with random
ports; embedded, the SQLite file). Each worker imports torch once, opens the store,
builds a ``Rendezvous`` (gloo on loopback, node "local") and goes through ``--rounds``
rounds (default 4) after a warm-up round, so start-up is never measured. The driver
plays the coordinator: each round it writes a new ``Allocation`` version with the same N
replicas, which makes the job re-form the same membership (reason "allocation": every
worker bumps or joins the new round, rank 0 closes it, everyone forms a new process group)
through the real protocol (``rendezvous/protocol.py``, ``rounds.py``, ``process_group.py``).
Between rounds the workers sit at a step boundary polling their local flag
(``Rendezvous.poll``, every 5 ms) and then vote (``should_rescale``); no training step
length is included.

* ``round_s`` (per N): from the driver's allocation write (``time.time()`` just before the
  put) to the moment the *last* member's ``next_round()`` returned, i.e. every member has
  formed the new process group (``init_process_group`` done); median over rounds. It
  includes noticing the allocation (the watcher), the vote, the store rounds and gloo's
  group set-up. ``rdzv_s``: from the moment the last member entered ``next_round()`` to
  the same end (the part "all members are in next_round -> all formed"). Split at the
  moment rank 0 wrote the round's state (everyone joined; seen by a watch of the
  driver's): ``close_s`` (allocation write -> round closed: the store part) and
  ``group_s`` (round closed -> last member's group formed: torch's TCPStore and
  ``init_process_group``).
* ``store_ops_per_round`` (per N): store calls counted exactly by a counting wrapper
  around the ``Store`` each worker passes to its ``Rendezvous``, summed over all workers,
  from one formed round to the next (median over rounds). Counted: every call the round
  itself makes (``next_round``: revision, get_prefix, put, txn, wait, ...) and every
  call of the watcher thread that a change caused (a ``wait`` that returned events, the
  re-reads). Not counted (a steady background, reported per worker per second): the
  lease keep-alive (3 / TTL) and watcher waits that timed out idle (1 / watch_timeout).
  One ``wait`` is one call (etcd: one Watch stream; embedded: a poll loop of SQLite).
  For etcd the etcd server's own count (``grpc_server_started_total`` over all methods,
  /metrics before the allocation write and after the last member formed; background
  included) is printed beside it. ``store_kb_read_per_round`` sums the bytes of the
  key-values the workers' reads returned.
* Growth with N: the exponent of a least-squares fit of log(figure) on log(N) over the
  sizes run (1: linear, 2: quadratic).

**Coordinator.** A real etcd holds 1024 nodes (``--nodes``, 8 slots each: 8192 GPUs)
registered as node agents do (``nodes/<n>`` = ``NodeInfo`` under a lease, ``workers``
updated as their workers start) and 400 jobs (``--jobs``) as ``pollux-run`` submits them
(``jobs/<j>/spec`` + ``status``), 90 % of them (``--modelled``) with hints carrying a
fitted goodput model (throughput parameters fitted to a trace model's placements, the
trace's gradient statistics: as benchmarks/policy_scale.py), and each running job's
rendezvous keys as its workers keep them (``rdzv/round``, ``workers/<w>``, the last two
rounds' ``members/<w>`` and ``state``; ``--no-rdzv-keys`` leaves them out). The
``Coordinator`` (policy pollux-dp) is leader and runs ``schedule_once`` directly: one
cold round (nothing allocated yet), then ``--coord-rounds`` timed rounds (default 20) in
steady state: before each, every modelled job's rank 0 re-reports its hints (every ~30 s
against a 60 s interval: each round sees new hints), ``--churn`` of the jobs finish and
as many arrive, and node agents publish their workers. Round latency: median and p95 of
``schedule_once`` wall time (CPU time beside it: the machine is shared). etcd requests
per round: the delta of etcd's ``grpc_server_started_total`` (all gRPC methods) around
``schedule_once`` - nothing else talks to etcd meanwhile (leases long enough that no
keep-alive runs), so it is exact; ``etcd_network_client_grpc_sent_bytes_total`` gives the
bytes etcd sent. One round is profiled (cProfile, top functions printed) and split into:
store reads (the ``get_prefix`` calls, gRPC and protobuf included), decoding (the rest of
reading nodes and jobs: JSON + message checks), speedup models (building goodput models
for new hints), policy solve, writes (the guarded transaction) and the rest.

The LAST line printed is one JSON object::

    {"round_s": {"2": .., "32": ..}, "round_s_embedded": {...},
     "store_ops_per_round": {"etcd": {...}, "embedded": {...}},
     "coordinator_round_ms_1024_nodes": .., "coordinator_round_ms_p95": ..,
     "etcd_requests_per_round": .., ...}

with ``"failed": {"rounds_<store>" | "coordinator": why}`` for a part that failed.
``--smoke``: 2 workers, one round per store, 16 nodes and 8 jobs for the coordinator.

Timings on a shared 2-core machine are noisy (run it under ``nice``); nothing asserts them.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from harness import Report, UsageError, run_benchmark  # beside this script
from local_etcd import LocalEtcd  # benchmarks/local_etcd.py, beside this script
from worker_events import read_events  # benchmarks/worker_events.py, beside this script

from pollux_launch.rendezvous.store import Store

JOB = "scale"
SIZES = (2, 4, 8, 16, 32)


def status(line: str) -> None:
    print(f"rendezvous_scale: {line}", file=sys.stderr, flush=True)


# ======================================================================================
# an exact count of store calls
# ======================================================================================


def _role() -> str:
    """Which part of a worker makes the call: the round itself (the main thread), the
    watcher thread, or a lease keep-alive thread."""
    name = threading.current_thread().name
    if name.startswith("pollux-rdzv-watch"):
        return "watch"
    if name.startswith("pollux-lease"):
        return "lease"
    return "round"


class CountingStore(Store):
    """A ``Store`` that forwards every call to ``inner`` and counts it, per role
    (``_role``) and operation, with the bytes of the key-values reads returned and the
    time spent. ``keep_alive`` and ``create`` are the base class's, so their refreshes
    and transactions are counted as the calls they make. A ``wait`` that returned
    nothing is counted as ``wait_idle``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()  # "role.op" -> calls
        self.bytes: Counter[str] = Counter()  # "role.op" -> bytes of key-values returned
        self.seconds: Counter[str] = Counter()  # "role.op" -> seconds
        self._lock = threading.Lock()

    def _count(self, op: str, t0: float, nbytes: int = 0) -> None:
        key = f"{_role()}.{op}"
        with self._lock:
            self.calls[key] += 1
            self.bytes[key] += nbytes
            self.seconds[key] += time.perf_counter() - t0

    def snapshot(self) -> dict:
        with self._lock:
            return {"calls": dict(self.calls), "bytes": dict(self.bytes),
                    "seconds": {k: round(v, 6) for k, v in self.seconds.items()}}

    def get(self, key):
        t0 = time.perf_counter()
        kv = self.inner.get(key)
        self._count("get", t0, len(kv.key) + len(kv.value) if kv else 0)
        return kv

    def get_prefix(self, prefix):
        t0 = time.perf_counter()
        kvs = self.inner.get_prefix(prefix)
        self._count("get_prefix", t0, sum(len(kv.key) + len(kv.value) for kv in kvs))
        return kvs

    def put(self, key, value, lease=0):
        t0 = time.perf_counter()
        rev = self.inner.put(key, value, lease)
        self._count("put", t0)
        return rev

    def delete(self, key, prefix=False):
        t0 = time.perf_counter()
        n = self.inner.delete(key, prefix)
        self._count("delete", t0)
        return n

    def txn(self, compare, success, failure=()):
        t0 = time.perf_counter()
        ok = self.inner.txn(compare, success, failure)
        self._count("txn", t0)
        return ok

    def lease_grant(self, ttl):
        t0 = time.perf_counter()
        lease = self.inner.lease_grant(ttl)
        self._count("lease_grant", t0)
        return lease

    def lease_refresh(self, lease):
        t0 = time.perf_counter()
        try:
            self.inner.lease_refresh(lease)
        finally:
            self._count("lease_refresh", t0)

    def lease_revoke(self, lease):
        t0 = time.perf_counter()
        self.inner.lease_revoke(lease)
        self._count("lease_revoke", t0)

    def revision(self):
        t0 = time.perf_counter()
        rev = self.inner.revision()
        self._count("revision", t0)
        return rev

    def wait(self, prefix, after_revision, timeout):
        t0 = time.perf_counter()
        events = self.inner.wait(prefix, after_revision, timeout)
        self._count("wait" if events else "wait_idle", t0,
                    sum(len(e.key) + len(e.value) for e in events))
        return events

    def close(self):
        self.inner.close()


# round-related store calls: the round's own, and the watcher's caused by a change
BACKGROUND = ("lease.", "watch.wait_idle")


def round_calls(calls: dict[str, int]) -> int:
    return sum(n for k, n in calls.items() if not k.startswith(BACKGROUND))


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}


# ======================================================================================
# worker side (started by the driver: --worker)
# ======================================================================================


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def worker_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from pollux_launch.rendezvous.protocol import (
        Rendezvous,
        RendezvousConfig,
        RendezvousError,
        WorkerRemoved,
    )
    from pollux_launch.rendezvous.store import open_store

    torch.set_num_threads(1)
    if os.environ.get("POLLUX_BENCH_LOG_DIR"):  # debugging: each worker's protocol log
        import logging

        logging.basicConfig(
            level=logging.DEBUG, format="%(created).3f %(threadName)s %(name)s %(message)s",
            filename=os.path.join(os.environ["POLLUX_BENCH_LOG_DIR"], f"{args.worker_id}.log"))
    store = CountingStore(open_store(args.store_url))
    cfg = RendezvousConfig(lease_ttl=args.lease_ttl, join_timeout=600.0,
                           collective_timeout=300.0, backend="gloo", addr="127.0.0.1",
                           watch_timeout=args.watch_timeout)
    rdzv = Rendezvous(store, args.job, args.worker_id, node="local", config=cfg,
                      owns_store=True)
    emit(event="ready", pid=os.getpid())
    model = torch.zeros(16)  # the tiny "model": its state moves when newcomers join
    try:
        t_seen = t_enter = time.time()
        info = rdzv.next_round()
        while True:
            t_formed = time.time()
            ops = store.snapshot()
            # the group works: an all-reduce of rank + 1 (after the timed part)
            check = torch.tensor([float(info.rank + 1)])
            dist.all_reduce(check)
            if info.needs_state_sync:
                dist.broadcast(model, 0)
            emit(event="formed", round=info.round, rank=info.rank, ws=info.world_size,
                 reason=info.reason, t_seen=t_seen, t_enter=t_enter, t_formed=t_formed,
                 ok=check.item() == info.world_size * (info.world_size + 1) / 2, ops=ops)
            while not rdzv.poll():  # a step boundary, no training: the local flag only
                time.sleep(0.005)
            t_seen = time.time()
            if not rdzv.should_rescale():  # the vote: every rank leaves at this step
                continue
            t_enter = time.time()
            info = rdzv.next_round()
    except WorkerRemoved:
        emit(event="removed", ops=store.snapshot())
        return 0
    except RendezvousError as exc:
        print(f"worker {args.worker_id}: {exc}", file=sys.stderr, flush=True)
        return 2


# ======================================================================================
# driver side: round formation
# ======================================================================================


def etcd_counters(metrics_url: str | None) -> dict[str, float]:
    """etcd's counters we read: gRPC calls started per method, bytes sent to clients."""
    if metrics_url is None:
        return {}
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_started_total{"):
            method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[f"grpc.{method}"] = out.get(f"grpc.{method}", 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_network_client_grpc_sent_bytes_total"):
            out["sent_bytes"] = float(line.rsplit(" ", 1)[1])
    return out


def grpc_total(delta: dict[str, float]) -> int:
    return int(sum(v for k, v in delta.items() if k.startswith("grpc.")))


def counter_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


class Pool:
    """N worker processes of one job, their JSON events, the job's allocation."""

    def __init__(self, url: str, job: str, args: argparse.Namespace) -> None:
        from pollux_launch.rendezvous.rounds import JobKeys
        from pollux_launch.rendezvous.store import open_store

        self.url, self.job, self.args = url, job, args
        self.store = open_store(url)
        self.keys = JobKeys(job)
        self.version = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.events: queue.Queue[dict] = queue.Queue()
        self.stderr: dict[str, list[str]] = {}

    def allocate(self, replicas: int) -> float:
        """Write the next allocation version; returns the time just before the write."""
        from pollux_launch.messages import Allocation, encode

        self.version += 1
        t0 = time.time()
        self.store.put(self.keys.allocation,
                       encode(Allocation(self.version, ("local",) * replicas, t0)))
        return t0

    def spawn(self, n: int) -> None:
        for i in range(n):
            wid = f"w{i:03d}"
            cmd = [sys.executable, __file__, "--worker", "--store-url", self.url, "--job",
                   self.job, "--worker-id", wid, "--lease-ttl", str(self.args.lease_ttl),
                   "--watch-timeout", str(self.args.watch_timeout)]
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)
            self.procs[wid] = proc
            self.stderr[wid] = []
            threading.Thread(target=self._read, args=(wid, proc), daemon=True).start()
            threading.Thread(target=self._drain, args=(wid, proc), daemon=True).start()

    def _read(self, wid: str, proc: subprocess.Popen) -> None:
        read_events(wid, proc, self.events)

    def _drain(self, wid: str, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.stderr[wid].append(line)
            del self.stderr[wid][:-20]

    def wait(self, count: int, event: str, timeout: float, **match: object) -> dict[str, dict]:
        """The next ``count`` events of kind ``event`` (one per worker) matching ``match``."""
        got: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                e = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                codes = {w: p.poll() for w, p in self.procs.items()}
                logs = {w: "".join(s[-3:]) for w, s in self.stderr.items() if s}
                raise SystemExit(f"error: timed out after {timeout:g} s waiting for {count} "
                                 f"x {event} {match} (got {len(got)}); exit codes {codes}; "
                                 f"stderr {logs}") from None
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                got[e["worker"]] = e
        return got

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.allocate(0)  # an allocation with no nodes: everyone leaves (exit 0)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.store.close()


class StateWatch:
    """When round ``r``'s state was written (its rank 0 closed it: everyone joined), as
    seen by a watch of the driver's own on the job's keys (a few ms late at most)."""

    def __init__(self, pool: Pool, r: int) -> None:
        from pollux_launch.rendezvous.store import open_store

        self.store = open_store(pool.url)
        self.key, self.prefix = pool.keys.state(r), pool.keys.prefix
        self.rev = self.store.revision()
        self.at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rev = self.rev
        try:
            while not self.done.is_set():
                for ev in self.store.wait(self.prefix, rev, 0.5):
                    rev = max(rev, ev.revision)
                    if ev.key == self.key and ev.kind == "put" and self.at is None:
                        self.at = time.time()
                        return
        except Exception as exc:  # the figure is then missing, the round still counts
            status(f"state watch: {exc}")

    def result(self) -> float | None:
        self.thread.join(timeout=5)
        self.done.set()
        self.thread.join()
        self.store.close()
        return self.at


def _median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def measure_size(url: str, store_kind: str, n: int, args: argparse.Namespace,
                 metrics_url: str | None, bar) -> dict:
    """``args.rounds`` re-formations of an N-worker job; medians."""
    pool = Pool(url, f"{JOB}-{store_kind}-{n}", args)
    rounds: list[dict] = []
    try:
        pool.allocate(n)
        pool.spawn(n)
        bar.set_postfix_str(f"{store_kind} N={n}: starting workers")
        last = pool.wait(n, "formed", args.start_timeout, round=1)
        bar.set_postfix_str(f"{store_kind} N={n}: rounds")
        for i in range(args.rounds + 1):  # the first re-formation is a warm-up
            time.sleep(args.settle)  # watchers idle, teardown threads done
            m0 = etcd_counters(metrics_url)
            r = last[next(iter(last))]["round"] + 1
            closed = StateWatch(pool, r)
            t0 = pool.allocate(n)
            new = pool.wait(n, "formed", args.round_timeout, round=r)
            m1 = etcd_counters(metrics_url)
            t_closed = closed.result()
            if not all(e["ok"] and e["ws"] == n for e in new.values()):
                raise SystemExit(f"error: round {r} of N={n} formed wrongly: "
                                 f"{[(e['ws'], e['ok']) for e in new.values()]}")
            end = max(e["t_formed"] for e in new.values())
            calls = Counter()
            nbytes = Counter()
            for w, e in new.items():
                calls.update(diff(e["ops"]["calls"], last[w]["ops"]["calls"]))
                nbytes.update(diff(e["ops"]["bytes"], last[w]["ops"]["bytes"]))
            if i > 0:
                rounds.append({
                    "round_s": end - t0,
                    "rdzv_s": end - max(e["t_enter"] for e in new.values()),
                    "notice_s": max(e["t_seen"] for e in new.values()) - t0,
                    "close_s": t_closed - t0 if t_closed else None,
                    "group_s": end - t_closed if t_closed else None,
                    "calls": dict(calls),
                    "ops": round_calls(calls),
                    "kb_read": sum(v for k, v in nbytes.items() if not k.startswith(BACKGROUND))
                    / 1024,
                    "etcd_requests": grpc_total(counter_delta(m1, m0)) if m1 else None,
                })
            bar.update()
            last = new
    finally:
        pool.close()
    med = statistics.median
    ops_by_call: Counter[str] = Counter()
    for rd in rounds:
        ops_by_call.update(rd["calls"])
    return {
        "round_s": round(med(rd["round_s"] for rd in rounds), 4),
        "round_s_max": round(max(rd["round_s"] for rd in rounds), 4),
        "rdzv_s": round(med(rd["rdzv_s"] for rd in rounds), 4),
        "notice_s": round(med(rd["notice_s"] for rd in rounds), 4),
        "close_s": _median_or_none([rd["close_s"] for rd in rounds]),
        "group_s": _median_or_none([rd["group_s"] for rd in rounds]),
        "group_s_max": max((rd["group_s"] for rd in rounds if rd["group_s"] is not None),
                           default=None),
        "store_ops": med(rd["ops"] for rd in rounds),
        "store_kb_read": round(med(rd["kb_read"] for rd in rounds), 1),
        "etcd_requests": (med(rd["etcd_requests"] for rd in rounds)
                          if metrics_url else None),
        # mean per round, by role.operation (background included, for the record)
        "calls": {k: round(v / len(rounds), 1) for k, v in sorted(ops_by_call.items())},
    }


def growth(figures: dict[int, float]) -> float | None:
    """Exponent b of figure ~ a N^b (least squares in log-log)."""
    pts = [(math.log(n), math.log(v)) for n, v in figures.items() if v and v > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 2) if sxx else None


def describe(b: float | None) -> str:
    if b is None:
        return "-"
    name = ("constant" if b < 0.5 else "linear" if b < 1.4 else
            "between linear and quadratic" if b < 1.8 else "quadratic" if b < 2.4 else "cubic+")
    return f"N^{b:.2f} ({name})"


def run_rounds(args: argparse.Namespace, stores: Sequence[str], tmp: Path) -> dict:
    from tqdm import tqdm

    results: dict[str, dict[int, dict]] = {}
    total = len(stores) * len(args.sizes) * (args.rounds + 1)
    with tqdm(total=total, desc="rounds", unit="round", file=sys.stderr) as bar:
        for kind in stores:
            etcd = None
            if kind == "etcd":
                (tmp / "etcd-rounds").mkdir()
                etcd = LocalEtcd(tmp / "etcd-rounds")
            if etcd is not None:
                url = etcd.url
                metrics = f"http://127.0.0.1:{etcd.client_port}/metrics"
            else:
                url, metrics = f"embedded://{tmp}/store.db", None
            try:
                results[kind] = {}
                for n in args.sizes:
                    results[kind][n] = measure_size(url, kind, n, args, metrics, bar)
                    status(f"{kind} N={n}: round {results[kind][n]['round_s']:.3f} s, "
                           f"{results[kind][n]['store_ops']:.0f} store ops/round")
            finally:
                if etcd is not None:
                    etcd.stop()
    return results


def print_rounds(results: dict[str, dict[int, dict]], args: argparse.Namespace) -> None:
    bg = 3 / args.lease_ttl + 1 / args.watch_timeout
    print(f"\nround formation (re-forming the same N members; medians of {args.rounds} "
          f"rounds; background not counted: ~{bg:.1f} store calls/s per worker)")
    head = (f"{'store':<9}{'N':>4}{'round_s':>9}{'max':>8}{'rdzv_s':>8}{'notice_s':>9}"
            f"{'close_s':>8}{'group_s':>8}{'ops/round':>11}{'ops/N':>7}{'KB read':>9}"
            f"{'etcd req':>9}")
    print(head)
    for kind, per in results.items():
        for n, r in per.items():
            etcd = "-" if r["etcd_requests"] is None else f"{r['etcd_requests']:.0f}"
            close, group = (("-" if r[k] is None else f"{r[k]:.3f}")
                            for k in ("close_s", "group_s"))
            print(f"{kind:<9}{n:>4}{r['round_s']:>9.3f}{r['round_s_max']:>8.3f}"
                  f"{r['rdzv_s']:>8.3f}{r['notice_s']:>9.3f}{close:>8}{group:>8}"
                  f"{r['store_ops']:>11.0f}"
                  f"{r['store_ops'] / n:>7.1f}{r['store_kb_read']:>9.1f}{etcd:>9}")
        if len(per) > 1:
            fit = {f: describe(growth({n: r[f] for n, r in per.items()}))
                   for f in ("round_s", "close_s", "store_ops", "store_kb_read")}
            print(f"  {kind} growth: round_s {fit['round_s']}, close_s {fit['close_s']}, "
                  f"store ops {fit['store_ops']}, KB read {fit['store_kb_read']}")
    for kind, per in results.items():
        n = max(per)
        calls = ", ".join(f"{k} {v:g}" for k, v in per[n]["calls"].items())
        print(f"  {kind} N={n} calls per round (all workers, mean): {calls}")


# ======================================================================================
# driver side: the coordinator at 1024 nodes
# ======================================================================================


class Cluster:
    """What node agents, launchers and workers keep in the store, written as they do."""

    def __init__(self, store: Store, args: argparse.Namespace) -> None:
        import numpy as np

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from policy_scale import _goodput_model  # benchmarks/policy_scale.py

        from pollux_launch.sim import traces

        self.store, self.args = store, args
        self.rng = random.Random(args.seed)
        self.np = np
        self.models = traces.available_models()
        self.fitted = {m: _goodput_model(m) for m in self.models}  # (trace, PerfParams)
        self.now = time.time()
        self.lease = store.lease_grant(3600)  # workers' keys (a stand-in for their leases)
        self.node_leases: dict[str, int] = {}
        self.node_workers: dict[str, dict[str, int]] = {}
        self.jobs: dict[str, str] = {}  # job -> trace model
        self.modelled: set[str] = set()
        self.epoch: dict[str, int] = {}  # each job's epoch (its gradient statistics)
        self.finished: set[str] = set()
        self.rounds_of: dict[str, int] = {}
        self.serial = 0

    # -- node agents ---------------------------------------------------------------------
    def register_nodes(self, bar) -> None:
        from pollux_launch import keys
        from pollux_launch.messages import NodeInfo, encode

        for i in range(self.args.nodes):
            name = f"node{i:04d}"
            # each agent: its own lease (kept alive from a thread; long here so that no
            # keep-alive runs during the timed rounds), then its record under it
            lease = self.store.lease_grant(3600)
            self.node_leases[name] = lease
            self.node_workers[name] = {}
            self.store.put(keys.node(name), encode(NodeInfo(
                name, self.args.slots, f"10.0.{i // 256}.{i % 256}", time.time(), {}, 7000)),
                lease=lease)
            bar.update()

    def publish_workers(self, allocs: dict[str, tuple[str, ...]]) -> int:
        """Node agents start / stop workers as the allocations say and publish them."""
        from pollux_launch import keys
        from pollux_launch.messages import NodeInfo, encode

        want: dict[str, dict[str, int]] = {n: {} for n in self.node_workers}
        for job, nodes in allocs.items():
            for node in nodes:
                want[node][job] = want[node].get(job, 0) + 1
        changed = 0
        for node, workers in want.items():
            if workers != self.node_workers[node]:
                i = int(node[4:])
                self.store.put(keys.node(node), encode(NodeInfo(
                    node, self.args.slots, f"10.0.{i // 256}.{i % 256}", time.time(), workers,
                    7000)), lease=self.node_leases[node])
                self.node_workers[node] = workers
                changed += 1
        return changed

    # -- launchers -------------------------------------------------------------------------
    def submit(self, age: float) -> str:
        """pollux-run: the spec and a pending status in one transaction (no secret: no
        signature key)."""
        from pollux_launch import keys
        from pollux_launch.messages import JobSpec, JobStatus, encode
        from pollux_launch.rendezvous.store import Put

        model = self.models[self.rng.randrange(len(self.models))]
        name = f"{model}-{self.serial:04d}"
        self.serial += 1
        initial = self.rng.choice([1, 1, 2, 4, 8])
        spec = JobSpec(name, ("python", f"train_{model}.py", "--epochs", "90"), "torch",
                       initial, 1, 64, True, self.now - age, "/home/user/work",
                       {"PYTHONUNBUFFERED": "1"}, f"{self.rng.getrandbits(64):016x}")
        self.store.txn([], [Put(keys.job(name, "spec"), encode(spec)),
                            Put(keys.job(name, "status"), encode(JobStatus("pending")))])
        self.jobs[name] = model
        if self.rng.random() < self.args.modelled:
            self.modelled.add(name)
            self.report_hints(name, replicas=initial)
        return name

    def report_hints(self, job: str, replicas: int) -> None:
        """The job's rank-0 agent: JobHints with its fitted model (tuning/tuner.py)."""
        from pollux_launch import keys
        from pollux_launch.messages import JobHints, encode

        tr, perf = self.fitted[self.jobs[job]]
        epoch = self.epoch.setdefault(job, self.rng.randrange(max(1, tr.max_epochs)))
        sqr, var = tr.grad_stats(tr.init_batch_size, epoch)
        jitter = 1 + 0.02 * (self.rng.random() - 0.5)  # each refit moves a little
        hints = JobHints(
            init_batch_size=tr.init_batch_size, max_batch_size=tr.max_batch_size,
            local_bsz_bounds=(tr.min_local_bsz, tr.max_local_bsz),
            perf_params={k: v * (jitter if k.startswith("beta") else 1)
                         for k, v in perf.to_dict().items()},
            grad_sqr=float(sqr), grad_var=float(var),
            max_profiled_replicas=max(1, replicas), max_profiled_nodes=max(1, replicas // 8),
            num_nodes=max(1, replicas // 8), num_replicas=max(1, replicas),
            local_bsz=tr.min_local_bsz, accum_steps=0, progress=1000.0 * (epoch + 1),
            timestamp=time.time())
        self.store.put(keys.job(job, "hints"), encode(hints))

    def finish(self, job: str) -> None:
        from pollux_launch import keys
        from pollux_launch.messages import JobStatus, encode

        self.store.put(keys.job(job, "status"),
                       encode(JobStatus("succeeded", 0, "", time.time())))
        self.store.delete(keys.job(job, "rdzv/"), prefix=True)  # its workers left
        self.finished.add(job)

    def running(self, job: str) -> None:
        from pollux_launch import keys
        from pollux_launch.messages import JobStatus, encode

        self.store.put(keys.job(job, "status"), encode(JobStatus("running", None, "",
                                                                 time.time())))

    # -- workers -----------------------------------------------------------------------------
    def rdzv_keys(self, job: str, nodes: tuple[str, ...], version: int) -> None:
        """The rendezvous keys a job's workers keep once they re-formed for ``nodes``:
        the round pointer, each worker's record, the last two rounds' members and states
        (rank 0 of round r deletes round r - 2)."""
        from pollux_launch.messages import encode
        from pollux_launch.rendezvous.rounds import (
            JobKeys,
            Member,
            RoundInfo,
            RoundState,
            WorkerInfo,
        )
        from pollux_launch.rendezvous.store import Delete, Put

        k = JobKeys(job)
        r = self.rounds_of.get(job, 1) + 1
        self.rounds_of[job] = r
        workers = [f"{n}-{job[:12]}-{i}" for i, n in enumerate(nodes)]
        ops: list = [Delete(k.rdzv, prefix=True)]
        ops.append(Put(k.round, encode(RoundInfo(r, version, nodes, "allocation", r - 1,
                                                 tuple(workers), time.time()))))
        for rr in (r - 1, r):
            ops.append(Put(k.state(rr), encode(RoundState(
                rr, version, tuple(workers), "10.0.0.1", 29500, "allocation", (),
                time.time(), nodes))))
        for i, (w, n) in enumerate(zip(workers, nodes, strict=True)):
            ops.append(Put(k.worker(w), encode(WorkerInfo(w, n, "10.0.0.1", 1000 + i,
                                                          time.time())), lease=self.lease))
            for rr in (r - 1, r):
                ops.append(Put(k.member(rr, w), encode(Member(w, n, "10.0.0.1", 1000 + i,
                                                              rr - 1, i)), lease=self.lease))
        # one delete of the old keys, then batches of at most etcd's 128 ops per txn
        self.store.txn([], ops[:1])
        for i in range(1, len(ops), 120):
            self.store.txn([], ops[i:i + 120])


class TimedPolicy:
    """The coordinator's policy, with the wall time of each ``optimize``."""

    def __init__(self, policy) -> None:
        self.policy, self.seconds = policy, 0.0

    def optimize(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.policy.optimize(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.policy, name)


def _timed(owner: object, name: str, box: Counter) -> None:
    """Replace the bound method ``owner.name`` by one adding its wall time to box[name]."""
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            box[name] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def current_allocations(store: Store) -> dict[str, tuple[str, ...]]:
    from pollux_launch import keys
    from pollux_launch.messages import Allocation, decode

    out = {}
    for kv in store.get_prefix(keys.JOBS):
        split = keys.split_job_key(kv.key)
        if split and split[1] == "allocation":
            out[split[0]] = decode(Allocation, kv.value).nodes
    return out


def run_coordinator(args: argparse.Namespace, tmp: Path) -> dict:
    from tqdm import tqdm

    from pollux_launch.coordinator.service import Coordinator
    from pollux_launch.policy import DEFAULT_POLICY, make_policy
    from pollux_launch.rendezvous.store import open_store

    (tmp / "etcd-coordinator").mkdir()
    etcd = LocalEtcd(tmp / "etcd-coordinator")
    metrics = f"http://127.0.0.1:{etcd.client_port}/metrics"
    try:
        raw = open_store(etcd.url, timeout=60)
        store = CountingStore(raw)
        cluster = Cluster(raw, args)
        setup = args.nodes + args.jobs
        with tqdm(total=setup, desc="registering nodes and jobs", file=sys.stderr) as bar:
            cluster.register_nodes(bar)
            for _ in range(args.jobs):
                cluster.submit(age=cluster.rng.uniform(600, 4 * 3600))
                bar.update()
        policy = TimedPolicy(make_policy(DEFAULT_POLICY, p=-1.0, delta=30.0))
        coord = Coordinator(store, policy, interval=60.0, lease_ttl=3600.0,
                            name="bench-coordinator", node_grace=40.0)
        if not coord._campaign():  # leader, so every round's writes are guarded (term)
            raise SystemExit("error: the benchmark's coordinator did not become leader")
        box: Counter[str] = Counter()
        for name in ("_read_nodes", "_read_jobs", "_speedup", "_with_grace"):
            _timed(coord, name, box)

        def one_round(profile: bool = False) -> dict:
            box.clear()
            policy.seconds = 0.0
            before = store.snapshot()
            m0 = etcd_counters(metrics)
            prof = cProfile.Profile() if profile else None
            c0, t0 = time.process_time(), time.perf_counter()
            if prof:
                prof.enable()
            writes = coord.schedule_once()
            if prof:
                prof.disable()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            m1 = etcd_counters(metrics)
            after = store.snapshot()
            delta = counter_delta(m1, m0)
            secs = {k: after["seconds"].get(k, 0) - before["seconds"].get(k, 0)
                    for k in after["seconds"]}
            reads = sum(v for k, v in secs.items() if k.endswith((".get_prefix", ".get")))
            write_s = sum(v for k, v in secs.items() if k.endswith((".txn", ".put")))
            read_nodes_jobs = box["_read_nodes"] + box["_read_jobs"]
            parts = {
                "store_reads": reads,
                "decoding": max(0.0, read_nodes_jobs - reads),
                "speedup_models": box["_speedup"],
                "policy_solve": policy.seconds,
                "writes": write_s,
            }
            parts["other"] = max(0.0, wall - sum(parts.values()))
            calls = diff(after["calls"], before["calls"])
            nbytes = diff(after["bytes"], before["bytes"])
            out = {"wall_ms": wall * 1000, "cpu_ms": cpu * 1000, "writes": len(writes),
                   "etcd_requests": grpc_total(delta),
                   "etcd_by_method": {k[5:]: int(v) for k, v in delta.items()
                                      if k.startswith("grpc.")},
                   "etcd_sent_kb": delta.get("sent_bytes", 0) / 1024,
                   "store_calls": sum(calls.values()),
                   "kb_read": sum(nbytes.values()) / 1024,
                   "parts_ms": {k: v * 1000 for k, v in parts.items()}}
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                out["profile"] = s.getvalue()
            return out

        def after_round(first: bool) -> None:
            """What the cluster does between two rounds (not timed)."""
            allocs = {j: n for j, n in current_allocations(raw).items()
                      if j not in cluster.finished}
            cluster.publish_workers(allocs)
            if not args.no_rdzv_keys:
                for job, nodes in allocs.items():
                    if nodes and rdzv_of.get(job) != nodes:  # its workers re-formed
                        cluster.rdzv_keys(job, nodes, version=1)
                        rdzv_of[job] = nodes
            for job, nodes in allocs.items():
                if nodes and job not in started:
                    cluster.running(job)
                    started.add(job)
            if first:
                return
            live = [j for j in cluster.jobs if j not in cluster.finished]
            churn = max(0, round(args.churn * len(live)))
            for job in cluster.rng.sample(live, churn):
                cluster.finish(job)
            for _ in range(churn):
                cluster.submit(age=0.0)
            refresh = [j for j in cluster.modelled
                       if j not in cluster.finished and cluster.rng.random() < args.hint_refresh]
            for job in refresh:
                cluster.report_hints(job, replicas=len(allocs.get(job, ())) or 1)

        rdzv_of: dict[str, tuple[str, ...]] = {}
        started: set[str] = set()
        status(f"coordinator: cold round over {args.nodes} nodes, {args.jobs} jobs")
        cold = one_round()
        with tqdm(total=args.coord_rounds + 2, desc="coordinator rounds",
                  file=sys.stderr) as bar:
            after_round(first=True)
            bar.update()
            warm = one_round()  # the jobs started: the first steady round (untimed)
            after_round(first=False)
            bar.update()
            timed = []
            for i in range(args.coord_rounds):
                timed.append(one_round(profile=(i == args.coord_rounds // 2)))
                after_round(first=False)
                bar.update()
        agent_reads = node_agent_reads(raw, metrics)
        keys_total = len(raw.get_prefix(""))
        rdzv_keys = sum(1 for kv in raw.get_prefix("jobs/") if "/rdzv/" in kv.key)
        gpus = sum(len(n) for n in current_allocations(raw).values())
        raw.close()
    finally:
        etcd.stop()
    # every change under jobs/ wakes every node agent into one such read: the jobs' hints
    # alone change jobs/ HINT_RATE times a second (each job reports every ~30 s)
    hint_rate = args.jobs / HINTS_EVERY_S
    read_s = agent_reads["ms"] / 1000
    agent_load = args.nodes * min(hint_rate, 1 / read_s) * agent_reads["kb"] / 1024
    walls = sorted(r["wall_ms"] for r in timed)
    p95 = walls[min(len(walls) - 1, math.ceil(0.95 * len(walls)) - 1)]
    profiled = next(r for r in timed if "profile" in r)
    med = statistics.median
    parts = {k: round(med(r["parts_ms"][k] for r in timed), 1) for k in timed[0]["parts_ms"]}
    return {
        "nodes": args.nodes, "slots_per_node": args.slots, "gpus": args.nodes * args.slots,
        "jobs": args.jobs, "gpus_allocated": gpus, "store_keys": keys_total,
        "rdzv_keys": rdzv_keys,
        "round_ms": round(med(walls), 1), "round_ms_p95": round(p95, 1),
        "round_cpu_ms": round(med(r["cpu_ms"] for r in timed), 1),
        "cold_round_ms": round(cold["wall_ms"], 1), "warm_up_round_ms": round(warm["wall_ms"], 1),
        "etcd_requests_per_round": med(r["etcd_requests"] for r in timed),
        "etcd_requests_by_method": timed[0]["etcd_by_method"],
        "etcd_sent_kb_per_round": round(med(r["etcd_sent_kb"] for r in timed), 1),
        "store_calls_per_round": med(r["store_calls"] for r in timed),
        "kb_read_per_round": round(med(r["kb_read"] for r in timed), 1),
        "writes_per_round": med(r["writes"] for r in timed),
        "parts_ms": parts,
        "profile": profiled["profile"],
        "node_agent_read_ms": round(agent_reads["ms"], 1),
        "node_agent_read_kb": round(agent_reads["kb"], 1),
        "node_agents_read_mb_per_s_estimate": round(agent_load),
        "rounds": len(timed),
    }


HINTS_EVERY_S = 30.0  # each job's rank 0 reports hints every ~30 s


def node_agent_reads(store: Store, metrics: str, repeats: int = 3) -> dict:
    """What one node agent's reconciliation reads: ``NodeAgent._read_jobs`` (the whole
    jobs/ prefix), median wall time and the KB etcd sent for it."""
    import shutil

    from pollux_launch.launcher.node_agent import NodeAgent
    from pollux_launch.messages import NodeInfo

    agent = NodeAgent(store, NodeInfo("node0000", 8), "etcd://unused", lease_ttl=3600)
    times, kb = [], []
    try:
        for _ in range(repeats):
            m0 = etcd_counters(metrics)
            t0 = time.perf_counter()
            agent._read_jobs()
            times.append((time.perf_counter() - t0) * 1000)
            kb.append(counter_delta(etcd_counters(metrics), m0).get("sent_bytes", 0) / 1024)
    finally:
        shutil.rmtree(agent.runtime_dir, ignore_errors=True)
    kv_kb = sum(len(kv.key) + len(kv.value) for kv in store.get_prefix("jobs/")) / 1024
    return {"ms": statistics.median(times), "kb": statistics.median(kb), "kv_kb": kv_kb}


def print_coordinator(c: dict) -> None:
    print(f"\ncoordinator: {c['nodes']} nodes x {c['slots_per_node']} slots ({c['gpus']} GPUs,"
          f" {c['gpus_allocated']} allocated), {c['jobs']} jobs, {c['store_keys']} store keys"
          f" ({c['rdzv_keys']} of them rendezvous keys)")
    print(f"  round: median {c['round_ms']:.0f} ms, p95 {c['round_ms_p95']:.0f} ms, CPU "
          f"{c['round_cpu_ms']:.0f} ms (cold first round {c['cold_round_ms']:.0f} ms); "
          f"{c['writes_per_round']:.0f} allocations written per round")
    print(f"  etcd: {c['etcd_requests_per_round']:.0f} requests per round (median; the first "
          f"timed round: {c['etcd_requests_by_method']}), {c['etcd_sent_kb_per_round']:.0f} "
          "KB sent; "
          f"client side {c['store_calls_per_round']:.0f} store calls, "
          f"{c['kb_read_per_round']:.0f} KB of key-values read")
    print(f"  one node agent's reconciliation read (all of jobs/): "
          f"{c['node_agent_read_ms']:.0f} ms, {c['node_agent_read_kb']:.0f} KB; every change "
          f"under jobs/ wakes all {c['nodes']} agents into one (hints alone: "
          f"{c['jobs'] / HINTS_EVERY_S:.0f}/s): ~{c['node_agents_read_mb_per_s_estimate']} "
          "MB/s from etcd (estimate)")
    parts = ", ".join(f"{k} {v:.0f} ms" for k, v in c["parts_ms"].items())
    print(f"  where a round's time goes (medians): {parts}")
    print("  profile of one round (top functions by own time):")
    lines = [ln for ln in c["profile"].splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    for ln in lines[start:start + 15]:
        print("    " + ln.strip()[:150])


# ======================================================================================


def sizes(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes numbers like 2,4,8, got {text!r}") \
            from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError("--sizes: each size must be >= 1")
    return out


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.rounds < 1 or args.coord_rounds < 1 or args.nodes < 1 or args.jobs < 1:
        raise UsageError("--rounds, --coord-rounds, --nodes and --jobs must be >= 1")
    if args.skip_rounds and args.skip_coordinator:
        raise UsageError("--skip-rounds and --skip-coordinator leave nothing to measure")
    stores = ["etcd", "embedded"] if args.store == "both" else [args.store]
    with tempfile.TemporaryDirectory(prefix="pollux-rdzv-scale-") as tmp:
        res: dict[str, dict[int, dict]] = {}
        for kind in [] if args.skip_rounds else stores:
            with report.case(f"rounds_{kind}"):
                res.update(run_rounds(args, [kind], Path(tmp)))
        if res:
            print_rounds(res, args)
            for kind, key in (("etcd", "round_s"), ("embedded", "round_s_embedded")):
                if kind in res:
                    report[key] = {str(n): r["round_s"] for n, r in res[kind].items()}
            report["store_ops_per_round"] = {
                kind: {str(n): r["store_ops"] for n, r in per.items()}
                for kind, per in res.items()}
            for key in ("rdzv_s", "close_s", "group_s"):
                report[key] = {kind: {str(n): r[key] for n, r in per.items()}
                            for kind, per in res.items()}
            report["store_kb_read_per_round"] = {
                kind: {str(n): r["store_kb_read"] for n, r in per.items()}
                for kind, per in res.items()}
            if "etcd" in res:
                report["etcd_server_requests_per_round"] = {
                    str(n): r["etcd_requests"] for n, r in res["etcd"].items()}
            report["growth_exponent"] = {
                kind: {"round_s": growth({n: r["round_s"] for n, r in per.items()}),
                       "close_s": growth({n: r["close_s"] for n, r in per.items()}),
                       "store_ops": growth({n: r["store_ops"] for n, r in per.items()}),
                       "store_kb_read": growth({n: r["store_kb_read"]
                                                for n, r in per.items()})}
                for kind, per in res.items()}
        if not args.skip_coordinator:
            with report.case("coordinator"):
                c = run_coordinator(args, Path(tmp))
                print_coordinator(c)
                report[f"coordinator_round_ms_{args.nodes}_nodes"] = c["round_ms"]
                report["coordinator_round_ms_p95"] = c["round_ms_p95"]
                report["coordinator_round_cpu_ms"] = c["round_cpu_ms"]
                report["etcd_requests_per_round"] = c["etcd_requests_per_round"]
                report["coordinator"] = {k: v for k, v in c.items() if k != "profile"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=sizes, default=list(SIZES),
                   help="worker counts (default 2,4,8,16,32)")
    p.add_argument("--store", choices=["etcd", "embedded", "both"], default="both")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per size (default 4)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds between rounds (default 1)")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="workers' lease TTL (5 s)")
    p.add_argument("--watch-timeout", type=float, default=1.0,
                   help="workers' watch_timeout (RendezvousConfig; default 1 s)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds the workers may take to start and form round 1")
    p.add_argument("--round-timeout", type=float, default=300.0)
    p.add_argument("--skip-rounds", action="store_true", help="the coordinator part only")
    p.add_argument("--skip-coordinator", action="store_true", help="the rounds only")
    p.add_argument("--nodes", type=int, default=1024, help="coordinator: nodes (1024)")
    p.add_argument("--slots", type=int, default=8, help="coordinator: GPUs per node (8)")
    p.add_argument("--jobs", type=int, default=400, help="coordinator: jobs (400)")
    p.add_argument("--modelled", type=float, default=0.9,
                   help="fraction of jobs whose hints carry a fitted model (0.9)")
    p.add_argument("--hint-refresh", type=float, default=1.0,
                   help="fraction of modelled jobs re-reporting hints between rounds (1.0: "
                   "hints every ~30 s against a 60 s coordinator interval)")
    p.add_argument("--churn", type=float, default=0.01,
                   help="fraction of jobs finishing (and as many arriving) per round")
    p.add_argument("--coord-rounds", type=int, default=20,
                   help="timed coordinator rounds (default 20)")
    p.add_argument("--no-rdzv-keys", action="store_true",
                   help="leave the running jobs' rendezvous keys out of the store")
    p.add_argument("--seed", type=int, default=0)
    # worker mode (started by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store-url", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", help=argparse.SUPPRESS)
    if "--worker" in (sys.argv[1:] if argv is None else argv):  # started by the driver
        return worker_main(p.parse_args(argv))
    return run_benchmark(p, bench, argv=argv, smoke={
        "sizes": [2], "rounds": 1, "settle": 0.2, "nodes": 16, "jobs": 8, "coord_rounds": 2})


if __name__ == "__main__":
    sys.exit(main())
