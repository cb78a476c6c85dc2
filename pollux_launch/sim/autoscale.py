"""Cloud autoscaling in the simulator (Pollux Sec. 4.2.2 and 5.3.3).

:class:`NodePool` is the simulated cloud: node slots ``0..size-1``, each free or held
under a :class:`Lease` from the moment it is requested (it costs money from then on)
until it is released. A requested node *joins* (the policy sees it) at the first round
at or after ``requested + boot_time``. A node to be removed is *drained*: the policy
sees it with 0 slots for one round, which moves its jobs off (each pays its rescale
cost), and it is released at the next round; an empty node is released at once. Cost
is node-hours: the held nodes, booting and draining ones included, integrated over time.

:class:`SimAutoscaler` decides, every ``AutoscaleConfig.interval`` seconds, by
:func:`pollux_launch.policy.autoscale.target_nodes`: ``utility_at(n)`` is the utility
(:func:`~pollux_launch.policy.autoscale.utility`, per GPU of the ``n`` nodes, idle ones
included) of the allocation the scheduling policy picks for the active jobs on ``n``
nodes (where it can place no job at all, e.g. a TunedJobs gang larger than the cluster,
the current size counts as wanting more, as no nodes do in ``target_nodes``). The
what-if solves run on a deep copy of the live policy, so they never touch its warm-start
state, start from the live allocation on the nodes that would be kept (the most loaded
first) and are memoised within a decision. Jobs keep their exploration cap (2x the most
GPUs they have run on) in what-ifs, as the policy would apply it.

The rule (``goodput`` or ``throughput``) sees the jobs through
:class:`~pollux_launch.policy.autoscale.RuleView`: with ``throughput`` the what-if solves
and the utility use system-throughput speedups. The live policy schedules with goodput
either way.

Shrinking releases the emptiest nodes, the youngest first among equals, and never a
node younger than ``min_lifetime`` (counted from when it joined) or one still booting;
while there is work it waits until the nodes of the last growth have joined. Growing
first cancels drains, then requests new nodes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pollux_launch.policy import JobInfo, Policy, PolicyNode
from pollux_launch.policy.autoscale import AutoscaleConfig, RuleView, target_nodes, utility

EPS = 1e-6  # seconds: tolerance on the round grid


@dataclass
class Lease:
    """One node held in the pool: requested (billed) at ``requested``, usable from
    ``ready``, given back at ``released`` (None: still held)."""

    slot: int
    requested: float
    ready: float
    released: float | None = None
    draining: bool = False


class NodePool:
    """The cluster's node slots and their leases (see the module docstring)."""

    def __init__(self, size: int, gpus_per_node: int, initial: int, boot_time: float = 0.0):
        if not 0 <= initial <= size:
            raise ValueError(f"initial nodes {initial} must lie in 0..{size}")
        self.size, self.gpus_per_node, self.boot_time = size, gpus_per_node, float(boot_time)
        self.leases: list[Lease] = []  # every lease ever made, in order
        self._held: dict[int, Lease] = {}
        for slot in range(initial):
            self._lease(slot, 0.0, 0.0)

    def _lease(self, slot: int, requested: float, ready: float) -> None:
        lease = Lease(slot, requested, ready)
        self.leases.append(lease)
        self._held[slot] = lease

    def held(self) -> list[Lease]:
        """Leases held now (booting, ready and draining), by slot."""
        return [self._held[s] for s in sorted(self._held)]

    def visible(self, now: float) -> list[Lease]:
        """Nodes the policy sees this round (joined ones, draining ones included)."""
        return [lease for lease in self.held() if lease.ready <= now + EPS]

    def committed(self) -> list[Lease]:
        """Nodes the cluster keeps: held and not draining (booting ones included)."""
        return [lease for lease in self.held() if not lease.draining]

    def booting(self, now: float) -> int:
        return sum(lease.ready > now + EPS for lease in self._held.values())

    def draining(self) -> int:
        return sum(lease.draining for lease in self._held.values())

    def policy_nodes(self, now: float) -> tuple[list[int], list[PolicyNode]]:
        """Slots of the visible nodes and the nodes as the policy sees them (a draining
        node has 0 slots)."""
        vis = self.visible(now)
        return [lease.slot for lease in vis], [
            PolicyNode(f"node{lease.slot}", 0 if lease.draining else self.gpus_per_node)
            for lease in vis]

    def grow(self, count: int, now: float) -> int:
        """Keep ``count`` more nodes: cancel drains first, then request new nodes (they
        join after the boot time). Returns how many were added."""
        added = 0
        for lease in self.held():
            if added < count and lease.draining:
                lease.draining = False
                added += 1
        free = [s for s in range(self.size) if s not in self._held]
        for slot in free[: count - added]:
            self._lease(slot, now, now + self.boot_time)
            added += 1
        return added

    def shrink(self, count: int, now: float, load: np.ndarray, min_lifetime: float) -> int:
        """Remove up to ``count`` joined nodes at least ``min_lifetime`` old: the emptiest
        (GPUs in use, ``load`` per slot), then the youngest. Empty ones are released now,
        others drain. Returns how many were removed."""
        old = [lease for lease in self.committed()
               if lease.ready <= now + EPS and now - lease.ready >= min_lifetime - EPS]
        old.sort(key=lambda lease: (int(load[lease.slot]), -lease.ready, -lease.slot))
        for lease in old[:count]:
            if load[lease.slot] == 0:
                self._release(lease, now)
            else:
                lease.draining = True
        return min(count, len(old))

    def release_drained(self, now: float, load: np.ndarray) -> None:
        """Release the draining nodes that are empty now."""
        for lease in self.held():
            if lease.draining and load[lease.slot] == 0:
                self._release(lease, now)

    def _release(self, lease: Lease, now: float) -> None:
        lease.released = now
        del self._held[lease.slot]


