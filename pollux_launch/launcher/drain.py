"""``pollux-run drain``: take nodes out of the cluster without stopping a job.

* ``pollux-run drain NODE...``: the coordinator offers the nodes no slots (a
  ``NodeDrain`` under ``drains/<node>``), so at its next round every job moves off them -
  live jobs re-form without their workers there, which leave after handing over their
  state; ``--wait`` returns once no worker of any job runs there. ``--undo`` ends the
  drain.
* ``pollux-run drain --num-nodes N``, inside a ``pollux-run --slurm`` allocation (or with
  its ``SLURM_JOB_ID`` set): ``scontrol update JobId=... NumNodes=N`` done right. Slurm
  kills whatever runs on the nodes a resize releases at once, so this picks the nodes to
  release (:func:`pick_release`: never the batch node; those running the fewest workers,
  the last listed first), drains them, waits until none runs a worker, and only then
  releases exactly those (``scontrol update JobId=... NodeList=<the others>``).

Exit codes: 0 done; 1 the nodes were not drained within ``--timeout`` (they stay
drained, nothing is released); 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import env as envvars
from .. import keys
from ..arguments import OptionsError, count, name, seconds
from ..messages import Allocation, JobStatus, MessageError, NodeDrain, NodeInfo, decode, encode
from ..rendezvous.store import Store
from ..rendezvous.store.cli_args import add_store_arguments, open_from_args
from .slurm_allocation import AllocationError, find_allocation_store, scontrol, scontrol_fields

SAY_EVERY = 10.0  # s between progress lines while waiting


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("nodes", nargs="*", type=name, metavar="NODE",
                        help="the nodes to drain (as `pollux-run status` names them)")
    parser.add_argument("--num-nodes", type=count, default=None, metavar="N",
                        help="in a Slurm allocation: shrink it to N nodes, the released "
                        "ones drained first (instead of scontrol update NumNodes=N)")
    parser.add_argument("--wait", action="store_true",
                        help="return once no worker runs on the nodes")
    parser.add_argument("--undo", action="store_true", help="end the nodes' drain")
    parser.add_argument("--timeout", type=seconds, default=600.0,
                        help="seconds --wait / --num-nodes wait for the nodes to empty "
                        "(default 600)")
    parser.add_argument("--reason", default="pollux-run drain",
                        help="why (shown in the store; at most 200 characters)")


def run(args: argparse.Namespace) -> int:
    if bool(args.nodes) == (args.num_nodes is not None):
        raise OptionsError("pollux-run drain: give the NODEs to drain, or --num-nodes N "
                           "inside a Slurm allocation")
    if len(args.reason) > 200:
        raise OptionsError("--reason: at most 200 characters")
    find_allocation_store(args)
    if args.num_nodes is not None and args.undo:
        raise OptionsError("--undo: name the NODEs whose drain ends")
    release: list[str] = []
    store, _ = open_from_args(args)
    with store:
        if args.num_nodes is not None:
            job_id, release, kept = _slurm_release(args.num_nodes, store)
        targets = release or list(args.nodes)
        if args.undo:
            for node in targets:
                store.delete(keys.drain(node))
            print(f"drain of {', '.join(targets)} ended")
            return 0
        for node in targets:
            store.put(keys.drain(node), encode(NodeDrain(node, args.reason, time.time())))
        print(f"draining {', '.join(targets)}: their jobs move off them", flush=True)
        if not (args.wait or release):
            return 0
        if not _wait_empty(store, targets, args.timeout):
            print(f"pollux-run drain: {', '.join(targets)} still run workers after "
                  f"{args.timeout:.0f} s; they stay drained"
                  + (", nothing released" if release else ""), file=sys.stderr)
            return 1
        if not release:
            print(f"{', '.join(targets)}: drained, no worker left")
            return 0
        scontrol("update", f"JobId={job_id}", f"NodeList={','.join(kept)}")
        for node in release:  # (gone from the allocation: their agents end with them)
            store.delete(keys.drain(node))
    print(f"[pollux] Slurm job {job_id}: released {', '.join(release)} after draining them; "
          f"{len(kept)} node(s) left ({', '.join(kept)})")
    return 0


def _slurm_release(num_nodes: int, store: Store) -> tuple[str, list[str], list[str]]:
    """(job id, nodes to release, nodes kept) for shrinking the allocation to
    ``num_nodes``. Raises AllocationError (one line)."""
    job_id = os.environ.get(envvars.SLURM_JOB_ID)
    if not job_id:
        raise AllocationError("--num-nodes: not inside a Slurm allocation (no SLURM_JOB_ID)")
    fields = scontrol_fields("show", "job", job_id)
    nodes = scontrol("show", "hostnames", fields.get("NodeList", "")).split()
    batch = fields.get("BatchHost", "")
    if not 1 <= num_nodes < len(nodes):
        raise AllocationError(f"--num-nodes {num_nodes}: Slurm job {job_id} has "
                              f"{len(nodes)} node(s); give a number from 1 to "
                              f"{len(nodes) - 1}")
    release = pick_release(nodes, batch, _busy(store, set(nodes)), len(nodes) - num_nodes)
    return job_id, release, [n for n in nodes if n not in release]


def pick_release(nodes: list[str], batch: str, busy: dict[str, int], count: int) -> list[str]:
    """The ``count`` nodes to release: never ``batch`` (it runs the script: releasing it
    would end the allocation); those running the fewest workers (``busy``: per node),
    the last listed first - what moves the least work."""
    candidates = [n for n in reversed(nodes) if n != batch]
    return sorted(candidates, key=lambda n: busy.get(n, 0))[:count]


def _wait_empty(store: Store, nodes: list[str], timeout: float) -> bool:
    """Until no worker runs on ``nodes`` (their agents' records) and no unfinished job's
    allocation places one there; False after ``timeout``."""
    deadline, said = time.monotonic() + timeout, time.monotonic()
    while True:
        left = _busy(store, set(nodes))
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        if time.monotonic() - said > SAY_EVERY:
            said = time.monotonic()
            print("waiting: " + "; ".join(f"{n}: {k} worker(s)" for n, k in sorted(left.items())),
                  flush=True)
        time.sleep(0.5)


def _busy(store: Store, nodes: set[str]) -> dict[str, int]:
    """Per node of ``nodes``: the workers that still run or are placed there."""
    busy: dict[str, int] = {}
    for kv in store.get_prefix(keys.NODES):
        try:
            node = decode(NodeInfo, kv.value)
        except MessageError:
            continue  # (a malformed record runs nothing that we could wait for)
        if node.name in nodes and (running := sum(node.workers.values())):
            busy[node.name] = running
    finished: set[str] = set()
    allocations: dict[str, Allocation] = {}
    for kv in store.get_prefix(keys.JOBS):
        split = keys.split_job_key(kv.key)
        try:
            if split and split[1] == "status" and decode(JobStatus, kv.value).finished:
                finished.add(split[0])
            elif split and split[1] == "allocation":
                allocations[split[0]] = decode(Allocation, kv.value)
        except MessageError:
            continue  # (the coordinator says so; it places nothing we could wait for)
    for job, alloc in allocations.items():
        if job not in finished:
            for node in alloc.nodes:
                if node in nodes:
                    busy[node] = max(busy.get(node, 0), alloc.nodes.count(node))
    return busy
