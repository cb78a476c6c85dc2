"""The training loop tests drive an ``ElasticTrainer`` with (tests/ is on the path)."""

from __future__ import annotations

from typing import Any

import torch


def run_steps(trainer: Any, loader: Any, steps: int) -> None:
    """``steps`` optimiser steps of cross-entropy over ``loader``'s ``(x, y)`` batches,
    across data epochs as needed."""
    done = 0
    while done < steps:
        for x, y in loader:
            if trainer.step(torch.nn.functional.cross_entropy(trainer.model(x), y)):
                done += 1
            if done >= steps:
                break
