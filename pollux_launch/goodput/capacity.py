"""THROUGHPUT of a job at its best batch size: samples per second per allocation.

Pollux's throughput model (Eqn 7-11), with no statistical efficiency::

    THROUGHPUT(N, K) = max_{M, m, s}  M / T_iter(N, K, m, s),   M = K * m * (s + 1)

over total batches ``M`` in ``[min_batch_size, max_batch_size]`` (or ``M`` pinned at
``fixed_batch_size``), per-GPU batches ``m`` within their (memory) bounds and the fewest
accumulation steps ``s`` that fit. This is the per-job "processing rate" that
throughput-maximising schedulers such as Saxena et al.'s (``saxena-dp``) add up; Pollux
itself weighs each sample by EFFICIENCY(M) (Eqn 6) instead (:class:`GoodputFunction`).

The search is :meth:`GoodputFunction.optimize` (Eqn 13) with gradient statistics whose
efficiency is exactly 1 at every batch size (``sqr = 0``: all noise, Eqn 6), so goodput is
throughput and the candidate grid, the (m, s) rule and the model are shared, not copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .efficiency import GradParams
from .function import GoodputFunction, _broadcast, _check_bounds
from .throughput import PerfParams

__all__ = ["ThroughputFunction"]

#: EFFICIENCY(M) = (var + sqr) / (var + sqr * M / M0) = 1 for every M when sqr = 0.
_NO_EFFICIENCY = GradParams(sqr=0.0, var=1.0)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int (samples), got {value!r}")
    return int(value)


class ThroughputFunction:
    """Samples per second of one job at (num_nodes, num_replicas), at its best batch size
    within ``[min_batch_size, max_batch_size]`` (or at ``fixed_batch_size``): system
    throughput only (Pollux Eqn 7-11, no statistical efficiency).

    Callable as ``fn(num_nodes, num_replicas)`` on int arrays of equal (or broadcastable)
    shape: 0 at 0 replicas and where no batch configuration fits. The best rate, ``m`` and
    ``s`` of each distinct (nodes, replicas) are computed once (vectorised over the
    allocations asked for together) and kept in a dense table, as :class:`SpeedupFunction`
    keeps goodput.
    """

    def __init__(
        self,
        perf: PerfParams,
        *,
        min_batch_size: int,
        max_batch_size: int,
        local_bsz_bounds: tuple[int, int],
        accumulation: bool = True,
        fixed_batch_size: int | None = None,
    ) -> None:
        if not isinstance(perf, PerfParams):
            raise ValueError(f"perf must be a PerfParams (fitted throughput model), got {perf!r}")
        lo = _positive_int("min_batch_size", min_batch_size)
        hi = _positive_int("max_batch_size", max_batch_size)
        if hi < lo:
            raise ValueError(f"max_batch_size ({hi}) must be >= min_batch_size ({lo})")
        m_lo, m_hi = _check_bounds(local_bsz_bounds)
        if fixed_batch_size is not None:
            fixed_batch_size = _positive_int("fixed_batch_size", fixed_batch_size)
        self.perf_params = perf
        self.min_batch_size, self.max_batch_size = lo, hi
        self.local_bsz_bounds = (int(m_lo), int(m_hi))
        self.accumulation = bool(accumulation)
        self.fixed_batch_size = fixed_batch_size
        self._fn = GoodputFunction(perf, _NO_EFFICIENCY, lo)
        # [nodes, replicas] -> (rate, m, s); NaN rate: not computed yet.
        self._rate = np.full((2, 5), np.nan)
        self._m = np.zeros((2, 5), dtype=np.int64)
        self._s = np.zeros((2, 5), dtype=np.int64)
        self._rate[:, 0] = 0.0

    def __call__(self, num_nodes: Any, num_replicas: Any) -> np.ndarray:
        """Samples per second at each allocation (0 at 0 replicas)."""
        n, k = self._lookup(num_nodes, num_replicas)
        return self._rate[n, k]

    def best_batch(self, num_nodes: Any, num_replicas: Any) -> tuple[np.ndarray, np.ndarray]:
        """The per-GPU batch ``m`` and accumulation steps ``s`` that reach the rate of
        :meth:`__call__` at each allocation (both 0 where it is 0)."""
        n, k = self._lookup(num_nodes, num_replicas)
        return self._m[n, k], self._s[n, k]

    def _lookup(self, num_nodes: Any, num_replicas: Any) -> tuple[np.ndarray, np.ndarray]:
        """Validated int index arrays into the table, every entry filled."""
        n, k = _broadcast(np.asarray(num_nodes), np.asarray(num_replicas))
        for name, a in (("num_nodes", n), ("num_replicas", k)):
            if a.size and not (np.issubdtype(a.dtype, np.integer) or np.all(a == np.round(a))):
                raise ValueError(f"{name} must hold whole numbers, got {a!r}")
        n = n.astype(np.intp)
        k = k.astype(np.intp)
        if n.size == 0:
            return n, k
        if np.any(k < 0) or np.any((k > 0) & ((n < 1) | (n > k))):
            raise ValueError(
                "allocations need num_replicas >= 0 and 1 <= num_nodes <= num_replicas "
                "where num_replicas > 0"
            )
        n = np.where(k == 0, 0, n)  # every empty allocation is the same one
        if n.max() >= self._rate.shape[0] or k.max() >= self._rate.shape[1]:
            self._grow(int(n.max()) + 1, int(k.max()) + 1)
        missing = np.isnan(self._rate[n, k])
        if missing.any():
            cols = self._rate.shape[1]
            flat = np.unique(n[missing] * cols + k[missing])
            pn, pk = flat // cols, flat % cols
            self._rate[pn, pk] = 0.0
            self._m[pn, pk] = self._s[pn, pk] = 0
            for cap, sel in self._caps(pk):
                rate, m, s = self._fn.optimize(
                    pn[sel], pk[sel], cap, self.local_bsz_bounds,
                    accumulation=self.accumulation, fixed_batch_size=self.fixed_batch_size,
                )
                at = (pn[sel], pk[sel])
                self._rate[at], self._m[at], self._s[at] = rate, m, s
        return n, k

    def _caps(self, k: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Groups of allocations by the largest total batch they can reach, and that cap.

        Without accumulation ``K`` replicas reach ``K * m_max`` samples at most: capping the
        candidate grid there (rather than at ``max_batch_size``) puts its top candidate on
        the largest batch that fits, where throughput usually peaks. Groups whose cap is
        below ``min_batch_size`` are left out (nothing fits: rate 0).
        """
        if self.accumulation or self.fixed_batch_size is not None:
            return [(self.max_batch_size, np.ones(k.shape, dtype=bool))]
        cap = np.minimum(self.max_batch_size, k * self.local_bsz_bounds[1])
        return [(int(c), cap == c) for c in np.unique(cap) if c >= self.min_batch_size]

    def _grow(self, rows: int, cols: int) -> None:
        r0, c0 = self._rate.shape
        # Double what must grow: a policy sweeping K = 1..G grows a few times only.
        rows = r0 if rows <= r0 else max(rows, 2 * r0)
        cols = c0 if cols <= c0 else max(cols, 2 * c0)
        for name, fill in (("_rate", np.nan), ("_m", 0), ("_s", 0)):
            old = getattr(self, name)
            new = np.full((rows, cols), fill, dtype=old.dtype)
            new[:r0, :c0] = old
            setattr(self, name, new)
        self._rate[:, 0] = 0.0
