"""Helpers for the multi-process rendezvous tests: start real worker processes
(``rdzv_worker.py``), read their JSON event lines, write allocations as the coordinator would."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from pollux_launch.messages import Allocation, encode
from pollux_launch.rendezvous.rounds import JobKeys
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("rdzv_worker.py")


class Job:
    """One job's worker processes and its allocation key."""

    def __init__(self, url: str, prefix: str, ttl: float = 2.0, join_timeout: float = 30.0):
        self.url, self.prefix, self.ttl, self.join_timeout = url, prefix, ttl, join_timeout
        self.name = f"job-{uuid.uuid4().hex[:8]}"
        self.keys = JobKeys(self.name)
        self.procs: dict[str, subprocess.Popen] = {}
        self.events: queue.Queue[dict] = queue.Queue()
        self.stderr: dict[str, list[str]] = {}
        self.version = 0

    def allocate(self, replicas: int) -> None:
        self.version += 1
        with open_store(self.url, self.prefix) as store:
            store.put(self.keys.allocation,
                      encode(Allocation(self.version, ("local",) * replicas, time.time())))

    def start(self, worker: str) -> subprocess.Popen:
        cmd = [sys.executable, str(WORKER), "--store", self.url, "--prefix", self.prefix,
               "--job", self.name, "--worker", worker, "--ttl", str(self.ttl),
               "--join-timeout", str(self.join_timeout)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs[worker] = proc
        self.stderr[worker] = []
        threading.Thread(target=self._read, args=(worker, proc.stdout), daemon=True).start()
        threading.Thread(target=self._drain, args=(worker, proc.stderr), daemon=True).start()
        return proc

    def _read(self, worker: str, stream) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            event["worker"] = worker
            self.events.put(event)

    def _drain(self, worker: str, stream) -> None:
        for line in stream:
            self.stderr[worker].append(line)

    def wait_for(self, count: int, timeout: float = 60.0, **match: object) -> list[dict]:
        """The next ``count`` events whose fields equal ``match`` (others are dropped)."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                logs = {w: "".join(lines)[-2000:] for w, lines in self.stderr.items()}
                raise AssertionError(f"timed out waiting for {match}: got {got}; stderr {logs}")
            try:
                event = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if all(event.get(k) == v for k, v in match.items()):
                got.append(event)
        return got

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def make_job(store_prefix):
    jobs: list[Job] = []

    def make(url: str, **kw: float) -> Job:
        jobs.append(Job(url, store_prefix, **kw))
        return jobs[-1]
    yield make
    for job in jobs:
        job.stop()
