"""Statistical efficiency of a batch size, from the gradient noise scale (Pollux Sec. 3.1).

With ``sqr`` = |g|^2 and ``var`` = tr(Sigma) measured at (normalised to) the initial
batch size ``M0`` (pre-conditioned for adaptive optimisers, Eqn 5):

    phi           = M0 * var / sqr                         gradient noise scale (Eqn 4)
    r(S)          = (var + sqr) / (var / S + sqr)          AdaScale gain at S = M / M0
    EFFICIENCY(M) = r(S) / S = (phi + M0) / (phi + M)      (Eqn 6)

so each sample at batch ``M`` makes ``EFFICIENCY(M)`` times the progress of a sample at
``M0``. Jobs whose batch size is fixed use efficiency 1 (see ``GoodputFunction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GradParams", "efficiency", "gain", "noise_scale"]


@dataclass(frozen=True)
class GradParams:
    """Gradient statistics normalised to the initial batch size (Pollux Eqn 4-5)."""

    sqr: float  # |g|^2, squared norm of the true gradient
    var: float  # tr(Sigma) of the per-M0-batch gradient noise

    def __post_init__(self):
        for name in ("sqr", "var"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"GradParams.{name} must be a finite number >= 0, got {value!r} "
                    "(clip noisy estimates at 0 before passing them)"
                )


def _check_init(init_batch_size: float) -> None:
    if not init_batch_size > 0:
        raise ValueError(f"init_batch_size (M0) must be > 0, got {init_batch_size}")


def noise_scale(grad_params: GradParams, init_batch_size: float) -> float:
    """phi = M0 * var / sqr (Eqn 4); inf when the gradient is all noise (sqr == 0)."""
    _check_init(init_batch_size)
    if grad_params.sqr == 0:
        return math.inf if grad_params.var > 0 else 0.0
    return init_batch_size * grad_params.var / grad_params.sqr


def gain(grad_params: GradParams, scale: Any) -> np.ndarray:
    """AdaScale gain r = (var + sqr) / (var / S + sqr); 1 where nothing is known (0/0)."""
    s = np.asarray(scale, dtype=float)
    if np.any(s <= 0):
        raise ValueError("scale S = M / M0 must be > 0")
    sqr, var = grad_params.sqr, grad_params.var
    if sqr == 0 and var == 0:
        return np.ones_like(s)
    return (var + sqr) / (var / s + sqr)


def efficiency(grad_params: GradParams, init_batch_size: float, batch_size: Any) -> np.ndarray:
    """EFFICIENCY(M) = r(M/M0) / (M/M0) = (phi + M0) / (phi + M) (Eqn 6); 1 at M0,
    decreasing in M. Without statistics (sqr = var = 0) it is M0/M: no credit for growth."""
    _check_init(init_batch_size)
    m = np.asarray(batch_size, dtype=float)
    if np.any(m <= 0):
        raise ValueError("batch_size must be > 0 samples")
    scale = m / init_batch_size
    return gain(grad_params, scale) / scale
