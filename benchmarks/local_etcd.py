"""A throw-away single-member etcd on loopback for the benchmarks (random free ports, a
temporary data dir; heartbeat 50 ms / election 500 ms so that 1 s lease TTLs work).

    with LocalEtcd.temporary() as etcd:      # or LocalEtcd(folder) ... etcd.stop()
        open_store(etcd.url)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """A throw-away single-member etcd on loopback (random ports, temp data dir)."""

    def __init__(self, folder: Path) -> None:
        if not os.access(ETCD, os.X_OK):
            sys.exit(
                f"error: etcd not found at {ETCD}; install Debian's etcd-server or use "
                "--store embedded"
            )
        self.folder = folder
        self.client, self.peer = _free_port(), _free_port()
        client, peer = f"http://127.0.0.1:{self.client}", f"http://127.0.0.1:{self.peer}"
        cmd = [
            ETCD,
            "--name",
            "bench",
            "--data-dir",
            str(folder / "etcd"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"bench={peer}",
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--log-level",
            "warn",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]
        log = open(folder / "etcd.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        sys.exit(f"error: etcd did not become healthy; see {folder / 'etcd.log'}")

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    @classmethod
    @contextlib.contextmanager
    def temporary(cls) -> Iterator[LocalEtcd]:
        """A LocalEtcd in a temporary folder, stopped and removed afterwards."""
        with tempfile.TemporaryDirectory(prefix="pollux-bench-etcd-") as tmp:
            etcd = cls(Path(tmp))
            try:
                yield etcd
            finally:
                etcd.stop()
