"""Gradient pre-conditioners for the noise scale (PGNS, Pollux Eqn 5).

For an adaptive optimiser the step is ``P^-1 g``, so the statistics that predict how the
batch size trades off are those of the pre-conditioned gradient. For Adam-family
optimisers ``P = diag(sqrt(v_hat) + eps)`` with ``v_hat = exp_avg_sq / (1 - beta2^t)``
(as in adaptdl's ``AdamGradientNoiseScale``); during the first few optimiser steps
``v_hat`` is too noisy and the identity is used. Plain SGD (with or without momentum) uses
the identity.

One interface, backends chosen by name (``"identity"``, ``"adam"``) or ``"auto"`` from the
optimiser type. A pre-conditioner returns the per-parameter *inverse* diagonal
``r = 1 / P`` (so the hot path multiplies, never divides), or ``None`` for the identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

# Below this many optimiser steps Adam's second moment is too noisy to pre-condition with.
ADAM_MIN_STEPS = 5

_ADAM_FAMILY: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


class Preconditioner(Protocol):
    name: str

    def inverse(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """``1 / P`` per parameter, aligned with ``params``; None means the identity."""


class IdentityPreconditioner:
    name = "identity"

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        del optimizer

    def inverse(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        return None


class AdamPreconditioner:
    """``r = 1 / (sqrt(exp_avg_sq / (1 - beta2^t)) + eps)`` from the optimiser's own state."""

    name = "adam"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._group_of: dict[int, dict] = {
            id(p): group for group in optimizer.param_groups for p in group["params"]
        }

    @torch.no_grad()
    def inverse(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        states = [self._optimizer.state.get(p) for p in params]
        present = [i for i, s in enumerate(states) if s and "exp_avg_sq" in s]
        if not present:
            return None
        v, corr, eps = [], [], []
        for i in present:
            state, group = states[i], self._group_of[id(params[i])]
            step = float(state["step"])  # a CPU tensor unless capturable/fused: cheap
            if step < ADAM_MIN_STEPS:
                return None  # too early for any: stay consistent across parameters
            v.append(state["exp_avg_sq"])
            corr.append(1.0 / math.sqrt(1.0 - group["betas"][1] ** step))
            eps.append(group["eps"])
        denom = torch._foreach_sqrt(v)
        torch._foreach_mul_(denom, corr)
        torch._foreach_add_(denom, eps)
        torch._foreach_reciprocal_(denom)
        if len(present) == len(params):
            return denom
        # Parameters never stepped (no gradient yet) keep the identity.
        out = [torch.ones_like(p) for p in params]
        for i, r in zip(present, denom, strict=True):
            out[i] = r
        return out


PRECONDITIONERS: dict[str, Callable[[torch.optim.Optimizer], Preconditioner]] = {
    "identity": IdentityPreconditioner,
    "adam": AdamPreconditioner,
}


def auto_preconditioner_name(optimizer: torch.optim.Optimizer) -> str:
    """``"adam"`` for Adam-family optimisers (by type, or by ``betas`` + ``eps`` in every
    param group for look-alikes), else ``"identity"``."""
    if isinstance(optimizer, _ADAM_FAMILY):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "identity"
    groups = optimizer.param_groups
    if groups and all("betas" in g and "eps" in g for g in groups):
        return "adam"
    return "identity"


def make_preconditioner(name: str, optimizer: torch.optim.Optimizer) -> Preconditioner:
    """The pre-conditioner registered as ``name`` (or chosen by ``"auto"``)."""
    if name == "auto":
        name = auto_preconditioner_name(optimizer)
    try:
        factory = PRECONDITIONERS[name]
    except KeyError:
        choices = ", ".join(["auto", *PRECONDITIONERS])
        raise ValueError(f"unknown preconditioner {name!r}; choose one of: {choices}") from None
    return factory(optimizer)
