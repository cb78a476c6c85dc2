"""``ElasticController``: the step boundary of an elastic job, for every framework adapter.

The torch ``ElasticTrainer``, DeepSpeed's ``ElasticDeepSpeed`` and Horovod's
``HorovodControl`` each drive one controller. What is specific to a framework lives
behind :class:`FrameworkHooks`; the group it runs on behind :class:`Collectives`; how
the group changes behind :class:`Membership` (pollux's rendezvous - Horovod re-forms its
groups itself and passes none).

Protocol, identical on every replica. ``after_step(batch_size)`` follows every optimiser
step: it counts the step and its statistical progress (Pollux Sec. 3.1), then

1. SIGTERM seen (only with a checkpoint directory): rank 0 writes a final checkpoint and
   the worker ends by that same signal; where the state is spread over the ranks
   (shards, ZeRO partitions: ``hooks.checkpoint_needs_peers``) the rank says so at the
   next vote (3; a static job of such state votes on this alone), every rank writes the
   final checkpoint, and the ranks that got the signal end by it;
2. a decision broadcast a due checkpoint: every rank captures its state (a collective
   for ZeRO partitions) and rank 0 writes it in the background;
3. every ``check_every`` steps (about 50 ms of training) the replicas vote - one 8-byte
   all-reduce - on re-forming (and on ending, 1); a rank votes yes when its rendezvous
   saw a new allocation
   (for a grow: once the newcomers registered, at most ``grow_grace`` later), a newer
   round or a dead peer. Then: ``hooks.capture`` on the old group, the next round (a
   worker not in it leaves with exit status 0), ``hooks.rebuild`` on the new one
   (newcomers receive the state, this controller's included), a forced decision;
4. every ``decide_every`` steps, or when the group's size changed underneath (a Horovod
   reset that only removed workers): a decision. With a ``decision_budget`` (what a
   job gets when it leaves ``decide_every`` unset) ``decide_every`` is the least number
   of steps between decisions: rank 0 times its decisions and spaces them so that they
   cost at most that fraction of the training time between them (a host-bound step of a
   few hundred microseconds would otherwise spend several percent deciding), and
   broadcasts the next one's step with each decision.

Idle steps. Where the group changes only through this controller (``skip_idle``: the
torch trainer's), a boundary that ends its work plans how many of the next ones will have
nothing due - no decision, no vote, no policy acting on every step (``idle_safe``), no
new round's first step - from step counts alone, so the same on every rank; those cost
one attribute test each, and the next full boundary times them all (their mean step).
A new group, a loaded state and SIGTERM cancel the plan.

Adaptation policies (:mod:`.adaptation`, KungFu's APs; by default only Pollux's
``GoodputPolicy``) run on every rank: ``after_step`` at every boundary before 3-4,
``on_rescale`` for every new group (and on a leaving worker), ``before_epoch`` /
``after_epoch`` around the epochs of ``epochs()``, each followed by a decision.

A decision: rank 0 takes its policies' pending proposals - the goodput policy's per-GPU
batch m and accumulation steps s for the allocation (Pollux Eqn 13), a user policy's
batch, LR factor, replica request or stop - and adds the LR factor of the total batch
``K m (s+1)`` (AdaScale, or the configured rule) unless a policy fixed it, the vote
interval and whether a checkpoint is due, and reports the job's hints when due (after
the first step of a new round, never inside its pause; at once when the replica request
changed). One broadcast of a :class:`Decision`; every rank applies it, and every rank
uses rank 0's LR factor until the next decision.

A collective that fails because a peer died (:func:`~.failures.is_peer_failure`) makes
the survivors form a failure round and take rank 0's state (``recover``); the step in
flight is dropped. A fresh round - every member new: the job's start, or all its workers
died - resumes from the newest checkpoint when the job has a checkpoint directory.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pollux_launch import env as envvars
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.hooks import IDLE_MAX
from pollux_launch.tuning.sync_points import SyncPoints
from pollux_launch.tuning.tuner import GoodputTuner

from .adaptation import AdaptationPolicy, GoodputPolicy, PolicyContext, fit_total, resolve_batch
from .checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint
from .failures import StateLost, first_line, is_peer_failure
from .hints import HintsReporter
from .protocols import Collectives, FrameworkHooks, MemberRemoved, Membership

log = logging.getLogger(__name__)

STATE_VERSION = 1
VOTE_PERIOD_S = 0.05  # vote about every 50 ms of training: cheap, rescales start promptly
DEFAULT_DECIDE_EVERY = 20  # steps between decisions (at least, with a budget)
DECISION_BUDGET = 0.005  # decisions may cost this fraction of training time (default)
DECISION_MAX_S = 5.0  # ...but come at least this often (seconds of training)


class LeaveJob(SystemExit):
    """This worker is not in the job's new round: it ends with status 0.

    A ``SystemExit``, not a ``PolluxError``: leaving is the worker's normal end (exit
    status 0, through the script's ``except Exception`` and ``finally`` alike), no error.
    """

    def __init__(self) -> None:
        super().__init__(0)


@dataclass(frozen=True)
class Decision:
    """What rank 0 decided, applied by every rank at the same step boundary.

    ``replicas``: the policies' replica request ``(lo, hi)`` (``hi`` 0: no upper bound),
    None for none; ``lr_fixed``: a policy set ``lr_factor`` (it stays until one resets it).
    """

    local_bsz: int
    accum_steps: int
    check_every: int
    lr_factor: float
    checkpoint: bool = False
    stop: bool = False
    replicas: tuple[int, int] | None = None
    lr_fixed: bool = False
    decide_in: int = 1  # steps until the next decision (with a decision budget)

    SIZE = 10

    def to_tensor(self) -> torch.Tensor:
        lo, hi = self.replicas or (0, 0)
        return torch.tensor([self.local_bsz, self.accum_steps, self.check_every,
                             self.lr_factor, float(self.checkpoint), float(self.stop), lo, hi,
                             float(self.lr_fixed), self.decide_in], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Decision:
        m, s, check, factor, ckpt, stop, lo, hi, fixed, later = (
            float(v) for v in t.cpu().tolist())
        if not (m >= 1 and s >= 0 and check >= 1 and math.isfinite(factor) and factor > 0
                and lo >= 0 and hi >= 0 and (hi == 0 or hi >= lo) and later >= 1):
            raise ValueError(f"malformed decision from rank 0: {t.tolist()}")
        return cls(int(m), int(s), int(check), factor, ckpt > 0, stop > 0,
                   (int(lo), int(hi)) if lo > 0 else None, fixed > 0, int(later))


def recent_pause(rescales: list[dict[str, Any]], last: int = 5) -> float | None:
    """The dearest survivors' pause of the last ``last`` allocation-driven rescales (a grow
    costs more than a shrink: the policy's delta is what a change may cost), or None."""
    pauses = [r["pause_s"] for r in rescales if r.get("reason") == "allocation"
              and isinstance(r.get("pause_s"), float)]
    return max(pauses[-last:]) if pauses else None


