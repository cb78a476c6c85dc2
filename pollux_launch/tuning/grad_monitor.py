"""Measuring the gradient statistics of a torch training job (feeds :mod:`.gns`).

The measurement protocol, one optimiser step at a time (each call is cheap and has no
host-device synchronisation; values are folded into the estimator in batches):

1. for every micro-batch's *local* gradient (before it is averaged across replicas):
   :meth:`GradientNoiseMonitor.on_local_grad` per parameter (a tensor hook) or
   :meth:`~GradientNoiseMonitor.add_local` for a whole list, then
   :meth:`~GradientNoiseMonitor.end_micro_step`;
2. on the synchronising micro-step, right after the local gradients exist:
   :meth:`~GradientNoiseMonitor.reduce_local_async` - one small all-reduce issued
   asynchronously, so it overlaps the gradient all-reduce;
3. once the gradients are averaged: :meth:`~GradientNoiseMonitor.finish_step` (on *every*
   synchronising step, measured or not: it keeps the replicas' schedules in step).

:func:`pollux_launch.tuning.hooks.attach_measurement` drives this from autograd hooks for
torch DDP (or a single process); other adapters (Horovod, DeepSpeed) can call it directly.

Cost control. Measuring costs about two passes over the gradients. The monitor times its
own work and measures only every ``interval``-th step, with ``interval`` chosen so that
the cost stays within ``overhead_budget`` of the step time (at most ``max_interval``). The
EMA decay of a measured step accounts for the steps in between, so the averaging window
in training progress is unchanged. The cost ratio rides along in the scalar all-reduce
and ``interval`` changes only at a fixed count of measured steps, so every replica keeps
the same schedule (their all-reduces must match) without extra communication. With
``scheduled=True`` (``ElasticTrainer``'s) it changes, and the pending rows are read back,
only in :meth:`GradientNoiseMonitor.sync_point`, which the owner calls at points every
replica reaches at the same step (its decisions): the steps in between never wait for
the device (``tuning.sync_points``).

Conventions: the averaged gradient after the step is ``(1/K) * sum`` over replicas and
``sum`` over the ``s + 1`` micro-batches (DDP semantics with the loss *not* divided by the
number of micro-batches); pass ``loss_averaged_over_accum=True`` to :meth:`configure` if the
loss is divided by ``s + 1``. Gradients scaled by an AMP ``GradScaler`` are unscaled here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .gns import GNSEstimator, GradNoise
from .preconditioner import Preconditioner, make_preconditioner

_DOT_DTYPES = (torch.float32, torch.float64)
# Self-timed cost misses cache effects on the rest of the step: aim at half of 1 %.
DEFAULT_OVERHEAD_BUDGET = 0.005
DEFAULT_MAX_INTERVAL = 32
_FIRST_ADAPT = 8  # measured steps before the interval is first adapted (then every flush)


def _sqr(t: torch.Tensor) -> torch.Tensor:
    """``|t|^2`` as a 0-d tensor; a BLAS dot on CPU, a float32-accumulated norm otherwise."""
    if t.dtype in _DOT_DTYPES and t.device.type == "cpu":
        flat = t.reshape(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


def _sum_parts(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of 0-d tensors as a float64 0-d tensor: on a GPU three kernels whatever
    their number (a kernel launch costs more host time than the arithmetic)."""
    if all(p.dtype == parts[0].dtype for p in parts):
        return torch.stack(list(parts)).double().sum()
    return torch.stack([p.double() for p in parts]).sum()


def _sqr_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_i |t_i|^2`` as a float64 0-d tensor."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    if tensors[0].device.type == "cpu":
        return _sum_parts([_sqr(t) for t in tensors])
    # one fused norm kernel for the whole list, then the squares summed in float64
    norms = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms, dtype=torch.float64).square()


