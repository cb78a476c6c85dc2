"""What pollux costs per training step: a plain loop vs ``ElasticTrainer`` (issue 31).

For each model the same process builds two identical set-ups - the same model (same
seed), optimiser, data set and loader fetch - one trained by a plain loop (``DataLoader``,
``forward``, ``backward``, ``step``, ``zero_grad``), one by pollux (``AdaptiveDataLoader``
at a fixed batch, ``ElasticTrainer.step``, its hooks, monitor, controller boundary and
decisions as in a job). Blocks of ``--block`` steps alternate (A B, then B A: slow drifts
of a shared machine cancel out), each timed between device synchronisations; the figure
of a case is the median over ``--pairs`` pairs. Both loaders fetch a batch in one call
(``TensorBatches``: what ``AdaptiveDataLoader`` does for a ``TensorDataset``), so what
differs is pollux's own work.

Cases (``--cases``): ``tiny`` (a host-bound 8->1 linear model at batch 8: its step is
almost all host work, so its difference is pollux's host cost per step), ``mlp`` (1.05M
parameters, batch 128), ``resnet18`` (ResNet-18 for 32 px images, defined here so that
no torchvision is needed; batch 256 on a GPU, 16 on a CPU), ``transformer`` (14 blocks
of width 768, ~100M parameters, bf16 autocast on a GPU; sequence 512 x batch 16 on a
GPU, 32 x 2 on a CPU). At one replica in this process, and with ``--replicas 2`` also at
two (DDP over gloo in two processes on a CPU; NCCL on two GPUs, skipped with fewer).

``--frameworks deepspeed,horovod`` (the default): the same measurement of the DeepSpeed
and Horovod adapters' step paths on the tiny case, each against its framework's own loop
(``step_overhead_frameworks.py``), in ``frameworks``.

LAST line: ``{"device": ..., "host_us_per_step": <tiny case: pollux - plain, in us>,
"host_us_per_step_cpu": <the same from process CPU time>, "cases": {name: {"plain_ms",
"pollux_ms", "overhead_pct"}}}`` (two-replica cases as ``name@2``); ``fetch``: the
per-micro-batch time of ``AdaptiveDataLoader`` on a plain ``TensorDataset`` vs
``DataLoader``'s per-sample fetch of the same. Goals: ``host_us_per_step <= 50`` on a CPU;
``overhead_pct <= 1`` on a GPU where the plain step is >= 10 ms, <= 3 for the MLP.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from harness import Report, UsageError, run_benchmark  # beside this script
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ALL_CASES = ("tiny", "mlp", "resnet18", "transformer")


# -- models ---------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout)) if stride != 1 or cin != cout
                      else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.short(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 with the 3x3 stem used for 32 px images (He et al.; 11.2M parameters)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class _Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, is_causal=False)
        return self.head(x).flatten(0, 1)


@dataclass
class Case:
    """One model's set-up: how to build it, its data, its batch and its loss."""

    build: Callable[[], nn.Module]
    data: Callable[[], TensorDataset]
    batch: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str = "sgd"
    autocast: bool = False  # bf16 autocast on a GPU


def make_case(name: str, gpu: bool) -> Case:
    g = torch.Generator().manual_seed(0)
    if name == "tiny":
        return Case(lambda: nn.Linear(8, 1),
                    lambda: TensorDataset(torch.randn(1 << 15, 8, generator=g),
                                          torch.randn(1 << 15, 1, generator=g)),
                    8, F.mse_loss)
    if name == "mlp":
        return Case(lambda: nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512),
                                          nn.ReLU(), nn.Linear(512, 10)),
                    lambda: TensorDataset(torch.randn(1 << 14, 512, generator=g),
                                          torch.randint(0, 10, (1 << 14,), generator=g)),
                    128, F.cross_entropy, optimizer="adam")
    if name == "resnet18":
        n = 4096 if gpu else 512
        return Case(resnet18,
                    lambda: TensorDataset(torch.randn(n, 3, 32, 32, generator=g),
                                          torch.randint(0, 10, (n,), generator=g)),
                    256 if gpu else 16, F.cross_entropy, autocast=True)
    if name == "transformer":
        vocab, seq, n = 8192, (512 if gpu else 32), (512 if gpu else 64)

        def tokens() -> TensorDataset:
            x = torch.randint(0, vocab, (n, seq), generator=g)
            return TensorDataset(x, torch.roll(x, -1, dims=1))
        return Case(lambda: _Transformer(vocab, 768, 14), tokens, 16 if gpu else 2,
                    lambda out, y: F.cross_entropy(out, y.flatten()), optimizer="adam",
                    autocast=True)
    raise UsageError(f"unknown case {name!r}; choose from {', '.join(ALL_CASES)}")


