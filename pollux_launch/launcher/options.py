"""``pollux-run [flags] COMMAND...``: horovodrun's flags with horovodrun's meaning, plus Pollux's.

``build_parser`` declares the flags; ``parse_launch_args`` turns argv into a validated,
frozen :class:`LaunchOptions` or raises :class:`OptionsError` with one line saying what
is wrong and how to fix it - before anything starts.

Replica counts: ``-np`` is where the job starts. Without ``--min-np``/``--max-np`` the job
keeps exactly ``-np`` replicas (as with horovodrun; its batch size still adapts); with
them, the coordinator moves it anywhere in ``[min-np, max-np]``.

torchrun's form is accepted too (:func:`_torchrun_form`): ``pollux-run --nproc-per-node P
--nnodes MIN:MAX [--max-restarts K] [-m] [--no-python] SCRIPT ARGS...`` means ``MIN*P`` to
``MAX*P`` replicas placed by the scheduler, the command ``python -u SCRIPT ARGS...``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from .. import env as envvars
from ..arguments import (
    OneLineParser,
    OptionsError,
    count,
    fairness,
    gpu_types_flag,
    seconds,
    seconds_or_zero,
    slots,
)
from ..messages import ELASTICITY, MAX_REPLICAS, JobSpec, field_range
from ..policy import POLICIES
from ..rendezvous.store.cli_args import (
    DEFAULT_URL,
    add_store_arguments,
    store_options,
    worker_store_env,
)
from .devices import cpu_slots, local_slots_default, parse_gpus
from .frameworks import (
    FRAMEWORKS,
    detect_elasticity,
    detect_framework,
    framework_launch,
    state_warning,
    uses_pollux_api,
)
from .hosts import HostsError, parse_hostfile, parse_hosts
from .launch_options import LaunchOptions
from .slurm_allocation import allocation_nodes

# horovodrun flags that only make sense for MPI/ssh/LSF launching.
_UNSUPPORTED = {
    "--mpi": "pollux-run launches workers itself (gloo); drop --mpi",
    "--jsm": "pollux-run does not launch through IBM jsrun; drop --jsm",
    "--mpi-args": "pollux-run does not use mpirun; drop --mpi-args",
    "-p": "pollux-run starts remote workers through node agents, not ssh: "
    "run `pollux-run agent --store etcd://...` on each host instead of -p",
    "--ssh-port": "pollux-run starts remote workers through node agents, not ssh: "
    "run `pollux-run agent --store etcd://...` on each host instead of --ssh-port",
    "-i": "pollux-run starts remote workers through node agents, not ssh: drop -i",
    "--ssh-identity-file": "pollux-run starts remote workers through node agents, not ssh: "
    "drop --ssh-identity-file",
    "--disable-cache": "pollux-run keeps no host-check cache; drop --disable-cache",
}

# torchrun flags with no meaning here: the node agents place and start the workers.
_TORCHRUN_REFUSED = {
    "--node-rank": "node ranks are assigned by pollux-run's node agents; drop --node-rank",
    "--master-addr": "the master is the node of rank 0, chosen per allocation; drop "
    "--master-addr",
    "--master-port": "the master port is chosen per allocation; drop --master-port",
    "--local-addr": "each node agent advertises its own address (`pollux-run agent "
    "--address`); drop --local-addr",
    "--rdzv-conf": "pollux-run's rendezvous is its store: configure it with --store; drop "
    "--rdzv-conf",
    "--role": "a pollux-run job has one role; drop --role",
    "--log-dir": "use --output-filename DIR (per-rank stdout/stderr) or `pollux-run logs JOB`",
    "--redirects": "output is always captured and rank-prefixed; use --output-filename DIR "
    "for per-rank files",
    "--tee": "output is always captured and rank-prefixed; use --output-filename DIR",
    "--start-method": "workers are always started as new processes; drop --start-method",
    "--monitor-interval": "node agents watch their workers continuously; drop "
    "--monitor-interval",
    "--local-ranks-filter": "every rank's output is shown rank-prefixed; filter it with "
    "`pollux-run logs JOB --rank R`",
    "--run-path": "give the script as the command; drop --run-path",
}
# flags that say a command line is torchrun's form (the first word is a script)
_TORCHRUN_FORM = ("nproc_per_node", "nnodes", "standalone", "module", "no_python",
                  "rdzv_backend", "rdzv_endpoint", "rdzv_id")

# Horovod tuning flags: passed to Horovod workers as the environment Horovod reads.
_HOROVOD_ENV_FLAGS = {
    "fusion_threshold_mb": ("HOROVOD_FUSION_THRESHOLD", lambda v: str(int(v * 1024 * 1024))),
    "cycle_time_ms": ("HOROVOD_CYCLE_TIME", str),
    "cache_capacity": ("HOROVOD_CACHE_CAPACITY", str),
    "timeline_filename": ("HOROVOD_TIMELINE", str),
    "hierarchical_allreduce": ("HOROVOD_HIERARCHICAL_ALLREDUCE", lambda v: "1"),
    "autotune": ("HOROVOD_AUTOTUNE", lambda v: "1"),
}

UNBOUNDED = MAX_REPLICAS  # --max-np not given: as many replicas as the cluster offers

# The flag that sets each field of the job's spec: the spec's own bounds (messages.JobSpec,
# the ones every reader checks) are checked here, and a spec refused as a whole names it.
SPEC_FLAGS = {
    "initial_replicas": "-np", "min_replicas": "--min-np", "max_replicas": "--max-np",
    "max_restarts": "--max-restarts", "stop_grace": "--restart-grace",
    "min_batch_size": "--min-batch-size", "max_batch_size": "--max-batch-size",
    "name": "--job-name", "command": "the command", "env": "the workers' environment",
    "gpu_types": "--gpu-types",
}
_TORCHRUN_REPLICAS = "--nnodes x --nproc-per-node"
_JOB_NAME = re.compile(r"^[a-z0-9]([a-z0-9\-_.]{0,62}[a-z0-9])?$")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="pollux-run",
        usage="pollux-run [flags] COMMAND...   |   pollux-run SUBCOMMAND ...",
        description="Launch a goodput-adaptive, live-rescaling training job "
        "(horovodrun-compatible flags).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("horovodrun-compatible")
    g.add_argument("-np", "--num-proc", dest="np", type=count, help="replicas to start with")
    g.add_argument("--min-np", "--min-num-proc", dest="min_np", type=count,
                   help="fewest replicas the job may run on (elastic)")
    g.add_argument("--max-np", "--max-num-proc", dest="max_np", type=count,
                   help="most replicas the job may run on (elastic)")
    g.add_argument("-H", "--hosts", help="host1:slots,host2:slots - the hosts the job may use")
    g.add_argument("-hostfile", "--hostfile", dest="hostfile",
                   help="file of 'host slots=N' lines")
    g.add_argument("--host-discovery-script",
                   help="executable printing 'host[:slots]' lines, polled every second: "
                   "the hosts the job may use now (this machine's names; local mode)")
    g.add_argument("--slots-per-host", type=slots, default=None,
                   help="slots of a host listed without a count")
    g.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                   help="interface(s) for worker traffic, e.g. lo or eth0")
    g.add_argument("--start-timeout", type=seconds, default=None,
                   help="seconds to wait for all workers to start (default 30)")
    g.add_argument("--elastic-timeout", type=seconds, default=600.0,
                   help="seconds to wait for min-np replicas to become available")
    g.add_argument("--reset-limit", type=int, default=None,
                   help="Horovod jobs: horovodrun's limit on elastic resets")
    g.add_argument("--blacklist-cooldown-range", type=int, nargs=2, default=None,
                   metavar=("MIN_S", "MAX_S"),
                   help="Horovod jobs: horovodrun's cool-down range for failed hosts")
    g.add_argument("--output-filename", help="directory for per-rank stdout/stderr logs")
    g.add_argument("--verbose", action="store_true", help="more launcher output")
    g.add_argument("--log-level", default="WARNING",
                   choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"])
    g.add_argument("--gloo", action="store_true", help="accepted: workers always use gloo on CPU")
    g.add_argument("--fusion-threshold-mb", type=float, help="Horovod tuning, passed through")
    g.add_argument("--cycle-time-ms", type=float, help="Horovod tuning, passed through")
    g.add_argument("--cache-capacity", type=int, help="Horovod tuning, passed through")
    g.add_argument("--timeline-filename", help="Horovod timeline, passed through")
    g.add_argument("--hierarchical-allreduce", action="store_true", help="Horovod, passed through")
    g.add_argument("--autotune", action="store_true", help="Horovod autotune, passed through")
    g.add_argument("-v", "--version", action="store_true", help="print the version and exit")

    t = p.add_argument_group(
        "torchrun-compatible", "torchrun's form: pollux-run --nproc-per-node P --nnodes "
        "MIN:MAX SCRIPT ARGS (the first word is a Python script)")
    t.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   help="replicas per node: a number, auto, cpu or gpu")
    t.add_argument("--nnodes", help="nodes N or MIN:MAX (x --nproc-per-node replicas)")
    t.add_argument("--standalone", action="store_true",
                   help="this machine only, embedded store (the default)")
    t.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                   default=None, help="restarts of the whole group after a worker fails "
                   "(restart-elastic and fixed jobs; default 0, as torchrun)")
    t.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                   help="c10d or static: this machine; etcd/etcd-v2: --store etcd://ENDPOINT")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                   help="the etcd endpoint (etcd backends) or this machine")
    t.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="the job name")
    t.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    t.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run SCRIPT as a program, not with python")
    for flag in _TORCHRUN_REFUSED:
        p.add_argument(flag, flag.replace("-", "_").replace("__", "--", 1),
                       dest=_unsupported_dest(flag), nargs="?", const="", help=argparse.SUPPRESS)

    x = p.add_argument_group("pollux")
    x.add_argument("--job-name", help="unique job name (default: derived from the command)")
    x.add_argument("--fairness", type=fairness, default=-1.0,
                   help="fairness knob p of the Pollux fitness (default -1; 1 = plain sum)")
    x.add_argument("--interval", type=seconds, default=None,
                   help="seconds between scheduling rounds (default: from the calibrated cost "
                   "of a live rescale, 15)")
    x.add_argument("--policy", choices=sorted(POLICIES),
                   help="local mode: scheduling policy (default: the fastest exact one; in "
                   "a cluster, the coordinator service's --policy)")
    x.add_argument("--realloc-delay", type=seconds_or_zero, default=None,
                   help="seconds a re-allocation is expected to cost a live job (the "
                   "policy's penalty; default: the calibrated live pause for its state)")
    x.add_argument("--framework", default="auto", choices=("auto", *FRAMEWORKS),
                   help="training framework (default: detected from the script)")
    x.add_argument("--elasticity", default="auto", choices=("auto", *ELASTICITY),
                   help="how the job changes size: live (re-form in place: the pollux API, "
                   "Horovod Elastic), restart (stop and start every worker with torchrun's "
                   "variables), fixed (never); default: detected from the script")
    x.add_argument("--slurm", action=argparse.BooleanOptionalAction, default=None,
                   help="inside a Slurm allocation (sbatch/salloc): run the job on all its "
                   "nodes - a node agent on each through srun, the coordinator here, the "
                   "store given by --store or an etcd started here (default: on in an "
                   "allocation of several nodes, unless --store or -H says where to run)")
    x.add_argument("--sweep", metavar="FILE",
                   help="several jobs sharing the cluster (--slurm or --store): one "
                   "command per line of FILE, each optionally with its own flags; the "
                   "flags here are every job's defaults")
    x.add_argument("--restart-grace", type=seconds_or_zero, default=30.0,
                   help="seconds between SIGTERM and SIGKILL when a restart-elastic job's "
                   "workers are stopped (default 30, as torchrun)")
    for flag in _UNSUPPORTED:  # recognised, so that using one gets a reason, not "unknown"
        p.add_argument(flag, dest=_unsupported_dest(flag), nargs="?", const="",
                       help=argparse.SUPPRESS)
    add_store_arguments(p)
    x.add_argument("--min-batch-size", type=count, default=None, metavar="N",
                   help="smallest total batch the job may run with (its batch-size range; "
                   "narrows the script's)")
    x.add_argument("--max-batch-size", type=count, default=None, metavar="N",
                   help="largest total batch the job may run with (narrows the script's)")
    x.add_argument("--policy-module", action="append", default=None, metavar="MODULE:CLASS",
                   help="an adaptation policy for the job's workers (repeatable, in order; "
                   "'pollux' is Pollux's goodput policy, the default, which any given list "
                   "replaces): pollux_launch.elastic.AdaptationPolicy")
    x.add_argument("--gpus", default=None, metavar="N|IDS",
                   help="local mode: this machine's GPUs for the workers, one each: a count "
                   "or CUDA_VISIBLE_DEVICES ids (0,2,5); 'none' for CPU slots (default: "
                   "the GPUs it has)")
    x.add_argument("--gpu-types", type=gpu_types_flag, default=(), metavar="T1,T2",
                   help="the GPU types the job may run on, e.g. A100,H100 (as the node "
                   "agents report them; default: any); it never spans two")
    x.add_argument("--checkpoint-dir", help="folder for the job's durable checkpoints (a path "
                   "every node can reach): a job whose workers all died resumes from the "
                   "newest one")
    x.add_argument("--checkpoint-interval", type=seconds, default=None,
                   help=f"seconds between checkpoints (default "
                   f"{envvars.DEFAULT_CHECKPOINT_INTERVAL:g})")
    x.add_argument("--secret-file", help="cluster secret for signing the job spec "
                   "(or $POLLUX_SECRET / $POLLUX_SECRET_FILE)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def parse_launch_args(argv: list[str], cwd: str | Path = ".") -> LaunchOptions:
    """Validated options for ``pollux-run [flags] COMMAND...``; OptionsError if bad."""
    ns = build_parser().parse_args(argv)
    for flag, why in _UNSUPPORTED.items():
        if getattr(ns, _unsupported_dest(flag)) is not None:
            raise OptionsError(f"{flag} is not supported: {why}")
    for flag, why in _TORCHRUN_REFUSED.items():
        if getattr(ns, _unsupported_dest(flag)) is not None:
            raise OptionsError(f"torchrun's {flag} makes no sense here: {why}")
    if any(getattr(ns, f) for f in _TORCHRUN_FORM):
        _torchrun_form(ns)
    return _validate(ns, Path(cwd))


def _torchrun_form(ns: argparse.Namespace) -> None:
    """Rewrite torchrun's flags into ours, in place: replicas from --nnodes x
    --nproc-per-node, the command from SCRIPT (``python -u``, ``-m``, ``--no-python``),
    the store from the rendezvous flags, the job name from --rdzv-id."""
    import sys

    ns.torchrun_form = True
    mixed = [f for f, v in (("-np", ns.np), ("--min-np", ns.min_np), ("--max-np", ns.max_np),
                            ("-H", ns.hosts), ("--hostfile", ns.hostfile)) if v]
    if mixed:
        raise OptionsError(f"{mixed[0]} is horovodrun's and --nproc-per-node/--nnodes "
                           "torchrun's: use one form")
    per_node = _nproc_per_node(ns.nproc_per_node or "1")
    lo_nodes, hi_nodes = _nnodes(ns.nnodes or "1")
    ns.np, ns.min_np, ns.max_np = lo_nodes * per_node, lo_nodes * per_node, hi_nodes * per_node
    if ns.min_np == ns.max_np:  # not elastic: exactly that many, as torchrun
        ns.min_np = ns.max_np = None
    backend = (ns.rdzv_backend or "").lower()
    endpoint = ns.rdzv_endpoint or ""
    host = endpoint.rsplit(":", 1)[0] if endpoint else ""
    if ns.standalone and (ns.store or backend or endpoint):
        raise OptionsError("--standalone runs on this machine with the embedded store: drop "
                           "--store/--rdzv-backend/--rdzv-endpoint, or drop --standalone")
    if backend in ("etcd", "etcd-v2"):
        if not endpoint:
            raise OptionsError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT")
        url = f"etcd://{endpoint}"
        if ns.store and ns.store != url:
            raise OptionsError(f"--rdzv-endpoint {endpoint} and --store {ns.store} disagree: "
                               "give one")
        ns.store = url
    elif backend not in ("", "c10d", "static"):
        raise OptionsError(f"--rdzv-backend {ns.rdzv_backend}: use c10d (this machine) or "
                           "etcd (--rdzv-endpoint HOST:PORT of the cluster's etcd)")
    elif host and host not in ("localhost", "127.0.0.1", "::1", "[::1]"):
        raise OptionsError(f"--rdzv-endpoint {endpoint}: pollux-run's rendezvous is its store, "
                           "not a c10d endpoint; for several machines run `pollux-run agent "
                           "--store etcd://...` on each and pass --store etcd://...")
    if ns.rdzv_id and not ns.job_name:
        ns.job_name = ns.rdzv_id
    if not ns.command or ns.command == ["--"]:
        raise OptionsError("no script given; usage: pollux-run --nproc-per-node 2 train.py")
    script = ns.command[1:] if ns.command[0] == "--" else ns.command
    if ns.no_python and ns.module:
        raise OptionsError("--no-python and -m/--module exclude each other (as in torchrun)")
    if ns.no_python:
        ns.command = list(script)
    elif ns.module:
        ns.command = [sys.executable, "-u", "-m", *script]
    else:
        ns.command = [sys.executable, "-u", *script]


def _nproc_per_node(text: str) -> int:
    if text.isdigit() and int(text) >= 1:
        return int(text)
    if text in ("auto", "cpu", "gpu"):
        gpus = local_slots_default(gpus_only=True)
        if text == "gpu" and not gpus:
            raise OptionsError("--nproc-per-node gpu: this machine has no GPU")
        return gpus if text != "cpu" and gpus else cpu_slots()
    raise OptionsError(f"--nproc-per-node {text}: give a number, auto, cpu or gpu")


def _nnodes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise OptionsError(f"--nnodes {text}: give N or MIN:MAX (whole numbers)") from None
    if not 1 <= low <= high:
        raise OptionsError(f"--nnodes {text}: needs 1 <= MIN <= MAX")
    return low, high


def _unsupported_dest(flag: str) -> str:
    return "unsupported_" + flag.lstrip("-").replace("-", "_")


def _validate(ns: argparse.Namespace, cwd: Path) -> LaunchOptions:
    if ns.sweep:  # (pollux-run --sweep FILE: sweep.py reads it; a line cannot)
        raise OptionsError("--sweep: a job of a sweep file cannot name another sweep")
    command = tuple(ns.command[1:] if ns.command[:1] == ["--"] else ns.command)
    if not command:
        raise OptionsError("no command given; usage: pollux-run -np 2 python train.py")
    if shutil.which(command[0]) is None and not (cwd / command[0]).is_file():
        raise OptionsError(f"command {command[0]!r} not found; check the spelling or PATH")
    if getattr(ns, "torchrun_form", False) and not (ns.module or ns.no_python) \
            and not (cwd / command[2]).is_file():
        raise OptionsError(f"script {command[2]!r} not found in {cwd}")

    slots_per_host = ns.slots_per_host if ns.slots_per_host is not None else 1
    if slots_per_host < 1:
        raise OptionsError("--slots-per-host must be at least 1")
    if len([f for f in (ns.hosts, ns.hostfile, ns.host_discovery_script) if f]) > 1:
        raise OptionsError("give only one of -H, --hostfile and --host-discovery-script")
    discovery = None
    if ns.host_discovery_script:
        script = cwd / ns.host_discovery_script
        if not (script.is_file() and os.access(script, os.X_OK)):
            raise OptionsError(f"--host-discovery-script {ns.host_discovery_script}: not an "
                               "executable file (chmod +x it?)")
        discovery = str(script.resolve())
    try:
        hosts = (parse_hosts(ns.hosts, slots_per_host) if ns.hosts
                 else parse_hostfile(cwd / ns.hostfile, slots_per_host) if ns.hostfile
                 else None)
    except HostsError as exc:
        raise OptionsError(str(exc)) from None

    np_, lo, hi = ns.np, ns.min_np, ns.max_np
    for flag, value in (("-np", np_), ("--min-np", lo), ("--max-np", hi)):
        if value is not None and value < 1:
            raise OptionsError(f"{flag} must be at least 1, got {value}")
    if np_ is None:
        np_ = lo or 1
    if lo is None and hi is None:  # not elastic: exactly -np replicas, as horovodrun
        lo = hi = np_
    else:
        lo, hi = lo or 1, hi or UNBOUNDED
    if lo > hi:
        raise OptionsError(f"--min-np {lo} is larger than --max-np {hi}")
    if not lo <= np_ <= hi:
        raise OptionsError(f"-np {np_} must lie within --min-np {lo} and --max-np {hi}")
    if hosts is not None and lo > (slots := sum(h.slots for h in hosts)):
        raise OptionsError(f"--min-np {lo} needs more slots than the listed hosts' {slots}")

    # (--fairness, --interval, --realloc-delay, the timeouts: checked by their types)
    start_timeout = ns.start_timeout
    if start_timeout is None:
        try:
            start_timeout = seconds(os.environ.get("HOROVOD_START_TIMEOUT", "30"))
        except argparse.ArgumentTypeError as exc:
            raise OptionsError(f"$HOROVOD_START_TIMEOUT: {exc}") from None
    if ns.reset_limit is not None and ns.reset_limit < 0:
        raise OptionsError("--reset-limit must be 0 or more")
    cooldown = tuple(ns.blacklist_cooldown_range) if ns.blacklist_cooldown_range else None
    if cooldown and not 0 <= cooldown[0] <= cooldown[1]:
        raise OptionsError("--blacklist-cooldown-range needs 0 <= MIN_S <= MAX_S")

    slurm, slurm_notice = _slurm_mode(ns)
    job_name = ns.job_name or (os.environ.get(envvars.SLURM_JOB_ID) if slurm else None) \
        or _default_job_name(command)  # (--rdzv-id: the job name, as Slurm's job id)
    if not _JOB_NAME.match(job_name):
        raise OptionsError(
            f"--job-name {job_name!r}: use 1-64 lowercase letters, digits, '-', '_' or '.'"
        )
    framework = ns.framework if ns.framework != "auto" else detect_framework(command, cwd)
    horovod_env = {
        env: conv(getattr(ns, attr))
        for attr, (env, conv) in _HOROVOD_ENV_FLAGS.items()
        if getattr(ns, attr) not in (None, False)
    }
    if horovod_env and framework != "horovod":
        flags = [f"--{a.replace('_', '-')}" for a in _HOROVOD_ENV_FLAGS if getattr(ns, a)]
        raise OptionsError(f"{', '.join(flags)}: Horovod tuning, but this is a {framework} job")
    # Only horovodrun's elastic driver counts resets and blacklists hosts; a native or
    # DeepSpeed job's rescales are the scheduler's decisions, so silently ignoring the
    # flags there would mislead.
    elastic = [f for f, v in (("--reset-limit", ns.reset_limit),
                              ("--blacklist-cooldown-range", cooldown)) if v is not None]
    if elastic and framework != "horovod":
        raise OptionsError(
            f"{', '.join(elastic)}: horovodrun elastic options, but this is a {framework} job "
            "(its rescales are scheduled by Pollux; bound them with --min-np/--max-np)"
        )
    check = framework_launch(framework).check  # e.g. DeepSpeed's ds_config "pollux" section
    if check is not None:
        check(command, cwd)
    try:
        elasticity, why = detect_elasticity(framework, command, cwd, lo, hi, ns.elasticity)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    if elasticity == "fixed":  # (--elasticity fixed over a range: the job runs at -np)
        lo = hi = np_
    max_restarts = ns.max_restarts or 0
    state_note = state_warning(command, cwd, elasticity)
    torchrun = getattr(ns, "torchrun_form", False)
    _check_spec_bounds({
        "initial_replicas": np_, "min_replicas": lo, "max_replicas": hi,
        "max_restarts": max_restarts, "stop_grace": ns.restart_grace,
        "min_batch_size": ns.min_batch_size, "max_batch_size": ns.max_batch_size},
        {f: _TORCHRUN_REPLICAS for f in ("initial_replicas", "min_replicas", "max_replicas")}
        if torchrun else {})
    if ns.policy is not None and not (ns.store or DEFAULT_URL).startswith("embedded"):
        raise OptionsError("--policy: in a cluster every job is scheduled by the coordinator "
                           "service's policy (`pollux-run coordinator --policy ...`); drop "
                           "the flag here")
    if max_restarts and elasticity == "live":
        raise OptionsError("--max-restarts: this job re-forms live: when a worker is lost, "
                           "the others go on without it and its slot gets a new worker; "
                           "restarts apply to restart-elastic and fixed jobs")
    checkpoint_env = _checkpoint_env(ns, cwd)
    policy_env = _policy_env(ns, command, cwd)
    batch_env = _batch_env(ns)
    if elasticity != "live":  # the size its global batch is written for (constant_batch)
        batch_env[envvars.REFERENCE_WORLD_SIZE] = str(np_)
    if ns.output_filename:
        _writable_folder("--output-filename", ns.output_filename, cwd)
    return LaunchOptions(
        command=command, np=np_, min_np=lo, max_np=hi, hosts=hosts,
        slots_per_host=slots_per_host, host_discovery_script=discovery,
        network_interface=ns.network_interface, start_timeout=start_timeout,
        elastic_timeout=ns.elastic_timeout, reset_limit=ns.reset_limit,
        blacklist_cooldown_range=cooldown, output_filename=ns.output_filename,
        verbose=ns.verbose, log_level=ns.log_level, store=ns.store,
        store_prefix=ns.store_prefix, job_name=job_name,
        fairness=ns.fairness, interval=ns.interval, realloc_delay=ns.realloc_delay,
        policy=ns.policy, framework=framework,
        horovod_env=horovod_env, store_options=store_options(ns),
        worker_env={**worker_store_env(ns), **checkpoint_env, **policy_env, **batch_env},
        secret_file=ns.secret_file,
        elasticity=elasticity, elasticity_reason=why, elasticity_warning=state_note,
        max_restarts=max_restarts,
        stop_grace=ns.restart_grace, reports_goodput=uses_pollux_api(command, cwd),
        min_batch_size=ns.min_batch_size, max_batch_size=ns.max_batch_size,
        gpus=parse_gpus(ns.gpus) if ns.gpus is not None else None,
        slurm=slurm, slurm_notice=slurm_notice, gpu_types=ns.gpu_types,
    )


def _slurm_mode(ns: argparse.Namespace) -> tuple[bool, str]:
    """Whether the job runs on the Slurm allocation this runs in (``--slurm``), and the
    notice to print when that was not asked for but found: inside an allocation of
    several nodes (an sbatch script, an salloc shell - not a task of an srun step),
    unless a store or host list says where the job runs, or ``--no-slurm``."""
    if ns.slurm is not None:
        return ns.slurm, ""
    found = allocation_nodes(os.environ)
    if found is None or ns.store or ns.hosts or ns.hostfile or ns.host_discovery_script:
        return False, ""
    job_id, nodes = found
    return True, (f"in Slurm job {job_id}'s allocation of {nodes} nodes: running the job "
                  "on all of them, as --slurm does (--no-slurm: this node only)")


def _check_spec_bounds(values: dict[str, float | None], flags: dict[str, str]) -> None:
    """Each value bound for the job's spec within the bounds its readers check
    (``messages.JobSpec``): else one line naming the flag (``flags``: where another flag
    than ``SPEC_FLAGS``' sets it) and the range, before anything starts."""
    for name, value in values.items():
        if value is None:
            continue
        lo, hi = field_range(JobSpec, name)
        if not lo <= value <= hi:
            raise OptionsError(f"{flags.get(name, SPEC_FLAGS[name])} {_number(value)}: must "
                               f"lie in [{_number(lo)}, {_number(hi)}]")


def _number(value: float) -> str:
    """A bound or value as a person writes it: 3600, not 3600.0 or 3.6e+03."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _checkpoint_env(ns: argparse.Namespace, cwd: Path) -> dict[str, str]:
    """The workers' checkpoint variables; the folder is made now, so that a path no one
    can write is refused before anything starts."""
    if not ns.checkpoint_dir:
        if ns.checkpoint_interval is not None:
            raise OptionsError("--checkpoint-interval needs --checkpoint-dir DIR")
        return {}
    folder = _writable_folder("--checkpoint-dir", ns.checkpoint_dir, cwd)
    env = {envvars.CHECKPOINT_DIR: str(folder)}
    if ns.checkpoint_interval is not None:
        env[envvars.CHECKPOINT_INTERVAL] = repr(float(ns.checkpoint_interval))
    return env


def _batch_env(ns: argparse.Namespace) -> dict[str, str]:
    """The workers' batch-size range (their agents narrow the script's with it)."""
    lo, hi = ns.min_batch_size, ns.max_batch_size
    if lo is not None and hi is not None and lo > hi:
        raise OptionsError(f"--min-batch-size {lo} is above --max-batch-size {hi}")
    env = {}
    if lo is not None:
        env[envvars.MIN_BATCH_SIZE] = str(lo)
    if hi is not None:
        env[envvars.MAX_BATCH_SIZE] = str(hi)
    return env


def _policy_env(ns: argparse.Namespace, command: tuple[str, ...], cwd: Path
                ) -> dict[str, str]:
    """The workers' policy list: each entry checked for form (an import path, never code)
    and found without importing it (the workers import it)."""
    if not ns.policy_module:
        return {}
    from ..elastic.adaptation import ADAPTATION_POLICIES, PolicyError, check_spec

    if not uses_pollux_api(command, cwd):
        raise OptionsError("--policy-module: policies run inside the pollux API (ElasticTrainer, "
                           "pollux's Horovod DistributedOptimizer or DeepSpeed initialize), "
                           "which this script does not use")
    specs = []
    for given in ns.policy_module:
        for entry in given.split(","):
            try:
                spec = check_spec(entry)
            except PolicyError as exc:
                raise OptionsError(str(exc)) from None
            if spec not in ADAPTATION_POLICIES and not _module_found(spec.partition(":")[0], cwd):
                raise OptionsError(f"--policy-module {spec}: no module "
                                   f"{spec.partition(':')[0]!r} on the Python path or in "
                                   f"{cwd}; check the name, or run from its folder")
            specs.append(spec)
    return {envvars.POLICIES: ",".join(specs)}


def _module_found(module: str, cwd: Path) -> bool:
    """Whether ``module`` exists, found as ``import`` would (the Python path, then
    ``cwd``) without running any of it."""
    from importlib.machinery import PathFinder

    path: list[str] | None = [*sys.path, str(cwd)]
    spec = None
    for part in module.split("."):
        name = part if spec is None else f"{spec.name}.{part}"
        spec = PathFinder.find_spec(name, path)
        if spec is None:
            return False
        path = list(spec.submodule_search_locations or [])
    return True


def _default_job_name(command: tuple[str, ...]) -> str:
    module = command[command.index("-m") + 1] if "-m" in command[:-1] else None
    script = module.rpartition(".")[2] if module else next(
        (Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name)
    base = re.sub(r"[^a-z0-9\-]+", "-", script.lower()).strip("-") or "job"
    return f"{base[:40]}-{os.getpid()}"


def _writable_folder(flag: str, given: str, cwd: Path) -> Path:
    """``given`` (relative to ``cwd``) as an absolute folder, made now if missing, and
    proven writable by writing into it - so that nothing is started that would lose
    what it writes there."""
    folder = (cwd / given).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".pollux-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OptionsError(f"{flag} {given}: cannot write there ({exc.strerror or exc}); "
                           "give a writable folder") from None
    return folder
