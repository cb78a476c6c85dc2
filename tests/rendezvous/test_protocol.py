"""The protocol in one process: a one-worker job, bad input and clear errors."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pollux_launch.messages import Allocation, decode, encode
from pollux_launch.rendezvous.process_group import InMemoryCommit, broadcast_state
from pollux_launch.rendezvous.protocol import (
    Rendezvous,
    RendezvousConfig,
    RendezvousError,
    RendezvousTimeout,
    WorkerRemoved,
)
from pollux_launch.rendezvous.rounds import JobKeys, RoundInfo
from pollux_launch.rendezvous.store import open_store

FAST = RendezvousConfig(lease_ttl=1.0, join_timeout=1.0, backend="gloo", addr="127.0.0.1",
                        watch_timeout=0.2)


def _allocate(store, job: str, version: int, replicas: int) -> None:
    store.put(JobKeys(job).allocation, encode(Allocation(version, ("local",) * replicas)))


def _until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_one_worker_job_forms_notices_a_new_version_and_leaves_cleanly(store):
    _allocate(store, "solo", 1, 1)
    with Rendezvous(store, "solo", "w0", node="local", config=FAST) as rdzv:
        info = rdzv.next_round()
        assert (info.rank, info.world_size, info.round, info.members) == (0, 1, 1, ("w0",))
        assert (info.nodes, info.local_rank, info.local_world_size) == (("local",), 0, 1)
        assert info.needs_state_sync  # first round: everyone is a newcomer
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0] and not rdzv.should_rescale()
        assert store.get(JobKeys("solo").worker("w0")) is not None

        _allocate(store, "solo", 2, 0)  # the job is given nothing
        assert _until(rdzv.poll)
        assert rdzv.should_rescale()
        with pytest.raises(WorkerRemoved):
            rdzv.next_round()
        assert not dist.is_initialized()
        assert store.get(JobKeys("solo").worker("w0")) is None  # lease revoked at once


def test_a_member_joins_its_formed_round_even_after_a_newer_allocation(store):
    """Rank 0 formed a round and waits in the group's init for the others; an allocation
    written just then must not make another member bump past that round (rank 0 would
    wait for it until the collective timeout: a 60 s stall seen after a store wipe)."""
    _allocate(store, "race", 1, 2)
    with Rendezvous(store, "race", "w0", node="local", config=FAST) as a, \
            Rendezvous(store, "race", "w1", node="local", config=FAST) as b:
        entered: dict[int, float] = {}
        formed = None
        for _ in range(20):  # both join round 1; w0, the first to join, closes it
            for rdzv in (a, b):
                step = rdzv._attempt(entered)
                if not isinstance(step, str):
                    formed = formed or (rdzv.worker, step)
            if formed:
                break
        assert formed is not None, "round 1 never closed"
        closer, state = formed
        assert state.round == 1 and set(state.members) == {"w0", "w1"}
        _allocate(store, "race", 2, 2)  # the coordinator moves on meanwhile
        other = b if closer == "w0" else a
        step = other._attempt({})
        assert not isinstance(step, str) and step.round == 1, step  # joins, no new round
        assert store.get(JobKeys("race").round) is not None
        assert decode(RoundInfo, store.get(JobKeys("race").round).value).round == 1


def test_round_that_never_fills_raises_one_clear_line(store):
    _allocate(store, "big", 1, 3)
    with Rendezvous(store, "big", "w0", node="local", config=FAST) as rdzv:
        t0 = time.monotonic()
        with pytest.raises(RendezvousTimeout) as err:
            rdzv.next_round()
        assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert "1 worker(s) joined" in msg and "3 are needed" in msg and "\n" not in msg


def test_no_allocation_times_out_clearly(store):
    with Rendezvous(store, "none", "w0", node="local", config=FAST) as rdzv:
        with pytest.raises(RendezvousTimeout, match="found no round to join"):
            rdzv.next_round()


@pytest.mark.parametrize("value", ["not json", '{"v":1,"version":"two","nodes":["local"]}'])
def test_a_malformed_allocation_is_no_news(store, value):
    """Anyone with store access may write it: it is ignored (said once), like no
    allocation at all, never an error that would end the job's workers."""
    _allocate(store, "bad", 1, 1)
    store.put("jobs/bad/allocation", value)
    with Rendezvous(store, "bad", "w0", node="local", config=FAST) as rdzv:
        with pytest.raises(RendezvousTimeout, match="found no round to join"):
            rdzv.next_round()


