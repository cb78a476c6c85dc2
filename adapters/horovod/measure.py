"""Step timing and gradient noise scale for Horovod workers (Pollux Sec. 3.1-3.2).

Horovod averages gradients itself (one ``allreduce_async_`` per parameter, issued from
autograd hooks), so the measurement sits where Horovod hands each parameter's *local*
gradient to the all-reduce (:mod:`.optimizer` calls :meth:`HorovodMeasurement.on_local_grad`
there) and around ``synchronize()``:

1. ``on_local_grad``: this rank's pre-conditioned ``|g_k|^2`` per parameter (no sync);
2. ``before_sync``: one small all-reduce (sum over ranks) of those squared norms, issued
   asynchronously so it overlaps the gradients' all-reduce;
3. ``after_sync``: ``|mean_k g_k|^2`` of the averaged gradient; both moments go to the
   pure estimator :class:`pollux_launch.tuning.gns.GNSEstimator` (Pollux Eqn 4-6, PGNS
   Eqn 5), and the step's time to :class:`pollux_launch.tuning.profile.StepProfile`
   (the throughput model's data, Eqn 7-11).

With ``K`` ranks the ``K`` local gradients are the samples (``count = K``; each covers
``local_bsz * backward_passes_per_step`` examples). Horovod accumulates the
``backward_passes_per_step`` micro-batches into ``p.grad`` before its hook fires, so the
micro-batches are not seen separately; with one rank, consecutive steps are differenced
(``count = 2``, slightly biased, as in adaptdl). The scalar all-reduce runs on *every*
step when ``K > 1``, so ranks that join after a reset never disagree on the schedule.

No step reads a value back (issue 31): each step leaves its statistics as a row on the
device, and the rows are folded into the estimator in one copy by :meth:`HorovodMeasurement.
flush` - in :meth:`~HorovodMeasurement.stats`, which the control calls at its decisions,
scheduled points (``pollux_launch.tuning.sync_points``); there too, under a control
(``scheduled``), the pre-conditioner's ``1/P`` is refreshed. With one rank the step's
gradient is kept, flat, in one of two persistent rows, and one matrix-vector product gives
``[prev.cur, cur.cur]``, whence ``|prev + cur|^2 = |prev|^2 + |cur|^2 + 2 prev.cur``.

The configuration (``K`` = ``hvd.size()``, nodes = ``hvd.cross_size()``) is re-read at
every step, so an elastic reset needs no callback: the step after it starts a new
profile key (with warm-up) and a new estimator step. The state is plain JSON;
:meth:`sync` broadcasts rank 0's to all ranks as bytes (no pickle), which the Horovod
``TorchState`` does after every reset that adds workers (see :mod:`.optimizer`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from pollux_launch.tuning.device_rows import DeviceRows
from pollux_launch.tuning.gns import GNSEstimator, GradNoise
from pollux_launch.tuning.preconditioner import make_preconditioner
from pollux_launch.tuning.profile import ProfileKey, StepProfile
from pollux_launch.tuning.sync_points import SyncPoints

STATE_VERSION = 1


def _sqr(t: torch.Tensor) -> torch.Tensor:
    """``|t|^2`` as a 0-d tensor (a BLAS dot on CPU; summed in float64 by the caller)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        flat = t.reshape(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


def _sqr_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of 0-d squared norms (one stack, one sum)."""
    return torch.stack(parts).sum(dtype=torch.float64)


class HorovodMeasurement:
    """Per-rank step timing and gradient statistics for one Horovod optimizer.

    ``hvd`` is the ``horovod.torch`` module (passed in); ``params`` the optimizer's
    trainable parameters in ``param_groups`` order. ``local_bsz`` is the per-rank batch
    of one backward pass and ``init_batch_size`` the job's ``M0`` (default: ``local_bsz``
    times the world size at the first step). Without ``local_bsz`` nothing is measured
    until :meth:`set_batch` gives it.
    """

    def __init__(
        self,
        hvd: Any,
        optimizer: torch.optim.Optimizer,
        *,
        local_bsz: int | None = None,
        init_batch_size: int | None = None,
        gns: bool = True,
        timing: bool = True,
        preconditioner: str = "auto",
        smoothing: float = 0.999,
        warmup_steps: int = 3,
        refresh_every: int = 10,
        op_sum: bool = False,
        loss_averaged_over_accum: bool = True,
        process_set: Any | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        for name, v in (("local_bsz", local_bsz), ("init_batch_size", init_batch_size)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        self.hvd = hvd
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = [
            p for g in optimizer.param_groups for p in g["params"] if p.requires_grad
        ]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.gns = gns
        self.timing = timing
        self.preconditioner = make_preconditioner(preconditioner, optimizer)
        self.smoothing = smoothing
        self.estimator: GNSEstimator | None = (
            GNSEstimator(init_batch_size, smoothing) if init_batch_size else None
        )
        self.profile = StepProfile(warmup_steps)
        self.local_bsz = local_bsz
        self.refresh_every = refresh_every
        self.op_sum = op_sum
        self.loss_averaged_over_accum = loss_averaged_over_accum
        self.process_set = process_set
        self._clock = clock
        # scheduled: an owner (the control) calls stats() at its scheduled points, where
        # 1/P is refreshed too; else 1/P every refresh_every steps
        self.scheduled = False
        self.sync_points = SyncPoints()  # where it reads values (the control's too)
        self.accum_steps = 0  # backward_passes_per_step - 1, read from the optimizer
        self.num_replicas = 0  # 0: not configured yet
        self.num_nodes = 0
        self.steps = 0  # synchronised steps measured by this rank
        self.resets = 0  # configuration changes seen (first one included)
        self.last_step_time: float | None = None
        self._inv: list[torch.Tensor] | None = None
        self._parts: list[torch.Tensor] = []
        self._handle: Any | None = None
        self._buf: torch.Tensor | None = None
        # one rank: flat fp32 copies of this step's and the previous step's gradients in
        # the two rows of _pair (_row: this step's; _paired: the other one holds the last)
        self._pair: torch.Tensor | None = None
        self._rows_of: tuple[torch.Tensor, ...] = ()
        self._views: tuple[list[torch.Tensor], ...] = ()
        self._present: tuple[int, ...] | None = None  # which gradients are in it (None: all)
        self._row = 0
        self._paired = False
        # steps not folded in yet: device rows (by kind) and, in order, their host part
        self._pending = DeviceRows(("differenced", "sampled"))
        self._last_sqr: float | None = None  # |cur|^2 of the last differenced row folded
        self._t_last: float | None = None

    # -- configuration -------------------------------------------------------------------
    def set_batch(self, local_bsz: int | None = None, accum_steps: int | None = None) -> None:
        """A new per-rank batch (or accumulation count) from the next step on."""
        if local_bsz is not None:
            if not isinstance(local_bsz, int) or local_bsz < 1:
                raise ValueError(f"local_bsz must be a positive integer, got {local_bsz!r}")
            self.local_bsz = local_bsz
        if accum_steps is not None:
            self.accum_steps = accum_steps
        self.num_replicas = 0  # re-key at the next step

    def _configure(self, accum_steps: int) -> None:
        size = self.hvd.size() if self.process_set is None else self.process_set.size()
        if size == self.num_replicas and accum_steps == self.accum_steps:
            return
        self.num_replicas, self.accum_steps = size, accum_steps
        self.num_nodes = max(1, min(self.hvd.cross_size(), size))
        self.resets += 1
        self._paired = False
        self._t_last = None  # the reset's pause is not a step
        if self.local_bsz is not None:
            self.profile.set_key(
                ProfileKey(self.num_nodes, self.num_replicas, self.local_bsz, accum_steps))
            if self.estimator is None:
                self.estimator = GNSEstimator(self.local_bsz * size, self.smoothing)

    @property
    def _active(self) -> bool:
        return self.gns and self.local_bsz is not None

    # -- hot path ------------------------------------------------------------------------
    def on_local_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """One parameter's local (accumulated) gradient, just before Horovod reduces it."""
        # num_replicas is last step's (0 before the first): collect unless it was one rank.
        if not self._active or self.num_replicas == 1 or grad.is_sparse:
            return
        if self._inv is not None:
            grad = grad * self._inv[self._index[id(param)]]
        self._parts.append(_sqr(grad))

    def before_sync(self, accum_steps: int) -> None:
        """The local backward passes are done: issue the scalar all-reduce (every step
        with more than one rank, so that all ranks' collectives always match)."""
        self._configure(accum_steps)
        if not self._active or self.num_replicas == 1:
            if self._parts:
                self._parts = []
            return
        parts, self._parts = self._parts, []
        # [sum of local squared norms, ranks without a sample]: a rank that was alone
        # last step collected nothing, and then every rank skips this step together.
        local = (_sqr_sum(parts) if parts
                 else torch.zeros((), dtype=torch.float64, device=self.params[0].device))
        self._buf = torch.stack([local, local.new_full((), 0.0 if parts else 1.0)])
        self._handle = self.hvd.allreduce_async_(
            self._buf, name="pollux.gns.local_sqr", op=self.hvd.Sum,
            **({} if self.process_set is None else {"process_set": self.process_set}))

    def after_sync(self, sync_start: float) -> None:
        """The gradients are averaged: this step's statistics (a row, on the device) and
        time."""
        now = self._clock()
        if self.timing and self.local_bsz is not None and self._t_last is not None:
            self.profile.record(now - self._t_last, now - sync_start)
            self.last_step_time = now - self._t_last
        if self._active:
            if self._handle is not None:
                self._finish_sampled()
            elif self.num_replicas == 1:
                self._finish_differenced()
        self.steps += 1
        if not self.scheduled and self.steps % self.refresh_every == 0 and self.gns:
            # Between steps, so one step's local and total norms use the same 1/P.
            self._inv = self.preconditioner.inverse(self.params)
        self._t_last = self._clock()

    def abort_step(self) -> None:
        """The step failed (a Horovod reset): drop its half-measured state."""
        self._parts, self._handle, self._buf = [], None, None
        self._paired = False
        self._t_last = None

    def _grads(self) -> list[torch.Tensor]:
        grads = [p.grad for p in self.params]
        if self._inv is None:
            return [g for g in grads if g is not None and not g.is_sparse]
        return [g * r for g, r in zip(grads, self._inv, strict=True)
                if g is not None and not g.is_sparse]

    def _batch_scale(self, count: int) -> float:
        assert self.estimator is not None and self.local_bsz is not None
        return count * self.local_bsz * (self.accum_steps + 1) / self.estimator.init_batch_size

    def _norm_factor(self) -> float:
        # p.grad holds the SUM of the micro-batch gradients unless the loss was divided.
        n = self.accum_steps + 1
        return 1.0 if self.loss_averaged_over_accum else 1.0 / (n * n)

    def _finish_sampled(self) -> None:
        assert self._buf is not None and self.estimator is not None
        self.hvd.synchronize(self._handle)  # (Horovod's completion: no read of a value)
        self._handle = None
        with torch.no_grad():
            grads = self._grads()
            buf = self._buf
            total = _sqr_sum([_sqr(g) for g in grads]) if grads else buf[0] * 0.0
            # [sum of local |g_k|^2, |mean g|^2, ranks without a sample]
            row = torch.stack([buf[0], total.to(buf.device), buf[1]])
        k = self.num_replicas
        self._record("sampled", row, (k, self.op_sum, self._norm_factor(),
                                      self._batch_scale(k)))

    def _finish_differenced(self) -> None:
        grads = [p.grad for p in self.params]
        some = [g for g in grads if g is not None and not g.is_sparse]
        if not some:
            self._paired = False
            return
        present = (None if len(some) == len(grads) else
                   tuple(i for i, g in enumerate(grads) if g is not None and not g.is_sparse))
        if self._pair is None or present != self._present:  # (no pair with the last step)
            self._present, self._paired = present, False
            sizes = [g.numel() for g in some]
            self._views_of(torch.zeros(2, sum(sizes), dtype=torch.float32,
                                       device=some[0].device), sizes, some)
        self._row = row = self._row ^ 1
        cur = self._views[row]
        torch._foreach_copy_(cur, some)
        if self._inv is not None:
            inv = self._inv if present is None else [self._inv[i] for i in present]
            torch._foreach_mul_(cur, inv)
        dots = torch.mv(self._pair, self._rows_of[row])  # type: ignore[arg-type]
        if dots.requires_grad:  # (gradients of create_graph=True): no graph kept
            dots = dots.detach()
            self._views_of(self._pair.detach(), [g.numel() for g in some], some)
        self._record("differenced", dots, (row, self._paired, self._norm_factor(),
                                           self._batch_scale(2)))
        self._paired = True

    def _record(self, kind: str, row: torch.Tensor, meta: tuple[Any, ...]) -> None:
        if self._pending.add(kind, row, meta):  # (bounded: without a control, none reads them)
            self.flush()

    def _views_of(self, pair: torch.Tensor, sizes: list[int], grads: list[torch.Tensor]
                  ) -> None:
        self._pair = pair
        self._rows_of = (pair[0], pair[1])
        self._views = tuple([v.view(g.shape) for v, g in zip(r.split(sizes), grads,
                                                               strict=True)]
                            for r in self._rows_of)

    # -- reading (at scheduled points) ----------------------------------------------------
    def flush(self) -> int:
        """Fold the pending steps into the estimator (one device->host copy per kind of
        row); returns how many were accepted."""
        if not self._pending:
            return 0
        est, taken = self.estimator, 0
        assert est is not None
        for m, row in self._pending.take():
            if m[0] == "sampled":
                _, k, op_sum, f, scale = m
                local, total, missing = row
                if missing > 0:
                    continue
                if op_sum:
                    total = total / (k * k)  # op=Sum: the reduced gradient is K times the mean
                taken += est.update(local / k * f, total * f, k, scale)
                continue
            _, r, paired, f, scale = m
            cur, cross = (row[0], row[1]) if r == 0 else (row[1], row[0])
            prev, self._last_sqr = self._last_sqr, cur
            if paired and prev is not None:
                taken += est.update((cur + prev) / 2.0 * f,
                                    (prev + cur + 2.0 * cross) / 4.0 * f, 2, scale,
                                    differenced=True)
        return taken

    def stats(self) -> GradNoise | None:
        """Smoothed gradient statistics normalised to ``M0`` (None before any); the
        pending steps folded in first (and, ``scheduled``, 1/P refreshed: between steps)."""
        self.flush()
        if self.scheduled and self.gns:
            self._inv = self.preconditioner.inverse(self.params)
        return self.estimator.stats() if self.estimator is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the estimator (pending steps folded in) and the step profile."""
        self.flush()
        return {
            "v": STATE_VERSION,
            "estimator": self.estimator.state_dict() if self.estimator is not None else None,
            "profile": self.profile.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"HorovodMeasurement state: expected a dict with v={STATE_VERSION}")
        self._pending.clear()  # (the steps of the replaced estimator)
        est = state.get("estimator")
        if est is not None:
            estimator = GNSEstimator(int(est["init_batch_size"]), float(est["smoothing"]))
            estimator.load_state_dict(est)
            self.estimator = estimator
        self.profile.load_state_dict(state["profile"])

    def sync(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s state (JSON bytes via ``hvd.broadcast``)."""
        with self.sync_points.scheduled("sync"):  # (a reset: every rank is here)
            self._sync(root_rank)

    def _sync(self, root_rank: int) -> None:
        payload = json.dumps(self.state_dict()).encode()
        n = self.hvd.broadcast(torch.tensor([len(payload)], dtype=torch.int64), root_rank,
                               name="pollux.state.len")
        buf = torch.zeros(int(n[0]), dtype=torch.uint8)
        if self.hvd.rank() == root_rank:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        buf = self.hvd.broadcast(buf, root_rank, name="pollux.state")
        if self.hvd.rank() != root_rank:
            self.load_state_dict(json.loads(bytes(buf.numpy()).decode()))
        self.abort_step()

    def fit_inputs(self) -> dict[str, Any]:
        """The step profile as ``goodput.fit_perf_params`` keyword arguments."""
        return self.profile.fit_inputs()

