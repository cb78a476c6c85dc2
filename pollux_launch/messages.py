"""Messages exchanged through the store: small frozen dataclasses serialised to JSON.

Every message carries a schema version ``v``. Everything read from the store is
untrusted input - any party with store access may have written it, a job's own rank 0
writes its hints - and this module is the one layer that decodes it: :func:`decode`
takes at most ``MAX_VALUE_BYTES`` of UTF-8 JSON, nested at most ``MAX_DEPTH`` deep, with
finite numbers only; checks the schema version, every field's type, every number's
range (``within``: ints that reach numpy stay small and exact) and every name (one
level of a store key, ``keys.NAME``); and raises :class:`MessageError` (a
``ValueError``) on anything else. Nothing is ever unpickled or evaluated. Services read
through a :class:`ValueLog`, so that a bad value is logged once per key and revision,
then ignored.

Who writes what (key schema in ``rendezvous/README.md``):

* ``JobSpec``    - written once by ``pollux-run`` when a job is submitted.
* ``JobHints``   - written by the job's rank-0 agent every ~30 s: what the policy needs.
* ``Allocation`` - written by the coordinator; one node name per replica, with a version
  number that increases with every change (one rendezvous round per version).
* ``NodeInfo``   - written by each node agent under a lease.
* ``JobGpus``    - the GPUs a job's workers hold on a node, by that node's agent.
* ``WorkerFinished`` - a worker that completed the script, by its node agent.
* ``JobStatus``  - the job's lifecycle state, written by whoever learns of a change
  (``pollux-run`` or a node agent when workers exit, ``pollux-run cancel``).
* ``JobRestarts`` - how often the job started again after all its workers died, and the
  progress lost (the rendezvous' rank 0).
* ``JobGeneration`` - a restart-elastic job's restarts after a failure (torchrun's
  restart count) and its measured cost of a restart (its node agents).
* ``WorkerTask`` / ``TaskExit`` - a Horovod worker a job's launcher asks a node's agent to
  run, and how it ended (``adapters/horovod/launch/tasks.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import types
import typing
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pollux_launch.errors import UserError

from . import keys

SCHEMA_VERSION = 1
MAX_VALUE_BYTES = 1 << 20  # a message of ours is a few KB at most
MAX_DEPTH = 8  # the deepest message of ours nests 3 levels
MAX_INT = 1 << 53  # any int beyond is refused: exact in a float, safe in numpy
MAX_SLOTS = 4096  # per node
MAX_REPLICAS = 1_000_000  # per job (also: JobSpec's "unbounded")
MAX_BATCH = 1 << 31

M = TypeVar("M")


class MessageError(UserError, ValueError):
    """A value read from the store is not a well-formed message. ``field``: the name of
    the field whose value is wrong (None: the message as a whole), so that a caller can
    say which of its inputs set it without reading the text."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def within(lo: float, hi: float, default: Any = dataclasses.MISSING,
            factory: Any = dataclasses.MISSING) -> Any:
    """A field whose numbers (or, for a container, each number in it) lie in [lo, hi]."""
    return field(default=default, default_factory=factory, metadata={"range": (lo, hi)})


def named(default: Any = dataclasses.MISSING) -> Any:
    """A field that is a name (or a tuple of names): one level of a store key."""
    return field(default=default, metadata={"name": True})


_TIME = (0.0, 1e11)  # seconds since the epoch (to year 5138)


ELASTICITY = ("live", "restart", "fixed")


