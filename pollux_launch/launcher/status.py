"""``pollux-run status [--watch]``: the cluster at a glance.

One table of nodes (GPU type, slots used / free, which job holds each GPU) and one of jobs (state,
kind of elasticity, GPUs per node and which, batch size = replicas x m x (s+1),
statistical efficiency, goodput, speedup over one GPU, re-allocations, restarts with the
progress they lost or what one costs, age), all read from the store - nothing is
computed that the store does not say, except goodput and efficiency, which follow from
the job's hints.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import IO

import numpy as np

from .. import env as envvars
from .. import keys
from ..arguments import seconds
from ..messages import (
    MAX_REPLICAS,
    Allocation,
    AutoscaleStatus,
    JobGeneration,
    JobGpus,
    JobHints,
    JobRestarts,
    JobSpec,
    JobStatus,
    MessageError,
    NodeDrain,
    NodeInfo,
    decode,
)
from ..rendezvous.store import Store
from ..rendezvous.store.cli_args import add_store_arguments, open_from_args


def job_figures(hints: JobHints) -> dict[str, float | None]:
    """Batch size, efficiency, goodput and speedup of the job's current configuration."""
    from ..coordinator.jobs import model_speedup
    from ..goodput import GradParams, efficiency

    k, m, s = hints.num_replicas, hints.local_bsz, hints.accum_steps
    batch = k * m * (s + 1)
    out: dict[str, float | None] = {"batch": batch, "efficiency": None, "goodput": None,
                                    "speedup": None}
    if hints.grad_sqr and hints.grad_var is not None and batch:
        grad = GradParams(sqr=hints.grad_sqr, var=hints.grad_var)
        out["efficiency"] = float(efficiency(grad, hints.init_batch_size, np.array([batch]))[0])
    speedup = model_speedup(hints)
    if speedup is not None and k:
        nodes, reps = np.array([hints.num_nodes or 1]), np.array([k])
        out["goodput"] = float(speedup.goodput(nodes, reps)[0])
        out["speedup"] = float(speedup(nodes, reps)[0])
    return out


def describe_hints(hints: JobHints) -> str:
    """The launcher's compact status line."""
    f = job_figures(hints)
    parts = [
        f"replicas {hints.num_replicas} on {hints.num_nodes} node(s)",
        f"batch {f['batch']} = {hints.num_replicas}x{hints.local_bsz}x{hints.accum_steps + 1}",
    ]
    if f["efficiency"] is not None:
        parts.append(f"efficiency {f['efficiency']:.2f}")
    if f["goodput"] is not None:
        parts.append(f"goodput {f['goodput']:.0f}/s")
    parts.append(f"progress {hints.progress:.0f}")
    return " | ".join(parts)


def describe_allocation(alloc: Allocation | None) -> str:
    """The launcher's status line for a job that reports no hints (restart-elastic,
    fixed): where its current group runs."""
    if alloc is None or not alloc.nodes:
        return "waiting for free slots"
    return (f"replicas {alloc.num_replicas} on {alloc.num_nodes} node(s) "
            f"(allocation v{alloc.version})")


def describe_kind(spec: JobSpec) -> str:
    """How the job changes size, e.g. ``restart-elastic 1..2 replicas``."""
    hi = "any" if spec.max_replicas >= MAX_REPLICAS else str(spec.max_replicas)
    if spec.elasticity == "fixed":
        return f"fixed at {spec.initial_replicas} replica(s)"
    span = (f"{spec.min_replicas}..{hi} replicas" if spec.min_replicas != spec.max_replicas
            else f"{spec.min_replicas} replica(s)")
    return f"{spec.elasticity}-elastic {span}"


