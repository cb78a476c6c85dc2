"""Horovod host-discovery entry point: print a job's current allocation as ``host:slots``.

::

    python -m pollux_launch.adapters.horovod.launch.discover --store URL --job NAME [--prefix P]

Horovod's elastic driver runs its discovery script about once a second, so this module
imports nothing heavy (no torch, numpy or horovod: the JSON message types and the store
only). Where ``pollux-run`` itself is running, prefer the cheaper path: a
:class:`~.hosts.HostsFileMirror` in the launcher and a ``cat`` script
(:func:`~.hosts.write_discovery_script`). Store options (TLS files, credentials) come
from the same ``POLLUX_STORE_*`` environment variables the workers get.

Exit status: 0 with the host list (empty when the job has no allocation yet, which the
driver reads as "no hosts for now"); 2 with one line on stderr for a bad argument or
an unreachable store.
"""

from __future__ import annotations

import argparse
import os
import sys

from pollux_launch import env as envvars
from pollux_launch.rendezvous.store import StoreError, open_store
from pollux_launch.rendezvous.store.environ import store_options

from .hosts import format_hosts, hosts_from_allocation, read_allocation


def discover(store_url: str, job: str, prefix: str = envvars.DEFAULT_PREFIX) -> str:
    """The discovery output for ``job`` (``host:slots`` lines, possibly empty)."""
    store = open_store(store_url, prefix, **store_options())
    try:
        return format_hosts(hosts_from_allocation(read_allocation(store, job)))
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pollux_launch.adapters.horovod.launch.discover",
        description="Print a Pollux job's allocation as Horovod host:slots lines.")
    parser.add_argument("--store", default=os.environ.get(envvars.STORE),
                        help=f"store URL (default: ${envvars.STORE})")
    parser.add_argument("--prefix", default=os.environ.get(envvars.PREFIX, envvars.DEFAULT_PREFIX),
                        help=f"cluster key prefix (default: ${envvars.PREFIX} or "
                        f"{envvars.DEFAULT_PREFIX})")
    parser.add_argument("--job", default=os.environ.get(envvars.JOB),
                        help=f"job name (default: ${envvars.JOB})")
    args = parser.parse_args(argv)
    if not args.store or not args.job:
        print("discover: need --store URL and --job NAME (or POLLUX_STORE and POLLUX_JOB)",
              file=sys.stderr)
        return 2
    try:
        sys.stdout.write(discover(args.store, args.job, args.prefix))
    except (StoreError, ValueError) as exc:
        print(f"discover: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
