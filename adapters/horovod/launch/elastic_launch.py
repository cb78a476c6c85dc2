"""``python -m pollux_launch.adapters.horovod.launch.elastic_launch``: Horovod Elastic's driver for
a job whose hosts are other machines' node agents (what ``horovodrun`` would be, minus ssh).

Run by the launcher-side ``HorovodDriver`` in cluster mode, with the job's ``POLLUX_*``
environment. It runs Horovod's own elastic gloo launcher (Horovod 0.28.1's
``launch_gloo_elastic``, the public seam that takes the worker-executing function) with:

* host discovery from the job's allocation in the store (node name -> replicas), read
  about once a second by Horovod's driver; a store outage keeps the last hosts;
* :class:`~.tasks.StoreExec` to execute each worker on its node through that node's
  agent (``jobs/<job>/tasks/``), no ssh;
* the interface that carries this host's address (its route to the store) for Horovod's
  rendezvous server; each node agent binds its own workers to its own interface.

Exit status: 0 when every worker completed, 1 when Horovod reports a failed worker (its
message on stderr), as ``horovodrun`` does; 128+SIG, quietly, when SIGTERM/SIGINT stopped
it (a cancel: Horovod's report of the workers it ended is no failure). With
:func:`~.local_run.install`'s changes: each change of size said in one ``[pollux]`` line,
and each slot of a node a Horovod host of its own (``NODE@N``), so a lost worker costs
its slot - which gets a new worker - not its node.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pollux_launch import env as envvars
from pollux_launch.messages import Allocation, MessageError, ValueLog
from pollux_launch.rendezvous.network import advertised_address, interface_of
from pollux_launch.rendezvous.store import Store, StoreError
from pollux_launch.rendezvous.store.environ import store_from_env

from .hosts import read_allocation
from .local_run import LocalRun, QuietInfo, install
from .tasks import StoreExec, env_for_tasks

log = logging.getLogger(__name__)


def discovery(store: Store, job: str):
    """A Horovod ``HostDiscovery`` over the job's allocation (imported lazily)."""
    from horovod.runner.elastic.discovery import HostDiscovery

    class AllocationDiscovery(HostDiscovery):
        def __init__(self) -> None:
            super().__init__()
            self.last: dict[str, int] = {}
            self.values = ValueLog(log)  # a malformed allocation: said once per revision

        def find_available_hosts_and_slots(self) -> dict[str, int]:
            # keep the hosts we knew meanwhile: a store outage or a bad value must not
            # shrink the job (the outage is reported by whoever writes allocations)
            try:
                alloc: Allocation | None = read_allocation(store, job, self.values)
            except (StoreError, MessageError):
                return dict(self.last)
            hosts: dict[str, int] = {}
            for node in alloc.nodes if alloc else ():
                hosts[node] = hosts.get(node, 0) + 1
            self.last = hosts
            return dict(hosts)

    return AllocationDiscovery()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, required=True)
    parser.add_argument("--min-np", type=int, required=True)
    parser.add_argument("--max-np", type=int, default=None)
    parser.add_argument("--elastic-timeout", type=int, default=600)
    parser.add_argument("--reset-limit", type=int, default=None)
    parser.add_argument("--cooldown-range", type=int, nargs=2, default=None)
    parser.add_argument("--start-timeout", type=int, default=30)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    handler = logging.StreamHandler(sys.stdout)  # (one stream: LOG_ONLY marks whole lines)
    handler.setFormatter(QuietInfo("%(asctime)s hvd-launch %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])

    from horovod.runner.common.util import secret, timeout
    from horovod.runner.elastic.settings import ElasticSettings
    from horovod.runner.gloo_run import launch_gloo_elastic
    from horovod.runner.http.http_server import RendezvousServer

    store = store_from_env()
    job = os.environ[envvars.JOB]
    nic = interface_of(advertised_address(store))
    if nic is None:
        print("elastic_launch: no interface carries this host's address", file=sys.stderr)
        return 2
    settings = ElasticSettings(
        discovery=discovery(store, job), min_num_proc=args.min_np, max_num_proc=args.max_np,
        elastic_timeout=args.elastic_timeout, reset_limit=args.reset_limit,
        cooldown_range=args.cooldown_range, num_proc=args.np,
        verbose=2 if args.verbose else 0, key=secret.make_secret_key(),
        start_timeout=timeout.Timeout(args.start_timeout, message="Timed out waiting for "
                                      "{activity}; raise --start-timeout"),
        output_filename=None, run_func_mode=False, nics={nic},
        prefix_output_with_timestamp=False)
    run = LocalRun(job, nodes=True)
    install(run)
    try:
        launch_gloo_elastic(command, StoreExec(store, job, command, run), settings,
                            env_for_tasks(os.environ), lambda driver: {nic},
                            RendezvousServer(settings.verbose), sys.executable)
    except RuntimeError as exc:  # how Horovod's elastic launcher reports a failed job
        if run.stopping is not None:
            return 128 + run.stopping
        print(f"elastic_launch: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
