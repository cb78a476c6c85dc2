"""``ElasticTrainer``: DDP, the PolluxAgent's measurements and decisions, and live rescaling.

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

Step boundaries (after every optimiser step) are where things change, identically on
every replica:

* every ``check_every`` steps the replicas vote (one 4-byte all-reduce) on whether any
  saw a new allocation or a dead peer; if so they re-form the process group in place,
  rebuild DDP, and - when newcomers joined or a peer failed - rank 0 broadcasts the
  training state (model, optimizer, scheduler, scaler, loader position, agent, extras);
  a worker not in the new round exits with status 0;
* every ``decide_every`` steps rank 0 refits the throughput model when due, picks the
  per-GPU batch and accumulation steps for the allocation, reports the job's hints to
  the store, and broadcasts its decision (three integers);
* the LR of every step is the user's (scheduler's) LR times the agent's factor for the
  current batch size: the factor is applied around ``optimizer.step()`` and undone
  right after, so the user's scheduler never sees it.

A collective that fails because a peer died is caught: the survivors move to a failure
round, take rank 0's state and go on; only the step in flight is lost.

Durable state (``checkpoint_dir``, by default ``pollux-run --checkpoint-dir``): rank 0
writes the same state every ``checkpoint_interval`` seconds in the background
(``pollux_launch.elastic.checkpoint``); a job whose workers all died resumes from the
newest checkpoint at whatever size it is given, and SIGTERM (a drained node, a batch
system's preemption) makes rank 0 write a final one at its next step boundary before the
worker ends by that signal, as it would have without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pollux_launch import env as envvars
from pollux_launch.agent.agent import AgentConfig, PolluxAgent, default_lr_rule
from pollux_launch.agent.hooks import attach_measurement
from pollux_launch.agent.progress import StatisticalProgress
from pollux_launch.elastic.checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint
from pollux_launch.rendezvous.process_group import broadcast_state
from pollux_launch.rendezvous.store import StoreError

from .data import AdaptiveDataLoader
from .job import ElasticJob, WorkerRemoved, init

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
        decide_every: int = 20,
        min_gain: float = 0.05,
        ddp_kwargs: dict[str, Any] | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_interval: float | None = None,
    ) -> None:
        self.job = job or init()
        self.module, self.optimizer, self.loader = model, optimizer, loader
        self.lr_scheduler, self.grad_scaler = lr_scheduler, grad_scaler
        self.max_grad_norm = max_grad_norm
        self.decide_every, self.check_every = max(1, decide_every), 1
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._extra: dict[str, Any] = {}
        self._ddp: DistributedDataParallel | None = None
        self.steps = 0
        self.last_lr_factor = 1.0
        self._discard = False  # the forward of this micro-batch met a peer's failure
        config = AgentConfig(
            init_batch_size=loader.init_batch_size,
            max_batch_size=loader.max_batch_size,
            local_bsz_bounds=loader.local_bsz_bounds,
            gradient_accumulation=loader.gradient_accumulation,
            adaptive_batch_size=loader.max_batch_size > loader.init_batch_size,
            lr_scaling=default_lr_rule(optimizer) if lr_scaling == "auto" else lr_scaling,
            report_interval=report_interval,
            min_gain=min_gain,
        )
        p = self.job.placement
        self.hooks = attach_measurement(model, optimizer, config.init_batch_size,
                                        grad_scaler=grad_scaler, num_nodes=p.num_nodes,
                                        num_replicas=p.world_size, local_bsz=loader.local_bsz)
        progress = StatisticalProgress(config.init_batch_size, len(loader.dataset))
        # gradient statistics are read at decision points, not every step (flushing the
        # monitor costs a device->host copy)
        self._grad = None
        self.agent = PolluxAgent(config, self.hooks.profile, lambda: self._grad, progress)
        loader.on_step_boundary = self._on_boundary
        self.checkpoints = _checkpoint_writer(checkpoint_dir, checkpoint_interval)
        self.resumed_from: float | None = None  # the checkpoint's progress, if one was loaded
        self._terminating = False
        if self.checkpoints is not None:
            self._catch_sigterm()
        info = self.job.info
        sync = self.job.elastic and info.needs_state_sync
        if info is None or info.fresh:  # a new job, or one whose workers all died
            sync = self._resume() or sync
        self._enter_round(sync_state=sync)

    # -- what the user touches ---------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The module to call in the training loop (DDP-wrapped when distributed).
        Re-read it every step: a rescale replaces the wrapper."""
        return self._ddp if self._ddp is not None else self.module

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    def register_state(self, name: str, obj: Any) -> None:
        """Extra state to keep identical across replicas (``state_dict``/``load_state_dict``)."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(f"register_state({name!r}): the object needs state_dict() and "
                             "load_state_dict()")
        self._extra[name] = obj

    def epochs(self, total: float) -> Iterator[int]:
        """Data epochs until ``total`` statistical epochs are done (scale-invariant: the
        same training whatever batch sizes were used); resumes where the job stands."""
        while self.agent.progress.epochs() < total:
            yield self.loader.epoch

    def step(self, loss: torch.Tensor) -> bool:
        """Backward for this micro-batch; on the last micro-batch of an optimiser step also
        the (LR-scaled) optimiser step. True when the optimiser stepped."""
        if self._discard:  # its forward failed; the job re-formed: this step is dropped
            self._discard = False
            self.optimizer.zero_grad(set_to_none=True)
            return False
        sync = self.loader.is_sync_step
        if self.loader.accum_steps:  # average, not sum, over the micro-batches of a step
            loss = loss / (self.loader.accum_steps + 1)
        quiet = contextlib.ExitStack()
        if not sync:
            quiet.enter_context(self.hooks.accumulate())
            if self._ddp is not None:
                quiet.enter_context(self._ddp.no_sync())
        try:
            with quiet:
                (self.grad_scaler.scale(loss) if self.grad_scaler else loss).backward()
        except RuntimeError as exc:
            if not self._distributed_failure(exc):
                raise
            self._recover(exc)
            return False
        if not sync:
            return False
        self._optimizer_step()
        return True

    def status(self) -> dict[str, Any]:
        """What the agent sees now (for logs): replicas, batch shape, LR, efficiency..."""
        grad = self._grad
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        out = {
            "step": self.steps, "replicas": self.job.placement.world_size,
            "nodes": self.job.placement.num_nodes, "batch_size": self.loader.batch_size,
            "local_bsz": self.loader.local_bsz, "accum_steps": self.loader.accum_steps,
            "lr": lrs[0] * self.last_lr_factor, "lr_factor": self.last_lr_factor,
            "efficiency": None, "goodput": None,
            "epochs": self.agent.progress.epochs(),
        }
        if grad is not None:
            out["efficiency"] = float(grad.efficiency(self.loader.batch_size))
        fn = self.agent.goodput_function()
        if fn is not None:
            import numpy as np

            p = self.job.placement
            out["goodput"] = float(fn.evaluate(
                np.array([p.num_nodes]), np.array([p.world_size]),
                np.array([self.loader.local_bsz]), np.array([self.loader.accum_steps]))[0])
        return out

    def describe(self) -> str:
        s = self.status()
        eff = "-" if s["efficiency"] is None else f"{s['efficiency']:.2f}"
        good = "-" if s["goodput"] is None else f"{s['goodput']:.0f}/s"
        return (f"step {s['step']} | replicas {s['replicas']} | batch {s['batch_size']} = "
                f"{s['replicas']}x{s['local_bsz']}x{s['accum_steps'] + 1} | "
                f"lr {s['lr']:.4g} (x{s['lr_factor']:.2f}) | efficiency {eff} | goodput {good}")

    # -- the optimiser step ------------------------------------------------------------
    def _optimizer_step(self) -> None:
        batch = self.loader.batch_size
        factor = self.agent.lr_factor(batch)
        self.last_lr_factor = factor
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        base = [g["lr"] for g in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, base, strict=True):
            group["lr"] = lr * factor
        try:
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
            else:
                self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, base, strict=True):
                group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.agent.progress.step(batch, self._grad)
        self.steps += 1

    # -- step boundaries ---------------------------------------------------------------
    def _on_boundary(self) -> None:
        """Called by the loader after every optimiser step, before its next batch."""
        if self._terminating:
            self._terminate()
        if (self.checkpoints is not None and self.job.placement.rank == 0
                and self.checkpoints.due()):
            self._checkpoint(wait=False)
        try:
            if self.job.elastic and self.steps % self.check_every == 0 and self.job.rescale_due():
                self._rescale()
                return
            if self.steps % self.decide_every == 0:
                self._decide(force=False)
        except RuntimeError as exc:
            if not self._distributed_failure(exc):
                raise
            # the step before this boundary completed everywhere: nothing is in flight, so
            # the loader's next step is not aborted (aborting it would skip its boundary on
            # this rank only, and the ranks' collectives would fall out of step)
            self._recover(exc, in_flight=False)

    def _rescale(self) -> None:
        t0 = time.perf_counter()
        try:
            info = self.job.next_round()
        except WorkerRemoved:
            log.info("not in the new round: leaving the job")
            self.hooks.remove()
            self.job.close()
            raise SystemExit(0) from None
        self._enter_round(sync_state=info.needs_state_sync)
        log.info("rescaled to %d replicas in %.3f s", info.world_size, time.perf_counter() - t0)

    def _forward_failed(self, exc: RuntimeError, inputs: tuple, kwargs: dict) -> Any:
        """DDP's forward runs collectives of its own (the bucket rebuild after the first
        step, buffer broadcasts): a peer dying there re-forms the job like any failure,
        and the caller gets the local module's output, whose step ``step()`` drops."""
        if not self._distributed_failure(exc):
            raise exc
        self._recover(exc)
        self._discard = True
        return self.module(*inputs, **kwargs)

    def _recover(self, exc: BaseException, in_flight: bool = True) -> None:
        """A peer died mid-collective: form a failure round and take rank 0's state;
        ``in_flight``: the failure hit a step (its micro-batches are dropped)."""
        if self._terminating:  # peers ended by the same SIGTERM: only our own end is left
            self._terminate()
        if not self.job.elastic:
            raise exc
        log.warning("a collective failed (%s): re-forming the job", str(exc).splitlines()[0])
        self.optimizer.zero_grad(set_to_none=True)
        try:
            self.job.next_round()
        except WorkerRemoved:
            self.job.close()
            raise SystemExit(0) from None
        self._enter_round(sync_state=True)  # survivors may be a step apart
        if in_flight:
            self.loader.abort_step()

    def _enter_round(self, sync_state: bool) -> None:
        p = self.job.placement
        self._ddp = None
        if p.world_size > 1:
            # elastic rounds sync state themselves (below); a static group syncs like DDP does
            self._ddp = _ElasticDDP(self.module, self._forward_failed,
                                    init_sync=not self.job.elastic, **self._ddp_kwargs)
        if sync_state:
            self._load_state(broadcast_state(self._state() if p.rank == 0 else None))
        self.loader.set_replicas(p.rank, p.world_size)
        self._decide(force=True)

    def _decide(self, force: bool) -> None:
        """Rank 0 picks (m, s), reports hints; everyone applies the broadcast decision."""
        p = self.job.placement
        self._grad = self.hooks.monitor.stats()
        decision = torch.zeros(3, dtype=torch.int64)
        if p.rank == 0:
            current = (self.loader.local_bsz, self.loader.accum_steps)
            m, s = self.agent.choose(p.num_nodes, p.world_size, None if force else current,
                                     refit=not force)
            decision[:] = torch.tensor([m, s, self._check_interval()])
            self._report(m, s, force)
        if p.world_size > 1:
            dist.broadcast(decision, 0)
        m, s, self.check_every = (int(v) for v in decision)
        if (m, s) != (self.loader.local_bsz, self.loader.accum_steps) or force:
            self.loader.set_batch_size(m, s)
            self.hooks.configure(num_nodes=p.num_nodes, num_replicas=p.world_size,
                                 local_bsz=m, accum_steps=s, loss_averaged_over_accum=True,
                                 process_group=None if p.world_size == 1 else dist.group.WORLD)

    def _check_interval(self) -> int:
        """Vote about every 50 ms of training: cheap, and rescales start promptly."""
        profile = self.hooks.profile.arrays()
        if not len(profile["step_time"]):
            return 1
        step = float(profile["step_time"].mean())
        return int(min(self.decide_every, max(1, round(0.05 / max(step, 1e-6)))))

    def _report(self, m: int, s: int, force: bool) -> None:
        store = self.job.store
        if store is None or not (force or self.agent.report_due()):
            return
        p = self.job.placement
        try:
            self.agent.report(store, self.job.name,
                              self.agent.hints(p.num_nodes, p.world_size, m, s,
                                               restarts=max(0, self.job.rounds - 1)))
        except StoreError as exc:  # the store may be away for a while: training goes on
            log.warning("could not report hints (%s)", exc)

    # -- state -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "agent": self.agent.state_dict(),
            "monitor": self.hooks.monitor.state_dict(),
            "steps": self.steps,
            "extra": {k: v.state_dict() for k, v in self._extra.items()},
        }
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        if self.job.placement.rank == 0:
            return  # rank 0 is the source
        self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.agent.load_state_dict(state["agent"])
        self.hooks.monitor.load_state_dict(state["monitor"])
        self.steps = int(state["steps"])
        for name, obj in self._extra.items():
            obj.load_state_dict(state["extra"][name])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    # -- durable state -----------------------------------------------------------------
    def _checkpoint(self, wait: bool) -> None:
        assert self.checkpoints is not None
        self.checkpoints.save(self._state(), step=self.steps,
                              progress=self.agent.progress.iterations,
                              replicas=self.job.placement.world_size, wait=wait)

    def _resume(self) -> bool:
        """Rank 0 loads the newest checkpoint, if there is one; every rank (all of them
        fresh, all here) learns whether it did (one broadcast), so that they all take
        rank 0's state. True if so."""
        p = self.job.placement
        loaded = torch.zeros(1, dtype=torch.int64)
        if p.rank == 0 and self.checkpoints is not None:
            try:
                ckpt = latest_checkpoint(self.checkpoints.directory)
            except CheckpointError as exc:
                log.error("not resuming: %s; training starts from scratch", exc)
                ckpt = None
            if ckpt is not None:
                self._restore(ckpt.state)
                self.resumed_from = ckpt.progress
                loaded[0] = 1
                log.warning("resumed from %s (step %d, %.0f iterations of progress, taken "
                            "on %d replicas)", ckpt.path, ckpt.step, ckpt.progress,
                            ckpt.replicas)
                if self.job.rdzv is not None:
                    self.job.rdzv.credit_resumed(ckpt.progress)
        if self.job.elastic and p.world_size > 1:
            dist.broadcast(loaded, 0)
        return bool(loaded.item()) and p.world_size > 1

    def _catch_sigterm(self) -> None:
        """SIGTERM ends the worker at its next step boundary, after rank 0 wrote a final
        checkpoint (only where the script left SIGTERM's default and in the main thread)."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
            return

        def on_sigterm(signum, frame) -> None:
            self._terminating = True

        signal.signal(signal.SIGTERM, on_sigterm)

    def _terminate(self) -> None:
        if self.job.placement.rank == 0 and self.checkpoints is not None:
            log.warning("SIGTERM: writing a final checkpoint")
            self.checkpoints.flush()
            self._checkpoint(wait=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM would have ended us
        time.sleep(60)  # (the signal is delivered before this returns)

    @staticmethod
    def _distributed_failure(exc: RuntimeError) -> bool:
        """Heuristic: errors raised by a collective whose peer went away."""
        text = str(exc).lower()
        return dist.is_initialized() and any(w in text for w in (
            "connection", "peer", "gloo", "timed out", "timeout", "broken pipe", "nccl",
            "closed", "reset"))


def _checkpoint_writer(directory: str | None, interval: float | None) -> CheckpointWriter | None:
    """The job's checkpoint writer: the arguments, else pollux-run's ``--checkpoint-dir``
    and ``--checkpoint-interval`` (through the environment), else none."""
    directory = directory or os.environ.get(envvars.CHECKPOINT_DIR)
    if not directory:
        return None
    if interval is None:
        interval = float(os.environ.get(envvars.CHECKPOINT_INTERVAL,
                                        envvars.DEFAULT_CHECKPOINT_INTERVAL))
    return CheckpointWriter(directory, every=interval)


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
