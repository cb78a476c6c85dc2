"""``ElasticDeepSpeed``: a DeepSpeed job under pollux-run, goodput-adaptive and live-rescaled.

The counterpart of :class:`pollux_launch.adapters.torch.trainer.ElasticTrainer` for a
:class:`~.engine.PolluxEngine`. ``initialize`` creates it; the user's loop stays DeepSpeed's::

    engine, optimizer, loader, scheduler = initialize(model=model, optimizer=opt,
                                                      training_data=dataset, config=cfg)
    for epoch in engine.epochs(10):           # statistical epochs, resumes where the job is
        for x, y in loader:                   # pollux AdaptiveDataLoader
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()                     # optimizer step; at a boundary also the below

Step boundaries (after the optimizer step of ``engine.step()`` at an accumulation
boundary) are driven by the shared :class:`~pollux_launch.elastic.controller.
ElasticController`, as for the torch and Horovod adapters: rescale votes, rank 0's
decisions (micro batch ``m``, accumulation ``s``, LR factor, vote interval, a due
checkpoint), hints, failure recovery and durable state. What this module adds is
DeepSpeed's side (:class:`_DeepSpeedHooks`): a re-form captures the engine's consolidated
state on the old group, the rendezvous forms the new one (leavers exit 0), the engine is
rebuilt on it and the state restored (newcomers receive it); decisions go to the engine
(``set_batch_size``, ``set_lr_factor``); step times go to a
:class:`~pollux_launch.tuning.profile.StepProfile` keyed by ``(nodes, replicas, m, s)``;
gradient statistics come from the engine's :class:`~.gradients.DeepSpeedGradStats`.
Checkpoints hold the consolidated state, the same for every ZeRO stage and world size.

Survivors keep training while the newcomers of a grow start (import DeepSpeed, rehearse
a build): the rendezvous's grow wait, ``newcomer_wait`` seconds at most.

A collective that fails because a peer died is recovered at ZeRO-0 (every replica holds
the whole state: the survivors re-form and take rank 0's); at ZeRO-1/2 the dead replica's
optimizer partition is gone, so the worker fails with a one-line error (the job restarts
from its last checkpoint, if it has a checkpoint directory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from pollux_launch import env as envvars
from pollux_launch.elastic.factory import JobDescription, build_controller
from pollux_launch.elastic.failures import first_line, is_peer_failure
from pollux_launch.errors import PolluxError
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.profile import ProfileKey, StepProfile

from .config import NO_LR_SCALING
from .state import current_world_size

log = logging.getLogger(__name__)

KEEP_STATE_ENV = envvars.DEEPSPEED_KEEP_STATE


class PeerFailure(PolluxError, RuntimeError):
    """A peer died and this engine's state cannot be rebuilt without it."""


