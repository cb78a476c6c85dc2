"""Adaptation policies (KungFu's APs): user code at the step boundaries of an elastic job.

A policy is a small object whose hooks the :class:`~.controller.ElasticController` calls
on every replica of the job, whatever its framework (torch, DeepSpeed, Horovod):

* ``before_epoch(ctx)`` / ``after_epoch(ctx)``: around each data epoch of ``epochs()``
  (Horovod: where the script calls ``control.before_epoch()`` / ``control.after_epoch()``).
  A worker that starts inside an epoch (a newcomer, a resume) joins it without
  ``before_epoch``: its peers ran that one already;
* ``after_step(ctx)``: after every optimiser step;
* ``on_rescale(ctx)``: the job's group changed (``ctx.previous_world_size``; 0 at the
  job's start). A worker that is leaving gets it too, with ``ctx.detached`` True: it
  must not use collectives then.

The protocol:

1. Every rank runs every policy's hooks, in the order given, at the same step boundary.
   Hooks may use the context's collectives (``allreduce``, ``broadcast``, ``allgather`` of
   small values over the job's *current* group: after a rescale, the new one) as long as
   every rank takes the same branch: decide from the step, the epoch, or values that came
   out of a collective, never from a rank's own measurements alone.
2. Actions (``set_batch_size``, ``set_batch``, ``set_accumulation``, ``set_lr_factor``,
   ``request_replicas``, ``request_range``, ``stop``) are proposals gathered in
   ``ctx.pending``. A later policy sees what an earlier one proposed and may override it
   (a cap placed after the goodput policy).
3. Rank 0 decides and every rank applies. At the next decision (every ``decide_every``
   steps, at the end of each epoch, and right after every rescale) rank 0's proposals
   travel in the decision broadcast the controller sends anyway, and every rank applies
   them at that same step. What other ranks proposed is not used. KungFu instead checks
   with a collective per action that the replicas agree; deciding on rank 0 costs nothing
   extra and cannot hang when replicas disagree.
4. A replica request goes to the coordinator with the job's hints, at once. It becomes
   the job's replica range in the cluster policy, within the job's own limits
   (``--min-np``/``--max-np``) and the cluster's capacity: a policy never bypasses the
   scheduler.
5. ``stop()`` ends training on every rank at that decision: ``epochs()`` and the pollux
   loader stop; Horovod scripts read ``control.stopped``.

Policies' own state (``state_dict``/``load_state_dict``, plain JSON) travels with the
job's state to newcomers and into checkpoints. The default policy list is
``[GoodputPolicy()]``, Pollux's agent. An explicit list replaces it; put
``GoodputPolicy()`` in the list to combine with it.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pollux_launch.errors import UserError
from pollux_launch.registry import Registry

if TYPE_CHECKING:
    from pollux_launch.tuning.gns import GradNoise
    from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig

    from .protocols import ControlledJob

log = logging.getLogger(__name__)

OPS = ("sum", "mean", "max", "min")
# what --policy-module and POLLUX_POLICIES accept: a built-in name or module:attribute
_SPEC = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*)(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
                   r"(?::[A-Za-z_][A-Za-z0-9_]*)?")


class PolicyError(UserError, ValueError):
    """A policy cannot be loaded or an action is malformed (one line: what and how to fix)."""


class AdaptationPolicy:
    """Base class of adaptation policies; override any of the hooks (module docstring)."""

    #: the name in logs and in the job's state (default: the class name)
    name: str = ""

    def before_epoch(self, ctx: PolicyContext) -> None:
        """Before each data epoch, on every rank."""

    def after_step(self, ctx: PolicyContext) -> None:
        """After every optimiser step, on every rank."""

    @property
    def idle_safe(self) -> bool:
        """Whether the steps with no decision, vote or new round may go without this
        policy's ``after_step`` (the controller then skips their boundaries: a
        host-bound step's cost). By default: when the policy does not override
        ``after_step``; one that acts only at decisions (``ctx.decision_due``) may say
        True."""
        return type(self).after_step is AdaptationPolicy.after_step

    def after_epoch(self, ctx: PolicyContext) -> None:
        """After each data epoch, on every rank."""

    def on_rescale(self, ctx: PolicyContext) -> None:
        """The job's group changed (0 ``previous_world_size``: the start); on a leaving
        worker with ``ctx.detached`` True."""

    def state_dict(self) -> dict[str, Any]:
        """The policy's state to carry to newcomers and into checkpoints (plain JSON)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state a ``state_dict`` gave (rank 0's, on newcomers)."""

    @property
    def label(self) -> str:
        return self.name or type(self).__name__


@dataclass(frozen=True)
class Actions:
    """The proposals pending on this rank since the last decision.

    ``local_bsz``/``accum_steps`` (from ``set_batch``) or ``batch_size`` (a total, from
    ``set_batch_size``), with ``accum_steps`` alone from ``set_accumulation``;
    ``replicas``: ``(lo, hi)`` with ``hi`` 0 for no upper bound; ``lr_factor`` 0.0: back
    to the job's LR rule.
    """

    batch_size: int | None = None
    local_bsz: int | None = None
    accum_steps: int | None = None
    lr_factor: float | None = None
    replicas: tuple[int, int] | None = None
    stop: bool = False

    @property
    def empty(self) -> bool:
        return self == Actions()


def fit_total(total: int, replicas: int, config: TunerConfig, accum_steps: int | None = None
              ) -> tuple[int, int]:
    """``(m, s)`` whose total batch ``K m (s+1)`` is nearest ``total`` within the per-GPU
    bounds; ``s`` given, or the fewest accumulation steps that fit (0 without
    accumulation). Pure."""
    lo, hi = config.local_bsz_bounds
    k = max(1, replicas)
    if not config.gradient_accumulation:
        s = 0
    elif accum_steps is not None:
        s = max(0, int(accum_steps))
    else:
        s = max(0, math.ceil(total / (k * hi)) - 1)
    m = min(round(total / (k * (s + 1))), config.max_batch_size // (k * (s + 1)))
    return min(max(m, lo), hi), s  # (rounding never past max_batch_size, where lo allows)


def resolve_batch(actions: Actions, replicas: int, current: tuple[int, int],
                  config: TunerConfig) -> tuple[int, int] | None:
    """The ``(m, s)`` that ``actions`` ask for on ``replicas`` replicas (None: no batch
    action), within the job's limits: the per-GPU bounds, and a total batch in its range
    ``[min_batch_size, max_batch_size]``. Pure."""
    lo, hi = config.local_bsz_bounds
    if actions.local_bsz is not None:
        # (as given: the policy that names (m, s) answers for its total)
        s = (actions.accum_steps or 0) if config.gradient_accumulation else 0
        return min(max(actions.local_bsz, lo), hi), s
    if actions.batch_size is None and actions.accum_steps is None:
        return None
    m0, s0 = current
    total = actions.batch_size if actions.batch_size is not None else replicas * m0 * (s0 + 1)
    total = min(max(config.min_batch_size or 1, total), config.max_batch_size)
    return fit_total(total, replicas, config, actions.accum_steps)


class PolicyContext:
    """What a policy sees and does (module docstring); one per controller, valid across
    rescales. Metrics are this worker's unless said otherwise; combine them with the
    collectives."""

    def __init__(self, controller: ControlledJob) -> None:
        # a weak reference: the controller holds this context, and a cycle would keep a
        # finished controller (and its model and process group) alive until the cycle
        # collector runs, possibly after the group was destroyed
        self._c = weakref.proxy(controller)
        self._pending = Actions()
        self.metrics: dict[str, float] = {}  # the user's scalars: ctx.record(name, value)
        self.previous_world_size = 0  # in on_rescale: the size before (0: the start)
        self.detached = False  # in on_rescale: this worker is leaving the job
        self.decision_due = False  # this step ends with a decision (goodput policy)
        self._grad_step = -1
        self._grad: GradNoise | None = None

    # -- where the job stands --------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimiser steps of the job so far."""
        return self._c.steps

    @property
    def epoch(self) -> int:
        """The data epoch (the loader's; Horovod: the last one given to ``before_epoch``)."""
        return self._c.epoch

    @property
    def progress(self) -> float:
        """Statistical epochs done (scale-invariant progress, Pollux Sec. 3.1)."""
        return self._c.tuner.progress.epochs()

    @property
    def rank(self) -> int:
        return self._c.group.rank

    @property
    def world_size(self) -> int:
        return self._c.group.world_size

    @property
    def num_nodes(self) -> int:
        return self._c.group.num_nodes

    @property
    def local_bsz(self) -> int:
        return self._c.hooks.batch()[0]

    @property
    def accum_steps(self) -> int:
        return self._c.hooks.batch()[1]

    @property
    def batch_size(self) -> int:
        """The total batch of a step now: ``K m (s + 1)``."""
        m, s = self._c.hooks.batch()
        return self.world_size * m * (s + 1)

    @property
    def lr_factor(self) -> float:
        return self._c.lr_factor

    @property
    def config(self) -> TunerConfig:
        """The job's batch limits: ``init_batch_size``, ``max_batch_size``,
        ``local_bsz_bounds``, ``gradient_accumulation``."""
        return self._c.tuner.config

    @property
    def tuner(self) -> GoodputTuner:
        """The job's goodput model (Pollux's agent; what ``GoodputPolicy`` asks)."""
        return self._c.tuner

    @property
    def replica_request(self) -> tuple[int, int] | None:
        """The request in force: ``(lo, hi)``, ``hi`` 0 for none; None: no request."""
        return self._c.replica_request

    # -- monitored metrics ---------------------------------------------------------------
    @property
    def step_time(self) -> float | None:
        """This worker's last optimiser step, seconds (None before the second step)."""
        return self._c.step_time

    @property
    def sync_time(self) -> float | None:
        """The part of the last step this worker waited for its peers (where the adapter
        measures it: torch and Horovod; None elsewhere)."""
        last = self._c.tuner.profile.last
        return None if last is None else last[1]

    @property
    def local_time(self) -> float | None:
        """The last step less its wait for peers: this worker's own work. Under
        synchronous training every replica's step takes as long as the slowest, so this,
        not ``step_time``, shows which one is slow (None where ``sync_time`` is)."""
        last = self._c.tuner.profile.last
        if last is None or last[1] is None:
            return None
        return max(0.0, last[0] - min(last[1], last[0]))

    @property
    def throughput(self) -> float | None:
        """Samples per second of the whole job, smoothed over recent steps of the current
        configuration (None before the second step)."""
        return self._c.throughput

    @property
    def grad(self) -> GradNoise | None:
        """The gradient statistics (already measured by the agent, Pollux Eqn 4-5)."""
        if self._grad_step != self._c.steps:
            self._grad, self._grad_step = self._c.hooks.grad_stats(), self._c.steps
        return self._grad

    @property
    def gns(self) -> float | None:
        """The gradient noise scale ``M0 var / sqr`` (the critical batch size's estimate)."""
        g = self.grad
        return None if g is None or not g.sqr > 0 else float(g.noise_scale)

    @property
    def grad_sqr(self) -> float | None:
        """``|G|^2``, the squared norm of the true gradient."""
        g = self.grad
        return None if g is None else float(g.sqr)

    @property
    def grad_var(self) -> float | None:
        """``tr(Sigma) / M0``: the gradient variance of a batch of ``M0``."""
        g = self.grad
        return None if g is None else float(g.var)

    @property
    def grad_snr(self) -> float | None:
        """Signal-to-noise ratio of the gradient of the current batch: ``|G|^2`` over the
        variance of a batch of ``batch_size`` (KungFu's SNR monitor)."""
        g = self.grad
        if g is None or not g.var > 0:
            return None
        return float(g.sqr / (g.var * g.init_batch_size / self.batch_size))

    def record(self, name: str, value: float) -> None:
        """Keep a scalar of this worker (a loss, an accuracy) in ``ctx.metrics``."""
        self.metrics[str(name)] = float(value)

    # -- communication -------------------------------------------------------------------
    def allreduce(self, value: float | Sequence[float], op: str = "mean"
                  ) -> float | np.ndarray:
        """``op`` (sum, mean, max, min) of ``value`` over every rank of the current group."""
        if op not in OPS:
            raise PolicyError(f"allreduce op must be one of {OPS}, got {op!r}")
        t, scalar = self._tensor(value)
        if self.world_size > 1:
            t = self._c.group.allreduce(t, "mean" if op == "mean" else op,
                                        "pollux.policy.allreduce")
        return float(t[0]) if scalar else t.numpy()

    def broadcast(self, value: float | Sequence[float], src: int = 0) -> float | np.ndarray:
        """Rank ``src``'s ``value`` on every rank."""
        t, scalar = self._tensor(value)
        if self.world_size > 1:
            if not 0 <= src < self.world_size:
                raise PolicyError(f"broadcast src {src} is not a rank of {self.world_size}")
            if src == 0:
                t = self._c.group.broadcast(t, "pollux.policy.broadcast")
            else:  # everyone but src adds zeros
                mine = t if self.rank == src else torch.zeros_like(t)
                t = self._c.group.allreduce(mine, "sum", "pollux.policy.broadcast")
        return float(t[0]) if scalar else t.numpy()

    def allgather(self, value: float | Sequence[float]) -> np.ndarray:
        """Every rank's ``value``: an array with one row per rank (rank order)."""
        t, scalar = self._tensor(value)
        rows = (self._c.group.allgather(t, "pollux.policy.allgather") if self.world_size > 1
                else t.reshape(1, -1))
        out = rows.numpy()
        return out[:, 0] if scalar else out

    def _tensor(self, value: float | Sequence[float]) -> tuple[torch.Tensor, bool]:
        if self.detached:
            raise PolicyError("this worker is leaving the job: no collectives in its "
                              "on_rescale (check ctx.detached)")
        scalar = np.ndim(value) == 0
        arr = np.asarray(value, dtype=np.float64).reshape(-1)
        return torch.from_numpy(arr.copy()), scalar

    # -- actions (proposals; rank 0's are applied at the next decision) ------------------
    @property
    def pending(self) -> Actions:
        """What the policies before this one proposed since the last decision."""
        return self._pending

    @property
    def proposed_batch_size(self) -> int:
        """The total batch the pending proposals would give (or the current one)."""
        p = self._pending
        if p.local_bsz is not None:
            return self.world_size * p.local_bsz * ((p.accum_steps or 0) + 1)
        if p.batch_size is not None:
            return p.batch_size
        return self.batch_size  # (accumulation alone keeps the total)

    def set_batch_size(self, total: int) -> None:
        """A total batch per optimiser step; the controller picks ``(m, s)`` for it."""
        total = _positive_int("set_batch_size", total)
        self._pending = replace(self._pending, batch_size=total, local_bsz=None)

    def set_batch(self, local_bsz: int, accum_steps: int = 0) -> None:
        """The per-GPU micro-batch and accumulation steps themselves."""
        m = _positive_int("set_batch", local_bsz)
        if not isinstance(accum_steps, int) or accum_steps < 0:
            raise PolicyError(f"set_batch: accum_steps must be an int >= 0, got {accum_steps!r}")
        self._pending = replace(self._pending, local_bsz=m, accum_steps=accum_steps,
                                batch_size=None)

    def set_accumulation(self, accum_steps: int) -> None:
        """Accumulation steps (``s``: ``s + 1`` micro-batches a step), keeping the total."""
        if not isinstance(accum_steps, int) or accum_steps < 0:
            raise PolicyError(f"set_accumulation: need an int >= 0, got {accum_steps!r}")
        p = self._pending
        total = p.batch_size if p.batch_size is not None else self.proposed_batch_size
        self._pending = replace(p, batch_size=total, local_bsz=None, accum_steps=accum_steps)

    def set_lr_factor(self, factor: float | None) -> None:
        """The LR multiplier from the next decision on, kept until set again; None: back to
        the job's LR rule for the batch (e.g. AdaScale), the default."""
        if factor is None:
            self._pending = replace(self._pending, lr_factor=0.0)
            return
        f = float(factor)
        if not (math.isfinite(f) and f > 0):
            raise PolicyError(f"set_lr_factor: need a finite factor > 0, got {factor!r}")
        self._pending = replace(self._pending, lr_factor=f)

    def request_replicas(self, n: int) -> None:
        """Ask the coordinator for ``n`` replicas (a request, within the job's limits)."""
        n = _positive_int("request_replicas", n)
        self.request_range(n, n)

    def request_range(self, lo: int, hi: int | None = None) -> None:
        """Ask the coordinator to keep the job between ``lo`` and ``hi`` replicas (None:
        no upper bound); ``request_range(1)`` withdraws a request."""
        lo = _positive_int("request_range", lo)
        if hi is not None and (_positive_int("request_range", hi) < lo):
            raise PolicyError(f"request_range: need lo <= hi, got {lo}, {hi}")
        self._pending = replace(self._pending, replicas=(lo, 0 if hi is None else int(hi)))

    def stop(self) -> None:
        """End training on every rank at the next decision."""
        self._pending = replace(self._pending, stop=True)

    def take(self) -> Actions:
        """The pending proposals, cleared (the controller, at a decision)."""
        out, self._pending = self._pending, Actions()
        return out


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PolicyError(f"{what}: need a positive integer, got {value!r}")
    return int(value)


