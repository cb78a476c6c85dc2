"""What a change of allocation costs a job, by how the job rescales (pure).

One model serves the simulator (which charges it) and the coordinator (whose
re-allocation penalty, Pollux Sec. 4.2, uses each job's expected stall as its delta).
Its figures are *calibrated*: ``benchmarks/rescale.py --write-calibration`` measures
them on a machine and :mod:`pollux_launch.calibration` reads them back.

Models (``RESCALE_MODELS``), for a job going from ``old`` to ``new`` replicas:

* ``live`` (survivors keep their processes, as pollux-launch's live path does):
  - start (``old == 0``): the workers start (``start_s``) and form a group;
  - grow (any newcomer): the old group trains on while the newcomers start
    (``start_s`` of *overlap*: their GPUs idle, the job does not stall), then the
    survivors pause for ``grow_s + state_bytes / broadcast_bps`` (the state broadcast);
  - shrink (survivors only): the survivors pause ``shrink_s`` (no state moves);
  every new group also costs ``per_replica_s`` per member (round formation).
* ``restart`` (torchrun-style): every worker stops and starts again, ``restart_s``,
  and a running job reloads its state from a checkpoint (``state_bytes / checkpoint_bps``).
* ``checkpoint-restart``: the Pollux paper's flat ``checkpoint_restart_s`` (30 s) per
  change, the first start included.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

RESCALE_MODELS = ("live", "restart", "checkpoint-restart")

#: state a job is assumed to carry when it did not say (a ResNet-50 with SGD momentum)
DEFAULT_STATE_BYTES = 2 * 4 * 25_600_000

#: rounds are this many times a typical change's stall apart (Pollux: 60 s for 30 s) ...
INTERVAL_PER_STALL = 20.0
#: ... within these bounds: agents refit and report about every 30 s, so much shorter
#: rounds decide on stale models; longer than the paper's 60 s only delays new jobs.
MIN_INTERVAL_S, MAX_INTERVAL_S = 15.0, 60.0


@dataclass(frozen=True)
class RescaleCost:
    """Calibrated costs of a change (seconds, bytes per second); see the module doc."""

    start_s: float = 2.5
    shrink_s: float = 0.05
    grow_s: float = 0.1
    per_replica_s: float = 0.005
    broadcast_bps: float = 1.0e9
    restart_s: float = 2.0
    checkpoint_bps: float = 0.5e9
    checkpoint_restart_s: float = 30.0
    source: str = "built-in defaults"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source":
                if not isinstance(value, str):
                    raise ValueError("rescale cost: 'source' must be a string")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"rescale cost: {f.name} must be a finite number >= 0, "
                                 f"got {value!r}")
            if f.name.endswith("_bps") and value <= 0:
                raise ValueError(f"rescale cost: {f.name} must be > 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: object) -> RescaleCost:
        """Validate a decoded calibration (unknown keys are an error: a typo must not
        silently fall back to a default)."""
        if not isinstance(data, dict):
            raise ValueError("rescale cost: expected a JSON object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"version", "measured"})
        if unknown:
            raise ValueError(f"rescale cost: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)

    # -- the model ---------------------------------------------------------------------
    def transition(self, model: str, state_bytes: float, old: int, new: int,
                   newcomers: bool) -> tuple[float, float]:
        """``(overlap_s, stall_s)`` of one change from ``old`` to ``new`` replicas.

        ``overlap_s``: seconds the job still runs on its old allocation while newcomers
        start; ``stall_s``: seconds it then makes no progress. ``newcomers``: the new
        allocation starts a worker where none ran (a grow or a move), as opposed to only
        removing workers.
        """
        if model == "checkpoint-restart":
            return 0.0, self.checkpoint_restart_s
        if model == "restart":
            load = state_bytes / self.checkpoint_bps if old > 0 else 0.0
            return 0.0, self.restart_s + load
        if model != "live":
            raise ValueError(f"unknown rescale model {model!r}; one of {RESCALE_MODELS}")
        form = self.per_replica_s * new
        if old <= 0:
            return 0.0, self.start_s + form
        if newcomers:
            return self.start_s, self.grow_s + state_bytes / self.broadcast_bps + form
        return 0.0, self.shrink_s + form

    def expected_stall(self, model: str, state_bytes: float, replicas: int) -> float:
        """The policy's delta for a running job (Sec. 4.2): the stall of a grow, the
        dearer kind of change, at ``replicas``."""
        return self.transition(model, state_bytes, max(1, replicas), max(1, replicas),
                               newcomers=True)[1]

    def round_interval(self, model: str) -> float:
        """Default seconds between scheduling rounds: cheap changes, frequent rounds."""
        stall = self.expected_stall(model, DEFAULT_STATE_BYTES, 4)
        return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, INTERVAL_PER_STALL * stall))
