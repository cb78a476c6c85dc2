"""Time one PolluxSched round on an N-GPU cluster, for every policy engine.

    python benchmarks/policy_scale.py --gpus 64 [--repeats 20] [--ga-gens 100] [--ga-pop 100]
                                      [--saxena-scale 64,1024]

The cluster has 4 GPUs per node and about one active job per 2.5 GPUs (the Pollux
workloads at their busiest). Jobs are drawn from the six trace models; each job's
speedup function is the goodput core's ``SpeedupFunction`` (throughput model fitted to the
model's placements.csv, gradient statistics from its validation CSVs at the job's epoch),
built fresh for every timed solve so its memo starts cold as after a refit;
``--speedup trace-table`` (or a missing goodput core) uses a table of the traces'
ground-truth goodput instead. Each job's ``throughput_fn`` (what ``saxena-dp``
maximises) is likewise the goodput core's ``ThroughputFunction`` (samples/s at the best
batch in [M0, max batch], no statistical efficiency), or the traces' raw samples/s. The
round's ``current`` allocation is a previous round's answer with 10 % of the jobs
finished and as many new arrivals, so both re-allocation penalties and new jobs matter.
Every engine solves the same round; fitness is FITNESS_p (Eqn 14) of its answer and
total_throughput the sum of the jobs' samples/s in it (the objective of saxena-dp,
Saxena et al. MASCOTS 2020). ``saxena-dp`` is also timed alone on the rounds of
``--saxena-scale`` cluster sizes (default 64 and 1024 GPUs).

Prints a table and, as the LAST line, one JSON object:
{"gpus", "jobs", "policies": {name: {"solve_ms_median", "solve_ms_p95", "fitness",
 "total_throughput", ...}}, "default", "default_solve_ms_median", "default_solve_ms_p95",
 "default_fitness_ratio", "saxena_dp_scale": {"<gpus>": {"jobs", "solve_ms_median",
 "solve_ms_p95", ...}}}.
p95 is the 95th percentile of the timed solves (linear interpolation), so it means
something only with many of them: 20 of the default engine by default; the GA's single
timed solve (``--ga-repeats 1``) makes its p95 that one time. An engine that failed is
named under ``"failed"``. ``--smoke``: 16 GPUs, 2 solves, a GA of 10 x 3 generations.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
from harness import Report, UsageError, run_benchmark  # beside this script
from tqdm import tqdm

from pollux_launch.policy import (
    DEFAULT_POLICY,
    JobInfo,
    PolicyNode,
    check_allocation,
    evaluate_fitness,
    make_policy,
)

SLOTS = 4
MAX_TABLE_NODES = 16  # the trace measurements cover up to 16 nodes


@dataclass(frozen=True)
class TableSpeedup:
    """speedup(num_nodes, num_replicas) read from a precomputed goodput table."""

    table: np.ndarray  # (MAX_TABLE_NODES + 1, K + 1); row 0 and column 0 are zero

    def __call__(self, num_nodes, num_replicas):
        n = np.clip(np.asarray(num_nodes), 0, self.table.shape[0] - 1)
        k = np.asarray(num_replicas)
        ok = (k >= 0) & (k < self.table.shape[1])
        return np.where(ok, self.table[n, np.clip(k, 0, self.table.shape[1] - 1)], 0.0)


def _placement(n: int, k: int) -> tuple[int, ...]:
    n = max(min(n, k), -(-k // SLOTS))
    base, rem = divmod(k, n)
    return tuple([base + 1] * rem + [base] * (n - rem))


@functools.cache
def trace_table(model: str, epoch: int, efficiency: bool = True) -> tuple[np.ndarray, int]:
    """Ground-truth goodput table of one model at one epoch, normalised to 1 GPU; with
    ``efficiency=False`` its raw throughput (samples/s, not normalised) instead."""
    from pollux_launch.sim import traces

    tr = traces.load_model(model)
    kmax = min(tr.max_replicas, tr.max_batch_size // tr.min_local_bsz)
    kmax = min(kmax, getattr(traces, "PINNED_MAX_REPLICAS", {}).get(model, kmax))
    bsz = np.unique(np.geomspace(tr.min_local_bsz, tr.max_local_bsz, 10).round())
    table = np.zeros((MAX_TABLE_NODES + 1, kmax + 1))
    for k in range(1, kmax + 1):
        b = bsz[bsz * k <= tr.max_batch_size]
        if b.size == 0:
            continue
        eff = tr.efficiency(b * k, epoch) if efficiency else 1.0
        for n in range(1, min(k, MAX_TABLE_NODES) + 1):
            step, _ = tr.step_times(_placement(n, k), b)
            table[n, k] = np.max(b * k / step * eff)
    if efficiency:
        table /= table[1, 1]
    return table, kmax


@functools.cache
def _goodput_model(model: str):
    """Throughput parameters fitted to the model's placements.csv (goodput core)."""
    from pollux_launch import goodput
    from pollux_launch.sim import traces

    tr = traces.load_model(model)
    cols: dict[str, list] = {"n": [], "k": [], "b": [], "step": [], "sync": []}
    for placement, (bsz, step, sync) in tr.placement_tables.items():
        cols["n"] += [len(placement)] * len(bsz)
        cols["k"] += [sum(placement)] * len(bsz)
        cols["b"] += list(bsz)
        cols["step"] += list(step)
        cols["sync"] += list(sync)
    c = {key: np.asarray(v, dtype=float) for key, v in cols.items()}
    perf = goodput.fit_perf_params(
        c["n"], c["k"], c["b"], np.zeros_like(c["b"]), c["step"], c["sync"]
    )
    return tr, perf


