"""Synthetic workloads for Saxena et al.'s scenarios (MASCOTS 2020): Poisson arrivals at a
high or a low rate of compute-bound and communication-bound jobs, each with a batch-size
range and a GPU cap, drawn from the Pollux trace models. Deterministic given a seed;
written in the workload CSV format (:func:`pollux_launch.sim.workload.write_workload`)::

    python -m pollux_launch.sim.generate --scenario high_rate --gpus 16 --jobs 40 \\
        --seed 0 --output high.csv        # prints a JSON line: rate, horizon, jobs

or ``pollux-run simulate --scenario high_rate ...`` to generate and simulate at once.

Job categories, measured, not named by hand (:func:`classify_models`): a model is
*communication-bound* when all-reduce takes at least half of its measured step time at
the reference configuration - 8 GPUs on 2 nodes (placement 44), at the geometric middle
of its per-GPU batch bounds - and *compute-bound* otherwise. On the bundled traces:
bert 0.77, yolov3 0.69, ncf 0.72 (communication); cifar10 0.37, deepspeech2 0.36,
imagenet 0.36 (compute). Two models are left out by default: ncf, which the authors'
simulator pins to one GPU at batch 32768 and which trains in under a minute (no
scaling to decide), and imagenet, whose 90 epochs take 20-150 hours (no job could
finish within a scenario of hours). Each job: a category (1/2 each), a model of that
category (uniform), a batch range ``[M0 * 2^u, min(M0 * 2^(u + w), M_max)]`` with
``u`` in {0, 1} and ``w`` in {2, 3, 4} (the paper's jobs declare ranges of 4-16x), and a
GPU cap drawn from {4, 8, 16} (at most the cluster).

Arrival rates. The paper runs its simulated cluster at a high arrival rate, where more
jobs arrive than it can serve (jobs queue or are dropped), and at a low one, where it
keeps up. We derive the rates from the cluster instead of copying the paper's jobs per
hour (its jobs and cluster differ from these traces): the *offered load* of a rate
lambda is ``lambda * W / G``, where ``W`` is the mean single-GPU work of a job (seconds
to train it on one GPU at its best batch size, epoch by epoch from the true tables,
averaged over the category and model mix) and ``G`` the cluster's GPUs. Scaling out
never does better than linear, so a load above 1 overloads any policy. ``high_rate``
offers load 2.0 (twice what the cluster can serve at single-GPU efficiency) and
``low_rate`` 0.4 (well within it, room to scale jobs out); ``mid_rate`` (0.8) lies
between them. The scenario's horizon (the time up to which completed jobs are counted)
is the expected arrival window, ``jobs / lambda``: how many jobs a policy finishes
while they keep arriving. The same seed draws the same jobs in every scenario (only
their arrival times scale with the rate).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pollux_launch.sim.traces import MODELS_DIR, ModelTrace, available_models, load_model
from pollux_launch.sim.workload import TraceJob, WorkloadError, write_workload

COMPUTE, COMMUNICATION = "compute", "communication"
CATEGORIES = (COMPUTE, COMMUNICATION)
COMM_SHARE = 0.5  # all-reduce share of the step time from which a model is comm-bound
REFERENCE_PLACEMENT = (4, 4)  # 8 GPUs on 2 nodes
EXCLUDED_MODELS = {
    "ncf": "pinned to one GPU at batch 32768 by the authors' simulator; trains in < 1 min",
    "imagenet": "90 epochs take 20-150 hours: no job could finish within a scenario",
}
RANGE_START = (0, 1)  # min batch = M0 * 2^u
RANGE_WIDTH = (2, 3, 4)  # max batch = min batch * 2^w (at most the model's largest)
GPU_CAPS = (4, 8, 16)


@dataclass(frozen=True)
class Scenario:
    """An arrival pattern: offered load (arrival rate x mean single-GPU work / GPUs)."""

    name: str
    load: float
    jobs: int = 40


SCENARIOS = {
    "high_rate": Scenario("high_rate", load=2.0),
    "low_rate": Scenario("low_rate", load=0.4),
    # between the two: about what saxena-dp can serve and more than max-bs can, where
    # their gaps are widest (not one of the paper's two; benchmarks --scenarios mid_rate)
    "mid_rate": Scenario("mid_rate", load=0.8),
}


@dataclass(frozen=True)
class GeneratedWorkload:
    """Jobs of one scenario and how they were drawn."""

    scenario: str
    specs: list[TraceJob]
    rate_per_hour: float  # Poisson arrival rate
    horizon: float  # seconds: the expected arrival window, jobs / rate
    load: float  # offered load (module docstring)
    gpus: int
    seed: int
    categories: dict[str, str]  # model -> category

    def info(self) -> dict:
        """A JSON-able summary (the CLI's line)."""
        count = {c: sum(self.categories[s.application] == c for s in self.specs)
                 for c in CATEGORIES}
        return {"scenario": self.scenario, "jobs": len(self.specs), "gpus": self.gpus,
                "load": self.load, "rate_per_hour": round(self.rate_per_hour, 4),
                "horizon": round(self.horizon, 1), "seed": self.seed, "categories": count,
                "models": sorted({s.application for s in self.specs})}


def comm_share(trace: ModelTrace) -> float:
    """All-reduce share of the measured step time at the reference configuration."""
    local = math.sqrt(trace.min_local_bsz * trace.max_local_bsz)
    step, sync = trace.step_time(REFERENCE_PLACEMENT, local)
    return float(sync / step)


def classify_models(models_dir: str | Path = MODELS_DIR,
                    models: list[str] | None = None) -> dict[str, str]:
    """Each model's category: communication-bound if all-reduce is >= half its step."""
    names = available_models(models_dir) if models is None else models
    return {m: COMMUNICATION if comm_share(load_model(m, models_dir)) >= COMM_SHARE
            else COMPUTE for m in names}


@functools.cache
def _work(name: str, models_dir: str) -> float:
    return single_gpu_work(load_model(name, models_dir))


def single_gpu_work(trace: ModelTrace, lo: int | None = None, hi: int | None = None) -> float:
    """Seconds to train a job of ``trace`` on one GPU at its best total batch in
    ``[lo, hi]`` (default: the model's range), epoch by epoch from the true tables."""
    lo = trace.init_batch_size if lo is None else lo
    hi = trace.max_batch_size if hi is None else hi
    batches = np.unique(np.geomspace(lo, hi, 24).round().astype(int))
    accum = np.maximum(np.ceil(batches / trace.max_local_bsz - 1e-8) - 1, 0)
    local = np.ceil(batches / (accum + 1))
    local = np.maximum(local, trace.min_local_bsz)
    total = local * (accum + 1)
    step, sync = trace.step_times((1,), local)
    t_iter = step + accum * (step - sync)
    seconds = 0.0
    ends = trace.epoch_progress
    for e in range(trace.max_epochs):
        rate = trace.gain(total, e) / t_iter  # M0-iterations per second
        seconds += (ends[e + 1] - ends[e]) / float(rate.max())
    return seconds


def generate_workload(scenario: str | Scenario, *, gpus: int, seed: int = 0,
                      jobs: int | None = None, models_dir: str | Path = MODELS_DIR,
                      models: list[str] | None = None) -> GeneratedWorkload:
    """Draw a scenario's jobs for a cluster of ``gpus`` GPUs (module docstring)."""
    if isinstance(scenario, str):
        if scenario not in SCENARIOS:
            raise WorkloadError(f"unknown scenario {scenario!r}; choose one of "
                             f"{', '.join(SCENARIOS)}")
        scenario = SCENARIOS[scenario]
    count = scenario.jobs if jobs is None else int(jobs)
    if count < 1:
        raise WorkloadError(f"a scenario needs at least 1 job, got {count}")
    if gpus < 1:
        raise WorkloadError(f"the cluster needs at least 1 GPU, got {gpus}")
    if models is None:
        models = [m for m in available_models(models_dir) if m not in EXCLUDED_MODELS]
    categories = classify_models(models_dir, models)
    by_cat = {c: sorted(m for m, k in categories.items() if k == c) for c in CATEGORIES}
    present = [c for c in CATEGORIES if by_cat[c]]
    if not present:
        raise WorkloadError("no trace models to draw jobs from")
    # Mean single-GPU work of the mix: each present category equally likely, then its
    # models uniformly.
    mean_work = float(np.mean([np.mean([_work(m, str(models_dir)) for m in by_cat[c]])
                               for c in present]))
    rate = scenario.load * gpus / mean_work  # jobs per second
    rng = np.random.default_rng(seed)
    t, specs = 0.0, []
    caps = [c for c in GPU_CAPS if c <= gpus] or [gpus]
    for i in range(count):
        t += float(rng.exponential(1.0 / rate))
        cat = present[int(rng.integers(len(present)))]
        model = by_cat[cat][int(rng.integers(len(by_cat[cat])))]
        trace = load_model(model, models_dir)
        lo = trace.init_batch_size * 2 ** int(rng.choice(RANGE_START))
        hi = min(lo * 2 ** int(rng.choice(RANGE_WIDTH)), trace.max_batch_size)
        lo = min(lo, hi)
        cap = int(rng.choice(caps))
        specs.append(TraceJob(f"{scenario.name}-{i:03d}-{model}", round(t, 1), model,
                              min_batch_size=int(lo), max_batch_size=int(hi),
                              max_replicas=cap))
    return GeneratedWorkload(scenario.name, specs, rate * 3600.0, count / rate,
                             scenario.load, int(gpus), int(seed), categories)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pollux_launch.sim.generate",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    ap.add_argument("--gpus", type=int, default=64,
                    help="GPUs of the cluster the rate is sized for (64)")
    ap.add_argument("--jobs", type=int, default=None, help="jobs to draw (scenario's: 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models-dir", default=None, metavar="DIR")
    ap.add_argument("--output", required=True, metavar="FILE", help="workload CSV to write")
    args = ap.parse_args(argv)
    try:
        gen = generate_workload(args.scenario, gpus=args.gpus, seed=args.seed, jobs=args.jobs,
                                models_dir=args.models_dir or MODELS_DIR)
    except ValueError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    write_workload(gen.specs, args.output)
    print(json.dumps({**gen.info(), "output": str(args.output)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
