"""Step-time profile: what the throughput model is fitted to (Pollux Sec. 3.2, Eqn 7-11).

Each optimiser step's wall time (all ``s + 1`` micro-batches, the gradient
synchronisation and the optimiser update) and, where measurable, its *exposed*
synchronisation part (time spent waiting for the gradient all-reduce after the local
backward pass finished) are accumulated per configuration key ``(num_nodes, num_replicas,
local_bsz, accum_steps)``, where ``accum_steps = s`` counts the *extra* micro-batches (a
step processes ``s + 1``). The first ``warmup_steps`` steps after any change of key are not
recorded (allocator warm-up, new process group, data-loader restart).

:meth:`StepProfile.fit_inputs` returns exactly the arrays of the goodput core's
``fit_perf_params(num_nodes, num_replicas, local_bsz, accum_steps, step_time, sync_time)``.
The state is plain JSON, so rank 0 can put it in the store and broadcast it on a rescale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

STATE_VERSION = 1


@dataclass(frozen=True, order=True)
class ProfileKey:
    num_nodes: int
    num_replicas: int
    local_bsz: int
    accum_steps: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_replicas < self.num_nodes:
            raise ValueError(
                f"need 1 <= num_nodes <= num_replicas, got {self.num_nodes}, {self.num_replicas}"
            )
        if self.local_bsz < 1 or self.accum_steps < 0:
            raise ValueError(
                f"need local_bsz >= 1 and accum_steps >= 0, got {self.local_bsz}, "
                f"{self.accum_steps}"
            )


@dataclass
class _Totals:
    count: int = 0
    step_time: float = 0.0
    sync_count: int = 0
    sync_time: float = 0.0


FIELDS = ("num_nodes", "num_replicas", "local_bsz", "accum_steps", "step_time", "sync_time")


class StepProfile:
    """Per-key step-time sums with warm-up skipping."""

    def __init__(self, warmup_steps: int = 3) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self._totals: dict[ProfileKey, _Totals] = {}
        self._key: ProfileKey | None = None
        self._current: _Totals | None = None  # the totals of _key, once it has any
        self._since_change = 0
        # the newest step's (step_time, sync_time), warm-up included: what adaptation
        # policies read (pollux_launch.elastic.adaptation)
        self.last: tuple[float, float | None] | None = None

    @property
    def key(self) -> ProfileKey | None:
        return self._key

    def set_key(self, key: ProfileKey) -> None:
        """The configuration the next steps run under; a change restarts the warm-up."""
        if key != self._key:
            self._key, self._current = key, None
            self._since_change = 0

    @property
    def warm(self) -> bool:
        """Whether the current configuration's warm-up is over (its steps are kept)."""
        return self._key is not None and self._since_change >= self.warmup_steps

    def record(self, step_time: float, sync_time: float | None = None,
               steps: int = 1) -> bool:
        """One step's time (seconds), or the mean of ``steps`` steps after the warm-up
        (``sync_time``: the last one's); returns whether it was kept (not
        warm-up/invalid)."""
        if self._key is None:
            raise RuntimeError("StepProfile.record before set_key: say which configuration ran")
        self.last = (step_time, sync_time)
        self._since_change += steps
        if self._since_change <= self.warmup_steps:
            return False
        if not (math.isfinite(step_time) and step_time > 0.0):
            return False
        t = self._current
        if t is None:  # (looked up once per key, not per step: a dataclass hashes slowly)
            t = self._current = self._totals.setdefault(self._key, _Totals())
        t.count += steps
        t.step_time += step_time * steps
        if sync_time is not None and math.isfinite(sync_time) and sync_time >= 0.0:
            t.sync_count += 1
            t.sync_time += min(sync_time, step_time)
        return True

    def __len__(self) -> int:
        return len(self._totals)

    def arrays(self) -> dict[str, np.ndarray]:
        """Per-key means, keys sorted; ``sync_time`` is NaN where never measured."""
        keys = sorted(self._totals)
        tot = [self._totals[k] for k in keys]
        return {
            "num_nodes": np.array([k.num_nodes for k in keys], dtype=np.int64),
            "num_replicas": np.array([k.num_replicas for k in keys], dtype=np.int64),
            "local_bsz": np.array([k.local_bsz for k in keys], dtype=np.int64),
            "accum_steps": np.array([k.accum_steps for k in keys], dtype=np.int64),
            "step_time": np.array([t.step_time / t.count for t in tot], dtype=np.float64),
            "sync_time": np.array(
                [t.sync_time / t.sync_count if t.sync_count else np.nan for t in tot],
                dtype=np.float64,
            ),
        }

    def fit_inputs(self) -> dict[str, np.ndarray | None]:
        """Keyword arguments for ``goodput.fit_perf_params``; ``sync_time`` is None unless
        measured for every key."""
        out: dict[str, np.ndarray | None] = dict(self.arrays())
        sync = out["sync_time"]
        if sync is None or sync.size == 0 or np.isnan(sync).any():
            out["sync_time"] = None
        return out

    @property
    def max_profiled(self) -> tuple[int, int]:
        """``(max_profiled_replicas, max_profiled_nodes)`` for the job hints."""
        if not self._totals:
            return 0, 0
        return (
            max(k.num_replicas for k in self._totals),
            max(k.num_nodes for k in self._totals),
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: a list of ``[nodes, replicas, local_bsz, accum, count, step_sum,
        sync_count, sync_sum]`` rows."""
        rows = [
            [
                k.num_nodes,
                k.num_replicas,
                k.local_bsz,
                k.accum_steps,
                t.count,
                t.step_time,
                t.sync_count,
                t.sync_time,
            ]
            for k, t in sorted(self._totals.items())
        ]
        return {"v": STATE_VERSION, "warmup_steps": self.warmup_steps, "rows": rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the totals with ``state`` (the current key and warm-up are kept)."""
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"StepProfile state: expected a dict with v={STATE_VERSION}")
        totals: dict[ProfileKey, _Totals] = {}
        try:
            for row in state["rows"]:
                nodes, reps, bsz, accum, count, step, sync_count, sync = row
                key = ProfileKey(int(nodes), int(reps), int(bsz), int(accum))
                totals[key] = _Totals(int(count), float(step), int(sync_count), float(sync))
            self.warmup_steps = int(state["warmup_steps"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"StepProfile state is malformed: {exc}") from None
        self._totals, self._current = totals, None
