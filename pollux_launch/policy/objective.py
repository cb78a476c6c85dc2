"""The PolluxSched objective: fair-share speedups, re-allocation penalty, FITNESS_p.

All functions are pure and vectorised over a leading population axis: an allocation
``alloc`` has shape ``(..., J, N)`` (replicas of job ``j`` on node ``n``).

* Eqn 15: SPEEDUP_j(A_j) = GOODPUT_j(A_j) / GOODPUT_j(fair share); :func:`fair_share`
  gives the fair-share allocation and :class:`Objective` the normalisers.
* Re-allocation penalty (Sec. 4.2): a job whose allocation changes has its speedup scaled
  by (T_j - R_j * delta) / (T_j + delta); see :func:`reallocation_penalty`.
* Eqn 14: FITNESS_p(A) = (1/J * sum_j SPEEDUP_j(A_j)^p)^(1/p); see :func:`fitness`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollux_launch.policy.base import JobInfo, PolicyNode

#: Added to every speedup inside the power mean (as the Pollux artifact does) so that a
#: job with no GPUs contributes a large finite term for p < 0 instead of an infinity:
#: the search then still prefers allocations that start more jobs.
SPEEDUP_EPS = 1e-3

#: Largest memo of raw speedups an Objective keeps (jobs x (nodes+1) x (slots+1) floats).
_MEMO_BUDGET = 2_000_000


def check_delta(delta: float) -> float:
    """Validate the re-allocation delay (the penalty's delta, seconds)."""
    if not delta >= 0:
        raise ValueError(f"re-allocation delay delta={delta} must be >= 0 seconds")
    return float(delta)


def check_p(p: float) -> float:
    """Validate the fairness knob of Eqn 14."""
    p = float(p)
    if p == 0 or not np.isfinite(p):
        raise ValueError(
            f"fairness exponent p={p} is not allowed: use a finite non-zero value "
            "(p=-1 is the Pollux default; p=1 maximises the plain sum of speedups)"
        )
    return p


def fitness(speedups: np.ndarray, p: float = -1.0, eps: float = SPEEDUP_EPS) -> np.ndarray:
    """FITNESS_p (Eqn 14): the power mean with exponent ``p`` over the last axis.

    ``speedups`` has shape ``(..., J)``; the result has shape ``(...)``. Computed in log
    space so that very negative ``p`` (towards max-min fairness) does not overflow.
    With no jobs the fitness is 1.
    """
    p = check_p(p)
    s = np.asarray(speedups, dtype=float)
    if s.shape[-1] == 0:
        return np.ones(s.shape[:-1])
    z = p * np.log(np.maximum(s, 0.0) + eps)
    zmax = np.max(z, axis=-1, keepdims=True)
    log_mean = np.log(np.mean(np.exp(z - zmax), axis=-1)) + zmax[..., 0]
    return np.exp(log_mean / p)


def reallocation_penalty(
    age: np.ndarray | float, restarts: np.ndarray | int, delta: np.ndarray | float = 30.0
) -> np.ndarray:
    """Speedup factor for a job whose allocation changes: (T - R*delta) / (T + delta).

    Clipped at 0, and continuous in T: a job that arrived this very moment (T = 0) gets
    0, as in the Pollux artifact, so a round held at a job's arrival does not favour it
    over one that waited a little. With ``delta == 0`` a change is free (factor 1).
    ``delta`` may differ per job (:func:`job_delays`).
    """
    age = np.maximum(np.asarray(age, dtype=float), 0.0)
    restarts = np.asarray(restarts, dtype=float)
    delta = np.asarray(delta, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.maximum(age - restarts * delta, 0.0) / (age + delta)
    return np.where(delta <= 0, 1.0, factor)


def job_delays(jobs: Sequence[JobInfo], delta: float) -> np.ndarray:
    """Each job's cost of a re-allocation in seconds: its own (``JobInfo.realloc_delay``,
    e.g. a restart-elastic job's measured restart time) or the policy's ``delta``."""
    return np.array([delta if j.realloc_delay is None else j.realloc_delay for j in jobs],
                    dtype=float)


def packed_nodes(num_replicas: np.ndarray | int, slots: Sequence[int]) -> np.ndarray:
    """Fewest nodes that can host ``num_replicas`` replicas (biggest nodes first).

    0 replicas -> 0 nodes; more replicas than the cluster holds -> every node.
    """
    k = np.asarray(num_replicas, dtype=np.int64)
    cum = np.cumsum(np.sort(np.asarray(slots, dtype=np.int64))[::-1])
    if cum.size == 0:
        return np.zeros_like(k)
    n = np.searchsorted(cum, k, side="left") + 1
    return np.where(k <= 0, 0, np.minimum(n, cum.size)).astype(np.int64)


def fair_share(jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode]) -> np.ndarray:
    """Each job's fair-share GPU count (Eqn 15): the cluster divided evenly, rounded up
    (as the Pollux artifact does), at least 1 and at least ``min_replicas``."""
    total = sum(int(n.slots) for n in nodes)
    if not jobs:
        return np.zeros(0, dtype=np.int64)
    share = max(1, -(-total // len(jobs)))
    return np.array([max(share, j.min_replicas, 1) for j in jobs], dtype=np.int64)


def call_speedup(job: JobInfo, num_nodes: np.ndarray, num_replicas: np.ndarray) -> np.ndarray:
    """Call ``job.speedup_fn`` and sanitise the result (0 at 0 replicas, finite, >= 0)."""
    num_nodes = np.asarray(num_nodes, dtype=np.int64)
    num_replicas = np.asarray(num_replicas, dtype=np.int64)
    out = np.asarray(job.speedup_fn(num_nodes, num_replicas), dtype=float)
    out = np.broadcast_to(out, num_replicas.shape)
    return np.where((num_replicas > 0) & np.isfinite(out), np.maximum(out, 0.0), 0.0)


def speedup_normalisers(jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode]) -> np.ndarray:
    """Raw speedup of each job at its fair share (the denominator of Eqn 15).

    Taken as the best raw speedup with at most the fair-share GPU count, packed onto as
    few nodes as possible: a job may use fewer GPUs than its share, and this keeps the
    normaliser positive where a speedup model is not monotone. Falls back to 1.
    """
    slots = [int(n.slots) for n in nodes]
    share = fair_share(jobs, nodes)
    out = np.ones(len(jobs))
    for j, job in enumerate(jobs):
        k = np.arange(1, share[j] + 1)
        best = float(np.max(call_speedup(job, packed_nodes(k, slots), k), initial=0.0))
        if best > 0:
            out[j] = best
    return out


class Objective:
    """FITNESS_p of allocation matrices for one scheduling round.

    Built once per round (normalisers and penalties are computed here), then called on
    any number of candidate allocations of shape ``(..., J, N)``.
    """

    def __init__(
        self,
        jobs: Sequence[JobInfo],
        nodes: Sequence[PolicyNode],
        current: np.ndarray,
        p: float = -1.0,
        delta: float = 30.0,
        eps: float = SPEEDUP_EPS,
        norm: np.ndarray | None = None,
    ) -> None:
        self.jobs = list(jobs)
        self.slots = np.array([int(n.slots) for n in nodes], dtype=np.int64)
        self.current = np.asarray(current, dtype=np.int64).reshape(len(jobs), len(nodes))
        self.p = check_p(p)
        self.eps = eps
        # ``norm`` lets a caller that has already tabulated the speedups pass them in.
        self.norm = speedup_normalisers(jobs, nodes) if norm is None else np.asarray(norm)
        self.penalty = reallocation_penalty(
            np.array([j.age for j in jobs], dtype=float),
            np.array([j.restarts for j in jobs], dtype=float),
            job_delays(jobs, delta),
        )
        # Memo of raw speedups [job, nodes, replicas] (NaN: not asked yet). A search
        # evaluates the same few (N, K) per job over and over: after the first
        # generations every lookup is one gather instead of one speedup_fn call per job.
        n_nodes, total = len(self.slots), int(self.slots.sum())
        size = len(self.jobs) * (n_nodes + 1) * (total + 1)
        self._memo = np.full((len(self.jobs), n_nodes + 1, total + 1), np.nan) if (
            0 < size <= _MEMO_BUDGET) else None

    def raw_speedups(self, num_nodes: np.ndarray, num_replicas: np.ndarray) -> np.ndarray:
        """Sanitised raw speedup of every job (last axis) at ``(..., J)`` placements."""
        num_nodes = np.asarray(num_nodes, dtype=np.int64)
        num_replicas = np.asarray(num_replicas, dtype=np.int64)
        memo = self._memo
        J = len(self.jobs)
        if memo is None or np.any(num_replicas >= memo.shape[2]) or np.any(num_replicas < 0):
            out = np.zeros(num_replicas.shape)
            for j in range(J):
                out[..., j] = call_speedup(self.jobs[j], num_nodes[..., j], num_replicas[..., j])
            return out
        n = np.minimum(num_nodes, memo.shape[1] - 1)
        jj = np.broadcast_to(np.arange(J), num_replicas.shape)
        out = memo[jj, n, num_replicas]
        missing = np.isnan(out)
        if missing.any():
            mj, mn, mk = jj[missing], n[missing], num_replicas[missing]
            for j in np.unique(mj):
                sel = mj == j
                keys = np.unique(np.stack([mn[sel], mk[sel]]), axis=1)
                memo[j, keys[0], keys[1]] = call_speedup(self.jobs[j], keys[0], keys[1])
            out = memo[jj, n, num_replicas]
        return out

    def job_speedup(
        self, j: int, num_nodes: np.ndarray, num_replicas: np.ndarray, changed: np.ndarray
    ) -> np.ndarray:
        """Normalised, penalised speedup of job ``j`` at the given placements."""
        num_nodes = np.asarray(num_nodes, dtype=np.int64)
        num_replicas = np.asarray(num_replicas, dtype=np.int64)
        memo = self._memo
        if (memo is None or num_replicas.size == 0 or num_replicas.max() >= memo.shape[2]
                or num_replicas.min() < 0):
            raw = call_speedup(self.jobs[j], num_nodes, num_replicas)
        else:
            n = np.minimum(num_nodes, memo.shape[1] - 1)
            raw = memo[j, n, num_replicas]
            missing = np.isnan(raw)
            if missing.any():
                keys = np.unique(np.stack([n[missing], num_replicas[missing]]), axis=1)
                memo[j, keys[0], keys[1]] = call_speedup(self.jobs[j], keys[0], keys[1])
                raw = memo[j, n, num_replicas]
        s = raw / self.norm[j]
        return np.where(changed, s * self.penalty[j], s)

    def speedups(self, alloc: np.ndarray) -> np.ndarray:
        """Per-job speedups (Eqn 15 with the re-allocation penalty), shape ``(..., J)``."""
        alloc = np.asarray(alloc)
        num_nodes = np.count_nonzero(alloc, axis=-1)
        num_replicas = alloc.sum(axis=-1)
        changed = np.any(alloc != self.current, axis=-1)
        out = self.raw_speedups(num_nodes, num_replicas) / self.norm
        return np.where(changed, out * self.penalty, out)

    def __call__(self, alloc: np.ndarray) -> np.ndarray:
        """FITNESS_p (Eqn 14) of each allocation, shape ``(...)``."""
        return fitness(self.speedups(alloc), self.p, self.eps)


def job_speedups(
    jobs: Sequence[JobInfo],
    nodes: Sequence[PolicyNode],
    alloc: np.ndarray,
    current: np.ndarray,
    delta: float = 30.0,
) -> np.ndarray:
    """Per-job speedups of ``alloc`` (fair-share normalised, penalised), shape ``(..., J)``."""
    return Objective(jobs, nodes, current, -1.0, delta).speedups(alloc)


def evaluate_fitness(
    jobs: Sequence[JobInfo],
    nodes: Sequence[PolicyNode],
    alloc: np.ndarray,
    current: np.ndarray,
    p: float = -1.0,
    delta: float = 30.0,
) -> float | np.ndarray:
    """FITNESS_p of ``alloc`` in the round described by ``(jobs, nodes, current)``:
    the same number every engine maximises, so engines can be compared."""
    out = Objective(jobs, nodes, current, p, delta)(alloc)
    return float(out) if np.ndim(out) == 0 else out
