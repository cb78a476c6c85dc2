"""Several "real hosts" on this one machine, made of Linux network namespaces (root only).

``HostNet`` makes a bridge in the root namespace with the address ``10.N.0.1/24`` (N random
in 100..199, chosen so that no interface on the machine is already in 10.N.0.0/24);
``add_host(name)`` makes a network namespace joined to the bridge by a veth pair, with the
address ``10.N.0.(10+i)/24``, ``lo`` up and a default route via the bridge. Each host has
its own interface name (``Host.ifname``; look it up, do not assume it).

What a namespace does NOT give you, on purpose: processes in every host share the machine's
filesystem, PIDs and host name (the UTS namespace is not unshared), so ``hostname`` resolves
to 127.0.x.x on every host exactly as on a badly configured real cluster, and 127.0.0.1
inside a host is that host's own loopback, unreachable from the others.

Only the bridge address and the hosts' addresses in 10.N.0.0/24 are ever contacted; the
root namespace does not route anything from the hosts elsewhere (nothing here turns on
``ip_forward``). Each host gets its own /etc/resolv.conf (``ip netns exec`` bind-mounts
/etc/netns/<ns>/resolv.conf) naming 127.0.0.1, where nothing listens: DNS lookups inside a
host fail at once instead of timing out against the machine's unreachable name server
(torch's TCPStore does a reverse lookup per connection, which otherwise costs its whole
timeout). /etc/hosts is the machine's own.

Use in a test::

    import pytest
    from hosts import HostNet, netns_available   # tests/e2e is on sys.path under pytest

    pytestmark = pytest.mark.skipif(not netns_available(), reason="needs root and netns")

    @pytest.fixture
    def net():
        with HostNet() as net:          # close() also runs at exit if a test crashes
            yield net

    def test_something(net):
        a, b = net.add_host("a"), net.add_host("b")
        server = b.popen([sys.executable, "-m", "http.server", "--bind", b.address, "8000"])
        ...  # wait until it listens (read a "ready" line, or retry the client)
        client = "import urllib.request as u, sys; u.urlopen(sys.argv[1], timeout=5)"
        a.run([sys.executable, "-c", client, f"http://{b.address}:8000/"], check=True)
        # net.gateway is the root namespace's address on the bridge: bind servers that
        # run outside the hosts (etcd, a coordinator) to it.
        # Pass env={..., "GLOO_SOCKET_IFNAME": a.ifname} to pin gloo to the host's NIC.

``close()`` kills whatever still runs inside the hosts' namespaces, deletes the
namespaces, veths and bridge and undoes any firewall exception; it never raises and is
safe to call twice.

Firewall: with ``br_netfilter`` loaded and ``net.bridge.bridge-nf-call-iptables = 1``,
traffic between two hosts crosses iptables' FORWARD chain even though it is only bridged,
and traffic to the gateway crosses INPUT. Where ``iptables`` or ``nft`` is installed and a
relevant chain has rules or a non-accept policy, ``HostNet`` inserts ACCEPT rules limited
to its own bridge at the top of those chains and deletes exactly those rules in close().
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Host", "HostNet", "HostNetError", "netns_available"]

_IP = shutil.which("ip") or "/usr/sbin/ip"
_Argv = Sequence[str | os.PathLike[str]]
_ETC_NETNS = Path("/etc/netns")
_RESOLV_CONF = ("# tests/e2e/hosts.py: no DNS inside test hosts (port 53 on lo is closed)\n"
                "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def _remove_etc_netns(netns: str) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(_ETC_NETNS / netns)
    with contextlib.suppress(OSError):
        _ETC_NETNS.rmdir()  # only if empty, i.e. nobody else uses it


class HostNetError(RuntimeError):
    """Setting up the namespaces failed (the message carries the failing command)."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 20) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise HostNetError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def _ip(*args: str, check: bool = True) -> str:
    return _run([_IP, *args], check=check)


def _quiet(argv: Sequence[str]) -> None:
    """Run a clean-up command; never raise."""
    with contextlib.suppress(Exception):
        _run(argv, check=False)