@dataclass(frozen=True)
class JobSpec:
    """What a job is and how it may be scaled (written once, at submission)."""

    name: str = named()
    command: tuple[str, ...] = ()
    framework: str = "torch"
    initial_replicas: int = within(1, MAX_REPLICAS, 1)
    min_replicas: int = within(1, MAX_REPLICAS, 1)
    max_replicas: int = within(1, MAX_REPLICAS, MAX_REPLICAS)
    preemptible: bool = True
    submit_time: float = within(*_TIME, 0.0)
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    submission: str = ""  # random id of this submission (signed with the spec)
    expires: float = within(*_TIME, 0.0)  # agents start nothing of it after (0: never)
    # how its size may change (ELASTICITY): "live" re-forms in place, "restart" stops and
    # starts every worker with torchrun's variables, "fixed" never changes
    elasticity: str = "live"
    max_restarts: int = within(0, 1_000_000, 0)  # restarts after a failure (torchrun's)
    stop_grace: float = within(0.0, 3600.0, 30.0)  # SIGTERM -> SIGKILL when restarting
    # its script uses the pollux API, so it will report a goodput model; False: it never
    # will (a torchrun-style or plain Horovod Elastic script) and takes what is free
    reports_goodput: bool = True
    # the job's batch-size range (Saxena et al.; pollux-run --min/--max-batch-size): every
    # policy and the job's agent keep its total batch within it (None: the script's)
    min_batch_size: int | None = within(1, MAX_BATCH, None)
    max_batch_size: int | None = within(1, MAX_BATCH, None)
    # the GPU types it may run on (pollux-run --gpu-types; empty: any); it never spans two
    gpu_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_types("JobSpec.gpu_types", self.gpu_types)
        if not self.command:
            raise MessageError("JobSpec.command is empty")
        if not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise MessageError("JobSpec: needs min_replicas <= initial_replicas <= "
                               "max_replicas")
        if self.elasticity not in ELASTICITY:
            raise MessageError(f"JobSpec.elasticity must be one of {ELASTICITY}, got "
                               f"{self.elasticity[:40]!r}")
        if self.elasticity == "fixed" and self.min_replicas != self.max_replicas:
            raise MessageError("JobSpec: a fixed job needs min_replicas == max_replicas")
        if (self.min_batch_size is not None and self.max_batch_size is not None
                and self.min_batch_size > self.max_batch_size):
            raise MessageError("JobSpec: needs min_batch_size <= max_batch_size")


@dataclass(frozen=True)
class JobHints:
    """The job's rank-0 agent's view of itself, enough for the policy (Pollux Sec. 4.1).

    ``perf_params`` holds the fitted throughput-model parameters by name (see
    ``pollux_launch.goodput.PerfParams``); ``grad_sqr``/``grad_var`` are the gradient
    statistics normalised to ``init_batch_size`` (Pollux Eqn 4-6).
    """

    init_batch_size: int = within(1, MAX_BATCH)
    max_batch_size: int = within(1, MAX_BATCH)
    local_bsz_bounds: tuple[int, int] = within(1, MAX_BATCH)
    # the batch-size range's lower end, when the job has one (None: M0)
    min_batch_size: int | None = within(1, MAX_BATCH, None)
    gradient_accumulation: bool = True
    adaptive_batch_size: bool = True
    perf_params: dict[str, float] | None = within(0.0, 1e6, None)
    grad_sqr: float | None = within(0.0, 1e30, None)
    grad_var: float | None = within(0.0, 1e30, None)
    max_profiled_replicas: int = within(0, MAX_REPLICAS, 0)
    max_profiled_nodes: int = within(0, MAX_REPLICAS, 0)
    num_nodes: int = within(0, MAX_REPLICAS, 0)
    num_replicas: int = within(0, MAX_REPLICAS, 0)
    local_bsz: int = within(0, MAX_BATCH, 0)
    accum_steps: int = within(0, 1 << 20, 0)
    progress: float = within(0.0, 1e15, 0.0)
    restarts: int = within(0, MAX_INT, 0)
    timestamp: float = within(*_TIME, 0.0)
    # seconds the survivors paused in the job's recent live rescales (the dearest of the
    # last few): the coordinator's measured delta for this job's re-allocation penalty
    rescale_s: float | None = within(0.0, 86400.0, None)
    # the job's adaptation policies' replica request (pollux_launch.elastic.adaptation):
    # the coordinator keeps it between them, within the spec's limits and the capacity
    min_replicas_wanted: int | None = within(1, MAX_REPLICAS, None)
    max_replicas_wanted: int | None = within(1, MAX_REPLICAS, None)

    def __post_init__(self) -> None:
        lo, hi = self.local_bsz_bounds
        if not (lo <= hi and self.init_batch_size <= self.max_batch_size):
            raise MessageError("JobHints: needs local_bsz_bounds lo <= hi and "
                               "init_batch_size <= max_batch_size")
        if self.min_batch_size is not None and self.min_batch_size > self.max_batch_size:
            raise MessageError("JobHints: needs min_batch_size <= max_batch_size")
        if (self.min_replicas_wanted is not None and self.max_replicas_wanted is not None
                and self.min_replicas_wanted > self.max_replicas_wanted):
            raise MessageError("JobHints: needs min_replicas_wanted <= max_replicas_wanted")
        if self.perf_params is not None:
            from .goodput import PerfParams  # (the goodput core's own checks: names, ranges)

            try:
                PerfParams(**self.perf_params)
            except (TypeError, ValueError) as exc:
                raise MessageError(f"JobHints.perf_params: {exc}") from None


