"""From what the store says about a job to what the policy needs (a ``JobInfo``).

Pure: messages in, ``JobInfo`` out. A job that has not reported a fitted throughput
model yet gets a *prior* speedup that grows linearly up to the replicas it asked for
(``-np``) and is flat beyond, so the policy starts it where the user asked; once the
agent's hints carry a model, the speedup is Pollux's goodput ratio (Eqn 15 normalisation
is the policy's job) and the exploration cap bounds how far it may grow.

By kind of elasticity (``JobSpec.elasticity``):

* ``live``: a change costs the survivors' pause the job measured (its ``rescale_s``
  hint), before that the calibrated live pause
  (:class:`~pollux_launch.policy.rescale_cost.RescaleCost`) for a typical state, or the
  operator's ``--realloc-delay`` where set;
* ``restart``: a change costs its measured restart time (``JobGeneration.restart_s``),
  the calibrated torchrun-style restart before one was measured;
* ``fixed``: never resized or moved once running (not preemptible).

A job whose script does not use the pollux API (``JobSpec.reports_goodput`` False: a
torchrun-style script, a plain Horovod Elastic one) never reports a model, so its prior
(1 at ``-np``, as every job's) grows linearly on up to its ``--max-np``: it takes what is
free, as torchrun's elastic agent and horovodrun's host discovery do, and competes for
more as a perfectly scalable job would.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..goodput import GoodputFunction, GradParams, PerfParams, SpeedupFunction, exploration_cap
from ..goodput.capacity import ThroughputFunction
from ..messages import Allocation, JobGeneration, JobHints, JobSpec
from ..policy import JobInfo
from ..policy.rescale_cost import DEFAULT_STATE_BYTES, RescaleCost

SpeedupFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

# Youngest age the penalty sees: it is 0 at age 0 (Pollux's, continuous), and the
# launcher's clock (submit_time) may run ahead of this host's: a skew must not make a new
# job's first start worthless while GPUs are free.
MIN_AGE_S = 1.0


def prior_speedup(initial_replicas: int, up_to: int | None = None) -> SpeedupFn:
    """min(K, up_to)/initial (``up_to``: ``initial``): 1 at the replicas the user asked
    for, as for every job without a model; worth growing to ``up_to``, no further."""
    initial = max(1, initial_replicas)
    cap = initial if up_to is None else max(initial, up_to)

    def speedup(num_nodes: np.ndarray, num_replicas: np.ndarray) -> np.ndarray:
        return np.minimum(np.asarray(num_replicas, dtype=float), cap) / initial

    return speedup


def model_speedup(hints: JobHints, *, single_replica_accumulation: bool = False
                  ) -> SpeedupFn | None:
    """The goodput-based speedup function of a job's hints, or None without a model.
    ``single_replica_accumulation``: the job's agent takes >= 2 micro-batches on one
    replica above M0 (the Pollux agent, which the simulator can simulate; pollux-launch's
    agent does not: see ``GoodputFunction``)."""
    if not hints.perf_params or hints.grad_sqr is None or hints.grad_var is None:
        return None
    goodput_fn = GoodputFunction(
        PerfParams(**hints.perf_params),
        GradParams(sqr=hints.grad_sqr, var=hints.grad_var),
        hints.init_batch_size,
        single_replica_accumulation=single_replica_accumulation,
    )
    return SpeedupFunction(
        goodput_fn,
        max_batch_size=hints.max_batch_size,
        local_bsz_bounds=hints.local_bsz_bounds,
        accumulation=hints.gradient_accumulation,
        fixed_batch_size=None if hints.adaptive_batch_size else hints.init_batch_size,
        min_batch_size=hints.min_batch_size,
    )


def wanted_range(spec: JobSpec, hints: JobHints | None, max_replicas: int) -> tuple[int, int]:
    """The job's replica range for the policy: the spec's ``[min, max]`` (``max_replicas``:
    after the exploration cap) narrowed by its adaptation policies' request, which the
    spec's limits bound (a request may lift the exploration cap: the job asked)."""
    lo, hi = spec.min_replicas, max(spec.min_replicas, max_replicas)
    if hints is None:
        return lo, hi
    if hints.min_replicas_wanted is not None:
        lo = min(max(lo, hints.min_replicas_wanted), spec.max_replicas)
        hi = max(hi, lo)
    if hints.max_replicas_wanted is not None:
        hi = max(lo, min(hi, hints.max_replicas_wanted))
    return lo, hi


