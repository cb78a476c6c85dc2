"""Synthetic speedup functions for policy tests: concave in replicas, slower across nodes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pollux_launch.policy import JobInfo, PolicyNode


@dataclass(frozen=True)
class Amdahl:
    """speedup(n, k) = k / (1 + serial * (k - 1)) * (1 - cross_node * [n > 1]), 0 at k = 0."""

    serial: float = 0.05
    cross_node: float = 0.2

    def __call__(self, num_nodes: np.ndarray, num_replicas: np.ndarray) -> np.ndarray:
        k = np.asarray(num_replicas, dtype=float)
        n = np.asarray(num_nodes)
        s = k / (1.0 + self.serial * np.maximum(k - 1.0, 0.0))
        return np.where(k > 0, s * np.where(n > 1, 1.0 - self.cross_node, 1.0), 0.0)


def make_jobs(specs, age: float = 3600.0) -> list[JobInfo]:
    """specs: iterable of (serial, cross_node) or dicts of JobInfo fields + those."""
    jobs = []
    for i, spec in enumerate(specs):
        spec = dict(spec) if isinstance(spec, dict) else {"serial": spec[0], "cross_node": spec[1]}
        fn = Amdahl(spec.pop("serial", 0.05), spec.pop("cross_node", 0.2))
        spec.setdefault("age", age)
        jobs.append(JobInfo(name=spec.pop("name", f"job{i}"), speedup_fn=fn, **spec))
    return jobs


def make_nodes(count: int, slots: int = 4) -> list[PolicyNode]:
    return [PolicyNode(f"node{i}", slots) for i in range(count)]


def random_round(rng: np.random.Generator, n_nodes: int, n_jobs: int, slots: int = 4):
    """A random round: jobs with random scalability, limits and a feasible current state."""
    nodes = make_nodes(n_nodes, slots)
    specs = []
    for _ in range(n_jobs):
        lo = int(rng.integers(0, 3))
        specs.append(
            {
                "serial": float(rng.uniform(0.0, 0.5)),
                "cross_node": float(rng.uniform(0.0, 0.6)),
                "age": float(rng.choice([0.0, 30.0, 600.0, 7200.0])),
                "restarts": int(rng.integers(0, 4)),
                "min_replicas": lo,
                "max_replicas": int(rng.integers(max(lo, 1), 3 * slots + 1)),
                "preemptible": bool(rng.random() > 0.2),
            }
        )
    jobs = make_jobs(specs)
    # a feasible current allocation: single-node jobs placed first-fit
    current = np.zeros((n_jobs, n_nodes), dtype=np.int64)
    free = np.full(n_nodes, slots)
    for j, job in enumerate(jobs):
        if rng.random() < 0.5 or max(job.min_replicas, 1) > min(job.max_replicas, slots):
            continue
        k = int(rng.integers(max(job.min_replicas, 1), min(job.max_replicas, slots) + 1))
        fits = np.flatnonzero(free >= k)
        if fits.size:
            current[j, fits[0]] = k
            free[fits[0]] -= k
    return jobs, nodes, current
