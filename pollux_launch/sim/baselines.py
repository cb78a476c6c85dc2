"""Baselines: TunedJobs gang scheduling (FIFO or least attained service), and max-bs.

``max-bs`` is the baseline of Saxena et al. (MASCOTS 2020) that scales GPUs but cannot
vary batch sizes: exactly the ``saxena-dp`` engine (the same throughput-maximising DP
over jobs x GPUs, every job given >= 1 GPU), with every adaptive job's total batch size
fixed at the top of its range (``max_batch_size``, default the model's largest validated
batch) - in the simulated world (the job trains at that batch on whatever GPUs it gets,
split evenly, with gradient accumulation where one GPU cannot hold its share) and in what
the policy sees (``JobInfo.throughput_fn`` and ``speedup_fn`` at that fixed batch). Its
GPUs are still elastic; only the batch size is not.

A TunedJobs job runs on exactly the hand-tuned number of GPUs from the workload's
``num_replicas`` column (passed as :attr:`JobInfo.max_replicas`) with its fixed
``batch_size``, or not at all. ``tuned-las`` is Tiresias' discretised two-queue LAS
(Gu et al., NSDI'19) as the Pollux authors configured it for their comparison: a job is
demoted once it has attained 16 GPU-hours; within a queue, first come first served.
``tuned-fifo`` is one queue in submission order. Admission is greedy in priority order
(a job that does not fit is skipped, smaller ones behind it may run); running jobs keep
their GPUs; new ones are packed onto the nodes with the most free GPUs first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollux_launch.policy import JobInfo, Policy, PolicyNode

LAS_QUEUE_THRESHOLD = 16 * 3600.0  # GPU-seconds of attained service before demotion


class TunedJobsPolicy(Policy):
    """Gang-schedules each job at ``max_replicas`` GPUs, in FIFO or two-level LAS order.

    Keeps per-job state across rounds (attained service, queue order), as Tiresias does;
    attained service is measured from the jobs' ages and the allocation in force.
    """

    def __init__(self, discipline: str = "las", queue_threshold: float = LAS_QUEUE_THRESHOLD):
        if discipline not in ("las", "fifo"):
            raise ValueError(f"unknown TunedJobs discipline {discipline!r}; use 'las' or 'fifo'")
        self.name = f"tuned-{discipline}"
        self.discipline = discipline
        self.queue_threshold = float(queue_threshold)
        self._seq = 0
        self._arrival: dict[str, int] = {}  # order a job entered its current queue
        self._demoted: set[str] = set()
        self._service: dict[str, float] = {}  # attained GPU-seconds
        self._last_age: dict[str, float] = {}

    def optimize(self, jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode],
                 current: np.ndarray) -> np.ndarray:
        current = np.asarray(current, dtype=int).reshape(len(jobs), len(nodes))
        names = {j.name for j in jobs}
        for table in (self._arrival, self._service, self._last_age):
            for gone in [k for k in table if k not in names]:
                del table[gone]
        self._demoted &= names
        for j, job in enumerate(jobs):
            if job.name not in self._arrival:
                self._arrival[job.name] = self._next_seq()
                self._service[job.name] = 0.0
            else:  # service attained since the last round under the allocation in force
                elapsed = max(job.age - self._last_age[job.name], 0.0)
                self._service[job.name] += elapsed * int(current[j].sum())
            self._last_age[job.name] = job.age
            if (self.discipline == "las" and job.name not in self._demoted
                    and self._service[job.name] >= self.queue_threshold):
                self._demoted.add(job.name)
                self._arrival[job.name] = self._next_seq()  # joins the back of queue 1

        def priority(j: int):
            job = jobs[j]
            pinned = not job.preemptible and current[j].sum() > 0
            return (not pinned, job.name in self._demoted, self._arrival[job.name])

        slots = np.array([n.slots for n in nodes], dtype=int)
        free_total = int(slots.sum())
        admitted = []
        for j in sorted(range(len(jobs)), key=priority):
            need = max(int(jobs[j].max_replicas), 1)
            if need <= free_total:
                admitted.append(j)
                free_total -= need
        out = np.zeros_like(current)
        keep = [j for j in admitted if current[j].sum() == max(jobs[j].max_replicas, 1)]
        for j in keep:
            out[j] = current[j]
        free = slots - out.sum(axis=0)
        for j in admitted:
            if j in keep:
                continue
            need = max(int(jobs[j].max_replicas), 1)
            while need > 0:  # most free GPUs first, lowest index on ties
                n = int(np.argmax(free))
                take = min(int(free[n]), need)
                out[j, n] += take
                free[n] -= take
                need -= take
        return out

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


BASELINES = {
    "tuned-las": lambda **_: TunedJobsPolicy("las"),
    "tuned-fifo": lambda **_: TunedJobsPolicy("fifo"),
}


#: Baselines that keep adaptive GPU counts but fix every job's batch at its maximum:
#: name -> the engine that divides the GPUs (``SimConfig.fixed_max_batch`` does the rest).
FIXED_BATCH_BASELINES = {"max-bs": "saxena-dp"}
