"""Policy engines by name (as torch.distributed.elastic picks rendezvous backends): one
:class:`~pollux_launch.registry.Registry`."""

from __future__ import annotations

from collections.abc import Callable

from pollux_launch.policy.base import Policy
from pollux_launch.registry import Registry, RegistryError


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
POLICIES: Registry[Callable[..., Policy]] = Registry(
    "policy", check=callable, expects="a callable factory(**options)")
POLICIES.register("pollux-dp", _dp)
POLICIES.register("pollux-ga", _ga)
POLICIES.register("saxena-dp", _saxena)

#: The engine used when none is named: the DP finds fitter allocations far faster.
DEFAULT_POLICY = "pollux-dp"


def register_policy(name: str, factory: Callable[..., Policy], *, replace: bool = False) -> None:
    """Make ``make_policy(name, **options)`` build ``factory(**options)``.

    Raises RegistryError (a ValueError) if ``name`` is taken, unless ``replace=True`` (a
    plug-in that silently replaced a built-in engine would change every round's answer
    unnoticed).
    """
    POLICIES.register(name, factory, replace=replace)


def unregister_policy(name: str) -> None:
    """Forget the engine ``name`` (KeyError if it is not registered)."""
    POLICIES.unregister(name)


def make_policy(name: str = DEFAULT_POLICY, **options) -> Policy:
    """Build the policy engine called ``name`` with ``options``.

    Raises ``UnknownName`` for an unknown name, ``RegistryError`` for a bad option (both
    one-line ValueErrors).
    """
    factory = POLICIES.get(name)
    try:
        return factory(**options)
    except TypeError as err:  # unknown keyword
        raise RegistryError(f"bad option for policy {name!r}: {err}") from None
