"""Messages exchanged through the store: small frozen dataclasses serialised to JSON.

Every message carries a schema version ``v``. Nothing read from the store is ever
unpickled or evaluated: :func:`decode` parses JSON, checks the schema version and the
field types, and raises :class:`MessageError` (a ``ValueError``) on anything malformed.

Who writes what (key schema in ``rendezvous/README.md``):

* ``JobSpec``    - written once by ``pollux-run`` when a job is submitted.
* ``JobHints``   - written by the job's rank-0 agent every ~30 s: what the policy needs.
* ``Allocation`` - written by the coordinator; one node name per replica, with a version
  number that increases with every change (one rendezvous round per version).
* ``NodeInfo``   - written by each node agent under a lease.
* ``JobStatus``  - the job's lifecycle state, written by whoever learns of a change
  (``pollux-run`` or a node agent when workers exit, ``pollux-run cancel``).
* ``JobRestarts`` - how often the job started again after all its workers died, and the
  progress lost (the rendezvous' rank 0).
* ``WorkerTask`` / ``TaskExit`` - a Horovod worker a job's launcher asks a node's agent to
  run, and how it ended (``adapters/horovod/tasks.py``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

SCHEMA_VERSION = 1

M = TypeVar("M")


class MessageError(ValueError):
    """A value read from the store is not a well-formed message."""


@dataclass(frozen=True)
class JobSpec:
    """What a job is and how it may be scaled (written once, at submission)."""

    name: str
    command: tuple[str, ...]
    framework: str = "torch"
    initial_replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1_000_000
    preemptible: bool = True
    submit_time: float = 0.0
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobHints:
    """The job's rank-0 agent's view of itself, enough for the policy (Pollux Sec. 4.1).

    ``perf_params`` holds the fitted throughput-model parameters by name (see
    ``pollux_launch.goodput.PerfParams``); ``grad_sqr``/``grad_var`` are the gradient
    statistics normalised to ``init_batch_size`` (Pollux Eqn 4-6).
    """

    init_batch_size: int
    max_batch_size: int
    local_bsz_bounds: tuple[int, int]
    gradient_accumulation: bool = True
    adaptive_batch_size: bool = True
    perf_params: dict[str, float] | None = None
    grad_sqr: float | None = None
    grad_var: float | None = None
    max_profiled_replicas: int = 0
    max_profiled_nodes: int = 0
    num_nodes: int = 0
    num_replicas: int = 0
    local_bsz: int = 0
    accum_steps: int = 0
    progress: float = 0.0
    restarts: int = 0
    timestamp: float = 0.0


@dataclass(frozen=True)
class Allocation:
    """The coordinator's decision for one job: one node name per replica.

    ``term`` is the writing coordinator's leadership term (the create revision of its
    ``coordinator/leader`` key): allocations are ordered by ``(term, version)``, and a
    reader that has seen one never goes back to an older one (``pollux_launch.fencing``).
    """

    version: int
    nodes: tuple[str, ...]
    timestamp: float = 0.0
    term: int = 0

    @property
    def order(self) -> tuple[int, int]:
        return (self.term, self.version)

    @property
    def num_replicas(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))


@dataclass(frozen=True)
class NodeInfo:
    """A node agent's registration (kept under its lease). ``workers``: the agent's own
    view of the processes it runs, per job (each holds a slot until it has exited)."""

    name: str
    slots: int
    address: str = "127.0.0.1"
    timestamp: float = 0.0
    workers: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerTask:
    """A process a job's launcher-side driver asks one node to run (Horovod's workers):
    the job's own command, with Horovod's variables for this slot."""

    node: str
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    index: int = 0


@dataclass(frozen=True)
class TaskExit:
    """How a ``WorkerTask``'s process ended, written by the node agent that ran it."""

    code: int


@dataclass(frozen=True)
class JobRestarts:
    """Times every worker of the job had died and it started again, and the statistical
    progress (``JobHints.progress``, iterations at the initial batch size) those restarts
    lost. Written by the rank 0 of the round that restarted it: first as if from scratch
    (all the progress last reported), then - once that rank 0 resumed from a durable
    checkpoint - less the checkpoint's progress (``resumed``: the restarts so credited)."""

    count: int
    lost_progress: float = 0.0
    timestamp: float = 0.0
    resumed: int = 0


JOB_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
FINISHED_STATES = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class JobStatus:
    """``state`` is one of JOB_STATES; ``exit_code`` is set once the job finished."""

    state: str
    exit_code: int | None = None
    message: str = ""
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        if self.state not in JOB_STATES:
            raise MessageError(f"JobStatus.state must be one of {JOB_STATES}, got {self.state!r}")

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES


def encode(msg: Any) -> str:
    """Serialise a message dataclass to compact JSON with its schema version."""
    body = dataclasses.asdict(msg)
    body["v"] = SCHEMA_VERSION
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def decode(cls: type[M], raw: str | bytes) -> M:
    """Parse and validate ``raw`` as a ``cls`` message; :class:`MessageError` if malformed."""
    name = cls.__name__
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise MessageError(f"{name}: expected a JSON object, got {type(body).__name__}")
    if body.pop("v", None) != SCHEMA_VERSION:
        raise MessageError(f"{name}: unsupported schema version (expected v={SCHEMA_VERSION})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{name}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _coerce(body.pop(f.name), hints[f.name], f"{name}.{f.name}")
    if body:
        raise MessageError(f"{name}: unknown field(s) {sorted(body)}")
    return cls(**kwargs)


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
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageError(f"{where}: expected an integer")
        return value
    if tp in (str, bool) and not isinstance(value, tp):
        raise MessageError(f"{where}: expected {tp.__name__}")
    return value
