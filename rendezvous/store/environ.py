"""The store a job's process was started with, from its environment (the contract's
names are in ``pollux_launch.env``): the URL, the cluster's prefix, TLS files and the
job's own store user, whose password is read from its file."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pollux_launch import env as envvars

from . import Store, StoreError, open_store


def store_options(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """``open_store`` options for a job's process, from ``environ`` (TLS files, its
    store user and that user's password, read from its file). Raises StoreError."""
    environ = os.environ if environ is None else environ
    opts: dict[str, object] = {}
    for var, name in ((envvars.STORE_CA_CERT, "ca_cert"), (envvars.STORE_CERT, "cert_cert"),
                      (envvars.STORE_KEY, "cert_key"), (envvars.STORE_USER, "user")):
        if environ.get(var):
            opts[name] = environ[var]
    if environ.get(envvars.STORE_PASSWORD_FILE):
        path = environ[envvars.STORE_PASSWORD_FILE]
        try:
            with open(path) as f:
                opts["password"] = f.read().strip()
        except OSError as exc:
            raise StoreError(f"${envvars.STORE_PASSWORD_FILE} {path}: cannot read it "
                             f"({exc.strerror})") from None
    return opts


def store_from_env(environ: Mapping[str, str] | None = None, **options: object) -> Store:
    """The store a job's process was started with (``POLLUX_STORE``, its prefix, TLS and
    credentials); ``options`` go to ``open_store`` too (e.g. ``timeout``). Raises
    StoreError (StoreUnavailable when it cannot be reached)."""
    environ = os.environ if environ is None else environ
    if not environ.get(envvars.STORE):
        raise StoreError(f"{envvars.STORE} is not set: start the process with pollux-run")
    return open_store(environ[envvars.STORE], environ.get(envvars.PREFIX, envvars.DEFAULT_PREFIX),
                      **{**store_options(environ), **options})