class ElasticController:
    """Drives one job's step boundaries (module docstring).

    ``loader``: a pollux ``AdaptiveDataLoader`` (its position travels with the state and
    its batch follows decisions), or None; ``adapt_lr``: False keeps the LR factor at 1
    (unless a policy sets one); ``policies``: the adaptation policies in order (None:
    ``[GoodputPolicy()]``, Pollux's agent); ``decision_budget``: space decisions by
    their cost (module docstring, 4), None: exactly every ``decide_every`` steps;
    ``sync_points``: the count of scheduled points to add to (an adapter's own, whose
    resets read values too), else a new one.
    """

    def __init__(self, hooks: FrameworkHooks, tuner: GoodputTuner, group: Collectives, *,
                 membership: Membership | None = None, reporter: HintsReporter | None = None,
                 loader: Any = None, decide_every: int = DEFAULT_DECIDE_EVERY,
                 adapt_lr: bool = True,
                 checkpoints: CheckpointWriter | None = None,
                 policies: Sequence[AdaptationPolicy] | None = None,
                 decision_budget: float | None = None,
                 sync_points: SyncPoints | None = None) -> None:
        if decide_every < 1:
            raise ValueError(f"decide_every must be >= 1, got {decide_every}")
        if decision_budget is not None and not 0 < decision_budget < 1:
            raise ValueError(f"decision_budget must be in (0, 1), got {decision_budget}")
        self.hooks, self.tuner, self.group = hooks, tuner, group
        self.membership, self.reporter, self.loader = membership, reporter, loader
        self.decide_every, self.check_every = decide_every, 1
        self.decision_budget = decision_budget
        self._decide_at = decide_every  # the step of the next decision (with a budget)
        self._decision_cost: float | None = None  # rank 0's, smoothed (seconds)
        self._decisions_timed = 0
        self.adapt_lr = adapt_lr
        self.checkpoints = checkpoints
        self.steps = 0  # optimiser steps of the job (travels with the state)
        self.resets = 0  # new groups the job went through (travels with the state)
        self.lr_factor = 1.0
        self.resumed_from: float | None = None  # the checkpoint's progress, if one was loaded
        self.rescales: list[dict[str, Any]] = []  # timings of re-forms (benchmarks, logs)
        self._grad: GradNoise | None = None
        self._decided_size = 0
        self._report_pending = False
        self._open_rescale: dict[str, Any] | None = None
        self._terminating = False
        self.policies = list(policies) if policies is not None else [GoodputPolicy()]
        self.ctx = PolicyContext(self)
        # whether steps may go without the policies' after_step (module docstring)
        self.idle_safe = all(p.idle_safe for p in self.policies)
        self.replica_request: tuple[int, int] | None = None  # the policies' (travels)
        self.stopped = False  # a policy stopped training (every rank, same step)
        self.epoch = 0  # the data epoch the policies see
        self.step_time: float | None = None  # this worker's last step (wall, seconds)
        self.throughput: float | None = None  # samples/s of the job, smoothed
        self._lr_fixed = False
        self._t_boundary: float | None = None
        # where the steps may wait for the device, counted (shared with an adapter's own)
        self.sync_points = sync_points if sync_points is not None else SyncPoints()
        self._mean_step: float | None = None  # smoothed step time (the vote interval's)
        # Idle boundaries (module docstring, "Idle steps"): an adapter whose group changes
        # only through this controller sets skip_idle; boundaries left to skip, skipped
        self.skip_idle = False
        self._idle_left = 0
        self._idle_done = 0
        if checkpoints is not None:
            self._catch_sigterm()

    @property
    def grad(self) -> GradNoise | None:
        """The gradient statistics of the last decision (what the tuner sees)."""
        return self._grad

    @property
    def elastic(self) -> bool:
        return self.membership is not None and self.membership.elastic

    # -- state that travels with the job -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"v": STATE_VERSION, "tuner": self.tuner.state_dict(), "steps": self.steps,
                "resets": self.resets, "lr_factor": self.lr_factor,
                "loader": self.loader.state_dict() if self.loader is not None else None,
                "replicas": list(self.replica_request) if self.replica_request else None,
                "lr_fixed": self._lr_fixed, "policies": self._policy_states(),
                "size": self._decided_size}

    def _policy_states(self) -> dict[str, Any]:
        return {f"{i}:{p.label}": p.state_dict() for i, p in enumerate(self.policies)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError("elastic controller state: unexpected format")
        self.tuner.load_state_dict(state["tuner"])
        self.steps, self.resets = int(state["steps"]), int(state["resets"])
        self._idle_left = 0  # (planned for other steps)
        self.lr_factor = float(state["lr_factor"])
        if self.loader is not None and state.get("loader") is not None:
            self.loader.load_state_dict(state["loader"])
        wanted = state.get("replicas")
        self.replica_request = (int(wanted[0]), int(wanted[1])) if wanted else None
        self._lr_fixed = bool(state.get("lr_fixed", False))
        # the group size the job last decided for: what a newcomer's policies see as
        # previous_world_size, as the survivors do (0: the job's start)
        self._decided_size = int(state.get("size", 0))
        saved = state.get("policies") or {}
        for i, p in enumerate(self.policies):  # (a policy the state lacks keeps its own)
            if isinstance(saved.get(f"{i}:{p.label}"), dict):
                p.load_state_dict(saved[f"{i}:{p.label}"])

    # -- the user's view ----------------------------------------------------------------
    def epochs(self, total: float) -> Iterator[int]:
        """Data epochs until ``total`` statistical epochs are done (the same training
        whatever batch sizes were used); resumes where the job stands."""
        if self.loader is None:
            raise ValueError("epochs() follows a pollux AdaptiveDataLoader; none was given")
        self.loader.statistical_epochs = True
        # a worker that starts inside an epoch (a newcomer; a resume from a checkpoint)
        # joins peers that ran its before_epoch already: it runs no hooks, no collective
        started = self.loader.sampler.position > 0
        while not self.stopped and self.tuner.progress.epochs() < total:
            epoch = self.loader.epoch
            if not started:
                self.before_epoch(epoch)
            started = False
            yield epoch
            self.after_epoch(epoch)

    def before_epoch(self, epoch: int) -> None:
        """Every rank, before data epoch ``epoch``: the policies' ``before_epoch``, then a
        decision (their proposals apply at once)."""
        self.epoch = epoch
        self._epoch_hooks("before_epoch")

    def after_epoch(self, epoch: int) -> None:
        """Every rank, after data epoch ``epoch``: the policies' ``after_epoch``, then a
        decision (their proposals apply at once)."""
        self.epoch = epoch
        self._epoch_hooks("after_epoch")

    def _epoch_hooks(self, hook: str) -> None:
        try:
            with self.sync_points.scheduled(hook):
                self._run_policies(hook)
                self.decide(force=False)
        except RuntimeError as exc:  # a peer died: the job re-formed; the decision was in it
            if not self.recover(exc, in_flight=False):
                raise

    # -- start and new groups -------------------------------------------------------------
    def start(self, fresh: bool, sync: bool) -> None:
        """The first round of this process: ``fresh`` - no member carries state (resume
        from a checkpoint if there is one); ``sync`` - newcomers must receive state."""
        with self.sync_points.scheduled("start"):
            resumed = self._resume() if fresh else None
            captured = None
            if resumed is not None:
                captured, state = resumed
                self.load_state_dict(state)
            self._rebuild(captured, from_rank0=resumed is not None or sync)
            self.enter_round()

    def enter_round(self) -> None:
        """After a new group formed (or Horovod's sync): follow it, decide for it."""
        if self.loader is not None:
            self.loader.set_replicas(self.group.rank, self.group.world_size)
        self.resets += 1  # (the first is the start)
        # the pause is not a step, and the old group's step times are not this one's
        self._t_boundary, self.throughput, self.step_time = None, None, None
        self._idle_left = self._idle_done = 0  # (planned for the old group's steps)
        self.ctx.previous_world_size = self._decided_size
        self._run_policies("on_rescale")
        self.decide(force=True)

    def _run_policies(self, hook: str) -> None:
        for policy in self.policies:
            getattr(policy, hook)(self.ctx)

    def _rebuild(self, captured: Any, from_rank0: bool) -> None:
        try:
            received = self.hooks.rebuild(captured, self.state_dict(), from_rank0)
        except StateLost as lost:
            received = self._resume_lost(lost)
        if received is not None:
            self.load_state_dict(received)

    def _resume_lost(self, lost: StateLost) -> dict[str, Any] | None:
        """Every rank of the new group (``StateLost``): the newest durable checkpoint,
        loaded by all of them, or the one-line error when there is none."""
        before = self.tuner.progress.iterations
        resumed = self._resume(why="a failed worker took state its peers do not hold: ")
        if resumed is None:
            raise lost.error from None
        captured, state = resumed
        self.load_state_dict(state)  # (elsewhere than on rank 0 its own: reload brings it)
        if self.group.rank == 0 and self.membership is not None:  # (status: RESTARTS)
            self.membership.record_rollback(before - self.tuner.progress.iterations)
        return lost.reload(captured)

    # -- step boundaries ------------------------------------------------------------------
    def after_step(self, batch_size: int) -> None:
        """After every optimiser step, on every rank: count it, then the boundary."""
        self.count_step(batch_size)
        self.boundary()

    def count_step(self, batch_size: int) -> None:
        """Count an optimiser step of ``batch_size`` samples (for adapters whose boundary
        comes later, e.g. when the loader fetches the next batch)."""
        self.steps += 1
        self.tuner.progress.step(batch_size, self._grad)
        if self._open_rescale is not None:  # the first step after a re-form is done
            self._open_rescale["pause_to_step_s"] = (time.perf_counter()
                                                     - self._open_rescale["t0"])
            self._open_rescale = None
        if self._report_pending:
            self._report_pending = False
            self._report(force=True)

    def boundary(self) -> None:
        """The step boundary proper (module docstring, 1-4): every rank, same step. A
        step with nothing due costs a few attribute reads and the policies' after_step
        (an idle one, one: module docstring); the rest runs at scheduled points
        (``tuning.sync_points``)."""
        if self._idle_left:
            self._idle_left -= 1
            self._idle_done += 1
            return
        self._boundary()
        if self.skip_idle:
            self._idle_left = self._idle_ahead()

    def _idle_ahead(self) -> int:
        """How many of the next boundaries have nothing due, the same on every rank: no
        decision, no vote, no policy that acts on every step, no step of a new round or
        a SIGTERM still to handle (its handler ends the run at once)."""
        if (not self.idle_safe or self._terminating or self._open_rescale is not None
                or self.stopped or self.group.world_size != self._decided_size):
            return 0
        steps = self.steps
        ahead = (self.decide_every - steps % self.decide_every if self.decision_budget is None
                 else self._decide_at - steps) - 1
        if self.elastic or self._ends_together():
            ahead = min(ahead, self.check_every - steps % self.check_every - 1)
        return max(0, min(ahead, IDLE_MAX))

    def _boundary(self) -> None:
        if self._terminating and not self._ends_together():
            with self.sync_points.scheduled("terminate"):
                self._terminate()
        self._time_step()
        try:
            due = (self.steps % self.decide_every == 0 if self.decision_budget is None
                   else self.steps >= self._decide_at)
            vote = self.steps % self.check_every == 0 and (self.elastic
                                                            or self._ends_together())
            self.ctx.decision_due = due
            if not (due or vote or self.group.world_size != self._decided_size):
                self._run_policies("after_step")
                return
            with self.sync_points.scheduled("decision" if due else "vote" if vote
                                            else "resize"):
                t0 = time.perf_counter()
                self._run_policies("after_step")
                rescale, end = self._vote() if vote else (False, False)
                if end:  # (a rank that goes on meets its peers' end at its next collective)
                    self._end_together()
                elif rescale:
                    self.rescale()
                elif self.group.world_size != self._decided_size:
                    self.enter_round()  # resized underneath (Horovod): a new group anyway
                elif due:
                    self.decide(force=False)
                    self._time_decision(time.perf_counter() - t0)
        except RuntimeError as exc:
            # the step before this boundary completed everywhere: nothing is in flight
            if not self.recover(exc, in_flight=False):
                raise

    def _vote(self) -> tuple[bool, bool]:
        """A vote step's one collective: (re-form, some rank got SIGTERM)."""
        if self.membership is not None and self.elastic:
            return self.membership.vote(self._terminating)
        flag = torch.tensor([float(self._terminating)], dtype=torch.float64)
        return False, bool(self.group.allreduce(flag, "max", "pollux.ending")[0] > 0)

    def _ends_together(self) -> bool:
        """Whether a SIGTERM ends this job's ranks together (its state is spread over
        them: only all of them can write the final checkpoint)."""
        return (self.checkpoints is not None and self.group.world_size > 1
                and self.hooks.checkpoint_needs_peers())

    def _end_together(self) -> None:
        """Some rank got SIGTERM (a cancel, a drain, a batch system's preemption; all of
        them, mostly): every rank writes the final checkpoint, then those that got the
        signal end by it. Any other goes on: its peers' end is a failure it recovers
        from, from this very checkpoint."""
        with self.sync_points.scheduled("terminate"):
            if self._terminating:
                log.warning("SIGTERM: writing a final checkpoint with the job's other ranks")
            self.save_checkpoint(wait=True)
            if self._terminating:
                self._end_by_sigterm()

    def _time_step(self) -> None:
        """The steps since the last boundary timed (idle ones included: their mean, as
        if each had been timed - the smoothing's weights are per step)."""
        now = time.perf_counter()
        n, self._idle_done = self._idle_done + 1, 0
        if self._t_boundary is not None and now > self._t_boundary:
            self.step_time = step = (now - self._t_boundary) / n
            mean = self._mean_step
            keep = 0.9 ** n
            self._mean_step = step if mean is None else keep * mean + (1 - keep) * step
            m, s = self.hooks.batch()
            rate = self.group.world_size * m * (s + 1) / step
            keep = 0.8 ** n
            self.throughput = rate if self.throughput is None else (
                keep * self.throughput + (1 - keep) * rate)
        self._t_boundary = now

    def rescale(self) -> None:
        """Re-form the group at this step boundary (every rank of the old group)."""
        assert self.membership is not None
        t0 = time.perf_counter()
        before = self.group.world_size
        captured = self.hooks.capture(self.state_dict())
        timing: dict[str, Any] = {"t0": t0, "from": before, "reason": "allocation",
                                  "captured_s": time.perf_counter() - t0}
        info = self._next_round(hand_off=getattr(self.hooks, "hand_off", None))
        timing["formed_s"] = time.perf_counter() - t0
        self._rebuild(captured, from_rank0=False)
        timing["rebuilt_s"] = time.perf_counter() - t0
        self.enter_round()
        timing.update(to=self.group.world_size, round=getattr(info, "round", None),
                      pause_s=time.perf_counter() - t0, done_at=time.time())
        self._record(timing)
        log.info("rescaled %d -> %d replicas in %.3f s", before, self.group.world_size,
                 timing["pause_s"])

    def recover(self, exc: BaseException, in_flight: bool = True) -> bool:
        """After a collective raised: True if a peer's failure was survived (the job
        re-formed; with ``in_flight`` the step in flight is dropped), False if ``exc`` is
        no peer's failure (the caller re-raises)."""
        if not is_peer_failure(exc):
            return False
        with self.sync_points.scheduled("failure"):
            return self._recover(exc, in_flight)

    def _recover(self, exc: BaseException, in_flight: bool) -> bool:
        if self._terminating:  # peers ended by the same SIGTERM: only our own end is left
            self._terminate()
        if not self.elastic:
            return False
        log.warning("a collective failed (%s): re-forming the job", first_line(exc))
        t0, before = time.perf_counter(), self.group.world_size
        captured = self.hooks.capture(self.state_dict())  # local: the group is broken
        info = self._next_round()
        self._rebuild(captured, from_rank0=True)  # survivors may be a step apart
        if in_flight and self.loader is not None:
            self.loader.abort_step()
        self.enter_round()
        self._record({"t0": t0, "from": before, "to": self.group.world_size,
                      "round": getattr(info, "round", None), "reason": "failure",
                      "pause_s": time.perf_counter() - t0, "done_at": time.time()})
        return True

    def _next_round(self, hand_off: Any = None) -> Any:
        assert self.membership is not None
        try:
            return (self.membership.next_round(hand_off) if hand_off is not None
                    else self.membership.next_round())
        except MemberRemoved:
            log.info("not in the new round: leaving the job")
            self.ctx.previous_world_size, self.ctx.detached = self.group.world_size, True
            self._run_policies("on_rescale")
            self.hooks.leave()
            self.membership.close()
            raise LeaveJob() from None

    def _record(self, timing: dict[str, Any]) -> None:
        self.rescales.append(timing)
        self._open_rescale = timing

    # -- decisions ------------------------------------------------------------------------
    def decide(self, force: bool) -> Decision:
        """Rank 0 decides from its policies' proposals and reports; every rank applies
        the broadcast decision (module docstring)."""
        g = self.group
        self._idle_left = 0  # (planned from the schedule this decision may change)
        self._grad = self.hooks.grad_stats()
        m, s = self.hooks.batch()
        actions = self.ctx.take()  # (another rank's proposals are not used: rank 0 decides)
        t = torch.zeros(Decision.SIZE, dtype=torch.float64)
        if g.rank == 0:
            cfg = self.tuner.config
            batch = resolve_batch(actions, g.world_size, (m, s), cfg)
            if batch is None and force:  # a new group and no proposal: keep the total batch
                batch = (fit_total(self._decided_total, g.world_size, cfg)
                         if self._decided_size else self.tuner.default_batch(g.world_size))
            m2, s2 = batch or (m, s)
            fixed = self._lr_fixed if actions.lr_factor is None else actions.lr_factor > 0
            if actions.lr_factor:
                factor = actions.lr_factor
            elif fixed:
                factor = self.lr_factor
            else:
                factor = (self.tuner.lr_factor(g.world_size * m2 * (s2 + 1)) if self.adapt_lr
                          else 1.0)
            wanted = actions.replicas if actions.replicas is not None else self.replica_request
            if wanted == (1, 0):
                wanted = None  # request_range(1): no request
            due = (not force and self.checkpoints is not None and self.checkpoints.due())
            t = Decision(m2, s2, self._check_interval(), factor, due, actions.stop, wanted,
                         fixed, self._decide_interval()).to_tensor()
        if g.world_size > 1:
            t = g.broadcast(t, "pollux.decision")
        d = Decision.from_tensor(t)
        changed_request = d.replicas != self.replica_request
        self._apply(d, force, (m, s))
        if g.rank == 0:
            if force:  # a new group: report after its first step, not inside the pause
                self._report_pending = True
            else:
                self._report(force=changed_request, batch=(d.local_bsz, d.accum_steps))
        if d.checkpoint:
            self._checkpoint(collective=True)
        return d

    @property
    def _decided_total(self) -> int:
        m, s = self.hooks.batch()
        return self._decided_size * m * (s + 1)

    def _apply(self, d: Decision, force: bool, current: tuple[int, int]) -> None:
        self.check_every = min(self.decide_every, d.check_every)
        self._decide_at = self.steps + d.decide_in
        self._decided_size = self.group.world_size
        self.lr_factor, self._lr_fixed = d.lr_factor, d.lr_fixed
        self.hooks.set_lr_factor(d.lr_factor)
        batch = (d.local_bsz, d.accum_steps)
        if force or batch != current:
            self.hooks.apply_batch(*batch)
            self.throughput = None  # a new configuration: its own rate
        if self.loader is not None and (self.loader.local_bsz, self.loader.accum_steps) != batch:
            self.loader.set_batch_size(*batch)
        if d.replicas != self.replica_request:
            log.info("adaptation policy: asking the coordinator for %s replicas",
                     "any" if d.replicas is None else
                     f"{d.replicas[0]}-{d.replicas[1] or 'max'}")
        self.replica_request = d.replicas
        if d.stop and not self.stopped:
            log.info("adaptation policy: training stops at step %d", self.steps)
            self.stopped = True
            if self.loader is not None:
                self.loader.stop()

    def _time_decision(self, cost: float) -> None:
        """Rank 0's estimate of a decision's cost: falling at once, rising slowly - a
        decision that refits the throughput model (tens of ms, every ``fit_interval``
        seconds) or warms up is amortised otherwise, and must not space out the rest."""
        last = self._decision_cost
        self._decision_cost = cost if last is None else min(cost, 0.9 * last + 0.1 * cost)
        self._decisions_timed += 1

    def _decide_interval(self) -> int:
        """Rank 0: steps until the next decision - ``decide_every``, or more where a
        decision would cost more than ``decision_budget`` of the steps in between (at
        most ``DECISION_MAX_S`` of training)."""
        every, cost, step = self.decide_every, self._decision_cost, self._mean_step
        if (self.decision_budget is None or cost is None or step is None
                or self._decisions_timed < 3):  # (the first ones fit and warm up)
            return every
        step = max(step, 1e-7)
        want = math.ceil(cost / (self.decision_budget * step))
        return int(max(every, min(want, DECISION_MAX_S / step)))

    def _check_interval(self) -> int:
        if self._mean_step is None:
            return 1
        step = max(self._mean_step, 1e-6)
        return int(min(self.decide_every, max(1, round(VOTE_PERIOD_S / step))))

    def _report(self, force: bool, batch: tuple[int, int] | None = None) -> None:
        """Rank 0's hints to the store when due (``force``: now)."""
        if self.reporter is None or not (force or self.tuner.report_due()):
            return
        g = self.group
        m, s = batch or self.hooks.batch()
        self.reporter.report(self.tuner, lambda: self.tuner.hints(
            g.num_nodes, g.world_size, m, s, restarts=max(0, self.resets - 1),
            rescale_s=recent_pause(self.rescales), replicas_wanted=self.replica_request))

    # -- durable state --------------------------------------------------------------------
    def save_checkpoint(self, wait: bool = True) -> None:
        """Write a checkpoint now: every rank calls it at the same point (the capture may
        be a collective), rank 0 writes (``wait``: before returning)."""
        if self.checkpoints is None:
            raise ValueError("no checkpoint directory")
        with self.sync_points.scheduled("checkpoint"):
            if wait and self.group.rank == 0:
                self.checkpoints.flush()
            self._checkpoint(collective=True, wait=wait)

    def _checkpoint(self, collective: bool, wait: bool = False) -> None:
        assert self.checkpoints is not None
        state = self.hooks.checkpoint_state(self.state_dict(), collective)
        if self.group.rank != 0:
            pending = state.get("pending") if wait and state is not None else None
            if pending is not None:  # this rank's own shards: written before it goes on
                try:
                    pending.result()
                except Exception as exc:  # (rank 0's commit of the checkpoint fails too)
                    log.warning("this rank's shards were not written (%s)", first_line(exc))
            return
        if state is None:
            log.warning("no checkpoint: this state cannot be captured without its peers")
            return
        pending, shards = state.pop("pending", None), state.pop("shards", None)
        self.checkpoints.save(state, step=self.steps, progress=self.tuner.progress.iterations,
                              replicas=self.group.world_size, wait=wait, pending=pending,
                              shards=shards)

    def _resume(self, why: str = "") -> tuple[Any, dict[str, Any]] | None:
        """Rank 0 loads the newest checkpoint, if there is one; every rank (all of them
        fresh, all here) learns whether it did (one broadcast). Returns, on rank 0,
        what ``hooks.rebuild`` takes and the controller state; elsewhere (None, {}).
        ``why`` starts the line that says so."""
        g = self.group
        loaded = torch.zeros(1, dtype=torch.float64)
        found = None
        if g.rank == 0 and self.checkpoints is not None:
            try:
                ckpt = latest_checkpoint(self.checkpoints.directory)
            except CheckpointError as exc:
                log.error("not resuming: %s; training starts from scratch", exc)
                ckpt = None
            if ckpt is not None:
                try:
                    found = self.hooks.restore_checkpoint(ckpt.state)
                except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                    log.error("not resuming from %s: %s; training starts from scratch",
                              ckpt.path, first_line(exc))
                if found is not None:
                    self.resumed_from = ckpt.progress
                    loaded[0] = 1
                    log.warning("%sresumed from %s (step %d, %.0f iterations of progress, "
                                "taken on %d replicas)", why, ckpt.path, ckpt.step, ckpt.progress,
                                ckpt.replicas)
                    if self.membership is not None:
                        self.membership.credit_resumed(ckpt.progress)
        if g.world_size > 1 and self.checkpoints is not None:
            loaded = g.broadcast(loaded, "pollux.resume")
        if not loaded[0]:
            return None
        if found is not None:
            return found
        return None, self.state_dict()  # (the others take rank 0's in rebuild)

    def _catch_sigterm(self) -> None:
        """SIGTERM ends the worker at its next step boundary, after rank 0 wrote a final
        checkpoint (only where the script left SIGTERM's default, in the main thread)."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            self._terminating = True
            self._idle_left = 0  # (the next boundary handles it)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _terminate(self) -> None:
        if self.group.rank == 0 and self.checkpoints is not None:
            log.warning("SIGTERM: writing a final checkpoint")
            self.checkpoints.flush()
            # (alone, a collective needs no peer: a one-rank sharded job writes its shards)
            self._checkpoint(collective=self.group.world_size == 1, wait=True)
        self._end_by_sigterm()

    def _end_by_sigterm(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM would have ended us
        time.sleep(60)  # (the signal is delivered before this returns)


def checkpoint_writer(directory: str | None, interval: float | None) -> CheckpointWriter | None:
    """The job's checkpoint writer: the arguments, else pollux-run's ``--checkpoint-dir``
    and ``--checkpoint-interval`` (through the environment), else none."""
    directory = directory or os.environ.get(envvars.CHECKPOINT_DIR)
    if not directory:
        return None
    if interval is None:
        interval = float(os.environ.get(envvars.CHECKPOINT_INTERVAL,
                                        envvars.DEFAULT_CHECKPOINT_INTERVAL))
    return CheckpointWriter(directory, every=interval)
