"""A torch.distributed.elastic script: ``@record`` on ``main``, torchrun's variables read back.

Plain torch only. Every rank writes what it saw (``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_MAX_RESTARTS``, ``GROUP_RANK``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``, the all-reduced sum of the ranks) to
``RESULT.rank<R>.attempt<RESTART_COUNT>.json``, and rank 0 writes ``RESULT`` (the same,
with every rank's record of this attempt) at the end::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 elastic_record.py \\
        --result r.json --fail-once

``--fail-once``: rank 1 raises in the first attempt (restart count 0), after the process
group formed, so that the launcher must end rank 0 too and restart both; ``@record``
writes the exception to torchrun's error file. ``--exit-code N``: fail with
``sys.exit(N)`` instead of an exception; ``--abort``: crash with ``os.abort()`` (SIGABRT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

VARS = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--result", required=True)
    p.add_argument("--fail-once", action="store_true",
                   help="rank 1 fails in the first attempt (TORCHELASTIC_RESTART_COUNT 0)")
    p.add_argument("--exit-code", type=int, default=None,
                   help="with --fail-once: sys.exit(N) instead of raising")
    p.add_argument("--abort", action="store_true",
                   help="with --fail-once: os.abort() instead of raising (a crash: SIGABRT)")
    args = p.parse_args()

    seen = {name: os.environ.get(name) for name in VARS}
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    seen.update(pid=os.getpid(), rank=rank, world=world, rank_sum=float(total), t=time.time())
    with open(f"{args.result}.rank{rank}.attempt{restarts}.json", "w") as f:
        json.dump(seen, f)

    if args.fail_once and rank == 1 and restarts == 0:
        if args.abort:
            os.abort()
        if args.exit_code is not None:
            sys.exit(args.exit_code)
        raise RuntimeError("rank 1 fails in its first attempt (--fail-once)")

    everyone: list[dict | None] = [None] * world
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({**seen, "ranks": everyone}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
