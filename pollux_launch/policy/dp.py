"""``pollux-dp``: exact GPU counts by dynamic programming, then packing onto nodes.

For p < 0, maximising FITNESS_p (Eqn 14) is minimising sum_j SPEEDUP_j^p, and for p > 0
maximising sum_j SPEEDUP_j^p: either way the objective is separable per job, so once
each job's speedup is tabulated against its GPU count (at the node count a packed
placement of that many GPUs needs), choosing the counts is a multiple-choice knapsack
over jobs x GPUs (as in Saxena et al., "Effective Elastic Scaling of Deep Learning
Workloads"). The re-allocation penalty enters the table: a job's current count keeps its
current placement unpenalised. The counts are then packed onto nodes honouring
capacities, interference avoidance and non-preemptible jobs, and left-over slots are
offered greedily to jobs that gain from them.

With interference avoidance on uniform nodes the knapsack has a second resource:
*exclusive nodes*. A distributed job holds its nodes to itself (no other distributed job
may share them) and a job that fills a node shares it with nobody, so counts whose
exclusive nodes exceed the cluster's cannot be packed however the placement tries
(e.g. five jobs of 14 GPUs on 16 nodes of 4 need 20 nodes). The exact DP then runs over
(GPUs, exclusive nodes), with "stay where you are" as a separate option holding the
job's current nodes, so that far fewer of its counts are ones no packing can place.

Counts and exclusive nodes still miss the *holes* distributed jobs leave in their partial
nodes (55 + 7 + 2 GPUs on 16 nodes of 4 leave two holes of 1, no node with 2), so a small
job's count may find no room. The counts are therefore packed two ways (largest first;
single-node jobs first, distributed ones spread over the holes) and the fitter packing is
improved by a local search on the true objective: a job takes GPUs on one node while the
jobs there shrink to make room, or leaves one of its nodes. On the 37 rounds of a
workload-1 simulation where packing alone trailed ``pollux-ga`` by over 3 % (mean 0.89x,
worst 0.67x its fitness), this gives mean 1.00x, worst 0.99x.

The knapsack is solved exactly over every count when that is cheap (J * G^2 small);
on large clusters a Lagrangian relaxation first finds near-optimal counts, and the
exact (GPU-only) DP then searches a window of counts around them.

Speed (``benchmarks/policy_scale.py``): each raw speedup is fetched from a job's
``speedup_fn`` once per round and (nodes, replicas), mostly in one call per job; the DPs
drop options an earlier one matches or beats (which they could never pick), and the
two-resource DP runs only where the GPU-only optimum does not fit the nodes; the greedy
fill keeps each job's costs of growing by ``a`` replicas and only re-reads the free slots
per step; the local search scores every move at once by the change in sum_j SPEEDUP_j^p.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollux_launch.policy.base import JobInfo, Policy, PolicyNode
from pollux_launch.policy.objective import (
    Objective,
    call_speedup,
    check_delta,
    check_p,
    fair_share,
    fitness,
    packed_nodes,
)
from pollux_launch.policy.placement import (
    allocation_violations,
    distributed_per_node,
    pinned_jobs,
    place_job,
    validate_round,
)

# log-space headroom for the scaled costs exp(p*log(s+eps) - C): the largest cost is
# e^600, so sums of many stay finite and the smallest still resolvable is ~e^-745.
_LOG_HEADROOM = 600.0


class _Speedups:
    """SPEEDUP_j of one round (Eqn 15 with the re-allocation penalty), exactly as
    ``Objective.speedups`` computes it, with every raw speedup fetched from the job's
    ``speedup_fn`` once per (nodes, replicas): packing and local search ask for the same
    few placements of a job many times, and on large clusters ``Objective`` keeps no
    memo (its table would be dense, jobs x nodes x GPUs). The memo is sparse: sorted
    codes of (job, nodes, replicas) and their raw speedups."""

    def __init__(self, obj: Objective) -> None:
        self.obj = obj
        # Replicas asked about: at most the cluster, a fair share (>= min_replicas) or
        # a current row; a malformed current beyond this is served without the memo.
        k_max = max([int(obj.slots.sum()), *(j.min_replicas for j in obj.jobs)])
        k_max = max(k_max, int(obj.current.sum(axis=1).max(initial=0)))
        self._radix = (obj.slots.size + 1, k_max + 1)  # code = (job*N' + nodes)*K' + k
        self._codes = np.zeros(0, dtype=np.int64)
        self._raw = np.zeros(0)

    def fetch(self, j: int, nn: np.ndarray, kk: np.ndarray) -> np.ndarray:
        """Raw speedups of job ``j`` from its ``speedup_fn`` (one call)."""
        return call_speedup(self.obj.jobs[j], nn, kk)

    def record(self, jj, nn, kk, raw) -> None:
        """Keep raw speedups fetched at (job, nodes, replicas) (int arrays, equal shapes)."""
        codes, first = np.unique(self._code(jj, nn, kk), return_index=True)
        pos, hit = self._find(codes)
        self._codes = np.insert(self._codes, pos[~hit], codes[~hit])
        self._raw = np.insert(self._raw, pos[~hit], np.asarray(raw, dtype=float)[first][~hit])

    def _code(self, jj, nn, kk) -> np.ndarray:
        n_radix, k_radix = self._radix
        return (np.asarray(jj, dtype=np.int64) * n_radix + nn) * k_radix + kk

    def _find(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.searchsorted(self._codes, codes)
        if self._codes.size == 0:
            return pos, np.zeros(codes.shape, dtype=bool)
        return pos, self._codes[np.minimum(pos, self._codes.size - 1)] == codes

    def raw(self, jj, nn, kk) -> np.ndarray:
        """Raw speedups at (job, nodes, replicas) (int arrays that broadcast together);
        one ``speedup_fn`` call per job with any not fetched yet."""
        jj, nn, kk = (np.asarray(x, dtype=np.int64) for x in (jj, nn, kk))
        if kk.size and (kk.max() >= self._radix[1] or nn.max() >= self._radix[0]):
            return self._direct(*np.broadcast_arrays(jj, nn, kk))
        codes = self._code(jj, nn, kk)
        pos, hit = self._find(codes)
        if not hit.all():
            miss = np.unique(codes[~hit])
            n_radix, k_radix = self._radix
            mj, mn, mk = miss // (n_radix * k_radix), miss // k_radix % n_radix, miss % k_radix
            raw = np.zeros(miss.size)
            for j in np.unique(mj).tolist():
                raw[mj == j] = self.fetch(j, mn[mj == j], mk[mj == j])
            self.record(mj, mn, mk, raw)
            pos = self._find(codes)[0]
        return self._raw[pos]

    def _direct(self, jj, nn, kk) -> np.ndarray:
        """Raw speedups straight from the jobs' ``speedup_fn`` (one call per job)."""
        out = np.zeros(kk.shape)
        for j in np.unique(jj).tolist():
            out[jj == j] = self.fetch(j, nn[jj == j], kk[jj == j])
        return out

    def value(self, jj, nn, kk, changed) -> np.ndarray:
        """Normalised speedups, penalised where the placement changed (Eqn 15); the
        arguments broadcast together."""
        s = self.raw(jj, nn, kk) / self.obj.norm[jj]
        return np.where(changed, s * self.obj.penalty[jj], s)

    def speedups(self, alloc: np.ndarray) -> np.ndarray:
        """Per-job speedups of allocations ``(..., J, N)``, as ``Objective.speedups``."""
        alloc = np.asarray(alloc)
        changed = np.any(alloc != self.obj.current, axis=-1)
        jj = np.arange(alloc.shape[-2])
        return self.value(jj, np.count_nonzero(alloc, axis=-1), alloc.sum(axis=-1), changed)

    def fitness(self, alloc: np.ndarray) -> np.ndarray:
        """FITNESS_p (Eqn 14) of allocations ``(..., J, N)``."""
        return fitness(self.speedups(alloc), self.obj.p, self.obj.eps)


