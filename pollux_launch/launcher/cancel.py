"""``pollux-run cancel JOB``: mark a job cancelled; its node agents stop its workers."""

from __future__ import annotations

import argparse
import sys
import time

from .. import keys
from ..messages import JobStatus, encode
from .store_args import add_store_arguments, open_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("job", help="name of the job to cancel")


def run(args: argparse.Namespace) -> int:
    store, _ = open_from_args(args)
    with store:
        if store.get(keys.job(args.job, "spec")) is None:
            print(f"pollux-run cancel: no job named {args.job!r}; see `pollux-run status`",
                  file=sys.stderr)
            return 1
        status = JobStatus("cancelled", 130, "cancelled by pollux-run cancel", time.time())
        store.put(keys.job(args.job, "status"), encode(status))
    print(f"cancelled {args.job}")
    return 0
