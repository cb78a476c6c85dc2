"""Gradient statistics of a DeepSpeed engine for the gradient noise scale (Pollux Eqn 4-6).

The pure estimator is ``pollux_launch.tuning.gns.GNSEstimator``; this module measures its
two inputs on a DeepSpeed engine, at every ZeRO stage 0-2, without touching DeepSpeed's
reduction:

* ``local_sqr`` - the mean of ``|g_i|^2`` over the ``count = K * s`` micro-batch gradients
  of one step (``K`` replicas, ``s`` = DeepSpeed's ``gradient_accumulation_steps``): a
  tensor hook on every module parameter sees each micro-batch's *local* gradient before
  DeepSpeed accumulates or reduces it (ZeRO-2's reduce-scatter hooks run after
  accumulation, later);
* ``total_sqr`` - ``|mean_i g_i|^2``, read in a step pre-hook of the torch optimizer that
  applies the update, where DeepSpeed has already averaged (and unscaled) the gradient:
  the full gradient at ZeRO-0, this replica's partition at ZeRO-1/2.

With one replica and no accumulation a step has one gradient, which says nothing about
its noise: then, as the torch adapter's monitor does, two consecutive steps' gradients
stand for two samples (``differenced``, slightly biased; replaced by unbiased samples as
soon as the job has more). One copy of the gradient is kept for that.

One small all-reduce per measured step sums ``[local, partition total]`` over replicas.
DeepSpeed divides the loss by ``s`` before backward and multiplies it by the loss scale;
both are undone here. Gradient clipping, when configured, happens before the optimizer
step and so biases ``total_sqr`` down (clip rarely in steady state). No pre-conditioning
yet (PGNS for Adam, Eqn 5, needs per-partition optimizer state; see README).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pollux_launch.tuning.gns import GNSEstimator, GradNoise

from . import compat


class DeepSpeedGradStats:
    """Measures ``(local_sqr, total_sqr)`` every ``interval``-th optimizer step and folds
    them into a :class:`GNSEstimator`. ``attach(engine)`` after every (re)build."""

    def __init__(self, init_batch_size: int, interval: int = 1, smoothing: float = 0.999,
                 estimator: GNSEstimator | None = None) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.estimator = estimator or GNSEstimator(init_batch_size, smoothing)
        self.interval = interval
        self._handles: list[Any] = []
        self._engine: Any = None
        self._local = torch.zeros((), dtype=torch.float64)
        self._total = torch.zeros((), dtype=torch.float64)
        self._measuring = False
        # one gradient per step: the previous step's (flat fp32) and its global step
        self._single = False
        self._cur: torch.Tensor | None = None
        self._prev: torch.Tensor | None = None
        self._prev_step = -2

    # -- wiring ------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.detach()
        self._engine = engine
        for p in engine.module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._on_local_grad))
        opt = compat.basic_optimizer(engine)
        self._handles.append(opt.register_step_pre_hook(self._on_pre_step))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._engine = None
        self._prev = self._cur = None  # a new engine: the next step starts a new pair

    # -- hot path ----------------------------------------------------------------------
    def begin_micro_step(self) -> None:
        """Before a micro-batch's forward: decide whether this optimizer step is measured
        (every replica decides the same from the shared step counter)."""
        eng = self._engine
        if eng is None:
            self._measuring = False
            return
        self._single = (eng.gradient_accumulation_steps() == 1
                        and (dist.get_world_size() if dist.is_initialized() else 1) == 1)
        # a single-gradient step is measured also just before a measured one (its pair)
        self._measuring = (eng.global_steps % self.interval == 0
                           or (self._single and (eng.global_steps + 1) % self.interval == 0))
        if eng.micro_steps % eng.gradient_accumulation_steps() == 0:
            self._local.zero_()
            self._total.zero_()

    def _on_local_grad(self, grad: torch.Tensor) -> None:
        if self._measuring:
            flat = grad.detach().reshape(-1).float()
            self._local += torch.dot(flat, flat).double()

    def _on_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._measuring:
            return
        grads = [p.grad.detach().reshape(-1).float() for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        for g in grads:
            self._total += torch.dot(g, g).double()
        if self._single and grads:
            self._cur = torch.cat(grads)

    def end_step(self, stepped: bool) -> bool:
        """After ``engine.step()`` at an accumulation boundary (``stepped``: the optimizer
        update was applied, not skipped for overflow). Returns whether a sample was taken."""
        eng = self._engine
        if eng is None or not self._measuring:
            return False
        self._measuring = False
        world = dist.get_world_size() if dist.is_initialized() else 1
        stage = eng.zero_optimization_stage()
        buf = torch.stack([self._local, self._total])
        if world > 1:
            dist.all_reduce(buf)  # the replicas' local sums; ZeRO partitions' totals
        local, total = float(buf[0]), float(buf[1])
        if stage == 0 and world > 1:
            total /= world  # every replica held the whole averaged gradient
        if not stepped:
            self._prev = None
            return False
        if self._single:
            return self._differenced(eng, total)
        gas = eng.gradient_accumulation_steps()
        scale = float(getattr(eng.optimizer, "loss_scale", 1.0) or 1.0)
        count = world * gas
        # hooks saw g_i * loss_scale / gas; the update's gradient is mean_i g_i (unscaled)
        local_sqr = local * (gas / scale) ** 2 / count
        batch = count * eng.train_micro_batch_size_per_gpu()
        return self.estimator.update(local_sqr, total, count,
                                     batch / self.estimator.init_batch_size)

    def _differenced(self, eng: Any, cur_sqr: float) -> bool:
        """One gradient per step: this step's and the previous one's as a pair."""
        cur, self._cur = self._cur, None
        step = int(eng.global_steps)  # (already counts this step)
        prev, consecutive = self._prev, self._prev_step == step - 1
        self._prev, self._prev_step = cur, step
        if cur is None or prev is None or not consecutive or prev.shape != cur.shape:
            return False
        if step % self.interval:  # (this one only pairs with the next)
            return False
        # (the optimizer's gradients are averaged and unscaled already)
        prev_sqr = float(torch.dot(prev, prev))
        pair = prev + cur
        total = float(torch.dot(pair, pair)) / 4.0
        local = (prev_sqr + cur_sqr) / 2.0
        batch = 2 * eng.train_micro_batch_size_per_gpu()
        return self.estimator.update(local, total, 2, batch / self.estimator.init_batch_size,
                                     differenced=True)

    def stats(self) -> GradNoise | None:
        return self.estimator.stats()
