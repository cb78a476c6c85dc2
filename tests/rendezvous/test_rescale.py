"""Live rescale with real worker processes on gloo, on both store backends."""

from __future__ import annotations

import signal
import time

import pytest


def _rounds(job, ws: int, count: int, **match: object) -> dict[str, dict]:
    events = job.wait_for(count, event="round", ws=ws, **match)
    for e in events:
        assert e["allreduce"] == ws * (ws + 1) / 2, e
        assert e["consistent"], e
    assert sorted(e["rank"] for e in events) == list(range(ws))
    assert len({e["round"] for e in events}) == 1
    return {e["worker"]: e for e in events}


@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_rescale_2_3_1_keeps_survivors_and_their_ranks(backend, make_job, tmp_path, request):
    url = (f"embedded://{tmp_path / 'store.db'}" if backend == "embedded"
           else request.getfixturevalue("etcd_server").url)
    job = make_job(url)
    job.allocate(2)
    procs = {"w0": job.start("w0"), "w1": job.start("w1")}
    r = _rounds(job, 2, 2)
    first, second = sorted(r, key=lambda w: r[w]["rank"])  # newcomers rank in join order
    assert all(r[w]["pid"] == procs[w].pid for w in r)
    job.wait_for(2, event="step")  # training in the 2-worker group

    procs["w2"] = job.start("w2")  # a newcomer, prewarmed: it waits for a round with it
    job.wait_for(1, event="ready", worker="w2")
    job.allocate(3)
    r = _rounds(job, 3, 3)
    assert [r[w]["rank"] for w in (first, second, "w2")] == [0, 1, 2]  # survivors first
    assert all(r[w]["pid"] == procs[w].pid for w in r)
    assert r["w2"]["step"] == r[first]["step"] > 0  # the newcomer got rank 0's state

    job.allocate(1)
    r = _rounds(job, 1, 1)
    assert list(r) == [first] and r[first]["pid"] == procs[first].pid  # rank 0 survives
    assert procs[second].wait(timeout=30) == 0 and procs["w2"].wait(timeout=30) == 0
    job.wait_for(1, event="step", worker=first)

    job.allocate(0)  # the job is allocated nothing: the last worker leaves too
    assert procs[first].wait(timeout=30) == 0


@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_sigkill_of_a_member_reforms_without_it(backend, make_job, tmp_path, request):
    url = (f"embedded://{tmp_path / 'store.db'}" if backend == "embedded"
           else request.getfixturevalue("etcd_server").url)
    job = make_job(url, ttl=1.0)
    job.allocate(3)
    procs = {w: job.start(w) for w in ("w0", "w1", "w2")}
    r = _rounds(job, 3, 3)
    order = sorted(r, key=lambda w: r[w]["rank"])
    before = job.wait_for(3, event="step")
    victim = order[1]
    procs[victim].send_signal(signal.SIGKILL)
    r = _rounds(job, 2, 2, reason="failure")
    survivors = [w for w in order if w != victim]
    assert [r[w]["rank"] for w in survivors] == [0, 1]  # old order kept, rank 0 stays 0
    assert all(r[w]["pid"] == procs[w].pid for w in survivors)
    # training goes on from the last commit: nothing lost beyond the step in flight
    a, b = (r[w]["step"] for w in survivors)
    assert a == b >= max(e["step"] for e in before)
    job.wait_for(2, event="step", round=r[survivors[0]]["round"])
    assert all(procs[w].poll() is None for w in survivors)

    # a replacement fills the vacancy the allocation still has, without a new version
    procs["w3"] = job.start("w3")
    r = _rounds(job, 3, 3, reason="membership")
    assert [r[w]["rank"] for w in (*survivors, "w3")] == [0, 1, 2]
    assert all(r[w]["pid"] == procs[w].pid for w in r)


def test_etcd_restart_during_a_job(make_job, etcd_private):
    job = make_job(etcd_private.url)
    job.allocate(2)
    procs = {"w0": job.start("w0"), "w1": job.start("w1")}
    r = _rounds(job, 2, 2)
    order = sorted(r, key=lambda w: r[w]["rank"])
    job.wait_for(2, event="step")
    etcd_private.kill()
    # the store is gone: the group keeps training in its round
    steps = job.wait_for(4, event="step", round=r["w0"]["round"])
    assert len(steps) == 4 and all(p.poll() is None for p in procs.values())
    time.sleep(1.0)
    etcd_private.start()
    procs["w2"] = job.start("w2")
    job.wait_for(1, event="ready", worker="w2")
    job.allocate(3)
    r = _rounds(job, 3, 3)
    assert [r[w]["rank"] for w in (*order, "w2")] == [0, 1, 2]
    assert all(r[w]["pid"] == procs[w].pid for w in r)
