"""Whether Horovod is installed, asked by both sides of the adapter (without importing it)."""

from __future__ import annotations

import importlib.util

from pollux_launch.errors import UserError

__all__ = ["HOROVOD_INSTALL_HINT", "HorovodMissing", "horovod_available", "require_horovod"]

HOROVOD_INSTALL_HINT = (
    "Horovod is not installed in this environment; install it with scripts/install-horovod.sh "
    "(builds Horovod 0.28.1 with PyTorch and Gloo once, ~10 min, then reuses the cached wheel)"
)


class HorovodMissing(UserError, RuntimeError):
    """Horovod is not installed where a Horovod job must run; the message says how to
    install it."""


def horovod_available() -> bool:
    """Whether ``horovod`` can be imported here (without importing it)."""
    return importlib.util.find_spec("horovod") is not None


def require_horovod() -> None:
    """Raise ``HorovodMissing`` (a RuntimeError) with the install hint if Horovod is
    missing."""
    if not horovod_available():
        raise HorovodMissing(HOROVOD_INSTALL_HINT)
