"""A constant global batch for restart-elastic scripts (torchrun style, no pollux API).

A restart-elastic job is started again with a new ``WORLD_SIZE`` when its allocation
changes. A script whose global batch is ``per-device batch x WORLD_SIZE x accumulation``
(Hugging Face ``Trainer``, most DDP loops) then trains with another batch, another number
of optimizer steps per epoch and another LR schedule. ``pollux-run`` exports the job's
reference size (``-np``) to its workers; :func:`accumulation_steps` turns it into the
accumulation that keeps the global batch at its value for that size::

    from pollux_launch.constant_batch import accumulation_steps
    args = TrainingArguments(..., gradient_accumulation_steps=accumulation_steps(2))

Importing this module does not make a script use the pollux API: it stays
restart-elastic (``launcher/frameworks.py``). It imports nothing but the standard library.
"""

from __future__ import annotations

import os
import sys

from . import env as envvars


def accumulation_steps(accumulation: int = 1, world_size: int | None = None) -> int:
    """The gradient accumulation that keeps ``per-device batch x world x accumulation``
    equal to its value at the job's reference size with ``accumulation`` steps.

    ``world_size``: the current one (default ``$WORLD_SIZE``). Outside ``pollux-run``
    (no reference size) ``accumulation`` is returned unchanged. Where the reference
    global batch is not a multiple of the current world, the nearest accumulation (at
    least 1) is returned and one line on stderr says the global batch changed. Raises
    ValueError (one line) for an ``accumulation`` below 1 or a malformed variable."""
    if accumulation < 1:
        raise ValueError(f"accumulation_steps({accumulation}): must be at least 1")
    ref = _positive(envvars.REFERENCE_WORLD_SIZE)
    world = world_size if world_size is not None else _positive("WORLD_SIZE")
    if ref is None or world is None:
        return accumulation
    if world < 1:
        raise ValueError(f"accumulation_steps: world size {world} must be at least 1")
    total = ref * accumulation
    steps = max(1, round(total / world))
    if steps * world != total:
        print(f"[pollux] constant batch: {ref} x {accumulation} micro-batches cannot be "
              f"split over {world} workers; accumulating {steps} (global batch "
              f"{world * steps}/{total} of the reference)", file=sys.stderr, flush=True)
    return steps


def _positive(name: str) -> int | None:
    """``$name`` as a positive integer (None when unset); ValueError when malformed."""
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1_000_000:
        raise ValueError(f"${name}={text[:40]!r}: expected a positive integer")
    return value
