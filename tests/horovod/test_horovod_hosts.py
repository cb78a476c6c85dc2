"""Host discovery for Horovod's elastic driver: allocation -> host:slots, from a real store."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from pollux_launch import keys
from pollux_launch.adapters.horovod.launch.command import (
    REMOVED_WORKER_EXIT_CODE,
    horovodrun_command,
    worker_failed,
)
from pollux_launch.adapters.horovod.launch.hosts import (
    HostsFileMirror,
    format_hosts,
    hosts_from_allocation,
    write_discovery_script,
)
from pollux_launch.messages import Allocation, encode
from pollux_launch.rendezvous.store import open_store


def test_hosts_from_allocation_counts_replicas_in_order():
    alloc = Allocation(4, ("b", "a", "b", "c", "b"))
    assert hosts_from_allocation(alloc) == [("b", 3), ("a", 1), ("c", 1)]
    assert format_hosts(hosts_from_allocation(alloc)) == "b:3\na:1\nc:1\n"
    assert hosts_from_allocation(None) == []
    # Nodes mapped onto one address are merged (Horovod needs each host once).
    merged = hosts_from_allocation(alloc, {"a": "10.0.0.1", "c": "10.0.0.1"})
    assert merged == [("b", 3), ("10.0.0.1", 2)]


@pytest.mark.parametrize("bad", [[("", 1)], [("a b", 1)], [("a:1", 1)], [("a", 0)]])
def test_format_hosts_rejects_bad_entries(bad):
    with pytest.raises(ValueError, match="bad host entry"):
        format_hosts(bad)


@pytest.fixture
def embedded(tmp_path):
    url = f"embedded://{tmp_path / 'store.db'}"
    with open_store(url) as store:
        yield url, store


def _wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_mirror_follows_allocation_and_cat_script_reads_it(embedded, tmp_path, caplog):
    _, store = embedded
    key = keys.job("j1", "allocation")
    hosts, script = tmp_path / "hosts", tmp_path / "discover.sh"
    write_discovery_script(script, hosts)
    with HostsFileMirror(store, "j1", hosts, wait_timeout=1.0) as mirror:
        # No allocation yet: an empty list (Horovod reads it as "no hosts for now").
        assert hosts.read_text() == ""
        store.put(key, encode(Allocation(1, ("localhost", "localhost"))))
        assert _wait_for(lambda: hosts.read_text() == "localhost:2\n")
        store.put(key, encode(Allocation(2, ("localhost",) * 3 + ("n2",))))
        assert _wait_for(lambda: hosts.read_text() == "localhost:3\nn2:1\n")
        assert mirror.version == 2
        out = subprocess.run([str(script)], capture_output=True, text=True, check=True)
        assert out.stdout == "localhost:3\nn2:1\n"
        # Malformed JSON in the store is never executed, and changes nothing: the job
        # keeps its hosts (a bad value must not shrink it); it is said once, not at every
        # refresh
        caplog.set_level(logging.WARNING)
        store.put(key, '{"v": 1, "version": "x"}')
        assert not _wait_for(lambda: hosts.read_text() != "localhost:3\nn2:1\n", timeout=2.0)
        assert mirror.version == 2
    said = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ignoring malformed jobs/j1/allocation"), said


def test_mirror_holds_growth_until_newcomers_are_ready(embedded, tmp_path):
    """The gate (warm.WarmStart.ready): a list adding slots is written only once it says
    yes - asked again meanwhile, while the old list stays - and one removing slots at
    once."""
    _, store = embedded
    key, hosts = keys.job("j3", "allocation"), tmp_path / "hosts"
    store.put(key, encode(Allocation(1, ("localhost",) * 2)))
    ready, asked = threading.Event(), []

    def gate() -> bool:
        asked.append(ready.is_set())
        return ready.is_set()

    with HostsFileMirror(store, "j3", hosts, newcomers_ready=gate) as mirror:
        assert hosts.read_text() == "localhost:2\n" and not asked  # the first: at once
        store.put(key, encode(Allocation(2, ("localhost",) * 4)))
        assert _wait_for(lambda: len(asked) >= 3)  # asked, and asked again
        assert hosts.read_text() == "localhost:2\n" and mirror.holding
        assert mirror.version == 1
        ready.set()
        assert _wait_for(lambda: hosts.read_text() == "localhost:4\n")
        assert not mirror.holding and mirror.version == 2 and asked[-1]
        ready.clear()
        n = len(asked)
        store.put(key, encode(Allocation(3, ("localhost",))))  # shrinking: not gated
        assert _wait_for(lambda: hosts.read_text() == "localhost:1\n")
        assert len(asked) == n
        store.put(key, encode(Allocation(4, ("localhost", "n2"))))  # a new host: gated
        assert _wait_for(lambda: len(asked) > n)
        assert hosts.read_text() == "localhost:1\n"
        ready.set()
        assert _wait_for(lambda: hosts.read_text() == "localhost:1\nn2:1\n")


def test_discover_entry_point_reads_the_store(embedded):
    url, store = embedded
    store.put(keys.job("j2", "allocation"), encode(Allocation(7, ("h1", "h2", "h1"))))
    cmd = [sys.executable, "-m", "pollux_launch.adapters.horovod.launch.discover",
           "--store", url, "--job", "j2"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert out.stdout == "h1:2\nh2:1\n"
    # The entry point must stay cheap: nothing heavy imported.
    probe = (f"import sys; sys.argv=['d','--store',{url!r},'--job','j2'];"
             "import pollux_launch.adapters.horovod.launch.discover as d; d.main();"
             "bad=[m for m in ('torch','numpy','horovod') if m in sys.modules];"
             "sys.exit(bool(bad))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0
    missing = subprocess.run([*cmd[:3], "--store", url], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and "need --store URL and --job NAME" in missing.stderr
    bad = subprocess.run([*cmd[:3], "--store", "nope", "--job", "x"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "bad store URL" in bad.stderr


def test_horovodrun_command_and_exit_codes():
    argv = horovodrun_command(["python", "train.py", "--lr", "1"], discovery_script="/d.sh",
                              np=2, min_np=1, max_np=4, horovodrun="horovodrun")
    assert argv[:6] == ["horovodrun", "--gloo", "-np", "2", "--host-discovery-script", "/d.sh"]
    assert argv[-4:] == ["python", "train.py", "--lr", "1"]
    for flag, value in (("--min-np", "1"), ("--max-np", "4"), ("--network-interface", "lo")):
        assert argv[argv.index(flag) + 1] == value
    with pytest.raises(ValueError, match="min-np <= np <= max-np"):
        horovodrun_command(["x"], discovery_script="/d", np=3, max_np=2, horovodrun="h")
    with pytest.raises(ValueError, match="no training command"):
        horovodrun_command([], discovery_script="/d", np=1, horovodrun="h")
    assert not worker_failed(0)
    assert not worker_failed(REMOVED_WORKER_EXIT_CODE)
    assert worker_failed(REMOVED_WORKER_EXIT_CODE, removed_by_reset=False)
    assert worker_failed(1)
