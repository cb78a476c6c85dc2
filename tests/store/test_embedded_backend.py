"""Embedded-only behaviour: URLs, bounded history, threads and forked processes."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from pollux_launch.rendezvous.store import Put, StoreCompacted, StoreError, open_store
from pollux_launch.rendezvous.store.embedded import default_path, path_from_url


def test_urls(tmp_path, monkeypatch):
    assert path_from_url(f"embedded://{tmp_path}/s.db") == tmp_path / "s.db"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert path_from_url("embedded://") == default_path() == tmp_path / "pollux-launch/store.db"
    for bad in ("embedded://host/x.db", "embedded:///x.db?mode=ro", "embedded://rel.db"):
        with pytest.raises(StoreError, match="embedded:///absolute"):
            path_from_url(bad)
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="does not exist"):  # a path the user names: not made
        open_store(f"embedded://{tmp_path}/file/sub/s.db")
    with pytest.raises(StoreError, match="does not exist"):
        open_store(f"embedded://{tmp_path}/new/s.db")
    assert not (tmp_path / "new").exists()
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"junk\.db"):
        open_store(f"embedded://{tmp_path}/junk.db")


def test_history_is_bounded_and_old_waits_say_so(tmp_path):
    with open_store(f"embedded://{tmp_path}/s.db", history=10) as store:
        start = store.revision()
        for i in range(300):
            store.put("k", str(i))
        with pytest.raises(StoreCompacted, match="re-read"):
            store.wait("", start, 0)
        recent = store.revision() - 5
        assert [e.value for e in store.wait("", recent, 0)] == [str(i) for i in range(295, 300)]


def test_threads_share_one_store(tmp_path):
    with open_store(f"embedded://{tmp_path}/s.db") as store:
        def work(t: int) -> None:
            for i in range(50):
                assert store.txn([], [Put(f"t{t}/{i}", "1")])
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(store.get_prefix("t")) == 200


def _forked_put(store, key: str) -> None:
    store.put(key, '"from the child"')


def test_a_forked_child_opens_its_own_connection(tmp_path):
    with open_store(f"embedded://{tmp_path}/s.db") as store:
        store.put("parent", "1")
        p = mp.get_context("fork").Process(target=_forked_put, args=(store, "child"))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        assert store.get("child").value == '"from the child"'
        store.put("parent", "2")  # the parent's connection is untouched
        assert store.get("parent").value == "2"


# Closes the store while other threads wait on it and write to it, many times over; each
# of those threads must end with StoreError (or its wait's end), and the process must
# not crash: a connection closed under a thread inside sqlite is a use-after-free (a
# Horovod job's launcher died of SIGSEGV after its job succeeded: its hosts mirror was
# still waiting on the store it closed).
CLOSE_UNDER_THREADS = """
import sys, threading, time
from pollux_launch.rendezvous.store import StoreError, open_store

path, rounds = sys.argv[1], int(sys.argv[2])
for n in range(rounds):
    store = open_store(f"embedded://{path}", poll_interval=0.001)
    ended = []

    def waiter():
        try:
            store.wait("w/", store.revision(), 30)
        except StoreError:
            ended.append("closed")

    def writer():
        try:
            for i in range(10**6):
                store.put(f"k/{i % 7}", str(i))
        except StoreError:
            ended.append("closed")

    threads = [threading.Thread(target=f, daemon=True) for f in (waiter, waiter, writer)]
    for t in threads:
        t.start()
    time.sleep(0.02 + (n % 5) * 0.005)
    store.close()
    for t in threads:
        t.join(5)
    assert ended == ["closed"] * 3, (n, ended)
print("ok")
"""


def test_closing_the_store_under_waiting_and_writing_threads_ends_them_safely(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CLOSE_UNDER_THREADS, str(tmp_path / "s.db"),
                           "40"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", \
        (done.returncode, done.stderr[-2000:])
