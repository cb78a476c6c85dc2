"""A logical cluster on this machine for the end-to-end tests: a real etcd, real node
agents and a real coordinator (``pollux-run`` subcommands), jobs submitted with
``pollux-run`` and workers training ``digits_worker.py`` with the native adapter.

Processes run in the root network namespace over loopback, or - given a ``host`` from
``hosts.py`` - inside that host's network namespace, as on separate machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from pollux_launch import keys
from pollux_launch.env import TRANSPORT_IFNAME
from pollux_launch.messages import Allocation, JobStatus, MessageError, decode
from pollux_launch.rendezvous.store import open_store

POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))
WORKER = str(Path(__file__).with_name("digits_worker.py"))
SECRET = "e2e-test-secret-not-for-production"


def read_jsonl(folder: Path, pattern: str = "*.jsonl") -> list[dict]:
    """Every record of the JSON-lines files in ``folder``, each with ``worker``: its file's
    stem. A line a worker is writing right now is skipped."""
    out = []
    for f in folder.glob(pattern):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line) | {"worker": f.stem})
            except ValueError:
                continue
    return out


class Cluster:
    """``store_flags``: more store flags for every ``pollux-run`` (TLS, ``--user``,
    ``--password-file``); ``store_options``: the same for this test's own ``open_store``."""

    def __init__(self, url: str, tmp: Path, store_flags: tuple[str, ...] = (),
                 **store_options: object) -> None:
        self.url, self.tmp, self.store_flags = url, tmp, store_flags
        # a Rendezvous made in this test process binds its transports in os.environ: the
        # services must find their own, as on a fresh host
        inherited = {k: v for k, v in os.environ.items() if k not in TRANSPORT_IFNAME}
        self.env = {**inherited, "POLLUX_SECRET": SECRET, "LOG_DIR": str(tmp / "logs")}
        (tmp / "logs").mkdir()
        self.procs: dict[str, subprocess.Popen] = {}
        self.store = open_store(url, **store_options)

    def start(self, name: str, *args: str, host=None) -> subprocess.Popen:
        """``pollux-run ARGS`` as process ``name`` (its output in ``<name>.log``), inside
        ``host``'s network namespace when one is given."""
        log = open(self.tmp / f"{name}.log", "a")
        popen = host.popen if host is not None else subprocess.Popen
        self.procs[name] = popen([POLLUX_RUN, *args], env=self.env, cwd=self.tmp,
                                 stdout=log, stderr=subprocess.STDOUT, text=True)
        log.close()
        return self.procs[name]

    def coordinator(self, *flags: str) -> None:
        self.start("coordinator", "coordinator", "--store", self.url, *self.store_flags,
                   "--interval", "2", "--realloc-delay", "1", "--lease-ttl", "2", *flags)

    def agent(self, node: str, slots: int, *flags: str, host=None) -> None:
        """A node agent (more ``flags`` of its own); on loopback unless ``host`` (then it
        finds its own address)."""
        where = () if host is not None else ("--address", "127.0.0.1")
        self.start(f"agent-{node}", "agent", "--store", self.url, *self.store_flags,
                   "--node-name", node, "--slots", str(slots), "--lease-ttl", "2",
                   "--state-dir", str(self.tmp / f"state-{node}"), *where, *flags, host=host)

    def submit(self, job: str, *flags: str, target: float = 0.85, epochs: int | None = None,
               host=None) -> subprocess.Popen:
        stop = self.tmp / f"{job}.stop"
        more = ("--epochs", str(epochs)) if epochs else ()
        return self.start(job, "--store", self.url, *self.store_flags, "--job-name", job,
                          *flags, sys.executable, WORKER, "--stop-file", str(stop),
                          "--target", str(target), "--step-delay", "0.1", *more, host=host)

    def status(self, job: str) -> JobStatus | None:
        kv = self.store.get(keys.job(job, "status"))
        return decode(JobStatus, kv.value) if kv else None

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def epochs_lost(self) -> int:
        """Data epochs trained again: how far rank 0's epoch fell back, summed over the
        fall-backs (a restart from scratch falls back once, to epoch 0)."""
        lost, prev = 0, None
        for s in sorted((s for s in self.steps() if s["rank"] == 0), key=lambda s: s["t"]):
            if prev is not None and s["epoch"] < prev:
                lost += prev - s["epoch"]
            prev = s["epoch"]
        return lost

    def steps_lost(self) -> int:
        """Optimiser steps trained again: how far rank 0's step count fell back."""
        lost, prev = 0, None
        for s in sorted((s for s in self.steps() if s["rank"] == 0), key=lambda s: s["t"]):
            if prev is not None and s["step"] <= prev:
                lost += prev - s["step"] + 1
            prev = s["step"]
        return lost

    def workers_left(self) -> list[psutil.Process]:
        """Worker processes of this cluster still running (orphans once jobs ended)."""
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if WORKER in cmd and any(str(self.tmp) in c for c in cmd):
                out.append(proc)
        return out

    def stop_job(self, job: str) -> None:
        (self.tmp / f"{job}.stop").touch()

    def allocation(self, job: str) -> tuple[str, ...]:
        kv = self.store.get(keys.job(job, "allocation"))
        return decode(Allocation, kv.value).nodes if kv else ()

    def steps(self) -> list[dict]:
        return read_jsonl(self.tmp / "logs")

    def check_capacity(self, slots: dict[str, int]) -> None:
        """Allocations never exceed a node's slots (checked at every observation)."""
        used: Counter[str] = Counter()
        for kv in self.store.get_prefix(keys.JOBS):
            split = keys.split_job_key(kv.key)
            if split and split[1] == "allocation":
                status = self.store.get(keys.job(split[0], "status"))
                try:
                    if status and decode(JobStatus, status.value).finished:
                        continue
                except MessageError:
                    pass
                used.update(decode(Allocation, kv.value).nodes)
        for node, k in used.items():
            assert k <= slots[node], f"node {node} over-allocated: {dict(used)}"

    def wait(self, predicate, timeout: float, what: str, slots: dict[str, int] | None = None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if slots:
                self.check_capacity(slots)
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        # what is still running, and where its workers stand (their faulthandler prints
        # every thread's stack on SIGUSR1 into the agents' logs below)
        left = []
        for proc in self.workers_left():
            with contextlib.suppress(psutil.Error):
                left.append(f"pid {proc.pid} ({proc.status()}, parent {proc.ppid()}): "
                            + " ".join(proc.cmdline()[:3]))
                if proc.cmdline()[1:2] == [WORKER]:  # (not a launcher: SIGUSR1 would end it)
                    proc.send_signal(signal.SIGUSR1)
        if left:
            time.sleep(2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.tmp.glob("*.log"))
        raise AssertionError(f"timed out waiting for {what}\nworkers left: {left}\n{logs}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.store.close()


