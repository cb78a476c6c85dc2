"""A throw-away single-member etcd on loopback for the benchmarks: the tests' ``EtcdServer``
(``tests/etcd_server.py``: random free ports, heartbeat 50 ms / election 500 ms so that
1 s lease TTLs work) in a folder of the benchmark's.

    with LocalEtcd.temporary() as etcd:      # or LocalEtcd(folder) ... etcd.stop()
        open_store(etcd.url)
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from etcd_server import ETCD, EtcdServer  # tests/etcd_server.py


class LocalEtcd(EtcdServer):
    """An ``EtcdServer`` started at once; exits with one line if etcd is missing."""

    def __init__(self, folder: Path) -> None:
        if not os.access(ETCD, os.X_OK):
            sys.exit(f"error: etcd not found at {ETCD}; install Debian's etcd-server or use "
                     "--store embedded")
        super().__init__(folder)
        try:
            self.start()
        except RuntimeError as exc:
            sys.exit(f"error: {exc}")

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
