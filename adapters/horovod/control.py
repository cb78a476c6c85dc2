"""The goodput tuner (the paper's PolluxAgent) in a Horovod Elastic job: decisions, LR, hints.

:class:`HorovodControl` sits on the measuring ``DistributedOptimizer`` (``optimizer.
pollux_control``; the measurement is ``optimizer.pollux``). The step-boundary protocol -
rank 0's decision of ``(m, s)`` (Pollux Eqn 13), the LR factor and the vote interval,
broadcast to every rank; hints reported when due; a forced decision for every new group
- is the shared :class:`~pollux_launch.elastic.controller.ElasticController`, the same as
for the torch and DeepSpeed adapters. Horovod re-forms its groups itself
(``hvd.elastic.run``), so the controller gets no membership, and this module only
connects it to Horovod:

* **after every reset that adds workers** (and at the start): in the ``TorchState``
  sync, which Horovod runs on *all* ranks then - survivors and newcomers alike. Rank 0's
  measurement and controller state are broadcast as JSON bytes (no pickle), then the
  controller enters the new group (a forced decision). (A reset callback runs on
  survivors only, before that sync, so it cannot hold a collective: newcomers would not
  join it.)
* **after a reset that only removed workers**: Horovod 0.28 skips the sync then
  (``HostsUpdatedInterrupt.skip_sync``), but every rank is a survivor and the controller
  sees ``hvd.size()`` differ from the size it last decided for at the next step
  boundary, so all of them decide there;
* **every optimiser step**: ``after_step`` (the step counter is part of the synced
  state, so all ranks reach the same steps).

A decision is applied by every rank: ``set_backward_passes_per_step(s + 1)`` on the
optimizer, ``m (s+1)`` as the batch of the given ``data_loader`` (Horovod's "allreduce
batch", which the training loop splits into ``optimizer.backward_passes_per_step``
micro-batches; the loader's next batch has it, mid-epoch too), and the LR factor around
each ``optimizer.step()`` - applied and undone, so the user's LR (and scheduler) never
sees it. Without a ``data_loader`` the batch shape is the user's and only the LR factor
applies.

Adaptation policies (``policies=``, then ``pollux-run --policy-module``'s; default:
Pollux's goodput policy) run on every rank at the controller's boundaries: after every
step, for every new group, and where the script calls :meth:`HorovodControl.before_epoch`
/ :meth:`HorovodControl.after_epoch`; their collectives are Horovod's. A policy's
``stop()`` sets :attr:`HorovodControl.stopped` on every rank at the same step: the
script's loop ends on it.

Hints go to ``jobs/<POLLUX_JOB>/hints`` in the store named by ``POLLUX_STORE`` (set by
``pollux-run``); without it nothing is reported and decisions still apply.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler

from pollux_launch import env as envvars
from pollux_launch.elastic.adaptation import AdaptationPolicy
from pollux_launch.elastic.controller import ElasticController
from pollux_launch.elastic.factory import JobDescription, WorkerEnv, build_controller, job_policies
from pollux_launch.tuning.gns import GNSEstimator, GradNoise
from pollux_launch.tuning.sync_points import SyncPoints
from pollux_launch.tuning.tuner import GoodputTuner, default_lr_rule

from .measure import HorovodMeasurement

log = logging.getLogger(__name__)

CONTROL_STATE_VERSION = 1


def broadcast_json(hvd: Any, obj: Any, root_rank: int, name: str) -> Any:
    """``obj`` from ``root_rank`` on every rank: JSON bytes through ``hvd.broadcast``."""
    payload = json.dumps(obj).encode() if hvd.rank() == root_rank else b""
    n = hvd.broadcast(torch.tensor([len(payload)], dtype=torch.int64), root_rank,
                      name=f"{name}.len")
    buf = torch.zeros(int(n[0]), dtype=torch.uint8)
    if hvd.rank() == root_rank:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    buf = hvd.broadcast(buf, root_rank, name=name)
    return obj if hvd.rank() == root_rank else json.loads(bytes(buf.numpy()).decode())


class HorovodControl:
    """Rank 0 decides, every rank applies (see the module docstring).

    ``local_bsz`` / ``accum_steps``: the starting per-rank micro-batch and accumulation
    steps (``backward_passes_per_step - 1``); ``init_batch_size``: the job's ``M0``
    (default: the starting batch at the first sync, ``K m (s+1)``); ``max_batch_size``:
    how large the total batch may grow (default ``M0``: fixed batch, only its shape
    adapts); ``min_batch_size``: the lower end of the job's batch-size range (default
    none); ``local_bsz_bounds``: per-rank micro-batch bounds (default ``(m, m)`` without a
    ``data_loader``, else ``(max(1, m // 2), 4 m)``).
    """

    def __init__(
        self,
        hvd: Any,
        optimizer: Any,
        measurement: HorovodMeasurement,
        *,
        local_bsz: int,
        accum_steps: int = 0,
        data_loader: Any | None = None,
        init_batch_size: int | None = None,
        max_batch_size: int | None = None,
        local_bsz_bounds: tuple[int, int] | None = None,
        gradient_accumulation: bool | None = None,
        min_batch_size: int | None = None,
        lr_scaling: str | Callable[[float, Any], float] = "auto",
        report_interval: float = 30.0,
        decide_every: int | None = None,
        min_gain: float = 0.05,
        dataset_size: int | None = None,
        on_decision: Callable[[int, int, float], None] | None = None,
        policies: Sequence[AdaptationPolicy] | None = None,
    ) -> None:
        if not isinstance(local_bsz, int) or local_bsz < 1:
            raise ValueError(f"local_bsz must be a positive integer, got {local_bsz!r}")
        if decide_every is not None and decide_every < 1:
            raise ValueError(f"decide_every must be >= 1, got {decide_every}")
        if data_loader is not None and getattr(data_loader, "batch_sampler", None) is None:
            raise ValueError("data_loader: need a torch DataLoader built with batch_size=... "
                             "(its batch sampler's batch size is what Pollux adapts)")
        adaptive_shape = data_loader is not None
        if data_loader is not None:
            _follow_batch_size(data_loader.batch_sampler)
        self.hvd, self.optimizer, self.measurement = hvd, optimizer, measurement
        self.data_loader = data_loader
        self.local_bsz, self.accum_steps = local_bsz, accum_steps
        self._init_batch_size = init_batch_size
        self._max_batch_size = max_batch_size
        self._min_batch_size = min_batch_size
        self.local_bsz_bounds = local_bsz_bounds or (
            (max(1, local_bsz // 2), 4 * local_bsz) if adaptive_shape else (local_bsz, local_bsz))
        self.gradient_accumulation = (adaptive_shape if gradient_accumulation is None
                                      else gradient_accumulation and adaptive_shape)
        self.lr_scaling = default_lr_rule(optimizer) if lr_scaling == "auto" else lr_scaling
        self.report_interval, self.decide_every, self.min_gain = (
            report_interval, decide_every, min_gain)
        if dataset_size is None and data_loader is not None:
            try:
                dataset_size = len(data_loader.dataset)
            except TypeError:
                dataset_size = None
        self.dataset_size = dataset_size
        self.on_decision = on_decision
        self._env = WorkerEnv.read()  # pollux-run's word (policies, batch range, store)
        self.policies = job_policies(policies, self._env)  # a bad one fails here, not later
        self.tuner: GoodputTuner | None = None  # built at the first sync (needs M0)
        self.controller: ElasticController | None = None
        # where values are read: the measurement's points (one count per optimizer)
        self.sync_points: SyncPoints = getattr(measurement, "sync_points", None) or SyncPoints()
        self.lr_factor = 1.0
        self._resumed: dict[str, Any] | None = None  # a checkpoint's, for the next sync

    # -- what the optimizer calls ----------------------------------------------------------
    def sync(self) -> None:
        """All ranks, after every reset and at the start: take rank 0's state, decide (a
        scheduled point: it reads values)."""
        with self.sync_points.scheduled("sync"):
            self._sync()

    def _sync(self) -> None:
        hvd, m = self.hvd, self.measurement
        if hvd.rank() == 0 and self.controller is None:
            self._build(self._init_batch_size or hvd.size() * self.local_bsz
                        * (self.accum_steps + 1))
        if hvd.rank() == 0 and self._resumed is not None:
            resumed, self._resumed = self._resumed, None
            assert self.controller is not None
            m.load_state_dict(resumed["measure"])
            self.controller.load_state_dict(resumed["control"])
            self.local_bsz, self.accum_steps = (int(v) for v in resumed["batch"])
        mine = None
        if hvd.rank() == 0:
            assert self.controller is not None and self.tuner is not None
            mine = {"v": CONTROL_STATE_VERSION, "m0": self.tuner.config.init_batch_size,
                    "measure": m.state_dict(), "control": self.controller.state_dict(),
                    "batch": [self.local_bsz, self.accum_steps]}
        state = broadcast_json(hvd, mine, 0, "pollux.control.state")
        if hvd.rank() != 0:
            if not isinstance(state, dict) or state.get("v") != CONTROL_STATE_VERSION:
                raise ValueError("pollux control state: unexpected format from rank 0")
            if self.controller is None:
                self._build(int(state["m0"]))
            assert self.controller is not None
            m.load_state_dict(state["measure"])
            self.controller.load_state_dict(state["control"])
            self.local_bsz, self.accum_steps = (int(v) for v in state["batch"])
        m.abort_step()
        self.controller.enter_round()

    def durable_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the control (``state.TorchState``): statistics,
        progress, steps and the batch shape."""
        assert self.controller is not None
        return {"control": self.controller.state_dict(),
                "measure": self.measurement.state_dict(),
                "batch": [self.local_bsz, self.accum_steps]}

    def resume_from(self, state: dict[str, Any]) -> None:
        """Rank 0, before the job's first sync: take a checkpoint's ``durable_state``
        (applied, then broadcast, by that sync)."""
        if not isinstance(state, dict) or not {"control", "measure", "batch"} <= set(state):
            raise ValueError("not a pollux Horovod control state")
        self._resumed = state

    def after_step(self) -> None:
        """All ranks, after every optimiser step."""
        if self.controller is not None:
            self.controller.after_step(self.batch_size)

    def before_epoch(self, epoch: int) -> None:
        """All ranks, before each epoch: the adaptation policies' ``before_epoch`` and a
        decision. (Without ``hvd.elastic`` the control starts here under pollux-run, as at
        the first ``step()``: the first epoch's hooks are not lost.) After a reset
        ``hvd.elastic.run`` calls the training function again on every rank, so a loop
        that calls this at its top runs it again for the epoch in progress - on every
        rank alike, newcomers included, as the policies' collectives need."""
        self.start_unsynced()
        if self.controller is not None:
            self.controller.before_epoch(epoch)

    def after_epoch(self, epoch: int) -> None:
        """All ranks, after each epoch: the policies' ``after_epoch`` and a decision."""
        self.start_unsynced()
        if self.controller is not None:
            self.controller.after_epoch(epoch)

    def start_unsynced(self) -> None:
        """No ``TorchState`` sync started the control (a script without ``hvd.elastic``):
        under pollux-run every rank starts it at its first call here or in ``step()``."""
        if self.tuner is None and self._env.environ.get(envvars.JOB):
            self.sync()

    @property
    def stopped(self) -> bool:
        """An adaptation policy ended training: the script's loop should end."""
        return self.controller is not None and self.controller.stopped

    @property
    def steps(self) -> int:
        return self.controller.steps if self.controller is not None else 0

    @property
    def resets(self) -> int:
        return self.controller.resets if self.controller is not None else 0

    @property
    def batch_size(self) -> int:
        return self.hvd.size() * self.local_bsz * (self.accum_steps + 1)

    def _build(self, m0: int) -> None:
        description = JobDescription(  # (hints: to the store pollux-run's environment names)
            init_batch_size=m0, max_batch_size=max(self._max_batch_size or m0, m0),
            min_batch_size=self._min_batch_size, local_bsz_bounds=tuple(self.local_bsz_bounds),
            gradient_accumulation=self.gradient_accumulation, lr_scaling=self.lr_scaling,
            report_interval=self.report_interval, min_gain=self.min_gain,
            decide_every=self.decide_every, dataset_size=self.dataset_size, env=self._env)
        m = self.measurement
        if m.estimator is None or m.estimator.init_batch_size != m0:
            m.estimator = GNSEstimator(m0, m.smoothing)
        self.controller = build_controller(
            description, _HorovodHooks(self), _HorovodGroup(self.hvd), m.profile,
            policies=self.policies, sync_points=self.sync_points)  # (one count: syncs' too)
        m.scheduled = True  # the measurement reads its rows, refreshes 1/P at decisions only
        self.tuner = self.controller.tuner

    def _grad(self) -> GradNoise | None:
        return self.controller.grad if self.controller is not None else None

    def status(self) -> dict[str, Any]:
        """What the tuner sees now (for logs)."""
        grad = self._grad()
        return {"step": self.steps, "replicas": self.hvd.size(), "batch_size": self.batch_size,
                "local_bsz": self.local_bsz, "accum_steps": self.accum_steps,
                "lr_factor": self.lr_factor, "resets": self.resets,
                "noise_scale": None if grad is None else grad.noise_scale,
                "efficiency": None if grad is None or math.isnan(grad.noise_scale)
                else float(grad.efficiency(self.batch_size))}


class _FollowingBatchSampler(BatchSampler):
    """torch's ``BatchSampler`` that reads ``batch_size`` for every batch. torch's own
    reads it once per epoch with ``drop_last=True`` (its iterator zips that many
    references to the sampler's), so a decision taken inside an epoch would reach the
    loop only at the next one, while ``backward_passes_per_step``, the LR factor and the
    statistics follow it at once."""

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.sampler)
        while True:
            batch = list(itertools.islice(it, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield batch


def _follow_batch_size(batch_sampler: Any) -> None:
    """Make the user's loader take a new ``batch_size`` at its next batch (a plain torch
    ``BatchSampler``, the one ``DataLoader(batch_size=...)`` builds; the object stays the
    same). With ``num_workers > 0`` the batches already prefetched keep their size."""
    if type(batch_sampler) is BatchSampler:
        batch_sampler.__class__ = _FollowingBatchSampler


class _HorovodGroup:
    """Horovod's current ranks as the controller sees them (``Collectives``)."""

    def __init__(self, hvd: Any) -> None:
        self.hvd = hvd

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def world_size(self) -> int:
        return self.hvd.size()

    @property
    def num_nodes(self) -> int:
        return max(1, min(self.hvd.cross_size(), self.hvd.size()))

    def broadcast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.broadcast(tensor, 0, name=name)

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        hvd = self.hvd
        ops = {"sum": hvd.Sum, "mean": hvd.Average, "max": hvd.Max, "min": hvd.Min}
        return hvd.allreduce(tensor, op=ops[op], name=name)

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allgather(tensor.reshape(1, -1), name=name)


class _HorovodHooks:
    """What the controller needs done in a Horovod job (``FrameworkHooks``). Horovod
    re-forms groups and moves the model's state itself (``hvd.elastic``), so the
    re-forming hooks are never called: the controller has no membership here."""

    def __init__(self, control: HorovodControl) -> None:
        self.c = control

    def batch(self) -> tuple[int, int]:
        return self.c.local_bsz, self.c.accum_steps

    def apply_batch(self, m: int, s: int) -> None:
        c = self.c
        c.local_bsz, c.accum_steps = m, s
        if c.data_loader is not None:
            c.data_loader.batch_sampler.batch_size = m * (s + 1)
        if c.optimizer.backward_passes_per_step != s + 1:
            c.optimizer.set_backward_passes_per_step(s + 1)
        if (m, s) != (c.measurement.local_bsz, c.measurement.accum_steps):
            c.measurement.set_batch(m, s)  # re-keys the step profile at the next step
        if c.on_decision is not None:
            c.on_decision(m, s, c.lr_factor)
        log.info("rank %d: batch %d = %d x %d x %d, lr x%.3f", c.hvd.rank(), c.batch_size,
                 c.hvd.size(), m, s + 1, c.lr_factor)

    def set_lr_factor(self, factor: float) -> None:
        self.c.lr_factor = factor  # the optimizer's step() applies it

    def grad_stats(self) -> GradNoise | None:
        return self.c.measurement.stats()

    def capture(self, controller_state: dict[str, Any]) -> None:
        raise NotImplementedError("Horovod re-forms its groups itself")

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool
                ) -> None:
        raise NotImplementedError("Horovod re-forms its groups itself")

    def leave(self) -> None:
        pass

    # Durable state is written where Horovod commits it, by ``state.TorchState`` (which
    # holds the model and the script's values); the controller gets no writer here.
    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool) -> None:
        return None

    def checkpoint_needs_peers(self) -> bool:
        return False  # (its durable state is pollux's TorchState's, written on commit)

    def restore_checkpoint(self, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        raise ValueError("a Horovod job resumes through pollux's TorchState")