@dataclass(frozen=True)
class Allocation:
    """The coordinator's decision for one job: one node name per replica.

    ``term`` is the writing coordinator's leadership term (the create revision of its
    ``coordinator/leader`` key): allocations are ordered by ``(term, version)``, and a
    node agent that has seen one never goes back to an older one.
    """

    version: int = within(0, MAX_INT)
    nodes: tuple[str, ...] = named()
    timestamp: float = within(*_TIME, 0.0)
    term: int = within(0, MAX_INT, 0)

    def __post_init__(self) -> None:
        if len(self.nodes) > MAX_REPLICAS:
            raise MessageError("Allocation.nodes: more replicas than any job may have")

    @property
    def order(self) -> tuple[int, int]:
        return (self.term, self.version)

    @property
    def num_replicas(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))


# A GPU id as CUDA_VISIBLE_DEVICES names one (an index, GPU-<uuid>, MIG-<uuid>, or the
# older MIG-GPU-<uuid>/<gi>/<ci>): never a comma
GPU_ID = re.compile(r"[A-Za-z0-9_.:/+-]{1,128}")
# a node's GPU type (its agent's --gpu-type, else the driver's model name, e.g. H100;
# "cpu" for CPU slots): jobs never span two (policy/gpu_types.py)
GPU_TYPE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")


def _check_types(where: str, types: tuple[str, ...]) -> None:
    if len(types) > 64:
        raise MessageError(f"{where}: more than 64 GPU types")
    for name in types:
        if not GPU_TYPE.fullmatch(name):
            raise MessageError(f"{where}: {name[:80]!r} is not a GPU type (letters, digits, "
                               "'_.+-', at most 64)")


def _check_gpus(where: str, gpus: tuple[str, ...]) -> None:
    if len(gpus) > MAX_SLOTS:
        raise MessageError(f"{where}: more GPUs than a node may have")
    for gpu in gpus:
        if not GPU_ID.fullmatch(gpu):
            raise MessageError(f"{where}: {gpu[:80]!r} is not a GPU id")


@dataclass(frozen=True)
class NodeInfo:
    """A node agent's registration (kept under its lease). ``workers``: the agent's own
    view of the processes it runs, per job (each holds a slot until it has exited);
    ``gpus``: the node's GPUs (one slot each; empty on a node of CPU slots)."""

    name: str = named()
    slots: int = within(0, MAX_SLOTS)
    address: str = "127.0.0.1"
    timestamp: float = within(*_TIME, 0.0)
    workers: dict[str, int] = within(0, MAX_SLOTS, factory=dict)
    log_port: int = within(0, 65535, 0)  # where it serves job logs (launcher/logs.py); 0: none
    gpus: tuple[str, ...] = ()
    gpu_type: str = ""  # GPU_TYPE ("": an agent that says none - one type with the others')

    def __post_init__(self) -> None:
        for job in self.workers:
            if not keys.NAME.fullmatch(job):
                raise MessageError(f"NodeInfo.workers: bad job name {job[:80]!r}")
        _check_gpus("NodeInfo.gpus", self.gpus)
        _check_types("NodeInfo.gpu_type", (self.gpu_type,) if self.gpu_type else ())


