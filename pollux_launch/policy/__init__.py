"""policy: PolluxSched, the cluster-wide allocation of GPUs to jobs (Pollux Sec. 4.2).

Pure: jobs' speedup functions + nodes + the current allocation matrix in, the next
allocation matrix out. Engines behind one interface, chosen by name::

    policy = make_policy("pollux-dp", p=-1, delta=30.0, interference_avoidance=True)
    alloc = policy.optimize(jobs, nodes, current)   # (len(jobs), len(nodes)) ints

Engines: ``pollux-dp`` (default) and ``pollux-ga`` maximise Pollux's FITNESS_p;
``saxena-dp`` maximises total throughput (Saxena et al., MASCOTS 2020).
"""

from pollux_launch.policy.base import JobInfo, Policy, PolicyNode, SpeedupFn
from pollux_launch.policy.objective import (
    evaluate_fitness,
    fair_share,
    fitness,
    job_speedups,
    reallocation_penalty,
)
from pollux_launch.policy.placement import check_allocation
from pollux_launch.policy.registry import (
    DEFAULT_POLICY,
    POLICIES,
    make_policy,
    register_policy,
    unregister_policy,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "JobInfo",
    "Policy",
    "PolicyNode",
    "SpeedupFn",
    "check_allocation",
    "evaluate_fitness",
    "fair_share",
    "fitness",
    "job_speedups",
    "make_policy",
    "reallocation_penalty",
    "register_policy",
    "unregister_policy",
]
