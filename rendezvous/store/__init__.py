"""Store backends behind one interface, chosen by URL (see ``base.Store``).

``open_store("embedded://")`` (one machine, no server) or
``open_store("etcd://10.0.0.1:2379,10.0.0.2:2379", ca_cert=...)`` (many machines).
Backends are imported on first use, so the etcd client is only needed for etcd URLs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from pollux_launch.env import DEFAULT_PREFIX

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

# scheme -> "module:factory"; a factory is called as factory(url, prefix, **options)
_BACKENDS: dict[str, str | Callable[..., Store]] = {
    "embedded": f"{__name__}.embedded:EmbeddedStore.from_url",
    "etcd": f"{__name__}.etcd:EtcdStore.from_url",
}


def register_backend(
    scheme: str, factory: str | Callable[..., Store], *, replace: bool = False
) -> None:
    """Make ``open_store`` open ``scheme://...`` URLs with ``factory(url, prefix, **opts)``
    (a callable, or "module:attr.path" imported on first use).

    Raises ValueError if ``scheme`` is taken, unless ``replace=True``: two plug-ins
    claiming one scheme is a mistake to see, not to settle by import order.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme:
        raise ValueError(f"store scheme must be a name such as 'etcd', got {scheme!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise ValueError(f"store backend {scheme!r}: factory must be a callable or "
                         f"'module:attr', got {factory!r}")
    scheme = scheme.lower()  # open_store matches schemes case-insensitively
    if scheme in _BACKENDS and not replace:
        raise ValueError(f"store scheme {scheme!r} is already registered; "
                         "pass replace=True to replace it")
    _BACKENDS[scheme] = factory


def unregister_backend(scheme: str) -> None:
    """Forget ``scheme`` (KeyError if it is not registered)."""
    del _BACKENDS[scheme.lower()]


def _factory(scheme: str) -> Callable[..., Store]:
    entry = _BACKENDS[scheme]
    if callable(entry):
        return entry
    module, _, attrs = entry.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise StoreError(f"the {scheme} store needs a package that is missing ({exc.name}); "
                         "install it with: pip install 'pollux-launch[etcd]'") from None
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


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
                         f"use one of: {', '.join(sorted(_BACKENDS))}")
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
