"""The framework-neutral step boundary of an elastic job.

* :mod:`.controller` - ``ElasticController``, which the torch, DeepSpeed and Horovod
  adapters all drive through ``FrameworkHooks``: votes, decisions, hints, re-forming,
  failure recovery, checkpoint cadence, SIGTERM;
* :mod:`.failures` - ``is_peer_failure``: one answer to "did a peer die?";
* :mod:`.checkpoint` - durable checkpoints, written in the background, atomically.
"""

from .checkpoint import Checkpoint, CheckpointError, CheckpointWriter, latest_checkpoint
from .controller import (
    Decision,
    ElasticController,
    FrameworkHooks,
    HintsReporter,
    LeaveJob,
    checkpoint_writer,
)
from .failures import is_peer_failure

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointWriter", "Decision", "ElasticController",
    "FrameworkHooks", "HintsReporter", "LeaveJob", "checkpoint_writer", "is_peer_failure",
    "latest_checkpoint",
]