@dataclass(frozen=True)
class NodeDrain:
    """An operator's drain of a node (``drains/<node>``, ``pollux-run drain``): the
    coordinator offers it no slots, so its jobs move off it live; deleted to undo."""

    node: str = named()
    reason: str = ""
    timestamp: float = within(*_TIME, 0.0)

    def __post_init__(self) -> None:
        if len(self.reason) > 200:
            raise MessageError("NodeDrain.reason: longer than 200 characters")


@dataclass(frozen=True)
class JobGpus:
    """The GPUs a job's workers hold on one node, oldest worker first (written by that
    node's agent under its lease whenever they change; launcher/devices.py)."""

    node: str = named()
    gpus: tuple[str, ...] = ()
    timestamp: float = within(*_TIME, 0.0)

    def __post_init__(self) -> None:
        _check_gpus("JobGpus.gpus", self.gpus)


@dataclass(frozen=True)
class WorkerFinished:
    """A worker that completed the job's script (exit 0 while its replica was allocated),
    recorded by its node agent (``launcher/completion.py``). ``generation``: the
    allocation's (term, version) and the restarts of the group it ran in (a
    restart-elastic job's; 0 for a live job, whose group is its last formed round)."""

    node: str = named()
    generation: tuple[int, int, int] = within(0, MAX_INT, (0, 0, 0))
    timestamp: float = within(*_TIME, 0.0)


@dataclass(frozen=True)
class WorkerTask:
    """A process a job's launcher-side driver asks one node to run (Horovod's workers):
    the job's own command, with Horovod's variables for this slot."""

    node: str = named()
    command: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    index: int = within(0, MAX_REPLICAS, 0)


@dataclass(frozen=True)
class TaskExit:
    """How a ``WorkerTask``'s process ended, written by the node agent that ran it."""

    code: int = within(-255, 255)


@dataclass(frozen=True)
class JobRestarts:
    """Times every worker of the job had died and it started again, and the statistical
    progress (``JobHints.progress``, iterations at the initial batch size) those restarts
    lost. Written by the rank 0 of the round that restarted it: first as if from scratch
    (all the progress last reported), then - once that rank 0 resumed from a durable
    checkpoint - less the checkpoint's progress (``resumed``: the restarts so credited)."""

    count: int = within(0, MAX_INT)
    lost_progress: float = within(0.0, 1e15, 0.0)
    timestamp: float = within(*_TIME, 0.0)
    resumed: int = within(0, MAX_INT, 0)


@dataclass(frozen=True)
class JobGeneration:
    """A restart-elastic job's group of workers: ``restarts`` is how often it was started
    again after a failure (torchrun's ``TORCHELASTIC_RESTART_COUNT``; a new allocation
    restarts it without counting), raised by compare-and-swap by the node agent that
    saw the failure, so that one failure seen on many nodes counts once. ``stop_s`` and
    ``startup_s`` are measured by the node agent of rank 0: how long the old workers took
    to exit after SIGTERM, and from starting the new rank 0 until its rendezvous port
    (``MASTER_PORT``) accepted connections - together the cost of one restart that the
    coordinator charges (the script's own checkpoint loading is not seen from outside).
    ``stops``: groups stopped before they finished (for a new allocation or after a
    failure); ``lost_s``: the training time they threw away, summed - for each, from its
    newest file under the job's ``--checkpoint-dir`` (or, with none there, from the
    group's start) until it was stopped; without ``--checkpoint-dir``, the group's whole
    run time (an upper bound). Both measured by the node agent that ran its rank 0."""

    restarts: int = within(0, MAX_INT, 0)
    stop_s: float | None = within(0.0, 1e6, None)
    startup_s: float | None = within(0.0, 1e6, None)
    timestamp: float = within(*_TIME, 0.0)
    stops: int = within(0, MAX_INT, 0)
    lost_s: float = within(0.0, 1e12, 0.0)

    @property
    def restart_s(self) -> float | None:
        """The measured cost of one restart, None before anything was measured."""
        if self.startup_s is None:
            return None
        return self.startup_s + (self.stop_s or 0.0)


