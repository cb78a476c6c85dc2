"""Learning-rate scaling rules: how much to scale the LR when the batch grows S = M/M0 times.

One interface, several rules chosen by name::

    factor = scale_lr("adascale", init_batch_size, batch_size, grad_params)

A rule is any callable ``rule(scale, stats) -> factor``; register your own with
:func:`register_lr_rule` (and :func:`unregister_lr_rule`) or pass the callable instead
of a name. Every rule gives 1 at ``S = 1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..registry import Registry
from .efficiency import GradParams, gain

__all__ = ["LEGWState", "LRRule", "lr_rules", "register_lr_rule", "scale_lr",
           "unregister_lr_rule"]

LRRule = Callable[[float, Any], float]


@dataclass(frozen=True)
class LEGWState:
    """Progress of warm-up for LEGW: progress and base warm-up length, same units."""

    progress: float
    base_warmup: float


def _linear(scale: float, stats: Any) -> float:
    """Goyal et al.: LR proportional to the batch size."""
    return scale


def _sqrt(scale: float, stats: Any) -> float:
    """Krizhevsky: LR proportional to the square root of the batch size."""
    return math.sqrt(scale)


def _adascale(scale: float, stats: Any) -> float:
    """AdaScale (Johnson et al., Pollux Sec. 3.1): the gain r = (var + sqr)/(var/S + sqr)."""
    if not isinstance(stats, GradParams):
        raise ValueError("the 'adascale' LR rule needs GradParams(sqr, var) as its stats")
    return float(gain(stats, scale))


def _legw(scale: float, stats: Any) -> float:
    """LEGW (You et al.): sqrt(S) scaling with the warm-up stretched S times.

    Given a :class:`LEGWState`, the factor includes the extra warm-up relative to the
    base schedule's own (which the user's scheduler already applies); otherwise sqrt(S).
    """
    factor = math.sqrt(scale)
    if isinstance(stats, LEGWState) and stats.base_warmup > 0:
        base = min(1.0, stats.progress / stats.base_warmup)
        stretched = min(1.0, stats.progress / (scale * stats.base_warmup))
        factor *= stretched / base if base > 0 else 1.0
    return factor


_RULES: Registry[LRRule] = Registry("LR rule", check=callable, expects="a callable")
for _name, _rule in (("linear", _linear), ("sqrt", _sqrt), ("adascale", _adascale),
                     ("legw", _legw)):
    _RULES.register(_name, _rule)


def register_lr_rule(name: str, rule: LRRule, *, replace: bool = False) -> None:
    """Make ``rule(scale, stats) -> factor`` available to :func:`scale_lr` by name.

    Raises RegistryError (a ValueError) if ``name`` is taken, unless ``replace=True``:
    every job that names a rule would otherwise change its LR with whichever module
    registered last.
    """
    _RULES.register(name, rule, replace=replace)


def unregister_lr_rule(name: str) -> None:
    """Forget the rule ``name`` (KeyError if it is not registered)."""
    _RULES.unregister(name)


def lr_rules() -> list[str]:
    """Names of the registered rules."""
    return _RULES.names()


def scale_lr(
    rule: str | LRRule, init_batch_size: float, batch_size: float, stats: Any = None
) -> float:
    """LR factor for total batch ``batch_size`` given a rule tuned at ``init_batch_size``."""
    if not init_batch_size > 0 or not batch_size > 0:
        raise ValueError(
            f"batch sizes must be > 0, got init_batch_size={init_batch_size}, "
            f"batch_size={batch_size}"
        )
    if isinstance(rule, str):
        rule = _RULES.get(rule)
    elif not callable(rule):
        raise ValueError(f"LR rule must be a name or a callable, got {rule!r}")
    return float(rule(batch_size / init_batch_size, stats))
