"""``pollux-ga``: the Pollux paper's population-based search, on pymoo.

Follows the Pollux artifact's policy (petuum/adaptdl, ``simulator/pollux.py``): NSGA-II
over allocation matrices with two objectives, FITNESS_p (Eqn 14) and cluster utility;
mutation resets a job's row to the current allocation, zeroes random elements and grows
random elements into free slots; crossover exchanges the rows of a random prefix of jobs;
repair enforces non-preemptible jobs, interference avoidance, max replicas, node
capacities and min replicas, in that order. The population is warm-started from the
previous round's (rows matched by job name, columns by node name), plus the current
allocation. The answer is the fittest individual of the final population.

Speed without changing the search: the objective memoises speedups per (job, nodes,
replicas) for the round, and mutation, repair and NSGA-II's binary tournament are
vectorised over the population (pymoo's tournament loops in Python).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pymoo.algorithms.moo.nsga2 import NSGA2
from pymoo.core.crossover import Crossover
from pymoo.core.duplicate import HashDuplicateElimination
from pymoo.core.mutation import Mutation
from pymoo.core.problem import Problem
from pymoo.core.repair import Repair
from pymoo.operators.selection.tournament import TournamentSelection
from pymoo.optimize import minimize

from pollux_launch.policy.base import JobInfo, Policy, PolicyNode
from pollux_launch.policy.objective import Objective, check_p, fair_share, fitness
from pollux_launch.policy.placement import pinned_jobs, validate_round


class _AllocationProblem(Problem):
    """States are flattened ``(J, N)`` matrices, jobs in the search's priority order."""

    def __init__(self, obj: Objective, base, pinned, min_rep, max_rep, fair, ia: bool):
        J, N = base.shape
        super().__init__(n_var=J * N, n_obj=2, xl=0, xu=np.tile(obj.slots, J), vtype=int)
        self.obj, self.base, self.pinned = obj, base, pinned
        self.min_rep, self.max_rep, self.fair, self.ia = min_rep, max_rep, fair, ia
        self.shape = (J, N)

    def states(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(X, dtype=np.int64).reshape(X.shape[0], *self.shape)

    def _evaluate(self, X, out, *args, **kwargs):
        states = self.states(X)
        speedups = self.obj.speedups(states)
        fit = fitness(speedups, self.obj.p, self.obj.eps)
        # Cluster utility: fair-share GPU-equivalents of progress per allocated GPU.
        used = np.maximum(states.sum(axis=(1, 2)), 1)
        util = (speedups * self.fair).sum(axis=1) / used
        out["F"] = np.column_stack([-fit, -util])


class _Crossover(Crossover):
    """Single-point crossover over jobs: offspring take a prefix of rows from one parent."""

    def __init__(self) -> None:
        super().__init__(n_parents=2, n_offsprings=2)

    def _do(self, problem, X, *args, random_state=None, **kwargs):
        _, n_matings, n_var = X.shape
        J, N = problem.shape
        S = X.reshape(2, n_matings, J, N)
        points = random_state.integers(J, size=(n_matings, 1))
        mask = (np.arange(J) < points)[..., None]
        out = np.stack([np.where(mask, S[1], S[0]), np.where(mask, S[0], S[1])])
        return out.reshape(2, n_matings, n_var)


class _Mutation(Mutation):
    def _do(self, problem, X, *args, random_state=None, **kwargs):
        rng = random_state
        states = problem.states(X)
        P, J, _ = states.shape
        # (1) reset some jobs to their current allocation
        reset = rng.random((P, J)) < 0.1
        states = np.where(reset[..., None], problem.base, states)
        # (2) zero out random elements of some jobs
        prob = np.where(rng.random((P, J)) < 0.1, 0.1, 0.0)
        states[rng.random(states.shape) < prob[..., None]] = 0
        # (3) grow random elements: about one free node and one used node per job
        slots = problem.obj.slots
        open_ = slots - states.sum(axis=1) > 0  # (P, N): nodes with a free slot
        prob1 = open_ / np.maximum(open_.sum(axis=1, keepdims=True), 1)  # (P, N)
        mask2 = (states > 0) & open_[:, None, :]
        prob2 = mask2 / np.maximum(mask2.sum(axis=2, keepdims=True), 1)
        # P(grow) = prob1 + prob2 - prob1 * prob2, with prob1 broadcast over jobs
        m = np.nonzero(rng.random(states.shape) < prob1[:, None, :] * (1.0 - prob2) + prob2)
        # uniform in [current, max(slots, current)] for the chosen elements only (one
        # vectorised draw: Generator.integers with array bounds loops per element)
        low = states[m]
        high = np.maximum(slots[m[2]], low) + 1
        states[m] = low + np.floor(rng.random(low.size) * (high - low)).astype(np.int64)
        return states.reshape(P, -1)


class _Repair(Repair):
    def _do(self, problem, X, random_state=None, **kwargs):
        rng = random_state if random_state is not None else np.random.default_rng(0)
        states = problem.states(X).copy()
        P = states.shape[0]
        states[:, problem.pinned] = problem.base[problem.pinned]
        if problem.ia:
            # at most one distributed job per node: earlier (higher-priority) jobs win
            distributed = np.count_nonzero(states, axis=2) > 1
            mask = (states > 0) & distributed[..., None]
            states[np.cumsum(mask, axis=1) > 1] = 0
        # no more than max replicas per job, trimmed from randomly ordered nodes (only the
        # rows over their limit need the shuffle)
        over = states.sum(axis=2) > problem.max_rep
        if over.any():
            rows = states[over]
            cap = np.broadcast_to(problem.max_rep, over.shape)[over][:, None]
            shuffle = np.argsort(rng.random(rows.shape), axis=1)
            s = np.take_along_axis(rows, shuffle, axis=1)
            s = np.diff(np.minimum(np.cumsum(s, axis=1), cap), axis=1, prepend=0)
            states[over] = np.take_along_axis(s, np.argsort(shuffle, axis=1), axis=1)
        # node capacities: earlier jobs keep their replicas
        cap = np.minimum(np.cumsum(states, axis=1), problem.obj.slots)
        states = np.diff(cap, axis=1, prepend=0)
        # min replicas: a job below its minimum gets nothing
        states[states.sum(axis=2) < problem.min_rep] = 0
        return states.reshape(P, -1)


def _binary_tournament(pop, P, random_state=None, **kwargs):
    """NSGA-II's binary tournament (pymoo's ``comp_by_dom_and_crowding``), vectorised.

    The winner of each pair dominates the other; failing that it has the larger crowding
    distance; ties are broken at random. (The problem has no constraints, so every
    individual is feasible.) pymoo's own version loops over the pairs in Python.
    """
    rng = random_state if random_state is not None else np.random.default_rng(0)
    F = pop.get("F")
    cd = pop.get("crowding").astype(float)
    a, b = P[:, 0], P[:, 1]
    fa, fb = F[a], F[b]
    a_dom = np.all(fa <= fb, axis=1) & np.any(fa < fb, axis=1)
    b_dom = np.all(fb <= fa, axis=1) & np.any(fb < fa, axis=1)
    ca, cb = cd[a], cd[b]
    coin = rng.random(len(a)) < 0.5
    pick_a = np.where(a_dom, True, np.where(b_dom, False,
                      np.where(ca > cb, True, np.where(ca < cb, False, coin))))
    return np.where(pick_a, a, b)[:, None].astype(int)


class _NSGA2(NSGA2):
    """NSGA-II whose per-generation optimum skips pymoo's feasibility scan: the problem
    has no constraints, so the optimum is always the first non-dominated front."""

    def _set_optimum(self, **kwargs):
        self.opt = self.pop[self.pop.get("rank") == 0]


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
        if delta < 0:
            raise ValueError(f"re-allocation delay delta={delta} must be >= 0 seconds")
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
        problem = _AllocationProblem(
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
        algorithm = _NSGA2(
            pop_size=self.pop_size,
            sampling=sampling.reshape(sampling.shape[0], -1),
            crossover=_Crossover(),
            mutation=_Mutation(),
            repair=_Repair(),
            selection=TournamentSelection(func_comp=_binary_tournament),
            eliminate_duplicates=HashDuplicateElimination(),
        )
        result = minimize(
            problem,
            algorithm,
            ("n_gen", self.n_gen),
            seed=self.seed + self._rounds,
            verbose=False,
        )
        self._rounds += 1
        pop = problem.states(result.pop.get("X"))
        F = result.pop.get("F")
        self._prev = (pop.copy(), job_names, node_names)
        best = pop[int(np.argmin(F[:, 0]))]
        out = np.zeros_like(cur)
        out[order] = best
        return out
