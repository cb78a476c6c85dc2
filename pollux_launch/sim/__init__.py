"""sim: trace-driven cluster simulator over the Pollux trace format (``pollux-run simulate``).

* :mod:`.traces`    the six models' tables and the ground truth read from them
* :mod:`.workload`  workload CSVs (``name,time,application,num_replicas,batch_size``)
* :mod:`.simulator` the cluster loop: jobs learn online, the policy allocates each round
* :mod:`.baselines` non-adaptive TunedJobs policies (``tuned-las``, ``tuned-fifo``)
* :mod:`.run`       workload file + policy name -> :class:`SimResult`
* :mod:`.plots`     JCT CDF and GPUs / efficiency timelines (PNG)
* :mod:`.cli`       the ``simulate`` subcommand
"""

from pollux_launch.sim.simulator import SimConfig, SimResult, simulate
from pollux_launch.sim.traces import ModelTrace, available_models, load_model
from pollux_launch.sim.workload import JobSpec, WorkloadError, load_workload

__all__ = [
    "JobSpec",
    "ModelTrace",
    "SimConfig",
    "SimResult",
    "WorkloadError",
    "available_models",
    "load_model",
    "load_workload",
    "simulate",
]
