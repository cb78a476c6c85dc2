"""Gradient noise scale: the pure estimator core (Pollux Sec. 3.1, Eqn 4-6).

Notation. ``G`` is the true gradient, ``Sigma`` the per-example gradient covariance, ``M0``
the job's initial (reference) total batch size. A training step averages ``count``
*micro-batch* gradients ``g_1..g_count`` (``count = K * (s + 1)`` for ``K`` replicas and
``s`` local accumulation steps), each over ``m`` examples, so the step's batch is
``M = count * m`` and ``scale = M / M0``.

From ``local_sqr`` (the mean of ``|g_i|^2``) and ``total_sqr`` (``|mean_i g_i|^2``),

* ``E[local_sqr] = |G|^2 + tr(Sigma) / m`` and ``E[total_sqr] = |G|^2 + tr(Sigma) / M``, so
* ``grad_sqr = (count * total_sqr - local_sqr) / (count - 1)`` is unbiased for ``|G|^2``,
* ``grad_var = (local_sqr - total_sqr) * scale / (count - 1)`` is unbiased for
  ``tr(Sigma) / M0``, i.e. the gradient variance *at the initial batch size M0*.

This is the normalisation the goodput core expects (``pollux_launch.goodput.GradParams``):
the gradient noise scale is ``phi = M0 * var / sqr = tr(Sigma) / |G|^2`` (McCandlish et al.
2018, "B_simple"; pre-conditioned, Pollux Eqn 5) and the statistical efficiency at total
batch ``M`` is ``E(M) = (phi + M0) / (phi + M)`` (Pollux Eqn 6).

With one replica and no accumulation there is only one gradient per step; two consecutive
steps are then used as the two samples (``count = 2``, ``differenced=True``). That is
slightly biased (the true gradient drifts between steps), as in adaptdl.

Both moments are smoothed by exponential moving averages with bias correction whose decay
per step is ``smoothing ** scale``: a step at ``M = 4 * M0`` counts as four ``M0``-steps.
Non-finite inputs (AMP overflow, a diverging step) are skipped, never averaged in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

ArrayT = TypeVar("ArrayT", float, np.ndarray)

STATE_VERSION = 1


@dataclass(frozen=True)
class GradNoise:
    """Smoothed gradient statistics normalised to the initial batch size ``M0``.

    ``sqr`` estimates ``|G|^2``, ``var`` estimates ``tr(Sigma) / M0`` (both pre-conditioned
    for adaptive optimisers, Pollux Eqn 5). Field names match ``goodput.GradParams``.
    """

    sqr: float
    var: float
    init_batch_size: int

    @property
    def noise_scale(self) -> float:
        """Gradient noise scale ``phi = M0 * var / sqr`` (in examples)."""
        return self.init_batch_size * self.var / self.sqr

    def efficiency(self, batch_size: ArrayT) -> ArrayT:
        """Statistical efficiency ``(phi + M0) / (phi + M)`` of total batch ``M`` (Eqn 6)."""
        phi = self.noise_scale
        return (phi + self.init_batch_size) / (phi + batch_size)

    def gain(self, scale: ArrayT) -> ArrayT:
        """AdaScale gain ``r = (var + sqr) / (var / scale + sqr)`` at ``scale = M / M0``."""
        return (self.var + self.sqr) / (self.var / scale + self.sqr)

    def to_grad_params(self) -> Any:
        """The goodput core's ``GradParams(sqr, var)`` (imported lazily: a sibling module)."""
        from pollux_launch.goodput import GradParams  # type: ignore[attr-defined]

        return GradParams(sqr=self.sqr, var=self.var)


def gradient_moments(
    local_sqr: ArrayT, total_sqr: ArrayT, count: ArrayT, scale: ArrayT
) -> tuple[ArrayT, ArrayT]:
    """Unbiased ``(|G|^2, tr(Sigma)/M0)`` from one step's squared norms (module docstring).

    Works elementwise on floats or numpy arrays; ``count`` must be > 1.
    """
    grad_sqr = (count * total_sqr - local_sqr) / (count - 1)
    grad_var = (local_sqr - total_sqr) * scale / (count - 1)
    return grad_sqr, grad_var


@dataclass
class _BiasCorrectedEMA:
    """``value = biased / weight``: an EMA whose zero start is corrected away (Adam-style)."""

    biased: float = 0.0
    weight: float = 0.0

    def update(self, value: float, decay: float) -> None:
        self.biased = decay * self.biased + (1.0 - decay) * value
        self.weight = decay * self.weight + (1.0 - decay)

    @property
    def value(self) -> float | None:
        return self.biased / self.weight if self.weight > 0.0 else None


