"""``pollux-ga``: the Pollux paper's population-based search (NSGA-II, pymoo's ranking).

Follows the Pollux artifact's policy (petuum/adaptdl, ``simulator/pollux.py``): NSGA-II
over allocation matrices with two objectives, FITNESS_p (Eqn 14) and cluster utility;
mutation resets a job's row to the current allocation, zeroes random elements and grows
random elements into free slots; crossover exchanges the rows of a random prefix of jobs;
repair enforces non-preemptible jobs, interference avoidance, max replicas, node
capacities and min replicas, in that order. The population is warm-started from the
previous round's (rows matched by job name, columns by node name), plus the current
allocation. The answer is the fittest individual of the final population.

The generation loop is pymoo's NSGA-II (``GeneticAlgorithm`` with ``Mating`` and
``RankAndCrowding``, pymoo 0.6) step for step - binary tournament on dominance then
crowding, crossover with probability 0.9, mutation, repair, duplicate elimination against
the population and the offspring so far (up to 100 mating attempts), survival by
non-dominated rank then crowding distance - but over one ``(P, J, N)`` array instead of
pymoo ``Population`` objects, whose per-individual bookkeeping cost more than the search
itself (1.04 s -> 0.54 s per round at 64 GPUs, with twice the matings). Ranking and
crowding are pymoo's own functions. Duplicates are found by the states' bytes, as the
artifact's ``eliminate_duplicates=True`` compares X (pymoo 0.6's
``HashDuplicateElimination`` hashes the individual objects, so it never finds any).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pymoo.operators.survival.rank_and_crowding.metrics import calc_crowding_distance
from pymoo.util.nds.non_dominated_sorting import NonDominatedSorting
from pymoo.util.randomized_argsort import randomized_argsort

from pollux_launch.policy.base import JobInfo, Policy, PolicyNode
from pollux_launch.policy.objective import Objective, check_delta, check_p, fair_share, fitness
from pollux_launch.policy.placement import pinned_jobs, validate_round

#: pymoo's defaults for ``Crossover.prob`` and ``InfillCriterion.n_max_iterations``.
CROSSOVER_PROB = 0.9
MAX_MATING_ATTEMPTS = 100


@dataclass(frozen=True)
class _Round:
    """One round's search problem; allocations are ``(P, J, N)``, jobs in priority order."""

    obj: Objective
    base: np.ndarray  # (J, N) current allocation
    pinned: np.ndarray  # (J,) non-preemptible jobs that keep ``base``
    min_rep: np.ndarray
    max_rep: np.ndarray
    fair: np.ndarray  # (J,) fair-share GPUs, weights of the utility objective
    ia: bool  # interference avoidance

    def evaluate(self, states: np.ndarray) -> np.ndarray:
        """Objectives to minimise, ``(P, 2)``: -FITNESS_p (Eqn 14) and -cluster utility."""
        speedups = self.obj.speedups(states)
        fit = fitness(speedups, self.obj.p, self.obj.eps)
        # Cluster utility: fair-share GPU-equivalents of progress per allocated GPU.
        used = np.maximum(states.sum(axis=(1, 2)), 1)
        util = (speedups * self.fair).sum(axis=1) / used
        return np.column_stack([-fit, -util])

    def crossover(self, a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Single-point crossover over jobs: offspring take a prefix of rows from one
        parent; a mating skips crossover (children = parents) with probability 0.1."""
        M, J, _ = a.shape
        cross = rng.random(M) < CROSSOVER_PROB
        points = np.where(cross, rng.integers(J, size=M), 0)[:, None, None]
        mask = np.arange(J)[None, :, None] < points
        return np.concatenate([np.where(mask, b, a), np.where(mask, a, b)])

    def mutate(self, states: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        P, J, _ = states.shape
        # (1) reset some jobs to their current allocation
        reset = rng.random((P, J)) < 0.1
        states = np.where(reset[..., None], self.base, states)
        # (2) zero out random elements (p=0.1) of some jobs (p=0.1); draws for those only
        rows = np.nonzero(rng.random((P, J)) < 0.1)
        picked = states[rows]
        picked[rng.random(picked.shape, dtype=np.float32) < 0.1] = 0
        states[rows] = picked
        # (3) grow random elements: about one free node and one used node per job
        slots = self.obj.slots
        open_ = slots - states.sum(axis=1) > 0  # (P, N): nodes with a free slot
        prob1 = open_ / np.maximum(open_.sum(axis=1, keepdims=True), 1)  # (P, N)
        mask2 = (states > 0) & open_[:, None, :]
        prob2 = mask2 / np.maximum(mask2.sum(axis=2, keepdims=True), 1)
        # P(grow) = prob1 + prob2 - prob1 * prob2, with prob1 broadcast over jobs
        grow = prob1[:, None, :] * (1.0 - prob2) + prob2
        m = np.nonzero(rng.random(states.shape, dtype=np.float32) < grow)
        # uniform in [current, max(slots, current)] for the chosen elements only
        low = states[m]
        high = np.maximum(slots[m[2]], low) + 1
        states[m] = low + np.floor(rng.random(low.size) * (high - low)).astype(np.int64)
        return states

    def repair(self, states: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        states = states.copy()
        states[:, self.pinned] = self.base[self.pinned]
        if self.ia:
            # at most one distributed job per node: earlier (higher-priority) jobs win
            distributed = np.count_nonzero(states, axis=2) > 1
            mask = (states > 0) & distributed[..., None]
            states[np.cumsum(mask, axis=1) > 1] = 0
        # no more than max replicas per job, trimmed from randomly ordered nodes (only the
        # rows over their limit need the shuffle)
        over = states.sum(axis=2) > self.max_rep
        if over.any():
            rows = states[over]
            cap = np.broadcast_to(self.max_rep, over.shape)[over][:, None]
            shuffle = np.argsort(rng.random(rows.shape), axis=1)
            s = np.take_along_axis(rows, shuffle, axis=1)
            s = np.diff(np.minimum(np.cumsum(s, axis=1), cap), axis=1, prepend=0)
            states[over] = np.take_along_axis(s, np.argsort(shuffle, axis=1), axis=1)
        # node capacities: earlier jobs keep their replicas
        cap = np.minimum(np.cumsum(states, axis=1), self.obj.slots)
        states = np.diff(cap, axis=1, prepend=0)
        # min replicas: a job below its minimum gets nothing
        states[states.sum(axis=2) < self.min_rep] = 0
        return states


def _unique(states: np.ndarray, seen: set[bytes]) -> np.ndarray:
    """Indices of the first occurrence of each state not in ``seen`` (which is updated),
    as pymoo's ``HashDuplicateElimination`` against the population and offspring."""
    keep = []
    for i, row in enumerate(states.reshape(states.shape[0], -1)):
        key = row.tobytes()
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return np.asarray(keep, dtype=np.int64)


def _survive(F: np.ndarray, n: int, rng: np.random.Generator):
    """NSGA-II survival (pymoo's ``RankAndCrowding`` with crowding distance): whole
    non-dominated fronts in rank order, the last one cut by crowding distance with random
    tie-breaks. Returns the survivors' indices, their ranks and crowding distances."""
    survivors, ranks, crowd = [], [], []
    taken = 0
    for k, front in enumerate(NonDominatedSorting().do(F, n_stop_if_ranked=n)):
        cd = (
            calc_crowding_distance(F[front])
            if len(front) > F.shape[1]
            else np.full(len(front), np.inf)
        )
        idx = np.arange(len(front))
        if taken + len(front) > n:
            idx = randomized_argsort(cd, order="descending", random_state=rng)[: n - taken]
        survivors.append(front[idx])
        ranks.append(np.full(len(idx), k))
        crowd.append(cd[idx])
        taken += len(idx)
        if taken >= n:
            break
    return np.concatenate(survivors), np.concatenate(ranks), np.concatenate(crowd)


def _tournament(F: np.ndarray, cd: np.ndarray, n: int, rng: np.random.Generator):
    """NSGA-II's binary tournament (pymoo's ``comp_by_dom_and_crowding``): ``n`` winners.

    The winner of each pair dominates the other; failing that it has the larger crowding
    distance; ties are broken at random. Pairs come from random permutations of the
    population, as pymoo's ``TournamentSelection`` draws them.
    """
    P = F.shape[0]
    perms = np.concatenate([rng.permutation(P) for _ in range(-(-2 * n // P))])
    a, b = perms[: 2 * n].reshape(n, 2).T
    fa, fb = F[a], F[b]
    a_dom = np.all(fa <= fb, axis=1) & np.any(fa < fb, axis=1)
    b_dom = np.all(fb <= fa, axis=1) & np.any(fb < fa, axis=1)
    ca, cb = cd[a], cd[b]
    coin = rng.random(n) < 0.5
    pick_a = np.where(
        a_dom, True, np.where(b_dom, False, np.where(ca > cb, True, np.where(ca < cb, False, coin)))
    )
    return np.where(pick_a, a, b)


def nsga2(problem: _Round, sampling: np.ndarray, pop_size: int, n_gen: int, seed: int):
    """Run NSGA-II from ``sampling`` (``(S, J, N)``); returns the final population and
    its objectives. The first generation is the repaired, de-duplicated sampling."""
    rng = np.random.default_rng(seed)
    seen: set[bytes] = set()
    pop = problem.repair(sampling, rng)
    pop = pop[_unique(pop, seen)]
    F = problem.evaluate(pop)
    keep, _, cd = _survive(F, len(pop), rng)
    pop, F = pop[keep], F[keep]
    for _ in range(n_gen - 1):
        seen = {row.tobytes() for row in pop.reshape(len(pop), -1)}
        offspring: list[np.ndarray] = []
        want = pop_size
        for _ in range(MAX_MATING_ATTEMPTS):
            parents = _tournament(F, cd, 2 * -(-want // 2), rng).reshape(2, -1)
            children = problem.crossover(pop[parents[0]], pop[parents[1]], rng)
            children = problem.repair(problem.mutate(children, rng), rng)
            children = children[_unique(children, seen)][:want]
            offspring.append(children)
            want -= len(children)
            if want <= 0:
                break
        off = np.concatenate(offspring)
        if len(off) == 0:
            break
        pop = np.concatenate([pop, off])
        F = np.concatenate([F, problem.evaluate(off)])
        keep, _, cd = _survive(F, pop_size, rng)
        pop, F = pop[keep], F[keep]
    return pop, F


class GAPolicy(Policy):
    """The paper's genetic algorithm (see module docstring). Keeps the last population."""

    name = "pollux-ga"

    def __init__(
        self,
        p: float = -1.0,
        delta: float = 30.0,
        interference_avoidance: bool = True,
        seed: int = 0,
        pop_size: int = 100,
        n_gen: int = 100,
    ) -> None:
        self.p = check_p(p)
        check_delta(delta)
        if pop_size < 2 or n_gen < 1:
            raise ValueError("pollux-ga needs pop_size >= 2 and n_gen >= 1")
        self.delta = float(delta)
        self.interference_avoidance = bool(interference_avoidance)
        self.seed = int(seed)
        self.pop_size = int(pop_size)
        self.n_gen = int(n_gen)
        self._rounds = 0
        self._prev: tuple[np.ndarray, list[str], list[str]] | None = None

    def _warm_start(self, base, job_names, node_names) -> np.ndarray:
        """Previous population mapped onto this round's jobs and nodes, plus ``base``."""
        if self._prev is None:
            return base[None]
        prev, prev_jobs, prev_nodes = self._prev
        states = np.zeros((prev.shape[0], *base.shape), dtype=np.int64)
        jidx = {n: i for i, n in enumerate(prev_jobs)}
        nidx = {n: i for i, n in enumerate(prev_nodes)}
        dst_j = [i for i, n in enumerate(job_names) if n in jidx]
        src_j = [jidx[job_names[i]] for i in dst_j]
        dst_n = [i for i, n in enumerate(node_names) if n in nidx]
        src_n = [nidx[node_names[i]] for i in dst_n]
        if dst_j and dst_n:
            states[np.ix_(np.arange(prev.shape[0]), dst_j, dst_n)] = prev[
                np.ix_(np.arange(prev.shape[0]), src_j, src_n)
            ]
        return np.concatenate([base[None], states])

    def optimize(
        self, jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current: np.ndarray
    ) -> np.ndarray:
        cur = validate_round(jobs, nodes, current)
        J, N = cur.shape
        if J == 0 or N == 0:
            return np.zeros((J, N), dtype=np.int64)
        pinned = pinned_jobs(jobs, cur)
        # Priority order for repair: pinned jobs first, then (as the artifact orders by
        # attained service) the youngest jobs, so that new arrivals are not crowded out.
        order = sorted(
            range(J), key=lambda j: (not pinned[j], jobs[j].min_replicas, jobs[j].age, j)
        )
        ojobs = [jobs[j] for j in order]
        base = cur[order]
        obj = Objective(ojobs, nodes, base, self.p, self.delta)
        problem = _Round(
            obj,
            base,
            pinned[order],
            np.array([j.min_replicas for j in ojobs]),
            np.array([j.max_replicas for j in ojobs]),
            fair_share(ojobs, nodes).astype(float),
            self.interference_avoidance,
        )
        job_names = [j.name for j in ojobs]
        node_names = [n.name for n in nodes]
        sampling = self._warm_start(base, job_names, node_names)
        pop, F = nsga2(problem, sampling, self.pop_size, self.n_gen, self.seed + self._rounds)
        self._rounds += 1
        self._prev = (pop.copy(), job_names, node_names)
        best = pop[int(np.argmin(F[:, 0]))]
        out = np.zeros_like(cur)
        out[order] = best
        return out
