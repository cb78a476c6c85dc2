"""The coordinator's cluster autoscaler: Pollux's utility rule applied to the live cluster.

Each coordinator round calls :meth:`Autoscaler.round` before the policy runs. Every
``interval`` seconds it decides how many nodes the cluster should have
(:func:`pollux_launch.policy.autoscale.target_nodes`, the utility of each size computed
by solving the round's jobs on that many nodes of the cluster's size with a separate
policy instance, so the live policy's warm start is untouched; the jobs are seen through
:class:`~pollux_launch.policy.autoscale.RuleView`, so ``--autoscale-rule throughput``
solves and scores them by system throughput alone), then:

* grows: a node being drained is kept first (cheaper than a new one); the rest are asked
  of the provisioner, and count as booting until they register (or ``boot_timeout``);
* shrinks: drains the nodes holding the fewest replicas, youngest first, never one
  younger than ``min_lifetime``. A draining node is offered no slots, so the policy moves
  its jobs off live; once no allocation places anything there and its agent runs no
  worker, the provisioner gives it back (its agent stops, its record goes).

Provisioner calls run one at a time on a background thread: a round never waits for
one. A call that fails or hangs (cut off at the provisioner's timeout) is logged once per
distinct error and the next one waits an exponential back-off (up to ten minutes);
scheduling goes on meanwhile. The decision and its reason are written to
``coordinator/autoscale`` (``AutoscaleStatus``) for ``pollux-run status``, its counts
kept current between decisions. The coordinator holds nothing durable: one that takes
over resumes from that record (:meth:`Autoscaler.resume`): booting nodes are not asked
for again, drains go on, node lifetimes restart (so none is released early).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..messages import AutoscaleStatus, NodeInfo
from ..policy import JobInfo, PolicyNode
from ..policy.autoscale import AutoscaleConfig, RuleView, target_nodes, utility
from .provisioners import Provisioner, ProvisionerError

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 600.0
Solve = Callable[[Sequence[JobInfo], Sequence[PolicyNode]], np.ndarray]


class Autoscaler:
    """See the module docstring. ``solve(jobs, nodes)``: an allocation of ``jobs`` on a
    hypothetical cluster (a what-if); ``slots``: GPUs of a new node (default: the largest
    registered node's); ``settle``: seconds after start before the first decision (nodes
    that run already register meanwhile)."""

    def __init__(self, cfg: AutoscaleConfig, provisioner: Provisioner, solve: Solve,
                 clock: Callable[[], float], *, slots: int | None = None,
                 boot_timeout: float = 900.0, settle: float = 10.0) -> None:
        self.cfg, self.provisioner, self.solve, self.clock = cfg, provisioner, solve, clock
        self.slots, self.boot_timeout = slots, boot_timeout
        self.status: AutoscaleStatus | None = None
        self._view = RuleView(cfg.rule)
        self._booting: list[float] = []  # when each node asked for and not joined was asked
        self._draining: dict[str, float] = {}  # node -> since
        self._releasing: set[str] = set()  # handed to the provisioner's down
        self._born: dict[str, float] = {}  # node -> first seen
        self._known: set[str] = set()
        self._resumed_nodes: int | None = None  # nodes the resumed decision saw
        # a coordinator that just started first lets the running nodes register
        self._next = clock() + settle
        self._retry_at = 0.0
        self._backoff = cfg.interval
        self._said: set[str] = set()  # provisioner errors logged already
        self._calls: queue.Queue[tuple[str, object]] = queue.Queue()
        self._lock = threading.Lock()  # the state above: rounds and failed calls change it
        self._busy = threading.Event()  # a call queued or running
        threading.Thread(target=self._serve, name="provisioner", daemon=True).start()

    def resume(self, last: AutoscaleStatus, now: float) -> None:
        """Go on from another coordinator's last decision (``last``, from the store): its
        booting nodes count as asked for at its decision time (they expire
        ``boot_timeout`` after it), its drains go on, and the nodes it saw count as
        known, so only nodes registering beyond them count as booted ones joining.
        Lifetimes restart (a node is never released early)."""
        with self._lock:
            asked = min(last.timestamp, now)
            self._booting = [asked] * last.booting
            self._draining = {name: asked for name in last.draining}
            self._resumed_nodes = last.nodes
            self.status = last

    def max_gpus(self, nodes: Sequence[NodeInfo]) -> int:
        """GPUs of the cluster at its largest (what admission may count on)."""
        slots = self.slots or max((n.slots for n in nodes), default=1)
        return self.cfg.max_nodes * slots

    # -- one coordinator round -------------------------------------------------------------
    def round(self, jobs: Sequence[JobInfo], nodes: Sequence[NodeInfo],
              held: dict[str, dict[str, int]], now: float) -> set[str]:
        """Bookkeeping, release of drained nodes, a decision when due; returns the nodes
        to offer no slots this round (draining)."""
        with self._lock:
            return self._round(jobs, nodes, held, now)

    def _round(self, jobs: Sequence[JobInfo], nodes: Sequence[NodeInfo],
               held: dict[str, dict[str, int]], now: float) -> set[str]:
        present = {n.name: n for n in nodes}
        for name in present:
            self._born.setdefault(name, now)
        joined = len(set(present) - self._known)
        if self._resumed_nodes is not None:  # the first round after resume(): the nodes
            joined = max(0, len(present) - self._resumed_nodes)  # beyond those it saw
            self._resumed_nodes = None
        self._known = set(present)
        self._booting = sorted(self._booting)[joined:]  # the oldest requests came first
        self._booting = [t for t in self._booting if now - t < self.boot_timeout]
        for name in list(self._draining):
            if name not in present:  # released (or gone): forget it
                del self._draining[name]
                self._releasing.discard(name)
                self._born.pop(name, None)
        idle = [n for n in self._draining if n not in self._releasing
                and not held.get(n) and sum(present[n].workers.values()) == 0]
        if idle and self._may_call(now):
            self._releasing.update(idle)
            self._call("down", sorted(idle))
        if now >= self._next:
            self._next = now + self.cfg.interval
            self._decide(jobs, present, held, now)
        else:
            self._refresh_status(len(present))
        return set(self._draining)

    def _refresh_status(self, nodes: int | None = None) -> None:
        """Between decisions the record keeps telling the truth (nodes that joined or
        were released, requests that failed): status shows it, and a successor resumes
        from it."""
        if self.status is not None:
            self.status = dataclasses.replace(
                self.status, nodes=self.status.nodes if nodes is None else nodes,
                booting=len(self._booting), draining=tuple(sorted(self._draining)))

    def _decide(self, jobs: Sequence[JobInfo], present: dict[str, NodeInfo],
                held: dict[str, dict[str, int]], now: float) -> None:
        cfg = self.cfg
        slots = self.slots or max((n.slots for n in present.values()), default=1)
        active = [n for n in present if n not in self._draining]
        current = len(active) + len(self._booting)
        memo: dict[int, float] = {}
        jobs = self._view(jobs)

        def utility_at(k: int) -> float:
            if k not in memo:
                what_if = [PolicyNode(f"what-if-{i}", slots) for i in range(k)]
                alloc = (np.asarray(self.solve(jobs, what_if)) if jobs and k
                         else np.zeros((len(jobs), k), dtype=int))
                memo[k] = utility(jobs, alloc, gpus=k * slots)
            return memo[k]

        target, now_utility = target_nodes(cfg, utility_at, current, has_work=bool(jobs))
        reason = ("utility within the band" if jobs else "no work: the minimum")
        if target > current:
            keep = sorted(self._draining, key=lambda n: -self._draining[n])[:target - current]
            for name in keep:  # a node being drained is the cheapest new one
                if name not in self._releasing:
                    del self._draining[name]
            more = target - current - len(keep)
            if more > 0 and self._may_call(now):
                self._booting += [now] * more
                self._call("up", more)
            if jobs:
                reason = (f"utility {now_utility:.2f} > {cfg.high:.2f}: grow to the largest "
                          f"size whose utility stays >= {cfg.low:.2f}")
            else:
                reason = "fewer nodes than the minimum"
        elif target < current:
            old = [n for n in active if now - self._born.get(n, now) >= cfg.min_lifetime]
            order = sorted(old, key=lambda n: (sum(held.get(n, {}).values()),
                                               -self._born.get(n, now), n))
            for name in order[:current - target]:
                self._draining[name] = now
            reason = (f"utility {now_utility:.2f} < {cfg.low:.2f}: shrink" if jobs
                      else "no work: shrink to the minimum")
        if target != current:
            log.info("autoscale: %d -> %d nodes (%s)", current, target, reason)
        self.status = AutoscaleStatus(
            nodes=len(present), target=target, booting=len(self._booting),
            draining=tuple(sorted(self._draining)), utility=max(0.0, now_utility),
            rule=cfg.rule, reason=reason, timestamp=now)

    # -- provisioner calls (background) -----------------------------------------------------
    def _may_call(self, now: float) -> bool:
        return not self._busy.is_set() and now >= self._retry_at

    def _call(self, op: str, arg: object) -> None:
        self._busy.set()
        self._calls.put((op, arg))

    def _serve(self) -> None:
        while True:
            op, arg = self._calls.get()
            try:
                if op == "up":
                    self.provisioner.up(int(arg))  # type: ignore[call-overload]
                else:
                    self.provisioner.down(list(arg))  # type: ignore[call-overload]
                self._backoff = self.cfg.interval
                self._said.clear()
            except ProvisionerError as exc:
                self._failed(op, arg, str(exc))
            except Exception as exc:  # a provisioner's bug must not stop the autoscaler
                self._failed(op, arg, f"{type(exc).__name__}: {exc}")
            finally:
                self._busy.clear()

    def _failed(self, op: str, arg: object, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            log.warning("autoscale: provisioner %s %s failed (%s); retrying in %.0f s",
                        op, arg, why, self._backoff)
        with self._lock:
            self._retry_at = self.clock() + self._backoff
            self._backoff = min(MAX_BACKOFF_S, 2 * self._backoff)
            if op == "up":  # those nodes will not come: the next decision asks again
                gone = int(arg)  # type: ignore[call-overload]
                self._booting = self._booting[:max(0, len(self._booting) - gone)]
                self._refresh_status()
            else:
                self._releasing.difference_update(arg)  # type: ignore[arg-type]
