"""Keeping a live job's training state: a target allocation leaves every running job a
replica on a node whose worker holds the job's state.

A live job rescales without checkpoints: its state lives in the memory of its workers,
and the *holders* are the members of its latest formed rendezvous round whose lease is
still alive (a freshly started worker that has not formed a round yet holds nothing).
A new round keeps a holder only if the allocation leaves it a slot on its node
(``rendezvous.rounds.plan_round``); a round of newcomers only starts training over
(``Rendezvous._restarted``). Policies choose replica counts per node without knowing
which replica holds state, so a shrink from [A, B] to one replica may keep the empty
newcomer on B and drop A, the only holder.

The rule (:func:`keep_holders`): a job is *stranded* when it has holders, its target row
keeps at least one replica, and none of them on a node where it has holders. For each
stranded job (fewest holder nodes first, then job order), target replicas of it move
from one node without holders onto a holder node ``h``:

1. into free slots of ``h`` in the target (column sum below its slots), or
2. by swapping with another job's replicas that are *new* on ``h`` this round (its target
   there exceeds both its current replicas and its own holders there): they take the
   stranded job's place on the node it leaves.

As many move as fit, up to all the job has on that node (so that a job the policy moved
whole, e.g. re-packed on other nodes because its count changed, goes back whole rather
than spread over two nodes). Row sums never change (every job keeps its replica count:
its limits hold), column sums grow only into free slots (never beyond a node's slots),
a job that may not be changed (``movable`` False: e.g. non-preemptible and running) is
left alone, and no other job loses a replica covering one of its holders. Preferred: a
move that spreads neither job over more nodes, into free slots before a swap; else the
move that spreads them least (state comes first: interference avoidance is kept where a
move allows it), free slots first, the most replicas, the roomiest holder node; ties go
to the lowest indices. A job stays stranded when no move exists (every holder node is
full of replicas that were already running there, or has no slots, e.g. it is being
drained): the target is left as the policy chose it, and the caller says so. Greedy,
one job at a time, repeated while a move opens a way for a job that had none: the
result is maximal (no stranded job has a move left), not a best matching over several
stranded jobs competing for the same room.

Pure: arrays in, arrays out; vectorised over jobs and nodes (the per-job loop runs only
over the stranded jobs, usually none or few).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HolderRepair:
    """``target``: the repaired ``(J, N)`` matrix; ``moved``: jobs the repair gave back a
    holder node; ``stranded``: jobs that still keep none of their holders (no move
    existed)."""

    target: np.ndarray
    moved: np.ndarray
    stranded: np.ndarray


def stranded_jobs(target: np.ndarray, holders: np.ndarray) -> np.ndarray:
    """``(J,)`` bool: jobs with holders whose target keeps replicas, none on a holder node."""
    target, has = np.asarray(target), np.asarray(holders) > 0
    return has.any(axis=1) & (target.sum(axis=1) > 0) & ~((target > 0) & has).any(axis=1)


def keep_holders(target: np.ndarray, current: np.ndarray, holders: np.ndarray,
                 slots: np.ndarray, movable: np.ndarray | None = None) -> HolderRepair:
    """Repair ``target`` so that stranded jobs keep a replica on a holder node (the rule
    in the module docstring). ``current``: the allocation in force; ``holders``: per job
    and node, the workers there that hold the job's state; ``slots``: each node's slots
    as offered to the policy; ``movable``: jobs whose row may change (default all)."""
    out = np.array(target, dtype=np.int64)
    cur = np.asarray(current, dtype=np.int64)
    hold = np.asarray(holders, dtype=np.int64)
    cap = np.asarray(slots, dtype=np.int64)
    J, N = out.shape if out.ndim == 2 else (-1, -1)
    if out.ndim != 2 or cur.shape != out.shape or hold.shape != out.shape or cap.shape != (N,):
        raise ValueError(f"target {np.shape(target)}, current {np.shape(current)}, holders "
                         f"{np.shape(holders)} must be (jobs, nodes) and slots (nodes,), "
                         f"got slots {np.shape(slots)}")
    ok = np.ones(J, dtype=bool) if movable is None else np.asarray(movable, dtype=bool)
    if ok.shape != (J,):
        raise ValueError(f"movable has shape {ok.shape}, expected ({J},)")
    before = stranded_jobs(out, hold)
    todo = np.flatnonzero(before & ok)
    # fewest holder nodes first: they have the fewest ways out
    todo = todo[np.argsort(np.count_nonzero(hold[todo] > 0, axis=1), kind="stable")]
    used = out.sum(axis=0)
    while todo.size:  # a move may open a way for a job that had none: until none moves
        done = np.array([_move_one(out, used, cur, hold, cap, ok, int(j)) for j in todo])
        # (a swap may also have landed a job on one of its holder nodes)
        todo = todo[~done & stranded_jobs(out[todo], hold[todo])] if done.any() else todo[:0]
    after = stranded_jobs(out, hold)
    return HolderRepair(out, before & ~after, after)


def _move_one(out: np.ndarray, used: np.ndarray, cur: np.ndarray, hold: np.ndarray,
              cap: np.ndarray, ok: np.ndarray, j: int) -> bool:
    """Move replicas of job ``j`` from one node onto one of its holder nodes, in place
    (``used``: the column sums of ``out``), if it is stranded; False when it is not or no
    move exists."""
    row, has = out[j], hold[j] > 0
    if not row.any() or (row[has] > 0).any():
        return False
    H, M = np.flatnonzero(has), np.flatnonzero(row > 0)  # (no replica on a holder node)
    room = cap[H] - used[H]
    # free slots: (holder node h, source m), as many replicas as fit
    fh = np.repeat(np.flatnonzero(room > 0), M.size)
    fm = np.tile(M, fh.size // max(M.size, 1))
    ft = np.minimum(room[fh], row[fm])
    fspread = (ft < row[fm]).astype(np.int64)  # j stays on m too: it spreads
    if fh.size and not fspread.all():  # j moves whole: neither job spreads
        best = np.lexsort((fm, fh, -room[fh], -ft, fspread))[0]  # (last key is primary)
        return _apply(out, used, j, -1, int(H[fh[best]]), int(fm[best]), int(ft[best]))
    # swaps: (partner k, holder node h, source m), as many as k has new there
    spare = out[:, H] - np.maximum(cur[:, H], hold[:, H])  # new there, beyond its holders
    spare[j] = 0
    spare[~ok] = 0
    ks, hs = np.nonzero(spare > 0)
    sk, sh = np.repeat(ks, M.size), np.repeat(hs, M.size)
    sm = np.tile(M, ks.size)
    st = np.minimum(spare[sk, sh], row[sm])
    # both jobs' spread: j stays on m too; k lands on a node new to it, or leaves h
    sspread = (st < row[sm]) + (out[sk, sm] == 0).astype(np.int64) - (st == out[sk, H[sh]])
    kind = np.concatenate([np.zeros(fh.size, dtype=np.int64), np.ones(sk.size, np.int64)])
    if kind.size == 0:
        return False
    k_all = np.concatenate([np.full(fh.size, -1), sk])
    h_all = np.concatenate([fh, sh])
    m_all = np.concatenate([fm, sm])
    t_all = np.concatenate([ft, st])
    spread = np.concatenate([fspread, sspread])
    best = np.lexsort((m_all, h_all, k_all, -t_all, kind, spread))[0]
    return _apply(out, used, j, int(k_all[best]), int(H[h_all[best]]), int(m_all[best]),
                  int(t_all[best]))


def _apply(out: np.ndarray, used: np.ndarray, j: int, k: int, h: int, m: int, t: int) -> bool:
    """``t`` replicas of job ``j`` from node ``m`` to ``h``; with ``k`` >= 0, ``t`` of job
    ``k``'s from ``h`` to ``m`` (a swap), else into free slots."""
    out[j, h] += t
    out[j, m] -= t
    if k >= 0:
        out[k, h] -= t
        out[k, m] += t
    else:
        used[h] += t
        used[m] -= t
    return True
