"""Elastic sampler / AdaptiveDataLoader: exactly-once epochs under any rescale sequence."""

from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from pollux_launch.adapters.torch.data import AdaptiveDataLoader, ElasticSampler, plan_step

# A change: (world size, per-replica batch, steps to run before the next change).
changes = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 9), st.integers(1, 8)), min_size=1, max_size=12
)


def _run_epoch(sampler: ElasticSampler, schedule, cycle_last: bool = True):
    """Step every rank in lock-step through one epoch; returns (all indices, per-step
    per-rank sizes with the batch size in force)."""
    seen, steps = [], []
    i = 0
    while True:
        world, bsz, n = schedule[min(i, len(schedule) - 1)]
        for _ in range(n):
            batches = [sampler.batch(r, world, bsz) for r in range(world)]
            if not batches[0]:
                assert all(not b for b in batches)
                return seen, steps
            seen.extend(x for b in batches for x in b)
            steps.append(([len(b) for b in batches], bsz))
            sampler.advance(world, bsz)
        i += 1


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 200), schedule=changes, seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_every_index_exactly_once_per_epoch(n, schedule, seed, epoch):
    sampler = ElasticSampler(n, seed=seed)
    sampler.set_epoch(epoch)
    seen, steps = _run_epoch(sampler, schedule)
    counts = Counter(seen)
    assert set(counts) == set(range(n))  # nothing skipped
    repeats = sum(c - 1 for c in counts.values())
    assert repeats == sampler.padded  # repeats only as documented padding ...
    for sizes, bsz in steps:
        assert min(sizes) >= 1 and max(sizes) <= bsz + 1  # ... and never an empty rank
        assert max(sizes) - min(sizes) <= 1 or sizes == [bsz] * len(sizes)
    if sampler.padded:  # only possible when fewer samples than replicas were left
        assert sampler.padded < max(w for w, _, _ in schedule)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 200), schedule=changes)
def test_drop_last_sees_each_index_at_most_once(n, schedule):
    sampler = ElasticSampler(n, drop_last=True, seed=1)
    seen, steps = _run_epoch(sampler, schedule)
    assert len(seen) == len(set(seen))
    assert all(sizes == [bsz] * len(sizes) for sizes, bsz in steps)  # only full steps
    assert n - len(seen) < max(w * b for w, b, _ in schedule)


def test_order_is_deterministic_per_seed_and_epoch():
    a, b = ElasticSampler(50, seed=3), ElasticSampler(50, seed=3)
    assert a.batch(1, 2, 5) == b.batch(1, 2, 5)
    b.set_epoch(1)
    assert a.batch(0, 1, 50) != b.batch(0, 1, 50)
    assert ElasticSampler(7, shuffle=False).batch(0, 1, 7) == list(range(7))


def test_plan_step_tail_rules():
    assert plan_step(10, 2, 4, drop_last=False) == [4, 4]
    assert plan_step(9, 2, 4, drop_last=False) == [5, 4]  # a 1-sample tail is absorbed
    assert plan_step(5, 2, 4, drop_last=False) == [3, 2]
    assert plan_step(5, 2, 4, drop_last=True) == []
    assert plan_step(2, 3, 4, drop_last=False) == [1, 1, 0]  # padding case
    with pytest.raises(ValueError, match="local_bsz >= 1"):
        plan_step(5, 2, 0, drop_last=False)


def test_sampler_state_is_json_and_resumes_mid_epoch():
    a = ElasticSampler(40, seed=9)
    a.advance(3, 4)
    b = ElasticSampler(40, seed=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.batch(1, 2, 3) == a.batch(1, 2, 3)
    with pytest.raises(ValueError, match="v=1"):
        b.load_state_dict({"epoch": 1})


# --- AdaptiveDataLoader over a real torch DataLoader --------------------------------------


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(5, 80),
    schedule=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2), st.integers(1, 4)),
        min_size=1,
        max_size=6,
    ),
)
def test_loader_rescales_mid_epoch_without_skips(n, schedule):
    """All ranks' loaders run in lock-step; every few optimiser steps the world size, the
    batch size and the accumulation change. A joining rank takes rank 0's state."""
    m0, max_bsz = 4, 200
    loaders = {0: AdaptiveDataLoader(_dataset(n), m0, max_batch_size=max_bsz, seed=5)}
    iters = {0: iter(loaders[0])}
    seen: list[int] = []
    world, micro, steps_left, si = 1, 0, schedule[0][3], 0
    while True:
        out = [next(iters[r], None) for r in range(world)]
        if out[0] is None:
            assert all(o is None for o in out)
            break
        seen.extend(int(x) for (b,) in out for x in b)
        micro += 1
        if not loaders[0].is_sync_step:
            assert all(not loaders[r].is_sync_step for r in range(world))
            continue
        micro = 0
        steps_left -= 1
        if steps_left == 0 and si + 1 < len(schedule):
            si += 1
            new_world, bsz, accum, steps_left = schedule[si]
            state = loaders[0].state_dict()
            for r in range(new_world):
                if r not in loaders:  # a new worker: gets rank 0's state, starts iterating
                    loaders[r] = AdaptiveDataLoader(_dataset(n), m0, max_batch_size=max_bsz, seed=5)
                    loaders[r].load_state_dict(state)
                    loaders[r].set_replicas(r, new_world)
                    loaders[r].set_batch_size(bsz, accum)
                    iters[r] = iter(loaders[r])
                else:
                    loaders[r].set_replicas(r, new_world)
                    loaders[r].set_batch_size(bsz, accum)
            for r in range(new_world, world):  # removed workers leave
                del loaders[r], iters[r]
            world = new_world
    assert set(seen) == set(range(n))  # nothing skipped, repeats only as counted padding
    assert len(seen) - n == loaders[0].padded_last_epoch
    assert loaders[0].epoch == 1


