"""pollux-dp's fast paths give what the plain computations give: the round's speedup
memo, the tabulated greedy fill, the array-scored local-search move, the pruned DPs,
and about one ``speedup_fn`` call per job."""

import dataclasses
import itertools

import numpy as np

from pollux_launch.policy import make_policy
from pollux_launch.policy.dp import DPPolicy, _Speedups
from pollux_launch.policy.objective import Objective, fitness
from pollux_launch.policy.placement import pinned_jobs

from .synthetic import random_round


def _round(seed, n_nodes=6, n_jobs=9, slots=4):
    """A random round with every job started a while ago (no penalty factor of 0)."""
    jobs, nodes, cur = random_round(np.random.default_rng(seed), n_nodes, n_jobs, slots)
    jobs = [dataclasses.replace(j, age=max(j.age, 3600.0), restarts=0) for j in jobs]
    obj = Objective(jobs, nodes, cur, -1.0)
    return jobs, nodes, cur, obj


def _random_alloc(rng, cur, slots):
    """A feasible allocation: pinned rows kept, the rest first-fit at random counts."""
    alloc = np.where(cur.sum(axis=1, keepdims=True) > 0, cur, 0) * (rng.random() < 0.5)
    free = slots - alloc.sum(axis=0)
    for j in rng.permutation(cur.shape[0]):
        if alloc[j].any():
            continue
        for n in rng.permutation(cur.shape[1]):
            k = int(rng.integers(0, free[n] + 1))
            alloc[j, n] = k
            free[n] -= k
            if rng.random() < 0.6:
                break
    return alloc


def test_round_memo_matches_the_objective():
    rng = np.random.default_rng(0)
    for seed in range(5):
        _, _, cur, obj = _round(seed)
        allocs = np.stack([_random_alloc(rng, cur, obj.slots) for _ in range(20)])
        memo = _Speedups(obj)
        np.testing.assert_array_equal(memo.speedups(allocs), obj.speedups(allocs))
        np.testing.assert_array_equal(memo.fitness(allocs), obj(allocs))


def _plain_fill(pol, memo, cur, alloc, free, pinned):
    """The greedy fill step by step: every job's every candidate, every step."""
    jobs = memo.obj.jobs
    while np.any(free > 0):
        open_nodes = np.flatnonzero(free > 0)
        best = (0.0, -1, None)
        for j in np.flatnonzero(~pinned):
            row, k = alloc[j], int(alloc[j].sum())
            used = np.flatnonzero(row)
            targets = open_nodes if k == 0 else np.intersect1d(used, open_nodes)
            cands = []
            for n in targets:
                for a in range(1, min(int(free[n]), jobs[j].max_replicas - k) + 1):
                    if k + a >= jobs[j].min_replicas:
                        cands.append(row.copy())
                        cands[-1][n] += a
            if not cands:
                continue
            c = pol._row_cost(memo, j, np.vstack([row[None], cands]), cur[j])
            i = int(np.argmin(c[1:] - c[0]))
            if c[1 + i] - c[0] < best[0] - 1e-12 * abs(c[0]):
                best = (c[1 + i] - c[0], j, cands[i])
        if best[1] < 0:
            return
        free -= best[2] - alloc[best[1]]
        alloc[best[1]] = best[2]


def test_tabulated_fill_matches_the_plain_greedy():
    rng = np.random.default_rng(1)
    pol = DPPolicy()
    for seed in range(30):
        jobs, _, cur, obj = _round(seed, n_nodes=int(rng.integers(1, 7)))
        pinned = pinned_jobs(jobs, cur)
        base = _random_alloc(rng, cur, obj.slots)
        base[pinned] = cur[pinned]
        base[:, (base.sum(axis=0) > obj.slots)] = 0
        out = []
        for fill in (pol._fill, lambda *a: _plain_fill(pol, *a)):
            alloc = base.copy()
            fill(_Speedups(obj), cur, alloc, obj.slots - alloc.sum(axis=0), pinned)
            out.append(alloc)
        np.testing.assert_array_equal(out[0], out[1])


