"""``DistributedOptimizer``: ``hvd.DistributedOptimizer`` plus the Pollux agent's hooks.

A Horovod script changes one line::

    from pollux_launch.adapters.horovod import DistributedOptimizer
    optimizer = DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     backward_passes_per_step=k, local_bsz=args.batch_size)

and keeps everything else (``hvd.elastic.run``, ``hvd.elastic.TorchState``,
``ElasticSampler``). The returned optimizer *is* a Horovod ``DistributedOptimizer`` (same
class construction, same methods, same all-reduces) with three methods extended:

* ``_allreduce_grad_async`` / ``_grouped_allreduce_grad_async`` - where Horovod hands a
  parameter's local, accumulated gradient to ``compression.compress()`` and then to the
  all-reduce: its squared norm is taken here first (before the in-place all-reduce
  overwrites it). This is the same call site as a custom ``compression`` object, one call
  up, because the Adam pre-conditioner (PGNS, Pollux Eqn 5) needs to know *which*
  parameter the tensor belongs to and ``compress()`` only sees the tensor; the user's
  ``compression`` argument stays free;
* ``synchronize`` - one scalar all-reduce before waiting, statistics and step time after.

``optimizer.pollux`` is the :class:`~.measure.HorovodMeasurement` (``stats()``,
``profile``, ``state_dict()``). Elastic resets need no callback: the configuration is
re-read every step. When the optimizer is in a ``hvd.elastic.TorchState``, rank 0's
measurement state is broadcast with the optimizer state on every sync (new workers).

``optimizer.pollux_control`` (when ``local_bsz`` is given; ``adapt=False`` turns it off)
is the :class:`~.control.HorovodControl`: after every reset (in that sync, on all ranks)
and every ``decide_every`` steps rank 0's Pollux agent picks the per-rank batch
(``data_loader``'s batch sampler) and ``backward_passes_per_step``, and the LR factor
applied around ``step()``; rank 0 reports the job's hints to the store under
``pollux-run``. ``step()`` also counts steps for it. Without ``hvd.elastic`` (no
``TorchState``), the control starts at the first ``step()`` only under ``pollux-run``.

Accumulation follows Horovod's examples: divide the loss by ``backward_passes_per_step``
(else pass ``loss_averaged_over_accum=False``). ``op=hvd.Adasum`` is not supported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic import state as _hvd_state
from horovod.torch.optimizer import _DistributedOptimizer

from .control import HorovodControl
from .measure import HorovodMeasurement

_Base = _DistributedOptimizer  # Horovod's method bodies, called unbound


class PolluxMeasured:
    """Marker base of every optimizer class made here (for Horovod's state registry)."""

    pollux: HorovodMeasurement
    pollux_control: HorovodControl | None


def _allreduce_grad_async(self: Any, p: torch.Tensor) -> Any:
    if p.grad is not None:
        self.pollux.on_local_grad(p, p.grad)
    return _Base._allreduce_grad_async(self, p)


def _grouped_allreduce_grad_async(self: Any, ps: Any) -> Any:
    for p in ps:
        if p.grad is not None:
            self.pollux.on_local_grad(p, p.grad)
    return _Base._grouped_allreduce_grad_async(self, ps)


def _synchronize(self: Any) -> None:
    m: HorovodMeasurement = self.pollux
    if not self.process_set.included():
        return _Base.synchronize(self)
    m.before_sync(self.backward_passes_per_step - 1)
    t0 = m._clock()
    try:
        _Base.synchronize(self)
    except BaseException:
        m.abort_step()  # a Horovod reset interrupted the step
        raise
    m.after_sync(t0)


def _step(self: Any, closure: Any = None) -> Any:
    ctl: HorovodControl | None = self.pollux_control
    if ctl is None:
        return _Base.step(self, closure)
    if ctl.tuner is None:
        ctl.start_unsynced()  # no TorchState sync ran (not hvd.elastic): under pollux-run
    factor = ctl.lr_factor
    if factor == 1.0:  # (nothing to scale, nothing to restore)
        result = _Base.step(self, closure)
    else:
        base = [g["lr"] for g in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            result = _Base.step(self, closure)
        finally:
            for group, lr in zip(self.param_groups, base, strict=True):
                group["lr"] = lr
    ctl.after_step()
    return result


_OVERRIDES = {
    "_allreduce_grad_async": _allreduce_grad_async,
    "_grouped_allreduce_grad_async": _grouped_allreduce_grad_async,
    "synchronize": _synchronize,
    "step": _step,
}
_classes: dict[type, type] = {}


def _measured_class(optimizer_cls: type) -> type:
    """``optimizer_cls`` + Horovod's methods + ours, built as Horovod builds its class
    (its methods call ``super(self.__class__, self)``, so the class must derive from the
    user's optimizer class directly: a subclass of Horovod's class would recurse)."""
    cls = _classes.get(optimizer_cls)
    if cls is None:
        body = dict(_DistributedOptimizer.__dict__)
        body.update(_OVERRIDES)
        body.pop("__dict__", None)
        body.pop("__weakref__", None)
        cls = type(optimizer_cls.__name__, (optimizer_cls, PolluxMeasured), body)
        _classes[optimizer_cls] = cls
    return cls


class _PolluxOptimizerStateHandler(_hvd_state.OptimizerStateHandler):
    """Horovod's optimizer handler, plus rank 0's measurement state on every sync."""

    def sync(self) -> None:
        super().sync()
        control = self.value.pollux_control
        if control is not None:
            control.sync()  # the measurement too, then a decision for the new size
        else:
            self.value.pollux.sync(root_rank=0)


def _register_state_handler() -> None:
    registry = _hvd_state.get_handler_registry()
    if not any(t is PolluxMeasured for t, _ in registry):
        _hvd_state.set_handler_registry(
            [(PolluxMeasured, _PolluxOptimizerStateHandler), *registry])


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: Any = hvd.Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = hvd.global_process_set,
    *,
    local_bsz: int | None = None,
    init_batch_size: int | None = None,
    gns: bool = True,
    timing: bool = True,
    preconditioner: str = "auto",
    loss_averaged_over_accum: bool = True,
    warmup_steps: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    adapt: bool = True,
    data_loader: Any = None,
    max_batch_size: int | None = None,
    min_batch_size: int | None = None,
    local_bsz_bounds: tuple[int, int] | None = None,
    lr_scaling: Any = "auto",
    report_interval: float = 30.0,
    decide_every: int | None = None,
    on_decision: Callable[[int, int, float], None] | None = None,
    policies: Any = None,
) -> Any:
    """Same arguments and behaviour as ``hvd.DistributedOptimizer``; keyword-only extras:

    ``local_bsz``: per-rank batch of one backward pass (needed for the statistics and the
    step profile; :meth:`HorovodMeasurement.set_batch` sets it later);
    ``init_batch_size``: the job's ``M0`` (default: ``local_bsz`` x ranks at the first
    step); ``gns`` / ``timing``: switch either measurement off; ``preconditioner``:
    "auto", "identity" or "adam" (PGNS, Pollux Eqn 5).

    Pollux's decisions (with ``local_bsz``, unless ``adapt=False``; see
    :class:`~.control.HorovodControl`): ``data_loader`` (its batch becomes
    ``m * backward_passes_per_step``), ``max_batch_size`` (default ``M0``: fixed total
    batch), ``min_batch_size`` (the range's lower end), ``local_bsz_bounds``,
    ``lr_scaling`` ("auto": AdaScale for SGD, "sqrt" for Adam; or "linear", "legw", a
    function), ``report_interval`` (seconds between hints),
    ``decide_every`` (steps between decisions; None: at least 20, spaced by their
    cost), ``on_decision(m, s, lr_factor)``,
    ``policies`` (adaptation policies, ``pollux_launch.elastic.AdaptationPolicy``; None:
    ``pollux-run --policy-module``'s, else Pollux's goodput policy).
    """
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported by pollux_launch's "
                         "DistributedOptimizer; use op=hvd.Average (the default)")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("pollux_launch's DistributedOptimizer supports op=hvd.Average "
                         "or hvd.Sum")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot use LBFGS with DistributedOptimizer (as in Horovod)")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0 and groups is None:
        groups = num_groups
    cls = _measured_class(optimizer.__class__)
    opt = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
              op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
    opt.pollux = HorovodMeasurement(
        hvd, opt, local_bsz=local_bsz, init_batch_size=init_batch_size, gns=gns,
        timing=timing, preconditioner=preconditioner, warmup_steps=warmup_steps,
        op_sum=op == hvd.Sum, loss_averaged_over_accum=loss_averaged_over_accum,
        process_set=None if process_set is hvd.global_process_set else process_set,
        clock=clock)
    opt.pollux_control = None
    if adapt and local_bsz is not None:
        opt.pollux_control = HorovodControl(
            hvd, opt, opt.pollux, local_bsz=local_bsz, accum_steps=backward_passes_per_step - 1,
            data_loader=data_loader, init_batch_size=init_batch_size,
            max_batch_size=max_batch_size, min_batch_size=min_batch_size,
            local_bsz_bounds=local_bsz_bounds,
            lr_scaling=lr_scaling, report_interval=report_interval, decide_every=decide_every,
            on_decision=on_decision, policies=policies)
    _register_state_handler()
    return opt
