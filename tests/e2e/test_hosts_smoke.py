"""Smoke tests for hosts.py: namespaces on a bridge behave like separate machines.

Real processes only: TCP between hosts and to the bridge address, an etcd in the root
namespace reached from every host through the project's store client, and a gloo process
group across two hosts (which needs GLOO_SOCKET_IFNAME, because the shared host name
resolves to 127.0.0.1 on every host).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from hosts import Host, HostNet, netns_available

from pollux_launch.rendezvous.store import open_store

pytestmark = [pytest.mark.skipif(not netns_available(),
                                 reason="needs root and network namespaces (ip netns)"),
              pytest.mark.timeout(120)]

PY = sys.executable
ETCD = "/usr/bin/etcd"

# accept connections and answer each with the peer's address, until killed
SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", s.getsockname()[1], flush=True)
while True:
    conn, peer = s.accept()
    conn.sendall(f"{sys.argv[3]} sees {peer[0]}".encode())
    conn.close()
"""

CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
        print("ok", c.recv(200).decode(), flush=True)
except OSError as exc:
    print("error", type(exc).__name__, exc, flush=True)
"""

STORE = """
import sys, time
from pollux_launch.rendezvous.store import open_store
url, prefix, me, value, other = sys.argv[1:6]
with open_store(url, prefix, timeout=10) as store:
    store.put(f"/smoke/{me}", value)
    deadline = time.monotonic() + 20
    while other != "-" and store.get(f"/smoke/{other}") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    kv = store.get(f"/smoke/{other}") if other != "-" else None
    print("other", kv.value if kv else None, flush=True)
"""

GLOO = """
import datetime, sys, time
import torch
import torch.distributed as dist
rank, master, port, timeout = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
start = time.monotonic()
try:
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=timeout))
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    print("RESULT", x.item(), flush=True)
    dist.destroy_process_group()
except Exception as exc:
    print("FAILED", f"{time.monotonic() - start:.1f}s", type(exc).__name__, exc, flush=True)
    sys.exit(3)