def _plain_moves(alloc, jobs, slots, pinned, movable):
    """Every local-search move of ``_make_room``, built row by row."""
    N = alloc.shape[1]
    moves = []
    for j in movable:
        k_now, job = int(alloc[j].sum()), jobs[j]
        for n in range(N):
            free_n = int(slots[n] - alloc[:, n].sum() + alloc[j, n])
            donors = np.argsort(-alloc[:, n], kind="stable")
            top = min(slots[n], job.max_replicas)
            for k in range(max(k_now + 1, job.min_replicas, 1), top + 1):
                need, row = k - free_n, np.zeros(N, dtype=np.int64)
                row[n] = k
                change = [(j, row)]
                for d in donors:
                    if need <= 0 or alloc[d, n] == 0:
                        break
                    if pinned[d] or d == j:
                        continue
                    take = min(need, int(alloc[d, n]))
                    need -= take
                    r = alloc[d].copy()
                    r[n] -= take
                    change.append((d, r if r.sum() >= jobs[d].min_replicas else 0 * r))
                if need <= 0:
                    moves.append(change)
        for n in np.flatnonzero(alloc[j]):
            r = alloc[j].copy()
            r[n] = 0
            if r.sum() >= max(job.min_replicas, 1):
                moves.append([(j, r)])
    return moves


def test_array_scored_move_is_the_fittest_move():
    rng = np.random.default_rng(2)
    pol = DPPolicy()
    for seed in range(30):
        jobs, _, cur, obj = _round(seed, n_nodes=int(rng.integers(1, 6)))
        pinned = pinned_jobs(jobs, cur)
        alloc = _random_alloc(rng, cur, obj.slots)
        alloc[pinned] = cur[pinned]
        alloc[:, (alloc.sum(axis=0) > obj.slots)] = 0
        memo = _Speedups(obj)
        movable = np.flatnonzero(~pinned)
        moves = _plain_moves(alloc, jobs, obj.slots, pinned, movable)
        move = pol._best_move(memo, cur, alloc, pinned, movable, memo.speedups(alloc))
        assert (move is None) == (not moves)
        if move is None:
            continue
        cands = np.stack([alloc] * len(moves))
        for c, change in enumerate(moves):
            for x, r in change:
                cands[c, x] = r
        new = alloc.copy()
        for x, r in move:
            new[x] = r
        assert any(np.array_equal(new, c) for c in cands)
        f = fitness(memo.speedups(cands), -1.0, obj.eps)
        assert float(memo.fitness(new)) >= f.max() * (1 - 1e-12)


def test_pruned_knapsacks_reach_the_brute_force_optimum():
    rng = np.random.default_rng(3)
    pol = DPPolicy()
    for _ in range(40):
        J, G, D = int(rng.integers(1, 4)), int(rng.integers(0, 7)), int(rng.integers(0, 3))
        ks = [np.arange(int(rng.integers(1, 5))) for _ in range(J)]
        ds = [np.minimum(k // 2, rng.integers(0, 2, k.size) + k // 3) for k in ks]
        cs = [np.round(rng.random(k.size), 1) for k in ks]  # ties on purpose
        best1 = best2 = np.inf
        for pick in itertools.product(*(range(k.size) for k in ks)):
            k = sum(ks[j][o] for j, o in enumerate(pick))
            d = sum(ds[j][o] for j, o in enumerate(pick))
            c = sum(cs[j][o] for j, o in enumerate(pick))
            best1 = min(best1, c) if k <= G else best1
            best2 = min(best2, c) if k <= G and d <= D else best2
        counts = pol._knapsack(ks, cs, G)
        assert counts.sum() <= G
        assert sum(cs[j][k] for j, k in enumerate(counts)) == best1
        if np.isfinite(best2):
            pick = pol._knapsack_nodes(ks, ds, cs, G, D)
            assert sum(ks[j][o] for j, o in enumerate(pick)) <= G
            assert sum(ds[j][o] for j, o in enumerate(pick)) <= D
            assert sum(cs[j][o] for j, o in enumerate(pick)) == best2


class _Counted:
    """A speedup function that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, num_nodes, num_replicas):
        self.calls += 1
        return self.fn(num_nodes, num_replicas)


def test_about_one_speedup_call_per_job():
    for seed in range(8):
        jobs, nodes, cur, _ = _round(seed, n_nodes=8, n_jobs=12)
        fns = [_Counted(j.speedup_fn) for j in jobs]
        jobs = [dataclasses.replace(j, speedup_fn=f) for j, f in zip(jobs, fns, strict=True)]
        make_policy("pollux-dp").optimize(jobs, nodes, cur)
        calls = [f.calls for f in fns]
        assert max(calls) <= 2 and sum(calls) <= len(jobs) + 3, calls
