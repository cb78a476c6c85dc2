"""``ElasticTrainer``: DDP, the GoodputTuner's measurements and decisions, and live rescaling.

What a training script writes::

    import pollux_launch.adapters.torch as pollux

    job = pollux.init()                                   # joins the job's rendezvous
    loader = pollux.AdaptiveDataLoader(train_set, batch_size=64, max_batch_size=512,
                                       local_bsz_bounds=(16, 128))
    trainer = pollux.ElasticTrainer(model, optimizer, loader, lr_scheduler=scheduler)
    for epoch in trainer.epochs(30):                      # statistical epochs
        for x, y in loader:
            loss = loss_fn(trainer.model(x), y)
            trainer.step(loss)                            # backward + (accumulate | step)
        evaluate(trainer.module)

Step boundaries (after every optimiser step) are driven by the shared
:class:`~pollux_launch.elastic.controller.ElasticController` - the same protocol as the
DeepSpeed and Horovod adapters: votes on re-forming, rank 0's decisions ((m, s), the LR
factor, the vote interval, a due checkpoint) broadcast to every replica, hints, failure
recovery and durable state. This module is what is specific to plain PyTorch: the DDP
wrapper (rebuilt for every new group), the optimiser step with the LR factor applied
around ``optimizer.step()`` and undone right after (the user's scheduler never sees it),
and the training state (model, optimizer, scheduler, scaler, gradient monitor, extras)
that newcomers receive by broadcast and checkpoints keep.

The step is a hot path (issue 31): ``step()`` costs a few tens of microseconds of host
work beyond the user's backward and optimiser step, and never makes the host wait for
the device - the measurement hooks run per parameter only on the steps the gradient
monitor samples, and every read of a device value (the monitor's rows, the decision)
happens at the controller's scheduled points (``pollux_launch.tuning.sync_points``).

Adaptation policies (``policies=[...]``, or ``pollux-run --policy-module``; default:
Pollux's goodput policy) run at these boundaries: see :mod:`pollux_launch.elastic.adaptation`.
``trainer.stopped`` tells that one ended training.

A collective that fails because a peer died is caught - in backward, in DDP's forward or
at a boundary: the survivors move to a failure round, take rank 0's state and go on; only
the step in flight is lost.

Durable state (``checkpoint_dir``, by default ``pollux-run --checkpoint-dir``): rank 0
writes the state every ``checkpoint_interval`` seconds in the background
(``pollux_launch.elastic.checkpoint``); a job whose workers all died resumes from the
newest checkpoint at whatever size it is given, and SIGTERM (a drained node, a batch
system's preemption) makes rank 0 write a final one at its next step boundary before the
worker ends by that signal, as it would have without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from pollux_launch.elastic.adaptation import AdaptationPolicy
from pollux_launch.elastic.controller import checkpoint_writer
from pollux_launch.elastic.factory import JobDescription, build_controller
from pollux_launch.elastic.failures import StateLost, first_line, is_peer_failure
from pollux_launch.rendezvous.process_group import (
    broadcast_state,
    release_at_exit,
    round_connections,
    share_state,
    vote_any,
)
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.hooks import attach_measurement
from pollux_launch.tuning.tuner import default_lr_rule

from .data import AdaptiveDataLoader
from .fsdp import (
    FSDPResharder,
    ShardingError,
    is_sharded,
    load_sharded,
    reset_iteration,
    save_sharded,
    shard_model,
)
from .job import ElasticJob, JobCollectives, init

log = logging.getLogger(__name__)


class ElasticTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: AdaptiveDataLoader,
        *,
        job: ElasticJob | None = None,
        lr_scheduler: Any | None = None,
        grad_scaler: Any | None = None,
        lr_scaling: str | Any = "auto",
        max_grad_norm: float | None = None,
        report_interval: float = 30.0,
        decide_every: int | None = None,
        min_gain: float = 0.05,
        ddp_kwargs: dict[str, Any] | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_interval: float | None = None,
        policies: Sequence[AdaptationPolicy] | None = None,
        sharding: str | None = None,
    ) -> None:
        self.job = job or init()
        model = _sharded(model, optimizer, sharding, self.job)
        self._resharder = FSDPResharder(model, optimizer) if is_sharded(model) else None
        # FSDP's forward all-gathers: a peer dying there re-forms the job (as in DDP's)
        self._guarded = (_Guarded(model, self._forward_failed, self._sharded_forward_failed)
                         if self._resharder is not None and self.job.elastic else None)
        self.module, self.optimizer, self.loader = model, optimizer, loader
        self.lr_scheduler, self.grad_scaler = lr_scheduler, grad_scaler
        self.max_grad_norm = max_grad_norm
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._extra: dict[str, Any] = {}
        self._ddp: DistributedDataParallel | None = None
        self._discard = False  # the forward of this micro-batch met a peer's failure
        self._failed: RuntimeError | None = None  # a sharded forward's, recovered in step()
        description = JobDescription(  # (checks the batch range first)
            init_batch_size=loader.init_batch_size, max_batch_size=loader.max_batch_size,
            min_batch_size=loader.min_batch_size, local_bsz_bounds=loader.local_bsz_bounds,
            gradient_accumulation=loader.gradient_accumulation,
            lr_scaling=default_lr_rule(optimizer) if lr_scaling == "auto" else lr_scaling,
            report_interval=report_interval, min_gain=min_gain, decide_every=decide_every,
            dataset_size=len(loader.dataset), policies=policies, identity=self.job)
        p = self.job.placement
        # a sharded model's parameters are not in the autograd graph (FSDP computes with
        # unsharded copies): no per-parameter hooks fire; its steps are timed here
        self.hooks = attach_measurement(model, optimizer, description.init_batch_size,
                                        grad_scaler=grad_scaler, num_nodes=p.num_nodes,
                                        num_replicas=p.world_size, local_bsz=loader.local_bsz,
                                        sharded=self.sharded, driven=True,
                                        preconditioner="identity" if self.sharded else "auto")
        self._comm = (self._resharder.instrument(self.hooks.monitor)
                      if self._resharder is not None else None)
        hooks = _TorchHooks(self) if self._resharder is None else _ShardedHooks(self)
        self.controller = build_controller(
            description, hooks, JobCollectives(self.job), self.hooks.profile,
            membership=self.job.membership(), loader=loader,
            checkpoints=checkpoint_writer(checkpoint_dir, checkpoint_interval))
        self.tuner = self.controller.tuner
        # its group changes only through the controller: boundaries with nothing due
        # may be skipped (the controller's "Idle steps")
        self.controller.skip_idle = True
        # (a policy that acts on every step reads each step's times: all measured)
        self.hooks.skip_idle = self.controller.idle_safe
        loader.on_step_boundary = self._on_boundary
        release_at_exit(self._release_group)
        info = self.job.info
        self.controller.start(fresh=info is None or info.fresh,
                              sync=self.job.elastic and info is not None
                              and info.needs_state_sync)

    # -- what the user touches ---------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """The model is sharded (FSDP2): re-sharded in place when the group changes."""
        return self._resharder is not None

    @property
    def model(self) -> torch.nn.Module:
        """The module to call in the training loop (DDP-wrapped when distributed; a
        sharded one guarded against a peer's failure in its collectives). Re-read it
        every step: a rescale replaces the wrapper."""
        if self._ddp is not None:
            return self._ddp
        return self._guarded if self._guarded is not None else self.module

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    @property
    def steps(self) -> int:
        """Optimiser steps of the job so far (resumed ones included)."""
        return self.controller.steps

    @property
    def stopped(self) -> bool:
        """An adaptation policy ended training (``epochs()`` and the loader stop too)."""
        return self.controller.stopped

    @property
    def checkpoints(self) -> Any:
        return self.controller.checkpoints

    @property
    def resumed_from(self) -> float | None:
        """The progress of the checkpoint this job resumed from, if it did."""
        return self.controller.resumed_from

    def register_state(self, name: str, obj: Any) -> None:
        """Extra state to keep identical across replicas (``state_dict``/``load_state_dict``)."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(f"register_state({name!r}): the object needs state_dict() and "
                             "load_state_dict()")
        self._extra[name] = obj

    def epochs(self, total: float) -> Iterator[int]:
        """Data epochs until ``total`` statistical epochs are done (scale-invariant: the
        same training whatever batch sizes were used); resumes where the job stands."""
        return self.controller.epochs(total)

    def save_checkpoint(self, wait: bool = True) -> None:
        """Write a checkpoint now (call on every rank at the same point; rank 0 writes).
        Needs a checkpoint directory."""
        if self.controller.checkpoints is None:
            raise ValueError("save_checkpoint: no checkpoint directory (pass checkpoint_dir= "
                             "or pollux-run --checkpoint-dir)")
        self.controller.save_checkpoint(wait=wait)

    def step(self, loss: torch.Tensor) -> bool:
        """Backward for this micro-batch; on the last micro-batch of an optimiser step also
        the (LR-scaled) optimiser step. True when the optimiser stepped."""
        if self._discard:  # its forward failed; the job re-formed: this step is dropped
            self._discard = False
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self._failed is not None:  # a sharded forward failed: re-form here (_Guarded)
            exc, self._failed = self._failed, None
            return self._dropped(exc)
        loader = self.loader
        sync = loader.is_sync_step
        if loader.accum_steps:  # average, not sum, over the micro-batches of a step
            loss = loss / (loader.accum_steps + 1)
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        try:
            if sync:
                loss.backward()
            else:
                with self.hooks.accumulate(), (self._ddp.no_sync() if self._ddp is not None
                                               else contextlib.nullcontext()):
                    loss.backward()
            # (its collectives too: the monitor's all-reduce of local norms, waited here,
            # and a sharded model's gradient clipping; nothing is stepped before them)
            self.hooks.micro_step_done(sync, None if self._comm is None
                                       else self._comm.take() if sync else 0.0)
            if sync:
                self._optimizer_step()
        except RuntimeError as exc:
            return self._dropped(exc)
        return sync

    def _dropped(self, exc: RuntimeError) -> bool:
        """A collective of this step failed: if a peer's failure, the job re-forms and the
        step is dropped (False); anything else is raised."""
        self.optimizer.zero_grad(set_to_none=True)
        if not self.controller.recover(exc):
            raise exc
        return False

    def status(self) -> dict[str, Any]:
        """What the tuner sees now (for logs): replicas, batch shape, LR, efficiency..."""
        grad = self.controller.grad
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        factor = self.controller.lr_factor
        out = {
            "step": self.steps, "replicas": self.job.placement.world_size,
            "nodes": self.job.placement.num_nodes, "batch_size": self.loader.batch_size,
            "local_bsz": self.loader.local_bsz, "accum_steps": self.loader.accum_steps,
            "lr": lrs[0] * factor, "lr_factor": factor,
            "efficiency": None, "goodput": None,
            "epochs": self.tuner.progress.epochs(),
        }
        if grad is not None:
            out["efficiency"] = float(grad.efficiency(self.loader.batch_size))
        fn = self.tuner.goodput_function()
        if fn is not None:
            import numpy as np

            p = self.job.placement
            out["goodput"] = float(fn.evaluate(
                np.array([p.num_nodes]), np.array([p.world_size]),
                np.array([self.loader.local_bsz]), np.array([self.loader.accum_steps]))[0])
        return out

    @property
    def last_lr_factor(self) -> float:
        return self.controller.lr_factor

    def describe(self) -> str:
        s = self.status()
        eff = "-" if s["efficiency"] is None else f"{s['efficiency']:.2f}"
        good = "-" if s["goodput"] is None else f"{s['goodput']:.0f}/s"
        return (f"step {s['step']} | replicas {s['replicas']} | batch {s['batch_size']} = "
                f"{s['replicas']}x{s['local_bsz']}x{s['accum_steps'] + 1} | "
                f"lr {s['lr']:.4g} (x{s['lr_factor']:.2f}) | efficiency {eff} | goodput {good}")

    # -- the optimiser step ------------------------------------------------------------
    def _optimizer_step(self) -> None:
        """Clip, step with the LR factor applied (undone right after: the user's
        scheduler never sees it), zero the gradients, count the step. No host-device
        synchronisation: the scaler unscales only for clipping (a fused optimizer
        unscales inside its own kernel otherwise) and nothing reads a tensor."""
        opt, scaler, factor = self.optimizer, self.grad_scaler, self.controller.lr_factor
        if self.max_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        base = [g["lr"] for g in opt.param_groups] if factor != 1.0 else None
        if base is not None:
            for group, lr in zip(opt.param_groups, base, strict=True):
                group["lr"] = lr * factor
        try:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        finally:
            if base is not None:
                for group, lr in zip(opt.param_groups, base, strict=True):
                    group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        self.controller.count_step(self.loader.batch_size)

    def _on_boundary(self) -> None:
        """Called by the loader after every optimiser step, before its next batch."""
        self.controller.boundary()

    def _release_group(self) -> None:
        """Drop the DDP wrapper, whose reducer holds the process group: a group destroyed
        while something still holds it keeps its gloo threads (``process_group``'s "Leaving
        at exit"). When this worker leaves its job, and at exit - after the sharded
        checkpoint write in flight, which uses the groups."""
        if isinstance(self.controller.hooks, _ShardedHooks):
            self.controller.hooks._settle()
        self._ddp = None

    def _forward_failed(self, exc: RuntimeError, inputs: tuple, kwargs: dict) -> Any:
        """DDP's forward runs collectives of its own (the bucket rebuild after the first
        step, buffer broadcasts), FSDP's its all-gathers: a peer dying there re-forms the
        job like any failure, and the caller gets the local module's output, whose step
        ``step()`` drops (a sharded model's only before its first forward succeeded:
        :meth:`_sharded_forward_failed` after)."""
        if not self.controller.recover(exc):
            raise exc
        self._discard = True
        return self.module(*inputs, **kwargs)

    def _sharded_forward_failed(self, exc: RuntimeError, stand_in: Any) -> Any:
        """FSDP's forward met a failure: the caller gets ``stand_in`` (zeros shaped like
        the output), and ``step()`` re-forms the job. A forward run again here would
        all-gather on the new group, out of step with a newcomer's first forward (or a
        survivor that failed in its backward), so nothing of it runs on the new group."""
        if not is_peer_failure(exc):
            raise exc
        self._failed = exc
        return stand_in

    # -- state -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """The training state outside the controller's own (which travels beside it); a
        sharded model's: no model, the optimizer's without its sharded tensors."""
        rs = self._resharder
        self.hooks.end_idle()  # (the monitor's schedule past the idle steps first)
        state: dict[str, Any] = {
            "model": self.module.state_dict() if rs is None else {},
            "optimizer": (self.optimizer.state_dict() if rs is None
                          else rs.light_optimizer_state()),
            "monitor": self.hooks.monitor.state_dict(),
            "extra": {k: v.state_dict() for k, v in self._extra.items()},
        }
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        """Load ``state`` (a survivor's share of a grow has no model or optimizer)."""
        if state.get("model"):
            self.module.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.hooks.end_idle()
        self.hooks.monitor.load_state_dict(state["monitor"])
        for name, obj in self._extra.items():
            obj.load_state_dict(state["extra"][name])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


class _TorchHooks:
    """What the controller needs done in plain PyTorch (``FrameworkHooks``)."""

    def __init__(self, trainer: ElasticTrainer) -> None:
        self.t = trainer

    def batch(self) -> tuple[int, int]:
        return self.t.loader.local_bsz, self.t.loader.accum_steps

    def apply_batch(self, m: int, s: int) -> None:
        t, p = self.t, self.t.job.placement
        t.loader.set_batch_size(m, s)
        t.hooks.configure(num_nodes=p.num_nodes, num_replicas=p.world_size, local_bsz=m,
                          accum_steps=s, loss_averaged_over_accum=True,
                          process_group=None)  # the default group at call time: held by none

    def set_lr_factor(self, factor: float) -> None:
        pass  # _optimizer_step reads the controller's factor

    def grad_stats(self) -> GradNoise | None:
        """At a decision (a scheduled point, every rank at the same step)."""
        self.t.hooks.sync_point()
        return self.t.hooks.monitor.stats()

    def capture(self, controller_state: dict[str, Any]) -> None:
        return None  # the state stays in the module and optimizer; DDP is rebuilt

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool
                ) -> dict[str, Any] | None:
        t, p = self.t, self.t.job.placement
        t._ddp = None
        if p.world_size > 1:
            # elastic rounds sync state themselves (below); a static group syncs like DDP does
            t._ddp = _ElasticDDP(t.module, t._forward_failed, init_sync=not t.job.elastic,
                                 **t._ddp_kwargs)
        info = t.job.info
        newcomers = info is not None and info.needs_state_sync
        if p.world_size == 1 or not (from_rank0 or (t.job.elastic and newcomers)):
            return None
        holders = info.holders if info is not None and t.job.elastic else []
        if holders and info.newcomers and info.reason != "failure":
            # a grow: newcomers need the state; survivors keep theirs unless one of them
            # may be a step apart (it re-formed after a failure) - all ranks agree
            apart = from_rank0 and p.rank in holders
            if not vote_any(apart, t.job.rdzv.group):
                return self._share(controller_state, holders)
        mine = {"fw": t._state(), "ctl": controller_state}
        # rank 0's state everywhere; a rank without state of its own receives into its
        # tensors, a survivor apart from them (whole, should this broadcast fail too)
        got = broadcast_state(mine, into=None if p.rank in holders else mine)
        if p.rank == 0:
            return None
        t._restore(_steps_on_cpu(got["fw"], t.optimizer))
        return got["ctl"]

    def _share(self, controller_state: dict[str, Any], holders: list[int]
               ) -> dict[str, Any] | None:
        """A grow: the model and optimizer state, alike on every surviving DDP replica,
        goes to the newcomers only, point to point from the survivors at once
        (``share_state``); the rest, small, from rank 0 to every rank as before."""
        t, rank = self.t, self.t.job.placement.rank
        light = t._state()
        heavy = {k: light.pop(k) for k in ("model", "optimizer")}
        mine = {"fw": light, "ctl": controller_state}
        got = broadcast_state(mine, into=mine)
        heavy = share_state(heavy, holders, into=heavy)
        if rank == 0:
            return None
        fw = got["fw"] if rank in holders else {**got["fw"], **heavy}
        t._restore(_steps_on_cpu(fw, t.optimizer))
        return got["ctl"]

    def leave(self) -> None:
        self.t.hooks.remove()
        self.t._release_group()

    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool
                         ) -> dict[str, Any]:
        return {"fw": self.t._state(), "ctl": controller_state}

    def checkpoint_needs_peers(self) -> bool:
        return False

    def restore_checkpoint(self, state: dict[str, Any]) -> tuple[None, dict[str, Any]]:
        self.t._restore(state["fw"])
        return None, state["ctl"]


