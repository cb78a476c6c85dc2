"""``pollux-run [flags] COMMAND...``: horovodrun's flags with horovodrun's meaning, plus Pollux's.

``build_parser`` declares the flags; ``parse_launch_args`` turns argv into a validated,
frozen :class:`LaunchOptions` or raises :class:`OptionsError` with one line saying what
is wrong and how to fix it - before anything starts.

Replica counts: ``-np`` is where the job starts. Without ``--min-np``/``--max-np`` the job
keeps exactly ``-np`` replicas (as with horovodrun; its batch size still adapts); with
them, the coordinator moves it anywhere in ``[min-np, max-np]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .. import env as envvars
from ..arguments import (
    OneLineParser,
    OptionsError,
    count,
    fairness,
    seconds,
    seconds_or_zero,
    slots,
)
from ..messages import MAX_REPLICAS
from ..rendezvous.store.cli_args import add_store_arguments, store_options, worker_store_env
from .frameworks import FRAMEWORKS, detect_framework, ds_config_paths
from .hosts import Host, HostsError, parse_hostfile, parse_hosts

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
_JOB_NAME = re.compile(r"^[a-z0-9]([a-z0-9\-_.]{0,62}[a-z0-9])?$")


@dataclass(frozen=True)
class LaunchOptions:
    command: tuple[str, ...]
    np: int
    min_np: int
    max_np: int
    hosts: tuple[Host, ...] | None
    host_discovery_script: str | None
    slots_per_host: int
    network_interface: str | None
    start_timeout: float
    elastic_timeout: float
    reset_limit: int | None
    blacklist_cooldown_range: tuple[int, int] | None
    output_filename: str | None
    verbose: bool
    log_level: str
    store: str | None
    store_prefix: str
    job_name: str
    fairness: float
    interval: float
    realloc_delay: float
    policy: str | None
    framework: str
    horovod_env: dict[str, str] = field(default_factory=dict)
    store_options: dict[str, object] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    secret_file: str | None = None

    @property
    def elastic(self) -> bool:
        return self.min_np != self.max_np


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
                   help="executable printing 'host[:slots]' lines: the hosts the job may use")
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

    x = p.add_argument_group("pollux")
    x.add_argument("--job-name", help="unique job name (default: derived from the command)")
    x.add_argument("--fairness", type=fairness, default=-1.0,
                   help="fairness knob p of the Pollux fitness (default -1; 1 = plain sum)")
    x.add_argument("--interval", type=seconds, default=60.0,
                   help="seconds between scheduling rounds (default 60)")
    x.add_argument("--policy", help="scheduling policy name (default: the fastest exact one)")
    x.add_argument("--realloc-delay", type=seconds_or_zero, default=10.0,
                   help="seconds a re-allocation is expected to cost a job (the policy's "
                   "penalty; default 10: live rescaling, not checkpoint-restart)")
    x.add_argument("--framework", default="auto", choices=("auto", *FRAMEWORKS),
                   help="training framework (default: detected from the script)")
    for flag in _UNSUPPORTED:  # recognised, so that using one gets a reason, not "unknown"
        p.add_argument(flag, dest=_unsupported_dest(flag), nargs="?", const="",
                       help=argparse.SUPPRESS)
    add_store_arguments(p)
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
    return _validate(ns, Path(cwd))


def _unsupported_dest(flag: str) -> str:
    return "unsupported_" + flag.lstrip("-").replace("-", "_")


def _validate(ns: argparse.Namespace, cwd: Path) -> LaunchOptions:
    command = tuple(ns.command[1:] if ns.command[:1] == ["--"] else ns.command)
    if not command:
        raise OptionsError("no command given; usage: pollux-run -np 2 python train.py")
    if shutil.which(command[0]) is None and not (cwd / command[0]).is_file():
        raise OptionsError(f"command {command[0]!r} not found; check the spelling or PATH")

    slots_per_host = ns.slots_per_host if ns.slots_per_host is not None else 1
    if slots_per_host < 1:
        raise OptionsError("--slots-per-host must be at least 1")
    sources = [f for f in ("hosts", "hostfile", "host_discovery_script") if getattr(ns, f)]
    if len(sources) > 1:
        raise OptionsError("give only one of -H, --hostfile and --host-discovery-script")
    try:
        hosts = (parse_hosts(ns.hosts, slots_per_host) if ns.hosts
                 else parse_hostfile(cwd / ns.hostfile, slots_per_host) if ns.hostfile
                 else None)
    except HostsError as exc:
        raise OptionsError(str(exc)) from None
    if ns.host_discovery_script:
        script = cwd / ns.host_discovery_script
        if not (script.is_file() and os.access(script, os.X_OK)):
            raise OptionsError(
                f"--host-discovery-script {ns.host_discovery_script}: not an executable file"
            )

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

    job_name = ns.job_name or _default_job_name(command)
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
    if framework == "deepspeed":
        _check_ds_configs(command, cwd)
    checkpoint_env = _checkpoint_env(ns, cwd)
    if ns.output_filename:
        _writable_folder("--output-filename", ns.output_filename, cwd)
    return LaunchOptions(
        command=command, np=np_, min_np=lo, max_np=hi, hosts=hosts,
        host_discovery_script=ns.host_discovery_script, slots_per_host=slots_per_host,
        network_interface=ns.network_interface, start_timeout=start_timeout,
        elastic_timeout=ns.elastic_timeout, reset_limit=ns.reset_limit,
        blacklist_cooldown_range=cooldown, output_filename=ns.output_filename,
        verbose=ns.verbose, log_level=ns.log_level, store=ns.store,
        store_prefix=ns.store_prefix, job_name=job_name,
        fairness=ns.fairness, interval=ns.interval, realloc_delay=ns.realloc_delay,
        policy=ns.policy, framework=framework,
        horovod_env=horovod_env, store_options=store_options(ns),
        worker_env={**worker_store_env(ns), **checkpoint_env}, secret_file=ns.secret_file,
    )


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


def _default_job_name(command: tuple[str, ...]) -> str:
    script = next((Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name)
    base = re.sub(r"[^a-z0-9\-]+", "-", script.lower()).strip("-") or "job"
    return f"{base[:40]}-{os.getpid()}"


def _check_ds_configs(command: tuple[str, ...], cwd: Path) -> None:
    """A DeepSpeed job's ds_config (its "pollux" section above all) is checked here,
    before any worker starts, and a mistake names the file."""
    from ..adapters.deepspeed.config import PolluxConfigError, parse_pollux_config

    for path in ds_config_paths(command, cwd):
        try:
            parse_pollux_config(path)
        except PolluxConfigError as exc:
            text = str(exc)
            raise OptionsError(text if str(path) in text else f"{path}: {text}") from None


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
