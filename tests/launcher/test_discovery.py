"""horovodrun's ``--host-discovery-script`` in local mode: real scripts, run and polled."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from pollux_launch.launcher.discovery import MAX_OUTPUT, DiscoveryError, HostDiscovery
from pollux_launch.launcher.options import OptionsError, parse_launch_args
from pollux_launch.launcher.run import launch
from pollux_launch.rendezvous.store import StoreError


def script(tmp_path: Path, body: str, name: str = "discover.sh") -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_this_machines_hosts_add_up_and_others_are_named(tmp_path):
    hostname = socket.gethostname()
    d = HostDiscovery(script(tmp_path, f"echo localhost:2\necho\necho {hostname}\n"
                             "echo far.example:4\n"), slots_per_host=3)
    assert d.discover() == (5, ["far.example"])  # 2 + 3 (no count: --slots-per-host)
    assert HostDiscovery(script(tmp_path, "true\n")).discover() == (0, [])  # none yet


@pytest.mark.parametrize(("body", "needle"), [
    ("echo oops >&2\nexit 3\n", "exited 3: oops"),
    ("echo localhost:0\n", "slots must be"),
    ("echo 'bad host!'\n", "not a valid host name"),
    ("printf '\\377\\376'\n", "not UTF-8"),
    (f"head -c {MAX_OUTPUT + 10} /dev/zero | tr '\\0' a\n", "more than"),
])
def test_a_bad_run_is_one_line(tmp_path, body, needle):
    with pytest.raises(DiscoveryError) as info:
        HostDiscovery(script(tmp_path, body)).discover()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_polling_reports_changes_and_survives_failures(tmp_path, caplog):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    # a host file that says "fail" makes the script fail: the slots stay as last seen
    d = HostDiscovery(script(tmp_path, f'grep -q fail {hosts} && exit 1\ncat {hosts}\n'),
                      interval=0.05)
    seen: list[int] = []
    changed = threading.Event()
    refuse = [1]  # the first report fails as a store error would: tried again

    def on_change(n: int) -> None:
        if refuse:
            refuse.pop()
            raise StoreError("store away")
        seen.append(n)
        changed.set()

    stop = threading.Event()
    thread = threading.Thread(target=d.run, args=(stop, 1, on_change), daemon=True)
    with caplog.at_level(logging.WARNING, logger="pollux_launch.launcher.discovery"):
        thread.start()
        try:
            hosts.write_text("localhost:2\n")
            assert changed.wait(10) and seen == [2]
            changed.clear()
            hosts.write_text("fail\n")
            stop.wait(0.5)  # ~10 failed runs
            assert seen == [2]
            hosts.write_text("localhost:1\nelsewhere:8\n")
            assert changed.wait(10) and seen == [2, 1]
            stop.wait(0.3)
        finally:
            stop.set()
            thread.join(5)
    said = [r.getMessage() for r in caplog.records]
    assert sum("exited 1; keeping 2 slot(s)" in m for m in said) == 1, said  # once
    assert sum("elsewhere are not this machine" in m for m in said) == 1, said
    assert sum("cannot record 2 slot(s)" in m for m in said) == 1, said


@pytest.mark.parametrize(("body", "store", "needle"), [
    ("echo far.example:2\n", "embedded", "not this machine"),
    ("exit 2\n", "embedded", "exited 2"),
    ("echo localhost:1\n", "etcd://127.0.0.1:1", "in a cluster the hosts are the node agents"),
])
def test_the_launcher_refuses_what_discovery_cannot_do(tmp_path, monkeypatch, body, store,
                                                       needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import torch\n")
    url = f"embedded://{tmp_path}/s.db" if store == "embedded" else store
    opts = parse_launch_args(["--store", url, "--host-discovery-script",
                              str(script(tmp_path, body)), "python", "train.py"], cwd=tmp_path)
    with pytest.raises(OptionsError, match=needle):
        launch(opts)
