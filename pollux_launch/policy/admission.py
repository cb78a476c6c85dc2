"""Admission control: which arrived jobs compete for GPUs (Saxena et al.'s autoscaler).

Pollux lets every job compete from its arrival, waiting with zero GPUs while the cluster
is full. Saxena et al. admit jobs one at a time, in arrival order, while the optimiser
stays feasible (every admitted job gets at least the GPUs it needs to run), and either
queue or drop the rest. One pure function decides for the coordinator and the
simulator alike:

* ``none``: every job is admitted on arrival (Pollux);
* ``queue``: jobs wait in arrival order (no job overtakes an earlier one) until they fit;
  with ``max_wait`` a job that waited that long is dropped;
* ``drop``: a job that does not fit when it arrives is dropped at once.

"Fits": the GPUs the admitted jobs need to run (each its ``min_replicas``, at least 1)
plus the candidate's are within the cluster's, and fewer than ``max_running`` jobs are
admitted. The cluster policy then divides the GPUs among the admitted jobs only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ADMISSION_MODES = ("none", "queue", "drop")


@dataclass(frozen=True)
class AdmissionConfig:
    """``mode``: one of ADMISSION_MODES; ``max_wait``: seconds a queued job may wait
    before it is dropped (queue mode; None: for ever); ``max_running``: most admitted jobs
    at once (None: as many as fit)."""

    mode: str = "none"
    max_wait: float | None = None
    max_running: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"admission mode must be one of {', '.join(ADMISSION_MODES)}, "
                             f"got {self.mode!r}")
        if self.max_wait is not None and not self.max_wait >= 0:
            raise ValueError(f"max wait must be >= 0 seconds, got {self.max_wait}")
        if self.max_running is not None and (isinstance(self.max_running, bool)
                                             or self.max_running < 1):
            raise ValueError(f"max running jobs must be >= 1, got {self.max_running}")
        if self.mode == "none" and (self.max_wait is not None or self.max_running is not None):
            raise ValueError("--max-wait and --max-running need --admission queue or drop")
        if self.mode == "drop" and self.max_wait is not None:
            raise ValueError("--max-wait applies to --admission queue (drop never waits)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class Candidate:
    """A job as admission sees it: its arrival time and the GPUs it needs to run."""

    name: str
    arrival: float
    min_replicas: int = 1

    @property
    def need(self) -> int:
        return max(1, self.min_replicas)


@dataclass(frozen=True)
class AdmissionDecision:
    """Names admitted now, dropped now (with a one-line reason each), and still waiting."""

    admit: tuple[str, ...] = ()
    drop: tuple[tuple[str, str], ...] = ()
    wait: tuple[str, ...] = ()


def decide_admission(config: AdmissionConfig, waiting: Sequence[Candidate],
                     admitted: Sequence[Candidate], capacity: int, now: float
                     ) -> AdmissionDecision:
    """Who of ``waiting`` (arrived, not admitted yet) is admitted, dropped or kept waiting,
    given the unfinished ``admitted`` jobs and ``capacity`` GPUs (module docstring)."""
    order = sorted(waiting, key=lambda c: (c.arrival, c.name))
    if not config.enabled:
        return AdmissionDecision(admit=tuple(c.name for c in order))
    used = sum(c.need for c in admitted)
    running = len(admitted)
    admit: list[str] = []
    drop: list[tuple[str, str]] = []
    wait: list[str] = []
    blocked = False  # an earlier job waits: no later one overtakes it
    for c in order:
        full = config.max_running is not None and running >= config.max_running
        fits = not full and used + c.need <= capacity
        if fits and not blocked:
            admit.append(c.name)
            used, running = used + c.need, running + 1
            continue
        why = (f"{running} jobs are running, the most --max-running allows" if full
               else f"it needs {c.need} GPU(s) and the running jobs need {used} of "
                    f"{capacity}" if not fits else "earlier jobs are waiting")
        if config.mode == "drop":
            drop.append((c.name, f"the cluster cannot take it now: {why}"))
        elif config.max_wait is not None and now - c.arrival >= config.max_wait:
            drop.append((c.name, f"not started within --max-wait {config.max_wait:g} s: "
                                 f"{why}"))
        else:
            wait.append(c.name)
            blocked = True
    return AdmissionDecision(tuple(admit), tuple(drop), tuple(wait))
