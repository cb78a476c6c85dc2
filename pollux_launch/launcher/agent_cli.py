"""``pollux-run agent``: the node agent of a multi-node cluster, one per node.

Foreground, logs to stdout, SIGTERM drains (workers get SIGTERM, the node's lease is
revoked) - systemd-friendly. Runs only job specs signed with the cluster secret when
one is configured (``--secret-file`` or $POLLUX_SECRET).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time

from .. import env as envvars
from ..arguments import gpu_type_flag, lease_seconds, name, node_address
from ..arguments import slots as slot_count
from ..messages import NodeInfo
from ..rendezvous.network import advertised_address, interface_of
from ..rendezvous.store.cli_args import add_store_arguments, open_from_args
from . import security
from .devices import detect_gpus, gpu_type, node_slots, parse_gpus
from .logs import state_home
from .node_agent import NodeAgent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--node-name", type=name,
                        default=os.environ.get(envvars.SLURMD_NODENAME) or socket.gethostname(),
                        help="this node's name (default: Slurm's name for it where srun "
                        "started the agent, else the host name)")
    parser.add_argument("--slots", type=slot_count, default=None,
                        help="workers this node can run (default: its GPUs, else CPU cores)")
    parser.add_argument("--gpus", default=None, metavar="N|IDS",
                        help="this node's GPUs, each worker holding one: a count or "
                        "CUDA_VISIBLE_DEVICES ids (0,2,5); 'none' for CPU slots (default: "
                        "those of CUDA_VISIBLE_DEVICES, else the driver's)")
    parser.add_argument("--gpu-type", type=gpu_type_flag, default=None, metavar="NAME",
                        help="this node's GPU type, e.g. A100 (default: the driver's model "
                        "name; 'cpu' for CPU slots): a job never spans two types")
    parser.add_argument("--address", type=node_address, default=None,
                        help="address other nodes reach this one at: an IP address, or a "
                        "host name that resolves (default: this host's address on the "
                        "route to the store)")
    parser.add_argument("--network-interface", default=None, metavar="NIC",
                        help="interface the workers' transports (gloo, NCCL sockets) bind "
                        "(default: the one carrying --address)")
    parser.add_argument("--secret-file", help="cluster secret (or $POLLUX_SECRET)")
    parser.add_argument("--output-filename", help="directory for per-worker logs")
    parser.add_argument("--state-dir", default=None,
                        help="where the agent keeps what outlives it, e.g. the submissions "
                        "it finished (default: $XDG_STATE_HOME or ~/.local/state, then "
                        "pollux-launch/agent-NODE)")
    parser.add_argument("--log-dir", default=None,
                        help="where the agent keeps its jobs' output, one folder per job, "
                        "served to `pollux-run logs` (default: STATE_DIR/logs)")
    parser.add_argument("--lease-ttl", type=lease_seconds, default=5.0,
                        help="registration lease (seconds)")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s agent[{args.node_name}] %(levelname)s %(message)s")
    gpus = parse_gpus(args.gpus) if args.gpus is not None else detect_gpus()
    slots = node_slots(gpus, args.slots)
    secret = security.load_secret(args.secret_file)
    state_dir = args.state_dir or str(state_home() / "pollux-launch" / f"agent-{args.node_name}")
    if secret is None:
        logging.warning("no cluster secret set: this agent runs any job in the store")
    store, url = open_from_args(args)
    address = args.address or advertised_address(store)
    if args.network_interface and interface_of(address) not in (None, args.network_interface):
        logging.warning("--network-interface %s does not carry --address %s",
                        args.network_interface, address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    node = NodeInfo(args.node_name, slots, address, time.time(),
                    gpu_type=args.gpu_type or gpu_type(gpus))
    nic = args.network_interface or interface_of(address) or "(none found: transports default)"
    logging.info("node %s: %d slots%s of type %s at %s (interface %s), store %s", node.name,
                 slots, f" (GPUs {','.join(gpus)})" if gpus else "", node.gpu_type, address,
                 nic, url)
    with store:
        NodeAgent(store, node, url, args.store_prefix, secret=secret,
                  output_dir=args.output_filename, lease_ttl=args.lease_ttl,
                  ifname=args.network_interface, state_dir=state_dir,
                  log_dir=args.log_dir or os.path.join(state_dir, "logs"),
                  gpus=gpus).serve(stop)
    return 0
