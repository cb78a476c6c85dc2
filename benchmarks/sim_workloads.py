"""Average JCT of the Pollux workloads per rescale model, next to the published figures.

    python benchmarks/sim_workloads.py [--loads 1.0] [--workloads 1-8]
        [--rescale-models live,checkpoint-restart] [--policies pollux-dp] [--procs 2]
        [--rescale-calibration FILE]

Runs every load x workload x rescale model x policy in the trace simulator (what
``pollux-run simulate`` runs), at most ``--procs`` at a time. Each rescale model gets
the round interval it implies (``RescaleCost.round_interval``: 60 s for the paper's
checkpoint-restart, 15 s for live) and the calibrated costs (default: the bundled
calibration from benchmarks/rescale.py). Prints a table per load and, as its LAST line,
one JSON object::

    {"loads": {"1.0": {"workloads": {"workload-1": {"live": s, "checkpoint-restart": s,
                                                    "published": s}, ...},
                       "mean": {...}, "live_vs_published": r, "max_live_vs_published": r,
                       "checkpoint-restart_vs_published": r}, ...},
     "live_vs_published": r (load 1.0), "published": {...}, "calibration": "...", ...}

``*_vs_published`` is the mean over workloads of avg JCT / the published Pollux avg JCT
where per-workload figures are published (load 1.0), else the ratio of the means over
workloads 1-8. A policy other than the default is reported as ``<model>:<policy>``.
``--smoke``: the first 5 jobs of workload 1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time

from harness import Report, UsageError, run_benchmark  # beside this script
from tqdm import tqdm

from pollux_launch.calibration import load_rescale_cost
from pollux_launch.policy import DEFAULT_POLICY
from pollux_launch.policy.rescale_cost import RESCALE_MODELS
from pollux_launch.sim.run import config_for, run_specs
from pollux_launch.sim.traces import TRACES_DIR, available_models, parse_numbers
from pollux_launch.sim.workload import load_workload

# traces/README.md: Pollux (p = -1), authors' simulator, 64 GPUs, 60 s, 30 s per restart.
PUBLISHED_POLLUX = {1.0: [2089, 3323, 2188, 2721, 2674, 2446, 3616, 2952]}
PUBLISHED_MEAN = {
    "pollux": {0.5: 1534, 1.0: 2751, 1.5: 3685, 2.0: 5289},
    "tiresias+tunedjobs": {0.5: 2091, 1.0: 4038, 1.5: 6182, 2.0: 10040},
    "optimus+oracle+tunedjobs": {0.5: 2395, 1.0: 5682, 1.5: 7235, 2.0: 9721},
}
LOAD_DIRS = {0.5: "workloads-0.5", 1.0: "workloads", 1.5: "workloads-1.5", 2.0: "workloads-2.0"}


def _one(task):
    load, k, model, policy, seed, calibration, jobs = task
    path = TRACES_DIR / LOAD_DIRS[load] / f"workload-{k}.csv"
    t0 = time.perf_counter()
    cfg = config_for(model, load_rescale_cost(calibration))
    res = run_specs(load_workload(path, available_models())[:jobs], policy, cfg, seed=seed)
    summary = res.summary()
    summary["wall_s"] = time.perf_counter() - t0
    return load, k, _label(model, policy), summary


def _label(model: str, policy: str) -> str:
    return model if policy == DEFAULT_POLICY else f"{model}:{policy}"



def _ratio(load: float, ks: list[int], jcts: dict[int, float]) -> float:
    """avg JCT / published Pollux: mean of per-workload ratios, or of the means."""
    per_workload = PUBLISHED_POLLUX.get(load)
    if per_workload:
        return sum(jcts[k] / per_workload[k - 1] for k in ks) / len(ks)
    return sum(jcts.values()) / len(ks) / PUBLISHED_MEAN["pollux"][load]


def bench(args: argparse.Namespace, report: Report) -> None:
    try:
        loads = [float(x) for x in args.loads.split(",")]
        ks = parse_numbers(args.workloads)
        cost = load_rescale_cost(args.rescale_calibration)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if bad := [x for x in loads if x not in LOAD_DIRS]:
        raise UsageError(f"unknown load {bad[0]}; choose from {sorted(LOAD_DIRS)}")
    models = [m.strip() for m in args.rescale_models.split(",") if m.strip()]
    if bad := [m for m in models if m not in RESCALE_MODELS]:
        raise UsageError(f"unknown rescale model {bad[0]!r}; "
                         f"choose from {', '.join(RESCALE_MODELS)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    tasks = [(load, k, m, p, args.seed, args.rescale_calibration, args.jobs)
             for load in loads for k in ks for m in models for p in policies]
    labels = [_label(m, p) for m in models for p in policies]
    results: dict[float, dict[int, dict[str, dict]]] = {x: {k: {} for k in ks} for x in loads}
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(max(1, min(args.procs, 2))) as pool:
        for load, k, label, summary in tqdm(pool.imap_unordered(_one, tasks), total=len(tasks),
                                            file=sys.stderr, desc="simulate"):
            results[load][k][label] = summary
            tqdm.write(f"load {load}x workload-{k} {label}: avg JCT {summary['avg_jct']:.0f} s "
                       f"(interval {summary['interval']:.0f} s, {summary['wall_s']:.0f} s wall)",
                       file=sys.stderr)
    out_loads = {}
    for load in loads:
        res = results[load]
        published = PUBLISHED_POLLUX.get(load)
        print(f"\nload {load}x, avg JCT (s)")
        print(f"{'workload':<12}" + "".join(f"{x:>20}" for x in labels)
              + (f"{'published':>11}" if published else ""))
        for k in ks:
            print(f"{'workload-' + str(k):<12}"
                  + "".join(f"{res[k][x]['avg_jct']:>20.0f}" for x in labels)
                  + (f"{published[k - 1]:>11}" if published else ""))
        means = {x: sum(res[k][x]["avg_jct"] for k in ks) / len(ks) for x in labels}
        print(f"{'mean':<12}" + "".join(f"{means[x]:>20.0f}" for x in labels))
        entry = {
            "workloads": {
                f"workload-{k}": {**{x: round(res[k][x]["avg_jct"], 1) for x in labels},
                                  **({"published": published[k - 1]} if published else {})}
                for k in ks},
            "mean": {x: round(v, 1) for x, v in means.items()},
            "solve_ms_median": {x: round(max(res[k][x]["solve_ms_median"] for k in ks), 2)
                                for x in labels},
        }
        if published or ks == list(range(1, 9)):
            for x in labels:
                jcts = {k: res[k][x]["avg_jct"] for k in ks}
                entry[f"{x}_vs_published"] = round(_ratio(load, ks, jcts), 4)
                if published:
                    entry[f"max_{x}_vs_published"] = round(
                        max(jcts[k] / published[k - 1] for k in ks), 4)
                print(f"  {x}: {entry[f'{x}_vs_published']:.3f} x published Pollux")
        out_loads[str(load)] = entry
    summary = {"loads": out_loads,
               "published": {"pollux_load_1.0": PUBLISHED_POLLUX[1.0],
                             "pollux_mean": PUBLISHED_MEAN["pollux"]},
               "calibration": cost.source,
               "intervals_s": {m: config_for(m, cost).interval for m in models},
               "total_wall_s": round(time.perf_counter() - t0, 1)}
    if "1.0" in out_loads and "live_vs_published" in out_loads["1.0"]:
        summary["live_vs_published"] = out_loads["1.0"]["live_vs_published"]
    report.update(summary)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="1.0", help="comma list of 0.5, 1.0, 1.5, 2.0")
    ap.add_argument("--workloads", default="1-8", help="e.g. 1-8 or 1,3,5")
    ap.add_argument("--rescale-models", default="live,checkpoint-restart",
                    help=f"comma list of {', '.join(RESCALE_MODELS)}")
    ap.add_argument("--policies", default=DEFAULT_POLICY, help="comma list (e.g. pollux-ga)")
    ap.add_argument("--rescale-calibration", default=None, metavar="FILE",
                    help="calibrated costs (default: the bundled calibration)")
    ap.add_argument("--procs", type=int, default=2, help="parallel simulations (max 2 here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None, metavar="N",
                    help="only the first N jobs of each workload (default: all)")
    return run_benchmark(ap, bench, argv=argv, smoke={"workloads": "1", "jobs": 5})


if __name__ == "__main__":
    sys.exit(main())