def test_loader_accumulation_and_batch_size_bookkeeping():
    loader = AdaptiveDataLoader(_dataset(30), 4, max_batch_size=16, local_bsz_bounds=(2, 8))
    assert (loader.local_bsz, loader.accum_steps, loader.batch_size) == (4, 0, 4)
    loader.set_batch_size(3, accum_steps=2)
    sync_flags, sizes = [], []
    for (x,) in loader:
        sizes.append(len(x))
        sync_flags.append(loader.is_sync_step)
    assert sum(sizes) == 30 and sizes[:9] == [3] * 9
    assert sync_flags[:6] == [False, False, True, False, False, True]
    assert sync_flags[-1] is True and loader.epoch == 1


def test_change_requested_mid_step_waits_for_the_step_boundary():
    loader = AdaptiveDataLoader(_dataset(40), 4, max_batch_size=16)
    loader.set_batch_size(2, accum_steps=1)
    it = iter(loader)
    assert len(next(it)[0]) == 2 and not loader.is_sync_step
    loader.set_batch_size(5)  # requested between the two micro-batches of a step
    assert len(next(it)[0]) == 2 and loader.is_sync_step
    assert len(next(it)[0]) == 5 and loader.is_sync_step


def test_loader_with_worker_processes_and_drop_last():
    loader = AdaptiveDataLoader(_dataset(23), 4, max_batch_size=8, drop_last=True, num_workers=2)
    got = [int(v) for (x,) in loader for v in x]
    assert len(got) == 20 and len(set(got)) == 20


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_size": 0}, "batch_size \\(M0\\) must be a positive integer"),
        ({"batch_size": 8, "max_batch_size": 4}, "max_batch_size must be an integer >= batch_size"),
        ({"batch_size": 8, "local_bsz_bounds": (4, 2)}, "local_bsz_bounds must satisfy"),
        ({"batch_size": 8, "shuffle": True, "sampler": None}, "chooses sampler itself"),
        ({"batch_size": 8, "rank": 2, "num_replicas": 2}, "need 0 <= rank < num_replicas"),
    ],
)
def test_bad_loader_arguments_are_one_line_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        AdaptiveDataLoader(_dataset(10), **kwargs)


def test_bad_batch_size_changes():
    loader = AdaptiveDataLoader(
        _dataset(10), 4, max_batch_size=8, local_bsz_bounds=(2, 6), gradient_accumulation=False
    )
    with pytest.raises(ValueError, match="outside local_bsz_bounds"):
        loader.set_batch_size(7)
    with pytest.raises(ValueError, match="accum_steps"):
        loader.set_batch_size(4, accum_steps=1)


class _Counting(torch.utils.data.Dataset):
    """A data set that fetches a list of indices in one call (``__getitems__``)."""

    def __init__(self, n: int) -> None:
        self.n, self.batch_calls, self.item_calls = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.item_calls += 1
        return torch.tensor([float(i)]), i

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        self.batch_calls += 1
        return [(torch.tensor([float(i)]), i) for i in indices]


def test_a_data_set_with_getitems_is_fetched_once_per_micro_batch():
    data = _Counting(37)
    loader = AdaptiveDataLoader(data, 4, max_batch_size=16, local_bsz_bounds=(2, 8))
    loader.set_batch_size(3, accum_steps=1)
    seen = [int(i) for _, idx in loader for i in idx]
    assert sorted(seen) == list(range(37))  # exactly once, as before
    assert data.batch_calls == 13 and data.item_calls == 0  # ceil(37 / 3) micro-batches


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tensor_data_set_is_fetched_as_whole_batches(workers):
    """A TensorDataset (and a Subset of one) is indexed once per tensor per micro-batch:
    the same batches as sample-by-sample fetching and collation, with worker processes
    and pin_memory (a no-op without a GPU) as DataLoader does."""
    from pollux_launch.adapters.torch.data import TensorBatches

    x = torch.arange(60.0).reshape(30, 2)
    y = torch.arange(30)
    for data in (TensorDataset(x, y), torch.utils.data.Subset(TensorDataset(x, y), range(3, 28))):
        kw = {"num_workers": workers, "pin_memory": True} if workers else {}
        fast = AdaptiveDataLoader(data, 4, max_batch_size=8, seed=3, **kw)
        assert isinstance(fast._fetch_from, TensorBatches)
        slow = AdaptiveDataLoader(data, 4, max_batch_size=8, seed=3,
                                  collate_fn=torch.utils.data.default_collate)
        assert not isinstance(slow._fetch_from, TensorBatches)  # the user's collate: as given
        with warnings.catch_warnings():  # (pin_memory without a GPU says it does nothing)
            warnings.simplefilter("ignore", UserWarning)
            got = list(fast)
        want = list(slow)
        assert len(got) == len(want)
        for (a, b), (c, d) in zip(got, want, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)
        assert sorted(int(v) for _, b in got for v in b) == sorted(
            int(data[i][1]) for i in range(len(data)))