"""


def _env(**extra: str) -> dict[str, str]:
    """The environment for child processes: no proxies (nothing may leave 10.N.0.0/24),
    no inherited gloo interface, one thread."""
    drop = {"http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy",
            "gloo_socket_ifname", "tp_socket_ifname"}
    env = {k: v for k, v in os.environ.items() if k.lower() not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output from {proc.args!r} within {timeout} s")
    return proc.stdout.readline().strip()


def _stop(*procs: subprocess.Popen[str] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
    for proc in procs:
        if proc is not None:
            proc.communicate(timeout=10)  # reap and close pipes


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _serve(host: Host | None, address: str, label: str) -> tuple[subprocess.Popen[str], int]:
    """A SERVER on ``address`` (in ``host``, or in the root namespace when None)."""
    argv = [PY, "-c", SERVER, address, "0", label]
    kwargs = {"stdout": subprocess.PIPE, "text": True, "env": _env()}
    proc = host.popen(argv, **kwargs) if host else subprocess.Popen(argv, **kwargs)
    line = _readline(proc, 20)
    assert line.startswith("ready "), line
    return proc, int(line.split()[1])


def _connect(host: Host, address: str, port: int) -> str:
    out = host.run([PY, "-c", CLIENT, address, str(port)], capture_output=True, text=True,
                   env=_env(), timeout=30)
    return out.stdout.strip() + out.stderr.strip()


@pytest.fixture
def net() -> Iterator[HostNet]:
    with HostNet() as hostnet:
        yield hostnet


def test_tcp_between_hosts_and_to_the_bridge(net: HostNet) -> None:
    a, b = net.add_host("a"), net.add_host("b")
    assert a.ifname != b.ifname and a.address != b.address != net.gateway
    on_b = on_root = None
    try:
        on_b, b_port = _serve(b, b.address, "b")
        on_root, root_port = _serve(None, net.gateway, "root")
        assert _connect(a, b.address, b_port) == f"ok b sees {a.address}"
        assert _connect(a, net.gateway, root_port) == f"ok root sees {a.address}"
        assert _connect(b, net.gateway, root_port) == f"ok root sees {b.address}"
        # 127.0.0.1 is each host's own loopback: B's server is not there for A
        assert _connect(a, "127.0.0.1", b_port).startswith("error ConnectionRefusedError")
    finally:
        _stop(on_b, on_root)


def test_etcd_on_the_bridge_reachable_from_every_host(net: HostNet) -> None:
    if not os.access(ETCD, os.X_OK):
        pytest.skip(f"{ETCD} is not installed")
    a, b = net.add_host("a"), net.add_host("b")
    port, peer_port = _free_port(net.gateway), _free_port("127.0.0.1")
    client, peer = f"http://{net.gateway}:{port}", f"http://127.0.0.1:{peer_port}"
    url, prefix = f"etcd://{net.gateway}:{port}", f"/smoke-{uuid.uuid4().hex[:8]}"
    etcd = None
    with tempfile.TemporaryDirectory(prefix="hosts-smoke-etcd-") as data:
        try:
            etcd = subprocess.Popen(
                [ETCD, "--name", "smoke", "--data-dir", f"{data}/etcd",
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"smoke={peer}", "--log-level", "warn"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                stdin=subprocess.DEVNULL, env=_env())
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            deadline = time.monotonic() + 30
            while True:
                assert etcd.poll() is None, f"etcd exited: {etcd.communicate()[1][-2000:]}"
                try:
                    with opener.open(f"{client}/health", timeout=1) as reply:
                        if b'"true"' in reply.read():
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "etcd did not become healthy in 30 s"
                time.sleep(0.1)
            results = {}
            for me, other in ((a, "-"), (b, "a")):
                out = me.run([PY, "-c", STORE, url, prefix, me.name, me.address, other],
                             capture_output=True, text=True, env=_env(), timeout=40)
                assert out.returncode == 0, out.stderr[-3000:]
                results[me.name] = out.stdout.strip()
            assert results == {"a": "other None", "b": f"other {a.address}"}
            with open_store(url, prefix, timeout=10) as store:
                got = {h: kv.value for h in "ab" if (kv := store.get(f"/smoke/{h}"))}
            assert got == {"a": a.address, "b": b.address}
        finally:
            _stop(etcd)


def _gloo_pair(net: HostNet, with_ifname: bool) -> list[subprocess.Popen[str]]:
    a, b = net.add_host("a"), net.add_host("b")
    procs = []
    for rank, host in enumerate((a, b)):
        env = _env(GLOO_SOCKET_IFNAME=host.ifname) if with_ifname else _env()
        procs.append(host.popen([PY, "-c", GLOO, str(rank), a.address, "29500", "10"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True))
    return procs


def test_gloo_across_hosts_with_socket_ifname(net: HostNet) -> None:
    procs = _gloo_pair(net, with_ifname=True)
    try:
        outs = [proc.communicate(timeout=50)[0] for proc in procs]
        for proc, out in zip(procs, outs, strict=True):
            assert proc.returncode == 0, out[-3000:]
            assert "RESULT 3.0" in out, out[-3000:]
    finally:
        _stop(*procs)


def test_gloo_across_hosts_without_socket_ifname_fails(net: HostNet) -> None:
    """The bug the launcher fixes: without GLOO_SOCKET_IFNAME gloo binds to the address
    the host name resolves to, 127.0.0.1, and advertises it to its peer. Whichever rank
    dials (gloo orders the pair by address) gets "Connection refused" from its own
    loopback at once; the other waits for a connection that never comes (observed: about
    5x the 10 s timeout), so it is killed here instead of waited for."""
    procs = _gloo_pair(net, with_ifname=False)
    try:
        deadline = time.monotonic() + 45
        while all(proc.poll() is None for proc in procs):
            assert time.monotonic() < deadline, "neither rank failed within 45 s"
            time.sleep(0.1)
        first = next(proc for proc in procs if proc.poll() is not None)
        out = first.communicate(timeout=10)[0]
        assert first.returncode == 3, out[-3000:]
        assert "FAILED" in out and "127.0.0.1" in out, out[-3000:]
        assert "RESULT" not in out
    finally:
        _stop(*procs)