class GradientNoiseMonitor:
    """Per-worker gradient-noise measurement (Pollux Sec. 3.1, PGNS Eqn 5).

    With ``K > 1`` replicas or ``s > 0`` accumulation steps, the ``K * (s + 1)`` local
    micro-batch gradients are the samples (unbiased); with one replica and no
    accumulation, consecutive steps are differenced (slightly biased). Every worker
    computes the same statistics; rank 0's are the ones reported.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        init_batch_size: int,
        *,
        preconditioner: str | Preconditioner = "auto",
        smoothing: float = 0.999,
        grad_scaler: Any | None = None,
        overhead_budget: float | None = DEFAULT_OVERHEAD_BUDGET,
        max_interval: int = DEFAULT_MAX_INTERVAL,
        refresh_every: int = 10,
        flush_every: int = 32,
        clock: Callable[[], float] = time.perf_counter,
        sharded: bool = False,
        scheduled: bool = False,
    ) -> None:
        if refresh_every < 1 or flush_every < 1 or max_interval < 1:
            raise ValueError("refresh_every, flush_every and max_interval must be >= 1")
        if overhead_budget is not None and not overhead_budget > 0:
            raise ValueError(f"overhead_budget must be positive or None, got {overhead_budget}")
        self.params: list[torch.Tensor] = [
            p for g in optimizer.param_groups for p in g["params"] if p.requires_grad
        ]
        if not self.params:
            raise ValueError("the optimizer has no trainable parameters to measure")
        self.preconditioner: Preconditioner = (
            make_preconditioner(preconditioner, optimizer)
            if isinstance(preconditioner, str)
            else preconditioner
        )
        self.estimator = GNSEstimator(init_batch_size, smoothing)
        # sharded (FSDP2): each replica holds a shard of the averaged gradient, whose
        # squared norm is then the sum over replicas (one more scalar all-reduce)
        self.sharded = sharded
        # scheduled: the owner calls sync_point() at its scheduled points, the only
        # places that read device values; otherwise every flush_every measured steps
        self.scheduled = scheduled
        self.grad_scaler = grad_scaler
        self.overhead_budget = overhead_budget
        self.max_interval = max_interval
        self.interval = 1  # measure every interval-th step (same on every replica)
        self._refresh_every = refresh_every
        self._since_refresh = 0  # measured steps since 1/P was last refreshed (scheduled)
        self._flush_every = flush_every
        self._clock = clock
        # Cached 1/P, refreshed between steps every few measured steps (the optimiser's
        # second moment moves slowly); never within a step, so local and total agree.
        self._inv: list[torch.Tensor] | None = self.preconditioner.inverse(self.params)
        self._measured = 0  # measured steps since construction (schedule of updates)
        self._pending: list[torch.Tensor] = []  # (local_sqr, total_sqr) rows, on device
        self._meta: list[tuple[int, float, bool, int]] = []
        self._cost_ratio = 0.0  # this replica's last measured cost / step time
        self._shared_ratio: torch.Tensor | None = None  # its mean over replicas
        self.configure(num_replicas=1, local_bsz=init_batch_size)

    # -- configuration ---------------------------------------------------------------
    def configure(
        self,
        *,
        num_replicas: int,
        local_bsz: int,
        accum_steps: int = 0,
        process_group: Any | None = None,
        loss_averaged_over_accum: bool = False,
        reduce_local: bool = True,
    ) -> None:
        """Set the current allocation and batch shape (call on every replica after every
        rescale or batch change, at a step boundary). Drops any half-measured step.

        ``reduce_local=False`` when this process itself feeds every replica's local
        gradients (a single-process simulation, or a framework that gathered them): the
        local squared norms are then not all-reduced.
        """
        if num_replicas < 1 or local_bsz < 1 or accum_steps < 0:
            raise ValueError(
                f"need num_replicas >= 1, local_bsz >= 1, accum_steps >= 0; got "
                f"{num_replicas}, {local_bsz}, {accum_steps}"
            )
        self.num_replicas = num_replicas
        self.local_bsz = local_bsz
        self.accum_steps = accum_steps
        self.process_group = process_group
        self.loss_averaged_over_accum = loss_averaged_over_accum
        self.reduce_local = reduce_local
        # One replica, no accumulation: no local samples to compare, difference steps (a
        # sharded model at one replica too: FSDP then reduces nothing, where the local
        # gradients are seen)
        self.differenced = num_replicas == 1 and (accum_steps == 0 or self.sharded)
        self.collect_local = not self.differenced
        self._step = 0  # synchronising steps since configure
        # the measurement schedule restarts here on every replica alike (newcomers too):
        # measure every step until the interval is adapted again, from shared numbers
        self._measured = 0
        self.interval = 1
        self._shared_ratio = None
        self._last_record: int | None = None
        self._last_finish: float | None = None
        self._prev: list[torch.Tensor] | None = None  # differenced: the previous step
        self._prev_sqr: torch.Tensor | None = None
        self._prev_key: tuple[int, list[int]] | None = None
        self._spare: list[torch.Tensor] | None = None
        self._reset_step()

    def _reset_step(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._micro = 0
        self._local: torch.Tensor | None = None
        self._work: Any | None = None
        self._cost = 0.0
        k = self.interval
        if self.differenced:  # two consecutive steps: capture one, estimate on the next
            self.measuring = self._step % k == 0 or (self._step + 1) % k == 0
        else:
            self.measuring = self._step % k == 0
        self._local_active = self.collect_local and self.measuring

    # -- hot path ----------------------------------------------------------------------
    def on_local_grad(self, index: int, grad: torch.Tensor) -> None:
        """Tensor-hook body: one parameter's local micro-batch gradient."""
        if not self._local_active:
            return
        t0 = self._clock()
        if self._inv is not None:
            grad = grad * self._inv[index]
        self._parts.append(_sqr(grad))
        self._cost += self._clock() - t0

    def add_local(
        self, grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> None:
        """A whole micro-batch's local gradients at once (``indices`` into ``params``,
        default all, in order)."""
        if not self._local_active or not grads:
            return
        t0 = self._clock()
        if self._inv is not None:
            inv = self._inv if indices is None else [self._inv[i] for i in indices]
            grads = torch._foreach_mul(list(grads), inv)
        self._parts.append(_sqr_sum(grads))
        self._cost += self._clock() - t0

    def end_micro_step(self) -> None:
        """One micro-batch's backward is complete (on this replica)."""
        self._micro += 1

    def reduce_local_async(self) -> None:
        """Sum the local squared norms over replicas, asynchronously (call on the
        synchronising micro-step as soon as the local gradients exist)."""
        if not self._local_active or self._local is not None:
            return
        t0 = self._clock()
        if self._parts:
            local = _sum_parts(self._parts)
        else:
            local = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        self._parts = []
        # [local squared norms, measurement cost ratio]: the ratio is averaged over
        # replicas for free, so all of them pick the same measurement interval.
        # (torch.full: a fill on the device, where copying a host scalar would wait)
        buf = torch.stack([local, torch.full((), self._cost_ratio, dtype=torch.float64,
                                             device=local.device)])
        if self.num_replicas > 1 and self.reduce_local:
            self._work = dist.all_reduce(buf, group=self.process_group, async_op=True)
        self._local = buf
        self._cost += self._clock() - t0

    def unmeasured_ahead(self) -> int:
        """How many synchronising steps from the next one on the schedule leaves
        unmeasured (their local gradients unsampled too): the steps an owner may finish
        together with :meth:`skip_steps`. Changes only with the interval (at a
        ``sync_point``)."""
        if self.measuring:
            return 0
        k, s = self.interval, self._step
        # (differenced: the capture step k-1 comes before the estimate step 0)
        return (k - 1 - s % k) if self.differenced else (k - s % k)

    def skip_steps(self, n: int) -> None:
        """``n`` unmeasured synchronising steps (at most :meth:`unmeasured_ahead`) ended
        without :meth:`finish_step`: the schedule moves on as if each had, the last at
        this moment."""
        if n > 0:
            self._step += n
            self._last_finish = self._clock()
            self._reset_step()

    def finish_step(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """The gradients (``grads`` aligned with ``params``; default ``p.grad``) are now
        averaged across replicas and micro-batches: record this step's statistics.
        Call on every synchronising step, measured or not (an unmeasured one costs a few
        attribute updates: no tensor is touched)."""
        if not self.measuring:
            self._step += 1
            self._last_finish = self._clock()
            self._reset_step()
            return
        t0 = self._clock()
        try:
            with torch.no_grad():
                self._measure(grads)
        finally:
            self._end_step(t0)

    def _measure(self, grads: Sequence[torch.Tensor | None] | None) -> None:
        if grads is None:
            grads = [p.grad for p in self.params]
            if self.sharded:  # FSDP2's gradients are DTensors: their local shards
                grads = [g if g is None else g._local_tensor for g in grads]
        idx = [i for i, g in enumerate(grads) if g is not None]
        present = [grads[i] for i in idx]  # type: ignore[misc]
        if present:
            amp = self._amp_scale()
            if self.differenced:
                self._finish_differenced(present, idx, amp)
            else:
                self._finish_sampled(present, idx, amp)

    def _end_step(self, t0: float) -> None:
        """After a measured step: its cost ratio, the schedule (module docstring)."""
        now = self._clock()
        if self._last_finish is not None:
            step_time = now - self._last_finish
            if step_time > 0:  # smoothed: one slow step should not swing the interval
                ratio = (self._cost + now - t0) / step_time
                self._cost_ratio = (
                    ratio if not self._cost_ratio else (0.5 * self._cost_ratio + 0.5 * ratio)
                )
        self._last_finish = now
        self._step += 1
        self._measured += 1
        self._since_refresh += 1
        if not self.scheduled and self._measured % self._refresh_every == 0:
            # For the next step: its local norms must use the same 1/P as its total.
            self._inv = self.preconditioner.inverse(self.params)
        if not self.scheduled:
            if self._measured % self._flush_every == 0 or self._measured == _FIRST_ADAPT:
                self._update_interval()  # at the same measured step on every replica
                self.flush()
        elif len(self._pending) >= 4 * self._flush_every:
            self.flush()  # (no sync point came for long: the rows stay bounded)
        self._reset_step()

    def sync_point(self) -> None:
        """At a scheduled point that every replica reaches at the same step (a decision:
        ``tuning.sync_points``): fold the pending rows into the estimator and adapt the
        measurement interval, refresh the preconditioner (Adam's step count may live on
        the device) - the things that read device values. Between steps: a step's local
        norms and its total use the same 1/P."""
        if self._measured >= _FIRST_ADAPT:
            self._update_interval()
            self._reset_step()  # (whether the next step is measured follows the interval)
        self.flush()
        # 1/P moves slowly: refreshed as often as unscheduled (every refresh_every
        # measured steps), or as soon as it can be once it could not (Adam's first steps)
        if self._since_refresh >= self._refresh_every or (
                self._inv is None and self._since_refresh):
            self._inv = self.preconditioner.inverse(self.params)
            self._since_refresh = 0

    def restart_clock(self) -> None:
        """Forget the last step's end time (after a pause in training or in measuring),
        so that the pause is not taken for a long step."""
        self._last_finish = None

    def _update_interval(self) -> None:
        if self.overhead_budget is None:
            return
        if self.differenced or self._shared_ratio is None:
            ratio = self._cost_ratio  # one replica: nothing to agree on
        else:
            ratio = float(self._shared_ratio)
        # ratio is the cost of one measured step relative to a step's time.
        if self.differenced:
            ratio *= 2  # a capture step and an estimate step per measurement
        want = math.ceil(ratio / self.overhead_budget) if ratio > 0 else 1
        self.interval = max(1, min(self.max_interval, want))

    def _finish_sampled(
        self, grads: list[torch.Tensor], idx: list[int], amp: torch.Tensor | None
    ) -> None:
        if self._local is None:
            self.reduce_local_async()  # a caller that skipped step 2
        if self._work is not None:
            self._work.wait()
        assert self._local is not None
        n = max(self._micro, 1)
        count = self.num_replicas * n
        if self.num_replicas > 1 and self.reduce_local:
            self._shared_ratio = self._local[1] / self.num_replicas
        if count < 2:
            return
        if self._inv is not None:
            grads = torch._foreach_mul(grads, [self._inv[i] for i in idx])
        total = _sqr_sum(grads)
        if self.sharded and self.num_replicas > 1:
            dist.all_reduce(total, group=self.process_group)
        local = self._local[0].to(total.device)
        if self.loss_averaged_over_accum:
            local = local * (n * n)  # the hooks saw g_i / n
        else:
            total = total / (n * n)  # the summed gradient -> the mean micro-batch gradient
        row = torch.stack([local / count, total])
        if amp is not None:
            row = row / amp.double().to(row.device) ** 2
        scale = count * self.local_bsz / self.estimator.init_batch_size
        self._record(row, count, scale, False)

    def _finish_differenced(
        self, grads: list[torch.Tensor], idx: list[int], amp: torch.Tensor | None
    ) -> None:
        # Two persistent float buffers take turns as "current" and "previous": no
        # allocation per step.
        key = (self._step, idx)
        cur = self._spare
        if (
            cur is None
            or len(cur) != len(grads)
            or any(c.shape != g.shape for c, g in zip(cur, grads, strict=True))
        ):
            cur = [torch.empty_like(g, dtype=torch.float32) for g in grads]
        torch._foreach_copy_(cur, grads)
        if self._inv is not None:
            torch._foreach_mul_(cur, [self._inv[i] for i in idx])
        if amp is not None:
            torch._foreach_div_(cur, amp.to(cur[0].device))
        cur_sqr = _sqr_sum(cur)
        prev, prev_sqr = self._prev, self._prev_sqr
        if (
            prev is not None
            and prev_sqr is not None
            and self._prev_key == (self._step - 1, idx)
            and self._step % self.interval == 0
        ):
            torch._foreach_add_(prev, cur)  # prev is not needed afterwards: sum in place
            total = _sqr_sum(prev) / 4.0
            row = torch.stack([(cur_sqr + prev_sqr.to(cur_sqr.device)) / 2.0, total])
            scale = 2 * self.local_bsz / self.estimator.init_batch_size
            self._record(row, 2, scale, True)
        self._spare = prev
        self._prev, self._prev_sqr, self._prev_key = cur, cur_sqr, key

    def _record(self, row: torch.Tensor, count: int, scale: float, differenced: bool) -> None:
        # Steps since the last record: the EMA decays for the skipped steps too.
        steps = 1 if self._last_record is None else self._step - self._last_record
        self._last_record = self._step
        self._pending.append(row)
        self._meta.append((count, scale, differenced, steps))

    def _amp_scale(self) -> torch.Tensor | None:
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        get_async = getattr(scaler, "_get_scale_async", None)
        scale = get_async() if get_async is not None else None
        if scale is None:
            return torch.tensor(float(scaler.get_scale()), dtype=torch.float64)
        return scale

    # -- reading ------------------------------------------------------------------------
    def flush(self) -> int:
        """Fold the pending steps into the estimator (one device->host copy)."""
        if not self._pending:
            return 0
        dev = self._pending[0].device
        rows = torch.stack([r.to(dev) for r in self._pending]).cpu().numpy()
        meta, self._pending, self._meta = self._meta, [], []
        return self.estimator.update_many(rows, meta)

    def stats(self) -> GradNoise | None:
        """Current smoothed statistics normalised to ``M0`` (None before any)."""
        self.flush()
        return self.estimator.stats()

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON (the estimator's state and the measurement interval)."""
        self.flush()
        return {"estimator": self.estimator.state_dict(), "interval": self.interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending, self._meta = [], []
        try:
            self.estimator.load_state_dict(state["estimator"])
            self.interval = max(1, min(self.max_interval, int(state["interval"])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"GradientNoiseMonitor state is malformed: {exc}") from None
        self._reset_step()
