"""A checker for the step path's host-device synchronisation, on any device (issue 31).

Reading a tensor (``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``...) makes the host
wait for a GPU. :func:`watch_reads` wraps every such method of ``torch.Tensor``: a call
made from pollux's own code (``pollux_launch``, ``adapters``, ``rendezvous``) outside a
scheduled point (``pollux_launch.tuning.sync_points.inside()``) is recorded as
``file:line: .method()``, whatever the tensor's device. Used by the torch, DeepSpeed and
Horovod adapters' step-sync tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pollux_launch.tuning import sync_points

ROOT = Path(__file__).resolve().parents[1]
OURS = tuple(str(ROOT / d) for d in ("pollux_launch", "adapters", "rendezvous"))
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def watch_reads(setattr_: Callable[[object, str, object], None] = setattr) -> list[str]:
    """Wrap the read methods (with ``setattr_``: pytest's ``monkeypatch.setattr`` undoes
    it after the test); returns the list that the violations are appended to."""
    seen: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(OURS) and not sync_points.inside():
                seen.append(f"{caller.f_code.co_filename}:{caller.f_lineno}: .{_name}()")
            return _original(self, *args, **kwargs)

        setattr_(torch.Tensor, name, wrapped)
    return seen