@pytest.mark.parametrize("key,value", [
    ("rdzv/round", '{"v":1,"round":1,"alloc_version":1,"nodes":["local"],"evil":1}'),
])
def test_malformed_store_values_raise_rendezvous_error(store, key, value):
    _allocate(store, "bad", 1, 1)
    store.put(f"jobs/bad/{key}", value)
    with Rendezvous(store, "bad", "w0", node="local", config=FAST) as rdzv:
        with pytest.raises(RendezvousError, match="malformed value at store key") as err:
            rdzv.next_round()
    assert "\n" not in str(err.value)


def test_bad_or_unreachable_store_and_bad_config_are_one_line_errors(tmp_path):
    with pytest.raises(RendezvousError, match="POLLUX_STORE and POLLUX_JOB not set"):
        Rendezvous.from_env(env={})
    with pytest.raises(RendezvousError, match="POLLUX_STORE='nonsense'"):
        Rendezvous.from_env(env={"POLLUX_STORE": "nonsense", "POLLUX_JOB": "j"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    env = {"POLLUX_STORE": f"etcd://127.0.0.1:{port}", "POLLUX_JOB": "j"}
    with pytest.raises(RendezvousError, match="did not answer") as err:
        Rendezvous.from_env(FAST, env, timeout=1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="lease_ttl"):
        RendezvousConfig(lease_ttl=0)
    with pytest.raises(ValueError, match="worker id"):
        Rendezvous(open_store(f"embedded://{tmp_path / 's.db'}"), "j", "a/b")


def _broadcast_worker(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)

    def state():
        return {"model": {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([1, 2])},
                "opt": {"state": {0: {"momentum": torch.ones(2, dtype=torch.bfloat16)}},
                        "param_groups": [{"lr": 0.1, "params": [0], "nesterov": False}]},
                "step": 7, "tag": ("x", None)}
    sent = state()
    mine = state() if rank == 0 else {"junk": torch.zeros(1)}
    got = broadcast_state(mine)
    commit = InMemoryCommit(lambda: got, lambda s: None)
    commit.commit()
    got["model"]["w"] += 1  # the commit is a copy
    ok = (torch.equal(commit.state["model"]["w"], sent["model"]["w"])
          and torch.equal(commit.state["model"]["b"], sent["model"]["b"])
          and commit.state["opt"]["state"][0]["momentum"].dtype == torch.bfloat16
          and commit.state["opt"]["param_groups"] == sent["opt"]["param_groups"]
          and commit.state["step"] == 7 and commit.state["tag"] == ("x", None))
    out.put((rank, ok))
    dist.destroy_process_group()


def test_broadcast_state_sends_nested_state_without_pickle():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {0: True, 1: True}


def test_group_info_local_placement():
    from pollux_launch.rendezvous.protocol import GroupInfo

    info = GroupInfo(4, 3, 4, ("w0", "w1", "w2", "w3"), 2, "allocation", (), "gloo",
                     "127.0.0.1", 1, ("a", "b", "a", "a"))
    assert (info.local_rank, info.local_world_size, info.num_nodes) == (2, 3, 2)
    assert not info.needs_state_sync


@pytest.mark.parametrize("store_just_back", [True, False])
def test_a_lease_lapsed_around_a_store_outage_is_not_taken_for_a_death(store, store_just_back):
    """Keep-alives queued behind a stalled store land after its leases expired: a member
    whose key vanished while the store was away, or just after it came back, counts as
    dead only if it has not registered again ``lease_ttl`` later (it re-registers at
    once: its group goes on, nobody re-forms). Once the store has answered for longer,
    a vanished member is dead at once, as before."""
    _allocate(store, "stall", 1, 1)
    with Rendezvous(store, "stall", "w0", node="local", config=FAST) as rdzv:
        rdzv.next_round()
        key = JobKeys("stall").worker("w0")
        # the watcher's own record of when the store last started answering
        rdzv._store_ok_since = time.monotonic() - (0.0 if store_just_back else 10.0)
        lease = rdzv._lease
        store.lease_revoke(lease)  # the lease lapses: the worker's key goes
        assert _until(lambda: rdzv._lease != lease and store.get(key) is not None)
        time.sleep(2 * FAST.lease_ttl)  # (past any doubt: a real death would count now)
        assert rdzv.poll() is not store_just_back