class _ShardedHooks(_TorchHooks):
    """``_TorchHooks`` for an FSDP2 model: no DDP wrapper; on a change of group its
    shards are re-sharded in place (``fsdp.FSDPResharder``) - survivors receive what
    they lack on the old group (``hand_off``), newcomers theirs on the new one, and only
    the small rest of the state (optimizer step counts and hyper-parameters, scheduler,
    monitor, the controller's) goes from rank 0 to the newcomers.

    Durable checkpoints: every rank writes its shards (``torch.distributed.checkpoint``,
    in the background, over a gloo group of their own) and rank 0 the rest; a job resumes
    from one at any size, DCP re-sharding on load; at SIGTERM the ranks write the final
    one together (``checkpoint_needs_peers``). A rank lost to a failure takes its shard
    with it: the others go back to the newest checkpoint in place (without one the job
    fails, saying so in one line)."""

    def __init__(self, trainer: ElasticTrainer) -> None:
        super().__init__(trainer)
        self._handed: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._lost = False
        self._saving: Any = None  # the ranks' shard write in flight (its future)
        self._ckpt_group: Any = None  # that write's own process group (this round's)

    # -- the old group ---------------------------------------------------------------
    def _settle(self) -> None:
        """Wait for the shard write in flight: it uses this round's groups."""
        saving, self._saving = self._saving, None
        if saving is None:
            return
        try:
            saving.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is one
            log.warning("a checkpoint's shards were not written (%s)", first_line(exc))

    def capture(self, controller_state: dict[str, Any]) -> Any:
        self._settle()
        return None

    def hand_off(self, old: tuple[str, ...], new: tuple[str, ...], me: str) -> None:
        rs = self.t._resharder
        assert rs is not None
        try:
            rs.hand_off(old, new, me)
        except RuntimeError as exc:  # a peer died mid-way: the new group finds out
            log.warning("re-sharding on the old group failed (%s)", first_line(exc))
            self._lost = True
        self._handed = (old, new)

    def leave(self) -> None:
        self._settle()
        super().leave()

    # -- the new group ---------------------------------------------------------------
    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool
                ) -> dict[str, Any] | None:
        t, p = self.t, self.t.job.placement
        info = t.job.info
        rs = t._resharder
        assert rs is not None
        handed, self._handed = self._handed, None
        self._ckpt_group = None  # (went with the old group)
        if info is None or not t.job.elastic or info.fresh:
            # the job's start, a restart or a static group: the model as the script
            # built it, or the checkpoint rank 0 resumed from
            if from_rank0 and self._any(captured is not None):
                return self._load(captured)
            return None
        mine = self._lost or (handed is None and t.job.worker not in info.newcomers)
        try:
            lost = self._any(mine)
        except Exception as exc:
            # a peer of the new group (a newcomer stopped before it joined) died in the
            # vote: a rank that lost a shard knows the answer without it, and this
            # group cannot load a checkpoint either
            if not (mine and is_peer_failure(exc)):
                raise
            raise self._lost_shard(resumable=True) from None
        self._lost = False
        if lost:
            raise StateLost(self._lost_shard(resumable=False), self._reload)
        newcomer = t.job.worker in info.newcomers
        mine = None
        if p.rank == 0:
            mine = {"fw": t._state(), "ctl": controller_state, "old": list(handed[0]),
                    "layout": rs.state_layout()}
        got = broadcast_state(mine) if info.newcomers else mine
        old = tuple(got["old"]) if newcomer else handed[0]
        if newcomer:
            t._restore(got["fw"])
        rs.finish(old, tuple(info.members), t.job.worker, t.job.device_mesh(),
                  got["layout"] if newcomer else None)
        return got["ctl"] if newcomer else None

    def _any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is on any (the controller's collectives: the
        round's control group, or a static job's default group)."""
        if self.t.job.placement.world_size == 1:
            return flag
        vote = torch.tensor([float(flag)], dtype=torch.float64)
        return bool(self.t.controller.group.allreduce(vote, "max", "pollux.vote")[0])

    def _lost_shard(self, resumable: bool) -> ShardingError:
        """A failure took a rank and its shard, which no peer holds, and the job cannot
        go on from a checkpoint in place (``resumable``: one may exist, this group could
        not load it): what to do instead, in one line."""
        ckpts = self.t.controller.checkpoints
        if ckpts is None:
            resume = ("pollux-run --checkpoint-dir DIR keeps durable sharded checkpoints "
                      "that such a job goes on from")
        elif resumable:
            resume = (f"launch it again with --checkpoint-dir {ckpts.directory} to resume "
                      "from its newest sharded checkpoint")
        else:
            resume = (f"{ckpts.directory} holds no checkpoint to go on from yet "
                      "(--checkpoint-interval sets how often one is written)")
        return ShardingError("a worker of this sharded job failed: its shard of the model is "
                             f"lost and cannot be rebuilt from its peers; {resume}")

    def _reload(self, captured: dict[str, Any] | None) -> dict[str, Any] | None:
        """After ``StateLost``: every rank of the new group loads the checkpoint the
        controller found (a survivor first re-points its model at the new mesh)."""
        t = self.t
        info = t.job.info
        assert info is not None and t._resharder is not None
        if t.job.worker not in info.newcomers:  # (the failure cut its FSDP step short)
            reset_iteration(t.module)
            t._resharder.blank(tuple(info.members), t.job.worker, t.job.device_mesh())
        return self._load(captured)

    def _load(self, captured: dict[str, Any] | None) -> dict[str, Any] | None:
        """Every rank: the checkpoint rank 0 ``captured`` (``restore_checkpoint``): its
        shards (DCP re-shards them for this group) and the rest from rank 0. Returns its
        controller state elsewhere than on rank 0 (which loaded it already)."""
        t, p = self.t, self.t.job.placement
        got = captured if p.rank == 0 else None
        if p.world_size > 1:
            got = broadcast_state(got)
        assert got is not None
        load_sharded(t.module, t.optimizer, got["shards"])
        t._restore(got["fw"])
        return got["ctl"] if p.rank != 0 else None

    # -- durable state -------------------------------------------------------------------
    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool
                         ) -> dict[str, Any] | None:
        t = self.t
        ckpts = t.controller.checkpoints
        if not collective or ckpts is None:
            return None  # every rank writes its shard: only at a scheduled point
        self._settle()
        if self._ckpt_group is None:  # collective, as every rank is here
            with round_connections():  # (cut with the round's, should it break)
                self._ckpt_group = torch.distributed.new_group(backend="gloo")
        name = f"shards-{t.controller.steps:08d}"
        self._saving = save_sharded(t.module, t.optimizer, str(ckpts.directory / name),
                                    self._ckpt_group)
        fw = t._state()
        del fw["optimizer"]  # (the shards hold its whole state)
        return {"fw": fw, "ctl": controller_state, "shards": name, "pending": self._saving}

    def checkpoint_needs_peers(self) -> bool:
        return True

    def restore_checkpoint(self, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not isinstance(state.get("shards"), str):
            raise ValueError("not a sharded checkpoint (this model is sharded)")
        return {"shards": state["shards"], "fw": state["fw"], "ctl": state["ctl"]}, state["ctl"]


def _sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             sharding: str | None, job: ElasticJob) -> torch.nn.Module:
    """The model to train: ``sharding="fsdp"`` shards it here (``fsdp.shard_model``);
    a model wrapped already (DDP, or sharded and asked to shard) is one clear error."""
    if sharding not in (None, "fsdp"):
        raise ShardingError(f"sharding must be None (DDP) or 'fsdp', got {sharding!r}")
    if isinstance(model, DistributedDataParallel):
        raise ShardingError("the model is wrapped in DistributedDataParallel already: pass "
                            "the module itself (ElasticTrainer wraps it, or shards it with "
                            "sharding='fsdp')")
    if sharding == "fsdp":
        if is_sharded(model):
            raise ShardingError("the model is sharded with fully_shard already: drop "
                                "sharding='fsdp' (or pass the unsharded model)")
        if torch.distributed.is_initialized():
            model = shard_model(model, optimizer, job.device_mesh())
    return model


def _steps_on_cpu(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Received over nccl, every tensor is on the GPU - the optimizers' ``step`` counts
    too, which torch keeps on the CPU unless ``capturable``/``fused`` (and which
    ``load_state_dict`` does not move): put them back where rank 0 holds them."""
    if "optimizer" not in state or any(g.get("capturable") or g.get("fused")
                                       for g in optimizer.param_groups):
        return state
    for entry in state["optimizer"].get("state", {}).values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(step, torch.Tensor) and step.device.type != "cpu":
            entry["step"] = step.cpu()
    return state


