"""The one registry type behind every extension point, and the adapters' launch sides
found through their entry points (the launcher names none of them)."""

from __future__ import annotations

import pytest

from pollux_launch.registry import Registry, RegistryError, UnknownName


def test_register_get_unregister():
    reg: Registry[int] = Registry("number", check=lambda e: isinstance(e, int),
                                  expects="an int")
    reg.register("one", 1)
    assert reg.get("one") == reg["one"] == 1 and "one" in reg and reg.names() == ["one"]
    with pytest.raises(RegistryError, match="'one' is already registered"):
        reg.register("one", 2)
    reg.register("one", 2, replace=True)
    assert reg.get("one") == 2
    with pytest.raises(RegistryError, match="expected an int"):
        reg.register("two", "2")  # not lazy: a string is an entry of the wrong kind
    with pytest.raises(RegistryError, match="bad number name"):
        reg.register("", 3)
    reg.unregister("one")
    with pytest.raises(KeyError):
        reg.unregister("one")
    with pytest.raises(UnknownName, match="unknown number 'one': choose one of"):
        reg.get("one")


def test_lazy_entries_are_imported_on_first_use_and_names_fold():
    reg: Registry[object] = Registry("thing", lazy=True, fold=str.lower,
                                     valid_name=lambda n: "/" not in n)
    reg.register("Join", "os.path:join")
    import os.path

    assert reg.get("JOIN") is os.path.join
    with pytest.raises(RegistryError, match="'module:attr'"):
        reg.register("x", "no-colon")
    with pytest.raises(RegistryError):
        reg.register("a/b", "os:sep")
    assert isinstance(UnknownName("x"), (ValueError, KeyError))  # callers' old excepts


def test_the_adapters_plug_their_launch_sides_in_through_entry_points():
    from pollux_launch.adapters.deepspeed.launch import check_ds_configs
    from pollux_launch.adapters.horovod.launch.driver import HorovodDriver
    from pollux_launch.adapters.horovod.launch.tasks import HorovodTaskDriver
    from pollux_launch.launcher.drivers import ReplicaDriver, driver_classes
    from pollux_launch.launcher.frameworks import framework_launch
    from pollux_launch.launcher.restart import RestartDriver

    assert driver_classes("horovod") == [HorovodDriver, HorovodTaskDriver]
    assert driver_classes("deepspeed") == [ReplicaDriver]
    assert driver_classes("deepspeed", "restart") == [RestartDriver]
    assert driver_classes("torch", "fixed") == [RestartDriver]
    assert framework_launch("deepspeed").check is check_ds_configs
    assert framework_launch("an-unknown-framework").live == ("replicas",)


def test_a_stale_install_without_the_entry_points_is_one_clear_line(monkeypatch):
    from pollux_launch.arguments import OptionsError
    from pollux_launch.launcher import frameworks

    frameworks.LAUNCH.names()  # (plug-ins loaded first, as in any run)
    monkeypatch.setattr(frameworks, "LAUNCH", Registry("framework"))  # as if none found
    with pytest.raises(OptionsError, match="horovod adapter's launch side is not registered"):
        frameworks.framework_launch("horovod")
    assert frameworks.framework_launch("torch") is frameworks.DEFAULT_LAUNCH

