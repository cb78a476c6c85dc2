"""The simulated cluster: replay a workload through a policy, round by round.

Timeline (as in the Pollux authors' simulator, so figures are comparable): every
``interval`` seconds all jobs advance, then the policy sees every submitted, unfinished
job and returns the next allocation matrix; a job whose allocation changed pays what the
``rescale_model`` charges (:mod:`pollux_launch.policy.rescale_cost`): ``checkpoint-restart``
is the paper's flat ``realloc_delay`` (30 s) of no progress, its first start included;
``live`` lets the old allocation train on while newcomers start, then stalls the job for
the calibrated pause (state broadcast); ``restart`` stops it for a torchrun-style restart
and a checkpoint reload. Each job's expected stall is also its delta in the policy's
re-allocation penalty. Between rounds a job advances epoch by epoch at its *true* goodput
``r / T_iter`` (M0-iterations per second, ``T_iter = step + s * (step - sync)``) read
from the trace tables, and re-picks its per-GPU batch size and accumulation steps at
every epoch boundary and at the end of every interval (as the authors' simulator does).

Fidelity to the authors' simulator (run beside this one on workloads 1 and 6, with
``checkpoint-restart``: avg JCT within 2.1 %, before the coordinator's age floor below
moved them by -2.5 % and -1.1 %). Matched: the Pollux agent's >= 2 micro-batches on one
GPU above M0 (``single_replica_accumulation``), the exploration cap from a job's first
round (``cap_unmodelled``), the batch re-picked every interval. Kept different, on
purpose: a job's age in the penalty is at least 1 s (the coordinator's floor; theirs
is 0 at arrival, so that a job arriving on a round's very second gains nothing from
being started in it, here ~1/31 of its speedup with a 30 s delta); the fair-share
normaliser packs a share above one node onto several nodes (theirs evaluates
it on one node, a placement that cannot exist); the power mean's epsilon is added to
the speedup itself (theirs to 0.25 x speedup: no measurable effect on workload 7);
epoch ends are not rounded to whole seconds (theirs are: noise, not bias); the default
engine is the exact DP, not their genetic algorithm (whose repair order therefore does
not apply).

Beyond the authors' simulator (all off by default, leaving results unchanged):
admission control in front of the policy (``SimConfig.admission``: Saxena et al.'s
queue / drop, :mod:`pollux_launch.policy.admission`), a horizon at which the run stops
(``SimConfig.horizon``; summaries count jobs completed by then, drops, queueing delay),
each job's batch-size range and GPU cap from the workload (:class:`SimJob`), every job's
batch fixed at its maximum (``SimConfig.fixed_max_batch``: the ``max-bs`` baseline), a
throughput model per job for throughput-maximising policies (``JobInfo.throughput_fn``),
profiling on arrival (:class:`ProfileConfig`), and cloud autoscaling
(``SimConfig.autoscale``, Pollux Sec. 4.2.2: the cluster starts at ``nodes`` and grows
and shrinks within MIN..MAX by the utility rule, nodes joining after ``boot_time``;
:mod:`pollux_launch.sim.autoscale`). Every run reports its cost in node-hours.

What a job *knows* is what a real Pollux agent would know: the (nodes, replicas,
per-GPU batch) configurations it has run and their measured step/sync times (refit
with ``fit_perf_params``, warm-started from its previous fit, before each round in
which it saw a new one and, as in the authors' simulator, before re-picking its batch
size at an epoch boundary after seeing a new one), and the
gradient statistics of its current batch size and epoch. Before its first step it has
no model: the policy sees the coordinator's prior, held to one GPU by the exploration cap
(2x the most replicas seen, which then lets it grow), as in the Pollux authors' simulator.

What the policy sees of a job is what the live coordinator would see of it: the
simulator writes each job's state as the store's messages (``JobSpec``, ``JobHints``,
``Allocation``, ``JobGeneration``) and :func:`pollux_launch.coordinator.jobs.job_info`
turns them into the job's ``JobInfo`` (exploration cap, limits, priors, the speedup and
throughput functions of its model, the re-allocation delay): there is one translation,
the coordinator's, and ``tests/sim/test_sim_matches_coordinator.py`` holds the two to it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from pollux_launch.coordinator import jobs as coordinator_jobs
from pollux_launch.coordinator.jobs import SpeedupFn
from pollux_launch.goodput import GoodputFunction, GradParams, GridCache, fit_perf_params
from pollux_launch.messages import Allocation, JobGeneration, JobHints, JobSpec
from pollux_launch.policy import JobInfo, Policy, PolicyNode
from pollux_launch.policy.admission import AdmissionConfig, Candidate, decide_admission
from pollux_launch.policy.autoscale import AutoscaleConfig
from pollux_launch.policy.rescale_cost import (
    DEFAULT_STATE_BYTES,
    RESCALE_MODELS,
    RescaleCost,
)
from pollux_launch.sim.autoscale import NodePool, SimAutoscaler
from pollux_launch.sim.traces import (
    PINNED_BATCH_SIZE,
    PINNED_MAX_REPLICAS,
    STATE_BYTES,
    ModelTrace,
)
from pollux_launch.sim.workload import TraceJob, WorkloadError

EPS = 1e-8  # tolerance of ceil() on batch-size ratios


PROFILE_LADDERS = ("doubling", "ends")


@dataclass(frozen=True)
class ProfileConfig:
    """Profile on arrival (as Saxena et al.'s job scalability analyser and Sia's
    bootstrapping do): before a new job competes it trains ``seconds`` (simulated, not
    counting rescale stalls) on each of a few GPU counts up to ``top`` = its own limit,
    at most ``max_replicas``: 1, 2, 4, ... then ``top`` (``ladder="doubling"``) or 1
    then ``top`` (``"ends"``). Meanwhile it tells the policy a linear speedup capped at
    the count being profiled, so that the policy gives it that count (a policy may give
    fewer on a full cluster: the job then profiles what it got). What it measures seeds
    its throughput model; afterwards it competes with that model and Pollux's
    exploration cap (2x the most GPUs it has run on). Its profiling steps are real
    training: they make progress, occupy the GPUs the policy gave it, and pay for each
    rescale as any change does."""

    seconds: float = 60.0
    max_replicas: int = 8
    ladder: str = "doubling"

    def __post_init__(self):
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"profile seconds must be > 0, got {self.seconds}")
        if isinstance(self.max_replicas, bool) or not int(self.max_replicas) >= 1:
            raise ValueError(f"profile max replicas must be >= 1, got {self.max_replicas}")
        if self.ladder not in PROFILE_LADDERS:
            raise ValueError(f"profile ladder must be one of {', '.join(PROFILE_LADDERS)}, "
                             f"got {self.ladder!r}")

    def counts(self, cap: int) -> list[int]:
        """GPU counts profiled by a job that may use ``cap`` (see the class doc)."""
        top = max(1, min(int(cap), int(self.max_replicas)))
        if self.ladder == "ends":
            return [1, top] if top > 1 else [1]
        out = [1 << i for i in range(top.bit_length()) if (1 << i) < top]
        return [*out, top]


@dataclass(frozen=True)
class SimConfig:
    """Cluster and timing of one simulation (defaults: the Pollux paper's setup)."""

    nodes: int = 16
    gpus_per_node: int = 4
    interval: float = 60.0  # seconds between scheduling rounds
    realloc_delay: float = 30.0  # checkpoint-restart: seconds of no progress per change
    rescale_model: str = "checkpoint-restart"  # what a change costs: RESCALE_MODELS
    cost: RescaleCost = field(default_factory=RescaleCost)  # calibrated live / restart
    interference: float = 0.0  # slowdown of distributed jobs sharing a node (0 = none)
    adaptive: bool = True  # False: TunedJobs, jobs keep their workload batch size
    # the simulated agent's batch rule: True, the Pollux agent's >= 2 micro-batches on one
    # GPU above M0; False, pollux-launch's agent, which needs none (GoodputFunction)
    single_replica_accumulation: bool = True
    # what the policy sees of a job without a model yet: True, Pollux's scheduler (the
    # exploration cap, one GPU, holds from the start); False, the live coordinator's
    # default (the job's prior decides its size): see coordinator.jobs.job_info
    cap_unmodelled: bool = True
    max_time: float = 60 * 86400.0  # give up (error) past this much simulated time
    # which arrived jobs compete (Saxena et al.'s autoscaler): none admits every job at
    # arrival (Pollux, today's behaviour); queue / drop as in policy.admission
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # stop at this simulated time (seconds); summaries count jobs completed by then
    horizon: float | None = None
    # max-bs: every adaptive job trains at its largest batch size (the range's top)
    fixed_max_batch: bool = False
    profile: ProfileConfig | None = None  # profile on arrival (None: Pollux's exploration)
    # cloud autoscaling (Pollux Sec. 4.2.2): the cluster starts at ``nodes`` and moves
    # within MIN..MAX (None: a fixed cluster of ``nodes``); see :mod:`.autoscale`
    autoscale: AutoscaleConfig | None = None
    boot_time: float = 90.0  # autoscale: seconds from requesting a node to its joining

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError("the cluster needs at least 1 node with at least 1 GPU")
        if self.autoscale is None and self.nodes < 1:
            raise ValueError("the cluster needs at least 1 node with at least 1 GPU")
        if self.autoscale is not None:
            if not isinstance(self.autoscale, AutoscaleConfig):
                raise ValueError(f"autoscale must be an AutoscaleConfig, got {self.autoscale!r}")
            lo, hi = self.autoscale.min_nodes, self.autoscale.max_nodes
            if not lo <= self.nodes <= hi:
                raise ValueError(f"an autoscaled cluster starts within --autoscale {lo}:{hi}; "
                                 f"got {self.nodes} starting nodes")
        if not (self.boot_time >= 0 and math.isfinite(self.boot_time)):
            raise ValueError(f"boot time must be >= 0 seconds, got {self.boot_time}")
        if not self.interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {self.interval}")
        if self.realloc_delay < 0:
            raise ValueError(f"realloc delay must be >= 0 seconds, got {self.realloc_delay}")
        if not 0.0 <= self.interference < 1.0:
            raise ValueError(f"interference must be in [0, 1), got {self.interference}")
        if self.rescale_model not in RESCALE_MODELS:
            raise ValueError(f"unknown rescale model {self.rescale_model!r}; choose one of "
                             f"{', '.join(RESCALE_MODELS)}")
        if not isinstance(self.admission, AdmissionConfig):
            raise ValueError(f"admission must be an AdmissionConfig, got {self.admission!r}")
        if self.horizon is not None and not (self.horizon > 0 and math.isfinite(self.horizon)):
            raise ValueError(f"horizon must be > 0 seconds, got {self.horizon}")

    @property
    def rescale_cost(self) -> RescaleCost:
        """The cost model with checkpoint-restart's flat cost set to ``realloc_delay``."""
        return dataclasses.replace(self.cost, checkpoint_restart_s=self.realloc_delay)

    def policy_delta(self) -> float:
        """Delta of the penalty for a job of unknown state (each job brings its own)."""
        return self.rescale_cost.expected_stall(self.rescale_model, DEFAULT_STATE_BYTES, 4)

    @property
    def pool_nodes(self) -> int:
        """Most nodes the cluster can ever hold (autoscale: MAX; else ``nodes``)."""
        return self.nodes if self.autoscale is None else self.autoscale.max_nodes

    @property
    def total_gpus(self) -> int:
        """GPUs of the largest cluster (job limits and admission use this)."""
        return self.pool_nodes * self.gpus_per_node


# The kind of elasticity (``messages.JobSpec.elasticity``) each rescale model simulates:
# a live job re-forms in place; checkpoint-restart and restart stop the whole job.
ELASTICITY = {"live": "live", "restart": "restart", "checkpoint-restart": "restart"}


def batch_range(job: TraceJob, trace: ModelTrace) -> tuple[int, int]:
    """The job's range of total batch sizes: its workload's, defaulting to the model's
    (M0 to its largest validated batch). ValueError (one line) when the range leaves what
    the traces measured: there are no gradient statistics outside it."""
    m0, top = trace.init_batch_size, trace.max_batch_size
    lo = m0 if job.min_batch_size is None else int(job.min_batch_size)
    hi = top if job.max_batch_size is None else int(job.max_batch_size)
    if not m0 <= lo <= hi <= top:
        raise WorkloadError(f"job {job.name}: batch-size range [{lo}, {hi}] must lie within "
                         f"[{m0}, {top}], the batch sizes the {trace.name} traces measured")
    return lo, hi


class SimJob:
    """One job: its true state in the simulated world and its agent's learned model.

    An adaptive job trains at the total batch size its agent finds best (goodput, Eqn 13)
    within its range ``[min_batch, max_batch]`` (workload columns ``min_batch_size`` /
    ``max_batch_size``, default the model's), on at most ``max_replicas`` GPUs (column
    ``max_replicas``); with ``SimConfig.fixed_max_batch`` (max-bs) it trains at
    ``max_batch`` whatever its GPUs. ncf keeps the authors' pinning (32768 on one GPU)
    unless its row sets a limit.

    The policy sees the job as the coordinator sees a live one: the simulator writes the
    job's state as the store's messages (:meth:`spec_message`, :meth:`hints_message`,
    :meth:`allocation_message`, :meth:`generation_message`) and the coordinator's
    :func:`~pollux_launch.coordinator.jobs.job_info` turns them into its ``JobInfo``.
    """

    def __init__(self, trace_job: TraceJob, trace: ModelTrace, cfg: SimConfig, index: int):
        self.trace_job, self.trace, self.cfg, self.index = trace_job, trace, cfg, index
        self.name = trace_job.name
        self.min_batch, self.max_batch = trace.init_batch_size, trace.max_batch_size
        self.user_cap: int | None = None  # the workload's max_replicas
        if cfg.adaptive:
            limited = any(v is not None for v in (trace_job.min_batch_size,
                                                  trace_job.max_batch_size,
                                                  trace_job.max_replicas))
            self.min_batch, self.max_batch = batch_range(trace_job, trace)
            pinned = None if limited else PINNED_BATCH_SIZE.get(trace.name)
            if pinned is None and (cfg.fixed_max_batch or trace.init_batch_size
                                   < self.min_batch == self.max_batch):
                pinned = self.max_batch  # (a one-batch range above M0: that batch)
            self.fixed_batch = pinned
            self.replica_cap = None if limited else PINNED_MAX_REPLICAS.get(trace.name)
            self.user_cap = trace_job.max_replicas
        else:
            self.fixed_batch = trace_job.batch_size
            self.replica_cap = trace_job.num_replicas
        # the range's lower end, for the goodput search (M0 is its lower end already)
        self._min_kw = ({"min_batch_size": self.min_batch}
                        if self.min_batch > trace.init_batch_size else {})
        # admission: GPUs the job needs to run (a TunedJobs job: its gang); the policy is
        # told it as min_replicas once admitted when admission control is on
        self.need = int(trace_job.num_replicas) if not cfg.adaptive else 1
        self.min_replicas = 0
        self.profile_plan: list[int] = []  # GPU counts still to profile (profile on arrival)
        self.profile_clock = 0.0  # seconds trained on the current one
        # true state
        self.alloc = np.zeros(cfg.pool_nodes, dtype=int)
        self.placement: tuple[int, ...] = ()
        self.atomic_bsz = 0
        self.accum_steps = 0
        self.rescale_left = 0.0  # seconds of stall left
        self.overlap_left = 0.0  # seconds the old configuration still trains (live grow)
        self._old: tuple[tuple[int, ...], int, int] | None = None  # that configuration
        self.state_bytes = STATE_BYTES.get(trace.name, DEFAULT_STATE_BYTES)
        self.progress = 0.0
        self.epoch = 0
        self.completion_time: float | None = None
        self.restarts: int | None = None  # None until first started
        self.attained_service = 0.0  # GPU-seconds
        # agent's knowledge
        self.profile: dict[tuple[int, int, int], tuple[float, float]] = {}
        self.max_seen_replicas = 0
        self.max_seen_nodes = 0
        self.perf_params = None
        self.grad_params = None
        self._stale = False
        # the coordinator's (speedup, throughput) functions of the last model reported,
        # and that model: built once per fit, as the coordinator memoises them per hints
        self._model_key: tuple | None = None
        self._models: tuple[SpeedupFn | None, SpeedupFn | None] = (None, None)
        self._grids: GridCache = {}  # candidate (m, s) grids: shared by all this job's fits

    # --- agent side ---------------------------------------------------------------------
    @property
    def bsz_bounds(self) -> tuple[int, int]:
        return self.trace.min_local_bsz, self.trace.max_local_bsz

    def observe(self, nodes: int, replicas: int, atomic: int, step: float, sync: float,
                sqr: float, var: float) -> None:
        """Record what the agent measured this step (a new configuration marks a refit)."""
        self.grad_params = GradParams(sqr, var)
        key = (nodes, replicas, atomic)
        if key not in self.profile:
            self.profile[key] = (step, sync)
            self.max_seen_replicas = max(self.max_seen_replicas, replicas)
            self.max_seen_nodes = max(self.max_seen_nodes, nodes)
            self._stale = True

    def refit(self) -> None:
        """Refit the throughput model to every configuration run so far (Pollux Sec. 4.1).

        Called once per scheduling round, before the job reports to the policy, as a real
        agent refits periodically rather than after every step.
        """
        if not self._stale:
            return
        self._stale = False
        keys = np.array(list(self.profile), dtype=int)
        vals = np.array(list(self.profile.values()), dtype=float)
        # Warm start from the previous fit: a few new observations move the optimum little.
        self.perf_params = fit_perf_params(
            keys[:, 0], keys[:, 1], keys[:, 2], np.zeros(len(keys), dtype=int),
            vals[:, 0], vals[:, 1], init=self.perf_params)
        self.choose_batch()  # a new model may prefer another (m, s) for the same GPUs

    def goodput_fn(self) -> GoodputFunction:
        """The agent's own goodput model, for its choice of (m, s)."""
        return GoodputFunction(self.perf_params, self.grad_params, self.trace.init_batch_size,
                               grid_cache=self._grids,
                               single_replica_accumulation=self.cfg.single_replica_accumulation)

    def limit(self) -> int:
        """Most GPUs the job can ever use: its cap, the traces, the cluster, its batch."""
        if self.replica_cap is not None:
            return int(self.replica_cap)
        return max(1, int(min(self.user_cap or self.cfg.total_gpus, self.trace.max_replicas,
                              self.cfg.total_gpus, self.max_batch // self.trace.min_local_bsz)))

    def start_profile(self, profile: ProfileConfig | None) -> None:
        """On arrival: plan the GPU counts to profile (adaptive jobs without a pinned
        count only)."""
        if profile is not None and self.cfg.adaptive and self.replica_cap is None:
            self.profile_plan = profile.counts(self.limit())
            self.profile_clock = 0.0

    # --- what the coordinator would read: the store's messages ---------------------------
    def spec_message(self) -> JobSpec:
        """The job as ``pollux-run`` would submit it: ``-np`` what it needs to run (1 GPU
        for an adaptive job, its gang for a TunedJobs one), ``--max-np`` its
        :meth:`limit`, ``--min-np`` what admission promised it, and the rescale model's
        kind of elasticity. A TunedJobs job, and a job that is profiling, reports no
        model (``reports_goodput`` False): the coordinator's prior for such a job grows
        linearly, as a perfectly scalable job's, up to its gang or the count profiled."""
        limit = self.limit()
        initial = min(self.need, limit)
        return JobSpec(
            name=self.name, command=("simulated", self.trace.name),
            initial_replicas=initial, min_replicas=min(max(1, self.min_replicas), initial),
            max_replicas=limit, submit_time=self.trace_job.submit_time,
            elasticity=ELASTICITY[self.cfg.rescale_model],
            reports_goodput=self.cfg.adaptive and not self.profile_plan)

    def rescale_s(self) -> float:
        """What one grow at the job's current size costs it (its stall): what its agents
        measure and report, a live job's in its hints, a restarting one's in its
        generation."""
        return self.cfg.rescale_cost.expected_stall(
            self.cfg.rescale_model, self.state_bytes, max(1, sum(self.placement)))

    def hints_message(self) -> JobHints:
        """What the job's agent reports: its batch limits, its fitted model (withheld
        while it profiles), the most replicas and nodes it has run on, a live job's
        rescale pause, and while it profiles a request for the count being profiled.

        A job whose batch is fixed (pinned, max-bs, TunedJobs) reports it as its initial
        batch with ``adaptive_batch_size`` off, as a live job of a fixed batch does; its
        gradient noise is normalised to that batch (Pollux Eqn 4-5)."""
        fixed, grad = self.fixed_batch, self.grad_params
        m0 = self.trace.init_batch_size if fixed is None else int(fixed)
        model = self.perf_params is not None and grad is not None and not self.profile_plan
        live = ELASTICITY[self.cfg.rescale_model] == "live"
        return JobHints(
            init_batch_size=m0, max_batch_size=max(self.max_batch, m0),
            local_bsz_bounds=self.bsz_bounds,
            min_batch_size=(self.min_batch if fixed is None and self.min_batch > m0
                            else None),
            gradient_accumulation=True, adaptive_batch_size=fixed is None,
            perf_params=self.perf_params.to_dict() if model else None,
            grad_sqr=float(grad.sqr) if model else None,
            grad_var=float(grad.var) * self.trace.init_batch_size / m0 if model else None,
            max_profiled_replicas=self.max_seen_replicas,
            max_profiled_nodes=self.max_seen_nodes,
            num_nodes=len(self.placement), num_replicas=sum(self.placement),
            local_bsz=self.atomic_bsz, accum_steps=self.accum_steps,
            progress=self.progress, rescale_s=self.rescale_s() if live else None,
            max_replicas_wanted=self.profile_plan[0] if self.profile_plan else None)

    def allocation_message(self) -> Allocation | None:
        """The job's allocation as the coordinator writes it (one node name per replica,
        a new version for every change: its restarts + 1); None before it first ran."""
        if self.restarts is None:
            return None
        nodes = tuple(f"node-{n}" for n, count in enumerate(self.alloc.tolist())
                      for _ in range(count))
        return Allocation(version=self.restarts + 1, nodes=nodes)

    def generation_message(self) -> JobGeneration | None:
        """A restarting job's measured cost of one restart (None for a live job)."""
        if ELASTICITY[self.cfg.rescale_model] != "restart":
            return None
        return JobGeneration(startup_s=self.rescale_s())

    def policy_view(self, now: float) -> JobInfo:
        """The policy's view of the job at ``now``: its messages through the coordinator's
        own translation, so that the simulator schedules a job exactly as the live
        coordinator would in the same state (exploration cap, limits, priors, delays)."""
        hints = self.hints_message()
        speedup_fn, throughput_fn = self._model_functions(hints)
        # (through the module: the one translation, whatever it is when this runs)
        return coordinator_jobs.job_info(
            self.spec_message(), hints, self.allocation_message(), now,
            speedup_fn=speedup_fn, generation=self.generation_message(),
            cost=self.cfg.rescale_cost, throughput_fn=throughput_fn,
            cap_unmodelled=self.cfg.cap_unmodelled)

    def _model_functions(self, hints: JobHints) -> tuple[SpeedupFn | None, SpeedupFn | None]:
        """The coordinator's speedup and throughput functions of the model in ``hints``,
        built once per fit (their memo tables are worth keeping across rounds)."""
        if hints.perf_params is None:
            return None, None
        key = (self.perf_params, self.grad_params)
        if key != self._model_key:
            self._model_key = key
            self._models = (
                coordinator_jobs.model_speedup(
                    hints, single_replica_accumulation=self.cfg.single_replica_accumulation),
                coordinator_jobs.model_throughput(hints))
        return self._models

    def speedup_fn(self) -> SpeedupFn:
        """The speedup function the policy sees now (see :meth:`policy_view`)."""
        return self.policy_view(self.trace_job.submit_time).speedup_fn

    def max_replicas(self) -> int:
        """Most GPUs the policy may give now (see :meth:`policy_view`)."""
        return self.policy_view(self.trace_job.submit_time).max_replicas

    def job_info(self, now: float) -> JobInfo:
        """One round's report to the policy: the next count to profile once this one is
        done, a refit if the job saw something new, then :meth:`policy_view`."""
        if self.profile_plan and self.profile_clock >= self.cfg.profile.seconds - EPS:
            self.profile_plan.pop(0)  # this count is profiled: on to the next
            self.profile_clock = 0.0
        if self.cfg.adaptive:  # TunedJobs never use a model: save the fit
            self.refit()
        return self.policy_view(now)

    def choose_batch(self) -> None:
        """Pick (per-GPU batch m, accumulation steps s) for the current placement."""
        if not self.placement:
            return
        tr = self.trace
        nodes, replicas = len(self.placement), sum(self.placement)
        batch = self.fixed_batch
        smallest = min(max(self.min_batch, tr.min_local_bsz * replicas), self.max_batch)
        if batch is None and self.perf_params is None:  # no model yet: smallest batch
            batch = smallest
        if batch is None:
            _, atomic, accum = self.goodput_fn().optimize(
                nodes, replicas, self.max_batch, self.bsz_bounds, accumulation=True,
                **self._min_kw)
            atomic, accum = int(atomic), int(accum)
            if atomic == 0:  # no (m, s) lands in the range exactly: its smallest batch
                batch = smallest
        if batch is not None:
            local = math.ceil(batch / replicas - EPS)
            accum = math.ceil(local / tr.max_local_bsz - EPS) - 1
            if (self.cfg.single_replica_accumulation and replicas == 1
                    and batch > tr.init_batch_size):
                accum = max(1, accum)  # the Pollux agent's >= 2 micro-batches for stats
            atomic = math.ceil(local / (accum + 1) - EPS)
        count = replicas * (accum + 1)
        self.atomic_bsz = max(1, min(atomic, self.max_batch // count))
        self.accum_steps = accum

    # --- true dynamics -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return sum(self.placement) * self.atomic_bsz * (self.accum_steps + 1)

    def reallocate(self, row: np.ndarray) -> None:
        """Take a new allocation row and what changing to it costs (the rescale model)."""
        old_row, old = self.alloc, (self.placement, self.atomic_bsz, self.accum_steps)
        if self.overlap_left > 0 and self._old is not None:
            old = self._old  # changed again while newcomers started: that config still runs
        self.alloc = row.copy()
        self.placement = tuple(int(c) for c in row if c > 0)
        self.overlap_left, self._old = 0.0, None
        if self.placement:
            overlap, stall = self.cfg.rescale_cost.transition(
                self.cfg.rescale_model, self.state_bytes, sum(old[0]), sum(self.placement),
                newcomers=bool(np.any(row > old_row)))
            if overlap > 0 and old[0]:
                self.overlap_left, self._old = overlap, old
            self.rescale_left = stall
            self.restarts = 0 if self.restarts is None else self.restarts + 1
            self.choose_batch()
        else:
            self.atomic_bsz = self.accum_steps = 0
            self.rescale_left = 0.0

    def advance(self, start: float, seconds: float, interference: float = 0.0) -> None:
        """Run for ``seconds`` from time ``start`` (epoch by epoch, at the true goodput):
        first on the old configuration while newcomers start, then the stall, then on
        the current one; (m, s) is re-picked at the end, as a Pollux agent does."""
        if not self.placement or self.completion_time is not None:
            return
        gpus = sum(self.placement)
        left = seconds
        if self.overlap_left > 0 and self._old is not None:
            dt = min(self.overlap_left, left)
            self.overlap_left -= dt
            if self._train(start + seconds - left, dt, interference, self._old):
                return
            left -= dt
        delay = min(self.rescale_left, left)
        self.rescale_left -= delay
        self.attained_service += delay * gpus
        left -= delay
        if self.profile_plan:
            self.profile_clock += left  # trained on the count being profiled
        if self._train(start + seconds - left, left, interference, None):
            return
        if self.fixed_batch is None and self.cfg.adaptive and self.perf_params is not None:
            self.choose_batch()

    def _train(self, start: float, seconds: float, interference: float,
               config: tuple[tuple[int, ...], int, int] | None) -> bool:
        """Train ``seconds`` on ``config`` (placement, m, s; None: the current one, whose
        (m, s) is re-picked at epoch ends). True when the job completed."""
        tr, left, gpus = self.trace, seconds, sum(self.placement)
        while left > 0:
            placement, atomic, accum = config or (self.placement, self.atomic_bsz,
                                                  self.accum_steps)
            step, sync = tr.step_time(placement, atomic)
            batch = sum(placement) * atomic * (accum + 1)
            sqr, var = tr.grad_stats(batch, self.epoch)
            scale = batch / tr.init_batch_size
            gain = (var + sqr) / (var / scale + sqr)
            self.observe(len(placement), sum(placement), atomic, step, sync, float(sqr),
                         float(var))
            goodput = gain / (step + accum * (step - sync)) * (1.0 - interference)
            target = tr.epoch_progress[self.epoch + 1]
            if self.progress + goodput * left < target:
                self.progress += goodput * left
                self.attained_service += left * gpus
                return False
            dt = (target - self.progress) / goodput
            self.progress = float(target)
            self.epoch += 1
            self.attained_service += dt * gpus
            left -= dt
            if self.epoch >= tr.max_epochs:
                self.completion_time = start + seconds - left
                return True
            if config is not None:
                continue  # the old group keeps its (m, s) until it re-forms
            # New epoch, new gradient statistics: re-pick (m, s), with a model refitted to
            # what this placement showed (the authors' simulator refits on every new
            # configuration, so its batch choice never lags behind its observations).
            if self._stale and self.fixed_batch is None and self.cfg.adaptive:
                self.refit()
            else:
                self.choose_batch()
        return False

    def true_efficiency(self) -> float:
        if not self.placement or self.completion_time is not None:
            return float("nan")
        return float(self.trace.efficiency(self.batch_size, self.epoch))


@dataclass
class SimResult:
    """Everything one simulation measured."""

    policy: str
    config: SimConfig
    submit: dict[str, float]
    completion: dict[str, float]
    application: dict[str, str]
    restarts: dict[str, int]
    max_gpus: dict[str, int] = field(default_factory=dict)  # most GPUs each job ever held
    admitted: dict[str, float] = field(default_factory=dict)  # name -> time it was admitted
    dropped: dict[str, float] = field(default_factory=dict)  # name -> time it was dropped
    drop_reasons: dict[str, str] = field(default_factory=dict)  # name -> one line
    times: list[float] = field(default_factory=list)  # one entry per scheduling round
    allocated_gpus: list[int] = field(default_factory=list)
    active_jobs: list[int] = field(default_factory=list)  # admitted, unfinished
    waiting_jobs: list[int] = field(default_factory=list)  # arrived, not admitted yet
    avg_efficiency: list[float] = field(default_factory=list)
    solve_ms: list[float] = field(default_factory=list)
    capacity_gpus: list[int] = field(default_factory=list)  # GPUs the policy could use
    # the cluster every round (autoscale: also idle rounds): time, nodes held (billed:
    # booting and draining included), ready (joined, not draining), target, active jobs
    cluster: dict[str, list] = field(default_factory=lambda: {
        k: [] for k in ("time", "held", "ready", "target", "active_jobs", "utility")})
    # every node held: (requested, joined, released or None); billed from requested
    leases: list[tuple[float, float, float | None]] = field(default_factory=list)
    autoscale_decisions: int = 0
    whatif_solves: int = 0  # policy solves of the autoscaler's what-ifs
    end_time: float = 0.0  # simulated time when the run ended
    wall_s: float = 0.0

    @property
    def node_hours(self) -> float:
        """Cost: nodes held (booting and draining included) integrated over [0, end]."""
        end = self.end_time
        return sum(max((end if to is None else min(to, end)) - start, 0.0)
                   for start, _, to in self.leases) / 3600.0

    def cost_summary(self) -> dict:
        """Node-hours, the mean and peak nodes held, and the autoscaler's settings."""
        a, cfg = self.config.autoscale, self.config
        held = self.cluster["held"]
        hours = self.end_time / 3600.0
        return {
            "node_hours": self.node_hours,
            "avg_nodes": self.node_hours / hours if hours > 0 else float(cfg.nodes),
            "peak_nodes": max([*held, cfg.nodes]),
            "autoscale": None if a is None else {
                "min_nodes": a.min_nodes, "max_nodes": a.max_nodes, "rule": a.rule,
                "utility_high": a.high, "utility_low": a.low, "interval": a.interval,
                "min_node_lifetime": a.min_lifetime, "boot_time": cfg.boot_time,
                "decisions": self.autoscale_decisions, "whatif_solves": self.whatif_solves},
        }

    def _utilization(self) -> np.ndarray:
        """Allocated / usable GPUs per round (usable: the joined nodes' GPUs, default the
        whole cluster's; 0 where none)."""
        used = np.array(self.allocated_gpus, dtype=float)
        cap = np.array(self.capacity_gpus, dtype=float)
        if cap.shape != used.shape:
            cap = np.full(used.shape, float(self.config.total_gpus))
        return np.divide(used, cap, out=np.zeros_like(used), where=cap > 0)

    @property
    def jcts(self) -> dict[str, float]:
        return {k: self.completion[k] - self.submit[k] for k in self.completion}

    def admission_summary(self, horizon: float | None = None) -> dict:
        """Counts up to ``horizon`` (default the config's; None: the whole run): jobs
        arrived, admitted, completed, dropped and still unfinished; drop ratio (dropped /
        arrived); mean queueing delay (admission - arrival) of admitted jobs; avg JCT of
        completed jobs (completion - arrival, queueing included)."""
        h = self.config.horizon if horizon is None else horizon

        def by(table: dict[str, float]) -> dict[str, float]:
            return {k: t for k, t in table.items() if h is None or t <= h}

        arrived, admitted, dropped = by(self.submit), by(self.admitted), by(self.dropped)
        done = by(self.completion)
        queued = [t - self.submit[k] for k, t in admitted.items()]
        jct = [t - self.submit[k] for k, t in done.items()]
        adm = self.config.admission
        return {
            "admission": adm.mode,
            "max_wait": adm.max_wait,
            "max_running": adm.max_running,
            "horizon": h,
            "arrived": len(arrived),
            "admitted": len(admitted),
            "completed": len(done),
            "dropped": len(dropped),
            "unfinished": len(arrived) - len(done) - len(dropped),
            "drop_ratio": len(dropped) / len(arrived) if arrived else 0.0,
            "avg_queue_delay": float(np.mean(queued)) if queued else 0.0,
            "avg_jct_completed": float(np.mean(jct)) if jct else None,
            "profile_on_arrival": self.config.profile is not None,
        }

    def summary(self, horizon: float | None = None) -> dict:
        """The run's figures; the admission ones (:meth:`admission_summary`) count up to
        ``horizon`` (default the config's)."""
        jct = np.array(list(self.jcts.values()), dtype=float)
        solve = np.array(self.solve_ms, dtype=float)
        util = self._utilization()
        some = jct.size > 0
        return {
            "policy": self.policy,
            "jobs": len(self.submit),
            "avg_jct": float(jct.mean()) if some else None,
            "p99_jct": float(np.percentile(jct, 99)) if some else None,
            "makespan": (float(max(self.completion.values()) - min(self.submit.values()))
                         if some else None),
            "rounds": len(self.solve_ms),
            "solve_ms_median": float(np.median(solve)) if solve.size else 0.0,
            "solve_ms_p95": float(np.percentile(solve, 95)) if solve.size else 0.0,
            "avg_gpu_utilization": float(util.mean()) if util.size else 0.0,
            "total_restarts": int(sum(self.restarts.values())),
            "nodes": self.config.nodes,
            "gpus_per_node": self.config.gpus_per_node,
            "interval": self.config.interval,
            "rescale_model": self.config.rescale_model,
            "realloc_delay": self.config.realloc_delay,
            **self.admission_summary(horizon),
            **self.cost_summary(),
            "sim_wall_s": round(self.wall_s, 3),
        }

    def to_json(self) -> dict:
        """Summary plus per-job JCTs and the per-round timeline (for summary.json)."""
        out = self.summary()
        out["jcts"] = self.jcts
        out["queue_delays"] = {k: t - self.submit[k] for k, t in self.admitted.items()}
        out["drops"] = {k: {"time": t, "reason": self.drop_reasons.get(k, "")}
                        for k, t in self.dropped.items()}
        out["timeline"] = {
            "time": self.times, "allocated_gpus": self.allocated_gpus,
            "gpu_utilization": self._utilization().tolist(),
            "active_jobs": self.active_jobs, "waiting_jobs": self.waiting_jobs,
            "avg_efficiency": [None if math.isnan(e) else e for e in self.avg_efficiency],
            "solve_ms": self.solve_ms, "capacity_gpus": self.capacity_gpus,
        }
        if self.config.autoscale is not None:
            out["cluster_timeline"] = self.cluster
            out["leases"] = self.leases
        return out




def _interfered(jobs: Sequence[SimJob], cfg: SimConfig) -> set[int]:
    """Indices of distributed jobs that share a node with another distributed job."""
    if cfg.interference <= 0:
        return set()
    dist = [j for j in jobs if len(j.placement) > 1 and j.completion_time is None]
    per_node = np.zeros(cfg.pool_nodes, dtype=int)
    for j in dist:
        per_node += j.alloc > 0
    return {j.index for j in dist if np.any(per_node[j.alloc > 0] > 1)}


def simulate(
    specs: Sequence[TraceJob],
    traces: dict[str, ModelTrace],
    policy: Policy,
    cfg: SimConfig = SimConfig(),
    *,
    policy_name: str | None = None,
    progress: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> SimResult:
    """Run ``specs`` on a ``cfg`` cluster scheduled by ``policy`` until every job is done
    or dropped, or until ``cfg.horizon``.

    Each round, the jobs that have arrived and are not admitted yet go through admission
    control (:func:`pollux_launch.policy.admission.decide_admission`, capacity: the
    cluster's GPUs; a job needs 1 GPU, a TunedJobs job its gang): the policy allocates to
    admitted jobs only, and a dropped job never runs. With ``admission`` on, an admitted
    job is the policy's ``min_replicas`` = what it needs (admission promised it that).
    """
    if not specs:
        raise WorkloadError("the workload has no jobs")
    if not cfg.adaptive:
        too_big = [s for s in specs if (s.num_replicas or 0) > cfg.total_gpus]
        missing = [s for s in specs if s.num_replicas is None or s.batch_size is None]
        if missing:
            raise WorkloadError("TunedJobs baselines need the workload's num_replicas and "
                             f"batch_size columns (job {missing[0].name} has none)")
        if too_big:
            raise WorkloadError(f"job {too_big[0].name} wants {too_big[0].num_replicas} GPUs but "
                             f"the cluster has {cfg.total_gpus}; use a larger --nodes")
    t_wall = clock()
    jobs = [SimJob(s, traces[s.application], cfg, i) for i, s in enumerate(specs)]
    pool = NodePool(cfg.pool_nodes, cfg.gpus_per_node, cfg.nodes, cfg.boot_time)
    scaler = None if cfg.autoscale is None else SimAutoscaler(cfg.autoscale, policy, pool)
    result = SimResult(policy=policy_name or getattr(policy, "name", type(policy).__name__),
                       config=cfg, submit={j.name: j.trace_job.submit_time for j in jobs},
                       completion={}, application={j.name: j.trace_job.application for j in jobs},
                       restarts={})
    pending = sorted(jobs, key=lambda j: (j.trace_job.submit_time, j.index))
    active: list[SimJob] = []
    waiting: list[SimJob] = []  # arrived, not admitted (yet)
    now, nxt = 0.0, 0
    bar = tqdm(total=len(jobs), desc=f"simulate {result.policy}", unit="job",
               file=sys.stderr, disable=not progress, mininterval=0.5, leave=False)
    try:
        while len(result.completion) + len(result.dropped) < len(jobs):
            if cfg.horizon is not None and now >= cfg.horizon:
                break
            if (not active and not waiting and nxt < len(pending)
                    and (scaler is None or scaler.settled(now))):
                # idle cluster: skip to the next arrival
                # Rounds stay on the k * interval grid (k >= 1), as in the authors' simulator.
                first = pending[nxt].trace_job.submit_time
                k = max(1, math.ceil(first / cfg.interval - EPS))
                now = max(now, k * cfg.interval)
            else:
                hit = _interfered(active, cfg)
                for job in active:
                    job.advance(now, cfg.interval, cfg.interference if job.index in hit else 0)
                now += cfg.interval
            if now > cfg.max_time:
                left = len(jobs) - len(result.completion) - len(result.dropped)
                raise RuntimeError(f"simulation passed {cfg.max_time:.0f} s with {left} jobs "
                                   "unfinished")
            done = [j for j in active if j.completion_time is not None]
            for job in done:
                result.completion[job.name] = job.completion_time
                result.restarts[job.name] = job.restarts or 0
            if done:
                bar.update(len(done))
                active = [j for j in active if j.completion_time is None]
            while nxt < len(pending) and pending[nxt].trace_job.submit_time <= now:
                waiting.append(pending[nxt])
                nxt += 1
            if waiting:
                waiting = _admit(waiting, active, cfg, now, result)
                if len(result.dropped) + len(result.completion) > bar.n:
                    bar.update(len(result.dropped) + len(result.completion) - bar.n)
            infos = [j.job_info(now) for j in active]
            current = (np.stack([j.alloc for j in active]) if active
                       else np.zeros((0, cfg.pool_nodes), dtype=int))
            if scaler is not None:
                scaler.step(now, infos, current, has_work=bool(active or waiting))
                _record_cluster(result, pool, scaler, now, len(active))
            if not active:
                continue
            slots, nodes = pool.policy_nodes(now)
            alloc = np.zeros_like(current)
            if nodes:
                t0 = clock()
                sub = np.asarray(policy.optimize(infos, nodes, current[:, slots]), dtype=int)
                result.solve_ms.append((clock() - t0) * 1e3)
                _check(sub, (len(active), len(nodes)), nodes, infos)
                alloc[:, slots] = sub
            for job, row in zip(active, alloc, strict=True):
                if not np.array_equal(row, job.alloc):
                    job.reallocate(row)
                    held = int(row.sum())
                    if held > result.max_gpus.get(job.name, 0):
                        result.max_gpus[job.name] = held
            eff = [j.true_efficiency() for j in active if j.placement]
            result.times.append(now)
            result.allocated_gpus.append(int(alloc.sum()))
            result.capacity_gpus.append(sum(n.slots for n in nodes))
            result.active_jobs.append(len(active))
            result.waiting_jobs.append(len(waiting))
            result.avg_efficiency.append(float(np.mean(eff)) if eff else float("nan"))
            bar.set_postfix_str(f"t={now / 3600:.1f}h active={len(active)}"
                                + (f" waiting={len(waiting)}" if waiting else "")
                                + (f" nodes={len(pool.held())}" if scaler else ""),
                                refresh=False)
    finally:
        bar.close()
    result.end_time = now
    result.leases = [(lease.requested, lease.ready, lease.released) for lease in pool.leases]
    if scaler is not None:
        result.autoscale_decisions, result.whatif_solves = (scaler.decisions,
                                                            scaler.whatif_solves)
    result.wall_s = clock() - t_wall
    return result


def _record_cluster(result: SimResult, pool: NodePool, scaler: SimAutoscaler, now: float,
                    active: int) -> None:
    """One row of the cluster timeline (autoscale)."""
    row = result.cluster
    row["time"].append(now)
    row["held"].append(len(pool.held()))
    row["ready"].append(sum(not lease.draining for lease in pool.visible(now)))
    row["target"].append(scaler.target)
    row["active_jobs"].append(active)
    row["utility"].append(None if math.isnan(scaler.utility) else scaler.utility)


def _admit(waiting: list[SimJob], active: list[SimJob], cfg: SimConfig, now: float,
           result: SimResult) -> list[SimJob]:
    """Admission control of one round: admitted jobs join ``active`` (in arrival order),
    dropped ones are recorded with their reason; returns the jobs still waiting."""
    adm = cfg.admission
    if not adm.enabled:  # Pollux: every arrived job competes at once
        admit, dropped, keep = waiting, {}, []
    else:
        decision = decide_admission(
            adm, [Candidate(j.name, j.trace_job.submit_time, j.need) for j in waiting],
            [Candidate(j.name, j.trace_job.submit_time, j.need) for j in active],
            cfg.total_gpus, now)
        names, dropped = set(decision.admit), dict(decision.drop)
        admit = [j for j in waiting if j.name in names]
        keep = [j for j in waiting if j.name not in names and j.name not in dropped]
    for job in admit:
        result.admitted[job.name] = now
        if adm.enabled:
            job.min_replicas = job.need
        job.start_profile(cfg.profile)
        active.append(job)
    for name, reason in dropped.items():
        result.dropped[name] = now
        result.drop_reasons[name] = reason
    return keep


def _check(alloc: np.ndarray, shape, nodes: Sequence[PolicyNode],
           infos: Sequence[JobInfo]) -> None:
    """The simulator trusts no policy: wrong shapes or over-full nodes are bugs."""
    if alloc.shape != tuple(shape):
        raise RuntimeError(f"policy returned shape {alloc.shape}, expected {tuple(shape)}")
    slots = np.array([n.slots for n in nodes], dtype=int)
    if np.any(alloc < 0) or np.any(alloc.sum(axis=0) > slots):
        raise RuntimeError("policy over-allocated a node or returned negative replicas")
    over = [i.name for i, row in zip(infos, alloc, strict=True) if row.sum() > i.max_replicas]
    if over:
        raise RuntimeError(f"policy gave job {over[0]} more than its max_replicas")
