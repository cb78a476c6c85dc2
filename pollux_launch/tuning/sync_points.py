"""Where the training step may wait for the device: scheduled points only (issue 31).

A steady-state step of a pollux job never synchronises the host with the device: no
tensor is read (``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``), the gradient-noise
rows stay on the device, the loss scale is read asynchronously. What needs host values -
the monitor's flush, a decision's broadcast, a checkpoint's capture, a rescale - runs at
*scheduled points*: a step boundary that every replica reaches at the same step, at most
every ``decide_every`` steps (a decision) or on events (a new group, an epoch's end).

:class:`SyncPoints` counts them by reason, and marks the thread as inside one while it
runs; where CUDA's sync debug mode is on (``torch.cuda.set_sync_debug_mode("error")``)
it is lifted for the duration, so that a run in that mode fails on any other
synchronisation and on none of these. :func:`inside` is what a checker asks.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()


def inside() -> bool:
    """Whether this thread is inside a scheduled point."""
    return getattr(_local, "depth", 0) > 0


class SyncPoints:
    """Counts of the scheduled points passed, by reason (``decision``, ``rescale``...)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def scheduled(self, reason: str) -> Iterator[None]:
        """Run a scheduled point's work (it may synchronise; see the module docstring)."""
        self.counts[reason] += 1
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        mode = 0
        if depth == 0 and torch.cuda.is_initialized():
            mode = torch.cuda.get_sync_debug_mode()
            if mode:
                torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            _local.depth = depth
            if mode:
                torch.cuda.set_sync_debug_mode(mode)
