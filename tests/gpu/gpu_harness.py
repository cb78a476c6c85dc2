"""The GPU suite's harness (``tests/gpu``): a job of real ``gpu_worker.py`` processes on
an embedded store, started with the environment a node agent gives its workers, whose
allocations the test writes as the coordinator would; and what the workers recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import torch

from pollux_launch import env as envvars
from pollux_launch.messages import Allocation, encode
from pollux_launch.rendezvous.rounds import JobKeys
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("gpu_worker.py")
CUDA = torch.cuda.is_available()
NO_CUDA = ("CUDA is not available (torch.cuda.is_available() is False): the GPU suite "
           "runs only its [cpu] sanity variants here; run `pytest tests/gpu` on a GPU machine")
NODE = "n1"  # every worker on one node: local rank == rank


def expected_device(device: str, local_rank: int) -> str:
    """Where a worker with ``GPU_DEVICE=device`` and this local rank keeps its tensors."""
    if device == "cuda":
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    return device


class GpuJob:
    """One job's ``gpu_worker.py`` processes, its allocation and its workers' records."""

    def __init__(self, url: str, prefix: str, log_dir: Path, env: dict[str, str]) -> None:
        self.url, self.prefix, self.log_dir = url, prefix, log_dir
        self.name = f"gpu-{uuid.uuid4().hex[:8]}"
        self.keys = JobKeys(self.name)
        self.version = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = env

    # -- the coordinator's side ---------------------------------------------------------
    def allocate(self, replicas: int) -> None:
        """A new allocation version: ``replicas`` workers on the one node."""
        self.version += 1
        with open_store(self.url, self.prefix) as store:
            store.put(self.keys.allocation,
                      encode(Allocation(self.version, (NODE,) * replicas, time.time())))

    # -- the node agent's side ----------------------------------------------------------
    def start(self, worker: str, hold: bool = False) -> subprocess.Popen:
        """Start ``worker``; with ``hold`` it imports everything, then waits for
        ``release`` before it joins the job (so that starting it costs no time later)."""
        if not hold:
            self.release(worker)
        env = {k: v for k, v in os.environ.items()
               if k not in envvars.TRANSPORT_IFNAME and k not in (
                   "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT")}
        env.update(self.env)
        env.update({envvars.STORE: self.url, envvars.PREFIX: self.prefix,
                    envvars.JOB: self.name, envvars.NODE: NODE, envvars.WORKER_ID: worker,
                    envvars.ADDR: "127.0.0.1", "LOG_DIR": str(self.log_dir),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        out = open(self.log_dir / f"{worker}.out", "w")
        self.procs[worker] = subprocess.Popen([sys.executable, str(WORKER)], env=env,
                                              stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return self.procs[worker]

    def release(self, worker: str) -> None:
        """Let a held worker join the job."""
        (self.log_dir / f"{worker}.go").touch()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    # -- scenarios ---------------------------------------------------------------------
    def grow_1_to_2(self, alone: int, together: int) -> None:
        """``w0`` trains ``alone`` steps as the only replica, then ``w1`` (started at the
        same time, held until now) joins it and trains ``together`` steps with it."""
        self.allocate(1)
        self.start("w0")
        self.start("w1", hold=True)
        self.wait_steps(alone, worker="w0", world=1)
        self.allocate(2)
        self.release("w1")
        self.wait_steps(together, worker="w1", world=2)

    def finish(self) -> None:
        """Allocate the job nothing: every worker leaves, with exit status 0."""
        self.allocate(0)
        codes = {w: self.wait_exit(w) for w in self.procs}
        assert set(codes.values()) == {0}, (codes, self.output())

    # -- what the workers wrote ---------------------------------------------------------
    def records(self, kind: str | None = None, **match: object) -> list[dict]:
        """Every record (each with ``worker``), in each worker's order, filtered."""
        out = []
        for f in sorted(self.log_dir.glob("*.jsonl")):
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line) | {"worker": f.stem}
                except ValueError:
                    continue  # a line being written
                if (kind is None or rec["kind"] == kind) and all(
                        rec.get(k) == v for k, v in match.items()):
                    out.append(rec)
        return out

    def one(self, kind: str, **match: object) -> dict:
        found = self.records(kind, **match)
        assert len(found) == 1, (kind, match, found, self.output())
        return found[0]

    def steps_by_number(self, **match: object) -> dict[int, list[dict]]:
        """``step`` records grouped by step number."""
        out: dict[int, list[dict]] = defaultdict(list)
        for rec in self.records("step", **match):
            out[rec["step"]].append(rec)
        return out

    def output(self) -> str:
        """The tail of every worker's stdout/stderr (for assertion messages)."""
        return "\n".join(f"--- {f.stem}:\n{f.read_text()[-3000:]}"
                         for f in sorted(self.log_dir.glob("*.out")))

    def wait_for(self, predicate, what: str, timeout: float = 60.0):
        """Poll ``predicate()`` until it is truthy; fail (with the workers' output) when it
        is not within ``timeout`` or a worker exited with an error meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            bad = {w: p.returncode for w, p in self.procs.items()
                   if p.poll() not in (None, 0)}
            if bad or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: "
                                     f"{'workers failed ' + str(bad) if bad else 'timed out'}"
                                     f"\n{self.output()}")
            time.sleep(0.1)

    def wait_steps(self, count: int, timeout: float = 60.0, **match: object) -> list[dict]:
        """At least ``count`` step records matching ``match`` (per worker if one is named)."""
        return self.wait_for(lambda: (r := self.records("step", **match)) and len(r) >= count
                             and r, f"{count} steps {match}", timeout)

    def wait_exit(self, worker: str, timeout: float = 60.0) -> int:
        try:
            return self.procs[worker].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{worker} did not exit\n{self.output()}") from None


