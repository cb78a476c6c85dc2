"""Workload CSVs in the Pollux trace format: ``name,time,application,num_replicas,batch_size``.

``time`` is the submission time in seconds; ``num_replicas`` / ``batch_size`` are the
hand-tuned (TunedJobs) settings that only non-adaptive baselines use, so they may be
absent for adaptive policies. Every problem is reported as one ``WorkloadError`` line
naming the file, the row (1-based line number, header = line 1) and the column.

Optional columns, each job's limits as Saxena et al. declare them (any subset; an empty
cell leaves that job without the limit): ``min_batch_size`` and ``max_batch_size``, the
range of total batch sizes the job may train at (default: the model's, M0 to its largest
validated batch; the simulator checks the range against the model), and
``max_replicas``, the most GPUs it may use. :func:`write_workload` writes the format.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pollux_launch.errors import UserError

REQUIRED_COLUMNS = ("name", "time", "application")
TUNED_COLUMNS = ("num_replicas", "batch_size")
LIMIT_COLUMNS = ("min_batch_size", "max_batch_size", "max_replicas")


class WorkloadError(UserError, ValueError):
    """A workload file the simulator cannot replay; the message says what and where."""


@dataclass(frozen=True)
class TraceJob:
    """One row of a workload trace: when a job arrives, the model it trains and the
    limits the trace gives it. Not the store's ``messages.JobSpec``: the simulator
    writes that one from a trace job's state (``SimJob.spec_message``)."""

    name: str
    submit_time: float
    application: str
    num_replicas: int | None = None  # TunedJobs: fixed number of GPUs
    batch_size: int | None = None  # TunedJobs: fixed total batch size
    min_batch_size: int | None = None  # the job's batch-size range (None: the model's)
    max_batch_size: int | None = None
    max_replicas: int | None = None  # most GPUs the job may use (None: no cap)


def load_workload(path: str | Path, known_models: Iterable[str]) -> list[TraceJob]:
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
    limit_cols = [c for c in LIMIT_COLUMNS if c in header]
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
                value = _positive_int(text)
                if value is None:
                    raise bad(col, f"{text!r} must be a positive integer")
                tuned[k] = value
        limits: dict[str, int] = {}
        for col in limit_cols:
            text = row[col] or ""
            if not text:
                continue  # no limit for this job
            value = _positive_int(text)
            if value is None:
                raise bad(col, f"{text!r} must be a positive integer (or empty: no limit)")
            limits[col] = value
        if limits.get("min_batch_size", 0) > limits.get("max_batch_size", math.inf):
            raise bad("min_batch_size", f"min_batch_size {limits['min_batch_size']} exceeds "
                                        f"max_batch_size {limits['max_batch_size']}")
        jobs.append(TraceJob(name, t, app, tuned[0], tuned[1], **limits))
    jobs.sort(key=lambda j: j.submit_time)  # stable: ties keep file order
    return jobs


def _positive_int(text) -> int | None:
    """``text`` as an int >= 1 (``"4"`` or ``"4.0"``), None if it is not one."""
    try:
        value = int(float(text))
        return value if value >= 1 and float(text) == value else None
    except (TypeError, ValueError, OverflowError):
        return None


def write_workload(specs: Iterable[TraceJob], path: str | Path) -> Path:
    """Write ``specs`` as a workload CSV that :func:`load_workload` reads back unchanged.

    Columns: the required ones, the TunedJobs ones if every job has them, and each limit
    column that some job sets (empty cells for the jobs without it).
    """
    specs = list(specs)
    tuned = bool(specs) and all(s.num_replicas is not None and s.batch_size is not None
                                for s in specs)
    limits = [c for c in LIMIT_COLUMNS if any(getattr(s, c) is not None for s in specs)]
    header = [*REQUIRED_COLUMNS, *(TUNED_COLUMNS if tuned else ()), *limits]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        for s in specs:
            t = s.submit_time
            row = [s.name, str(int(t)) if t == int(t) else repr(float(t)), s.application]
            if tuned:
                row += [s.num_replicas, s.batch_size]
            row += ["" if getattr(s, c) is None else getattr(s, c) for c in limits]
            out.writerow(row)
    return path
