"""What the policy examples share: the worker's start (logging, one thread, a seed, the
job) and their JSON-lines output."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

import pollux_launch.adapters.torch as pollux


def start(seed: int) -> pollux.ElasticJob:
    """Log at pollux-run's level, one CPU thread per worker (they share a small machine),
    a fixed seed; join the job."""
    level = os.environ.get("POLLUX_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=level.replace("TRACE", "DEBUG").replace("FATAL", "CRITICAL"),
                        format="%(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    return pollux.init()


def emitter(path: str | None, when: Callable[[], bool] = lambda: True
            ) -> Callable[[dict[str, Any]], None]:
    """``emit(record)``: one JSON line appended to ``path`` (nothing without one) while
    ``when()`` holds (e.g. on rank 0 only)."""
    out = open(path, "a", buffering=1) if path else None

    def emit(record: dict[str, Any]) -> None:
        if out is not None and when():
            out.write(json.dumps(record) + "\n")

    return emit
