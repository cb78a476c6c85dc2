"""DeepSpeed adapter: a ``"pollux"`` section in ds_config and live rescaling of engines.

Change one import line::

    engine, optimizer, loader, scheduler = pollux_launch.adapters.deepspeed.initialize(
        model=model, optimizer=optimizer, config="ds_config.json")

Modules: :mod:`.config` (the section, pure), :mod:`.engine` (``initialize``, the engine
handle), :mod:`.state` (capture / rebuild / restore of an engine across world sizes),
:mod:`.gradients` (gradient noise statistics), :mod:`.elastic` (the job under pollux-run:
agent decisions, hints, rescales at step boundaries), :mod:`.compat` (every
DeepSpeed-internal access, DeepSpeed 0.19.8). Importing this package does not import DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from .config import (
    PolluxConfig,
    PolluxConfigError,
    derive_ds_config,
    parse_pollux_config,
)

__all__ = [
    "PolluxConfig",
    "PolluxConfigError",
    "capture",
    "derive_ds_config",
    "detach",
    "epochs",
    "initialize",
    "initialize_handle",
    "parse_pollux_config",
    "prewarm",
    "rebuild",
    "restore",
]


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize``; see :func:`.engine.initialize`."""
    from .engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def initialize_handle(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """A PolluxEngine on a caller-managed process group; see :func:`.engine.initialize_handle`."""
    from .engine import initialize_handle as _initialize_handle

    return _initialize_handle(*args, **kwargs)


def epochs(engine: Any, total: int) -> Any:
    """The epochs to run: under pollux-run the engine's statistical epochs (they resume
    where the job stands, so a newcomer starts at the job's epoch), else ``range(total)``."""
    from .engine import PolluxEngine

    if isinstance(engine, PolluxEngine) and engine.loader is not None:
        return engine.epochs(total)
    return range(total)


def __getattr__(name: str) -> Any:
    # DeepSpeed and torch.distributed helpers load on first use only
    if name in ("capture", "detach", "rebuild", "restore"):
        from . import state

        return getattr(state, name)
    if name == "prewarm":
        from .compat import prewarm

        return prewarm
    if name == "PolluxEngine":
        from .engine import PolluxEngine

        return PolluxEngine
    if name == "ElasticDeepSpeed":
        from .elastic import ElasticDeepSpeed

        return ElasticDeepSpeed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