class ElasticDeepSpeed:
    """Drives one :class:`~.engine.PolluxEngine` through the job's rounds (module docstring).

    ``handle``: the engine handle (already built for the current round; a newcomer's has
    received the job's state); ``job``: the worker's ``ElasticJob``; ``loader``: the
    pollux ``AdaptiveDataLoader`` or None when the script feeds data itself (it must then
    read ``engine.train_micro_batch_size_per_gpu()``, ``global_rank`` and
    ``dp_world_size`` after every step); ``checkpoints``: a ``CheckpointWriter`` or None;
    ``policies``: adaptation policies (None: the command line's, else Pollux's).
    """

    def __init__(self, handle: Any, job: Any, loader: Any = None, *,
                 decide_every: int | None = None, min_gain: float = 0.05,
                 checkpoints: Any = None, policies: Any = None) -> None:
        from pollux_launch.adapters.torch.job import JobCollectives

        self.handle, self.job, self.loader = handle, job, loader
        cfg = handle.pollux
        description = JobDescription(  # (checks the batch range first)
            init_batch_size=cfg.initial_batch_size, max_batch_size=cfg.max_batch_size,
            min_batch_size=cfg.min_batch_size, local_bsz_bounds=cfg.micro_batch_size_range,
            gradient_accumulation=cfg.gradient_accumulation, lr_scaling=cfg.lr_scaling,
            report_interval=cfg.report_interval, min_gain=min_gain, decide_every=decide_every,
            adapt_lr=cfg.lr_scaling != NO_LR_SCALING,
            dataset_size=len(loader.dataset) if loader is not None else None,
            policies=policies, identity=job)
        self.config = description.config
        self.profile = StepProfile(warmup_steps=3)
        self.keep_state = description.env.environ.get(KEEP_STATE_ENV, "") not in ("", "0")
        self._t_last: float | None = None
        self.controller = build_controller(
            description, _DeepSpeedHooks(self), JobCollectives(job), self.profile,
            membership=job.membership(), loader=loader, checkpoints=checkpoints)
        self.tuner = self.controller.tuner
        # its group changes only through the controller: boundaries with nothing due
        # may be skipped (the controller's "Idle steps")
        self.controller.skip_idle = True
        self.progress = self.tuner.progress
        handle.driver = self
        restored = handle.restored_state
        if restored is not None and restored.get("client", {}).get("elastic"):
            self.controller.load_state_dict(restored["client"]["elastic"])  # a newcomer
        info = job.info
        # (the engine's build gave newcomers the survivors' state already)
        self.controller.start(fresh=info is None or info.fresh, sync=False)
        self._t_last = None

    @property
    def steps(self) -> int:
        return self.controller.steps

    @property
    def rescales(self) -> list[dict[str, Any]]:
        """Timings of rescales and failure recoveries (benchmarks, logs)."""
        return self.controller.rescales

    def epochs(self, total: float) -> Iterator[int]:
        return self.controller.epochs(total)

    def on_boundary(self) -> None:
        """After every optimizer step, on every replica (called by ``engine.step()``)."""
        now = time.perf_counter()
        if self._t_last is not None:
            self.profile.record(now - self._t_last)
        self._t_last = now
        if not self.keep_state:
            self.handle.restored_state = None
        self.controller.after_step(self.handle.engine.train_batch_size())  # (no forwarding)

    def recover(self, exc: RuntimeError) -> bool:
        """After a collective raised: True if it was a peer's failure and the job re-formed
        (the step in flight is lost); False if ``exc`` is not a distributed failure."""
        if not (self.controller.elastic and is_peer_failure(exc)):
            return False
        stage = self.handle.engine.zero_optimization_stage()
        if stage != 0:
            raise PeerFailure(
                f"a peer failed ({first_line(exc)}); its ZeRO-{stage} optimizer partition is "
                "lost: live recovery needs ZeRO stage 0 - the job restarts from its last "
                "checkpoint (pollux-run --checkpoint-dir)") from exc
        return self.controller.recover(exc)


class _DeepSpeedHooks:
    """What the controller needs done to a DeepSpeed engine (``FrameworkHooks``)."""

    def __init__(self, driver: ElasticDeepSpeed) -> None:
        self.d = driver
        self._detached = False

    @property
    def _handle(self) -> Any:
        return self.d.handle

    def batch(self) -> tuple[int, int]:
        micro, gas = self._handle.batch
        return micro, gas - 1

    def apply_batch(self, m: int, s: int) -> None:
        if (m, s + 1) != self._handle.batch:
            self._handle.set_batch_size(m, s + 1)
            self.d._t_last = None  # the next interval spans the change
        p = self.d.job.placement
        self.d.profile.set_key(ProfileKey(p.num_nodes, p.world_size, m, s))

    def set_lr_factor(self, factor: float) -> None:
        self._handle.set_lr_factor(factor)

    def grad_stats(self) -> GradNoise | None:
        return self._handle.grad_stats.stats()

    def capture(self, controller_state: dict[str, Any]) -> Any:
        state = self._handle.capture({"elastic": controller_state})  # collective at ZeRO-1/2
        self._handle._detach()
        self._detached = True
        return state

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool
                ) -> dict[str, Any] | None:
        handle, rank = self._handle, self.d.job.placement.rank
        if captured is None and not from_rank0:
            return None  # the start: the engine was built for this round already
        if not self._detached:
            handle._detach()
        micro, gas = handle.pollux.initial_micro_batch(current_world_size())
        source = captured if (not from_rank0 or rank == 0) else None
        if source is not None:  # the batch is decided for the new group right after
            source["client"].setdefault("pollux", {})["batch"] = [micro, gas]
        restored = handle._build(source, micro, gas)
        self._detached = False
        handle.restored_state = restored
        self.d._t_last = None
        if from_rank0 and rank != 0 and restored is not None:
            return restored["client"].get("elastic")
        return None

    def leave(self) -> None:
        # the engine was detached by capture(); the groups it held are gone
        self._handle._release_groups()

    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool
                         ) -> dict[str, Any] | None:
        handle = self._handle
        if not collective and handle.engine.zero_optimization_stage() != 0:
            return None  # the optimizer's partitions are spread over the peers
        return handle.capture({"elastic": controller_state})

    def checkpoint_needs_peers(self) -> bool:
        return self._handle.engine.zero_optimization_stage() != 0

    def restore_checkpoint(self, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        client = state.get("client")
        if not isinstance(client, dict) or not isinstance(client.get("elastic"), dict):
            raise ValueError("not a DeepSpeed elastic checkpoint (no client state)")
        return state, client["elastic"]