class SimAutoscaler:
    """Decides the cluster size every ``cfg.interval`` seconds (module docstring)."""

    def __init__(self, cfg: AutoscaleConfig, policy: Policy, pool: NodePool) -> None:
        self.cfg, self.pool = cfg, pool
        self.whatif = copy.deepcopy(policy)  # never disturbs the live policy's state
        self.next_decision = 0.0
        self.target = len(pool.committed())
        self.utility = float("nan")
        self.decisions = 0
        self.whatif_solves = 0
        self._view = RuleView(cfg.rule)

    def settled(self, now: float) -> bool:
        """Nothing left to do on an idle cluster: at the minimum, none booting/draining."""
        return (len(self.pool.committed()) <= self.cfg.min_nodes
                and not self.pool.booting(now) and not self.pool.draining())

    def step(self, now: float, infos: Sequence[JobInfo], alloc: np.ndarray,
             has_work: bool) -> None:
        """One round before the policy runs: release drained nodes, then decide if due.
        ``alloc``: the live allocation, jobs x slots (before this round's solve)."""
        load = alloc.sum(axis=0) if alloc.size else np.zeros(self.pool.size, dtype=int)
        self.pool.release_drained(now, load)
        if now + EPS < self.next_decision:
            return
        self.next_decision = now + self.cfg.interval
        self.decisions += 1
        kept = self.pool.committed()
        infos = self._view(infos)
        # what-ifs start from the live allocation on the nodes kept, most loaded first
        order = sorted(kept, key=lambda lease: (-int(load[lease.slot]), lease.ready,
                                                lease.slot))
        start = (alloc[:, [lease.slot for lease in order]] if alloc.size
                 else np.zeros((0, len(order)), dtype=int))
        memo: dict[int, tuple[float, int]] = {}  # n -> (utility, GPUs placed)

        def utility_at(n: int) -> float:
            if n not in memo:
                memo[n] = self._utility_at(n, infos, start)
            value, placed = memo[n]
            if n == len(kept) and infos and placed == 0:
                return 1.0  # no job fits on the cluster as it is: the work wants more
            return value

        target, self.utility = target_nodes(self.cfg, utility_at, len(kept), has_work)
        if target < len(kept) and has_work and self.pool.booting(now):
            # The last growth has not joined yet: judge it once it has (else a shrink
            # would drain the running nodes while the requested ones still boot).
            target = len(kept)
        self.target = target
        if target > len(kept):
            self.pool.grow(target - len(kept), now)
        elif target < len(kept):
            self.pool.shrink(len(kept) - target, now, load, self.cfg.min_lifetime)

    def _utility_at(self, n: int, infos: Sequence[JobInfo],
                    start: np.ndarray) -> tuple[float, int]:
        """(utility, GPUs placed) of the policy's allocation on ``n`` nodes."""
        if n <= 0 or not infos:
            return 0.0, 0
        gpn = self.pool.gpus_per_node
        nodes = [PolicyNode(f"whatif{i}", gpn) for i in range(n)]
        cur = np.zeros((len(infos), n), dtype=int)
        k = min(n, start.shape[1])
        cur[:, :k] = start[:, :k]
        self.whatif_solves += 1
        alloc = np.asarray(self.whatif.optimize(infos, nodes, cur), dtype=int)
        return utility(infos, alloc, gpus=n * gpn), int(alloc.sum())
