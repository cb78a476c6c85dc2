"""Live re-sharding of an FSDP2 job: pauses, bytes moved, memory - next to DDP's pauses.

    python benchmarks/sharded_rescale.py --params 100M --repeats 2
    python benchmarks/rescale.py --sharding fsdp --params 100M     # the same

Real workers (benchmarks/sharded_worker.py: rescale.py's MLP, 256-H-H-256, with Adam) are
started by a real node agent on an embedded store and trained by ``ElasticTrainer`` over
gloo; the driver plays the coordinator: 2 replicas, then ``--repeats`` cycles of up
(2 -> 4) and down (4 -> 2). The same cycles run twice: the model sharded with FSDP2
(``sharding="fsdp"``: re-sharded in place) and in DDP (state shared with newcomers).

* ``up_pause_s`` / ``down_pause_s``: median survivors' pause (the controller's: from the
  step boundary that votes to re-form to the new group's first decision), FSDP; where
  it goes: ``*_formed_s`` (to the new group formed: the old group's hand-off
  included), ``*_rebuilt_s`` (and the newcomers' shards moved and installed);
  ``ddp_up_pause_s`` / ``ddp_down_pause_s``: the same for DDP;
* ``bytes_moved``: the most bytes one rank received in a grow (p2p, both phases);
* ``p2p_gbps``: gloo send/recv between two processes of this machine, of that size,
  measured in the same run (median of 3); ``pause_vs_limit``: up pause / (bytes moved /
  that bandwidth) - the goal is <= 1.5;
* ``peak_extra_mem_ratio``: the most resident memory a rank gained during a change (its
  peak since the step boundary that voted, Linux VmHWM) over its new shard of the model
  and Adam state (goal <= 2.0).

``--sharding zero3`` is refused (one line): ZeRO-3 does not re-shard live yet. The LAST
line is one JSON object. ``--smoke``: one cycle of a small model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, UsageError, run_benchmark
from rescale import mlp_dims, param_count, parse_count

WORKER = Path(__file__).with_name("sharded_worker.py")


def _records(log_dir: Path) -> list[dict]:
    out = []
    for f in log_dir.glob("*.jsonl"):
        out += [{**json.loads(ln), "worker": f.stem}
                for ln in f.read_text().splitlines() if ln.strip()]
    return out


def cycle(sharding: str, params: int, repeats: int, timeout: float = 600) -> dict[str, Any]:
    """One job through 2, then ``repeats`` x (4, 2) replicas; its workers' records."""
    from pollux_launch import keys
    from pollux_launch.launcher.node_agent import NodeAgent
    from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
    from pollux_launch.rendezvous.store import open_store

    with tempfile.TemporaryDirectory(prefix="pollux-sharded-") as tmp:
        url, log_dir = f"embedded://{tmp}/store.db", Path(tmp) / "logs"
        log_dir.mkdir()
        store = open_store(url)
        env = {"LOG_DIR": str(log_dir), "PARAMS": str(params), "SHARDING": sharding,
               "OMP_NUM_THREADS": "1"}
        store.put(keys.job("sb", "spec"), encode(JobSpec(
            name="sb", command=(sys.executable, str(WORKER)), env=env)))
        agent = NodeAgent(store, NodeInfo("n1", 4), url, only_jobs={"sb"}, poll=0.2)
        stop = threading.Event()
        thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
        thread.start()
        sizes = [2] + [4, 2] * repeats
        try:
            for version, replicas in enumerate(sizes, start=1):
                store.put(keys.job("sb", "allocation"),
                          encode(Allocation(version, ("n1",) * replicas)))
                deadline = time.monotonic() + timeout
                while sum(1 for r in _records(log_dir)
                          if r["kind"] == "step" and r["round"] >= version) < 3:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{sharding or 'ddp'}: no 3 steps on {replicas} "
                                           f"replicas within {timeout:g} s")
                    kv = store.get(keys.job("sb", "status"))
                    if kv and decode(JobStatus, kv.value).finished:
                        raise RuntimeError(f"the job ended: {decode(JobStatus, kv.value)}")
                    time.sleep(0.2)
                print(f"{sharding or 'ddp'}: {replicas} replicas trained", flush=True)
            (log_dir / "stop").touch()
            deadline = time.monotonic() + 120
            while not ((kv := store.get(keys.job("sb", "status")))
                       and decode(JobStatus, kv.value).finished):
                if time.monotonic() > deadline:
                    raise RuntimeError("the job did not end within 120 s")
                time.sleep(0.2)
        finally:
            stop.set()
            thread.join(timeout=60)
            store.close()
        return {"records": _records(log_dir), "exits": list(agent.exits)}


