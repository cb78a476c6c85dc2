"""Average JCT of the Pollux workloads under several policies, next to the published figures.

    python benchmarks/sim_workloads.py [--load 1.0] [--workloads 1-8]
                                       [--policies pollux-dp,pollux-ga] [--procs 2]

Runs every workload x policy in the trace simulator (``pollux-run simulate``), at most
``--procs`` at a time, prints a table, and as its LAST line one JSON object:
``{"load": ..., "workloads": {"workload-1": {"<policy>": avg_jct, ...}, ...},
"mean_avg_jct": {"<policy>": ..., "published-pollux": ...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

from tqdm import tqdm

from pollux_launch.policy import DEFAULT_POLICY
from pollux_launch.sim.run import run_workload
from pollux_launch.sim.simulator import SimConfig
from pollux_launch.sim.traces import TRACES_DIR

# traces/README.md: Pollux (p = -1), authors' simulator, 64 GPUs, 60 s, 30 s per restart.
PUBLISHED_POLLUX = {1.0: [2089, 3323, 2188, 2721, 2674, 2446, 3616, 2952]}
# Tiresias+TunedJobs, the published counterpart of our tuned-las baseline.
PUBLISHED_TIRESIAS = {1.0: [2474, 5145, 3876, 3280, 3501, 3470, 5480, 5080]}
PUBLISHED_MEAN = {
    "pollux": {0.5: 1534, 1.0: 2751, 1.5: 3685, 2.0: 5289},
    "tiresias+tunedjobs": {0.5: 2091, 1.0: 4038, 1.5: 6182, 2.0: 10040},
    "optimus+oracle+tunedjobs": {0.5: 2395, 1.0: 5682, 1.5: 7235, 2.0: 9721},
}
LOAD_DIRS = {0.5: "workloads-0.5", 1.0: "workloads", 1.5: "workloads-1.5", 2.0: "workloads-2.0"}


def _one(task):
    load, k, policy, seed = task
    path = TRACES_DIR / LOAD_DIRS[load] / f"workload-{k}.csv"
    t0 = time.perf_counter()
    res = run_workload(path, policy, SimConfig(), seed=seed)
    summary = res.summary()
    summary["wall_s"] = time.perf_counter() - t0
    return load, k, policy, summary


def _parse_range(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=float, default=1.0, choices=sorted(LOAD_DIRS))
    ap.add_argument("--workloads", default="1-8", help="e.g. 1-8 or 1,3,5")
    ap.add_argument("--policies", default=f"{DEFAULT_POLICY},pollux-ga")
    ap.add_argument("--procs", type=int, default=2, help="parallel simulations (max 2 here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ks = _parse_range(args.workloads)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    tasks = [(args.load, k, p, args.seed) for k in ks for p in policies]
    results: dict[int, dict[str, dict]] = {k: {} for k in ks}
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(max(1, min(args.procs, 2))) as pool:
        for _, k, policy, summary in tqdm(
            pool.imap_unordered(_one, tasks),
            total=len(tasks),
            file=sys.stderr,
            desc=f"simulate load {args.load}x",
        ):
            results[k][policy] = summary
            tqdm.write(
                f"workload-{k} {policy}: avg JCT {summary['avg_jct']:.0f} s "
                f"({summary['wall_s']:.0f} s wall)",
                file=sys.stderr,
            )

    published = PUBLISHED_POLLUX.get(args.load)
    tiresias = PUBLISHED_TIRESIAS.get(args.load)
    head = f"{'workload':<12}" + "".join(f"{p:>14}" for p in policies)
    head += f"{'pub.Pollux':>11}{'pub.Tiresias':>13}" if published else ""
    print(f"load {args.load}x, avg JCT (s); solve ms median / p95 and sim wall s per run below")
    print(head)
    for k in ks:
        row = f"{'workload-' + str(k):<12}" + "".join(
            f"{results[k][p]['avg_jct']:>14.0f}" for p in policies
        )
        row += f"{published[k - 1]:>11}{tiresias[k - 1]:>13}" if published else ""
        print(row)
    means = {p: sum(results[k][p]["avg_jct"] for k in ks) / len(ks) for p in policies}
    row = f"{'mean':<12}" + "".join(f"{means[p]:>14.0f}" for p in policies)
    if published:
        row += f"{sum(published[k - 1] for k in ks) / len(ks):>11.0f}"
        row += f"{sum(tiresias[k - 1] for k in ks) / len(ks):>13.0f}"
    print(row)
    for p in policies:
        s = [results[k][p] for k in ks]
        print(
            f"  {p}: solve ms median {max(x['solve_ms_median'] for x in s):.1f} (worst "
            f"workload), p95 {max(x['solve_ms_p95'] for x in s):.1f}; sim wall s "
            f"max {max(x['wall_s'] for x in s):.0f}; mean p99 JCT "
            f"{sum(x['p99_jct'] for x in s) / len(s):.0f}; mean makespan "
            f"{sum(x['makespan'] for x in s) / len(s):.0f}"
        )
    mean_json = {p: round(v, 1) for p, v in means.items()}
    if published:
        mean_json["published-pollux"] = round(sum(published[k - 1] for k in ks) / len(ks), 1)
        mean_json["published-tiresias"] = round(sum(tiresias[k - 1] for k in ks) / len(ks), 1)
    elif ks == list(range(1, 9)):
        mean_json["published-pollux"] = PUBLISHED_MEAN["pollux"][args.load]
        mean_json["published-tiresias"] = PUBLISHED_MEAN["tiresias+tunedjobs"][args.load]
    print(
        json.dumps(
            {
                "load": args.load,
                "workloads": {
                    f"workload-{k}": {p: round(results[k][p]["avg_jct"], 1) for p in policies}
                    for k in ks
                },
                "mean_avg_jct": mean_json,
                "solve_ms_median": {
                    p: round(max(results[k][p]["solve_ms_median"] for k in ks), 2) for p in policies
                },
                "sim_wall_s_max": {
                    p: round(max(results[k][p]["wall_s"] for k in ks), 1) for p in policies
                },
                "total_wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
