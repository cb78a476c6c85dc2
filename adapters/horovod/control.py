"""The Pollux agent inside a Horovod Elastic job: decisions, LR scaling and hints.

:class:`HorovodControl` sits on the measuring ``DistributedOptimizer`` (``optimizer.
pollux_control``; the measurement is ``optimizer.pollux``) and drives a
:class:`~pollux_launch.agent.agent.PolluxAgent` with it. It acts at two kinds of points,
identically on every rank:

* **after every reset that adds workers** (and at the start): in the ``TorchState``
  sync, which Horovod runs on *all* ranks then - survivors and newcomers alike. Rank 0's
  measurement, progress and counters are broadcast as JSON bytes (no pickle), then a
  decision is forced for the new world size. (A reset callback runs on survivors only,
  before that sync, so it cannot hold a collective: newcomers would not join it.)
* **after a reset that only removed workers**, at the end of the first step in the new
  group: Horovod 0.28 skips the sync then (``HostsUpdatedInterrupt.skip_sync``), but
  every rank is a survivor and sees ``hvd.size()`` differ from the size it last decided
  for, so all of them decide at that step boundary;
* **every** ``decide_every`` **optimiser steps** (the step counter is part of the synced
  state, so all ranks reach the same steps).

A decision: rank 0 refits the throughput model when due, picks the per-GPU batch ``m``
and accumulation steps ``s`` maximising goodput for ``hvd.size()`` ranks (Pollux Eqn 13)
and the LR factor of the batch ``K m (s+1)`` (AdaScale for SGD, square root for Adam;
Pollux Sec. 3.1), reports the job's ``JobHints`` to the store when due, and broadcasts
``(m, s, factor)``. Every rank applies it: ``set_backward_passes_per_step(s + 1)`` on the
optimizer, ``m (s+1)`` as the batch of the given ``data_loader`` (Horovod's "allreduce
batch", which the training loop splits into ``optimizer.backward_passes_per_step``
micro-batches), and the LR factor around each ``optimizer.step()`` - applied and undone,
so the user's LR (and scheduler) never sees it. Without a ``data_loader`` the batch
shape is the user's and only the LR factor applies.

Hints go to ``jobs/<POLLUX_JOB>/hints`` in the store named by ``POLLUX_STORE`` (set by
``pollux-run``); without it nothing is reported and decisions still apply.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from pollux_launch import env as envvars
from pollux_launch.agent.agent import AgentConfig, PolluxAgent, default_lr_rule
from pollux_launch.agent.gns import GNSEstimator, GradNoise
from pollux_launch.agent.progress import StatisticalProgress

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
    adapts); ``local_bsz_bounds``: per-rank micro-batch bounds (default ``(m, m)``
    without a ``data_loader``, else ``(max(1, m // 2), 4 m)``).
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
        lr_scaling: str | Callable[[float, Any], float] = "auto",
        report_interval: float = 30.0,
        decide_every: int = 20,
        min_gain: float = 0.05,
        dataset_size: int | None = None,
        on_decision: Callable[[int, int, float], None] | None = None,
    ) -> None:
        if not isinstance(local_bsz, int) or local_bsz < 1:
            raise ValueError(f"local_bsz must be a positive integer, got {local_bsz!r}")
        if decide_every < 1:
            raise ValueError(f"decide_every must be >= 1, got {decide_every}")
        if data_loader is not None and getattr(data_loader, "batch_sampler", None) is None:
            raise ValueError("data_loader: need a torch DataLoader built with batch_size=... "
                             "(its batch sampler's batch size is what Pollux adapts)")
        adaptive_shape = data_loader is not None
        self.hvd, self.optimizer, self.measurement = hvd, optimizer, measurement
        self.data_loader = data_loader
        self.local_bsz, self.accum_steps = local_bsz, accum_steps
        self._init_batch_size = init_batch_size
        self._max_batch_size = max_batch_size
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
        self.agent: PolluxAgent | None = None  # built at the first sync (needs M0)
        self.lr_factor = 1.0
        self.steps = 0  # optimiser steps of the job (synced)
        self.resets = 0  # forced decisions: the start and every reset (synced)
        self._decided_size = 0  # hvd.size() at the last forced decision
        self._grad: GradNoise | None = None
        self._store: Any | None = None
        self._store_failed = False

    # -- what the optimizer calls ----------------------------------------------------------
    def sync(self) -> None:
        """All ranks, after every reset and at the start: take rank 0's state, decide."""
        hvd, m = self.hvd, self.measurement
        if hvd.rank() == 0 and self.agent is None:
            self._build(self._init_batch_size or hvd.size() * self.local_bsz
                        * (self.accum_steps + 1))
        mine = None
        if hvd.rank() == 0:
            assert self.agent is not None
            mine = {"v": CONTROL_STATE_VERSION, "m0": self.agent.config.init_batch_size,
                    "measure": m.state_dict(), "progress": self.agent.progress.state_dict(),
                    "steps": self.steps, "resets": self.resets, "batch": [
                        self.local_bsz, self.accum_steps]}
        state = broadcast_json(hvd, mine, 0, "pollux.control.state")
        if hvd.rank() != 0:
            if not isinstance(state, dict) or state.get("v") != CONTROL_STATE_VERSION:
                raise ValueError("pollux control state: unexpected format from rank 0")
            if self.agent is None:
                self._build(int(state["m0"]))
            assert self.agent is not None
            m.load_state_dict(state["measure"])
            self.agent.progress.load_state_dict(state["progress"])
            self.agent._fitted_len = -1  # refit from the received profile
            self.steps, self.resets = int(state["steps"]), int(state["resets"])
            self.local_bsz, self.accum_steps = (int(v) for v in state["batch"])
        m.abort_step()
        self.decide(force=True)

    def after_step(self) -> None:
        """All ranks, after every optimiser step."""
        self.steps += 1
        if self.agent is not None:
            self.agent.progress.step(self.batch_size, self._grad)
            resized = self.hvd.size() != self._decided_size  # a removal-only reset
            if resized or self.steps % self.decide_every == 0:
                self.decide(force=resized)

    # -- decisions -------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.hvd.size() * self.local_bsz * (self.accum_steps + 1)

    def decide(self, force: bool) -> None:
        """Rank 0 picks ``(m, s)`` and the LR factor and reports; all ranks apply."""
        assert self.agent is not None
        hvd, agent = self.hvd, self.agent
        if force:
            self.resets += 1  # the first forced decision is the start, not a reset
            self._decided_size = hvd.size()
        self._grad = self.measurement.stats()
        decision = torch.zeros(3, dtype=torch.float64)
        if hvd.rank() == 0:
            size, nodes = hvd.size(), max(1, min(hvd.cross_size(), hvd.size()))
            current = (self.local_bsz, self.accum_steps)
            m, s = agent.choose(nodes, size, None if force else current, refit=not force)
            factor = agent.lr_factor(size * m * (s + 1))
            decision[:] = torch.tensor([m, s, factor], dtype=torch.float64)
            self._report(nodes, size, m, s, force)
        decision = self.hvd.broadcast(decision, 0, name="pollux.control.decision")
        self._apply(int(decision[0]), int(decision[1]), float(decision[2]), force)

    def _apply(self, m: int, s: int, factor: float, force: bool) -> None:
        self.lr_factor = factor
        if not force and (m, s) == (self.local_bsz, self.accum_steps):
            return
        self.local_bsz, self.accum_steps = m, s
        if self.data_loader is not None:
            self.data_loader.batch_sampler.batch_size = m * (s + 1)
        if self.optimizer.backward_passes_per_step != s + 1:
            self.optimizer.set_backward_passes_per_step(s + 1)
        if (m, s) != (self.measurement.local_bsz, self.measurement.accum_steps):
            self.measurement.set_batch(m, s)  # re-keys the step profile at the next step
        if self.on_decision is not None:
            self.on_decision(m, s, factor)
        log.info("rank %d: batch %d = %d x %d x %d, lr x%.3f", self.hvd.rank(),
                 self.batch_size, self.hvd.size(), m, s + 1, factor)

    def _build(self, m0: int) -> None:
        lo, hi = self.local_bsz_bounds
        mx = max(self._max_batch_size or m0, m0)
        config = AgentConfig(
            init_batch_size=m0, max_batch_size=mx, local_bsz_bounds=(lo, hi),
            gradient_accumulation=self.gradient_accumulation,
            adaptive_batch_size=mx > m0, lr_scaling=self.lr_scaling,
            report_interval=self.report_interval, min_gain=self.min_gain)
        self.agent = PolluxAgent(config, self.measurement.profile, lambda: self._grad,
                                 StatisticalProgress(m0, self.dataset_size))
        m = self.measurement
        if m.estimator is None or m.estimator.init_batch_size != m0:
            m.estimator = GNSEstimator(m0, m.smoothing)

    # -- hints -----------------------------------------------------------------------------
    def _report(self, nodes: int, size: int, m: int, s: int, force: bool) -> None:
        assert self.agent is not None
        if not (force or self.agent.report_due()):
            return
        store, job = self._open_store(), os.environ.get(envvars.JOB)
        if store is None or not job:
            return
        from pollux_launch.rendezvous.store import StoreError

        try:
            hints = self.agent.hints(nodes, size, m, s, restarts=max(0, self.resets - 1))
            self.agent.report(store, job, hints)
        except StoreError as exc:  # the store may be away for a while: training goes on
            log.warning("could not report hints (%s)", exc)

    def _open_store(self) -> Any | None:
        if self._store is None and not self._store_failed and os.environ.get(envvars.STORE):
            from pollux_launch.rendezvous.store import StoreError

            try:
                self._store = envvars.store_from_env()
            except StoreError as exc:
                log.warning("no hints: cannot open the store (%s)", exc)
                self._store_failed = True
        return self._store

    def status(self) -> dict[str, Any]:
        """What the agent sees now (for logs)."""
        grad = self._grad
        return {"step": self.steps, "replicas": self.hvd.size(), "batch_size": self.batch_size,
                "local_bsz": self.local_bsz, "accum_steps": self.accum_steps,
                "lr_factor": self.lr_factor, "resets": self.resets,
                "noise_scale": None if grad is None else grad.noise_scale,
                "efficiency": None if grad is None or math.isnan(grad.noise_scale)
                else float(grad.efficiency(self.batch_size))}