class GNSEstimator:
    """Smoothed ``|G|^2`` and ``tr(Sigma)/M0`` from per-step squared norms.

    Pure and framework-free: the torch side (:mod:`.grad_monitor`) measures the squared
    norms and feeds them here; the state is JSON-serialisable so it survives a rescale
    (rank 0 broadcasts it) and can be stored with the job.
    """

    def __init__(self, init_batch_size: int, smoothing: float = 0.999) -> None:
        if not isinstance(init_batch_size, int) or init_batch_size < 1:
            raise ValueError(f"init_batch_size must be a positive integer, got {init_batch_size!r}")
        if not 0.0 < smoothing < 1.0:
            raise ValueError(f"smoothing must lie in (0, 1), got {smoothing!r}")
        self.init_batch_size = init_batch_size
        self.smoothing = smoothing
        self._sqr = _BiasCorrectedEMA()
        self._var = _BiasCorrectedEMA()
        self._differenced = False  # whether the averages come from the differenced estimator
        self.updates = 0
        self.skipped = 0

    def update(
        self,
        local_sqr: float,
        total_sqr: float,
        count: int,
        scale: float,
        differenced: bool = False,
        steps: int = 1,
    ) -> bool:
        """Fold one step in; returns False (and changes nothing) if it was skipped.

        ``local_sqr``: mean squared norm of the ``count`` micro-batch gradients;
        ``total_sqr``: squared norm of their mean; ``scale``: total batch / M0;
        ``steps``: training steps this measurement stands for (>1 when only every few
        steps are measured), so the decay per unit of training progress is unchanged.
        """
        if count < 2 or not (math.isfinite(local_sqr) and math.isfinite(total_sqr)):
            self.skipped += 1
            return False
        grad_sqr, grad_var = gradient_moments(local_sqr, total_sqr, count, scale)
        if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)):
            self.skipped += 1
            return False
        if self._differenced and not differenced:
            # Unbiased samples are now available: forget the biased history (as adaptdl).
            self._sqr, self._var = _BiasCorrectedEMA(), _BiasCorrectedEMA()
        self._differenced = differenced
        decay = self.smoothing ** (scale * max(steps, 1))
        self._sqr.update(grad_sqr, decay)
        self._var.update(grad_var, decay)
        self.updates += 1
        return True

    def update_many(self, rows: np.ndarray, meta: list[tuple[int, float, bool, int]]) -> int:
        """Fold several steps: ``rows[i] = (local_sqr, total_sqr)``, ``meta[i] = (count,
        scale, differenced, steps)``. Returns how many were accepted."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
        return sum(
            self.update(float(lo), float(to), c, s, d, n)
            for (lo, to), (c, s, d, n) in zip(rows, meta, strict=True)
        )

    def stats(self) -> GradNoise | None:
        """Current smoothed statistics, or None before the first accepted step.

        ``sqr`` is floored at a tiny positive value and ``var`` at zero so that the noise
        scale stays defined (noisy early estimates can dip below zero).
        """
        sqr, var = self._sqr.value, self._var.value
        if sqr is None or var is None:
            return None
        return GradNoise(
            sqr=max(sqr, 1e-30), var=max(var, 0.0), init_batch_size=self.init_batch_size
        )

    @property
    def differenced(self) -> bool:
        return self._differenced

    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state (no tensors, nothing to unpickle)."""
        return {
            "v": STATE_VERSION,
            "init_batch_size": self.init_batch_size,
            "smoothing": self.smoothing,
            "sqr": [self._sqr.biased, self._sqr.weight],
            "var": [self._var.biased, self._var.weight],
            "differenced": self._differenced,
            "updates": self.updates,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"GNSEstimator state: expected a dict with v={STATE_VERSION}")
        try:
            self.init_batch_size = int(state["init_batch_size"])
            self.smoothing = float(state["smoothing"])
            self._sqr = _BiasCorrectedEMA(*(float(x) for x in state["sqr"]))
            self._var = _BiasCorrectedEMA(*(float(x) for x in state["var"]))
            self._differenced = bool(state["differenced"])
            self.updates = int(state["updates"])
            self.skipped = int(state["skipped"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"GNSEstimator state is malformed: {exc}") from None
