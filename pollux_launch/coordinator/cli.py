"""``pollux-run coordinator``: the scheduling service of a multi-node cluster.

Foreground, logs to stdout, SIGTERM/SIGINT stop it cleanly (systemd-friendly). Run
several for active/standby: one leads under a store lease, the others wait.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import threading
import time

import numpy as np

from ..arguments import (
    OptionsError,
    add_admission_arguments,
    add_autoscale_arguments,
    admission_from_args,
    autoscale_from_args,
    fairness,
    lease_seconds,
    seconds,
    seconds_or_zero,
    slots,
)
from ..calibration import add_calibration_argument, load_rescale_cost
from ..errors import UserError
from ..policy import DEFAULT_POLICY, POLICIES, make_policy
from ..policy.rescale_cost import DEFAULT_STATE_BYTES
from ..rendezvous.store.cli_args import DEFAULT_URL, add_store_arguments, open_from_args
from .autoscaler import Autoscaler
from .provisioners import PROVISIONERS, Provisioner, make_provisioner
from .service import Coordinator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                        help=f"search engine (default {DEFAULT_POLICY})")
    parser.add_argument("--fairness", type=fairness, default=-1.0,
                        help="fairness knob p (Eqn 14), in [-100, 1], not 0")
    parser.add_argument("--interval", type=seconds, default=None,
                        help="seconds between rounds (default: from the calibrated cost of "
                        "a live rescale, 15 s; the paper's checkpoint-restart used 60)")
    add_calibration_argument(parser)
    parser.add_argument("--realloc-delay", type=seconds_or_zero, default=None,
                        help="seconds a change costs every live job (the penalty's delta; "
                        "default: the calibrated pause for each job's state)")
    parser.add_argument("--no-interference-avoidance", action="store_true",
                        help="allow several multi-node jobs to share a node")
    parser.add_argument("--lease-ttl", type=lease_seconds, default=10.0,
                        help="leadership lease; a standby takes over this long after a crash")
    parser.add_argument("--node-grace", type=seconds_or_zero, default=40.0, metavar="S",
                        help="seconds a node may be missing from the store (agent dead, or "
                        "its lease lost in a store outage) before its jobs are moved; make "
                        "it outlast the store stalls to ride out (default 40)")
    add_admission_arguments(parser)
    add_autoscale_arguments(parser)
    parser.add_argument("--provisioner", default="command", choices=sorted(PROVISIONERS),
                        help="--autoscale: how nodes are got and given back (default command)")
    parser.add_argument("--provisioner-command", default="", metavar="EXE",
                        help="--provisioner command: run as `EXE up N` and `EXE down NODE...`")
    parser.add_argument("--slurm-args", default="", metavar="ARGS",
                        help="--provisioner slurm: extra sbatch arguments (partition, GPUs...)")
    parser.add_argument("--agent-args", default="", metavar="ARGS",
                        help="--provisioner slurm: extra `pollux-run agent` arguments for "
                        "the nodes it starts (e.g. --secret-file PATH --slots 8)")
    parser.add_argument("--node-slots", type=slots, default=None, metavar="N",
                        help="--autoscale: GPUs of a node it would add (default: the "
                        "largest registered node's)")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    try:
        cost = load_rescale_cost(args.rescale_calibration)
        admission = admission_from_args(args)
        autoscale = autoscale_from_args(args)
        provisioner = _provisioner(args) if autoscale is not None else None
    except UserError as exc:  # one line, exit 2 (a bug keeps its traceback)
        logging.error("%s", exc)
        return 2
    interval = args.interval or cost.round_interval("live")
    delta = cost.expected_stall("live", DEFAULT_STATE_BYTES, 4)
    policy = make_policy(args.policy, p=args.fairness,
                         delta=delta if args.realloc_delay is None else args.realloc_delay,
                         interference_avoidance=not args.no_interference_avoidance)
    store, url = open_from_args(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.info("serving %s with policy %s every %.0f s (rescale costs: %s; admission %s)",
                 url, policy.name, interval, cost.source, admission.mode)
    autoscaler = None
    if autoscale is not None:
        assert provisioner is not None
        what_if = make_policy(args.policy, p=args.fairness, delta=0.0,
                              interference_avoidance=not args.no_interference_avoidance)
        autoscaler = Autoscaler(
            autoscale, provisioner,
            lambda jobs, nodes: what_if.optimize(jobs, nodes, np.zeros(
                (len(jobs), len(nodes)), dtype=int)),
            time.time, slots=args.node_slots)
        logging.info("autoscaling %d..%d nodes (%s rule, provisioner %s)",
                     autoscale.min_nodes, autoscale.max_nodes, autoscale.rule,
                     provisioner.name)
    with store:
        Coordinator(store, policy, interval=interval, lease_ttl=args.lease_ttl,
                    node_grace=args.node_grace, cost=cost,
                    live_delay=args.realloc_delay, admission=admission,
                    autoscaler=autoscaler).serve(stop)
    return 0


def _provisioner(args: argparse.Namespace) -> Provisioner:
    if args.provisioner == "command":
        if not args.provisioner_command:
            raise OptionsError("--provisioner command needs --provisioner-command EXE")
        return make_provisioner("command", command=args.provisioner_command)
    agent = ["pollux-run", "agent", "--store", args.store or DEFAULT_URL, "--store-prefix",
             args.store_prefix, *shlex.split(args.agent_args)]
    return make_provisioner("slurm", agent=agent, sbatch_args=args.slurm_args)
