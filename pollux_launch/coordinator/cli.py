"""``pollux-run coordinator``: the scheduling service of a multi-node cluster.

Foreground, logs to stdout, SIGTERM/SIGINT stop it cleanly (systemd-friendly). Run
several for active/standby: one leads under a store lease, the others wait.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from ..arguments import fairness, lease_seconds, seconds, seconds_or_zero
from ..policy import DEFAULT_POLICY, POLICIES, make_policy
from ..rendezvous.store.cli_args import add_store_arguments, open_from_args
from .service import Coordinator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                        help=f"search engine (default {DEFAULT_POLICY})")
    parser.add_argument("--fairness", type=fairness, default=-1.0,
                        help="fairness knob p (Eqn 14), in [-100, 1], not 0")
    parser.add_argument("--interval", type=seconds, default=60.0, help="seconds between rounds")
    parser.add_argument("--realloc-delay", type=seconds_or_zero, default=30.0,
                        help="expected seconds lost per re-allocation (delta of the penalty)")
    parser.add_argument("--no-interference-avoidance", action="store_true",
                        help="allow several multi-node jobs to share a node")
    parser.add_argument("--lease-ttl", type=lease_seconds, default=10.0,
                        help="leadership lease; a standby takes over this long after a crash")
    parser.add_argument("--node-grace", type=seconds_or_zero, default=40.0, metavar="S",
                        help="seconds a node may be missing from the store (agent dead, or "
                        "its lease lost in a store outage) before its jobs are moved; make "
                        "it outlast the store stalls to ride out (default 40)")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    policy = make_policy(args.policy, p=args.fairness, delta=args.realloc_delay,
                         interference_avoidance=not args.no_interference_avoidance)
    store, url = open_from_args(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.info("serving %s with policy %s every %.0f s", url, policy.name, args.interval)
    with store:
        Coordinator(store, policy, interval=args.interval, lease_ttl=args.lease_ttl,
                    node_grace=args.node_grace).serve(stop)
    return 0
