"""The Horovod adapter's launch side: what ``pollux-run`` and its node agents run for a
Horovod job (see the package's docstring for each module). :func:`register` is this
adapter's entry point in the group ``pollux_launch.launcher.frameworks.PLUGINS``; it
imports no driver until one is used (the discovery script, run every second by Horovod's
driver, imports this package too)."""

from __future__ import annotations


def register() -> None:
    """Plug Horovod's drivers into the launcher (called once per process): ONE Horovod
    Elastic driver per job, run where the job was launched, and a task driver in every
    node agent; a Horovod job never restarts torchrun's way, so both kinds use them."""
    from pollux_launch.launcher.drivers import DRIVERS
    from pollux_launch.launcher.frameworks import LAUNCH, FrameworkLaunch

    DRIVERS.register("horovod", f"{__name__}.driver:HorovodDriver")
    DRIVERS.register("horovod-tasks", f"{__name__}.tasks:HorovodTaskDriver")
    drivers = ("horovod", "horovod-tasks")
    LAUNCH.register("horovod", FrameworkLaunch(live=drivers, restart=drivers))
