"""``saxena-dp``: the throughput-maximising elastic optimiser of Saxena et al.

V. Saxena, K. R. Jayaram, S. Basu, Y. Sabharwal, A. Verma, "Effective Elastic Scaling of
Deep Learning Workloads", MASCOTS 2020 (arXiv 2006.13878). Sources: only the paper's
abstract (batch-size ranges, scaling efficiency on multiple nodes, a fast DP optimiser that
scales jobs up and down, an autoscaler applying its counts and batch sizes) was reachable
when this was written, so the formulation below is reconstructed from it and from the DP
of an open reimplementation (Voda scheduler's "FfDL optimizer"); the paper's own equation
numbers are not cited.

The problem it solves each round: job ``j`` declares a range of total batch sizes
``[b_min_j, b_max_j]`` that train to the same accuracy and a cap ``k_max_j`` on its GPUs;
its throughput at ``k`` GPUs is the best, over batch sizes in its range that fit the GPUs'
memory, of samples per second predicted from profiled per-iteration compute and
all-reduce times. With ``G`` GPUs it picks a GPU count per job::

    maximise   sum_j  T_j(k_j)
    subject to sum_j  k_j <= G,   1 <= k_j <= k_max_j   (every admitted job runs)

by dynamic programming over jobs x GPUs (a multiple-choice knapsack)::

    P(0, g) = 0;   P(j, g) = max_{1 <= k <= min(k_max_j, g)}  P(j - 1, g - k) + T_j(k)

in O(J * G * k_max) <= O(J * G^2) time, and each job then runs at the batch size that
reached ``T_j(k_j)``. Jobs that do not fit (more jobs than GPUs) wait in a queue: here,
admission control upstream keeps them out; see :meth:`SaxenaDPPolicy.optimize` for what
happens when it does not.

Here ``T_j(k) = JobInfo.throughput_fn(nodes, k)``: :class:`pollux_launch.goodput.
ThroughputFunction`, i.e. Pollux's throughput model (Eqn 7-11) at the best (m, s) with
the total batch in the job's range (Eqn 13 without EFFICIENCY), at the fewest nodes that
hold ``k`` GPUs; ``k_max_j = max_replicas`` and ``min_replicas`` raises the lower bound 1.

How it differs from Pollux's PolluxSched (``pollux-dp``, ``pollux-ga``):

* objective: the plain sum of raw throughputs (samples/s; no normalisation, no fairness),
  where Pollux maximises FITNESS_p, a power mean (p = -1 by default) of speedups
  normalised to each job's fair share (Eqn 14-15);
* no statistical efficiency: every sample counts the same whatever the batch size, so the
  batch grows towards ``b_max`` wherever that raises samples/s; Pollux weighs each sample
  by EFFICIENCY(M) (Eqn 6), i.e. optimises goodput, not throughput;
* every admitted job gets at least one GPU (Pollux may leave a job with none);
* no re-allocation penalty (``delta``) and no notion of nodes: the paper treats the
  cluster as a pool of GPUs. This engine places the counts onto nodes itself (capacities,
  interference avoidance, non-preemptible jobs), as every engine here must.

Options: ``normalize=True`` sums each job's throughput in units of its own best rate per
GPU instead, i.e. a sum of per-job speedups (what the Voda reimplementation sums): a
model with many cheap samples then no longer outweighs one with few costly ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollux_launch.policy.base import JobInfo, Policy, PolicyNode, SpeedupFn
from pollux_launch.policy.objective import check_delta, check_p, packed_nodes
from pollux_launch.policy.placement import (
    distributed_per_node,
    pinned_jobs,
    place_job,
    validate_round,
)

__all__ = ["SaxenaDPPolicy", "max_throughput_counts"]


def max_throughput_counts(rates: Sequence[np.ndarray], lo: np.ndarray, budget: int) -> np.ndarray:
    """GPU counts maximising ``sum_j rates[j][k_j]`` with ``lo[j] <= k_j < len(rates[j])``
    and ``sum_j k_j <= budget``: the DP above, vectorised over budgets.

    ``rates[j][k]`` is job ``j``'s value at ``k`` GPUs (k = 0, 1, ...). Ties go to fewer
    GPUs (for the last job first). Raises ValueError when the lower bounds exceed the
    budget or a job has no allowed count.
    """
    lo = np.asarray(lo, dtype=np.int64)
    if len(rates) != lo.size:
        raise ValueError(f"{len(rates)} rate tables but {lo.size} lower bounds")
    if np.any(lo < 0) or any(lo[j] >= len(r) for j, r in enumerate(rates)):
        raise ValueError("every job needs an allowed count: 0 <= lo[j] < len(rates[j])")
    if int(lo.sum()) > budget:
        raise ValueError(f"the jobs need {int(lo.sum())} GPUs at least but {budget} are free")
    if not rates:
        return np.zeros(0, dtype=np.int64)
    kpad = max(len(r) for r in rates) - 1
    # dp[kpad + g]: best value with at most g GPUs so far; -inf below g = 0.
    dp = np.concatenate([np.full(kpad, -np.inf), np.zeros(budget + 1)])
    at = np.arange(kpad, kpad + budget + 1)
    choices = []
    for r, low in zip(rates, lo.tolist(), strict=True):
        ks = np.arange(low, min(len(r), budget + 1))
        v = np.asarray(r, dtype=float)[ks]
        # dp only rises with g: an option no better than a smaller one is never picked.
        best_before = np.maximum.accumulate(np.concatenate([[-np.inf], v[:-1]]))
        ks, v = ks[v > best_before], v[v > best_before]
        total = dp[at - ks[:, None]] + v[:, None]  # (options, budgets)
        pick = np.argmax(total, axis=0)
        dp[kpad:] = total[pick, np.arange(budget + 1)]
        choices.append(ks[pick])
    out = np.zeros(len(rates), dtype=np.int64)
    g = budget
    for j in range(len(rates) - 1, -1, -1):
        out[j] = choices[j][g]
        g -= int(out[j])
    return out


def _sanitised(fn: SpeedupFn, nn: np.ndarray, kk: np.ndarray) -> np.ndarray:
    """``fn(nn, kk)`` as finite floats >= 0, 0 at 0 replicas."""
    nn, kk = np.asarray(nn, dtype=np.int64), np.asarray(kk, dtype=np.int64)
    out = np.broadcast_to(np.asarray(fn(nn, kk), dtype=float), kk.shape)
    return np.where((kk > 0) & np.isfinite(out), np.maximum(out, 0.0), 0.0)


class SaxenaDPPolicy(Policy):
    """Saxena et al.'s DP over jobs x GPUs, then placement onto nodes (module docstring).

    ``interference_avoidance`` is honoured when placing. ``p``, ``delta`` and ``seed`` are
    accepted (validated as the other engines do) so that ``make_policy(name, **common)``
    builds any engine, and ignored: the objective has no fairness exponent and no
    re-allocation penalty, and the engine is deterministic.
    """

    name = "saxena-dp"

    def __init__(
        self,
        p: float = -1.0,
        delta: float = 30.0,
        interference_avoidance: bool = True,
        seed: int = 0,
        normalize: bool = False,
    ) -> None:
        check_p(p)
        check_delta(delta)
        self.interference_avoidance = bool(interference_avoidance)
        self.seed = seed
        self.normalize = bool(normalize)

    def optimize(
        self, jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current: np.ndarray
    ) -> np.ndarray:
        """Next allocation: the DP's counts placed onto nodes.

        Non-preemptible running jobs keep their rows; the others share the remaining
        ``G`` slots. Each job may take 0 or ``[max(min_replicas, 1), max_replicas]``
        replicas. Admission: jobs are admitted in input order while their minimum still
        fits in what earlier admitted jobs leave (a job whose minimum does not fit gets
        nothing; later, smaller ones may still be admitted); every admitted job gets at
        least its minimum, so when all minima fit, every job runs (a minimum of one
        replica always finds a slot; larger minima may not, on fragmented nodes).
        Placement and the use of left-over slots: :meth:`_place`, :meth:`_fill`.
        """
        cur = validate_round(jobs, nodes, current)
        J, N = cur.shape
        if J == 0 or N == 0:
            return np.zeros((J, N), dtype=np.int64)
        slots = np.array([int(n.slots) for n in nodes], dtype=np.int64)
        pinned = pinned_jobs(jobs, cur)
        G = int(np.maximum(slots - cur[pinned].sum(axis=0), 0).sum())
        lo = np.array([max(j.min_replicas, 1) for j in jobs], dtype=np.int64)
        hi = np.array([min(j.max_replicas, G) for j in jobs], dtype=np.int64)
        movable = ~pinned & (lo <= hi)
        admitted = np.zeros(J, dtype=bool)
        left = G
        for j in np.flatnonzero(movable).tolist():
            if lo[j] <= left:
                admitted[j], left = True, left - int(lo[j])
        fns, scale, raw = self._tables(jobs, slots, np.where(movable, hi, 0))
        adm = np.flatnonzero(admitted)
        counts = np.zeros(J, dtype=np.int64)
        counts[adm] = max_throughput_counts([scale[j] * raw[j] for j in adm], lo[adm], G)

        def value(j: int, nn, kk) -> np.ndarray:
            return scale[j] * _sanitised(fns[j], nn, kk)

        def total(alloc: np.ndarray) -> float:
            nn, kk = np.count_nonzero(alloc, axis=1), alloc.sum(axis=1)
            return sum(float(value(j, nn[j], kk[j])) for j in np.flatnonzero(movable))

        best, fragmented = None, False
        for compact in (False, True):
            alloc, fragmented = self._place(cur, counts, pinned, slots, lo, value, compact)
            self._fill(alloc, slots, movable, lo, hi, value)
            if best is None or total(alloc) > total(best) * (1 + 1e-12):
                best = alloc
            if not fragmented:
                break
        return best

    def _tables(self, jobs: Sequence[JobInfo], slots: np.ndarray, top: np.ndarray):
        """Each job's rate function, the factor its values are scaled by, and its raw
        values at k = 0..top[j] GPUs on the fewest nodes that hold them (one call each).

        A job without ``throughput_fn`` uses its ``speedup_fn`` (its measured scaling,
        statistical efficiency included) scaled so that its best rate per GPU equals the
        median best rate per GPU of the jobs that have one (unscaled if none has): it
        scales as its own model says, at a typical job's speed. With ``normalize`` every
        job is scaled to a best rate per GPU of 1.
        """
        fns = [j.speedup_fn if j.throughput_fn is None else j.throughput_fn for j in jobs]
        raw, per_gpu = [], np.zeros(len(jobs))
        for j, fn in enumerate(fns):
            ks = np.arange(top[j] + 1)
            raw.append(_sanitised(fn, packed_nodes(ks, slots), ks) if top[j] else np.zeros(1))
            if top[j]:
                per_gpu[j] = float(np.max(raw[j][1:] / ks[1:]))
        scale = np.ones(len(jobs))
        ok = per_gpu > 0
        if self.normalize:
            scale[ok] = 1.0 / per_gpu[ok]
            return fns, scale, raw
        known = np.array([j.throughput_fn is not None for j in jobs]) & ok
        if known.any():
            guess = ok & ~known
            scale[guess] = float(np.median(per_gpu[known])) / per_gpu[guess]
        return fns, scale, raw

    def _place(self, cur, counts, pinned, slots, lo, value, compact):
        """Pinned rows as they are; the others largest count first (``place_job``).
        Returns (allocation, whether any count landed fragmented).

        Where a count lands fragmented (not whole, or on more nodes than it needs), a few
        smaller counts down to the job's minimum are placed too and, of those rows, the
        one with the highest rate is kept, or with ``compact`` the highest-rate one on
        the fewest nodes its replicas need (the fill step offers the slots it leaves to
        the others). A job that cannot be given even its minimum gets nothing.
        """
        ia = self.interference_avoidance
        alloc = np.zeros_like(cur)
        alloc[pinned] = cur[pinned]
        free = slots - alloc.sum(axis=0)
        has_dist = distributed_per_node(alloc) > 0
        smax = int(slots.max())
        fragmented = False
        order = [j for j in np.argsort(-counts, kind="stable").tolist()
                 if counts[j] > 0 and not pinned[j]]
        for j in order:
            k = int(counts[j])
            row = place_job(k, free, has_dist, cur[j], ia)
            if row.sum() != k or np.count_nonzero(row) > packed_nodes(k, slots):
                fragmented = True
                tries = {k, int(row.sum()), int(lo[j]), *range(max(int(lo[j]), k - 2 * smax), k)}
                rows = [place_job(t, free, has_dist, cur[j], ia) for t in sorted(tries) if t]
                # (a row short of its count is still a valid placement of its sum)
                rows = np.array([r for r in rows if r.sum() >= lo[j]]).reshape(-1, free.size)
                if rows.shape[0] == 0:
                    continue
                nn, kk = np.count_nonzero(rows, axis=1), rows.sum(axis=1)
                rates = value(j, nn, kk)
                if compact:
                    rates = np.where(nn <= packed_nodes(kk, slots), rates, rates - np.inf)
                    rates = rates if np.isfinite(rates).any() else value(j, nn, kk)
                row = rows[int(np.argmax(rates))]
            alloc[j] = row
            free -= row
            if np.count_nonzero(row) > 1:
                has_dist |= row > 0
        return alloc, fragmented

    @staticmethod
    def _fill(alloc, slots, movable, lo, hi, value) -> None:
        """Give left-over slots, in place, to the job whose rate rises most: ``a`` more
        replicas on one node it already uses (any node for a job with none), so its node
        count (and interference avoidance) stays as it is. Stops when nothing gains.

        Each job's gain per ``a`` is tabulated once and again only when its row changes.
        """
        free = slots - alloc.sum(axis=0)
        amax = int(free.max(initial=0))
        if amax <= 0 or not movable.any():
            return
        a = np.arange(1, amax + 1)
        gain = np.full((alloc.shape[0], amax), -np.inf)

        def tabulate(j: int) -> None:
            k, nn = int(alloc[j].sum()), max(np.count_nonzero(alloc[j]), 1)
            ok = (k + a <= hi[j]) & (k + a >= lo[j])
            v = value(j, np.full(amax + 1, nn), np.append(k, k + a))  # now, then grown
            gain[j] = np.where(ok, v[1:] - v[0], -np.inf)

        for j in np.flatnonzero(movable).tolist():
            tabulate(j)
        while free.any():
            idle = alloc.sum(axis=1) == 0
            room = np.where(idle, free.max(), np.where(alloc > 0, free, 0).max(axis=1))
            masked = np.where(a <= room[:, None], gain, -np.inf)
            j, i = np.unravel_index(int(np.argmax(masked)), masked.shape)
            if not masked[j, i] > 0:
                return
            add = int(a[i])
            nodes = np.flatnonzero((free >= add) & ((alloc[j] > 0) | idle[j]))
            n = nodes[np.lexsort((-alloc[j, nodes], free[nodes]))[0]]  # best fit
            alloc[j, n] += add
            free[n] -= add
            tabulate(int(j))
