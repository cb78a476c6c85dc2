"""``pollux-run simulate``: replay a workload CSV through a simulated GPU cluster.

Prints per-job JCTs and a summary (unless ``--json``), and as its LAST line one JSON
object with avg_jct, p99_jct, makespan, solve_ms_median, solve_ms_p95, rounds, policy,
completed, drop_ratio, avg_queue_delay, .... ``--output DIR`` also writes
DIR/summary.json, DIR/jct_cdf.png, DIR/timeline.png (and DIR/workload.csv for a
``--scenario``).

``--scenario high_rate|low_rate`` generates Saxena et al.'s scenarios
(:mod:`pollux_launch.sim.generate`) instead of reading ``--workload``;
``--admission queue|drop`` puts admission control in front of the policy
(:mod:`pollux_launch.policy.admission`); ``--profile-on-arrival`` profiles each new job
on a few GPU counts before it competes (:class:`pollux_launch.sim.simulator.ProfileConfig`);
``--autoscale MIN:MAX`` grows and shrinks the cluster by Pollux's utility rule
(:mod:`pollux_launch.sim.autoscale`; node-hours in the summary, DIR/nodes.png).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pollux_launch.arguments import (
    OptionsError,
    add_admission_arguments,
    add_autoscale_arguments,
    admission_from_args,
    autoscale_from_args,
    seconds_or_zero,
)
from pollux_launch.calibration import add_calibration_argument, load_rescale_cost
from pollux_launch.errors import UserError
from pollux_launch.policy.rescale_cost import RESCALE_MODELS
from pollux_launch.sim.generate import SCENARIOS, generate_workload
from pollux_launch.sim.run import config_for, policy_names, run_specs, run_workload
from pollux_launch.sim.simulator import PROFILE_LADDERS, ProfileConfig
from pollux_launch.sim.traces import MODELS_DIR
from pollux_launch.sim.workload import write_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default=None, metavar="FILE",
                        help="workload CSV (name,time,application[,num_replicas,batch_size]"
                             "[,min_batch_size,max_batch_size,max_replicas])")
    parser.add_argument("--scenario", default=None, choices=sorted(SCENARIOS),
                        help="instead of --workload: generate Saxena et al.'s scenario for "
                             "this cluster (Poisson arrivals; --seed picks the draw)")
    parser.add_argument("--scenario-jobs", type=int, default=None, metavar="N",
                        help="jobs the --scenario draws (40)")
    parser.add_argument("--policy", default=None, metavar="NAME",
                        help=f"scheduling policy (default: the fast Pollux solver); "
                             f"one of {', '.join(policy_names())}")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes in the cluster (16); with --autoscale, the nodes it "
                             "starts with (default MIN, at least 1)")
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
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of randomised policies and of --scenario's draw (0)")
    add_admission_arguments(parser)
    add_autoscale_arguments(parser)
    parser.add_argument("--boot-time", type=seconds_or_zero, default=None, metavar="S",
                        help="--autoscale: seconds from requesting a node until it joins "
                             "(90); billed from the request")
    parser.add_argument("--horizon", type=float, default=None, metavar="S",
                        help="stop at simulated time S and count the jobs completed by then "
                             "(default: none; a --scenario's arrival window)")
    parser.add_argument("--profile-on-arrival", action="store_true",
                        help="a new job first trains briefly on 1, 2, 4, ... GPUs up to its "
                             "cap (at most --profile-max-replicas) to seed its throughput "
                             "model, then competes")
    parser.add_argument("--profile-seconds", type=float, default=None, metavar="S",
                        help="--profile-on-arrival: seconds of training per GPU count (60)")
    parser.add_argument("--profile-max-replicas", type=int, default=None, metavar="K",
                        help="--profile-on-arrival: largest GPU count profiled (8)")
    parser.add_argument("--profile-counts", default=None, choices=PROFILE_LADDERS,
                        help="--profile-on-arrival: GPU counts profiled: doubling (1, 2, 4, "
                             "... then the largest) or ends (1, then the largest) (doubling)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="also write summary.json and PNG plots into DIR")
    parser.add_argument("--json", action="store_true",
                        help="print only the JSON summary line (with per-job JCTs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--models-dir", metavar="DIR", default=None,
                        help="trace tables, one folder per application (default: the bundled "
                             "Pollux traces)")


def _profile(args: argparse.Namespace) -> ProfileConfig | None:
    fields = {"seconds": args.profile_seconds, "max_replicas": args.profile_max_replicas,
              "ladder": args.profile_counts}
    if not args.profile_on_arrival:
        extra = [k for k, v in fields.items() if v is not None]
        if extra:
            flag = {"seconds": "--profile-seconds", "max_replicas": "--profile-max-replicas",
                    "ladder": "--profile-counts"}[extra[0]]
            raise OptionsError(f"{flag} needs --profile-on-arrival")
        return None
    try:
        return ProfileConfig(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:  # the flags' values, checked by the config
        raise OptionsError(str(exc)) from None


def _cluster(args: argparse.Namespace, autoscale) -> tuple[int, float]:
    """(starting nodes, boot time) from --nodes / --autoscale / --boot-time."""
    if autoscale is None:
        if args.boot_time is not None:
            raise OptionsError("--boot-time needs --autoscale MIN:MAX")
        nodes = 16 if args.nodes is None else args.nodes
        if nodes < 1:
            raise OptionsError(f"--nodes must be at least 1, got {nodes}")
        return nodes, 90.0
    lo, hi = autoscale.min_nodes, autoscale.max_nodes
    nodes = max(lo, 1) if args.nodes is None else args.nodes
    if not lo <= nodes <= hi:
        raise OptionsError(f"--nodes {nodes} (the starting size) must lie within "
                         f"--autoscale {lo}:{hi}")
    return nodes, 90.0 if args.boot_time is None else args.boot_time


def run(args: argparse.Namespace) -> int:
    generated = None
    try:
        if (args.workload is None) == (args.scenario is None):
            raise OptionsError("give exactly one of --workload FILE and --scenario NAME")
        if args.scenario_jobs is not None and args.scenario is None:
            raise OptionsError("--scenario-jobs needs --scenario")
        models_dir = args.models_dir or MODELS_DIR
        admission = admission_from_args(args)
        autoscale = autoscale_from_args(args)
        nodes, boot = _cluster(args, autoscale)
        horizon = args.horizon
        if args.scenario is not None:
            generated = generate_workload(
                args.scenario, gpus=(autoscale.max_nodes if autoscale else nodes)
                * args.gpus_per_node, seed=args.seed,
                jobs=args.scenario_jobs, models_dir=models_dir)
            horizon = generated.horizon if horizon is None else horizon
        profile = _profile(args)
        try:
            cfg = config_for(args.rescale_model, load_rescale_cost(args.rescale_calibration),
                             args.interval, nodes=nodes, gpus_per_node=args.gpus_per_node,
                             realloc_delay=args.realloc_delay, interference=args.interference,
                             admission=admission, horizon=horizon, profile=profile,
                             autoscale=autoscale, boot_time=boot)
        except UserError:
            raise
        except ValueError as exc:  # the flags' values, checked by SimConfig
            raise OptionsError(str(exc)) from None
        run_kw = {"seed": args.seed, "progress": not args.no_progress,
                  "options": {"p": args.fairness}, "models_dir": models_dir}
        if generated is not None:
            result = run_specs(generated.specs, args.policy, cfg, **run_kw)
        else:
            result = run_workload(args.workload, args.policy, cfg, **run_kw)
    except UserError as exc:  # bad input: one line, no traceback (a bug keeps its own)
        print(f"pollux-run simulate: error: {exc}", file=sys.stderr)
        return 2
    summary = result.summary()
    workload = (str(args.workload) if generated is None
                else f"scenario:{generated.scenario}:seed{generated.seed}")
    summary["workload"] = workload
    if generated is not None:
        summary["scenario"] = generated.info()
    if args.output:
        from pollux_launch.sim.plots import plot_jct_cdf, plot_nodes, plot_timeline

        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        if generated is not None:
            write_workload(generated.specs, out / "workload.csv")
        full = {**result.to_json(), "workload": workload}
        (out / "summary.json").write_text(json.dumps(full, indent=1))
        plot_jct_cdf([result], out / "jct_cdf.png")
        plot_timeline([result], out / "timeline.png")
        if autoscale is not None:
            plot_nodes([result], out / "nodes.png")
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
    for name, when in sorted(result.dropped.items(), key=lambda kv: kv[1]):
        print(f"{name:<20} {result.application[name]:<12} {result.submit[name]:>10.0f} "
              f"{'dropped':>10} at {when:.0f} s: {result.drop_reasons.get(name, '')}")
    if summary["avg_jct"] is None:
        print(f"policy {summary['policy']}: {summary['jobs']} jobs, none completed")
    else:
        print(f"policy {summary['policy']}: {summary['jobs']} jobs, avg JCT "
              f"{summary['avg_jct']:.0f} s, p99 JCT {summary['p99_jct']:.0f} s, makespan "
              f"{summary['makespan']:.0f} s, GPU utilisation "
              f"{summary['avg_gpu_utilization']:.0%}, {summary['rounds']} rounds, solve "
              f"{summary['solve_ms_median']:.1f} ms median / {summary['solve_ms_p95']:.1f} ms "
              f"p95, simulated in {summary['sim_wall_s']:.1f} s")
    scale = summary["autoscale"]
    how = ("fixed cluster" if scale is None else
           f"autoscale {scale['min_nodes']}:{scale['max_nodes']} {scale['rule']} rule, "
           f"{scale['decisions']} decisions")
    print(f"cost: {summary['node_hours']:.1f} node-hours (avg {summary['avg_nodes']:.1f} "
          f"nodes, peak {summary['peak_nodes']}; {how})")
    if summary["admission"] != "none" or summary["horizon"] is not None:
        until = "" if summary["horizon"] is None else f" by {summary['horizon']:.0f} s"
        print(f"admission {summary['admission']}: {summary['arrived']} arrived, "
              f"{summary['completed']} completed{until}, {summary['dropped']} dropped "
              f"({summary['drop_ratio']:.0%}), {summary['unfinished']} unfinished, mean "
              f"queueing delay {summary['avg_queue_delay']:.0f} s")
