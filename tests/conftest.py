"""Shared store fixtures: a real etcd server and store URLs for both backends.

* ``etcd_server``   one etcd (Debian's /usr/bin/etcd) for the whole session, loopback only;
                    tests isolate themselves with their own key prefix (``store_prefix``).
* ``etcd_private``  a fresh etcd for one test, for tests that kill and restart it
                    (``.kill()``, ``.start()``, ``.restart()``: same ports, same data dir;
                    ``.pause()``/``.resume()``: SIGSTOP/SIGCONT, a stalled server).
* ``etcd_factory``  ``start(tls=None, host=...)`` -> another fresh etcd, stopped after the
                    test (``host``: the address clients use; it also serves loopback).
* ``etcd_certs``    a folder with a throw-away CA, server and client certificates.
* ``store_url``     parametrised: an embedded file under tmp_path, then the session etcd.
* ``store_prefix``  a cluster prefix unique to the test.
* ``store``         ``open_store(store_url, store_prefix)``, closed afterwards.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest
from etcd_server import ETCD, EtcdServer, make_certs


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory) -> None:
    """Local runs keep their logs under ``$XDG_STATE_HOME`` (launcher/logs.py): the
    session's own folder, not the user's home, for every process the tests start."""
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))


def start_etcd(data_dir: Path, tls: Path | None = None, host: str = "127.0.0.1") -> EtcdServer:
    """Start an ``EtcdServer`` under ``data_dir`` (skips the test if etcd is missing)."""
    if not os.access(ETCD, os.X_OK):
        pytest.skip("etcd is not installed (scripts/test.sh installs Debian's etcd-server)")
    for attempt in range(3):  # a free port may be taken between choosing and binding
        server = EtcdServer(data_dir / f"try{attempt}", tls, host)
        server.data_dir.mkdir(parents=True)
        try:
            return server.start()
        except RuntimeError:
            server.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def etcd_server():
    """One etcd for the session; isolate tests by key prefix."""
    with tempfile.TemporaryDirectory(prefix="pollux-etcd-") as tmp:
        server = start_etcd(Path(tmp))
        yield server
        server.stop()


@pytest.fixture
def etcd_factory(tmp_path):
    """``start(tls=None)``: a fresh etcd for this test (TLS with ``etcd_certs``)."""
    servers: list[EtcdServer] = []

    def start(tls: Path | None = None, host: str = "127.0.0.1") -> EtcdServer:
        servers.append(start_etcd(tmp_path / f"etcd{len(servers)}", tls, host))
        return servers[-1]
    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def etcd_private(etcd_factory):
    """A fresh etcd for one test (to kill and restart on the same data dir)."""
    return etcd_factory()


@pytest.fixture
def etcd_certs(tmp_path) -> Path:
    return make_certs(tmp_path / "certs")


@pytest.fixture(params=["embedded", "etcd"])
def store_url(request, tmp_path) -> str:
    if request.param == "embedded":
        return f"embedded://{tmp_path / 'store.db'}"
    return request.getfixturevalue("etcd_server").url


@pytest.fixture
def store_prefix() -> str:
    return f"/pollux-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_url, store_prefix):
    from pollux_launch.rendezvous.store import open_store

    s = open_store(store_url, store_prefix, timeout=10)
    yield s
    s.close()
