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
boundary) are where things change, identically on every replica:

* every ``check_every`` steps the replicas vote (one 4-byte all-reduce) on a rescale. A
  rank votes yes when its rendezvous saw a new allocation, a newer round or a dead peer -
  but for a *grow* only once the newcomers are registered (they register after importing
  DeepSpeed, so the survivors keep training while newcomers start). On yes: capture the
  engine's consolidated state on the old group, enter the next round (leavers exit 0),
  rebuild the engine on the new group and restore the state (newcomers receive it by
  broadcast), then re-decide the batch;
* every ``decide_every`` steps rank 0 refits the throughput model when due, picks the
  per-GPU micro batch ``m`` and accumulation ``s`` for the allocation (Pollux Eqn 13) and
  the LR factor (AdaScale or the configured rule), reports the job's hints to the store
  every ``report_interval`` seconds, and broadcasts its decision (four numbers);
* step times go to a :class:`~pollux_launch.agent.profile.StepProfile` keyed by
  ``(nodes, replicas, m, s)``; gradient statistics come from the engine's
  :class:`~.gradients.DeepSpeedGradStats`.

A collective that fails because a peer died is recovered at ZeRO-0 (every replica holds
the whole state: the survivors re-form and take rank 0's); at ZeRO-1/2 the dead replica's
optimizer partition is gone, so the worker fails with a one-line error (restart from a
checkpoint).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pollux_launch import keys
from pollux_launch.adapters.torch.job import WorkerRemoved
from pollux_launch.agent.agent import AgentConfig, PolluxAgent
from pollux_launch.agent.profile import ProfileKey, StepProfile
from pollux_launch.agent.progress import StatisticalProgress
from pollux_launch.messages import Allocation, MessageError, decode
from pollux_launch.rendezvous.process_group import vote_any
from pollux_launch.rendezvous.rounds import WorkerInfo
from pollux_launch.rendezvous.store import StoreError

from .config import NO_LR_SCALING

log = logging.getLogger(__name__)

KEEP_STATE_ENV = "POLLUX_DEEPSPEED_KEEP_STATE"  # keep engine.restored_state (tests, debugging)


class PeerFailure(RuntimeError):
    """A peer died and this engine's state cannot be rebuilt without it."""


class ElasticDeepSpeed:
    """Drives one :class:`~.engine.PolluxEngine` through the job's rounds (module docstring).

    ``handle``: the engine handle (already built for the current round; a newcomer's has
    received the job's state); ``job``: the worker's ``ElasticJob``; ``loader``: the
    pollux ``AdaptiveDataLoader`` or None when the script feeds data itself (it must then
    read ``engine.train_micro_batch_size_per_gpu()``, ``global_rank`` and
    ``dp_world_size`` after every step). ``newcomer_wait``: the longest the survivors keep
    training while the newcomers of a grow start up.
    """

    def __init__(self, handle: Any, job: Any, loader: Any = None, *,
                 decide_every: int = 20, min_gain: float = 0.05,
                 newcomer_wait: float = 120.0) -> None:
        self.handle, self.job, self.loader = handle, job, loader
        cfg = handle.pollux
        self.lr_scaling = cfg.lr_scaling
        self.config = AgentConfig(
            init_batch_size=cfg.initial_batch_size,
            max_batch_size=cfg.max_batch_size,
            local_bsz_bounds=cfg.micro_batch_size_range,
            gradient_accumulation=cfg.gradient_accumulation,
            adaptive_batch_size=cfg.max_batch_size > cfg.initial_batch_size,
            lr_scaling=cfg.lr_scaling,
            report_interval=cfg.report_interval,
            min_gain=min_gain,
        )
        self.profile = StepProfile(warmup_steps=3)
        size = len(loader.dataset) if loader is not None else None
        self.progress = StatisticalProgress(cfg.initial_batch_size, size)
        self._grad = None  # gradient statistics, read at decision points (same on all ranks)
        self.agent = PolluxAgent(self.config, self.profile, lambda: self._grad, self.progress)
        self.decide_every, self.check_every = max(1, decide_every), 1
        self.newcomer_wait = newcomer_wait
        self.keep_state = os.environ.get(KEEP_STATE_ENV, "") not in ("", "0")
        self.steps = 0
        self.rescales: list[dict[str, Any]] = []  # timings of rescales and failure recoveries
        self._t_last: float | None = None
        self._waiting_since: float | None = None
        self._ready_checked = (-1.0, False)
        self._open_rescale: dict[str, Any] | None = None
        self._report_pending = False
        handle.driver = self
        restored = handle.restored_state
        if restored is not None and restored.get("client", {}).get("elastic"):
            self.load_state_dict(restored["client"]["elastic"])  # a newcomer
        self._enter_round()

    # -- state that travels to newcomers -----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"agent": self.agent.state_dict(), "steps": self.steps,
                "loader": self.loader.state_dict() if self.loader is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agent.load_state_dict(state["agent"])
        self.steps = int(state["steps"])
        if self.loader is not None and state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])

    # -- the user's view ---------------------------------------------------------------
    def epochs(self, total: float) -> Iterator[int]:
        while self.progress.epochs() < total:
            yield self.loader.epoch

    # -- step boundaries ---------------------------------------------------------------
    def on_boundary(self) -> None:
        """After every optimizer step, on every replica (called by ``engine.step()``)."""
        now = time.perf_counter()
        if self._t_last is not None:
            self.profile.record(now - self._t_last)
        self._t_last = now
        self.steps += 1
        self.progress.step(self.handle.train_batch_size(), self._grad)
        if self._open_rescale is not None:  # the first step after a rescale is done
            self._open_rescale["pause_to_step_s"] = now - self._open_rescale["t0"]
            self._open_rescale = None
        if self._report_pending:
            self._report_pending = False
            micro, gas = self.handle.batch
            self._report(micro, gas - 1, force=True)
        if not self.keep_state:
            self.handle.restored_state = None
        try:
            if self.job.elastic and self.steps % self.check_every == 0 and self._rescale_due():
                self._rescale()
                return
            if self.steps % self.decide_every == 0:
                self._decide(force=False)
        except RuntimeError as exc:
            if not self.recover(exc):
                raise

    def _rescale_due(self) -> bool:
        """Collective: every rank votes; a grow waits until its newcomers registered."""
        rdzv = self.job.rdzv
        return vote_any(rdzv.poll() and self._newcomers_ready(), rdzv.group)

    def _newcomers_ready(self) -> bool:
        """Whether every node of the newest allocation runs enough live workers (newcomers
        register once DeepSpeed is imported), or the wait for them has run out. Reads the
        store at most every 0.25 s; a shrink, a newer round or a dead peer: at once."""
        now = time.monotonic()
        checked_at, ready = self._ready_checked
        if now - checked_at < 0.25:
            return ready
        rdzv = self.job.rdzv
        info = rdzv.info
        try:
            kv = rdzv.store.get(keys.job(rdzv.job, "allocation"))
            alloc = decode(Allocation, kv.value) if kv is not None else None
            if alloc is None or info is None or alloc.version <= info.alloc_version:
                ready = True
            else:
                live = Counter(decode(WorkerInfo, w.value).node
                               for w in rdzv.store.get_prefix(rdzv.keys.workers))
                ready = all(live[n] >= c for n, c in Counter(alloc.nodes).items())
        except (StoreError, MessageError) as exc:  # the rendezvous will report it
            log.warning("checking for newcomers failed (%s): rescaling now", exc)
            ready = True
        if self._waiting_since is None:
            self._waiting_since = now
        if not ready and now - self._waiting_since > self.newcomer_wait:
            log.warning("newcomers not registered after %.0f s: rescaling without waiting",
                        self.newcomer_wait)
            ready = True
        self._ready_checked = (now, ready)
        return ready

    def _rescale(self) -> None:
        t0 = time.perf_counter()
        old = self.job.placement
        timing: dict[str, Any] = {"t0": t0, "from": old.world_size}

        def reform() -> bool:
            timing["captured_s"] = time.perf_counter() - t0
            try:
                self.job.next_round()
            except WorkerRemoved:
                return False
            timing["formed_s"] = time.perf_counter() - t0
            return True

        restored = self.handle.rescale(reform, client_state={"elastic": self.state_dict()})
        if "formed_s" not in timing:
            log.info("not in the new round: leaving the job")
            self.job.close()
            raise SystemExit(0)
        self.handle.restored_state = restored
        timing["rebuilt_s"] = time.perf_counter() - t0
        self._enter_round()
        p = self.job.placement
        timing.update(to=p.world_size, round=p.round, pause_s=time.perf_counter() - t0)
        self.rescales.append(timing)
        self._open_rescale = timing
        log.info("rescaled %d -> %d replicas in %.3f s", old.world_size, p.world_size,
                 timing["pause_s"])

    def recover(self, exc: RuntimeError) -> bool:
        """After a collective raised: True if it was a peer's failure and the job re-formed
        (the step in flight is lost); False if ``exc`` is not a distributed failure."""
        if not (self.job.elastic and _distributed_failure(exc)):
            return False
        stage = self.handle.engine.zero_optimization_stage()
        if stage != 0:
            raise PeerFailure(
                f"a peer failed ({_line(exc)}); its ZeRO-{stage} optimizer partition is lost: "
                "live recovery needs ZeRO stage 0 - restart the job from a checkpoint") from exc
        log.warning("a collective failed (%s): re-forming the job", _line(exc))
        t0, old = time.perf_counter(), self.job.placement.world_size
        handle = self.handle
        state = handle.capture({"elastic": self.state_dict()})  # local at ZeRO-0
        handle._detach()
        try:
            self.job.next_round()
        except WorkerRemoved:
            self.job.close()
            raise SystemExit(0) from None
        # survivors may be a step apart: everyone takes rank 0's state
        m, gas = state["client"]["pollux"]["batch"]
        restored = handle._build(state if self.job.placement.rank == 0 else None, m, gas)
        if self.job.placement.rank != 0 and restored is not None:
            self.load_state_dict(restored["client"]["elastic"])
        handle.restored_state = restored
        if self.loader is not None:
            self.loader.abort_step()
        self._enter_round()
        p = self.job.placement
        self.rescales.append({"t0": t0, "from": old, "to": p.world_size, "round": p.round,
                              "reason": "failure", "pause_s": time.perf_counter() - t0,
                              "done_at": time.time()})
        return True

    def _enter_round(self) -> None:
        p = self.job.placement
        if self.loader is not None:
            self.loader.set_replicas(p.rank, p.world_size)
        self._waiting_since, self._ready_checked = None, (-1.0, False)
        self._decide(force=True)
        self._t_last = None

    # -- decisions ---------------------------------------------------------------------
    def _decide(self, force: bool) -> None:
        """Rank 0 picks (m, s) and the LR factor and reports hints; everyone applies the
        broadcast decision at this same boundary."""
        p = self.job.placement
        handle = self.handle
        self._grad = handle.grad_stats.stats()
        micro, gas = handle.batch
        decision = torch.zeros(4, dtype=torch.float64)
        if p.rank == 0:
            current = None if force else (micro, gas - 1)
            m, s = self.agent.choose(p.num_nodes, p.world_size, current, refit=not force)
            decision[:] = torch.tensor([m, s, self._check_interval(),
                                        self._lr_factor(p.world_size * m * (s + 1))])
            if force:  # a new round: report after its first step, not inside the pause
                self._report_pending = True
            else:
                self._report(m, s, force=False)
        if p.world_size > 1:
            dist.broadcast(decision, 0)
        m, s, check = (int(v) for v in decision[:3])
        self.check_every = max(1, check)
        if (m, s + 1) != (micro, gas):
            handle.set_batch_size(m, s + 1)
            self._t_last = None  # the next interval spans the change
        if self.loader is not None and (self.loader.local_bsz, self.loader.accum_steps) != (m, s):
            self.loader.set_batch_size(m, s)
        handle.set_lr_factor(float(decision[3]))
        self.profile.set_key(ProfileKey(p.num_nodes, p.world_size, m, s))

    def _lr_factor(self, batch_size: int) -> float:
        if self.lr_scaling == NO_LR_SCALING:
            return 1.0
        return self.agent.lr_factor(batch_size)

    def _check_interval(self) -> int:
        """Vote about every 50 ms of training: cheap, and rescales start promptly."""
        times = self.profile.arrays()["step_time"]
        if not len(times):
            return 1
        return int(min(self.decide_every, max(1, round(0.05 / max(float(times.mean()), 1e-6)))))

    def _report(self, m: int, s: int, force: bool) -> None:
        store = self.job.store
        if store is None or not (force or self.agent.report_due()):
            return
        p = self.job.placement
        try:
            self.agent.report(store, self.job.name, self.agent.hints(
                p.num_nodes, p.world_size, m, s, restarts=max(0, self.job.rounds - 1)))
        except StoreError as exc:  # the store may be away for a while: training goes on
            log.warning("could not report hints (%s)", exc)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _distributed_failure(exc: RuntimeError) -> bool:
    """Heuristic: errors raised by a collective whose peer went away."""
    text = str(exc).lower()
    return dist.is_initialized() and any(w in text for w in (
        "connection", "peer", "gloo", "timed out", "timeout", "broken pipe", "nccl",
        "closed", "reset"))
