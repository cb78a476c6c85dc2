"""Store flags shared by every ``pollux-run`` subcommand that talks to the cluster
(the launcher, the node agent, the coordinator, status, cancel).

They live with the store, not with any one subcommand, so that the launcher and the
coordinator both depend on the store and never on each other. TLS and auth options pass
through to the etcd client. A password is never taken on the command line (it would
show in ``ps``): it comes from ``--password-file`` or the ``POLLUX_STORE_PASSWORD``
environment variable, and is never logged.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pollux_launch import env as envvars

from . import Store, StoreError, open_store

DEFAULT_URL = "embedded://"
PASSWORD_ENV = envvars.STORE_PASSWORD


def add_store_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    g = parser.add_argument_group("store")
    g.add_argument("--store", default=default,
                   help="etcd://host:port[,host:port...] or embedded:///path "
                   f"(default: {default or 'an embedded store on this machine'})")
    g.add_argument("--store-prefix", default=envvars.DEFAULT_PREFIX,
                   help=f"key prefix of this cluster (default {envvars.DEFAULT_PREFIX})")
    g.add_argument("--ca-cert", help="etcd TLS: CA certificate file")
    g.add_argument("--cert", dest="cert_cert", help="etcd TLS: client certificate file")
    g.add_argument("--key", dest="cert_key", help="etcd TLS: client key file")
    g.add_argument("--user", help="etcd user name")
    g.add_argument("--password-file", help=f"etcd password file (or ${PASSWORD_ENV})")


def store_options(ns: argparse.Namespace) -> dict[str, object]:
    """Backend options from the flags (only those given)."""
    opts: dict[str, object] = {}
    for name in ("ca_cert", "cert_cert", "cert_key", "user"):
        value = getattr(ns, name, None)
        if value:
            opts[name] = value
    password = None
    if getattr(ns, "password_file", None):
        try:
            password = Path(ns.password_file).read_text().strip()
        except OSError as exc:
            raise StoreError(f"--password-file {ns.password_file}: {exc.strerror}") from None
    password = password or os.environ.get(PASSWORD_ENV)
    if password:
        opts["password"] = password
    return opts


def open_from_args(ns: argparse.Namespace) -> tuple[Store, str]:
    url = getattr(ns, "store", None) or DEFAULT_URL
    return open_store(url, ns.store_prefix, **store_options(ns)), url


def worker_store_env(ns: argparse.Namespace) -> dict[str, str]:
    """What lets a job's processes reach the same store: its TLS files, as absolute
    paths. Never the user or password given here: the node agent that starts a process
    gives it the job's own credentials (``Store.scoped_credentials``)."""
    env = {}
    for name, var in (("ca_cert", envvars.STORE_CA_CERT), ("cert_cert", envvars.STORE_CERT),
                      ("cert_key", envvars.STORE_KEY)):
        value = getattr(ns, name, None)
        if value:
            env[var] = os.path.abspath(value)
    return env