class DPPolicy(Policy):
    """Knapsack DP over GPU counts + packing (see module docstring)."""

    name = "pollux-dp"

    def __init__(
        self,
        p: float = -1.0,
        delta: float = 30.0,
        interference_avoidance: bool = True,
        seed: int = 0,
        full_dp_budget: int = 4_000_000,
        window: int = 8,
        room_moves: int = 8,
        room_budget: int = 2048,
    ) -> None:
        self.p = check_p(p)
        self.delta = check_delta(delta)
        self.interference_avoidance = bool(interference_avoidance)
        self.seed = seed  # deterministic engine; accepted for a uniform interface
        self.full_dp_budget = int(full_dp_budget)
        self.window = int(window)
        self.room_moves = int(room_moves)  # local-search moves after packing
        self.room_budget = int(room_budget)  # (job, node, count) tries per move, about

    # ----------------------------------------------------------------- tables
    def _tables(self, memo: _Speedups, cur: np.ndarray, pinned: np.ndarray, stay_ok, G):
        """Per job: allowed counts, their speedups when moved there (penalised), and the
        unpenalised speedup of staying put.

        One ``speedup_fn`` call per job covers every count, the current placement and the
        fair-share normaliser (Eqn 15), which is set on ``obj`` here; it also fetches the
        small counts spread over one node more than packed, which packing fragmented
        nodes and the local search ask for (a pair more costs far less than a call).
        """
        obj = memo.obj
        jobs = obj.jobs
        share = fair_share(jobs, [PolicyNode("", int(s)) for s in obj.slots])
        k_cur, n_cur = cur.sum(axis=1), np.count_nonzero(cur, axis=1)
        top = np.where(pinned, 0, np.minimum([j.max_replicas for j in jobs], G))
        width = np.maximum(top, share) + 1
        packed = packed_nodes(np.arange(width.max(initial=1)), obj.slots)
        k_sp = np.arange(2, 2 * int(obj.slots.max(initial=0)) + 1)
        n_sp = packed_nodes(k_sp, obj.slots) + 1
        spread = n_sp <= np.minimum(k_sp, obj.slots.size)
        k_sp, n_sp = k_sp[spread], n_sp[spread]
        ks_all, moved, stay_val, fetched = [], [], np.zeros(len(jobs)), []
        for j, job in enumerate(jobs):
            w, sp = width[j], k_sp <= top[j]
            kk = np.concatenate([np.arange(w), k_cur[j : j + 1], k_sp[sp]])
            nn = np.concatenate([packed[:w], n_cur[j : j + 1], n_sp[sp]])
            raw = memo.fetch(j, nn, kk)
            fetched.append((np.full(kk.size, j), nn, kk, raw))
            best = float(np.max(raw[1 : share[j] + 1], initial=0.0))
            obj.norm[j] = best if best > 0 else 1.0
            if pinned[j]:
                ks_all.append(k_cur[j : j + 1])
                moved.append(np.zeros(1))
                continue
            ks, v = kk[: top[j] + 1], raw[: top[j] + 1] / obj.norm[j]
            ok = (ks == 0) | (ks >= max(job.min_replicas, 1))
            ks_all.append(ks[ok])
            moved.append(v[ok] * obj.penalty[j])  # every count is a move ...
            if stay_ok[j]:  # ... except staying exactly where the job is
                stay_val[j] = raw[w] / obj.norm[j]
        memo.record(*(np.concatenate(x) for x in zip(*fetched, strict=True)))
        return ks_all, moved, stay_val

    def _costs(self, vals: list[np.ndarray], eps: float) -> tuple[list[np.ndarray], float]:
        """Scaled per-job costs to minimise: sign * exp(p*log(v+eps) - C)."""
        z = self.p * np.log(np.concatenate([np.zeros(0), *vals]) + eps)  # all, then split
        shift = float(z.max(initial=-np.inf)) if z.size else 0.0
        shift -= _LOG_HEADROOM
        sign = 1.0 if self.p < 0 else -1.0
        costs = sign * np.exp(z - shift)
        return np.split(costs, np.cumsum([v.size for v in vals])[:-1]), shift

    def _cost(self, v: np.ndarray, eps: float) -> np.ndarray:
        """Per-job cost (lower is better) of speedups ``v``: sign * (v + eps)^p."""
        z = self.p * np.log(v + eps)
        return np.exp(z) if self.p < 0 else -np.exp(z)

    # -------------------------------------------------------------- knapsack
    @staticmethod
    def _lagrangian(ks_all, costs, G) -> tuple[np.ndarray, np.ndarray]:
        """Counts from min_k cost_j(k) + lam*k, bracketing sum k <= G (lo: may exceed)."""
        J = len(ks_all)
        width = max(len(k) for k in ks_all)
        K = np.zeros((J, width), dtype=np.int64)
        C = np.full((J, width), np.inf)
        for j, (ks, c) in enumerate(zip(ks_all, costs, strict=True)):
            K[j, : len(ks)] = ks
            C[j, : len(ks)] = c
        rows = np.arange(J)

        def counts(lam: float) -> np.ndarray:
            return K[rows, np.argmin(C + lam * K, axis=1)]

        k0 = counts(0.0)
        if k0.sum() <= G:
            return k0, k0
        finite = C[np.isfinite(C)]
        lo, hi = -700.0, float(np.log(np.ptp(finite) + 1.0) + 1.0)  # log(lambda)
        k_hi = counts(np.exp(hi))
        k_lo = k0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            k_mid = counts(np.exp(mid))
            if k_mid.sum() <= G:
                hi, k_hi = mid, k_mid
            else:
                lo, k_lo = mid, k_mid
            if hi - lo < 1e-6:
                break
        return k_hi, k_lo

    @staticmethod
    def _undominated(ks: np.ndarray, ds: np.ndarray | None, c: np.ndarray) -> np.ndarray:
        """Options that no earlier option matches or beats in GPUs, nodes and cost.

        The DP table only falls as the budget grows, so such an option is never the
        first minimum (argmin) at any budget: dropping it changes no choice.
        ``ds=None``: GPUs only, ``ks`` ascending (a running minimum suffices).
        """
        if ds is None:
            prev = np.minimum.accumulate(c)
            return np.append(True, c[1:] < prev[:-1])
        o = np.arange(ks.size)
        dom = (ks[:, None] <= ks) & (ds[:, None] <= ds) & (c[:, None] <= c) & (o[:, None] < o)
        return ~dom.any(axis=0)

    def _knapsack(self, ks_all, costs, G) -> np.ndarray:
        """Exact multiple-choice knapsack DP: min sum cost, sum k <= G."""
        J = len(ks_all)
        work = sum(len(k) for k in ks_all) * (G + 1)
        if work > self.full_dp_budget:
            k_hi, k_lo = self._lagrangian(ks_all, costs, G)
            w = self.window
            cand_ks, cand_cs = [], []
            for j, (ks, c) in enumerate(zip(ks_all, costs, strict=True)):
                a = min(k_hi[j], k_lo[j])
                b = max(k_hi[j], k_lo[j])
                keep = (ks == 0) | (ks == ks[0]) | ((ks >= a - w - a // 4) & (ks <= b + w + b // 4))
                cand_ks.append(ks[keep])
                cand_cs.append(c[keep])
            ks_all, costs = cand_ks, cand_cs
        # dp[g]: least cost with at most g GPUs, after kpad +inf entries for g < 0.
        kpad = max(int(k.max(initial=0)) for k in ks_all)
        dp = np.concatenate([np.full(kpad, np.inf), np.zeros(G + 1)])
        at = np.arange(kpad, G + 1 + kpad)
        choice, kept = [], []
        for ks, c in zip(ks_all, costs, strict=True):
            keep = self._undominated(ks, None, c)
            ks, c = ks[keep], c[keep]
            m = dp[at - ks[:, None]] + c[:, None]  # (options, budgets)
            choice.append(np.argmin(m, axis=0))
            dp[kpad:] = m.min(axis=0)
            kept.append(ks)
        out = np.zeros(J, dtype=np.int64)
        rem = G
        for j in range(J - 1, -1, -1):
            k = int(kept[j][choice[j][rem]])
            out[j] = k
            rem -= k
        return out

    def _knapsack_nodes(self, ks_all, ds_all, costs, G, D):
        """Exact multiple-choice knapsack over two resources: GPUs and *exclusive* nodes.

        With interference avoidance no two distributed jobs share a node, and a job that
        fills a node shares it with nobody, so option ``(k, d)`` of a job holds ``d``
        nodes to itself (its nodes if distributed, 1 if it fills one node, else 0) on top
        of its ``k`` GPUs. Minimises the sum of costs subject to sum k <= G and
        sum d <= D. Returns the chosen option index of each job.
        """
        # dp over (GPUs, nodes), padded with +inf rows and columns in front for budgets
        # below zero, so that every option is a plain shifted gather of the flat table.
        kpad = max(int(k.max(initial=0)) for k in ks_all)
        dpad = max(int(d.max(initial=0)) for d in ds_all)
        W = D + 1 + dpad
        table = np.full((G + 1 + kpad, W), np.inf)
        table[kpad:, dpad:] = 0.0
        at = np.arange(kpad, G + 1 + kpad)[:, None] * W + np.arange(dpad, W)
        choice, kept = [], []
        for ks, ds, c in zip(ks_all, ds_all, costs, strict=True):
            opts = np.flatnonzero(self._undominated(ks, ds, c))
            shift = (ks[opts] * W + ds[opts])[:, None, None]
            m = table.ravel()[at - shift] + c[opts][:, None, None]  # (O, G+1, D+1)
            choice.append(np.argmin(m, axis=0))
            table[kpad:, dpad:] = m.min(axis=0)
            kept.append(opts)
        out = np.zeros(len(ks_all), dtype=np.int64)
        rg, rn = G, D
        for j in range(len(ks_all) - 1, -1, -1):
            o = int(kept[j][choice[j][rg, rn]])
            out[j] = o
            rg -= int(ks_all[j][o])
            rn -= int(ds_all[j][o])
        return out

    # --------------------------------------------------------------- packing
    def _row_cost(self, memo: _Speedups, j: int, rows: np.ndarray, cur_row: np.ndarray):
        """Cost (lower is better) of candidate rows ``(M, N)`` for job ``j``."""
        v = memo.value(
            j,
            np.count_nonzero(rows, axis=1),
            rows.sum(axis=1),
            np.any(rows != cur_row, axis=1),
        )
        return self._cost(v, memo.obj.eps)

    def _valid_count(self, job: JobInfo, k: int) -> bool:
        return k == 0 or job.min_replicas <= k <= job.max_replicas

    def _pack(self, memo, cur, counts, fixed, pinned, small_first: bool = False):
        """Place the movers' counts around the fixed jobs, largest first; with
        ``small_first`` the single-node counts go first (best fit) and distributed jobs
        then spread over the holes they leave, which may fit both where largest-first
        leaves a small job no node with room."""
        jobs, slots = memo.obj.jobs, memo.obj.slots
        ia = self.interference_avoidance
        alloc = np.zeros_like(cur)
        alloc[fixed] = cur[fixed]
        free = slots - alloc.sum(axis=0)
        has_dist = distributed_per_node(alloc) > 0
        smax = int(slots.max())
        key = -counts + (2 * counts.max(initial=0) + 1) * (counts > smax) * small_first
        movers = [j for j in np.argsort(key, kind="stable") if not fixed[j] and counts[j]]
        for j in movers:
            k = int(counts[j])
            row = place_job(k, free, has_dist, cur[j], ia)
            if row.sum() != k or np.count_nonzero(row) != packed_nodes(k, slots):
                # Fragmented: compare placing fewer replicas (down to 0) by true cost.
                tries = {k, 0, jobs[j].min_replicas, *range(max(1, k - 2 * smax), k)}
                rows = [place_job(t, free, has_dist, cur[j], ia) for t in sorted(tries)]
                rows = [r for r in rows if self._valid_count(jobs[j], int(r.sum()))]
                rows = np.array(rows).reshape(len(rows), -1)
                if rows.shape[0] == 0:
                    continue
                row = rows[int(np.argmin(self._row_cost(memo, j, rows, cur[j])))]
            alloc[j] = row
            free -= row
            if np.count_nonzero(row) > 1:
                has_dist |= row > 0
        self._fill(memo, cur, alloc, free, pinned)
        return alloc

    def _fill(self, memo, cur, alloc, free, pinned) -> None:
        """Offer left-over slots to jobs that gain from them (greedy, in place): each step
        grows the job that gains most by ``a`` replicas on one of its nodes (any node for
        a job with none), so interference avoidance cannot be broken.

        A job's candidates differ only in ``a`` (its node count stays) except at most
        one (node, a) that returns it to its current row (no penalty), so its costs are
        tabulated per ``a`` when its row changes and a step only reads the free slots.
        """
        amax = int(free.max(initial=0))
        if amax <= 0:
            return
        J = alloc.shape[0]
        tab = {
            "q": np.full((J, amax), np.inf),  # cost of growing by a = 1..amax
            "qe": np.full(J, np.inf),  # cost of returning to the current row ...
            "ne": np.zeros(J, dtype=np.int64),  # ... by adding ae on node ne
            "ae": np.zeros(J, dtype=np.int64),
            "c0": np.zeros(J),  # cost of the row as it is
        }
        self._fill_costs(memo, cur, alloc, free, np.flatnonzero(~pinned), tab)
        a = np.arange(1, amax + 1)
        while np.any(free > 0):
            best = np.where(a <= self._fill_room(alloc, free)[:, None], tab["q"], np.inf)
            best = best.min(axis=1)
            ret = free[tab["ne"]] >= np.maximum(tab["ae"], 1)
            best = np.where(ret, np.minimum(best, tab["qe"]), best)
            gain = best - tab["c0"]
            neg = np.flatnonzero(gain < 0)
            top, j = 0.0, -1  # the first strictly best job, as a scan in job order picks
            cands = zip(neg.tolist(), gain[neg].tolist(), tab["c0"][neg].tolist(), strict=True)
            for x, g, c in cands:
                if g < top - 1e-12 * abs(c):
                    top, j = g, x
            if j < 0:
                return
            n, add = self._fill_choice(memo, cur, alloc[j], j, free, tab["c0"][j])
            alloc[j, n] += add
            free[n] -= add
            self._fill_costs(memo, cur, alloc, free, np.array([j]), tab)

    @staticmethod
    def _fill_room(alloc: np.ndarray, free: np.ndarray) -> np.ndarray:
        """Most replicas each job could add on one node: the free slots of its fullest-
        free node, or of any node for a job with none."""
        near = np.where(alloc > 0, free, 0).max(axis=1, initial=0)
        return np.where(alloc.sum(axis=1) == 0, free.max(initial=0), near)

    def _fill_costs(self, memo, cur, alloc, free, js, tab) -> None:
        """Fill ``tab`` for jobs ``js`` (see :meth:`_fill`) from their rows of ``alloc``;
        growth beyond today's free slots is never possible later, so never looked up."""
        obj = memo.obj
        A = alloc[js]
        k, nn = A.sum(axis=1), np.count_nonzero(A, axis=1)
        lo = np.array([obj.jobs[j].min_replicas for j in js], dtype=np.int64) - k
        room = np.array([obj.jobs[j].max_replicas for j in js], dtype=np.int64) - k
        room = np.minimum(room, self._fill_room(A, free))
        nodes = np.where(k > 0, nn, 1)  # grows on a node it uses, or starts on one
        a = np.arange(1, tab["q"].shape[1] + 1)
        r, c = np.nonzero((a >= lo[:, None]) & (a <= room[:, None]))
        tab["q"][js] = np.inf
        v = memo.value(js[r], nodes[r], k[r] + a[c], True)
        tab["q"][js[r], c] = self._cost(v, obj.eps)
        # The one step back to the current row: it differs at one node, by too few.
        diff = A - cur[js]
        ne = np.argmax(diff != 0, axis=1)
        ae = -diff[np.arange(js.size), ne]
        ok = (np.count_nonzero(diff, axis=1) == 1) & (ae > 0) & (ae >= lo) & (ae <= room)
        ok &= (k == 0) | (A[np.arange(js.size), ne] > 0)
        tab["ne"][js], tab["ae"][js], tab["qe"][js] = ne, np.where(ok, ae, 0), np.inf
        v = memo.value(js[ok], nodes[ok], k[ok] + ae[ok], False)
        tab["qe"][js[ok]] = self._cost(v, obj.eps)
        v = memo.value(js, nn, k, np.any(diff != 0, axis=1))
        tab["c0"][js] = self._cost(v, obj.eps)

    def _fill_choice(self, memo, cur, row, j, free, c0) -> tuple[int, int]:
        """The (node, a) a fill step gives job ``j``: its first cheapest candidate in
        (node, a) order."""
        job = memo.obj.jobs[j]
        k = int(row.sum())
        open_nodes = np.flatnonzero(free > 0)
        targets = open_nodes if k == 0 else open_nodes[row[open_nodes] > 0]
        a = np.arange(1, int(free.max()) + 1)
        limit = np.minimum(free[targets], job.max_replicas - k)
        t, i = np.nonzero((a <= limit[:, None]) & (k + a >= job.min_replicas))
        n, add = targets[t], a[i]
        diff = row - cur[j]
        dn = diff[n]
        changed = np.count_nonzero(diff) - (dn != 0) + (dn + add != 0) > 0
        v = memo.value(j, np.count_nonzero(row) + (row[n] == 0), k + add, changed)
        best = int(np.argmin(self._cost(v, memo.obj.eps) - c0))
        return int(n[best]), int(add[best])

    def _make_room(self, memo, cur, alloc, pinned) -> np.ndarray:
        """Local search after packing: a job takes ``k`` GPUs on one node, shrinking the
        jobs already there (largest first) to make room, or leaves one of its nodes; the
        best improving move, repeated.

        The knapsack counts GPUs and exclusive nodes but not the holes distributed jobs
        leave in their partial nodes, so a small job's count may find no node with room
        (55 + 7 + 2 GPUs on 16 nodes of 4 leaves two holes of 1, not one of 2). Trading a
        replica of a large job for a starved small one is then the gain FITNESS_p with
        p < 0 values most. Only the changed jobs' speedups are evaluated; on large
        clusters the moves are tried for the least-sped-up jobs only.
        """
        obj = memo.obj
        N = alloc.shape[1]
        S = memo.speedups(alloc)
        best_f = float(fitness(S, self.p, obj.eps))
        movable = np.flatnonzero(~pinned)
        per_job = N * int(obj.slots.max(initial=1))
        movable = movable[np.argsort(S[movable], kind="stable")]
        movable = movable[: max(1, self.room_budget // max(per_job, 1))]
        for _ in range(self.room_moves):
            move = self._best_move(memo, cur, alloc, pinned, movable, S)
            if move is None:
                break
            new = alloc.copy()
            for x, r in move:
                new[x] = r
            if float(memo.fitness(new)) <= best_f * (1 + 1e-9):
                break
            alloc = new
            self._fill(memo, cur, alloc, obj.slots - alloc.sum(axis=0), pinned)
            S = memo.speedups(alloc)
            best_f = float(fitness(S, self.p, obj.eps))
        return alloc

    def _best_move(self, memo, cur, alloc, pinned, movable, S):
        """The local-search move of :meth:`_make_room` that most lowers
        sign * sum_j (SPEEDUP_j + eps)^p (so raises FITNESS_p, Eqn 14), as
        ``[(job, new row), ...]``, or None when there is none.

        Every move is scored at once from the speedups of the jobs it changes, on
        (mover, node, k, donor) arrays: a node's donors give up replicas largest first,
        so a donor's cut is what is still needed after the donors before it, up to its
        replicas there. Ties go to the first move in (mover, node, k) order.
        """
        obj = memo.obj
        N, K = alloc.shape[1], int(obj.slots.max(initial=0))
        if movable.size == 0 or K == 0:
            return None
        js, kk = movable, np.arange(1, K + 1)
        donor, amt, (dn, di, t, d), v_don = self._donor_values(memo, cur, alloc, pinned, K)
        fit, (pm, pk), v_move, leave_ok, (lm, ln), v_leave = self._mover_values(
            memo, cur, alloc, js, K
        )
        # Costs on one scale, so that none overflows.
        z = [self.p * np.log(v + obj.eps) for v in (S, v_don, *v_move, v_leave)]
        shift = max(float(x.max(initial=-np.inf)) for x in z)
        sign = 1.0 if self.p < 0 else -1.0
        c_now, c_don, c_pen, c_back, c_leave = (sign * np.exp(x - shift) for x in z)
        gain_don = np.zeros((N, donor.shape[1], K + 1))  # [node, donor rank, cut]
        gain_don[dn, di, t] = c_don - c_now[d]
        c_move = np.zeros((2, js.size, K))  # [moved / back where it is, mover, k]
        c_move[:, pm, pk] = c_pen, c_back
        # Take moves: mover js[m] gets kk on node n, the donors there cutting `cut`.
        rows = alloc[js]
        need = kk - (obj.slots - alloc.sum(axis=0) + rows)[:, :, None]
        have = np.where(donor[None] == js[:, None, None], 0, amt[None])  # not the mover
        before = np.cumsum(have, axis=2) - have
        cut = np.clip(need[..., None] - before[:, :, None, :], 0, have[:, :, None, :])
        ok = fit[:, None, :] & (kk <= obj.slots[:, None]) & (need <= have.sum(axis=2)[..., None])
        gain = gain_don[np.arange(N)[:, None, None], np.arange(donor.shape[1]), cut].sum(axis=3)
        back = (cur[js][:, :, None] == kk) & (cur[js].sum(axis=1)[:, None, None] == kk)
        gain += np.where(back, c_move[1][:, None], c_move[0][:, None]) - c_now[js][:, None, None]
        g_leave = np.zeros(rows.shape)
        g_leave[lm, ln] = c_leave - c_now[js][lm]
        scores = np.concatenate([gain.reshape(js.size, -1), g_leave], axis=1).ravel()
        valid = np.flatnonzero(np.concatenate([ok.reshape(js.size, -1), leave_ok], axis=1))
        if valid.size == 0:
            return None
        m, rest = divmod(int(valid[np.argmin(scores[valid])]), N * K + N)
        return self._move_rows(memo, alloc, int(js[m]), rest, donor, cut[m])

    @staticmethod
    def _move_rows(memo, alloc, j, rest, donor, cut) -> list[tuple[int, np.ndarray]]:
        """The changed rows of mover ``j``'s move number ``rest`` (see :meth:`_best_move`):
        node-major take moves (k = 1..K), then leaving each node."""
        N, K = alloc.shape[1], cut.shape[1]
        row = alloc[j].copy()
        if rest >= N * K:  # leave a node
            row[rest - N * K] = 0
            return [(j, row)]
        n, kidx = divmod(rest, K)
        row[:] = 0
        row[n] = kidx + 1
        move = [(j, row)]
        for x, take in zip(donor[n].tolist(), cut[n, kidx].tolist(), strict=True):
            if take > 0:
                r = alloc[x].copy()
                r[n] -= take
                keep = r.sum() >= memo.obj.jobs[x].min_replicas  # below its minimum: stops
                move.append((x, r if keep else np.zeros_like(r)))
        return move

    def _donor_values(self, memo, cur, alloc, pinned, K):
        """Per node the donors (see :meth:`_donors`) and each one's speedup after giving
        up t = 1..its replicas there (0 when that takes it below its minimum), with their
        (node, rank, t, job) indices."""
        donor, amt = self._donors(alloc, pinned)
        dn, di, dt = np.nonzero(amt[:, :, None] >= np.arange(1, K + 1))
        d, t = donor[dn, di], dt + 1
        left = alloc[d].sum(axis=1) - t
        stays = left >= np.array([memo.obj.jobs[x].min_replicas for x in d.tolist()], dtype=int)
        diff = alloc[d] - cur[d]
        dd = diff[np.arange(d.size), dn]
        changed = np.count_nonzero(diff, axis=1) - (dd != 0) + (dd - t != 0) > 0
        v = memo.value(
            d,
            np.where(stays, np.count_nonzero(alloc[d], axis=1) - (t == alloc[d, dn]), 0),
            np.where(stays, left, 0),
            np.where(stays, changed, cur[d].any(axis=1)),
        )
        return donor, amt, (dn, di, t, d), v

    @staticmethod
    def _mover_values(memo, cur, alloc, js, K):
        """Speedups of movers ``js``: on one node with k = 1..K (where allowed) moved or
        back where it is, and after leaving each of their nodes; with their indices."""
        jobs = memo.obj.jobs
        mins = np.array([jobs[j].min_replicas for j in js.tolist()], dtype=np.int64)
        maxs = np.array([jobs[j].max_replicas for j in js.tolist()], dtype=np.int64)
        rows = alloc[js]
        k_now = rows.sum(axis=1)
        kk = np.arange(1, K + 1)
        fit = (kk >= np.maximum(np.maximum(k_now + 1, mins), 1)[:, None]) & (kk <= maxs[:, None])
        pm, pk = np.nonzero(fit)
        v_move = [memo.value(js[pm], 1, kk[pk], moved) for moved in (True, False)]
        left = k_now[:, None] - rows
        leave_ok = (rows > 0) & (left >= np.maximum(mins, 1)[:, None])
        lm, ln = np.nonzero(leave_ok)
        diff = rows - cur[js]
        dl = diff[lm, ln]
        changed = np.count_nonzero(diff, axis=1)[lm] - (dl != 0) + (cur[js][lm, ln] != 0) > 0
        v_leave = memo.value(js[lm], np.count_nonzero(rows, axis=1)[lm] - 1, left[lm, ln], changed)
        return fit, (pm, pk), v_move, leave_ok, (lm, ln), v_leave

    @staticmethod
    def _donors(alloc: np.ndarray, pinned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per node, the jobs that may give up replicas there, largest first (ties: job
        order), padded with -1: ``donor[n, i]`` and its replicas ``amt[n, i]``."""
        held = np.where(pinned[:, None], 0, alloc)
        d, n = np.nonzero(held)
        order = np.lexsort((d, -held[d, n], n))
        d, n = d[order], n[order]
        rank = np.arange(d.size) - np.searchsorted(n, n)
        W = int(rank.max(initial=-1)) + 1
        donor = np.full((alloc.shape[1], W), -1, dtype=np.int64)
        amt = np.zeros((alloc.shape[1], W), dtype=np.int64)
        donor[n, rank] = d
        amt[n, rank] = held[d, n]
        return donor, amt

    def _node_budget(self, obj: Objective, cur: np.ndarray, pinned: np.ndarray) -> int | None:
        """Nodes left for exclusive use after the pinned jobs, or None where the
        two-resource knapsack does not apply (no interference avoidance, or nodes of
        different sizes)."""
        slots = obj.slots
        if not self.interference_avoidance or slots.size == 0 or np.any(slots != slots[0]):
            return None
        held = self._exclusive_nodes(cur[pinned], int(slots[0]))
        return max(int(slots.size - held.sum()), 0)

    @staticmethod
    def _exclusive_nodes(rows: np.ndarray, slots: int) -> np.ndarray:
        """Nodes each row holds to itself: all of them if distributed, 1 if it fills its
        node, else 0."""
        rows = np.atleast_2d(rows)
        nn = np.count_nonzero(rows, axis=1)
        return np.where(nn > 1, nn, (rows.sum(axis=1) >= slots).astype(np.int64))

    def _solve_nodes(self, obj, cur, movable, ks_all, moved, stay_ok, stay_val, G, D):
        """Counts and stay decisions of the movable jobs by :meth:`_knapsack_nodes`.

        Moving to ``k`` GPUs is the packed placement (``packed_nodes(k)`` nodes, with
        the penalty); staying put is its own option with the job's current nodes.
        The GPU-only knapsack relaxes the node budget, so where its exact answer fits
        the nodes it is optimal here too (usually the case), and this DP is not run.
        """
        S = int(obj.slots[0])
        nn_all = packed_nodes(np.arange(max(k.max(initial=0) for k in ks_all) + 1), obj.slots)
        if sum(ks_all[j].size for j in movable) * (G + 1) <= self.full_dp_budget:
            counts, stay = self._solve_counts(
                obj, cur, movable, ks_all, moved, stay_ok, stay_val, G
            )
            nn = nn_all[counts]
            held = np.where(nn > 1, nn, (counts >= S).astype(np.int64))
            held = np.where(stay, self._exclusive_nodes(cur[movable], S), held)
            if held.sum() <= D:
                return counts, stay
        ks_opts, ds_opts, v_opts, is_stay = [], [], [], []
        for j in movable:
            ks, v = ks_all[j], moved[j]
            nn = nn_all[ks]
            ds = np.where(nn > 1, nn, (ks >= S).astype(np.int64))
            flag = np.zeros(ks.size, dtype=bool)
            if stay_ok[j]:
                ks = np.append(ks, cur[j].sum())
                ds = np.append(ds, self._exclusive_nodes(cur[j], S)[0])
                v = np.append(v, stay_val[j])
                flag = np.append(flag, True)
            ks_opts.append(ks.astype(np.int64))
            ds_opts.append(ds.astype(np.int64))
            v_opts.append(v)
            is_stay.append(flag)
        costs, _ = self._costs(v_opts, obj.eps)
        pick = self._knapsack_nodes(ks_opts, ds_opts, costs, G, D)
        counts = np.array([ks_opts[i][o] for i, o in enumerate(pick)], dtype=np.int64)
        stay = np.array([is_stay[i][o] for i, o in enumerate(pick)], dtype=bool)
        return counts, stay

    def _solve_counts(self, obj, cur, movable, ks_all, moved, stay_ok, stay_val, G):
        """Counts and stay decisions of the movable jobs by :meth:`_knapsack` (GPUs only):
        a job's current count is worth the better of moving and staying."""
        k_cur = cur.sum(axis=1)
        vals = []
        for j, (ks, v) in enumerate(zip(ks_all, moved, strict=True)):
            if stay_ok[j]:
                v = v.copy()
                v[ks == k_cur[j]] = np.maximum(v[ks == k_cur[j]], stay_val[j])
            vals.append(v)
        costs, _ = self._costs(vals, obj.eps)
        counts = self._knapsack([ks_all[j] for j in movable], [costs[j] for j in movable], G)
        stay = np.zeros(movable.size, dtype=bool)
        for i, j in enumerate(movable):
            if stay_ok[j] and counts[i] == k_cur[j]:
                at = moved[j][ks_all[j] == k_cur[j]]
                stay[i] = stay_val[j] >= (at[0] if at.size else 0.0)
        return counts, stay

    # -------------------------------------------------------------- optimize
    def optimize(
        self, jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current: np.ndarray
    ) -> np.ndarray:
        cur = validate_round(jobs, nodes, current)
        J, N = cur.shape
        if J == 0 or N == 0:
            return np.zeros((J, N), dtype=np.int64)
        obj = Objective(jobs, nodes, cur, self.p, self.delta, norm=np.ones(J))
        memo = _Speedups(obj)
        pinned = pinned_jobs(jobs, cur)
        free = np.maximum(obj.slots - cur[pinned].sum(axis=0), 0)
        G = int(free.sum())
        # A job may stay put only where the current matrix is itself feasible.
        over = cur.sum(axis=0) > obj.slots
        if self.interference_avoidance:
            over |= distributed_per_node(cur) > 1
        k_cur = cur.sum(axis=1)
        lo = np.array([j.min_replicas for j in jobs])
        hi = np.array([j.max_replicas for j in jobs])
        stay_ok = (k_cur > 0) & (lo <= k_cur) & (k_cur <= hi) & ~np.any(over & (cur > 0), 1)
        ks_all, moved, stay_val = self._tables(memo, cur, pinned, stay_ok, G)
        movable = np.flatnonzero(~pinned)
        counts = k_cur.copy()
        stay = np.zeros(J, dtype=bool)
        two_d = self._node_budget(obj, cur, pinned) if movable.size else None
        args = (obj, cur, movable, ks_all, moved, stay_ok, stay_val, G)
        if two_d is not None and (
            (G + 1) * (two_d + 1) * sum(ks_all[j].size + 1 for j in movable)
            <= self.full_dp_budget * 4
        ):
            counts[movable], stay[movable] = self._solve_nodes(*args, two_d)
        elif movable.size:
            counts[movable], stay[movable] = self._solve_counts(*args)
        packs = [self._pack(memo, cur, counts, pinned | stay, pinned, small) for small in (0, 1)]
        alloc = packs[int(np.argmax(memo.fitness(np.stack(packs))))]
        alloc = self._make_room(memo, cur, alloc, pinned)
        # Never worse than leaving everything as it is, when that is allowed.
        if not allocation_violations(cur, nodes, jobs, cur, self.interference_avoidance):
            f_cur, f_new = memo.fitness(np.stack([cur, alloc]))
            if f_cur > f_new:
                return cur.copy()
        return alloc
