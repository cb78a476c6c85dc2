"""The Store contract, run against every backend (embedded SQLite and a real etcd)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from pollux_launch.rendezvous.store import (
    Compare,
    Delete,
    Event,
    LeaseExpired,
    Put,
    StoreError,
    open_store,
)

# grpc (etcd) does not survive fork: child processes are spawned
CTX = mp.get_context("spawn")
WAIT = 20.0  # generous timeout for waits that must be answered by an event


def _collect(store, prefix: str, after: int, count: int) -> list[Event]:
    """Wait until ``count`` events after ``after`` have arrived (backends may batch)."""
    events: list[Event] = []
    deadline = time.monotonic() + WAIT
    while len(events) < count and time.monotonic() < deadline:
        got = store.wait(prefix, events[-1].revision if events else after, WAIT)
        events.extend(got)
    return events


def test_put_get_overwrite_delete(store):
    assert store.get("a") is None
    r1 = store.put("a", '{"x": 1}')
    kv = store.get("a")
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease) == (
        "a", '{"x": 1}', r1, r1, 0)
    r2 = store.put("a", "2")
    kv = store.get("a")
    assert r2 > r1 and (kv.value, kv.create_revision, kv.mod_revision) == ("2", r1, r2)
    assert store.delete("a") == 1
    assert store.get("a") is None
    assert store.delete("a") == 0
    r3 = store.put("a", "3")  # re-created: a new create_revision
    assert store.get("a").create_revision == r3 > r2


def test_prefix_range_is_sorted_and_bounded(store):
    keys = ["jobs/b/x", "jobs/a/spec", "jobs/a/hints", "jobs/é", "jobs0", "job", "jobs/"]
    for k in keys:
        store.put(k, f'"{k}"')
    got = store.get_prefix("jobs/")
    assert [kv.key for kv in got] == ["jobs/", "jobs/a/hints", "jobs/a/spec", "jobs/b/x",
                                      "jobs/é"]
    assert all(kv.value == f'"{kv.key}"' for kv in got)
    assert [kv.key for kv in store.get_prefix("")] == sorted(keys)
    assert store.get_prefix("nothing/") == []
    assert store.delete("jobs/a/", prefix=True) == 2
    assert [kv.key for kv in store.get_prefix("jobs/")] == ["jobs/", "jobs/b/x", "jobs/é"]


def test_revisions_are_monotone_and_shared_by_a_transaction(store):
    r0 = store.revision()
    r1 = store.put("k1", "1")
    assert r1 > r0 and store.revision() == r1
    store.delete("missing")  # deleting nothing is no change
    assert store.revision() == r1
    assert store.txn([], [Put("k2", "2"), Put("k3", "3"), Delete("k1")])
    r2 = store.revision()
    assert r2 == r1 + 1
    assert store.get("k2").mod_revision == store.get("k3").mod_revision == r2
    events = _collect(store, "", r1, 3)
    assert sorted((e.kind, e.key, e.revision) for e in events) == [
        ("delete", "k1", r2), ("put", "k2", r2), ("put", "k3", r2)]


def test_txn_compares_value_and_revisions(store):
    r = store.put("v", "old")
    # value
    assert store.txn([Compare("v", "value", "==", "old")], [Put("v", "new")], [Put("f", "1")])
    assert store.get("v").value == "new" and store.get("f") is None
    assert not store.txn([Compare("v", "value", "==", "old")], [Put("v", "x")], [Put("f", "1")])
    assert store.get("v").value == "new" and store.get("f").value == "1"
    assert store.txn([Compare("v", "value", "!=", "x"), Compare("v", "value", ">", "a")], [])
    # a value comparison on a missing key fails whatever the operator (etcd semantics)
    assert not store.txn([Compare("nope", "value", "!=", "x")], [Put("nope", "1")])
    assert store.get("nope") is None
    # create_revision / mod_revision
    assert store.txn([Compare("v", "create_revision", "==", r)], [Delete("f")])
    assert store.get("f") is None
    mod = store.get("v").mod_revision
    assert not store.txn([Compare("v", "mod_revision", "<", mod)], [Put("v", "lost")])
    assert store.txn([Compare("v", "mod_revision", "==", mod),
                      Compare("absent", "create_revision", "==", 0)],
                     [Put("v", "won"), Put("absent", "now")])
    assert (store.get("v").value, store.get("absent").value) == ("won", "now")
    # create: put-if-absent
    assert not store.create("v", "again")
    assert store.create("fresh", "1") and store.get("fresh").value == "1"


def test_txn_rejects_malformed_input(store):
    with pytest.raises(StoreError, match="twice"):
        store.txn([], [Put("d", "1"), Put("d", "2")])
    with pytest.raises(StoreError, match="deletes and puts"):
        store.txn([], [Put("d/x", "1"), Delete("d/", prefix=True)])
    with pytest.raises(StoreError, match="str operand"):
        store.txn([Compare("d", "value", "==", 3)], [])
    with pytest.raises(StoreError, match="int"):
        store.txn([Compare("d", "mod_revision", "==", "3")], [])
    with pytest.raises(StoreError, match="JSON text"):
        store.put("d", {"not": "text"})
    assert store.get("d") is None


def _race_create(url: str, prefix: str, me: int, go, results) -> None:
    with open_store(url, prefix, timeout=20) as s:
        go.wait()
        results.put((me, s.create("leader", f'"{me}"')))


def test_create_race_across_processes_has_one_winner(store_url, store_prefix):
    n = 4
    go, results = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_race_create, args=(store_url, store_prefix, i, go, results))
             for i in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let the children connect, then release them together
    go.set()
    outcome = dict(results.get(timeout=60) for _ in range(n))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    winners = [i for i, won in outcome.items() if won]
    assert len(winners) == 1
    with open_store(store_url, store_prefix) as s:
        assert s.get("leader").value == f'"{winners[0]}"'


def test_lease_expiry_deletes_its_keys(store):
    lease = store.lease_grant(1)
    store.put("m/1", "1", lease=lease)
    store.put("m/2", "2", lease=lease)
    store.put("m/keep", "3")
    assert store.get("m/1").lease == lease
    events = _collect(store, "m/", store.revision(), 2)
    assert sorted((e.kind, e.key) for e in events) == [("delete", "m/1"), ("delete", "m/2")]
    assert [kv.key for kv in store.get_prefix("m/")] == ["m/keep"]
    with pytest.raises(LeaseExpired):
        store.lease_refresh(lease)
    with pytest.raises(LeaseExpired):
        store.put("m/3", "3", lease=lease)


def test_lease_refresh_and_keep_alive_keep_keys(store):
    lease = store.lease_grant(1)
    store.put("alive", "1", lease=lease)
    for _ in range(8):  # 2.4 s > 2 x TTL
        time.sleep(0.3)
        store.lease_refresh(lease)
    assert store.get("alive") is not None
    with store.keep_alive(lease, 0.3) as ka:
        time.sleep(2.4)
        assert store.get("alive") is not None and not ka.expired.is_set()
    ka.stop(revoke=True)
    assert store.get("alive") is None


def test_keep_alive_reports_a_lost_lease(store):
    lease = store.lease_grant(1)
    ka = store.keep_alive(lease, 0.2)
    store.lease_revoke(lease)
    assert ka.expired.wait(WAIT)
    assert isinstance(ka.error, LeaseExpired)
    ka.stop()


def test_lease_revoke_deletes_keys_and_is_idempotent(store):
    lease = store.lease_grant(30)
    store.put("r/1", "1", lease=lease)
    store.put("r/2", "2", lease=lease)
    rev = store.revision()
    store.lease_revoke(lease)
    assert store.get_prefix("r/") == []
    assert store.revision() == rev + 1  # one revision for all the lease's keys
    store.lease_revoke(lease)
    with pytest.raises(LeaseExpired):
        store.lease_refresh(lease)


def test_bad_lease_ttl(store):
    for ttl in (0, -1, "5"):
        with pytest.raises(StoreError):
            store.lease_grant(ttl)


def test_wait_returns_changes_after_a_revision_or_nothing(store):
    rev = store.revision()
    assert store.wait("w/", rev, 0.1) == []
    store.put("other/x", "1")  # outside the prefix: not an event for w/
    assert store.wait("w/", rev, 0.2) == []
    r1 = store.put("w/a", "1")
    r2 = store.put("w/b", "2")
    r3 = store.delete("w/a") and store.revision()
    events = _collect(store, "w/", rev, 3)
    assert events == [Event("put", "w/a", "1", r1), Event("put", "w/b", "2", r2),
                      Event("delete", "w/a", "", r3)]
    assert _collect(store, "w/", r2, 1) == [Event("delete", "w/a", "", r3)]
    assert store.wait("w/", r3, 0.2) == []


def _waiter(url: str, prefix: str, after: int, ready, results) -> None:
    with open_store(url, prefix, timeout=20) as s:
        s.get("warm-up")
        ready.set()
        t0 = time.monotonic()
        events = s.wait("w/", after, 60)
        results.put(([(e.kind, e.key, e.value) for e in events], time.monotonic() - t0))


def test_wait_wakes_when_another_process_writes(store, store_url, store_prefix):
    ready, results = CTX.Event(), CTX.Queue()
    p = CTX.Process(target=_waiter,
                    args=(store_url, store_prefix, store.revision(), ready, results))
    p.start()
    assert ready.wait(60)
    time.sleep(0.3)
    store.put("w/x", '"hello"')
    events, _ = results.get(timeout=60)  # returns long before the waiter's 60 s timeout
    p.join(30)
    assert events == [("put", "w/x", '"hello"')]


def _lease_holder(url: str, prefix: str, ready) -> None:
    s = open_store(url, prefix, timeout=20)
    lease = s.lease_grant(1)
    s.put("members/dead", "1", lease=lease)
    ready.set()
    time.sleep(600)  # killed by the test: the lease is never refreshed


def test_keys_of_a_killed_process_expire(store, store_url, store_prefix):
    ready = CTX.Event()
    p = CTX.Process(target=_lease_holder, args=(store_url, store_prefix, ready))
    p.start()
    assert ready.wait(60)
    rev = store.revision()
    assert store.get("members/dead") is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    gone = _collect(store, "members/", rev, 1)[0]
    assert (gone.kind, gone.key) == ("delete", "members/dead")
    assert store.get("members/dead") is None


def test_clusters_are_isolated_by_prefix(store_url, store_prefix):
    with open_store(store_url, store_prefix) as a, \
            open_store(store_url, store_prefix + "x") as b:
        a.put("k", "a")
        rev = b.revision()
        b.put("k", "b")
        assert a.get("k").value == "a" and b.get("k").value == "b"
        assert [kv.key for kv in a.get_prefix("")] == ["k"]
        assert a.wait("", rev, 0.2) == []
        assert b.delete("", prefix=True) == 1
        assert a.get("k").value == "a"


def test_bad_urls_and_options_fail_with_one_line(store_url):
    for url in ("nonsense", "ftp://x", "etcd://", "etcd://host:notaport", "embedded://rel/x"):
        with pytest.raises(StoreError) as info:
            open_store(url)
        assert "\n" not in str(info.value)
    with pytest.raises(StoreError, match="bogus"):
        open_store(store_url, bogus=1)