def model_throughput(hints: JobHints) -> ThroughputFunction | None:
    """The job's samples/s at its best batch in its range (system throughput, no
    statistical efficiency: what saxena-dp maximises), or None without a model."""
    if not hints.perf_params:
        return None
    return ThroughputFunction(
        PerfParams(**hints.perf_params),
        min_batch_size=hints.min_batch_size or hints.init_batch_size,
        max_batch_size=hints.max_batch_size,
        local_bsz_bounds=hints.local_bsz_bounds,
        accumulation=hints.gradient_accumulation,
        fixed_batch_size=None if hints.adaptive_batch_size else hints.init_batch_size,
    )


def job_info(
    spec: JobSpec,
    hints: JobHints | None,
    allocation: Allocation | None,
    now: float,
    speedup_fn: SpeedupFn | None = None,
    generation: JobGeneration | None = None,
    cost: RescaleCost | None = None,
    live_delay: float | None = None,
    throughput_fn: SpeedupFn | None = None,
    cap_unmodelled: bool = False,
) -> JobInfo:
    """The policy's view of one job. ``speedup_fn`` is the caller's memoised
    ``model_speedup(hints)`` (fitting and memo tables are worth keeping across rounds);
    ``generation``: a restart-elastic job's measured restart cost; ``cost``: the
    calibrated rescale costs (None: the built-in ones); ``live_delay``: the operator's
    fixed delta for live jobs (``--realloc-delay``), overriding the calibration;
    ``throughput_fn``: the caller's memoised ``model_throughput(hints)``;
    ``cap_unmodelled``: hold a job that reports goodput but has no model yet to the
    exploration cap too (Pollux's scheduler: ``-np``, at least one GPU, until it has run
    on more), instead of leaving its size to its prior (the simulator's default)."""
    max_replicas = spec.max_replicas
    delay = None
    state = DEFAULT_STATE_BYTES  # (the job's own is unknown: its measured pause is better)
    replicas = max(1, allocation.num_replicas if allocation else spec.initial_replicas)
    if spec.elasticity == "restart":
        measured = generation.restart_s if generation is not None else None
        delay = (measured if measured is not None
                 else (cost or RescaleCost()).expected_stall("restart", state, replicas))
    elif spec.elasticity == "live":
        measured = hints.rescale_s if hints is not None else None
        if live_delay is not None:
            delay = live_delay
        elif measured is not None:
            delay = measured
        else:
            delay = (cost or RescaleCost()).expected_stall("live", state, replicas)
    explore = speedup_fn is not None and hints is not None  # a model came with hints
    if speedup_fn is None:
        speedup_fn = prior_speedup(spec.initial_replicas,
                                   None if spec.reports_goodput else spec.max_replicas)
        explore = cap_unmodelled and spec.reports_goodput
    if explore:
        profiled = hints.max_profiled_replicas if hints is not None else 0
        cap = max(exploration_cap(profiled), spec.initial_replicas)
        max_replicas = min(max_replicas, cap)
    lo, hi = wanted_range(spec, hints, max_replicas)
    running = allocation is not None and allocation.num_replicas > 0
    return JobInfo(
        name=spec.name,
        speedup_fn=speedup_fn,
        age=max(MIN_AGE_S, now - spec.submit_time),
        # every version after the first moved a running job: a re-allocation (R_j)
        restarts=max(0, allocation.version - 1) if allocation else 0,
        min_replicas=lo,
        max_replicas=hi,
        preemptible=(spec.preemptible and spec.elasticity != "fixed") or not running,
        realloc_delay=delay,
        throughput_fn=throughput_fn,
    )