def render(store: Store, now: float | None = None) -> str:
    """The status tables as text."""
    now = time.time() if now is None else now
    nodes = {}
    bad: list[str] = []  # keys of malformed values: shown, or a job would silently lose them
    for kv in store.get_prefix(keys.NODES):
        try:
            node = decode(NodeInfo, kv.value)
            nodes[node.name] = node
        except MessageError:
            bad.append(kv.key)
    jobs: dict[str, dict[str, object]] = {}
    kinds = {"spec": JobSpec, "status": JobStatus, "hints": JobHints, "allocation": Allocation,
             "restarts": JobRestarts, "generation": JobGeneration}
    held: dict[str, dict[str, tuple[str, ...]]] = {}  # job -> node -> the GPUs its workers hold
    specs: set[str] = set()  # the jobs that have a spec key (well-formed or not)
    for kv in store.get_prefix(keys.JOBS):
        split = keys.split_job_key(kv.key)
        if split and split[1] == "spec":
            specs.add(split[0])
        if split and (split[1] in kinds or split[1].startswith("gpus/")):
            try:
                if split[1] in kinds:
                    jobs.setdefault(split[0], {})[split[1]] = decode(kinds[split[1]], kv.value)
                else:
                    gpus = decode(JobGpus, kv.value)
                    held.setdefault(split[0], {})[gpus.node] = gpus.gpus
            except MessageError:
                bad.append(kv.key)
    # a job exists while its spec key does (a malformed one too: it is shown, with the
    # key among the malformed values): keys left of a removed job (a write that raced its
    # removal) are no job, and listing them as one would list it forever
    jobs = {name: jobs.get(name, {}) for name in specs}
    used: Counter[str] = Counter()
    rows = []
    for name, view in sorted(jobs.items()):
        status, alloc = view.get("status"), view.get("allocation")
        spec, hints = view.get("spec"), view.get("hints")
        state = status.state if status else "unknown"
        placed = Counter(alloc.nodes) if alloc and not (status and status.finished) else Counter()
        used.update(placed)
        fig = job_figures(hints) if hints else {}
        on = held.get(name, {})
        rows.append([
            name, state, spec.elasticity if spec else "-",
            ",".join(f"{n}:{k}" + (f"[{_ids(on[n])}]" if on.get(n) else "")
                     for n, k in sorted(placed.items())) or "-",
            str(fig.get("batch") or "-") if hints else "-",
            _fmt(fig.get("efficiency"), ".2f"), _fmt(fig.get("goodput"), ".0f"),
            _fmt(fig.get("speedup"), ".2f"),
            str(max(0, alloc.version - 1)) if alloc else "0",
            _restarts(view.get("restarts"), view.get("generation"), spec),
            _age(now - spec.submit_time) if spec else "-",
        ])
    draining = set()  # (pollux-run drain: offered no slots, its jobs move off it)
    for kv in store.get_prefix(keys.DRAINS):
        try:
            draining.add(decode(NodeDrain, kv.value).node)
        except MessageError:
            bad.append(kv.key)
    node_rows = []
    for n in sorted(nodes.values(), key=lambda n: n.name):
        # USED: what the allocations place there; RUNNING: the live workers its agent
        # reports (a slot is free only when neither holds it)
        running = sum(max(0, k) for k in n.workers.values())
        free = 0 if n.name in draining else max(0, n.slots - max(used[n.name], running))
        node_rows.append([n.name + (" (draining)" if n.name in draining else ""),
                          str(n.slots), str(used[n.name]), str(running or "-"), str(free),
                          _node_gpus(n, held), n.gpu_type or "-"])
    out = [_table(["NODE", "SLOTS", "USED", "RUNNING", "FREE", "GPUS (JOB)", "TYPE"],
                  node_rows or [["(no nodes)", "", "", "", "", "", ""]])]
    kv = store.get(keys.AUTOSCALE)
    if kv is not None:
        try:
            a = decode(AutoscaleStatus, kv.value)
            out.append(f"autoscale: {a.nodes} nodes, target {a.target} ({a.booting} booting"
                       f"{', draining ' + ','.join(a.draining) if a.draining else ''}); "
                       f"utility {a.utility:.2f} ({a.rule} rule): {a.reason}")
        except MessageError:
            bad.append(kv.key)
    out.append(_table(
        ["JOB", "STATE", "KIND", "GPUS PER NODE", "BATCH", "EFF", "GOODPUT", "SPEEDUP", "REALLOCS",
         "RESTARTS (LOST)", "AGE"], rows or [["(no jobs)"] + [""] * 10]))
    wants = [f"{name} wants {_wanted(h)} replicas" for name, view in sorted(jobs.items())
             if (h := view.get("hints")) is not None and h.min_replicas_wanted is not None
             and not ((st := view.get("status")) is not None and st.finished)]
    if wants:
        out.append("adaptation policies' requests: " + "; ".join(wants))
    admission = [f"{name} {st.state}: {st.message}" for name, view in sorted(jobs.items())
                 if (st := view.get("status")) is not None
                 and st.state in ("queued", "rejected") and st.message]
    if admission:
        out.append("admission: " + "; ".join(admission))
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        out.append(f"ignored {len(bad)} malformed store value(s): "
                   f"{', '.join(k[:100] for k in bad[:5])}{more}")
    return "\n\n".join(out)


