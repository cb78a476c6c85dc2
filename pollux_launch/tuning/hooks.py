"""Autograd hooks that drive the measurements for torch (DDP or a single process).

:func:`attach_measurement` registers one tensor hook per parameter (it sees each
micro-batch's *local* gradient, before DDP averages it) and two end-of-backward callbacks:

* the first runs when the local backward pass is done: it counts the micro-batch and, on
  a synchronising micro-step, issues the scalar all-reduce of the local squared norms,
  which then overlaps DDP's gradient all-reduce;
* the second is queued from the first, so it runs after DDP's own finalisation (the
  gradients are averaged): it finishes the noise-scale step and times the step.

Step time is measured between consecutive synchronising steps' completions (it covers
data loading, forward, backward, synchronisation and the previous optimiser update);
the sync time is the exposed wait between the two callbacks.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import Variable

from .grad_monitor import DEFAULT_OVERHEAD_BUDGET, GradientNoiseMonitor
from .profile import ProfileKey, StepProfile


class MeasurementHooks:
    """Handle returned by :func:`attach_measurement`; ``remove()`` detaches everything."""

    def __init__(
        self,
        model: torch.nn.Module,
        monitor: GradientNoiseMonitor | None,
        profile: StepProfile | None,
        clock: Callable[[], float],
    ) -> None:
        self.model = model
        self.monitor = monitor
        self.profile = profile
        self._clock = clock
        self._queued = False
        self._accumulating = False
        self._t_local_done = 0.0
        self._t_last_step: float | None = None
        self._handles: list[Any] = []
        self._params = (
            monitor.params
            if monitor is not None
            else [p for p in model.parameters() if p.requires_grad]
        )
        self.reattach()

    def reattach(self) -> None:
        """Register the hooks again after :meth:`remove`, keeping all measured state."""
        if self._handles:
            return
        for i, p in enumerate(self._params):
            self._handles.append(p.register_hook(functools.partial(self._on_grad, i)))
        self._t_last_step = None
        if self.monitor is not None:
            self.monitor.restart_clock()

    def configure(
        self,
        *,
        num_nodes: int,
        num_replicas: int,
        local_bsz: int,
        accum_steps: int = 0,
        process_group: Any | None = None,
        loss_averaged_over_accum: bool = False,
    ) -> None:
        """New allocation or batch shape (at a step boundary)."""
        if self.monitor is not None:
            self.monitor.configure(
                num_replicas=num_replicas,
                local_bsz=local_bsz,
                accum_steps=accum_steps,
                process_group=process_group,
                loss_averaged_over_accum=loss_averaged_over_accum,
            )
        if self.profile is not None:
            self.profile.set_key(ProfileKey(num_nodes, num_replicas, local_bsz, accum_steps))
        self._t_last_step = None

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Mark backward passes inside as accumulation micro-steps (for models without
        DDP's ``no_sync``; under DDP, ``no_sync`` is detected by itself)."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def remove(self) -> None:
        """Detach every hook (the monitor and profile keep their state)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def micro_step_done(self, sync: bool, comm_s: float = 0.0) -> None:
        """A backward pass ended, for a model whose parameters no hook sees (FSDP2
        computes with unsharded copies; its gradients are reduced inside backward):
        what the two callbacks do, with ``sync`` on a step's last micro-batch, and
        ``comm_s`` the step's time in collectives (the profile's sync time)."""
        if self.monitor is not None:
            self.monitor.end_micro_step()
        if not sync:
            return
        if self.monitor is not None:
            self.monitor.reduce_local_async()
        self._t_local_done = self._clock() - comm_s
        self._after_sync()

    # Autograd-engine callbacks; they must not raise into the engine on user error paths.
    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.monitor is not None:
            self.monitor.on_local_grad(index, grad)
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._after_local_backward)

    def _after_local_backward(self) -> None:
        self._queued = False
        if self.monitor is not None:
            self.monitor.end_micro_step()
        if self._accumulating or not getattr(self.model, "require_backward_grad_sync", True):
            return  # an accumulation micro-step (DDP no_sync): nothing is averaged yet
        if self.monitor is not None:
            self.monitor.reduce_local_async()
        self._t_local_done = self._clock()
        Variable._execution_engine.queue_callback(self._after_sync)

    def _after_sync(self) -> None:
        if self.monitor is not None:
            self.monitor.finish_step()
        now = self._clock()
        if self.profile is not None and self.profile.key is not None:
            if self._t_last_step is not None:
                self.profile.record(now - self._t_last_step, now - self._t_local_done)
        self._t_last_step = now


def attach_measurement(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    init_batch_size: int,
    *,
    num_nodes: int = 1,
    num_replicas: int = 1,
    local_bsz: int | None = None,
    accum_steps: int = 0,
    process_group: Any | None = None,
    grad_scaler: Any | None = None,
    preconditioner: str = "auto",
    overhead_budget: float | None = DEFAULT_OVERHEAD_BUDGET,
    gns: bool = True,
    sharded: bool = False,
    timing: bool = True,
    warmup_steps: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> MeasurementHooks:
    """Attach gradient-noise and step-time measurement to ``model`` (a DDP module or a
    plain module); returns the handle with ``.monitor``, ``.profile`` and ``.remove()``.

    ``overhead_budget``: the fraction of step time the noise-scale measurement may cost
    (it then measures only every few steps); None measures every step. ``sharded``: an
    FSDP2 model, whose adapter feeds the local gradients (``add_local``, from its
    reduce-scatter) and calls :meth:`MeasurementHooks.micro_step_done` after each backward
    (its parameters are not in the autograd graph: no hook fires).
    """
    monitor = (
        GradientNoiseMonitor(
            optimizer,
            init_batch_size,
            preconditioner=preconditioner,
            grad_scaler=grad_scaler,
            overhead_budget=overhead_budget,
            sharded=sharded,
        )
        if gns
        else None
    )
    profile = StepProfile(warmup_steps) if timing else None
    hooks = MeasurementHooks(model, monitor, profile, clock)
    hooks.configure(
        num_nodes=num_nodes,
        num_replicas=num_replicas,
        local_bsz=local_bsz if local_bsz is not None else init_batch_size,
        accum_steps=accum_steps,
        process_group=process_group,
    )
    return hooks
