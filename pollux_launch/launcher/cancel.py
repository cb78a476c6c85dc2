"""``pollux-run cancel JOB``: mark a job cancelled; its node agents stop its workers."""

from __future__ import annotations

import argparse
import sys
import time

from .. import keys
from ..arguments import name
from ..messages import JobStatus, MessageError, decode, encode
from ..rendezvous.store import Compare, Put
from ..rendezvous.store.cli_args import add_store_arguments, open_from_args
from .slurm_allocation import find_allocation_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("job", type=name, help="name of the job to cancel")


def run(args: argparse.Namespace) -> int:
    find_allocation_store(args)  # (inside a `pollux-run --slurm` allocation: its store)
    store, _ = open_from_args(args)
    with store:
        if store.get(keys.job(args.job, "spec")) is None:
            print(f"pollux-run cancel: no job named {args.job!r}; see `pollux-run status`",
                  file=sys.stderr)
            return 1
        key = keys.job(args.job, "status")
        current = store.get(key)
        try:
            old = decode(JobStatus, current.value) if current else None
        except MessageError as exc:  # replaced by the cancellation: say what it was
            print(f"pollux-run cancel: replacing job {args.job!r}'s malformed status ({exc})",
                  file=sys.stderr)
            old = None
        if old is not None and old.finished:
            print(f"pollux-run cancel: job {args.job!r} already {old.state}; its name can "
                  "be used again", file=sys.stderr)
            return 1
        status = JobStatus("cancelled", 130, "cancelled by pollux-run cancel", time.time())
        guard = [keys.job_exists(args.job),
                 Compare(key, "mod_revision", "==", current.mod_revision if current else 0)]
        if not store.txn(guard, [Put(key, encode(status))]):
            print(f"pollux-run cancel: job {args.job!r} changed meanwhile; run it again",
                  file=sys.stderr)
            return 1
    print(f"cancelled {args.job}; its name can be used again")
    return 0