class GoodputPolicy(AdaptationPolicy):
    """Pollux's agent as a policy (the default): at every decision, the per-GPU batch and
    accumulation steps that maximise goodput for the allocation (Pollux Eqn 13), kept
    unless the predicted gain exceeds the tuner's ``min_gain``; for a new group, the best
    for its size. The LR follows the job's rule (AdaScale, square root...) unless a later
    policy sets it. Runs on rank 0 only (rank 0 decides)."""

    name = "pollux"
    idle_safe = True  # (it acts at decisions only)

    def after_step(self, ctx: PolicyContext) -> None:
        if ctx.decision_due and ctx.rank == 0:
            m, s = ctx.tuner.choose(ctx.num_nodes, ctx.world_size,
                                    (ctx.local_bsz, ctx.accum_steps), refit=True)
            ctx.set_batch(m, s)

    def on_rescale(self, ctx: PolicyContext) -> None:
        if ctx.rank == 0 and not ctx.detached:  # (refit=False: inside the rescale's pause)
            m, s = ctx.tuner.choose(ctx.num_nodes, ctx.world_size, None, refit=False)
            ctx.set_batch(m, s)


#: The adaptation policies known by name (``--policy-module pollux``, a ds_config's
#: ``policies``): name -> a policy class or factory, called with no arguments.
ADAPTATION_POLICIES: Registry[Callable[[], AdaptationPolicy]] = Registry(
    "adaptation policy", check=callable,
    expects="an AdaptationPolicy class or a factory taking no arguments")
