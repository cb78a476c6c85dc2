"""Scale-invariant training progress ("statistical epochs", Pollux Sec. 3.1 / adaptdl).

A step at total batch ``M`` makes as much progress as ``r = E(M) * M / M0`` steps at the
initial batch ``M0`` (Pollux Eqn 6: ``E(M) = (phi + M0) / (phi + M)``; ``r`` is the AdaScale
gain ``(var + sqr) / (var / scale + sqr)`` with ``scale = M / M0``). Summing ``r`` gives
progress in ``M0``-iterations; times ``M0`` over the dataset size, in *statistical epochs*.
So "train for N epochs" asks for the same amount of learning whatever batch sizes the
agent picks along the way; with ``M = M0`` throughout it equals the ordinary epoch count.
Before any gradient statistics exist a step counts as one ``M0``-iteration (``r = 1``,
conservative: large early batches are not over-credited).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .gns import GradNoise

STATE_VERSION = 1


def progress_gain(grad: GradNoise | None, batch_size: float | np.ndarray) -> float | np.ndarray:
    """``M0``-iterations made by one step at total batch ``batch_size`` (>= 1 when M >= M0)."""
    if grad is None:
        return np.ones_like(batch_size, dtype=np.float64) if np.ndim(batch_size) else 1.0
    return grad.gain(np.asarray(batch_size, dtype=np.float64) / grad.init_batch_size)


class StatisticalProgress:
    """Accumulated progress in ``M0``-iterations and statistical epochs."""

    def __init__(self, init_batch_size: int, dataset_size: int | None = None) -> None:
        if not isinstance(init_batch_size, int) or init_batch_size < 1:
            raise ValueError(f"init_batch_size must be a positive integer, got {init_batch_size!r}")
        if dataset_size is not None and dataset_size < 1:
            raise ValueError(f"dataset_size must be positive, got {dataset_size!r}")
        self.init_batch_size = init_batch_size
        self.dataset_size = dataset_size
        self.iterations = 0.0  # in M0-sized steps
        self.steps = 0  # real optimiser steps
        self.samples = 0  # real samples processed
        # the last step's (statistics, batch size, gain): a gain changes only when the
        # statistics (replaced at each decision) or the batch do - not computed per step
        self._last: tuple[GradNoise | None, int, float] | None = None

    def step(self, batch_size: int, grad: GradNoise | None) -> float:
        """Account one optimiser step at total batch ``batch_size``; returns its gain."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size!r}")
        last = self._last
        if last is not None and last[0] is grad and last[1] == batch_size:
            gain = last[2]
        else:
            gain = float(progress_gain(grad, batch_size))
            self._last = (grad, batch_size, gain)
        self.iterations += gain
        self.steps += 1
        self.samples += batch_size
        return gain

    def epochs(self, dataset_size: int | None = None) -> float:
        """Statistical epochs so far: ``iterations * M0 / dataset_size``."""
        size = dataset_size if dataset_size is not None else self.dataset_size
        if size is None:
            raise ValueError("statistical epochs need the dataset size: pass dataset_size")
        return self.iterations * self.init_batch_size / size

    def done(self, epochs: float, dataset_size: int | None = None) -> bool:
        """Whether ``epochs`` statistical epochs have been reached."""
        return self.epochs(dataset_size) >= epochs

    def state_dict(self) -> dict[str, Any]:
        return {
            "v": STATE_VERSION,
            "init_batch_size": self.init_batch_size,
            "dataset_size": self.dataset_size,
            "iterations": self.iterations,
            "steps": self.steps,
            "samples": self.samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"StatisticalProgress state: expected a dict with v={STATE_VERSION}")
        try:
            self.init_batch_size = int(state["init_batch_size"])
            size = state["dataset_size"]
            self.dataset_size = None if size is None else int(size)
            self.iterations = float(state["iterations"])
            self.steps = int(state["steps"])
            self.samples = int(state["samples"])
            self._last = None
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"StatisticalProgress state is malformed: {exc}") from None
