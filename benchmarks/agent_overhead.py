"""Per-step overhead of the agent's measurement hooks on 2-worker gloo DDP training (CPU).

Two worker processes train the same ~1M-parameter MLP with DDP over gloo. The run
alternates blocks of steps without and with the hooks attached (A B A B ..., the order
inside each pair alternating too, so slow drifts of the machine cancel out); each block is
timed on rank 0 between barriers. Overhead of a pair = t_with / t_without - 1; the figure
is the median over pairs.

What is attached is chosen by ``--attach module:function`` (default: the agent's
measurement hooks, :func:`pollux_launch.tuning.hooks.attach_measurement`); the function is
called as ``f(ddp_model, optimizer, init_batch_size=, num_replicas=, local_bsz=)`` and
must return an object with ``remove()``.

``--policy module:Class`` (an adaptation policy, ``pollux_launch.elastic.AdaptationPolicy``,
loaded as ``pollux-run --policy-module`` loads it) adds, on the "with" side only, the
step boundary a job runs with that policy: a real ``ElasticController`` over the
measurement hooks (their gradient statistics and step profile, the fixed batch, the
workers' gloo group) whose ``after_step`` runs after every optimiser step - the policy's
``after_step`` hook every step, and the controller's decision (one small broadcast) every
20 steps, as in training. The policy alone is the job's list (no goodput policy).

LAST line: {"overhead_pct": <100 * (t_with / t_without - 1), median of pairs>, with t the
wall time of a block; "overhead_pct_cpu": the same with t the CPU time both workers spent,
which a busy shared machine disturbs far less than wall time}. ``--smoke``: 2 pairs of
2-step blocks after 4 warm-up steps.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import Report, UsageError, run_benchmark  # beside this script
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

WORLD = 2


def default_attach(model: Any, optimizer: Any, **kw: Any) -> Any:
    from pollux_launch.tuning.hooks import attach_measurement

    return attach_measurement(model, optimizer, **kw)


def _resolve(spec: str | None) -> Callable[..., Any]:
    if not spec:
        return default_attach
    mod, _, fn = spec.partition(":")
    if not fn:
        raise SystemExit(f"--attach must look like module:function, got {spec!r}")
    return getattr(importlib.import_module(mod), fn)


class _BenchHooks:
    """``FrameworkHooks`` for the controller of ``--policy``: a fixed batch, the attached
    measurement hooks' gradient statistics, a static group (nothing to rebuild)."""

    def __init__(self, handle_of: Callable[[], Any], local_bsz: int) -> None:
        self._handle_of, self._local_bsz = handle_of, local_bsz

    def batch(self) -> tuple[int, int]:
        return self._local_bsz, 0

    def apply_batch(self, m: int, s: int) -> None:
        pass  # the batch is fixed (decisions keep it)

    def set_lr_factor(self, factor: float) -> None:
        pass  # 1.0 at the fixed batch

    def grad_stats(self) -> Any:
        monitor = getattr(self._handle_of(), "monitor", None)
        return monitor.stats() if monitor is not None else None

    def capture(self, controller_state: dict[str, Any]) -> None:
        return None

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool
                ) -> None:
        return None

    def leave(self) -> None:
        pass

    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool) -> None:
        return None

    def checkpoint_needs_peers(self) -> bool:
        return False

    def restore_checkpoint(self, state: dict[str, Any]) -> Any:
        raise ValueError("no checkpoints in this benchmark")


def make_controller(spec: str, handle_of: Callable[[], Any], local_bsz: int) -> Any:
    """A real ``ElasticController`` running policy ``spec`` over the attached hooks, on the
    already initialised gloo group (a static job), started as a job starts."""
    import pollux_launch.adapters.torch as pollux
    from pollux_launch.adapters.torch.job import JobCollectives
    from pollux_launch.elastic import ElasticController
    from pollux_launch.elastic.adaptation import load_policy
    from pollux_launch.tuning.profile import StepProfile
    from pollux_launch.tuning.progress import StatisticalProgress
    from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig

    bsz = local_bsz * WORLD
    config = TunerConfig(init_batch_size=bsz, max_batch_size=bsz,
                         local_bsz_bounds=(local_bsz, local_bsz), gradient_accumulation=False,
                         adaptive_batch_size=False)
    profile = getattr(handle_of(), "profile", None) or StepProfile()
    made: list[Any] = []
    tuner = GoodputTuner(config, profile, lambda: made[0].grad,
                         StatisticalProgress(bsz, 16 * bsz))
    made.append(ElasticController(_BenchHooks(handle_of, local_bsz), tuner,
                                  JobCollectives(pollux.init()), policies=[load_policy(spec)]))
    made[0].start(fresh=False, sync=False)
    return made[0]