def _link_exists(name: str) -> bool:
    return subprocess.run([_IP, "link", "show", "dev", name], capture_output=True,
                          stdin=subprocess.DEVNULL).returncode == 0


@functools.cache
def netns_available() -> bool:
    """True where this process is root and can create a namespace, a bridge and a veth."""
    if os.name != "posix" or os.geteuid() != 0 or not os.access(_IP, os.X_OK):
        return False
    tag = secrets.token_hex(3)
    ns, br, veth = f"pxprobe{tag}", f"pxq{tag}", f"pxq{tag}v"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", br, "type", "bridge")
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        return True
    except (HostNetError, OSError, subprocess.SubprocessError):
        return False
    finally:
        _quiet([_IP, "link", "del", veth])
        _quiet([_IP, "link", "del", br])
        _quiet([_IP, "netns", "del", ns])


class Host:
    """One namespace on the bridge: ``name``, ``netns``, ``address`` (no prefix length),
    ``ifname`` (its interface inside the namespace). Made by ``HostNet.add_host``."""

    def __init__(self, name: str, netns: str, address: str, ifname: str) -> None:
        self.name, self.netns, self.address, self.ifname = name, netns, address, ifname
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r}, " \
               f"ifname={self.ifname!r})"

    def argv(self, argv: _Argv) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's namespace."""
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a sequence of arguments, not a string")
        return [_IP, "netns", "exec", self.netns, *map(os.fspath, argv)]

    def popen(self, argv: _Argv, **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` inside the namespace (``ip netns exec`` execs the command
        itself, so ``.pid`` is the command's). kwargs (env, cwd, stdout, text, ...) are
        passed through. A process still running at ``HostNet.close()`` is killed."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.argv(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: _Argv, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` inside the namespace; kwargs are passed through."""
        return subprocess.run(self.argv(argv), **kwargs)

    def resolve_hostname_here(self) -> None:
        """Make the machine's host name resolve to this host's address inside this host
        (``/etc/netns/<ns>/hosts``, bind-mounted over /etc/hosts by ``ip netns exec``),
        as on a cluster node whose /etc/hosts is configured for it."""
        hosts = f"127.0.0.1 localhost\n{self.address} {socket.gethostname()}\n"
        (_ETC_NETNS / self.netns / "hosts").write_text(hosts)

    def pids(self) -> list[int]:
        """The PIDs of every process now inside this host's namespace."""
        out = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_all(self) -> None:
        """SIGKILL every process inside this host (a machine that fails)."""
        for proc in self._procs:
            with contextlib.suppress(Exception):
                if proc.poll() is None:
                    proc.kill()
        for _ in range(3):  # also children the tracked processes left behind
            pids = [p for p in self.pids() if p != os.getpid()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)


class _Firewall:
    """ACCEPT rules for one bridge, inserted only into chains that could drop its traffic."""

    def __init__(self, bridge: str) -> None:
        self.bridge = bridge
        self._undo: list[list[str]] = []

    def _matches(self, chain: str) -> list[str]:
        br = self.bridge
        return {"INPUT": ["-i", br], "OUTPUT": ["-o", br],
                "FORWARD": ["-i", br, "-o", br]}[chain]

    def open(self) -> None:
        handled_by_iptables: set[str] = set()
        iptables = shutil.which("iptables")
        if iptables:
            handled_by_iptables = self._open_iptables(iptables)
        nft = shutil.which("nft")
        if nft:
            self._open_nft(nft, handled_by_iptables)

    def _open_iptables(self, iptables: str) -> set[str]:
        """Returns the nf_tables "family/table" names iptables manages (iptables-nft)."""
        try:
            listing = _run([iptables, "-w", "-S"], check=True)
        except (HostNetError, OSError, subprocess.SubprocessError):
            return set()  # no usable iptables (e.g. not permitted); nft may still work
        for chain in ("INPUT", "FORWARD", "OUTPUT"):
            policy = re.search(rf"^-P {chain} (\S+)", listing, re.M)
            has_rules = re.search(rf"^-A {chain} ", listing, re.M) is not None
            if (policy is None or policy.group(1) == "ACCEPT") and not has_rules:
                continue
            rule = [*self._matches(chain), "-j", "ACCEPT"]
            _run([iptables, "-w", "-I", chain, "1", *rule])
            self._undo.append([iptables, "-w", "-D", chain, *rule])
        version = _run([iptables, "-V"], check=False)
        return {"ip/filter"} if "nf_tables" in version else set()

    def _open_nft(self, nft: str, skip: set[str]) -> None:
        try:
            ruleset = json.loads(_run([nft, "-j", "list", "ruleset"]) or "{}")
        except (HostNetError, OSError, subprocess.SubprocessError, ValueError):
            return
        items = ruleset.get("nftables", [])
        busy = {(r["rule"]["family"], r["rule"]["table"], r["rule"]["chain"])
                for r in items if "rule" in r}
        br = self.bridge
        for item in items:
            chain = item.get("chain")
            if not chain or chain.get("hook") not in ("input", "forward", "output"):
                continue
            family, table, name, hook = chain["family"], chain["table"], chain["name"], \
                chain["hook"]
            if family not in ("ip", "inet", "bridge") or f"{family}/{table}" in skip:
                continue
            if chain.get("policy", "accept") == "accept" and (family, table, name) not in busy:
                continue
            if family == "bridge":  # bridge-family hooks see the ports: our veths
                ports = f"{br}v*"
                match = ["oifname", ports] if hook == "output" else ["iifname", ports]
            else:
                match = {"input": ["iifname", br], "output": ["oifname", br],
                         "forward": ["iifname", br, "oifname", br]}[hook]
            out = _run([nft, "--echo", "--handle", "insert", "rule", family, table, name,
                        *match, "accept"])
            handle = re.search(r"# handle (\d+)", out)
            if handle:
                self._undo.append([nft, "delete", "rule", family, table, name, "handle",
                                   handle.group(1)])

    def close(self) -> None:
        while self._undo:
            _quiet(self._undo.pop())


class HostNet:
    """A bridge in the root namespace plus hosts (namespaces) on it; see the module doc.

    ``gateway``: the bridge's address (str); ``network``: the 10.N.0.0/24 network;
    ``bridge``: the bridge's name; ``hosts``: the hosts made so far.
    """

    MAX_HOSTS = 200

    def __init__(self) -> None:
        self.hosts: list[Host] = []
        self._veths: list[str] = []
        self._netns: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        self._firewall: _Firewall | None = None
        self.bridge = self._free_bridge_name()
        atexit.register(self.close)
        try:
            self.network = self._create_bridge()
            self.gateway = str(self.network.network_address + 1)
            self._firewall = _Firewall(self.bridge)
            self._firewall.open()
        except BaseException:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------------

    @staticmethod
    def _free_bridge_name() -> str:
        for _ in range(100):
            name = "pxb" + secrets.token_hex(3)[:5]
            if not _link_exists(name) and not Path("/run/netns", name + "-0").exists():
                return name
        raise HostNetError("no free bridge name")

    @staticmethod
    def _clashes(network: ipaddress.IPv4Network) -> list[str]:
        """Interfaces with an address inside ``network`` (or a smaller network inside it)
        and routes to networks inside it: anything that our bridge would collide with."""
        found = []
        for line in _ip("-o", "-4", "addr", "show").splitlines():
            fields = line.split()
            with contextlib.suppress(ValueError, IndexError):
                iface = ipaddress.IPv4Interface(fields[3])
                if iface.ip in network or iface.network.subnet_of(network):
                    found.append(f"address {fields[3]} on {fields[1]}")
        for line in _ip("-4", "route", "show", "table", "all").splitlines():
            fields = line.split()
            if fields and fields[0] in ("broadcast", "local", "unreachable", "blackhole",
                                        "prohibit", "throw", "unicast", "multicast"):
                fields = fields[1:]
            with contextlib.suppress(ValueError, IndexError):
                dest = ipaddress.IPv4Network(fields[0], strict=False)
                if dest.subnet_of(network):
                    found.append(f"route {line.strip()}")
        return found

    def _create_bridge(self) -> ipaddress.IPv4Network:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "addrgenmode", "none")  # no IPv6 link-local chatter
        for n in random.sample(range(100, 200), 100):
            network = ipaddress.IPv4Network(f"10.{n}.0.0/24")
            if self._clashes(network):
                continue
            gateway = f"{network.network_address + 1}/{network.prefixlen}"
            _ip("addr", "add", gateway, "dev", self.bridge)
            # another HostNet may have taken the same N meanwhile: then only our own
            # address and its connected route may be there
            mine = {f"address {gateway} on {self.bridge}"}
            others = [c for c in self._clashes(network)
                      if c not in mine and f" dev {self.bridge} " not in f"{c} "]
            if others:
                _ip("addr", "flush", "dev", self.bridge)
                continue
            _ip("link", "set", self.bridge, "up")
            return network
        raise HostNetError("no free 10.N.0.0/24 network for N in 100..199")

    def add_host(self, name: str) -> Host:
        """A new namespace joined to the bridge, with lo up, ``10.N.0.(10+i)/24`` on its
        own interface and a default route via ``gateway``."""
        with self._lock:
            if self._closed:
                raise HostNetError("HostNet is closed")
            i = len(self.hosts)
            if i >= self.MAX_HOSTS:
                raise HostNetError(f"at most {self.MAX_HOSTS} hosts")
            safe = re.sub(r"[^A-Za-z0-9_.-]", "", name)[:24]
            netns = f"{self.bridge}-{i}" + (f"-{safe}" if safe else "")
            address = str(self.network.network_address + 10 + i)
            ifname = f"ens{i + 1}"  # different on every host: tests must use Host.ifname
            outer, inner = f"{self.bridge}v{i}", f"{self.bridge}p{i}"
            try:
                _ip("netns", "add", netns)
                self._netns.append(netns)
                self._write_resolv_conf(netns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self._veths.append(outer)
                _ip("link", "set", outer, "addrgenmode", "none")
                _ip("link", "set", inner, "netns", netns)
                _ip("-n", netns, "link", "set", inner, "name", ifname)
                _ip("-n", netns, "link", "set", ifname, "addrgenmode", "none")
                _ip("-n", netns, "addr", "add", f"{address}/{self.network.prefixlen}",
                    "dev", ifname)
                _ip("-n", netns, "link", "set", "lo", "up")
                _ip("-n", netns, "link", "set", ifname, "up")
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", netns, "route", "add", "default", "via", self.gateway)
            except BaseException:
                _quiet([_IP, "link", "del", outer])
                _quiet([_IP, "netns", "del", netns])
                _remove_etc_netns(netns)
                raise
            host = Host(name, netns, address, ifname)
            self.hosts.append(host)
            return host

    @staticmethod
    def _write_resolv_conf(netns: str) -> None:
        """``ip netns exec`` bind-mounts /etc/netns/<ns>/* over /etc/*: give the host a
        resolver that fails at once on its own loopback instead of the machine's name
        server, which the hosts cannot reach (lookups would hang for seconds, and the
        queries would be traffic to an address that is not ours)."""
        folder = _ETC_NETNS / netns
        for _ in range(3):  # another HostNet may remove an empty /etc/netns meanwhile
            with contextlib.suppress(FileNotFoundError):
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "resolv.conf").write_text(_RESOLV_CONF)
                return
        raise HostNetError(f"cannot write {folder}/resolv.conf")

    # -- teardown --------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs in the hosts, delete namespaces, veths, bridge and firewall
        exceptions. Idempotent; never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.kill_all()
        if self._firewall is not None:
            with contextlib.suppress(Exception):
                self._firewall.close()
        for veth in self._veths:
            _quiet([_IP, "link", "del", veth])
        for netns in self._netns:
            _quiet([_IP, "netns", "del", netns])
            _remove_etc_netns(netns)
        _quiet([_IP, "link", "del", self.bridge])

    def __enter__(self) -> HostNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostNet(bridge={self.bridge!r}, gateway={getattr(self, 'gateway', None)!r}, " \
               f"hosts={[h.name for h in self.hosts]!r})"