ADAPTATION_POLICIES.register("pollux", GoodputPolicy)


def register_adaptation_policy(name: str, factory: Callable[[], AdaptationPolicy], *,
                               replace: bool = False) -> None:
    """Make ``name`` a policy that ``--policy-module`` and ``load_policy`` accept, built by
    ``factory()``. Raises RegistryError (a ValueError) for a taken name, unless
    ``replace=True``."""
    ADAPTATION_POLICIES.register(name, factory, replace=replace)


def check_spec(spec: str) -> str:
    """One ``--policy-module`` entry checked for form only: a built-in name or
    ``module:attribute`` (never code). Returns it; raises ``PolicyError``."""
    spec = spec.strip()
    if spec in ADAPTATION_POLICIES:
        return spec
    if not _SPEC.fullmatch(spec) or ":" not in spec:
        raise PolicyError(
            f"--policy-module {spec[:80]!r}: give module:Class (e.g. mypkg.policies:GNSBatch) "
            f"or a built-in ({', '.join(ADAPTATION_POLICIES.names())})")
    return spec


def load_policy(spec: str) -> AdaptationPolicy:
    """Import one policy: ``module:attribute`` names a policy class or factory (called with
    no arguments) or an instance; the module is found on the worker's Python path, then in
    its working directory (as ``python -m`` would)."""
    spec = check_spec(spec)
    if spec in ADAPTATION_POLICIES:
        return ADAPTATION_POLICIES.get(spec)()
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise PolicyError(f"policy {spec}: importing {module} failed: {exc}") from None
        # the import system caches directory listings, and a directory modified within
        # one tick of the clock keeps its mtime: a module written since the last listing
        # stays unseen until the caches go (a flaky "no module" otherwise)
        importlib.invalidate_caches()
        if "" not in sys.path and "." not in sys.path:
            sys.path.append(".")  # the job's working directory, where pollux-run was started
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            raise PolicyError(f"policy {spec}: no module {module!r} on the Python path or "
                              "in the working directory") from None
    obj = getattr(mod, attr, None)
    if obj is None:
        raise PolicyError(f"policy {spec}: {module} has no attribute {attr!r}")
    policy = obj() if callable(obj) and not isinstance(obj, AdaptationPolicy) else obj
    if not isinstance(policy, AdaptationPolicy):
        raise PolicyError(f"policy {spec}: {attr} is not an AdaptationPolicy (subclass "
                          "pollux_launch.elastic.AdaptationPolicy)")
    return policy


def load_policies(specs: str) -> list[AdaptationPolicy]:
    """Policies from a comma-separated list (``POLLUX_POLICIES``, ``--policy-module``)."""
    return [load_policy(s) for s in specs.split(",") if s.strip()]


def resolve_policies(given: Sequence[AdaptationPolicy] | None,
                     from_env: str | None) -> list[AdaptationPolicy]:
    """The job's policies in order: the script's (``policies=``), then the command line's
    (``pollux-run --policy-module``); neither: ``[GoodputPolicy()]``."""
    out = list(given) if given is not None else []
    for p in out:
        if not isinstance(p, AdaptationPolicy):
            raise PolicyError(f"policies: {p!r} is not an AdaptationPolicy")
    if from_env:
        out += load_policies(from_env)
    if given is None and not from_env:
        out = [GoodputPolicy()]
    return out
