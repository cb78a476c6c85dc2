"""Autograd hooks that drive the measurements for torch (DDP, FSDP2 or a single process).

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

Driven (``driven=True``, what ``ElasticTrainer`` uses): the owner of the training step
calls :meth:`MeasurementHooks.micro_step_done` after every backward pass, and the
per-parameter hooks are registered only for the optimiser steps whose local gradients
the monitor samples (every ``interval``-th step, issue 31): a step it does not sample
costs no Python call per parameter, only that one call. At several replicas the sync
time is then measured on the sampled steps only (a new configuration samples every step
until the next decision: each has its sync time); step time on every step.

Idle steps (driven). After a synchronising step the hooks plan how many of the next
ones need nothing measured (:meth:`GradientNoiseMonitor.unmeasured_ahead`, once the
profile's warm-up is over); those cost one attribute test in ``micro_step_done``, and the
last of them, or anything that reads or changes the measurements first
(:meth:`MeasurementHooks.end_idle`), moves the monitor's schedule past them and records
their mean step time. The plan follows step counts only: every replica makes the same.
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

# idle steps (and the controller's idle boundaries) in a row at most: then one is timed
IDLE_MAX = 1000


class MeasurementHooks:
    """Handle returned by :func:`attach_measurement`; ``remove()`` detaches everything."""

    def __init__(
        self,
        model: torch.nn.Module,
        monitor: GradientNoiseMonitor | None,
        profile: StepProfile | None,
        clock: Callable[[], float],
        driven: bool = False,
    ) -> None:
        self.model = model
        self.monitor = monitor
        self.profile = profile
        self._clock = clock
        self.driven = driven
        self._attached = True  # (remove() detaches for good, until reattach())
        self._armed = False  # driven: the per-parameter hooks are on for this step
        self._replicas = 1
        self._queued = False
        self._accumulating = False
        self._t_local_done = 0.0
        self._t_last_step: float | None = None
        # driven: synchronising steps ahead that need nothing measured (planned, the same
        # on every replica), and those already done (module docstring, "Idle steps")
        self.skip_idle = driven  # (off: every step measured as before)
        self._idle_left = 0
        self._idle_done = 0
        self._handles: list[Any] = []
        self._params = (
            monitor.params
            if monitor is not None
            else [p for p in model.parameters() if p.requires_grad]
        )
        self.reattach()

    def reattach(self) -> None:
        """Register the hooks again after :meth:`remove`, keeping all measured state."""
        self.end_idle()
        self._attached = True
        if not self.driven:
            self._register()
        self._arm()
        self._t_last_step = None
        if self.monitor is not None:
            self.monitor.restart_clock()

    def _register(self) -> None:
        if not self._handles:
            for i, p in enumerate(self._params):
                self._handles.append(p.register_hook(functools.partial(self._on_grad, i)))

    def _unregister(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _arm(self) -> None:
        """Driven: per-parameter hooks on for the next optimiser step if the monitor
        samples its local gradients (or nothing else would time its sync), off if not;
        registering costs one call per parameter, only when the schedule changes."""
        if not self.driven:
            return
        mon = self.monitor
        want = self._attached and not getattr(mon, "sharded", False) and (
            mon._local_active if mon is not None else self._replicas > 1)
        if want != self._armed:
            (self._register if want else self._unregister)()
            self._armed = want

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
        self.end_idle()
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
        self._replicas = num_replicas
        self._arm()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Mark backward passes inside as accumulation micro-steps (for models without
        DDP's ``no_sync``; under DDP, ``no_sync`` is detected by itself)."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def sync_point(self) -> None:
        """At a scheduled point (every replica at the same step boundary): the monitor's
        (``GradientNoiseMonitor.sync_point``), then the hooks armed for the next step as
        the interval it may have changed says."""
        self.end_idle()
        if self.monitor is not None:
            self.monitor.sync_point()
        self._arm()
        self._idle_left = self._idle_ahead()

    def remove(self) -> None:
        """Detach every hook (the monitor and profile keep their state)."""
        self.end_idle()
        self._attached = self._armed = False
        self._unregister()

    def micro_step_done(self, sync: bool, comm_s: float | None = None) -> None:
        """Driven: a backward pass ended (``sync``: the optimiser step's last one, its
        gradients averaged). On a step the armed hooks measured, they did the work;
        otherwise what the two callbacks do - with ``comm_s`` the step's time in
        collectives where the owner timed them (FSDP2's); at several replicas without it
        the sync time is left unmeasured. Then arms the hooks for the next step."""
        if sync and self._idle_left:
            self._idle_left -= 1
            self._idle_done += 1
            if not self._idle_left:
                self.end_idle()
            return
        if self._armed:
            if sync:
                self._arm()
                self._idle_left = self._idle_ahead()
            return
        if self.monitor is not None:
            self.monitor.end_micro_step()
        if not sync:
            return
        if self.monitor is not None:
            self.monitor.reduce_local_async()
        if comm_s is None and self._replicas > 1:
            self._after_sync(timed=False)  # (measured on the sampled steps only)
        else:  # as the callbacks time it: from the local gradients to the step's end
            self._t_local_done = self._clock() - (comm_s or 0.0)
            self._after_sync()
        self._arm()
        self._idle_left = self._idle_ahead()

    def _idle_ahead(self) -> int:
        """Driven: how many of the next synchronising steps need nothing measured - no
        sampled gradients, no armed hooks, the step profile past its warm-up, no times
        of collectives to take - from the monitor's schedule, the same on every
        replica."""
        if not self.skip_idle or self._armed or not self._attached:
            return 0
        if self.profile is not None and not self.profile.warm:
            return 0
        mon = self.monitor
        if mon is None:
            return 0 if self._replicas > 1 else IDLE_MAX
        if mon.sharded:  # (its collectives are timed per step: comm_s)
            return 0
        return min(mon.unmeasured_ahead(), IDLE_MAX)

    def end_idle(self) -> None:
        """Finish the idle steps done so far as if each had been measured - the monitor's
        schedule moves past them, the profile takes their mean - and arm the hooks for
        the next step. Before anything reads or changes the monitor or the profile."""
        n, self._idle_done, self._idle_left = self._idle_done, 0, 0
        if not n:
            return
        now = self._clock()
        if self.monitor is not None:
            self.monitor.skip_steps(n)
        if (self.profile is not None and self.profile.key is not None
                and self._t_last_step is not None):
            self.profile.record((now - self._t_last_step) / n, None, steps=n)
        self._t_last_step = now
        self._arm()

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

    def _after_sync(self, timed: bool = True) -> None:
        """The step's gradients are averaged: finish the monitor's step, record the step
        time and (``timed``) its sync time, since the local backward ended."""
        if self.monitor is not None:
            self.monitor.finish_step()
        now = self._clock()
        if self.profile is not None and self.profile.key is not None:
            if self._t_last_step is not None:
                self.profile.record(now - self._t_last_step,
                                    now - self._t_local_done if timed else None)
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
    driven: bool = False,
) -> MeasurementHooks:
    """Attach gradient-noise and step-time measurement to ``model`` (a DDP module or a
    plain module); returns the handle with ``.monitor``, ``.profile`` and ``.remove()``.

    ``overhead_budget``: the fraction of step time the noise-scale measurement may cost
    (it then measures only every few steps); None measures every step. ``sharded``: an
    FSDP2 model, whose adapter feeds the local gradients (``add_local``, from its
    reduce-scatter) and calls :meth:`MeasurementHooks.micro_step_done` after each backward
    (its parameters are not in the autograd graph: no hook fires). ``driven``: the
    caller calls ``micro_step_done`` after every backward, and the per-parameter hooks
    are on only for the steps the monitor samples (module docstring).
    """
    monitor = (
        GradientNoiseMonitor(
            optimizer,
            init_batch_size,
            preconditioner=preconditioner,
            grad_scaler=grad_scaler,
            overhead_budget=overhead_budget,
            sharded=sharded,
            scheduled=driven or sharded,
        )
        if gns
        else None
    )
    profile = StepProfile(warmup_steps) if timing else None
    hooks = MeasurementHooks(model, monitor, profile, clock, driven=driven or sharded)
    hooks.configure(
        num_nodes=num_nodes,
        num_replicas=num_replicas,
        local_bsz=local_bsz if local_bsz is not None else init_batch_size,
        accum_steps=accum_steps,
        process_group=process_group,
    )
    return hooks