def _ids(gpus: tuple[str, ...]) -> str:
    return ",".join(gpus)


def _node_gpus(node: NodeInfo, held: dict[str, dict[str, tuple[str, ...]]]) -> str:
    """Which job holds each of the node's GPUs, e.g. ``0,1=train 2=eval 3=free``
    ("-": a node of CPU slots)."""
    if not node.gpus:
        return "-"
    owner = {gpu: job for job, per in held.items() for gpu in per.get(node.name, ())}
    groups: dict[str, list[str]] = {}
    for gpu in node.gpus:
        groups.setdefault(owner.get(gpu, "free"), []).append(gpu)
    return " ".join(f"{_ids(tuple(g))}={who}" for who, g in groups.items())


def _wanted(hints: JobHints) -> str:
    lo, hi = hints.min_replicas_wanted, hints.max_replicas_wanted
    return str(lo) if lo == hi else f"{lo}-{hi}" if hi else f"{lo} or more"


def _restarts(restarts: JobRestarts | None, generation: JobGeneration | None,
              spec: JobSpec | None) -> str:
    """Restarts after every worker died, with the progress lost (iterations); for a
    restart-elastic or fixed job, its group's restarts after failures of the most its
    ``--max-restarts`` allows, a restart's measured cost, and - once a group was stopped
    before it finished (a new allocation, a failure) - how many were and the training
    time they lost (``<=``: the job has no ``--checkpoint-dir`` to measure it against,
    so the groups' whole run time), e.g. ``0/0 (2.1 s each), 2 stopped: lost 1m35s``."""
    if spec is not None and spec.elasticity != "live":
        done = generation.restarts if generation else 0
        cost = generation.restart_s if generation else None
        text = f"{done}/{spec.max_restarts}" + (f" ({cost:.1f} s each)" if cost else "")
        if generation is not None and generation.stops:
            bound = "" if envvars.CHECKPOINT_DIR in spec.env else "<="
            text += f", {generation.stops} stopped: lost {bound}{_age(generation.lost_s)}"
        return text
    if restarts is None or not restarts.count:
        return "0"
    return f"{restarts.count} ({restarts.lost_progress:.0f} it)"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _age(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 \
        else f"{seconds // 60}m{seconds % 60:02d}s"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


# -- subcommands ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--watch", action="store_true",
                        help="redraw the tables every --every seconds until Ctrl-C")
    parser.add_argument("--every", type=seconds, default=2.0, metavar="SECONDS",
                        help="with --watch: seconds between redraws (default 2)")


def run(args: argparse.Namespace, stdout: IO[str] | None = None) -> int:
    stdout = stdout or sys.stdout
    from .slurm_allocation import find_allocation_store

    find_allocation_store(args)
    store, _ = open_from_args(args)
    with store:
        while True:
            text = render(store)
            if args.watch:
                stdout.write("\x1b[2J\x1b[H")
            print(text, file=stdout, flush=True)
            if not args.watch:
                return 0
            time.sleep(args.every)