# -- the two loops ----------------------------------------------------------------------------

def _optimizer(kind: str, model: nn.Module, gpu: bool) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-4, fused=gpu)
    return torch.optim.SGD(model.parameters(), lr=0.01)


class Side:
    """One set-up (plain or pollux): ``run(n)`` trains ``n`` optimiser steps."""

    def __init__(self, case: Case, device: torch.device, pollux: bool, world: int) -> None:
        from pollux_launch.adapters.torch.data import TensorBatches, whole_batch

        torch.manual_seed(0)
        self.device, self.case = device, case
        gpu = device.type == "cuda"
        model = case.build().to(device)
        opt = _optimizer(case.optimizer, model, gpu)
        data = case.data()
        kw: dict[str, Any] = {"pin_memory": gpu}
        self.amp = (torch.autocast("cuda", dtype=torch.bfloat16) if case.autocast and gpu
                    else contextlib.nullcontext())
        local = max(1, case.batch // world) if world > 1 else case.batch
        if pollux:
            import pollux_launch.adapters.torch as px

            loader = px.AdaptiveDataLoader(data, batch_size=local * world, shuffle=True,
                                           drop_last=True, **kw)
            self.trainer = px.ElasticTrainer(model, opt, loader)
            self.batches = self._pollux_batches(loader)
        else:
            self.trainer = None
            self.model = (torch.nn.parallel.DistributedDataParallel(model) if world > 1
                          else model)
            self.opt = opt
            loader = DataLoader(TensorBatches(data), batch_size=local, collate_fn=whole_batch,
                                shuffle=world == 1, drop_last=True,
                                sampler=(torch.utils.data.DistributedSampler(data)
                                         if world > 1 else None), **kw)
            self.batches = self._plain_batches(loader)

    def _pollux_batches(self, loader: Any) -> Iterator[Any]:
        assert self.trainer is not None
        for _ in self.trainer.epochs(1e12):
            yield from loader

    @staticmethod
    def _plain_batches(loader: DataLoader) -> Iterator[Any]:
        epoch = 0
        while True:
            if isinstance(loader.sampler, torch.utils.data.DistributedSampler):
                loader.sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    def run(self, steps: int) -> None:
        dev, loss_fn, tr = self.device, self.case.loss, self.trainer
        for _ in range(steps):
            x, y = next(self.batches)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            if tr is not None:
                with self.amp:
                    loss = loss_fn(tr.model(x), y)
                tr.step(loss)
            else:
                with self.amp:
                    loss = loss_fn(self.model(x), y)
                loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)


def _sync(device: torch.device, world: int) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world > 1:
        dist.barrier()