class _Guarded(torch.nn.Module):
    """A sharded module whose forward hands a collective's failure to the trainer, as
    ``_ElasticDDP`` does for DDP: with zeros shaped like the last output
    (``on_failure_with``; the batch dimension follows the input's), or, before any
    forward succeeded, for a forward run again on the new group (``on_failure``)."""

    def __init__(self, module: torch.nn.Module, on_failure: Any, on_failure_with: Any
                 ) -> None:
        super().__init__()
        self.module = module
        self._on_failure, self._on_failure_with = on_failure, on_failure_with
        # the last output's (pytree spec or None for a lone tensor, leaves, input batch)
        self._shape: tuple[Any, list[Any], int | None] | None = None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            out = self.module(*inputs, **kwargs)
        except RuntimeError as exc:
            if self._shape is None:
                return self._on_failure(exc, inputs, kwargs)
            return self._on_failure_with(exc, self._zeros(inputs, kwargs))
        # metadata only, no tensor kept or read; a lone tensor (the usual output) without
        # a pytree walk: this runs on every forward
        if type(out) is torch.Tensor:
            self._shape = (None, [_Leaf(out.shape, out.dtype, out.device)],
                           _batch_of(inputs, kwargs))
        else:
            leaves, spec = tree_flatten(out)
            self._shape = (spec, [_Leaf(t.shape, t.dtype, t.device)
                                  if isinstance(t, torch.Tensor) else t for t in leaves],
                           _batch_of(inputs, kwargs))
        return out

    def _zeros(self, inputs: tuple, kwargs: dict) -> Any:
        assert self._shape is not None
        spec, leaves, then = self._shape
        now = _batch_of(inputs, kwargs)
        out = []
        for leaf in leaves:
            if not isinstance(leaf, _Leaf):
                out.append(leaf)
                continue
            shape, dtype, device = leaf.shape, leaf.dtype, leaf.device
            if shape and then and now and shape[0] % then == 0:  # (B, ...) or (B * S, ...)
                shape = torch.Size((shape[0] // then * now, *shape[1:]))
            out.append(torch.zeros(shape, dtype=dtype, device=device,
                                   requires_grad=dtype.is_floating_point))
        return out[0] if spec is None else tree_unflatten(out, spec)


class _Leaf(NamedTuple):
    """A tensor of an output, as its shape (no tensor kept; a pytree leaf is never a
    tuple, so nothing else is taken for one)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def _batch_of(inputs: tuple, kwargs: dict) -> int | None:
    """The first tensor argument's leading dimension (the micro-batch), if any."""
    if inputs and type(inputs[0]) is torch.Tensor and inputs[0].dim():
        return inputs[0].shape[0]  # (the usual call: one forward's worth of host time)
    for x in (*inputs, *kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim():
            return int(x.shape[0])
    return None


class _ElasticDDP(DistributedDataParallel):
    """DDP whose forward hands a collective's failure to the trainer (``on_failure``)
    instead of raising it into the training loop, where nothing could recover it."""

    def __init__(self, module: torch.nn.Module, on_failure: Any, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._on_failure = on_failure

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            return self._on_failure(exc, inputs, kwargs)
