"""What the DeepSpeed and Horovod adapters cost per optimiser step (issue 31).

The counterpart of ``step_overhead.py``'s ``tiny`` case for the two framework adapters:
one replica in this process, on the CPU, a host-bound model (``nn.Linear(8, 1)``, batch 8,
MSE, SGD) whose step is almost all host work, so that what differs is the adapter's own
host work per step. The same process builds two identical set-ups (same seed, same
batches) - the framework's own loop and pollux's - and times alternating blocks of
``block`` steps (A B, then B A: slow drifts of a shared machine cancel out); each figure
is the median over ``pairs`` pairs, from wall time and from process CPU time, exactly as
``step_overhead.measure`` computes them.

* ``deepspeed``: plain - ``deepspeed.initialize`` (ZeRO-0, fp32), ``engine(x)``,
  ``engine.backward(loss)``, ``engine.step()``; pollux - the same config with an enabled
  ``"pollux"`` section at a fixed batch: :func:`initialize_handle`'s ``PolluxEngine``
  driven by ``ElasticDeepSpeed`` on a static job (what ``initialize`` builds under
  pollux-run, without its rendezvous): gradient statistics, LR factor, the controller's
  boundary and decisions. DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``).
* ``horovod``: ``hvd.init()`` in this one process; plain - ``hvd.DistributedOptimizer``
  over SGD; pollux - pollux's ``DistributedOptimizer(..., local_bsz=8)`` with its control
  started as ``TorchState``'s sync starts it (measurement, LR factor, decisions).

Both sides are fed the same pre-made batches (no loader): the loader is measured by
``step_overhead.py``. A framework that cannot be imported gives ``{"skipped": why}``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from step_overhead import time_sides  # beside this script
from torch import nn

FRAMEWORKS = ("deepspeed", "horovod")
BATCH = 8


def _batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(64)]
    while True:
        yield from data


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 1)


# -- DeepSpeed ---------------------------------------------------------------------------------

def _ds_env() -> None:
    """One process, no launcher: what DeepSpeed's ``init_distributed`` needs, on the CPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29600 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)


def _ds_config(pollux: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH,
                           "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                           "zero_optimization": {"stage": 0}, "wall_clock_breakdown": False}
    if pollux:  # a fixed batch (as the torch case): the batch of every step is BATCH
        cfg["pollux"] = {"enabled": True, "initial_batch_size": BATCH,
                         "max_batch_size": BATCH, "micro_batch_size_range": [BATCH, BATCH]}
    return cfg


def _deepspeed_sides() -> dict[str, Callable[[int], None]]:
    _ds_env()
    import deepspeed

    from pollux_launch.adapters.deepspeed import initialize_handle
    from pollux_launch.adapters.deepspeed.elastic import ElasticDeepSpeed
    from pollux_launch.adapters.torch.job import ElasticJob

    def build(pollux: bool) -> Callable[[int], None]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if pollux:
            engine = initialize_handle(model=model, optimizer=opt, config=_ds_config(True))[0]
            ElasticDeepSpeed(engine, ElasticJob(None, None))  # a static job's driver
        else:
            engine = deepspeed.initialize(model=model, optimizer=opt,
                                          config=_ds_config(False))[0]
        batches = _batches()

        def run(steps: int) -> None:
            for _ in range(steps):
                x, y = next(batches)
                engine.backward(F.mse_loss(engine(x), y))
                engine.step()
        return run

    return {"plain": build(False), "pollux": build(True)}


# -- Horovod -----------------------------------------------------------------------------------

def _horovod_sides() -> dict[str, Callable[[int], None]]:
    import horovod.torch as hvd

    from pollux_launch.adapters.horovod import DistributedOptimizer

    hvd.init()

    def build(pollux: bool) -> Callable[[int], None]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        side = "pollux" if pollux else "plain"  # distinct all-reduce names per side
        named = [(f"{side}.{n}", p) for n, p in model.named_parameters()]
        if pollux:
            opt = DistributedOptimizer(opt, named_parameters=named, local_bsz=BATCH)
            opt.pollux_control.sync()  # what TorchState's sync does at the start
        else:
            opt = hvd.DistributedOptimizer(opt, named_parameters=named)
        batches = _batches()

        def run(steps: int) -> None:
            for _ in range(steps):
                x, y = next(batches)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        return run

    return {"plain": build(False), "pollux": build(True)}


# -- measuring ---------------------------------------------------------------------------------

def _missing(framework: str) -> str | None:
    """Why ``framework`` cannot run here (one line), or None."""
    module = {"deepspeed": "deepspeed", "horovod": "horovod.torch"}[framework]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # (a parent package is missing)
        found = False
    return None if found else f"{module} is not installed"


def build_sides(framework: str) -> dict[str, Callable[[int], None]]:
    """The plain and the pollux side of ``framework`` (each ``run(steps)``)."""
    if framework == "deepspeed":
        return _deepspeed_sides()
    if framework == "horovod":
        return _horovod_sides()
    raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")


def measure_framework(framework: str, pairs: int, block: int, warmup: int) -> dict[str, Any]:
    """``{"plain_ms", "pollux_ms", "overhead_pct", "diff_us", "diff_us_cpu"}`` of
    ``framework`` (``deepspeed`` or ``horovod``) at one replica in this process (module
    docstring), or ``{"skipped": why}`` where it cannot be imported."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    why = _missing(framework)
    if why is not None:
        return {"skipped": why}
    try:
        sides = build_sides(framework)
    except ImportError as exc:  # installed but broken (e.g. built against another torch)
        return {"skipped": f"{framework} cannot be imported: {str(exc).splitlines()[0]}"}
    return time_sides(sides, pairs, block, warmup)


if __name__ == "__main__":  # python benchmarks/step_overhead_frameworks.py [framework ...]
    import sys

    torch.set_num_threads(1)
    for name in sys.argv[1:] or FRAMEWORKS:
        print(name, measure_framework(name, 12, 200, 50), flush=True)
