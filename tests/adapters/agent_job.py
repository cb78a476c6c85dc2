"""A job run by a real node agent on an embedded store, the test playing the coordinator
(it writes the allocations): shared by the live adapter tests."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store


class AgentJob:
    def __init__(self, store: Any, agent: NodeAgent, name: str, log_dir: Path) -> None:
        self.store, self.agent, self.name, self.log_dir = store, agent, name, log_dir
        self.version = 0

    def allocate(self, replicas: int) -> int:
        """A new allocation of ``replicas`` on the node; returns its version."""
        self.version += 1
        self.store.put(keys.job(self.name, "allocation"),
                       encode(Allocation(self.version, ("n1",) * replicas)))
        return self.version

    def records(self) -> dict[str, list[dict]]:
        """Each worker's JSON lines ($LOG_DIR/<worker>.jsonl)."""
        return {f.stem: [json.loads(line) for line in f.read_text().splitlines() if line]
                for f in self.log_dir.glob("*.jsonl")}

    def finished(self, timeout: float = 240) -> JobStatus:
        """The job's final status, once it has one."""
        return wait_for(lambda: (kv := self.store.get(keys.job(self.name, "status")))
                        and decode(JobStatus, kv.value).finished
                        and decode(JobStatus, kv.value), timeout, "the job to finish")


@contextmanager
def agent_job(tmp_path: Path, name: str, worker: Path, env: Mapping[str, str],
              slots: int = 4) -> Iterator[AgentJob]:
    """``worker`` as job ``name`` (its env plus LOG_DIR) under a node agent of ``slots``."""
    url = f"embedded://{tmp_path}/store.db"
    log_dir = tmp_path / "logs"
    log_dir.mkdir(parents=True)
    store = open_store(url)
    spec = JobSpec(name=name, command=(sys.executable, str(worker)),
                   env={"LOG_DIR": str(log_dir), **env})
    store.put(keys.job(name, "spec"), encode(spec))
    agent = NodeAgent(store, NodeInfo("n1", slots), url, only_jobs={name}, poll=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield AgentJob(store, agent, name, log_dir)
    finally:
        stop.set()
        thread.join(timeout=60)
        store.close()
