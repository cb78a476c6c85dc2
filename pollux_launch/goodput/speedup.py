"""SPEEDUP of an allocation: its best goodput relative to a reference allocation (Eqn 15).

The policy evaluates the same job's speedup at many (nodes, replicas) allocations every
round, so the best goodput of each distinct allocation is computed once per fitted
model and kept in a dense table indexed by (nodes, replicas).

Contract with the policy: ``speedup_fn(num_nodes, num_replicas) -> speedup`` for numpy
integer arrays of any (equal or broadcastable) shape; zero replicas give 0. The policy
normalises by the job's fair share itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .function import GoodputFunction, _broadcast

__all__ = ["SpeedupFunction"]


class SpeedupFunction:
    """Memoised ``goodput(N, K) / goodput(reference)`` of one fitted goodput model."""

    def __init__(
        self,
        goodput_fn: GoodputFunction,
        max_batch_size: int,
        local_bsz_bounds: tuple[int, int],
        accumulation: bool = True,
        fixed_batch_size: int | None = None,
        reference: tuple[int, int] = (1, 1),
        min_batch_size: int | None = None,
    ):
        self._goodput_fn = goodput_fn
        self._kwargs = {
            "max_batch_size": max_batch_size,
            "local_bsz_bounds": local_bsz_bounds,
            "accumulation": accumulation,
            "fixed_batch_size": fixed_batch_size,
            "min_batch_size": min_batch_size,
        }
        self._table = np.full((2, 5), np.nan)  # [nodes, replicas] -> best goodput
        self._table[:, 0] = 0.0  # no replicas, no progress
        ref_nodes, ref_replicas = reference
        if not 1 <= ref_nodes <= ref_replicas:
            raise ValueError(f"reference must be (nodes, replicas) with 1 <= nodes <= "
                             f"replicas, got {reference!r}")
        ref = float(self.goodput(np.array([ref_nodes]), np.array([ref_replicas]))[0])
        if not ref > 0:
            raise ValueError(
                f"no batch configuration fits the reference allocation {reference}: "
                "check max_batch_size, local_bsz_bounds and accumulation"
            )
        self.reference = (int(ref_nodes), int(ref_replicas))
        self._ref_goodput = ref

    def goodput(self, num_nodes: Any, num_replicas: Any) -> np.ndarray:
        """Best goodput of each allocation (Eqn 13), computed once per distinct one."""
        n, k = _broadcast(np.asarray(num_nodes), np.asarray(num_replicas))
        if n.size == 0:
            return np.zeros(n.shape)
        if np.any(k < 0) or np.any(n < 0) or np.any((k > 0) & ((n < 1) | (n > k))):
            raise ValueError("allocations need 0 <= num_nodes <= num_replicas, with "
                             "num_nodes >= 1 where num_replicas > 0")
        n = n.astype(np.intp, copy=False)
        k = k.astype(np.intp, copy=False)
        n = np.where(k == 0, 0, n)  # every empty allocation is the same one
        rows, cols = self._table.shape
        if n.max() >= rows or k.max() >= cols:
            self._grow(int(n.max()) + 1, int(k.max()) + 1)
        values = self._table[n, k]
        missing = np.isnan(values)
        if missing.any():
            cols = self._table.shape[1]  # (a 1-D unique of n*cols+k: ~3x a 2-D one's speed)
            flat = np.unique(n[missing] * cols + k[missing])
            pn, pk = flat // cols, flat % cols
            good, _, _ = self._goodput_fn.optimize(pn, pk, **self._kwargs)
            self._table[pn, pk] = good
            values = self._table[n, k]
        return values

    def __call__(self, num_nodes: Any, num_replicas: Any) -> np.ndarray:
        """Speedup relative to the reference allocation (1 there; 0 for no replicas)."""
        return self.goodput(num_nodes, num_replicas) / self._ref_goodput

    def _grow(self, rows: int, cols: int) -> None:
        old = self._table
        r0, c0 = old.shape
        # Double what must grow: a policy sweeping K = 1..64 re-allocates a few times only.
        rows = r0 if rows <= r0 else max(rows, 2 * r0)
        cols = c0 if cols <= c0 else max(cols, 2 * c0)
        self._table = np.full((rows, cols), np.nan)
        self._table[:r0, :c0] = old
        self._table[:, 0] = 0.0
