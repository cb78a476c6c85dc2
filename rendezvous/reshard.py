"""Re-sharding row-sharded state in place when a job's group changes.

A tensor sharded on dim 0 over a group of ``W`` ranks - FSDP2's parameters and their
optimizer state, ZeRO-3's flat partitions (rows of one element) - is split as
``torch.chunk`` splits it: with ``c = ceil(n / W)``, rank ``i`` holds rows
``[i c, min((i + 1) c, n))`` (possibly none). When the group changes, each rank of the
new group needs the rows of its new shard; they are assembled from the overlapping
slices of the old shards, point to point: only rows a rank lacks move, and no rank ever
holds more than its old shard, its new shard and (rarely) the rows it keeps for a
newcomer.

A leaver and a newcomer share no group, so the exchange has two phases:

1. ``before`` - on the old group (survivors and leavers), once the new round is known
   and before the leavers go: every survivor receives the rows of its new shard it
   lacks; rows that only a leaver holds and a newcomer needs go to a survivor, which
   keeps them ("staged") for phase 2;
2. ``after`` - on the new group (survivors and newcomers): every newcomer receives its
   shard from the survivors holding those rows (their old shard, what they staged, or
   their new shard).

Planning (:func:`plan_rows`) is pure and names workers, not ranks: the same plan on every
rank. :func:`exchange` runs one phase's moves for many tensors at once (non-blocking
sends and receives straight from and into the shards' row ranges: nothing is packed).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Holding", "Move", "ReshardPlan", "exchange", "plan_rows", "shard_rows"]

OLD, NEW, STAGED = "old", "new", "staged"


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of ``n`` that rank ``rank`` of ``world`` holds
    (``torch.chunk``'s split; empty past the last chunk)."""
    c = -(-n // world) if n else 0
    return min(rank * c, n), min((rank + 1) * c, n)


@dataclass(frozen=True)
class Move:
    """Rows ``[start, stop)`` from ``src``'s ``src_kind`` holding to ``dst``'s
    ``dst_kind`` one (kinds: "old", "new", "staged"); ``src == dst`` is a local copy."""

    src: str
    dst: str
    start: int
    stop: int
    src_kind: str = OLD
    dst_kind: str = NEW


@dataclass(frozen=True)
class ReshardPlan:
    """The moves of both phases for one tensor of ``n`` rows, and the row ranges each
    survivor stages for phase 2."""

    n: int
    before: tuple[Move, ...]
    after: tuple[Move, ...]
    staged: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _subtract(span: tuple[int, int], covers: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``span`` less every range of ``covers``."""
    out, pos = [], span[0]
    for lo, hi in sorted(c for c in covers if c[0] < c[1]):
        if hi <= pos or lo >= span[1]:
            continue
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, hi)
    if pos < span[1]:
        out.append((pos, span[1]))
    return out


@functools.lru_cache(maxsize=4096)
def plan_rows(n: int, old: tuple[str, ...], new: tuple[str, ...]) -> ReshardPlan:
    """The moves that turn ``old``'s shards of ``n`` rows into ``new``'s (workers in rank
    order; a worker in both is a survivor). Raises ValueError when no worker survives
    (nothing can move: the state comes from a checkpoint)."""
    survivors = [w for w in new if w in old]
    if not survivors:
        raise ValueError("no worker of the old group is in the new one: nothing to re-shard")
    held = {w: shard_rows(n, len(old), i) for i, w in enumerate(old)}
    want = {w: shard_rows(n, len(new), i) for i, w in enumerate(new)}
    before: list[Move] = []
    for s in survivors:  # a survivor's new shard from every old shard that overlaps it
        for h in old:
            ov = _overlap(want[s], held[h])
            if ov:
                before.append(Move(h, s, *ov))
    # what newcomers need that only leavers hold: staged at a survivor, round robin
    staged: dict[str, list[tuple[int, int]]] = {s: [] for s in survivors}
    kept = [held[s] for s in survivors] + [want[s] for s in survivors]
    leavers = [w for w in old if w not in new]
    newcomers = [w for w in new if w not in old]
    for k, w in enumerate(newcomers):
        keeper = survivors[k % len(survivors)]
        for lo, hi in _subtract(want[w], kept):
            for h in leavers:
                ov = _overlap((lo, hi), held[h])
                if ov:
                    before.append(Move(h, keeper, *ov, dst_kind=STAGED))
                    staged[keeper].append(ov)
    # phase 2: every newcomer's rows from a survivor that has them, old shards first
    sources = ([(held[s], s, OLD) for s in survivors]
               + [(r, s, STAGED) for s in survivors for r in staged[s]]
               + [(want[s], s, NEW) for s in survivors])
    after: list[Move] = []
    for w in newcomers:
        for lo, hi in _subtract(want[w], []):
            pos = lo
            while pos < hi:
                best = max((src for src in sources if src[0][0] <= pos < src[0][1]),
                           key=lambda src: src[0][1], default=None)
                if best is None:  # cannot happen: every row is held by someone
                    raise AssertionError(f"row {pos} of {n} has no holder")
                stop = min(hi, best[0][1])
                after.append(Move(best[1], w, pos, stop, src_kind=best[2]))
                pos = stop
    return ReshardPlan(n, tuple(before), tuple(after),
                       {s: tuple(r) for s, r in staged.items() if r})


@dataclass
class Holding:
    """What one rank has of one tensor during a re-shard: its old shard (rows
    ``old_start`` on), its new shard to fill (rows ``new_start`` on) and what it stages
    (a tensor per row range). Row ``r`` of a holding is ``tensor[r - start]``."""

    old: torch.Tensor | None = None
    old_start: int = 0
    new: torch.Tensor | None = None
    new_start: int = 0
    staged: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        """The view of rows ``[start, stop)`` in this rank's ``kind`` holding."""
        if kind == STAGED:
            for (lo, hi), t in self.staged.items():
                if lo <= start and stop <= hi:
                    return t[start - lo: stop - lo]
            raise KeyError(f"rows {start}:{stop} are not staged here")
        t, base = (self.old, self.old_start) if kind == OLD else (self.new, self.new_start)
        if t is None:
            raise KeyError(f"no {kind} shard here")
        return t[start - base: stop - base]


def exchange(moves: Sequence[tuple[str, Move]], holdings: Mapping[str, Holding], me: str,
             rank_of: Mapping[str, int], group: dist.ProcessGroup | None = None) -> int:
    """Run one phase: ``moves`` are ``(tensor key, move)`` pairs, in the same order on
    every rank; ``holdings`` this rank's per key (staged ranges it receives into are
    allocated here); ``rank_of`` maps a worker to its rank in ``group``. Returns the
    bytes this rank received. Every rank of ``group`` calls it; raises what the
    process group raises when a peer fails."""
    ops: list[dist.P2POp] = []
    received = 0
    for key, mv in moves:
        if me not in (mv.src, mv.dst):
            continue
        h = holdings[key]
        if mv.dst == me and mv.dst_kind == STAGED and (mv.start, mv.stop) not in h.staged:
            src_t = h.old if h.old is not None else h.new
            assert src_t is not None
            h.staged[(mv.start, mv.stop)] = src_t.new_empty(
                (mv.stop - mv.start, *src_t.shape[1:]))
        if mv.src == mv.dst:
            h.rows(mv.dst_kind, mv.start, mv.stop).copy_(
                h.rows(mv.src_kind, mv.start, mv.stop))
        elif mv.src == me:
            ops.append(dist.P2POp(dist.isend, h.rows(mv.src_kind, mv.start, mv.stop),
                                  rank_of[mv.dst], group))
        else:
            buf = h.rows(mv.dst_kind, mv.start, mv.stop)
            received += buf.numel() * buf.element_size()
            ops.append(dist.P2POp(dist.irecv, buf, rank_of[mv.src], group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received
