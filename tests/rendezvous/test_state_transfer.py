"""Moving training state between ranks (``process_group``): broadcast, point-to-point
share from the holders, in-place receipt, and the in-memory commit's reused buffers."""

from __future__ import annotations

import multiprocessing as mp
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pollux_launch.rendezvous.process_group import (
    COALESCE_BYTES,
    InMemoryCommit,
    broadcast_state,
    share_state,
    share_waves,
    sync_state,
)

BIG = COALESCE_BYTES // 4 + 7  # float32 elements: one tensor over the coalescing limit


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(BIG, generator=g)
    return {"model": {"w": big, "wt": torch.randn(64, 300, generator=g).t(),  # strided
                      "b": torch.arange(5) + seed},
            "opt": {"state": {0: {"m": torch.randn(BIG, generator=g).double(),
                                  "step": torch.tensor(float(seed))}},
                    "param_groups": [{"lr": 0.1, "params": [0]}]},
            "empty": torch.zeros(0), "step": seed, "tag": ("x", None)}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@dataclass
class _Info:  # the GroupInfo fields sync_state reads
    rank: int
    world_size: int
    reason: str
    newcomers: tuple
    holders: list


def _run(world: int, target, *args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(target, r, world, port, out, *args))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return results


def _worker(target, rank: int, world: int, port: int, out, *args) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out.put((rank, target(rank, *args)))
    except Exception as exc:  # reported, not hung
        out.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def _broadcast(rank: int) -> object:
    mine = _state(rank)
    w, m = mine["model"]["w"], mine["opt"]["state"][0]["m"]
    got = broadcast_state(mine, into=mine)
    if rank == 0:
        return got is mine
    in_place = got["model"]["w"] is w and got["opt"]["state"][0]["m"] is m
    return _same(got, _state(0)) and in_place


def test_broadcast_state_large_and_small_tensors_land_in_place():
    assert _run(3, _broadcast) == {0: True, 1: True, 2: True}


def _share(rank: int, sets: list[list[int]]) -> object:
    results = []
    for holders in sets:  # holders hold the same state; the others receive it
        mine = _state(0) if rank in holders else _state(100 + rank)
        w = mine["model"]["w"]
        got = share_state(mine, holders, into=mine)
        results.append(got is mine if rank in holders
                       else _same(got, _state(0)) and got["model"]["w"] is w)
    return results


def test_share_state_reaches_every_rank_without_state():
    sets = [[0, 1], [0], [1, 2]]
    assert _run(4, _share, sets) == {r: [True] * len(sets) for r in range(4)}


def _sync(rank: int, reason: str, newcomers: tuple, holders: list[int]) -> object:
    # after a failure survivors may be a step apart (rank 0's state must win everywhere);
    # in a grow they hold the same state
    own = rank if reason == "failure" else 0
    mine = _state(own if rank in holders else 100 + rank)
    got = sync_state(mine, _Info(rank, 4, reason, newcomers, holders))
    return "kept" if got is None else _same(got, _state(0))


def test_sync_state_failure_takes_rank0_state_everywhere():
    got = _run(4, _sync, "failure", ("w3",), [0, 1, 2])
    assert got == {0: "kept", 1: True, 2: True, 3: True}


def test_sync_state_grow_leaves_survivors_alone():
    got = _run(4, _sync, "allocation", ("w2", "w3"), [0, 1])
    assert got == {0: "kept", 1: "kept", 2: True, 3: True}


def test_share_waves_double_the_holders():
    assert share_waves(4, [0, 1]) == [[(0, 2), (1, 3)]]
    assert share_waves(4, [0]) == [[(0, 1)], [(0, 2), (1, 3)]]
    assert share_waves(5, [2, 0]) == [[(0, 1), (2, 3)], [(0, 4)]]
    assert share_waves(3, [0, 1, 2]) == []
    assert share_waves(3, []) == []


def test_commit_reuses_its_buffers_and_restores_copies():
    w = torch.zeros(10)
    live = {"w": w, "n": 1}
    loaded: list[dict] = []
    commit = InMemoryCommit(lambda: live, loaded.append)
    commit.commit()
    first = commit.state["w"]
    w += 1
    live["n"] = 2
    commit.commit()
    assert commit.state["w"] is first and torch.equal(first, torch.ones(10))
    assert commit.state["n"] == 2 and first.data_ptr() != w.data_ptr()
    w += 1
    commit.restore()
    assert torch.equal(loaded[0]["w"], torch.ones(10)) and loaded[0]["w"] is not first
