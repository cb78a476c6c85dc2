"""Store backends behind one interface, chosen by URL (see ``base.Store``).

``open_store("embedded://")`` (one machine, no server) or
``open_store("etcd://10.0.0.1:2379,10.0.0.2:2379", ca_cert=...)`` (many machines).
Backends are imported on first use, so the etcd client is only needed for etcd URLs.
"""

from __future__ import annotations

from collections.abc import Callable

from pollux_launch.env import DEFAULT_PREFIX
from pollux_launch.registry import Registry

from .base import (
    Compare,
    Delete,
    Event,
    KeepAlive,
    KeyValue,
    LeaseExpired,
    Put,
    Store,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "Compare", "Delete", "Event", "KeepAlive", "KeyValue", "LeaseExpired", "Put", "Store",
    "StoreCompacted", "StoreError", "StoreUnavailable", "open_store", "register_backend",
    "unregister_backend",
]

# scheme -> factory, called as factory(url, prefix, **options); built-ins imported on
# first use, so that the etcd client is only needed for etcd URLs
_BACKENDS: Registry[Callable[..., Store]] = Registry(
    "store scheme", check=callable, expects="a callable factory(url, prefix, **options)",
    lazy=True, fold=str.lower, valid_name=lambda scheme: "://" not in scheme)
_BACKENDS.register("embedded", f"{__name__}.embedded:EmbeddedStore.from_url")
_BACKENDS.register("etcd", f"{__name__}.etcd:EtcdStore.from_url")


def register_backend(
    scheme: str, factory: str | Callable[..., Store], *, replace: bool = False
) -> None:
    """Make ``open_store`` open ``scheme://...`` URLs with ``factory(url, prefix, **opts)``
    (a callable, or "module:attr.path" imported on first use); schemes match
    case-insensitively.

    Raises RegistryError (a ValueError) if ``scheme`` is taken, unless ``replace=True``:
    two plug-ins claiming one scheme is a mistake to see, not to settle by import order.
    """
    _BACKENDS.register(scheme, factory, replace=replace)


def unregister_backend(scheme: str) -> None:
    """Forget ``scheme`` (KeyError if it is not registered)."""
    _BACKENDS.unregister(scheme)


def _factory(scheme: str) -> Callable[..., Store]:
    try:
        return _BACKENDS.get(scheme)
    except ImportError as exc:
        raise StoreError(f"the {scheme} store needs a package that is missing ({exc.name}); "
                         "install it with: pip install 'pollux-launch[etcd]'") from None


def open_store(url: str, prefix: str = DEFAULT_PREFIX, **options: object) -> Store:
    """Open the store named by ``url``; keys are kept under ``prefix`` (one per cluster).

    Raises StoreError with one line saying what is wrong (unknown scheme, malformed URL,
    unknown option) or StoreUnavailable when the backend cannot be reached in time.
    """
    if not isinstance(url, str) or "://" not in url:
        raise StoreError(f"bad store URL {url!r}: expected embedded:// , "
                         "embedded:///abs/path/store.db or etcd://host:port[,host:port...]")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _BACKENDS:
        raise StoreError(f"unknown store URL scheme {scheme!r} in {url!r}; "
                         f"use one of: {', '.join(_BACKENDS.names())}")
    if not isinstance(prefix, str):
        raise StoreError(f"store prefix must be a str such as {DEFAULT_PREFIX!r}, "
                         f"got {prefix!r}")
    factory = _factory(scheme)
    try:
        return factory(url, prefix, **options)
    except TypeError as exc:
        if "unexpected keyword" not in str(exc):
            raise
        raise StoreError(f"{scheme} store: {exc.args[0].split('() ')[-1]}; "
                         "see rendezvous/README.md for the options") from None
