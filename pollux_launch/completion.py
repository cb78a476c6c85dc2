"""When a job has completed: every worker of its final group exited 0 (torchrun waits for
every rank; a rank that finishes early ends nothing).

Protocol (keys in ``pollux_launch.keys``):

* A worker that exits 0 while its replica is still allocated completed the script: its
  node agent puts ``jobs/<job>/finished/<worker>`` (``WorkerFinished``, with the group
  it ran in). From the first such record on the job is *completing*: no agent starts or
  replaces a process of it, and the coordinator does not change its allocation.
* Its final group is a live job's last formed rendezvous round (its members), else the
  allocation's replicas in the current generation (allocation term and version, and a
  restart-elastic job's restarts after failures: a restarted group starts afresh).
* The job has succeeded once every worker of that group has a record; the agent whose
  record completes it says so. Until then the others run as long as they run: nothing
  ends them early.
* A worker of a completing job that ends any other way (an error exit, or killed by a
  signal: it cannot be replaced any more) fails the job.

:func:`completion` is pure: one read of the job's keys in, a :class:`Completion` out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from . import keys
from .messages import (
    Allocation,
    JobGeneration,
    JobSpec,
    MessageError,
    WorkerFinished,
    decode,
)
from .rendezvous.rounds import JobKeys, last_formed


@dataclass(frozen=True)
class Completion:
    """How far a job's final group has completed: ``finished`` of its ``group`` workers."""

    finished: int = 0
    group: int = 0

    @property
    def begun(self) -> bool:
        return self.finished > 0

    @property
    def done(self) -> bool:
        return self.begun and self.finished >= self.group


def generation(alloc: Allocation | None, restarts: int) -> tuple[int, int, int]:
    """The group a worker runs in: its allocation's (term, version) and the restarts."""
    return (alloc.term, alloc.version, restarts) if alloc is not None else (0, 0, restarts)


def completion(spec: JobSpec, alloc: Allocation | None, values: Mapping[str, str]) -> Completion:
    """The job's completion from ``values`` (its keys -> values, one read; malformed
    records are skipped: a store writer can delay a job's success, never fake it - a
    record only counts for a worker of the group)."""
    prefix = keys.job(spec.name, keys.FINISHED)
    marks: dict[str, WorkerFinished] = {}
    for key, value in values.items():
        if key.startswith(prefix):
            try:
                marks[key[len(prefix):]] = decode(WorkerFinished, value)
            except MessageError:
                continue
    if not marks:  # (the common case, every pass: nothing else to read)
        return Completion()
    if spec.elasticity == "live":
        try:
            formed = last_formed(JobKeys(spec.name), values)
        except MessageError:
            formed = None
        if formed is not None:
            return Completion(sum(w in marks for w in formed.members), len(formed.members))
        return Completion(len(marks), alloc.num_replicas if alloc else 0)
    restarts = 0
    raw = values.get(keys.job(spec.name, "generation"))
    if raw is not None:
        try:
            restarts = decode(JobGeneration, raw).restarts
        except MessageError:
            pass  # (the restart driver reads it as none too)
    current = generation(alloc, restarts)
    return Completion(sum(m.generation == current for m in marks.values()),
                      alloc.num_replicas if alloc else 0)