# "queued": waiting for admission (the coordinator's --admission queue); "rejected": not
# admitted (--admission drop, or --max-wait passed), the job never ran
JOB_STATES = ("pending", "queued", "running", "succeeded", "failed", "cancelled", "rejected")
FINISHED_STATES = ("succeeded", "failed", "cancelled", "rejected")
# a rejected job's exit code (its launcher's too): EX_TEMPFAIL, "try again later"
REJECTED_EXIT = 75


@dataclass(frozen=True)
class JobStatus:
    """``state`` is one of JOB_STATES; ``exit_code`` is set once the job finished."""

    state: str
    exit_code: int | None = within(-255, 255, None)
    message: str = ""
    timestamp: float = within(*_TIME, 0.0)

    def __post_init__(self) -> None:
        if self.state not in JOB_STATES:
            raise MessageError(f"JobStatus.state must be one of {JOB_STATES}, got {self.state!r}")

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES


@dataclass(frozen=True)
class AutoscaleStatus:
    """The coordinator's autoscaler at its last decision (``coordinator/autoscale``):
    nodes registered, the size it aims at, nodes asked for and not joined yet, nodes
    being drained, the cluster's utility (Pollux Sec. 4.2.2) and why."""

    nodes: int = within(0, MAX_INT)
    target: int = within(0, MAX_INT)
    booting: int = within(0, MAX_INT, 0)
    draining: tuple[str, ...] = named(())
    utility: float = within(0.0, 1e6, 0.0)
    rule: str = "goodput"
    reason: str = ""
    timestamp: float = within(*_TIME, 0.0)


def encode(msg: Any) -> str:
    """Serialise a message dataclass to compact JSON with its schema version."""
    body = dataclasses.asdict(msg)
    body["v"] = SCHEMA_VERSION
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def _no_constant(token: str) -> Any:
    raise MessageError(f"{token} is not a number JSON allows")


def decode(cls: type[M], raw: str | bytes) -> M:
    """Parse and validate ``raw`` as a ``cls`` message; :class:`MessageError` if malformed."""
    name = cls.__name__
    if len(raw) > MAX_VALUE_BYTES:
        raise MessageError(f"{name}: {len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        # a store hands over text with undecodable bytes as surrogates: not UTF-8 either
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        text.encode("utf-8")
    except UnicodeError:
        raise MessageError(f"{name}: not UTF-8 text") from None
    if _depth(text) > MAX_DEPTH:
        raise MessageError(f"{name}: nested more than {MAX_DEPTH} levels")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:  # (MessageError included)
        raise MessageError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise MessageError(f"{name}: expected a JSON object, got {type(body).__name__}")
    if body.pop("v", None) != SCHEMA_VERSION:
        raise MessageError(f"{name}: unsupported schema version (expected v={SCHEMA_VERSION})")
    hints, fields = _schema(cls)
    kwargs = {}
    for f in fields:
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{name}: missing field {f.name!r}")
            continue
        try:
            value = _coerce(body.pop(f.name), hints[f.name], f"{name}.{f.name}")
            _check(value, f.metadata, f"{name}.{f.name}")
        except MessageError as exc:
            exc.field = f.name
            raise
        kwargs[f.name] = value
    if body:
        raise MessageError(f"{name}: unknown field(s) {sorted(body)[:5]}")
    try:
        return cls(**kwargs)
    except MessageError:
        raise
    except (TypeError, ValueError) as exc:  # a message's own invariants
        raise MessageError(f"{name}: {exc}") from None


def checked(msg: Any) -> str:
    """``msg`` encoded, once it is proven that every reader accepts it: decoded back by
    :func:`decode` - the same checks (each field's range and type, the size, the
    invariants), so that a writer never puts what its readers would refuse
    (:class:`MessageError` otherwise, with ``field`` set where one field is wrong)."""
    text = encode(msg)
    decode(type(msg), text)
    return text


def field_range(cls: type, name: str) -> tuple[float, float]:
    """The bounds ``within`` declares for field ``name`` of message class ``cls``: for
    those who check a value before it becomes a message (the command line)."""
    for f in dataclasses.fields(cls):
        if f.name == name and "range" in f.metadata:
            return f.metadata["range"]
    raise KeyError(f"{cls.__name__}.{name} declares no range")


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], tuple[dataclasses.Field, ...]]:
    """A message class's field types and fields: resolved once per class (resolving the
    annotations was most of a decode's time; a coordinator decodes thousands per round)."""
    return typing.get_type_hints(cls), dataclasses.fields(cls)


