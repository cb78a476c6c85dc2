"""Rendezvous rounds: the key schema, the messages kept under it, and the pure rule that
decides a round's members and ranks.

Keys (relative to the store's cluster prefix; see ``rendezvous/README.md``)::

    jobs/<job>/allocation                          Allocation (the coordinator)
    jobs/<job>/rdzv/round                          RoundInfo: the round now open or formed
    jobs/<job>/rdzv/workers/<worker>               WorkerInfo, under the worker's lease
    jobs/<job>/rdzv/rounds/<r:08d>/members/<worker> Member, under the worker's lease
    jobs/<job>/rdzv/rounds/<r:08d>/state           RoundState, written once by its rank 0

Everything here is pure: no store, no clock, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pollux_launch import keys
from pollux_launch.messages import MAX_INT, MAX_REPLICAS, MessageError, decode, named, within

REASONS = ("allocation", "failure", "membership")


def check_name(kind: str, name: object) -> str:
    """``name`` if it can be one level of a store key, else a one-line MessageError."""
    if not isinstance(name, str) or not keys.NAME.fullmatch(name):
        raise MessageError(f"bad {kind} {name!r}: use 1-128 characters from "
                           "A-Z a-z 0-9 _ . @ : + -")
    return name


# -- messages (JSON via pollux_launch.messages.encode/decode) ----------------------------

@dataclass(frozen=True)
class RoundInfo:
    """The job's current round, bumped by compare-and-swap by whoever first sees a reason.

    ``nodes`` is the allocation the round serves (one node name per replica);
    ``prev_round``/``prev_members`` name the last *formed* round and its rank order, so
    survivors keep their order and alive-but-absent survivors can be waited for.
    """

    round: int = within(0, MAX_INT)
    alloc_version: int = within(0, MAX_INT)
    nodes: tuple[str, ...] = named()
    reason: str = "allocation"
    prev_round: int = within(0, MAX_INT, 0)
    prev_members: tuple[str, ...] = named(())
    timestamp: float = 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """A live worker (the key vanishes with its lease)."""

    worker: str = named()
    node: str = named()
    addr: str = ""
    pid: int = within(0, MAX_INT, 0)
    timestamp: float = 0.0


@dataclass(frozen=True)
class Member:
    """A worker's join record for one round; ``prev_round`` 0 means a newcomer."""

    worker: str = named()
    node: str = named()
    addr: str = ""
    pid: int = within(0, MAX_INT, 0)
    prev_round: int = within(0, MAX_INT, 0)
    prev_rank: int = within(-1, MAX_REPLICAS, -1)


@dataclass(frozen=True)
class RoundState:
    """A formed round: ``members`` in rank order, the node of each (``nodes``), and where
    rank 0's TCPStore listens."""

    round: int = within(0, MAX_INT)
    alloc_version: int = within(0, MAX_INT)
    members: tuple[str, ...] = named()
    master_addr: str = ""
    master_port: int = within(0, 65535, 0)
    reason: str = "allocation"
    newcomers: tuple[str, ...] = named(())
    timestamp: float = 0.0
    nodes: tuple[str, ...] = named(())


# -- key schema ----------------------------------------------------------------------------

@dataclass(frozen=True)
class JobKeys:
    """The keys of one job's rendezvous."""

    job: str

    def __post_init__(self) -> None:
        check_name("job name", self.job)

    @property
    def prefix(self) -> str:
        return keys.job(self.job)

    @property
    def allocation(self) -> str:
        return keys.job(self.job, "allocation")

    @property
    def hints(self) -> str:
        return keys.job(self.job, "hints")

    @property
    def restarts(self) -> str:
        return keys.job(self.job, "restarts")

    @property
    def rdzv(self) -> str:
        return keys.job(self.job, "rdzv/")

    @property
    def round(self) -> str:
        return self.rdzv + "round"

    @property
    def workers(self) -> str:
        return self.rdzv + "workers/"

    def worker(self, worker: str) -> str:
        return self.workers + worker

    def round_prefix(self, r: int) -> str:
        return f"{self.rdzv}rounds/{r:08d}/"

    def members(self, r: int) -> str:
        return self.round_prefix(r) + "members/"

    def member(self, r: int, worker: str) -> str:
        return self.members(r) + worker

    def state(self, r: int) -> str:
        return self.round_prefix(r) + "state"


def last_formed(job: JobKeys, values: Mapping[str, str]) -> RoundState | None:
    """The job's last formed round in ``values`` (store key -> value, e.g. one read of the
    job's prefix): the round its pointer names once formed, else the formed one before
    it; None before any round formed. Raises MessageError on a malformed value."""
    if job.round not in values:
        return None
    ptr = decode(RoundInfo, values[job.round])
    for r in (ptr.round, ptr.prev_round):
        if r and job.state(r) in values:
            return decode(RoundState, values[job.state(r)])
    return None


# -- who is in a round, in which rank order ------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """``ranked``: the members the round should have, rank 0 first (may include alive
    survivors that have not joined yet); ``ready``: every one of them joined and the round
    is as full as it will get, so rank 0 may close it now."""

    ranked: tuple[str, ...]
    ready: bool

    @property
    def closer(self) -> str | None:
        return self.ranked[0] if self.ranked else None


def plan_round(
    info: RoundInfo,
    joined: Sequence[tuple[str, str, int]],
    alive: Mapping[str, str],
) -> Plan:
    """Decide a round's rank order from who joined and who is alive.

    ``joined``: (worker, node, create_revision of its member key); ``alive``: worker ->
    node of every worker whose lease is live. Order: survivors of the previous round in
    their old rank order (so rank 0 survives whenever it is alive and allocated), then
    newcomers in join order; each takes a replica slot on its node (``info.nodes``) while
    any is left. A round is ready when everyone ranked has joined and it is full - or,
    for a repair round ("failure": a member died; "membership": a worker fills a vacancy),
    when no live survivor is missing (other newcomers are not awaited).
    """
    slots = Counter(info.nodes)
    joined_node = {w: n for w, n, _ in joined}
    survivors = [w for w in info.prev_members if w in joined_node or w in alive]
    newcomers = [w for w, _, _ in sorted(joined, key=lambda j: (j[2], j[0]))
                 if w not in info.prev_members]
    ranked = []
    for w in survivors + newcomers:
        node = joined_node.get(w, alive.get(w))
        if node is not None and slots[node] > 0:
            slots[node] -= 1
            ranked.append(w)
    all_joined = all(w in joined_node for w in ranked)
    full = len(ranked) == len(info.nodes) or info.reason != "allocation"
    return Plan(tuple(ranked), all_joined and full and bool(ranked))
