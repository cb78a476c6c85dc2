"""``pollux-run simulate``: replay a workload CSV through a simulated GPU cluster.

Prints per-job JCTs and a summary (unless ``--json``), and as its LAST line one JSON
object with avg_jct, p99_jct, makespan, solve_ms_median, solve_ms_p95, rounds, policy,
.... ``--output DIR`` also writes DIR/summary.json, DIR/jct_cdf.png, DIR/timeline.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pollux_launch.calibration import add_calibration_argument, load_rescale_cost
from pollux_launch.policy.rescale_cost import RESCALE_MODELS
from pollux_launch.sim.run import config_for, policy_names, run_workload
from pollux_launch.sim.traces import MODELS_DIR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, metavar="FILE",
                        help="workload CSV (name,time,application[,num_replicas,batch_size])")
    parser.add_argument("--policy", default=None, metavar="NAME",
                        help=f"scheduling policy (default: the fast Pollux solver); "
                             f"one of {', '.join(policy_names())}")
    parser.add_argument("--nodes", type=int, default=16, help="nodes in the cluster (16)")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (4)")
    parser.add_argument("--rescale-model", default="live", choices=RESCALE_MODELS,
                        help="what a change of allocation costs: live (survivors pause for "
                             "the calibrated state broadcast; newcomers' GPUs idle while "
                             "they start), restart (torchrun-style), checkpoint-restart (the "
                             "Pollux paper's flat --realloc-delay) (default live)")
    add_calibration_argument(parser)
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between scheduling rounds (default: from the rescale "
                             "model, 15 for live up to 60 for checkpoint-restart)")
    parser.add_argument("--realloc-delay", type=float, default=30.0,
                        help="checkpoint-restart: seconds of no progress per change (30)")
    parser.add_argument("--interference", type=float, default=0.0,
                        help="slowdown of distributed jobs sharing a node, 0..1 (0)")
    parser.add_argument("--fairness", type=float, default=-1.0, metavar="P",
                        help="fairness knob p of the Pollux objective (Eqn 14; default -1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of randomised policies (0)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="also write summary.json and PNG plots into DIR")
    parser.add_argument("--json", action="store_true",
                        help="print only the JSON summary line (with per-job JCTs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--models-dir", metavar="DIR", default=None,
                        help="trace tables, one folder per application (default: the bundled "
                             "Pollux traces)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_for(args.rescale_model, load_rescale_cost(args.rescale_calibration),
                         args.interval, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         realloc_delay=args.realloc_delay, interference=args.interference)
        result = run_workload(args.workload, args.policy, cfg, seed=args.seed,
                              progress=not args.no_progress,
                              options={"p": args.fairness},
                              models_dir=args.models_dir or MODELS_DIR)
    except ValueError as exc:  # bad input: one line, no traceback
        print(f"pollux-run simulate: error: {exc}", file=sys.stderr)
        return 2
    summary = result.summary()
    summary["workload"] = str(args.workload)
    if args.output:
        from pollux_launch.sim.plots import plot_jct_cdf, plot_timeline

        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        full = {**result.to_json(), "workload": str(args.workload)}
        (out / "summary.json").write_text(json.dumps(full, indent=1))
        plot_jct_cdf([result], out / "jct_cdf.png")
        plot_timeline([result], out / "timeline.png")
        summary["output"] = str(out)
    if args.json:
        summary["jcts"] = {k: round(v, 1) for k, v in result.jcts.items()}
    else:
        _print_human(result, summary)
    print(json.dumps(summary))
    return 0


def _print_human(result, summary: dict) -> None:
    print(f"{'job':<20} {'application':<12} {'submit(s)':>10} {'JCT(s)':>10} {'restarts':>8}")
    for name, jct in sorted(result.jcts.items(), key=lambda kv: result.submit[kv[0]]):
        print(f"{name:<20} {result.application[name]:<12} {result.submit[name]:>10.0f} "
              f"{jct:>10.0f} {result.restarts[name]:>8d}")
    print(f"policy {summary['policy']}: {summary['jobs']} jobs, avg JCT "
          f"{summary['avg_jct']:.0f} s, p99 JCT {summary['p99_jct']:.0f} s, makespan "
          f"{summary['makespan']:.0f} s, GPU utilisation {summary['avg_gpu_utilization']:.0%}, "
          f"{summary['rounds']} rounds, solve {summary['solve_ms_median']:.1f} ms median / "
          f"{summary['solve_ms_p95']:.1f} ms p95, simulated in {summary['sim_wall_s']:.1f} s")