def _pauses(records: list[dict], frm: int, to: int, key: str = "pause_s") -> list[float]:
    """One figure per rescale from ``frm`` to ``to`` replicas: the slowest survivor's
    ``key`` (the controller's timing: ``formed_s`` - the vote to the new group formed,
    the hand-off included; ``rebuilt_s`` - and the state moved; ``pause_s`` - and the
    first decision)."""
    seen: dict[int, float] = {}
    for r in records:
        if r["kind"] == "pause" and r.get("from") == frm and r.get("to") == to:
            seen[r["round"]] = max(seen.get(r["round"], 0.0), r.get(key) or 0.0)
    return list(seen.values())


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _p2p_probe(rank: int, world: int, nbytes: int, port: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.ones(max(1, nbytes // 4))
    times = []
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times[1:])))
    dist.destroy_process_group()


def p2p_gbps(nbytes: int) -> float:
    """gloo send/recv of ``nbytes`` between two processes here, in GB/s."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_p2p_probe, args=(r, 2, nbytes, port, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        seconds = json.loads(Path(out).read_text())
    return nbytes / seconds / 1e9


def measure(sharding: str, params: int | None, repeats: int) -> dict[str, Any]:
    """Both runs and the probe (module docstring)."""
    if sharding != "fsdp":
        raise UsageError(f"--sharding {sharding}: only fsdp re-shards live so far (ZeRO-3 "
                         "does not yet: its jobs restart)")
    n = param_count(mlp_dims(params))
    state = n * 4 * 3  # fp32 parameters and Adam's two moments
    fsdp = cycle("fsdp", params or 0, repeats)
    ddp = cycle("", params or 0, repeats)
    rec = fsdp["records"]
    moved = max((r["moved"] or 0 for r in rec if r["kind"] == "change" and r["world"] == 4),
                default=0)
    extra = [r["extra"] / (state / r["world"]) for r in rec if r["kind"] == "change"]
    up, down = _median(_pauses(rec, 2, 4)), _median(_pauses(rec, 4, 2))
    gbps = p2p_gbps(max(moved, 1 << 20))
    return {
        "sharding": sharding, "params": n, "state_bytes": state, "repeats": repeats,
        "bytes_moved": moved, "p2p_gbps": round(gbps, 3),
        "up_pause_s": up, "down_pause_s": down,
        "pause_vs_limit": (round(up / (moved / (gbps * 1e9)), 3) if up and moved else None),
        "peak_extra_mem_ratio": round(max(extra), 3) if extra else None,
        "up_formed_s": _median(_pauses(rec, 2, 4, "formed_s")),
        "up_rebuilt_s": _median(_pauses(rec, 2, 4, "rebuilt_s")),
        "down_formed_s": _median(_pauses(rec, 4, 2, "formed_s")),
        "down_rebuilt_s": _median(_pauses(rec, 4, 2, "rebuilt_s")),
        "ddp_up_pause_s": _median(_pauses(ddp["records"], 2, 4)),
        "ddp_down_pause_s": _median(_pauses(ddp["records"], 4, 2)),
        "exits_ok": all(c == 0 for _, _, c in fsdp["exits"] + ddp["exits"]),
    }


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    with report.case("sharded"):
        result = measure(args.sharding, args.params, args.repeats)
        report.check("exits", result.pop("exits_ok"), "a worker exited non-zero")
        report.update(result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sharding", choices=["fsdp", "zero3"], default="fsdp")
    p.add_argument("--params", type=parse_count, default=None, metavar="N",
                   help="model size, e.g. 10M, 100M (default: the ~0.92M MLP)")
    p.add_argument("--repeats", type=int, default=3, help="2->4->2 cycles (default 3)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_benchmark(p, bench, argv=argv, smoke={"repeats": 1})


if __name__ == "__main__":
    sys.exit(main())
