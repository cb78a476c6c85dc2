"""One construction of an elastic job's worker side, for every framework adapter.

The torch ``ElasticTrainer``, DeepSpeed's ``ElasticDeepSpeed`` and Horovod's
``HorovodControl`` each describe their job once, as a :class:`JobDescription`, and
:func:`build_controller` makes from it what drives the job's step boundaries, in this
order:

1. the tuner's limits (``TunerConfig``): the script's batch-size range narrowed by
   pollux-run's ``--min-batch-size``/``--max-batch-size`` (``tuning.tuner.batch_range``),
   checked when the description is made (a mistake is one line, before anything runs);
2. the ``GoodputTuner`` on the adapter's step profile, with the job's statistical
   progress, reading the gradient statistics of the controller's last decision;
3. the ``HintsReporter`` (rank 0's hints to the store): the rendezvous's store and job
   name, or (Horovod, which has no rendezvous) the ones pollux-run's environment names;
4. the adaptation policies: the script's, then ``pollux-run --policy-module``'s;
   neither: Pollux's ``GoodputPolicy``;
5. the ``ElasticController`` over the adapter's hooks, group and membership.

What pollux-run tells a worker through its environment (names: ``pollux_launch.env``) is
read once, into the description's :class:`WorkerEnv`; nothing below reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from pollux_launch import env as envvars
from pollux_launch.tuning.profile import StepProfile
from pollux_launch.tuning.progress import StatisticalProgress
from pollux_launch.tuning.sync_points import SyncPoints
from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig, batch_range

from .adaptation import AdaptationPolicy, resolve_policies
from .checkpoint import CheckpointWriter
from .controller import DECISION_BUDGET, DEFAULT_DECIDE_EVERY, ElasticController
from .hints import HintsReporter
from .protocols import Collectives, FrameworkHooks, Membership

__all__ = ["JobDescription", "WorkerEnv", "build_controller", "job_policies"]


@dataclass(frozen=True)
class WorkerEnv:
    """pollux-run's word to a worker through its environment, read once (``read``)."""

    environ: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """A snapshot of ``environ`` (default: this process's environment)."""
        return cls(MappingProxyType(dict(os.environ if environ is None else environ)))

    @property
    def policies(self) -> str | None:
        """``--policy-module``'s comma-separated policies (``POLLUX_POLICIES``)."""
        return self.environ.get(envvars.POLICIES)


def job_policies(given: Sequence[AdaptationPolicy] | None, env: WorkerEnv
                 ) -> list[AdaptationPolicy]:
    """The job's adaptation policies: ``given`` (the script's), then the command line's
    (``env``); neither: ``[GoodputPolicy()]``. Raises PolicyError (one line)."""
    return resolve_policies(given, env.policies)


@dataclass(frozen=True)
class JobDescription:
    """An elastic job as its adapter describes it: everything :func:`build_controller`
    needs that is not a live object of the adapter.

    Batch limits (``init_batch_size`` M0, ``max_batch_size``, ``min_batch_size``: the
    script's range, which the environment's flags narrow; ``local_bsz_bounds``: per-GPU
    micro-batch bounds; ``gradient_accumulation``); ``lr_scaling``: the LR rule (a name
    or a callable); ``report_interval``, ``min_gain``, ``decide_every`` (None: at least
    every ``DEFAULT_DECIDE_EVERY`` steps, spaced by the decisions' cost - see
    ``ElasticController``; a number: exactly that); ``adapt_lr``:
    False keeps the LR factor at 1; ``dataset_size``: samples in an epoch, for
    statistical epochs (None: unknown); ``policies``: the script's adaptation policies
    (None: the command line's, else Pollux's); ``identity``: whose hints these are, an
    object with ``name`` and ``store`` (the rendezvous's ``ElasticJob``, its store read
    at each report), or None for the job and store pollux-run's environment names;
    ``env``: the worker's environment, read once.

    Made, it has checked its batch range (:attr:`config`): raises ValueError (one line).
    """

    init_batch_size: int
    max_batch_size: int
    local_bsz_bounds: tuple[int, int]
    min_batch_size: int | None = None
    gradient_accumulation: bool = True
    lr_scaling: str | Callable[[float, Any], float] = "adascale"
    report_interval: float = 30.0
    min_gain: float = 0.05
    decide_every: int | None = None
    adapt_lr: bool = True
    dataset_size: int | None = None
    policies: Sequence[AdaptationPolicy] | None = None
    identity: Any = None
    env: WorkerEnv = field(default_factory=WorkerEnv.read)

    def __post_init__(self) -> None:
        self.config  # noqa: B018 - a bad range fails where the job is described

    @cached_property
    def config(self) -> TunerConfig:
        """The tuner's limits: the script's batch range narrowed by pollux-run's flags
        (the max never below M0; adaptive when the max is above M0)."""
        m0 = self.init_batch_size
        lo, hi = batch_range(m0, self.max_batch_size, self.min_batch_size, self.env.environ)
        return TunerConfig(
            init_batch_size=m0,
            max_batch_size=hi,
            min_batch_size=lo,
            local_bsz_bounds=self.local_bsz_bounds,
            gradient_accumulation=self.gradient_accumulation,
            adaptive_batch_size=hi > m0,
            lr_scaling=self.lr_scaling,
            report_interval=self.report_interval,
            min_gain=self.min_gain,
        )

    def hints_reporter(self) -> HintsReporter:
        """Rank 0's path for the hints: to ``identity``'s store, else the environment's."""
        who = self.identity
        if who is None:
            return HintsReporter.from_environ(self.env.environ)
        return HintsReporter(lambda: who.store, who.name)


def build_controller(
    job: JobDescription,
    hooks: FrameworkHooks,
    group: Collectives,
    profile: StepProfile,
    *,
    membership: Membership | None = None,
    loader: Any = None,
    checkpoints: CheckpointWriter | None = None,
    policies: Sequence[AdaptationPolicy] | None = None,
    sync_points: SyncPoints | None = None,
) -> ElasticController:
    """The controller of ``job``'s worker side (module docstring): its ``tuner``,
    ``reporter`` and ``policies`` built here, the tuner measuring ``profile``.

    ``membership``: how the group changes (None: it does not, or the framework re-forms
    it, as Horovod does); ``loader``: a pollux ``AdaptiveDataLoader`` or None;
    ``checkpoints``: the job's writer or None; ``policies``: the job's policies resolved
    already by :func:`job_policies` - for an adapter that must refuse a bad one before it
    can build (Horovod: at construction; it builds at its first sync); default: resolved
    here. Raises PolicyError for a policy that cannot be loaded.
    """
    config = job.config
    controller: ElasticController | None = None

    def grad_stats() -> Any:  # the statistics of the controller's last decision
        return controller.grad if controller is not None else None

    tuner = GoodputTuner(config, profile, grad_stats,
                         StatisticalProgress(config.init_batch_size, job.dataset_size))
    reporter = job.hints_reporter()
    chosen = job_policies(job.policies, job.env) if policies is None else list(policies)
    controller = ElasticController(
        hooks, tuner, group, membership=membership, reporter=reporter, loader=loader,
        decide_every=job.decide_every or DEFAULT_DECIDE_EVERY,
        decision_budget=DECISION_BUDGET if job.decide_every is None else None,
        adapt_lr=job.adapt_lr, checkpoints=checkpoints, sync_points=sync_points,
        policies=chosen)
    return controller
