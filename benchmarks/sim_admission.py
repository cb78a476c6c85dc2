"""Saxena et al.'s scenarios in the simulator: admission control, batch-size ranges, max-bs.

    python benchmarks/sim_admission.py [--nodes 4] [--gpus-per-node 4] [--jobs 120]
        [--seeds 0,1,2] [--rescale-model checkpoint-restart] [--profile-workloads 1-8]
        [--procs 2]

For each scenario (``high_rate``: offered load 2.0, more work arrives than the cluster
can serve; ``low_rate``: load 0.4; see :mod:`pollux_launch.sim.generate`), each
admission mode (``queue``: jobs wait in arrival order until each admitted job can have a
GPU; ``drop``: a job that does not fit on arrival is dropped) and each policy
(``pollux-dp``; ``saxena-dp``, Saxena et al.'s throughput-maximising DP; ``max-bs``,
the same DP with every job's batch fixed at its maximum), it simulates the scenario's
jobs drawn with each seed and reports, up to the scenario's horizon (its arrival window):

* ``completed``: jobs completed by the horizon, mean over seeds;
* ``drop_ratio``: jobs dropped / jobs arrived by the horizon, over all seeds;
* ``avg_jct``: mean JCT (completion - arrival, queueing included) of the completed jobs,
  over all seeds.

Sizing for a 2-core machine (about 5 minutes with 2 processes): 4 nodes x 4 GPUs, 120
jobs per scenario (the high rate's window is ~17 h of simulated time, the low rate's
~88 h), 3 seeds, the Pollux paper's checkpoint-restart (30 s per change, 60 s rounds).

``--profile-workloads`` also measures profile on arrival (each new job first trains 60 s
on 1, 2, 4, 8 GPUs within its limits) against Pollux's online exploration: avg JCT of the
Pollux workloads at load 1.0 on 16 x 4 GPUs with ``pollux-dp``, off and on (``none``
skips it). Progress goes to stderr; tables to stdout; the LAST line is one JSON object::

    {"high_rate": {"queue": {"pollux-dp": {"completed": n, "drop_ratio": d, "avg_jct": s},
                             "saxena-dp": {...}, "max-bs": {...}},
                   "drop": {...}},
     "low_rate": {...},
     "checks": {...}, "paper_ratios": {...},
     "profile_on_arrival": {"workloads": {"workload-1": {"off": s, "on": s}, ...},
                            "mean_off": s, "mean_on": s, "on_vs_off": r},
     "setup": {...}, "total_wall_s": s}

``--smoke``: 8 jobs and one seed per scenario, the first 5 jobs of workload 1 for profile
on arrival.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

from harness import Report, UsageError, run_benchmark  # beside this script
from tqdm import tqdm

from pollux_launch.calibration import load_rescale_cost
from pollux_launch.policy.admission import AdmissionConfig
from pollux_launch.policy.rescale_cost import RESCALE_MODELS
from pollux_launch.sim.generate import SCENARIOS, generate_workload
from pollux_launch.sim.run import config_for, run_specs
from pollux_launch.sim.simulator import ProfileConfig
from pollux_launch.sim.traces import TRACES_DIR, available_models, parse_numbers
from pollux_launch.sim.workload import load_workload

MODES = ("queue", "drop")
POLICIES = ("pollux-dp", "saxena-dp", "max-bs")


def _scenario_task(task):
    scenario, mode, policy, seed, nodes, gpn, jobs, model, calibration = task
    t0 = time.perf_counter()
    gen = generate_workload(scenario, gpus=nodes * gpn, seed=seed, jobs=jobs)
    cfg = config_for(model, load_rescale_cost(calibration), nodes=nodes, gpus_per_node=gpn,
                     admission=AdmissionConfig(mode), horizon=gen.horizon)
    res = run_specs(gen.specs, policy, cfg, seed=seed)
    s = res.summary()
    done = [res.jcts[k] for k, t in res.completion.items() if t <= gen.horizon]
    return ("scenario", (scenario, mode, policy, seed), {
        "completed": s["completed"], "arrived": s["arrived"], "dropped": s["dropped"],
        "jct_sum": float(sum(done)), "queue_delay": s["avg_queue_delay"],
        "restarts": s["total_restarts"], "horizon": gen.horizon,
        "rate_per_hour": gen.rate_per_hour, "wall_s": time.perf_counter() - t0})


def _profile_task(task):
    k, on, model, calibration, seconds, max_replicas, jobs = task
    t0 = time.perf_counter()
    profile = ProfileConfig(seconds, max_replicas) if on else None
    cfg = config_for(model, load_rescale_cost(calibration), profile=profile)
    path = TRACES_DIR / "workloads" / f"workload-{k}.csv"
    res = run_specs(load_workload(path, available_models())[:jobs], "pollux-dp", cfg)
    s = res.summary()
    return ("profile", (k, on), {"avg_jct": s["avg_jct"], "restarts": s["total_restarts"],
                                 "wall_s": time.perf_counter() - t0})


def _run(task):
    return _scenario_task(task[1]) if task[0] == "scenario" else _profile_task(task[1])



def bench(args: argparse.Namespace, report: Report) -> None:
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
        profile_ks = parse_numbers(args.profile_workloads)
        cost = load_rescale_cost(args.rescale_calibration)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    if bad := [x for x in scenarios if x not in SCENARIOS]:
        raise UsageError(f"unknown scenario {bad[0]!r}; choose from {', '.join(SCENARIOS)}")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if bad := [k for k in profile_ks if not 1 <= k <= 8]:
        raise UsageError(f"unknown Pollux workload {bad[0]}; choose from 1-8")
    tasks = [("scenario", (sc, mode, pol, seed, args.nodes, args.gpus_per_node, args.jobs,
                           args.rescale_model, args.rescale_calibration))
             for sc in scenarios for mode in MODES for pol in policies for seed in seeds]
    tasks += [("profile", (k, on, args.rescale_model, args.rescale_calibration,
                           args.profile_seconds, args.profile_max_replicas,
                           args.profile_jobs))
              for k in profile_ks for on in (False, True)]
    runs: dict = {}
    profile: dict = {}
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(max(1, min(args.procs, 2))) as pool:
        for kind, key, out in tqdm(pool.imap_unordered(_run, tasks), total=len(tasks),
                                   file=sys.stderr, desc="simulate"):
            if kind == "scenario":
                runs[key] = out
                sc, mode, pol, seed = key
                tqdm.write(f"{sc} {mode} {pol} seed {seed}: {out['completed']} completed, "
                           f"{out['dropped']}/{out['arrived']} dropped ({out['wall_s']:.0f} s)",
                           file=sys.stderr)
            else:
                profile[key] = out
                k, on = key
                tqdm.write(f"workload-{k} profile {'on' if on else 'off'}: avg JCT "
                           f"{out['avg_jct']:.0f} s ({out['wall_s']:.0f} s)", file=sys.stderr)

    summary: dict = {}
    for sc in scenarios:
        summary[sc] = {}
        for mode in MODES:
            summary[sc][mode] = {}
            for pol in policies:
                rs = [runs[(sc, mode, pol, seed)] for seed in seeds]
                done = sum(r["completed"] for r in rs)
                arrived = sum(r["arrived"] for r in rs)
                summary[sc][mode][pol] = {
                    "completed": round(done / len(rs), 2),
                    "drop_ratio": round(sum(r["dropped"] for r in rs) / max(arrived, 1), 4),
                    "avg_jct": round(sum(r["jct_sum"] for r in rs) / done, 1) if done else None,
                }
    print(f"\n{len(seeds)} seeds x {args.jobs} jobs, {args.nodes} x {args.gpus_per_node} GPUs, "
          f"{args.rescale_model}; completed by the horizon / drop ratio / avg JCT (s) of "
          "completed jobs")
    for sc in scenarios:
        horizon = runs[(sc, MODES[0], policies[0], seeds[0])]["horizon"]
        rate = runs[(sc, MODES[0], policies[0], seeds[0])]["rate_per_hour"]
        print(f"\n{sc}: {rate:.2f} jobs/h, horizon {horizon / 3600:.1f} h (seed {seeds[0]})")
        print(f"{'mode':<7}{'policy':<11}{'completed':>10}{'drop ratio':>12}{'avg JCT':>10}"
              f"{'queue delay':>13}{'restarts':>10}")
        for mode in MODES:
            for pol in policies:
                e = summary[sc][mode][pol]
                rs = [runs[(sc, mode, pol, seed)] for seed in seeds]
                qd = sum(r["queue_delay"] for r in rs) / len(rs)
                rst = sum(r["restarts"] for r in rs) / len(rs)
                jct = "-" if e["avg_jct"] is None else f"{e['avg_jct']:.0f}"
                print(f"{mode:<7}{pol:<11}{e['completed']:>10.1f}{e['drop_ratio']:>12.3f}"
                      f"{jct:>10}{qd:>13.0f}{rst:>10.0f}")

    checks, ratios = {}, {}
    if {"saxena-dp", "max-bs"} <= set(policies):
        for sc in scenarios:
            for mode in MODES:
                sx, mb = summary[sc][mode]["saxena-dp"], summary[sc][mode]["max-bs"]
                both = sx["avg_jct"] is not None and mb["avg_jct"] is not None
                checks[f"{sc}.{mode}.saxena_vs_max_bs"] = {
                    "more_completed": sx["completed"] >= mb["completed"],
                    "fewer_drops": sx["drop_ratio"] <= mb["drop_ratio"],
                    "lower_jct": both and sx["avg_jct"] <= mb["avg_jct"]}
                ratios[f"{sc}.{mode}"] = {
                    "completed_saxena_over_max_bs":
                        round(sx["completed"] / mb["completed"], 3) if mb["completed"] else None,
                    "drops_max_bs_over_saxena":
                        round(mb["drop_ratio"] / sx["drop_ratio"], 3) if sx["drop_ratio"]
                        else None,
                    "jct_max_bs_over_saxena":
                        round(mb["avg_jct"] / sx["avg_jct"], 3) if both else None}
    if {"saxena-dp", "pollux-dp"} <= set(policies):
        for sc in scenarios:
            for mode in MODES:
                px, sx = summary[sc][mode]["pollux-dp"], summary[sc][mode]["saxena-dp"]
                checks[f"{sc}.{mode}.pollux_jct_le_saxena"] = (
                    px["avg_jct"] is not None and sx["avg_jct"] is not None
                    and px["avg_jct"] <= sx["avg_jct"])
    print("\nchecks:", json.dumps(checks))
    out = {**summary, "checks": checks, "paper_ratios": ratios}

    if profile_ks:
        per = {f"workload-{k}": {"off": round(profile[(k, False)]["avg_jct"], 1),
                                 "on": round(profile[(k, True)]["avg_jct"], 1)}
               for k in profile_ks}
        mean_off = sum(v["off"] for v in per.values()) / len(per)
        mean_on = sum(v["on"] for v in per.values()) / len(per)
        out["profile_on_arrival"] = {
            "workloads": per, "mean_off": round(mean_off, 1), "mean_on": round(mean_on, 1),
            "on_vs_off": round(mean_on / mean_off, 4),
            "setup": f"pollux-dp, Pollux workloads at load 1.0, 16 x 4 GPUs, "
                     f"{args.rescale_model}; profile {args.profile_seconds:g} s per count on "
                     f"1, 2, 4, ... up to {args.profile_max_replicas} GPUs"}
        print(f"\nprofile on arrival (pollux-dp, Pollux workloads, {args.rescale_model}):")
        for name, v in per.items():
            print(f"  {name}: off {v['off']:.0f} s, on {v['on']:.0f} s "
                  f"({v['on'] / v['off']:.3f}x)")
        print(f"  mean: off {mean_off:.0f} s, on {mean_on:.0f} s ({mean_on / mean_off:.3f}x)")
    out["setup"] = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                    "jobs": args.jobs, "seeds": seeds, "rescale_model": args.rescale_model,
                    "calibration": cost.source,
                    "loads": {sc: SCENARIOS[sc].load for sc in scenarios}}
    out["total_wall_s"] = round(time.perf_counter() - t0, 1)
    report.update(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=120, help="jobs per scenario and seed")
    ap.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    ap.add_argument("--scenarios", default="high_rate,low_rate",
                    help=f"comma list of {', '.join(SCENARIOS)} (high_rate,low_rate)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rescale-model", default="checkpoint-restart", choices=RESCALE_MODELS)
    ap.add_argument("--rescale-calibration", default=None, metavar="FILE")
    ap.add_argument("--profile-workloads", default="1-8",
                    help="Pollux workloads (load 1.0) for profile on arrival, or none")
    ap.add_argument("--profile-seconds", type=float, default=60.0)
    ap.add_argument("--profile-max-replicas", type=int, default=8)
    ap.add_argument("--profile-jobs", type=int, default=None, metavar="N",
                    help="only the first N jobs of each Pollux workload (default: all)")
    ap.add_argument("--procs", type=int, default=2, help="parallel simulations (max 2 here)")
    return run_benchmark(ap, bench, argv=argv, smoke={
        "jobs": 8, "seeds": "0", "profile_workloads": "1", "profile_jobs": 5})


if __name__ == "__main__":
    sys.exit(main())
