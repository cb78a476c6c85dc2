"""Policy engines by name (as torch.distributed.elastic picks rendezvous backends)."""

from __future__ import annotations

from collections.abc import Callable

from pollux_launch.policy.base import Policy


def _dp(**options) -> Policy:
    from pollux_launch.policy.dp import DPPolicy

    return DPPolicy(**options)


def _ga(**options) -> Policy:
    from pollux_launch.policy.ga import GAPolicy

    return GAPolicy(**options)


def _saxena(**options) -> Policy:
    from pollux_launch.policy.saxena import SaxenaDPPolicy

    return SaxenaDPPolicy(**options)


#: name -> factory(**options). Common options: p (fairness, default -1), delta
#: (re-allocation delay, default 30 s), interference_avoidance (default True), seed;
#: saxena-dp (Saxena et al.'s throughput-maximising DP) accepts them all but uses only
#: interference_avoidance.
POLICIES: dict[str, Callable[..., Policy]] = {
    "pollux-dp": _dp,
    "pollux-ga": _ga,
    "saxena-dp": _saxena,
}

#: The engine used when none is named: the DP finds fitter allocations far faster.
DEFAULT_POLICY = "pollux-dp"


def register_policy(name: str, factory: Callable[..., Policy], *, replace: bool = False) -> None:
    """Make ``make_policy(name, **options)`` build ``factory(**options)``.

    Raises ValueError if ``name`` is taken, unless ``replace=True`` (a plug-in that
    silently replaced a built-in engine would change every round's answer unnoticed).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise ValueError(f"policy {name!r}: factory must be callable, got {factory!r}")
    if name in POLICIES and not replace:
        raise ValueError(f"policy {name!r} is already registered; pass replace=True to replace it")
    POLICIES[name] = factory


def unregister_policy(name: str) -> None:
    """Forget the engine ``name`` (KeyError if it is not registered)."""
    del POLICIES[name]


def make_policy(name: str = DEFAULT_POLICY, **options) -> Policy:
    """Build the policy engine called ``name`` with ``options``.

    Raises ``ValueError`` for an unknown name or a bad option.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(sorted(POLICIES))}")
    try:
        return POLICIES[name](**options)
    except TypeError as err:  # unknown keyword
        raise ValueError(f"bad option for policy {name!r}: {err}") from None
