"""pollux-launch: goodput-optimised, live-rescaling launcher for deep learning jobs.

Map of the package (see README.md):

* ``pollux_launch.goodput``     pure numeric core: throughput model, efficiency, goodput
* ``pollux_launch.policy``      pure cluster optimisation: fitness, search, placement
* ``pollux_launch.sim``         trace-driven cluster simulator
* ``pollux_launch.tuning``       the per-worker GoodputTuner (timing, noise scale, hints)
* ``pollux_launch.coordinator`` the scheduling service loop
* ``pollux_launch.rendezvous``  the store (etcd, embedded) and the live-rescale protocol
* ``pollux_launch.adapters``    torch / horovod / deepspeed glue
* ``pollux_launch.cli``         ``pollux-run``
"""

__version__ = "0.1.0"