def time_sides(sides: dict[str, Callable[[int], None]], pairs: int, block: int,
               warmup: int, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Alternating blocks of ``sides["plain"]`` and ``sides["pollux"]`` (each
    ``run(steps)``), timed between ``sync()`` calls (module docstring): ms per step and
    the overhead, medians of the pairs, from wall time and from this process's CPU time."""
    for run in sides.values():
        run(warmup)
    wall: dict[str, list[float]] = {"plain": [], "pollux": []}
    cpu: dict[str, list[float]] = {"plain": [], "pollux": []}
    for i in range(pairs):
        for name in (("plain", "pollux") if i % 2 == 0 else ("pollux", "plain")):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            sides[name](block)
            sync()
            wall[name].append((time.perf_counter() - t0) / block)
            cpu[name].append((time.process_time() - c0) / block)
    pairs_of = {k: list(zip(v["plain"], v["pollux"], strict=True))
                for k, v in (("wall", wall), ("cpu", cpu))}
    return {"plain_ms": round(1e3 * statistics.median(wall["plain"]), 4),
            "pollux_ms": round(1e3 * statistics.median(wall["pollux"]), 4),
            "overhead_pct": round(100 * statistics.median(
                [b / a - 1 for a, b in pairs_of["wall"]]), 3),
            "diff_us": round(1e6 * statistics.median([b - a for a, b in pairs_of["wall"]]), 2),
            "diff_us_cpu": round(1e6 * statistics.median(
                [b - a for a, b in pairs_of["cpu"]]), 2)}


def measure(case: Case, device: torch.device, pairs: int, block: int, warmup: int,
            world: int = 1) -> dict[str, float]:
    """``case``'s plain loop against pollux's (:func:`time_sides`)."""
    sides = {"plain": Side(case, device, False, world), "pollux": Side(case, device, True, world)}
    return time_sides({k: v.run for k, v in sides.items()}, pairs, block, warmup,
                      lambda: _sync(device, world))


def _replica(rank: int, world: int, init: str, case_name: str, args: argparse.Namespace,
             out: dict) -> None:
    gpu = torch.cuda.is_available()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("nccl" if gpu else "gloo", init_method=init, rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    try:
        got = measure(make_case(case_name, gpu), device, args.pairs, args.block, args.warmup,
                      world)
        if rank == 0:
            out[case_name] = got
    finally:
        dist.destroy_process_group()


def fetch_figures(batch: int, repeats: int) -> dict[str, float]:
    """us per micro-batch: AdaptiveDataLoader over a plain TensorDataset (one fetch per
    batch) against DataLoader's per-sample fetch and collation of the same."""
    import pollux_launch.adapters.torch as px

    data = make_case("mlp", False).data()
    loaders = {"dataloader_us": DataLoader(data, batch_size=batch, shuffle=True),
               "adaptive_us": px.AdaptiveDataLoader(data, batch_size=batch, shuffle=True)}
    out = {}
    for name, loader in loaders.items():
        it, n = iter(loader), 0
        t0 = time.perf_counter()
        while n < repeats:
            try:
                next(it)
                n += 1
            except StopIteration:
                it = iter(loader)
        out[name] = round(1e6 * (time.perf_counter() - t0) / repeats, 2)
    return out


def bench(args: argparse.Namespace, report: Report) -> None:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        make_case(c, False)  # (an unknown name is a usage error before anything runs)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    report["device"] = torch.cuda.get_device_name(device) if gpu else "cpu"
    report["cases"] = results = {}
    if not gpu:
        torch.set_num_threads(args.threads)
    for name in cases:
        with report.case(name):
            print(f"{name}: {args.pairs} pairs of {args.block}-step blocks", file=sys.stderr,
                  flush=True)
            results[name] = measure(make_case(name, gpu), device, args.pairs, args.block,
                                    args.warmup)
            print(f"  {results[name]}", file=sys.stderr, flush=True)
    if "tiny" in results:
        report["host_us_per_step"] = results["tiny"]["diff_us"]
        report["host_us_per_step_cpu"] = results["tiny"]["diff_us_cpu"]
    if args.replicas >= 2:
        if gpu and torch.cuda.device_count() < 2:
            report["replicas_2"] = "skipped: one GPU (NCCL needs a GPU per rank)"
        else:
            for name in cases:
                with report.case(f"{name}@2"):
                    out = mp.Manager().dict()
                    init = f"file://{tempfile.mkdtemp(prefix='step-overhead-')}/rdzv"
                    mp.spawn(_replica, args=(2, init, name, args, out), nprocs=2)
                    results[f"{name}@2"] = dict(out[name])
                    print(f"{name}@2: {results[f'{name}@2']}", file=sys.stderr, flush=True)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if frameworks:
        from step_overhead_frameworks import measure_framework  # beside this script

        report["frameworks"] = fw = {}
        for name in frameworks:
            with report.case(name):
                print(f"{name}: the tiny case, {args.pairs} pairs", file=sys.stderr, flush=True)
                fw[name] = measure_framework(name, args.pairs, args.fw_block, args.warmup)
                print(f"  {fw[name]}", file=sys.stderr, flush=True)
    with report.case("fetch"):
        report["fetch"] = fetch_figures(128, args.fetch_repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(ALL_CASES),
                        help=f"comma-separated, of {', '.join(ALL_CASES)} (default: all)")
    parser.add_argument("--pairs", type=int, default=12, help="alternating block pairs")
    parser.add_argument("--block", type=int, default=50, help="steps per block")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per side first")
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2),
                        help="2: also at two replicas (DDP)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on a CPU (default 1: host work is what is timed)")
    parser.add_argument("--fetch-repeats", type=int, default=300)
    parser.add_argument("--frameworks", default="deepspeed,horovod",
                        help="also the DeepSpeed / Horovod adapters' step paths on the tiny "
                        "case, each against its framework's own loop ('' for none)")
    parser.add_argument("--fw-block", type=int, default=200, help="their steps per block")
    return run_benchmark(parser, bench, smoke={
        "cases": "tiny,mlp", "pairs": 2, "block": 3, "warmup": 3, "replicas": 2,
        "fetch_repeats": 5, "fw_block": 3})


if __name__ == "__main__":
    sys.exit(main())
