"""A real etcd for the tests and the fault benchmark: Debian's ``/usr/bin/etcd``, one
member, random free ports, its own data dir (no pytest here, so benchmarks can use it)."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """A single-member etcd on loopback with its own data dir and random free ports.

    Heartbeat 50 ms / election 500 ms, so that the minimum lease TTL is 1 s (etcd's is
    1.5 x election timeout, rounded up to whole seconds; 2 s with the defaults).
    ``kill()`` sends SIGKILL; ``start()`` again reuses the same ports and data dir.
    ``tls``: a folder with ca.pem, server.pem/.key and client.pem/.key (``make_certs``)
    makes the client port speak TLS and require a client certificate.
    ``enable_auth(pw)`` turns on authentication with a ``root`` user; ``channel()`` is a
    gRPC channel to it (over TLS as a client would), ``users(pw)`` lists its users.
    """

    def __init__(self, data_dir: str | Path, tls: Path | None = None,
                 host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.tls = tls
        self.host = host  # clients' address (also served on loopback)
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.client_port}"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        scheme = "https" if self.tls else "http"
        client = f"{scheme}://127.0.0.1:{self.client_port}"
        advertised = f"{scheme}://{self.host}:{self.client_port}"
        listen = client if self.host == "127.0.0.1" else f"{client},{advertised}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [ETCD, "--name", "pollux-test", "--data-dir", str(self.data_dir / "etcd"),
               "--listen-client-urls", listen, "--advertise-client-urls", advertised,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"pollux-test={peer}",
               "--heartbeat-interval", "50", "--election-timeout", "500",
               "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
        context = None
        if self.tls:
            cmd += ["--cert-file", str(self.tls / "server.pem"),
                    "--key-file", str(self.tls / "server.key"),
                    "--trusted-ca-file", str(self.tls / "ca.pem"), "--client-cert-auth"]
            context = ssl.create_default_context(cafile=self.tls / "ca.pem")
            context.load_cert_chain(self.tls / "client.pem", self.tls / "client.key")
        log = open(self.data_dir / "etcd.log", "ab")  # handed to etcd, closed below
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see "
                                   f"{self.data_dir / 'etcd.log'}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1, context=context) as r:
                    if b'"true"' in r.read():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy in {timeout} s")

    def kill(self) -> None:
        """SIGKILL the server (the data dir stays; ``start()`` brings it back)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def wipe(self) -> None:
        """SIGKILL it, delete its data and start an empty one at the same address: a
        store that lost everything (a wiped data directory, a replaced machine)."""
        self.kill()
        shutil.rmtree(self.data_dir / "etcd", ignore_errors=True)
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing is answered)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot terminate
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def channel(self):
        """A gRPC channel to the client port (TLS with the client certificate if ``tls``)."""
        import grpc

        target = f"127.0.0.1:{self.client_port}"
        if not self.tls:
            return grpc.insecure_channel(target)
        creds = grpc.ssl_channel_credentials(
            (self.tls / "ca.pem").read_bytes(), (self.tls / "client.key").read_bytes(),
            (self.tls / "client.pem").read_bytes())
        return grpc.secure_channel(target, creds)

    def enable_auth(self, root_password: str) -> None:
        """Turn authentication on, with a ``root`` user (role root) of that password."""
        from pyetcd import etcdrpc

        with self.channel() as channel:
            auth = etcdrpc.AuthStub(channel)
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password),
                         timeout=5)
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"),
                               timeout=5)
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)

    def users(self, root_password: str) -> list[str]:
        """The users of an etcd with authentication (asked as ``root``)."""
        from pyetcd import etcdrpc

        with self.channel() as channel:
            auth = etcdrpc.AuthStub(channel)
            token = auth.Authenticate(etcdrpc.AuthenticateRequest(
                name="root", password=root_password), timeout=5).token
            return list(auth.UserList(etcdrpc.AuthUserListRequest(), timeout=5,
                                      metadata=[("token", token)]).users)


def make_certs(folder: Path) -> Path:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""
    folder.mkdir(parents=True, exist_ok=True)

    def ssl_cmd(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl_cmd("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=pollux-test-ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (folder / f"{name}.ext").write_text(ext + "\n")
        ssl_cmd("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")
        ssl_cmd("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")
    return folder