def make_model() -> torch.nn.Module:
    # 784*512 + 2*512*512 + 512*10 weights + biases: about 0.93M parameters.
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def _worker(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)  # 2 workers share a small CPU; keep them from oversubscribing
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    attach = _resolve(args.attach)
    gen = torch.Generator().manual_seed(rank)
    xs = torch.randn(16, args.local_bsz, 784, generator=gen)
    ys = torch.randint(0, 10, (16, args.local_bsz), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    it = 0

    controller: Any = None  # --policy: the step boundary, on the "with" side

    def run(steps: int, boundary: bool = False) -> tuple[float, float]:
        """(wall seconds, CPU seconds of both workers) for ``steps`` training steps;
        ``boundary``: each followed by the controller's (``--policy``)."""
        nonlocal it
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            x, y = xs[it % 16], ys[it % 16]
            it += 1
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if boundary:
                controller.after_step(args.local_bsz * WORLD)
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.barrier()
        wall = time.perf_counter() - t0
        dist.all_reduce(cpu)
        return wall, float(cpu)

    # The agent stays attached for a whole training run: attach once (warm-up included,
    # so adaptive parts settle), then toggle with remove()/reattach() where supported.
    handle = attach(
        model,
        opt,
        init_batch_size=args.local_bsz * WORLD,
        num_replicas=WORLD,
        local_bsz=args.local_bsz,
    )
    if args.policy:
        controller = make_controller(args.policy, lambda: handle, args.local_bsz)
    run(args.warmup, boundary=controller is not None)
    handle.remove()
    run(args.warmup // 4)
    pairs = []
    bar = tqdm(range(args.pairs), desc="pairs", disable=rank != 0)
    for i in bar:
        times = {}
        for with_hooks in (False, True) if i % 2 == 0 else (True, False):
            if with_hooks:
                if hasattr(handle, "reattach"):
                    handle.reattach()
                else:
                    handle = attach(
                        model,
                        opt,
                        init_batch_size=args.local_bsz * WORLD,
                        num_replicas=WORLD,
                        local_bsz=args.local_bsz,
                    )
            times[with_hooks] = run(args.steps, boundary=with_hooks and controller is not None)
            if with_hooks:
                handle.remove()
        pairs.append((*times[False], *times[True]))  # wall_a, cpu_a, wall_b, cpu_b
        if rank == 0 and i % 5 == 4:
            ov = [p[2] / p[0] - 1 for p in pairs]
            bar.set_postfix(overhead_pct=f"{100 * statistics.median(ov):.2f}")
    monitor = getattr(handle, "monitor", None)
    if rank == 0:
        with open(out_file + ".info", "w") as f:
            json.dump({"interval": getattr(monitor, "interval", None)}, f)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(pairs, f)
    # the controller and its policy context refer to each other: collect them now, or that
    # cycle keeps the DDP model (and its gloo group's threads) alive into the interpreter's
    # shutdown, where destroying them aborts the process now and then
    controller = None
    gc.collect()
    dist.destroy_process_group()


def _worker_full(rank: int, args: argparse.Namespace, init_file: str, out_file: str) -> None:
    """--full: plain DDP + DataLoader vs the whole native adapter (ElasticTrainer with its
    AdaptiveDataLoader, agent hooks, decisions, LR scaling), same data, same batch."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import pollux_launch.adapters.torch as pollux

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    gen = torch.Generator().manual_seed(0)
    n = 64 * args.local_bsz * WORLD
    data = TensorDataset(torch.randn(n, 784, generator=gen),
                         torch.randint(0, 10, (n,), generator=gen))
    loss_fn = torch.nn.CrossEntropyLoss()

    torch.manual_seed(0)
    plain = DDP(make_model())
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    plain_loader = DataLoader(data, batch_size=args.local_bsz,
                              sampler=DistributedSampler(data, WORLD, rank))

    torch.manual_seed(0)
    job = pollux.init()  # joins the already initialised static group
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    bsz = args.local_bsz * WORLD  # fixed batch: the comparison is per identical step
    loader = pollux.AdaptiveDataLoader(data, batch_size=bsz, max_batch_size=bsz,
                                       local_bsz_bounds=(args.local_bsz, args.local_bsz))
    trainer = pollux.ElasticTrainer(model, opt, loader, job=job)

    def forever(it_factory):
        while True:
            yield from it_factory()

    plain_batches = forever(lambda: iter(plain_loader))
    agent_batches = forever(lambda: iter(loader))

    def run(with_agent: bool, steps: int) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            if with_agent:
                x, y = next(agent_batches)
                trainer.step(loss_fn(trainer.model(x), y))
            else:
                x, y = next(plain_batches)
                loss_fn(plain(x), y).backward()
                plain_opt.step()
                plain_opt.zero_grad(set_to_none=True)
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.barrier()
        wall = time.perf_counter() - t0
        dist.all_reduce(cpu)
        return wall, float(cpu)

    run(False, args.warmup // 4)
    run(True, args.warmup)
    pairs = []
    for i in tqdm(range(args.pairs), desc="pairs", disable=rank != 0):
        times = {w: run(w, args.steps) for w in ((False, True) if i % 2 == 0 else (True, False))}
        pairs.append((*times[False], *times[True]))
    if rank == 0:
        with open(out_file + ".info", "w") as f:
            json.dump({"interval": trainer.hooks.monitor.interval}, f)
        with open(out_file, "w") as f:
            json.dump(pairs, f)
    dist.destroy_process_group()


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.policy and args.full:
        raise UsageError("--policy measures the hooks' side; --full measures ElasticTrainer")
    n_params = sum(p.numel() for p in make_model().parameters())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pairs.json")
        worker = _worker_full if args.full else _worker
        mp.spawn(worker, args=(args, os.path.join(tmp, "init"), out), nprocs=WORLD, join=True)
        with open(out) as f:
            pairs = json.load(f)
        with open(out + ".info") as f:
            info = json.load(f)

    def med(i: int) -> float:
        return statistics.median(p[i] for p in pairs) / args.steps

    wall = 100 * statistics.median(p[2] / p[0] - 1 for p in pairs)
    cpu = 100 * statistics.median(p[3] / p[1] - 1 for p in pairs)
    print(
        f"model {n_params / 1e6:.2f}M params, {WORLD} workers gloo, local batch {args.local_bsz}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"median step wall time: without {1e3 * med(0):.2f} ms, with {1e3 * med(2):.2f} ms; "
        f"CPU time (both workers): without {1e3 * med(1):.2f} ms, with {1e3 * med(3):.2f} ms"
    )
    print(
        f"{len(pairs)} pairs of {args.steps}-step blocks; noise-scale measured every "
        f"{info['interval']} step(s); CPU-time overhead {cpu:.2f} % (robust to a loaded machine)"
    )
    measured = ("ElasticTrainer" if args.full else "measurement hooks" if not args.policy
                else f"measurement hooks + controller with policy {args.policy}")
    report.update({"overhead_pct": round(wall, 3), "overhead_pct_cpu": round(cpu, 3),
                   "measured": measured})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--steps", type=int, default=8, help="steps per block")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--local-bsz", type=int, default=64)
    ap.add_argument("--attach", default=None, help="module:function to attach (default: agent)")
    ap.add_argument("--full", action="store_true",
                    help="compare plain DDP with the whole native adapter (ElasticTrainer)")
    ap.add_argument("--policy", default=None, metavar="MODULE:CLASS",
                    help="the with side also runs a controller with this adaptation policy "
                         "after every step")
    return run_benchmark(ap, bench, smoke={"pairs": 2, "steps": 2, "warmup": 4})


if __name__ == "__main__":
    sys.exit(main())