def goodput_core_speedup(model: str, epoch: int):
    """A fresh goodput-core SpeedupFunction for a model at an epoch, or None."""
    try:
        from pollux_launch import goodput

        tr, perf = _goodput_model(model)
    except (ImportError, AttributeError):
        return None
    sqr, var = tr.grad_stats(tr.init_batch_size, epoch)
    fn = goodput.GoodputFunction(
        perf, goodput.GradParams(float(sqr), float(var)), tr.init_batch_size
    )
    return goodput.SpeedupFunction(
        fn, tr.max_batch_size, (tr.min_local_bsz, tr.max_local_bsz), accumulation=True
    )


def goodput_core_throughput(model: str):
    """A fresh goodput-core ThroughputFunction for a model (its batch range: [M0, max])."""
    from pollux_launch import goodput

    tr, perf = _goodput_model(model)
    return goodput.ThroughputFunction(
        perf,
        min_batch_size=tr.init_batch_size,
        max_batch_size=tr.max_batch_size,
        local_bsz_bounds=(tr.min_local_bsz, tr.max_local_bsz),
        accumulation=True,
    )


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: str
    epoch: int
    age: float
    restarts: int


def make_jobs(specs: list[JobSpec], source: str) -> tuple[list[JobInfo], str]:
    """Fresh JobInfo objects (fresh, cold speedup memos, as after each round's refit)."""
    jobs, used = [], source
    for spec in specs:
        fn = goodput_core_speedup(spec.model, spec.epoch) if source != "trace-table" else None
        table, kmax = trace_table(spec.model, spec.epoch) if fn is None else (None, 0)
        if fn is None:
            used, fn = "trace-table", TableSpeedup(table)
            thr = TableSpeedup(trace_table(spec.model, spec.epoch, efficiency=False)[0])
        else:
            used = "goodput-core"
            tr, _ = _goodput_model(spec.model)
            kmax = min(tr.max_replicas, tr.max_batch_size // tr.min_local_bsz)
            thr = goodput_core_throughput(spec.model)
        if spec.model == "ncf":  # ncf jobs ran on one GPU in the Pollux workloads
            kmax = 1
        jobs.append(JobInfo(spec.name, fn, spec.age, spec.restarts, max_replicas=max(kmax, 1),
                            throughput_fn=thr))
    return jobs, used


def build_round(gpus: int, seed: int, source: str):
    """One busy round: specs of the active jobs, the nodes, and the current allocation."""
    from pollux_launch.sim import traces

    rng = np.random.default_rng(seed)
    nodes = [PolicyNode(f"node{i}", SLOTS) for i in range(gpus // SLOTS)]
    models = traces.available_models()
    n_jobs = max(1, round(gpus / 2.5))

    def spec(i: int, age: float, new: bool = False) -> JobSpec:
        model = models[int(rng.integers(len(models)))]
        epoch = int(rng.choice([0, traces.MAX_EPOCHS.get(model, 10) // 2]))
        restarts = 0 if new else int(rng.integers(0, 4))
        return JobSpec(f"{model}-{i}", model, epoch, age, restarts)

    specs = [spec(i, float(rng.uniform(600, 4 * 3600))) for i in range(n_jobs)]
    jobs, _ = make_jobs(specs, source)
    prev = make_policy(DEFAULT_POLICY).optimize(
        jobs, nodes, np.zeros((n_jobs, len(nodes)), dtype=np.int64)
    )
    # 10 % of jobs finish, as many arrive: the timed round.
    done = set(rng.choice(n_jobs, size=n_jobs // 10, replace=False).tolist())
    keep = [j for j in range(n_jobs) if j not in done]
    # (arrived since the last round: ages in (0, 60] s; at age 0 the penalty is 0)
    specs = [specs[j] for j in keep] + [spec(n_jobs + i, float(rng.uniform(1e-3, 60.0)), True)
                                        for i in range(len(done))]
    current = np.vstack([prev[keep], np.zeros((len(done), len(nodes)), dtype=np.int64)])
    return specs, nodes, current


def total_throughput(jobs: list[JobInfo], alloc: np.ndarray) -> float:
    """Sum of the jobs' samples/s (``throughput_fn``) in ``alloc``: saxena-dp's objective."""
    nn, kk = np.count_nonzero(alloc, axis=1), alloc.sum(axis=1)
    return float(sum(float(j.throughput_fn(nn[i], kk[i])) for i, j in enumerate(jobs)))


def time_saxena(gpus: int, seed: int, source: str, repeats: int, p: float) -> dict:
    """saxena-dp alone on the busy round of a ``gpus``-GPU cluster (fresh jobs per solve)."""
    specs, nodes, current = build_round(gpus, seed, source)
    times, cpu = [], []
    for r in range(repeats):
        pol = make_policy("saxena-dp", p=p, seed=seed + r)
        jobs, _ = make_jobs(specs, source)
        t0, c0 = time.perf_counter(), time.process_time()
        alloc = pol.optimize(jobs, nodes, current)
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
        check_allocation(alloc, nodes, jobs, current)
    return {
        "jobs": len(specs),
        "solve_ms_median": round(statistics.median(times), 2),
        "solve_ms_p95": p95(times),
        "solve_cpu_ms_median": round(statistics.median(cpu), 2),
        "solve_cpu_ms_p95": p95(cpu),
        "jobs_with_gpus": int(np.count_nonzero(alloc.sum(axis=1))),
        "gpus_allocated": int(alloc.sum()),
        "total_throughput": round(total_throughput(jobs, alloc), 1),
        "repeats": repeats,
    }


def p95(samples: list[float]) -> float:
    """95th percentile (linear interpolation between the closest ranks), rounded."""
    return round(float(np.percentile(samples, 95)), 2)


def solve_engine(name: str, opts: dict, repeats: int, warmup: int, specs: list[JobSpec],
                 nodes: list[PolicyNode], current: np.ndarray, args: argparse.Namespace,
                 bar: tqdm) -> dict:
    """``repeats`` timed solves of engine ``name`` (each after ``warmup`` untimed ones)."""
    times, cpu, fits, thr = [], [], [], []
    for r in range(repeats):
        pol = make_policy(name, p=args.p, seed=args.seed + r, **opts)
        for _ in range(warmup):
            pol.optimize(make_jobs(specs, args.speedup)[0], nodes, current)
            bar.update()
        jobs, _ = make_jobs(specs, args.speedup)
        t0, c0 = time.perf_counter(), time.process_time()
        alloc = pol.optimize(jobs, nodes, current)
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
        check_allocation(alloc, nodes, jobs, current)
        fits.append(evaluate_fitness(jobs, nodes, alloc, current, args.p))
        thr.append(total_throughput(jobs, alloc))
        bar.update()
    return {
        "solve_ms_median": round(statistics.median(times), 2),
        "solve_ms_p95": p95(times),
        # CPU time too: on a shared machine wall time includes waiting for a core.
        "solve_cpu_ms_median": round(statistics.median(cpu), 2),
        "solve_cpu_ms_p95": p95(cpu),
        "fitness": round(float(statistics.median(fits)), 6),
        "total_throughput": round(float(statistics.median(thr)), 1),
        "gpus_allocated": int(alloc.sum()),
        "repeats": repeats,
        **({"pop_size": opts["pop_size"], "n_gen": opts["n_gen"]} if opts else {}),
        **({"warmup_rounds": warmup} if warmup else {}),
    }


def bench(args: argparse.Namespace, report: Report) -> None:
    if args.gpus < SLOTS or args.gpus % SLOTS:
        raise UsageError(f"--gpus must be a positive multiple of {SLOTS}")
    try:
        scale_gpus = [int(x) for x in args.saxena_scale.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--saxena-scale must be comma-separated GPU counts, got "
                         f"{args.saxena_scale!r}") from None
    if any(g < SLOTS or g % SLOTS for g in scale_gpus):
        raise UsageError(f"--saxena-scale sizes must be positive multiples of {SLOTS}")
    specs, nodes, current = build_round(args.gpus, args.seed, args.speedup)
    jobs, source = make_jobs(specs, args.speedup)
    engines = {
        DEFAULT_POLICY: ({}, args.repeats, 0),
        "pollux-ga": (
            {"pop_size": args.ga_pop, "n_gen": args.ga_gens},
            args.ga_repeats,
            args.ga_warmup,
        ),
        "saxena-dp": ({}, args.repeats, 0),
    }
    results = {}
    total = sum(r * (1 + w) for _, r, w in engines.values())
    bar = tqdm(total=total, desc="solving", file=sys.stderr)
    for name, (opts, repeats, warmup) in engines.items():
        with report.case(name):
            results[name] = solve_engine(name, opts, repeats, warmup, specs, nodes, current,
                                         args, bar)
    bar.close()
    scale = {}
    for gpus in tqdm(scale_gpus, desc="saxena-dp scale", file=sys.stderr):
        with report.case(f"saxena-dp@{gpus}"):
            scale[str(gpus)] = time_saxena(gpus, args.seed, args.speedup, args.repeats, args.p)
    print(f"{'policy':<12}{'solve_ms':>12}{'p95_ms':>12}{'fitness':>12}{'gpus':>8}"
          f"{'samples/s':>14}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['solve_ms_median']:>12.1f}{r['solve_ms_p95']:>12.1f}"
            f"{r['fitness']:>12.4f}{r['gpus_allocated']:>8}{r['total_throughput']:>14.1f}"
        )
    for gpus, r in scale.items():
        label = f"saxena@{gpus}"
        print(
            f"{label:<12}{r['solve_ms_median']:>12.1f}{r['solve_ms_p95']:>12.1f}"
            f"{'':>12}{r['gpus_allocated']:>8}{r['total_throughput']:>14.1f}"
        )
    default = results.get(DEFAULT_POLICY, {})
    ga_fit = results.get("pollux-ga", {}).get("fitness")
    report.update({
        "gpus": args.gpus,
        "jobs": len(jobs),
        "speedup_source": source,
        "policies": results,
        "default": DEFAULT_POLICY,
        "default_solve_ms_median": default.get("solve_ms_median"),
        "default_solve_ms_p95": default.get("solve_ms_p95"),
        "default_fitness_ratio": (None if not default or ga_fit is None
                                  else round(default["fitness"] / ga_fit, 4) if ga_fit > 0
                                  else math.inf),
        "saxena_dp_scale": scale,
    })


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=64, help="cluster size (multiple of 4)")
    ap.add_argument(
        "--repeats", type=int, default=20, help="timed solves of the default policy (p95)"
    )
    ap.add_argument("--ga-repeats", type=int, default=1, help="timed solves of pollux-ga")
    ap.add_argument("--ga-pop", type=int, default=100, help="GA population (paper: 100)")
    ap.add_argument("--ga-gens", type=int, default=100, help="GA generations (paper: 100)")
    ap.add_argument(
        "--ga-warmup",
        type=int,
        default=2,
        help="untimed GA rounds before each timed one, so that it runs warm-started as in "
        "steady operation (each round re-seeds its population from the previous one)",
    )
    ap.add_argument("--p", type=float, default=-1.0, help="fairness exponent of Eqn 14")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--saxena-scale",
        default="64,1024",
        help="comma-separated cluster sizes (GPUs) on which saxena-dp is also timed alone "
        "(--repeats solves each); empty: none",
    )
    ap.add_argument(
        "--speedup",
        choices=["auto", "trace-table"],
        default="auto",
        help="speedup functions: the goodput core when available (auto) or trace tables",
    )
    return run_benchmark(ap, bench, argv=argv, smoke={
        "gpus": 16, "repeats": 2, "ga_pop": 10, "ga_gens": 3, "ga_warmup": 1,
        "saxena_scale": "16"})


if __name__ == "__main__":
    sys.exit(main())
