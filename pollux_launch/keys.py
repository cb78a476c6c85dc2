"""The cluster's key schema (relative to the store's cluster prefix, default ``/pollux``).

::

    nodes/<node>                  NodeInfo (and its live workers per job), agent's lease
    drains/<node>                 NodeDrain: an operator's drain (pollux-run drain)
    jobs/<job>/spec               JobSpec, written once at submission
    jobs/<job>/signature          hex HMAC-SHA256 of the spec's exact text (cluster secret)
    jobs/<job>/status             JobStatus
    jobs/<job>/hints              JobHints, refreshed by the job's rank-0 agent
    jobs/<job>/allocation         Allocation (version, nodes, leadership term), by the coordinator
    jobs/<job>/restarts           JobRestarts: restarts after all workers died, progress lost
    jobs/<job>/generation         JobGeneration: a restart-elastic job's restarts, their cost
    jobs/<job>/rdzv/...           the job's rendezvous rounds (rendezvous/README.md)
    jobs/<job>/gpus/<node>        JobGpus: the GPUs its workers hold there (that node's agent)
    jobs/<job>/finished/<worker>  WorkerFinished: a worker that completed the script (its agent)
    jobs/<job>/tasks/<task>       WorkerTask: a Horovod worker the job's launcher asks a node for
    jobs/<job>/exits/<task>       TaskExit, written by the node agent that ran the task
    coordinator/leader            the active coordinator's id, under its lease
    coordinator/autoscale         AutoscaleStatus: the autoscaler's last decision
    cluster/epoch                 a random token: this store's incarnation (launcher/epoch.py)

Only JSON is stored; see ``pollux_launch.messages``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rendezvous.store.base import Compare

# A name that is one level of a key: a node's, a job's, a worker's.
NAME = re.compile(r"[A-Za-z0-9_.@:+-]{1,128}")

NODES = "nodes/"
DRAINS = "drains/"
JOBS = "jobs/"
LEADER = "coordinator/leader"
AUTOSCALE = "coordinator/autoscale"
EPOCH = "cluster/epoch"


def node(name: str) -> str:
    return f"{NODES}{name}"


def drain(name: str) -> str:
    return f"{DRAINS}{name}"


def job(name: str, leaf: str = "") -> str:
    """``jobs/<name>/`` or ``jobs/<name>/<leaf>``."""
    return f"{JOBS}{name}/{leaf}"


def job_exists(name: str, created: int | None = None) -> Compare:
    """The condition that every write a service makes under ``jobs/<name>/`` for an
    existing job carries, in the same transaction: the job's spec key still exists -
    with ``created``, that very spec (its create revision as read; not a new submission
    of the name). Without it a write racing the job's removal (a local launcher deletes
    ``jobs/<name>/`` as it exits) brings back a key of a job that is gone: a ghost."""
    from .rendezvous.store.base import Compare  # (keys stays free of the store at import)

    if created is None:
        return Compare(job(name, "spec"), "create_revision", "!=", 0)
    return Compare(job(name, "spec"), "create_revision", "==", created)


def split_job_key(key: str) -> tuple[str, str] | None:
    """``jobs/<name>/<leaf...>`` -> (name, leaf); None for other keys."""
    if not key.startswith(JOBS):
        return None
    name, sep, leaf = key[len(JOBS):].partition("/")
    return (name, leaf) if sep and name else None


def job_gpus(job_name: str, node_name: str) -> str:
    """``jobs/<job>/gpus/<node>``: what the job's workers hold on that node."""
    return job(job_name, f"gpus/{node_name}")


FINISHED = "finished/"  # a job's leaf prefix of its completed workers


def job_finished(job_name: str, worker: str) -> str:
    """``jobs/<job>/finished/<worker>``: that worker completed the script."""
    return job(job_name, FINISHED + worker)
