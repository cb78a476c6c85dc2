"""Workload CSVs in the Pollux trace format: ``name,time,application,num_replicas,batch_size``.

``time`` is the submission time in seconds; ``num_replicas`` / ``batch_size`` are the
hand-tuned (TunedJobs) settings that only non-adaptive baselines use, so they may be
absent for adaptive policies. Every problem is reported as one ``WorkloadError`` line
naming the file, the row (1-based line number, header = line 1) and the column.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REQUIRED_COLUMNS = ("name", "time", "application")
TUNED_COLUMNS = ("num_replicas", "batch_size")


class WorkloadError(ValueError):
    """A workload file the simulator cannot replay; the message says what and where."""


@dataclass(frozen=True)
class JobSpec:
    """One submitted job."""

    name: str
    submit_time: float
    application: str
    num_replicas: int | None = None  # TunedJobs: fixed number of GPUs
    batch_size: int | None = None  # TunedJobs: fixed total batch size


def load_workload(path: str | Path, known_models: Iterable[str]) -> list[JobSpec]:
    """Read and validate a workload CSV; jobs come back sorted by submission time."""
    path = Path(path)
    known = sorted(known_models)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            rows = list(reader)
    except FileNotFoundError:
        raise WorkloadError(f"workload {path}: file not found") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise WorkloadError(f"workload {path}: cannot read it as CSV ({exc})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise WorkloadError(
            f"workload {path}: missing column(s) {', '.join(missing)}; the header must "
            f"include {','.join(REQUIRED_COLUMNS)} (and {','.join(TUNED_COLUMNS)} for "
            "TunedJobs baselines)")
    if not rows:
        raise WorkloadError(f"workload {path}: no jobs (only a header)")
    has_tuned = all(c in header for c in TUNED_COLUMNS)
    jobs, seen = [], {}
    for line, raw in enumerate(rows, start=2):
        row = {(k or "").strip(): (v or "").strip() if isinstance(v, str) else v
               for k, v in raw.items()}

        def bad(col: str, why: str, line=line) -> WorkloadError:
            return WorkloadError(f"workload {path}, row {line}, column '{col}': {why}")

        name = row["name"]
        if not name:
            raise bad("name", "empty job name")
        if name in seen:
            raise bad("name", f"duplicate job name {name!r} (first on row {seen[name]})")
        seen[name] = line
        try:
            t = float(row["time"])
        except (TypeError, ValueError):
            raise bad("time", f"{row['time']!r} is not a number of seconds") from None
        if not math.isfinite(t) or t < 0:
            raise bad("time", f"submission time {row['time']} must be a finite number >= 0")
        app = row["application"]
        if app not in known:
            raise bad("application", f"unknown application {app!r}; known: {', '.join(known)}")
        tuned: list[int | None] = [None, None]
        if has_tuned:
            for k, col in enumerate(TUNED_COLUMNS):
                text = row[col]
                try:
                    value = int(float(text))
                    ok = value >= 1 and float(text) == value
                except (TypeError, ValueError, OverflowError):
                    ok = False
                if not ok:
                    raise bad(col, f"{text!r} must be a positive integer")
                tuned[k] = value
        jobs.append(JobSpec(name, t, app, tuned[0], tuned[1]))
    jobs.sort(key=lambda j: j.submit_time)  # stable: ties keep file order
    return jobs
