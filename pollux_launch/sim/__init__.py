"""sim: trace-driven cluster simulator over the Pollux trace format (``pollux-run simulate``).

* :mod:`.traces`    the six models' tables and the ground truth read from them
* :mod:`.workload`  workload CSVs (``name,time,application,num_replicas,batch_size``, and
                    optional ``min_batch_size,max_batch_size,max_replicas`` limits)
* :mod:`.simulator` the cluster loop: admission control, then jobs learn online and the
                    policy allocates each round (optionally after profiling on arrival)
* :mod:`.autoscale` cloud autoscaling: the node pool (boot, drain, node-hours) and the
                    utility rule's what-if solves (``--autoscale MIN:MAX``)
* :mod:`.baselines` TunedJobs policies (``tuned-las``, ``tuned-fifo``) and ``max-bs``
* :mod:`.generate`  Saxena et al.'s scenarios: Poisson arrivals at a high or a low rate
* :mod:`.run`       workload file + policy name -> :class:`SimResult`
* :mod:`.plots`     JCT CDF, GPUs / efficiency and nodes / jobs timelines (PNG)
* :mod:`.cli`       the ``simulate`` subcommand
"""

from pollux_launch.sim.simulator import ProfileConfig, SimConfig, SimResult, simulate
from pollux_launch.sim.traces import ModelTrace, available_models, load_model
from pollux_launch.sim.workload import TraceJob, WorkloadError, load_workload, write_workload

__all__ = [
    "ModelTrace",
    "ProfileConfig",
    "SimConfig",
    "SimResult",
    "TraceJob",
    "WorkloadError",
    "available_models",
    "load_model",
    "load_workload",
    "simulate",
    "write_workload",
]
