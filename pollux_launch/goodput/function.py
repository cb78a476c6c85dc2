"""Goodput of a job and its best batch configuration for an allocation (Pollux Sec. 3-4).

    GOODPUT(N, K, m, s) = THROUGHPUT(N, K, m, s) x EFFICIENCY(K * m * (s + 1))   (Sec. 3)

:meth:`GoodputFunction.optimize` picks, for each allocation (N nodes, K replicas), the
total batch size ``M`` in ``[M0, max_batch_size]`` that maximises goodput, realised with
a per-GPU batch ``m`` within its (memory) bounds and the *fewest* accumulation steps
``s`` that fit (Eqn 13). It is vectorised over allocations: a 2-D grid of candidate
batch sizes (allocations x candidates) is evaluated at once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .efficiency import GradParams, efficiency
from .throughput import PerfParams, predict_step_time

__all__ = ["GoodputFunction", "GridCache"]

_EPS = 1e-8  # tolerance of ceil() on batch-size ratios
_CANDIDATES = 48  # total batch sizes tried per allocation (geometric grid)
_MAX_GRIDS = 4096  # grids one cache keeps (a job sees a few dozen allocations at most)

#: Memo of single-allocation candidate grids: (replicas, job limits) -> (m, s, M, valid).
GridCache = dict[tuple[Any, ...], tuple[np.ndarray, ...]]


class GoodputFunction:
    """Goodput model of one job: fitted throughput parameters, gradient statistics, M0.

    ``grid_cache`` memoises the candidate grid of each single allocation. A grid depends on
    the replicas and the job's limits only, never on the model, so an owner that builds a
    new function at every refit (the agent, the simulator's jobs) passes the same dict
    each time; by default each function keeps its own (memoised per fit).

    ``single_replica_accumulation``: on one replica, a total batch above M0 uses at least
    two micro-batches (s >= 1). The Pollux agent needs them to estimate the gradient noise
    on one GPU, and the authors' simulator models it; pollux-launch's agent differences
    consecutive steps instead (:mod:`pollux_launch.tuning.grad_monitor`), so it is off
    by default and on where the Pollux agent is simulated.
    """

    def __init__(self, perf_params: PerfParams, grad_params: GradParams, init_batch_size: int,
                 grid_cache: GridCache | None = None, single_replica_accumulation: bool = False):
        if not isinstance(perf_params, PerfParams):
            perf_params = PerfParams(*perf_params)
        if not isinstance(grad_params, GradParams):
            grad_params = GradParams(*grad_params)
        if not init_batch_size > 0:
            raise ValueError(f"init_batch_size (M0) must be > 0, got {init_batch_size}")
        self.perf_params = perf_params
        self.grad_params = grad_params
        self.init_batch_size = init_batch_size
        p, g = perf_params, grad_params
        # Scalars pulled out once: optimize() is on the scheduler's hot path.
        self._p = (p.alpha_grad, p.beta_grad, p.grad_exponent, p.alpha_local, p.beta_local,
                   p.alpha_node, p.beta_node, p.node_contention, p.gamma)
        self._no_stats = g.sqr == 0 and g.var == 0
        self._grids: GridCache = {} if grid_cache is None else grid_cache
        self.single_replica_accumulation = bool(single_replica_accumulation)

    def throughput(self, num_nodes: Any, num_replicas: Any, local_bsz: Any,
                   accum_steps: Any) -> np.ndarray:
        """Samples per second: M / T_iter with M = K * m * (s + 1) (Eqn 11)."""
        k, m, s = (np.asarray(a, dtype=float) for a in (num_replicas, local_bsz, accum_steps))
        step = predict_step_time(self.perf_params, num_nodes, k, m, s)
        return k * m * (s + 1) / step

    def efficiency(self, batch_size: Any) -> np.ndarray:
        """Statistical efficiency of total batch size ``M`` (Eqn 6)."""
        return efficiency(self.grad_params, self.init_batch_size, batch_size)

    def evaluate(self, num_nodes: Any, num_replicas: Any, local_bsz: Any,
                 accum_steps: Any) -> np.ndarray:
        """GOODPUT = THROUGHPUT x EFFICIENCY, in M0-samples of progress per second."""
        k, m, s = (np.asarray(a, dtype=float) for a in (num_replicas, local_bsz, accum_steps))
        return self.throughput(num_nodes, k, m, s) * self.efficiency(k * m * (s + 1))

    __call__ = evaluate

    def _efficiency(self, batch: np.ndarray) -> np.ndarray:
        """EFFICIENCY(M) without efficiency()'s checks (inputs come from a valid grid)."""
        if self._no_stats:
            return self.init_batch_size / batch
        sqr, var = self.grad_params.sqr, self.grad_params.var
        return (var + sqr) / (var + sqr * (batch / self.init_batch_size))  # = gain / scale

    def _sync_time(self, n: np.ndarray, k: np.ndarray) -> np.ndarray:
        """T_sync per allocation (Eqn 10), without predict_sync_time's broadcasting."""
        _, _, _, al, bl, an, bn, c, _ = self._p
        km2 = k - 2
        node = an + bn * km2
        if c:
            node = node + c * (1 - n / np.maximum(k, 1)) / np.maximum(n - 1, 1) ** 2
        return np.where(k > 1, np.where(n > 1, node, al + bl * km2), 0.0)

    def optimize(
        self,
        num_nodes: Any,
        num_replicas: Any,
        max_batch_size: int,
        local_bsz_bounds: tuple[int, int],
        accumulation: bool = True,
        fixed_batch_size: int | None = None,
        min_batch_size: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Best (goodput, local_bsz m, accum_steps s) for each allocation (Eqn 13).

        ``num_nodes`` / ``num_replicas`` broadcast together (any shape); the results have
        that shape. Candidate total batches M lie geometrically in
        ``[max(M0, K * m_min), max_batch_size]``; each uses the fewest accumulation steps
        whose per-GPU batch fits ``m <= m_max`` (``s = 0`` without ``accumulation``).
        ``fixed_batch_size`` pins M (efficiency 1); ``min_batch_size`` (the job's batch-size
        range's lower end) leaves out totals below it. Where no configuration fits - or the
        allocation has no replicas - goodput, m and s are 0.
        """
        m_lo, m_hi = _check_bounds(local_bsz_bounds)
        m0 = self.init_batch_size
        if fixed_batch_size is not None:
            if not fixed_batch_size > 0:
                raise ValueError(f"fixed_batch_size must be > 0, got {fixed_batch_size}")
        elif not max_batch_size >= m0:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) must be >= init_batch_size ({m0})"
            )
        n = np.asarray(num_nodes, dtype=float)
        k = np.asarray(num_replicas, dtype=float)
        if n.shape != k.shape:
            n, k = _broadcast(n, k)
        shape = k.shape
        key = (float(m0), float(max_batch_size), m_lo, m_hi, bool(accumulation),
               None if fixed_batch_size is None else float(fixed_batch_size),
               self.single_replica_accumulation)
        if k.size == 1:  # the agent's and the benchmark's case: memoised grid
            nv, kv = float(n.flat[0]), float(k.flat[0])
            if kv < 0 or (kv > 0 and not 1 <= nv <= kv):
                raise ValueError(_ALLOC_ERROR)
            n = n.reshape(1, 1)
            k = k.reshape(1, 1)
            local, accum, total, valid = self._grid_of(kv, key)
        else:
            n = n.reshape(-1, 1)
            k = k.reshape(-1, 1)
            if np.any((k < 0) | ((k > 0) & ((n < 1) | (n > k)))):
                raise ValueError(_ALLOC_ERROR)
            local, accum, total, valid = _grid(k, *key)
        ag, bg, p, *_, g = self._p
        grad = ag + bg * (local if p == 1.0 else local**p)
        sync = self._sync_time(n, k)
        if g == 1.0:
            step = (accum + 1) * grad + sync
        else:
            step = accum * grad + (grad**g + sync**g) ** (1 / g)
        good = total / step
        if fixed_batch_size is None:
            good *= self._efficiency(total)
        good[~valid] = 0.0
        if min_batch_size is not None and fixed_batch_size is None:
            good[total < min_batch_size] = 0.0
        best = np.argmax(good, axis=1)
        rows = np.arange(len(best))
        goodput = good[rows, best]
        ok = goodput > 0
        local_bsz = np.where(ok, local[rows, best], 0).astype(np.int64)
        accum_steps = np.where(ok, accum[rows, best], 0).astype(np.int64)
        return goodput.reshape(shape), local_bsz.reshape(shape), accum_steps.reshape(shape)

    def _grid_of(self, k: float, key: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
        """:func:`_grid` of one allocation, through this function's grid cache."""
        arrays = self._grids.get((k, *key))
        if arrays is None:
            arrays = _grid(np.array([[k]]), *key)
            for a in arrays:
                a.setflags(write=False)  # shared between calls (and fits): never modified
            if len(self._grids) < _MAX_GRIDS:
                self._grids[(k, *key)] = arrays
        return arrays


_ALLOC_ERROR = "each allocation needs 1 <= num_nodes <= num_replicas (or num_replicas == 0)"
_T = np.linspace(0.0, 1.0, _CANDIDATES)


def _grid(k: np.ndarray, m0: float, max_batch: float, m_lo: float, m_hi: float,
          accumulation: bool, fixed: float | None, single_accum: bool = False):
    """Candidate (m, s, M, valid) per allocation, shape (len(k), candidates) (Eqn 13).

    Depends only on the replicas and the job's limits, never on the fitted model.
    Invalid candidates carry m = 1 so that evaluating them stays finite.
    """
    k_safe = np.maximum(k, 1.0)
    if fixed is not None:
        batch = np.full_like(k_safe, fixed)
    else:
        lo = np.maximum(m0, k_safe * m_lo)
        # Geometric grid from lo to max (lo > max leaves only infeasible candidates).
        batch = lo * np.exp(_T * np.log(max_batch / lo))
    per_gpu = batch / k_safe
    forced = np.zeros(per_gpu.shape, dtype=bool)
    if accumulation:
        accum = np.maximum(np.ceil(per_gpu / m_hi - _EPS) - 1, 0.0)
        if single_accum:  # >= 2 micro-batches on one replica above M0 (see the class doc)
            forced = (k_safe == 1) & (per_gpu > m0 + _EPS) & (accum < 1)
            accum = np.where(forced, 1.0, accum)
    else:
        accum = np.zeros_like(per_gpu)
    local = np.ceil(per_gpu / (accum + 1) - _EPS)
    if fixed is None:
        # Rounding up may overshoot the largest batch: round down there instead.
        local = np.where(k_safe * local * (accum + 1) > max_batch * (1 + _EPS), local - 1, local)
    total = k_safe * local * (accum + 1)
    valid = (local >= m_lo) & (local <= m_hi) & (k > 0)
    if fixed is None:
        valid &= total >= m0 * (1 - _EPS)
    # Fewest steps: the same M must not fit with one accumulation step less.
    valid &= (local * (accum + 1) > m_hi * accum) | forced
    local = np.where(valid, local, 1.0)
    total = k_safe * local * (accum + 1)
    return local, accum, total, valid


def _broadcast(num_nodes: np.ndarray, num_replicas: np.ndarray) -> list[np.ndarray]:
    try:
        return np.broadcast_arrays(num_nodes, num_replicas)
    except ValueError:
        raise ValueError(
            f"num_nodes (shape {num_nodes.shape}) and num_replicas (shape "
            f"{num_replicas.shape}) must have the same or broadcastable shapes"
        ) from None


def _check_bounds(local_bsz_bounds: tuple[int, int]) -> tuple[float, float]:
    try:
        lo, hi = local_bsz_bounds
    except (TypeError, ValueError):
        raise ValueError(
            f"local_bsz_bounds must be (min, max) per-GPU batch sizes, got {local_bsz_bounds!r}"
        ) from None
    if lo is None:
        lo = 1
    if hi is None:
        raise ValueError("local_bsz_bounds needs a max per-GPU batch size (memory limit)")
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        raise ValueError(
            f"local_bsz_bounds must satisfy 0 < min <= max, got ({lo}, {hi})"
        )
    return float(lo), float(hi)
