"""GoodputTuner: the per-job brain inside the workers - Pollux's PolluxAgent (Sec. 3-4.1).

Framework adapters feed it measurements (``StepProfile`` for step times, a
``GradientNoiseMonitor`` for gradient statistics, ``StatisticalProgress``) and ask it
three things:

* ``choose(num_nodes, num_replicas, current)`` - the per-GPU batch ``m`` and accumulation
  steps ``s`` that maximise goodput for the allocation (Eqn 13), or the current ones when
  the predicted gain is below ``min_gain`` (no churn). Called on rank 0 only; the adapter
  broadcasts the answer so that every replica applies it at the same step boundary.
* ``lr_factor(batch_size)`` - the LR multiplier of the configured rule (AdaScale for SGD,
  square root for Adam-family by default).
* ``hints(...)`` - the job's ``JobHints`` (fitted throughput model, gradient
  statistics, limits, progress), due every ``report_interval`` seconds
  (``report_due``/``reported``); rank 0's ``elastic.hints.HintsReporter`` writes them to
  the store, for the coordinator.

Pure: no store, no environment. What pollux-run says through the environment (the
batch-size range's flags) is read by the caller and handed in (``batch_range``).

The throughput model is refitted from the profile at most once per ``fit_interval`` and
only when the profile changed; between fits the last fit is reused, and so is it when a
refit fails (bad observations, numeric trouble: logged once per kind of failure).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import env as envvars
from ..goodput import GoodputFunction, GridCache, PerfParams, fit_perf_params, scale_lr
from ..messages import JobHints
from .gns import GradNoise
from .profile import StepProfile
from .progress import StatisticalProgress

ADAM_LIKE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adafactor", "LAMB", "Lamb")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TunerConfig:
    """What the job allows (validated up front; errors are one line)."""

    init_batch_size: int
    max_batch_size: int
    local_bsz_bounds: tuple[int, int]
    gradient_accumulation: bool = True
    adaptive_batch_size: bool = True
    lr_scaling: str | Callable[[float, Any], float] = "adascale"
    report_interval: float = 30.0
    fit_interval: float = 10.0
    min_gain: float = 0.05
    # the job's batch-size range's lower end (Saxena et al.): no total batch below it
    min_batch_size: int | None = None

    def __post_init__(self) -> None:
        m0, mx = self.init_batch_size, self.max_batch_size
        lo, hi = self.local_bsz_bounds
        mn = self.min_batch_size
        if mn is not None and (not isinstance(mn, int) or not 1 <= mn <= mx):
            raise ValueError(f"min batch size must be an integer in [1, max batch size {mx}], "
                             f"got {mn!r}")
        if not isinstance(m0, int) or m0 < 1:
            raise ValueError(f"initial batch size must be a positive integer, got {m0!r}")
        if not isinstance(mx, int) or mx < m0:
            raise ValueError(f"max batch size {mx!r} must be an integer >= initial {m0}")
        if not 1 <= lo <= hi:
            raise ValueError(f"per-GPU batch bounds must satisfy 1 <= lo <= hi, got {(lo, hi)}")
        if self.min_gain < 0 or self.report_interval <= 0 or self.fit_interval <= 0:
            raise ValueError("min_gain must be >= 0 and the intervals positive")


def batch_range(init_batch_size: int, max_batch_size: int, min_batch_size: int | None = None,
                environ: Mapping[str, str] | None = None) -> tuple[int | None, int]:
    """The job's ``(min, max)`` total batch: the script's, narrowed by pollux-run's
    ``--min-batch-size``/``--max-batch-size`` as ``environ`` carries them (the worker's
    environment, read by the caller: ``elastic.factory``; None narrows nothing). The max
    never falls below ``init_batch_size`` (M0 is where training starts). Raises
    ValueError (one line) when nothing is left."""
    environ = {} if environ is None else environ
    lo, hi = min_batch_size, max_batch_size
    try:
        if environ.get(envvars.MIN_BATCH_SIZE):
            lo = max(lo or 1, int(environ[envvars.MIN_BATCH_SIZE]))
        if environ.get(envvars.MAX_BATCH_SIZE):
            hi = min(hi, int(environ[envvars.MAX_BATCH_SIZE]))
    except ValueError:
        raise ValueError(f"${envvars.MIN_BATCH_SIZE}/${envvars.MAX_BATCH_SIZE} must be "
                         "integers") from None
    if hi < init_batch_size:
        raise ValueError(f"batch-size range: max {hi} is below the initial batch size "
                         f"{init_batch_size}, where training starts; raise it")
    if lo is not None and lo > hi:
        raise ValueError(f"batch-size range: min {lo} is above max {hi} (the script's and "
                         "--min-batch-size/--max-batch-size together); widen one of them")
    return lo, hi


def default_lr_rule(optimizer: Any) -> str:
    """AdaScale for SGD-like optimisers, square root for Adam-family (Pollux Sec. 3.1)."""
    return "sqrt" if type(optimizer).__name__ in ADAM_LIKE else "adascale"


class GoodputTuner:
    def __init__(
        self,
        config: TunerConfig,
        profile: StepProfile,
        grad_stats: Callable[[], GradNoise | None],
        progress: StatisticalProgress,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.profile, self.progress = config, profile, progress
        self._grad_stats, self._clock = grad_stats, clock
        self._perf: PerfParams | None = None
        self._fitted_at = -math.inf
        self._fitted_len = -1
        self._last_report = -math.inf
        self._fit_errors: set[tuple[str, str]] = set()  # (type, first line) already logged
        self._grids: GridCache = {}  # candidate (m, s) grids: shared by all this job's fits

    # -- the model -------------------------------------------------------------------
    def perf_params(self, refit: bool = True) -> PerfParams | None:
        """The fitted throughput model (refitted when due and the profile grew; with
        ``refit=False`` only if there is no model yet)."""
        now = self._clock()
        due = self._perf is None or (
            refit and now - self._fitted_at >= self.config.fit_interval)
        if due and len(self.profile) and len(self.profile) != self._fitted_len:
            inputs = self.profile.fit_inputs()
            try:
                self._perf = fit_perf_params(**inputs)
            except (ValueError, ArithmeticError) as exc:  # bad observations, numeric trouble
                self._fit_failed(exc)  # the previous fit stands
            self._fitted_at, self._fitted_len = now, len(self.profile)
        return self._perf

    def _fit_failed(self, exc: Exception) -> None:
        """Log a failed fit once per kind (type and first line): a fit is retried every
        ``fit_interval``, and the same failure would otherwise fill the log."""
        first = (str(exc).splitlines() or [""])[0][:300]
        said = (type(exc).__name__, first)
        if said in self._fit_errors or len(self._fit_errors) >= 64:
            return
        self._fit_errors.add(said)
        log.warning("throughput-model fit failed (%s: %s); %s", said[0], first,
                    "keeping the previous fit" if self._perf is not None
                    else "no model yet: decisions use the default batch")

    def goodput_function(self, refit: bool = True) -> GoodputFunction | None:
        perf, grad = self.perf_params(refit), self._grad_stats()
        if perf is None or grad is None:
            return None
        return GoodputFunction(perf, grad.to_grad_params(), self.config.init_batch_size,
                               grid_cache=self._grids)

    # -- decisions -------------------------------------------------------------------
    def default_batch(self, num_replicas: int) -> tuple[int, int]:
        """(m, s) before any model: keep the total batch near M0 (within the range)."""
        lo, hi = self.config.local_bsz_bounds
        m0 = max(self.config.init_batch_size, self.config.min_batch_size or 0)
        m = min(max(math.ceil(m0 / num_replicas), lo), hi)
        s = 0
        if self.config.gradient_accumulation and m * num_replicas < m0:
            s = math.ceil(m0 / (m * num_replicas)) - 1
        return m, s

    def choose(
        self, num_nodes: int, num_replicas: int, current: tuple[int, int] | None = None,
        refit: bool = True,
    ) -> tuple[int, int]:
        """Best (m, s) for this allocation; ``current`` is kept unless the predicted
        goodput gain exceeds ``min_gain`` (or ``current`` no longer fits the bounds).
        ``refit=False`` decides with the current model (inside a rescale's pause: a fit
        takes tens of ms; the next regular decision refits)."""
        cfg = self.config
        fn = self.goodput_function(refit)
        if fn is None:
            return (
                current
                if current and self._fits(current, num_replicas)
                else self.default_batch(num_replicas)
            )
        fixed = None if cfg.adaptive_batch_size else cfg.init_batch_size
        nodes, reps = np.array([num_nodes]), np.array([num_replicas])
        goodput, m, s = fn.optimize(
            nodes,
            reps,
            cfg.max_batch_size,
            cfg.local_bsz_bounds,
            accumulation=cfg.gradient_accumulation,
            fixed_batch_size=fixed,
            min_batch_size=cfg.min_batch_size,
        )
        best = (int(m[0]), int(s[0]))
        if best[0] < 1:  # nothing fits: stay where we are if we can
            return current if current else self.default_batch(num_replicas)
        if best == current:  # (the steady state: nothing to compare)
            return best
        if current and self._fits(current, num_replicas):
            now = fn.evaluate(nodes, reps, np.array([current[0]]), np.array([current[1]]))
            if float(goodput[0]) <= float(now[0]) * (1 + cfg.min_gain):
                return current
        return best

    def _fits(self, cand: tuple[int, int], num_replicas: int) -> bool:
        lo, hi = self.config.local_bsz_bounds
        m, s = cand
        total = num_replicas * m * (s + 1)
        if not self.config.adaptive_batch_size:
            return lo <= m <= hi
        return (lo <= m <= hi and total <= self.config.max_batch_size
                and total >= (self.config.min_batch_size or 0))

    def lr_factor(self, batch_size: int) -> float:
        scale = batch_size / self.config.init_batch_size
        if scale == 1:
            return 1.0
        grad = self._grad_stats()
        rule = self.config.lr_scaling
        if rule == "adascale" and grad is None:
            return 1.0  # no statistics yet: AdaScale's gain is unknown, be conservative
        stats = grad.to_grad_params() if grad is not None else None
        return float(scale_lr(rule, self.config.init_batch_size, batch_size, stats))

    # -- reporting -------------------------------------------------------------------
    def hints(
        self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int,
        restarts: int = 0, rescale_s: float | None = None,
        replicas_wanted: tuple[int, int] | None = None,
    ) -> JobHints:
        cfg = self.config
        perf, grad = self.perf_params(), self._grad_stats()
        max_reps, max_nodes = self.profile.max_profiled
        return JobHints(
            init_batch_size=cfg.init_batch_size,
            max_batch_size=cfg.max_batch_size,
            min_batch_size=cfg.min_batch_size,
            local_bsz_bounds=cfg.local_bsz_bounds,
            gradient_accumulation=cfg.gradient_accumulation,
            adaptive_batch_size=cfg.adaptive_batch_size,
            perf_params=perf.to_dict() if perf else None,
            grad_sqr=grad.sqr if grad else None,
            grad_var=grad.var if grad else None,
            max_profiled_replicas=max_reps,
            max_profiled_nodes=max_nodes,
            num_nodes=num_nodes,
            num_replicas=num_replicas,
            local_bsz=local_bsz,
            accum_steps=accum_steps,
            progress=self.progress.iterations,
            restarts=restarts,
            timestamp=time.time(),
            rescale_s=rescale_s,
            min_replicas_wanted=replicas_wanted[0] if replicas_wanted else None,
            max_replicas_wanted=(replicas_wanted[1] or None) if replicas_wanted else None,
        )

    def report_due(self) -> bool:
        return self._clock() - self._last_report >= self.config.report_interval

    def reported(self) -> None:
        """The hints were just handed to the store (``elastic.hints.HintsReporter``): the
        next report is due ``report_interval`` from now, whether the write succeeds or
        not (a failed one is tried again then)."""
        self._last_report = self._clock()

    # -- state that travels with the job (rank 0 -> newcomers) -----------------------
    def state_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.state_dict(), "progress": self.progress.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.profile.load_state_dict(state["profile"])
        self.progress.load_state_dict(state["progress"])
        self._fitted_len = -1  # refit from the received profile
