"""Horovod Elastic under pollux-run (installed as ``pollux_launch.adapters.horovod``).

Worker side (this package; what a training script imports):

* :mod:`.optimizer` ``DistributedOptimizer``: ``hvd.DistributedOptimizer`` plus step timing
  and the gradient noise scale (Pollux Sec. 3.1-3.2)
* :mod:`.control`   ``HorovodControl``: the Pollux agent's batch / accumulation / LR
  decisions on every rank and rank 0's hints to the store
* :mod:`.state`     ``TorchState``: ``hvd.elastic.TorchState`` plus durable checkpoints
  (``checkpoint_dir``, or ``pollux-run --checkpoint-dir``)
* :mod:`.available` whether Horovod is installed (both sides ask)

Launch side (:mod:`.launch`; what ``pollux-run`` and its node agents run):

* :mod:`.launch.driver`   ``HorovodDriver``: pollux-run's driver of a Horovod job (one
  horovodrun); :mod:`.launch.tasks` the node agents' side of its workers
* :mod:`.launch.hosts`    allocation -> ``host:slots``; a hosts-file mirror and discovery
* :mod:`.launch.discover` ``python -m pollux_launch.adapters.horovod.launch.discover``
* :mod:`.launch.command`  the ``horovodrun`` command line and exit-code rules
* :mod:`.launch.warm`     pre-started newcomers: ``WarmStart`` (the job's warm
  :mod:`.launch.zygote`; each worker goes through the :mod:`.launch.handoff` shim)

This package imports neither torch nor horovod until ``DistributedOptimizer`` is used, so
the discovery entry point (run every second by Horovod's driver) stays cheap.
"""

from __future__ import annotations

from typing import Any

from .available import HOROVOD_INSTALL_HINT, horovod_available, require_horovod

__all__ = [
    "HOROVOD_INSTALL_HINT", "DistributedOptimizer", "HorovodControl", "HorovodMeasurement",
    "TorchState", "horovod_available", "require_horovod",
]


def __getattr__(name: str) -> Any:
    if name in ("DistributedOptimizer", "HorovodMeasurement"):
        from . import optimizer

        return getattr(optimizer, name)
    if name == "TorchState":
        from .state import TorchState

        return TorchState
    if name == "HorovodControl":
        from .control import HorovodControl

        return HorovodControl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
