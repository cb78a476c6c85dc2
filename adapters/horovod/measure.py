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

from pollux_launch.tuning.gns import GNSEstimator, GradNoise
from pollux_launch.tuning.preconditioner import make_preconditioner
from pollux_launch.tuning.profile import ProfileKey, StepProfile

STATE_VERSION = 1


def _sqr(t: torch.Tensor) -> torch.Tensor:
    """``|t|^2`` as a float64 0-d tensor (a BLAS dot on CPU)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        flat = t.reshape(-1)
        return torch.dot(flat, flat).double()
    return torch.linalg.vector_norm(t, dtype=torch.float32).square().double()


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
        self._prev: list[torch.Tensor] | None = None  # one rank: the previous step's grads
        self._prev_sqr: torch.Tensor | None = None
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
        self._prev = self._prev_sqr = None
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
        parts, self._parts = self._parts, []
        if not self._active or self.num_replicas == 1:
            return
        # [sum of local squared norms, ranks without a sample]: a rank that was alone
        # last step collected nothing, and then every rank skips this step together.
        local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
        missing = torch.tensor(0.0 if parts else 1.0, dtype=torch.float64)
        self._buf = torch.stack([local, missing])
        self._handle = self.hvd.allreduce_async_(
            self._buf, name="pollux.gns.local_sqr", op=self.hvd.Sum,
            **({} if self.process_set is None else {"process_set": self.process_set}))

    @torch.no_grad()
    def after_sync(self, sync_start: float) -> None:
        """The gradients are averaged: fold in this step's statistics and time."""
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
        if self.steps % self.refresh_every == 0 and self.gns:
            # Between steps, so one step's local and total norms use the same 1/P.
            self._inv = self.preconditioner.inverse(self.params)
        self._t_last = self._clock()

    def abort_step(self) -> None:
        """The step failed (a Horovod reset): drop its half-measured state."""
        self._parts, self._handle, self._buf = [], None, None
        self._prev = self._prev_sqr = None
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
        self.hvd.synchronize(self._handle)
        self._handle = None
        if float(self._buf[1]) > 0:
            return
        k = self.num_replicas
        total = sum((_sqr(g) for g in self._grads()), torch.zeros((), dtype=torch.float64))
        if self.op_sum:
            total = total / (k * k)  # op=Sum: the reduced gradient is K times the mean
        f = self._norm_factor()
        self.estimator.update(float(self._buf[0]) / k * f, float(total) * f, k,
                              self._batch_scale(k))

    def _finish_differenced(self) -> None:
        assert self.estimator is not None
        cur = [g.detach().to(torch.float32, copy=True) for g in self._grads()]
        cur_sqr = sum((_sqr(g) for g in cur), torch.zeros((), dtype=torch.float64))
        prev, prev_sqr = self._prev, self._prev_sqr
        if prev is not None and prev_sqr is not None and len(prev) == len(cur):
            torch._foreach_add_(prev, cur)
            total = sum((_sqr(g) for g in prev), torch.zeros((), dtype=torch.float64)) / 4.0
            f = self._norm_factor()
            self.estimator.update(float(cur_sqr + prev_sqr) / 2.0 * f, float(total) * f, 2,
                                  self._batch_scale(2), differenced=True)
        self._prev, self._prev_sqr = cur, cur_sqr

    # -- reading -------------------------------------------------------------------------
    def stats(self) -> GradNoise | None:
        """Smoothed gradient statistics normalised to ``M0`` (None before any)."""
        return self.estimator.stats() if self.estimator is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the estimator and the step profile."""
        return {
            "v": STATE_VERSION,
            "estimator": self.estimator.state_dict() if self.estimator is not None else None,
            "profile": self.profile.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"HorovodMeasurement state: expected a dict with v={STATE_VERSION}")
        est = state.get("estimator")
        if est is not None:
            estimator = GNSEstimator(int(est["init_batch_size"]), float(est["smoothing"]))
            estimator.load_state_dict(est)
            self.estimator = estimator
        self.profile.load_state_dict(state["profile"])

    def sync(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s state (JSON bytes via ``hvd.broadcast``)."""
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

