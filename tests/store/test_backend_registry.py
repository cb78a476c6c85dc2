"""Store backends by URL scheme: registering a taken scheme is an error unless replaced."""

from __future__ import annotations

import pytest

from pollux_launch.rendezvous.store import (
    open_store,
    register_backend,
    unregister_backend,
)
from pollux_launch.rendezvous.store.embedded import EmbeddedStore


@pytest.fixture
def scheme():
    """A scheme of this test's own, forgotten afterwards (tests never leak plug-ins)."""
    yield "testmem"
    try:
        unregister_backend("testmem")
    except KeyError:
        pass


def test_register_open_and_unregister(scheme, tmp_path):
    seen = []

    def factory(url, prefix, **options):
        seen.append((url, prefix, options))
        return EmbeddedStore(tmp_path / "s.db", prefix)

    register_backend(scheme, factory)
    with open_store("TestMem://x", "/p", timeout=1.0):
        pass
    assert seen == [("TestMem://x", "/p", {"timeout": 1.0})]
    unregister_backend(scheme)
    with pytest.raises(KeyError):
        unregister_backend(scheme)


def test_a_taken_scheme_is_refused_unless_replaced(scheme):
    register_backend(scheme, "some.module:Factory")
    with pytest.raises(ValueError, match=r"already registered.*replace=True"):
        register_backend(scheme.upper(), "other.module:Factory")
    with pytest.raises(ValueError, match="'etcd' is already registered"):
        register_backend("etcd", "other.module:Factory")
    register_backend(scheme, "other.module:Factory", replace=True)


@pytest.mark.parametrize(("name", "factory"), [("", "m:f"), ("a://", "m:f"), ("x", "no-colon"),
                                               ("x", 42)])
def test_bad_registrations(name, factory):
    with pytest.raises(ValueError):
        register_backend(name, factory)