def _depth(text: str) -> int:
    """How deep ``text``'s JSON nests (brackets outside strings), before parsing it: a
    deeply nested value would exhaust the parser's recursion."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # (fast: most values)
        return 0
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _check(value: Any, meta: typing.Mapping[str, Any], where: str) -> None:
    """A field's declared range / name rule, applied to each number / name in it."""
    if value is None:
        return
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, tuple) else (value,)
    if "range" in meta:
        lo, hi = meta["range"]
        for item in items:
            if not lo <= item <= hi:
                raise MessageError(f"{where}: {item!r} is outside [{lo:g}, {hi:g}]")
    if meta.get("name"):
        for item in items:
            if not keys.NAME.fullmatch(item):
                raise MessageError(f"{where}: {str(item)[:80]!r} is not a valid name")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is tuple:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        item_types = args[:1] * len(value) if args[-1] is Ellipsis else args
        if len(item_types) != len(value):
            raise MessageError(f"{where}: expected {len(item_types)} items")
        return tuple(_coerce(v, t, where) for v, t in zip(value, item_types, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        return {str(k): _coerce(v, args[1], where) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MessageError(f"{where}: expected a number")
        if (isinstance(value, int) and abs(value) > MAX_INT) or not math.isfinite(value):
            raise MessageError(f"{where}: {value!r} is not a finite number in range")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageError(f"{where}: expected an integer")
        if abs(value) > MAX_INT:
            raise MessageError(f"{where}: {value} is out of range")
        return value
    if tp in (str, bool) and not isinstance(value, tp):
        raise MessageError(f"{where}: expected {tp.__name__}")
    return value


class ValueLog:
    """One service's reader of store values: decodes through :func:`decode`, and logs a
    malformed value once per key and revision (then it is ignored; a fixed value is
    read again). Bounded: it remembers the last ``remember`` bad values."""

    def __init__(self, logger: logging.Logger, remember: int = 4096) -> None:
        self.log, self.remember = logger, remember
        self._said: OrderedDict[tuple[str, int], None] = OrderedDict()

    def read(self, cls: type[M], key: str, value: str, revision: int) -> M | None:
        try:
            return decode(cls, value)
        except MessageError as exc:
            self.bad(key, revision, str(exc))
            return None

    def bad(self, key: str, revision: int, why: str) -> None:
        """Log ``why`` for ``key`` at ``revision``, unless that was said already."""
        if (key, revision) in self._said:
            return
        self._said[(key, revision)] = None
        if len(self._said) > self.remember:
            self._said.popitem(last=False)
        self.log.warning("ignoring malformed %s (revision %d): %s", key[:200], revision,
                         why[:300])
