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
The steps never read a value back (issue 31): each measured step leaves a row on the
device, and the rows are folded into the estimator in one copy by :meth:`DeepSpeedGradStats.
stats` (or ``flush``) - at the controller's decisions, scheduled points
(``pollux_launch.tuning.sync_points``). A single-gradient step keeps its flat fp32 copy
in one of two persistent rows and needs one matrix-vector product: ``[prev.cur, cur.cur]``,
whence ``|prev + cur|^2 = |prev|^2 + |cur|^2 + 2 prev.cur``.

DeepSpeed divides the loss by ``s`` before backward and multiplies it by the loss scale;
both are undone here. Gradient clipping, when configured, happens before the optimizer
step and so biases ``total_sqr`` down (clip rarely in steady state). No pre-conditioning
yet (PGNS for Adam, Eqn 5, needs per-partition optimizer state; see README).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pollux_launch.tuning.device_rows import DeviceRows
from pollux_launch.tuning.gns import GNSEstimator, GradNoise

from . import compat


class DeepSpeedGradStats:
    """Measures ``(local_sqr, total_sqr)`` every ``interval``-th optimizer step and folds
    them into a :class:`GNSEstimator` (at :meth:`flush`). ``attach(engine)`` after every
    (re)build."""

    def __init__(self, init_batch_size: int, interval: int = 1, smoothing: float = 0.999,
                 estimator: GNSEstimator | None = None) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.estimator = estimator or GNSEstimator(init_batch_size, smoothing)
        self.interval = interval
        self._handles: list[Any] = []
        self._local_hooks: list[Any] = []
        self._engine: Any = None
        self._world = 1  # the default group's size, fixed for an engine's life
        self._params: list[torch.Tensor] = []  # the optimizer's, in its groups' order
        self._measuring = False
        self._single = False  # one gradient per step (one replica, no accumulation)
        self._parts: list[torch.Tensor] = []  # this step's local |g_i|^2 (0-d, device)
        self._total: torch.Tensor | None = None  # this step's |mean g|^2 (its partition)
        # one gradient per step: flat fp32 copies of this step's and the previous one's
        # in the two rows of _pair (_row: this step's), and the global step of the other
        self._pair: torch.Tensor | None = None
        self._rows_of: tuple[torch.Tensor, ...] = ()
        self._views: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._present: tuple[int, ...] | None = None  # which gradients are in it (None: all)
        self._row = 0
        self._dots: torch.Tensor | None = None  # [row 0 . cur, row 1 . cur]
        self._prev_step = -2
        # measured steps not folded in yet: device rows (by kind) and, in order, what
        # they need on the host
        self._pending = DeviceRows(("single", "sampled"))
        self._last_sqr: float | None = None  # |cur|^2 of the last single step folded in

    # -- wiring ------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.detach()
        self._engine = engine
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        opt = compat.basic_optimizer(engine)
        self._params = [p for group in opt.param_groups for p in group["params"]]
        self._pair = None
        self._handles.append(opt.register_step_pre_hook(self._on_pre_step))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._hook_local(False)
        self._engine = None
        self._prev_step = -2  # a new engine: the next step starts a new pair

    def _hook_local(self, on: bool) -> None:
        """The local-gradient hooks, only while the steps have several gradients (with
        one, its local norm is its total: P hook calls a step saved)."""
        if on == bool(self._local_hooks):
            return
        for h in self._local_hooks:
            h.remove()
        self._local_hooks = ([p.register_hook(self._on_local_grad)
                              for p in self._engine.module.parameters() if p.requires_grad]
                             if on else [])

    # -- hot path ----------------------------------------------------------------------
    def begin_micro_step(self) -> None:
        """Before a micro-batch's backward: decide whether this optimizer step is measured
        (every replica decides the same from the shared step counter)."""
        eng = self._engine
        if eng is None:
            self._measuring = False
            return
        gas = eng.gradient_accumulation_steps()
        self._single = single = gas == 1 and self._world == 1
        if single == bool(self._local_hooks):  # (hooked iff several gradients a step)
            self._hook_local(not single)
        step, every = eng.global_steps, self.interval
        # a single-gradient step is measured also just before a measured one (its pair)
        self._measuring = (every == 1 or step % every == 0
                           or (single and (step + 1) % every == 0))
        if eng.micro_steps % gas == 0:
            self._parts = []
            self._total = None

    def _on_local_grad(self, grad: torch.Tensor) -> None:
        if self._measuring:
            flat = grad.detach().reshape(-1).float()
            self._parts.append(torch.dot(flat, flat))

    def _on_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._measuring:
            return
        grads = [p.grad for p in self._params]
        some = [g for g in grads if g is not None]
        if not some:
            return
        if self._single:
            self._copy_single(some, None if len(some) == len(grads) else
                              tuple(i for i, g in enumerate(grads) if g is not None))
        else:
            flats = [g.detach().reshape(-1).float() for g in some]
            self._total = torch.stack([torch.dot(f, f) for f in flats]).sum(
                dtype=torch.float64)

    def _copy_single(self, grads: list[torch.Tensor], present: tuple[int, ...] | None
                     ) -> None:
        """This step's gradient into the pair's free row, and its products with both.
        (A gradient has its parameter's shape: which ones are present is the layout.)"""
        if self._pair is None or present != self._present:  # no pair with the last step
            self._present, self._prev_step = present, -2
            sizes = [g.numel() for g in grads]
            self._views_of(torch.zeros(2, sum(sizes), dtype=torch.float32,
                                       device=grads[0].device), sizes, grads)
        self._row = row = self._row ^ 1
        torch._foreach_copy_(self._views[row], grads)
        self._dots = torch.mv(self._pair, self._rows_of[row])  # type: ignore[arg-type]
        if self._dots.requires_grad:  # (gradients of create_graph=True): no graph kept
            self._dots = self._dots.detach()
            self._views_of(self._pair.detach(), [g.numel() for g in grads], grads)

    def _views_of(self, pair: torch.Tensor, sizes: list[int], grads: list[torch.Tensor]
                  ) -> None:
        self._pair = pair
        self._rows_of = (pair[0], pair[1])
        self._views = tuple(  # type: ignore[assignment]
            [v.view(g.shape) for v, g in zip(row.split(sizes), grads, strict=True)]
            for row in self._rows_of)

    def end_step(self, stepped: bool) -> None:
        """After ``engine.step()`` at an accumulation boundary (``stepped``: the optimizer
        update was applied, not skipped for overflow): this step's row, if measured."""
        eng = self._engine
        if eng is None or not self._measuring:
            return
        self._measuring = False
        if self._single:
            self._end_single(eng, stepped)
            return
        world = self._world
        local = torch.stack(self._parts).sum(dtype=torch.float64) if self._parts else None
        total = self._total
        if local is None or total is None:  # (no gradient seen: zero, as the peers add)
            zero = torch.zeros((), dtype=torch.float64, device=eng.device)
            local = zero if local is None else local
            total = zero if total is None else total
        buf = torch.stack([local, total.to(local.device)])
        if world > 1:
            dist.all_reduce(buf)  # the replicas' local sums; ZeRO partitions' totals
        self._parts, self._total = [], None
        if not stepped:
            return
        # every replica held the whole averaged gradient at ZeRO-0
        div = world if world > 1 and eng.zero_optimization_stage() == 0 else 1
        gas = eng.gradient_accumulation_steps()
        scale = float(getattr(eng.optimizer, "loss_scale", 1.0) or 1.0)  # (a host float)
        count = world * gas
        batch = count * eng.train_micro_batch_size_per_gpu()
        self._record("sampled", buf, (gas, scale, count, div,
                                      batch / self.estimator.init_batch_size))

    def _end_single(self, eng: Any, stepped: bool) -> None:
        """One gradient per step: this step's and the previous one's as a pair."""
        dots, self._dots = self._dots, None
        if not stepped or dots is None:
            self._prev_step = -2
            return
        step = int(eng.global_steps)  # (already counts this step)
        pair = self._prev_step == step - 1 and step % self.interval == 0
        self._prev_step = step
        batch = 2 * eng.train_micro_batch_size_per_gpu()
        self._record("single", dots, (self._row, pair, batch / self.estimator.init_batch_size))

    def _record(self, kind: str, row: torch.Tensor, meta: tuple[Any, ...]) -> None:
        if self._pending.add(kind, row, meta):  # (bounded: without a driver, none reads them)
            self.flush()

    # -- reading (at scheduled points) -------------------------------------------------
    def flush(self) -> int:
        """Fold the pending steps into the estimator (one device->host copy). Returns how
        many samples were taken."""
        est, taken = self.estimator, 0
        for m, (a, b) in self._pending.take():
            if m[0] == "sampled":
                _, gas, scale, count, div, batch_scale = m
                # hooks saw g_i * loss_scale / gas; the update's gradient is mean_i g_i
                # (unscaled, averaged)
                local_sqr = a * (gas / scale) ** 2 / count
                total = b / div if div != 1 else b
                taken += est.update(local_sqr, total, count, batch_scale)
                continue
            _, row, pair, batch_scale = m
            cur, cross = (a, b) if row == 0 else (b, a)
            prev, self._last_sqr = self._last_sqr, cur
            if pair and prev is not None:
                # (the optimizer's gradients are averaged and unscaled already)
                taken += est.update((prev + cur) / 2.0, (prev + cur + 2.0 * cross) / 4.0,
                                    2, batch_scale, differenced=True)
        return taken

    def stats(self) -> GradNoise | None:
        self.flush()
        return self.estimator.stats()

    def state_dict(self) -> dict[str, Any]:
        """The estimator's state (plain JSON), pending steps folded in."""
        self.flush()
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending.clear()  # (rows of the estimator replaced)
        self.estimator.load_state_dict(state)
