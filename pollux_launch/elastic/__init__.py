"""The framework-neutral step boundary of an elastic job.

* :mod:`.controller` - ``ElasticController``, which the torch, DeepSpeed and Horovod
  adapters all drive through ``FrameworkHooks``: votes, decisions, hints, re-forming,
  failure recovery, checkpoint cadence, SIGTERM;
* :mod:`.adaptation` - ``AdaptationPolicy``: user code at the step boundaries (KungFu's
  APs), with ``GoodputPolicy`` (Pollux's agent) the default;
* :mod:`.failures` - ``is_peer_failure``: one answer to "did a peer die?";
* :mod:`.checkpoint` - durable checkpoints, written in the background, atomically.
"""

from .adaptation import (
    Actions,
    AdaptationPolicy,
    GoodputPolicy,
    PolicyContext,
    PolicyError,
    load_policies,
)
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
    "Actions", "AdaptationPolicy", "Checkpoint", "CheckpointError", "CheckpointWriter",
    "Decision", "ElasticController", "FrameworkHooks", "GoodputPolicy", "HintsReporter",
    "LeaveJob", "PolicyContext", "PolicyError", "checkpoint_writer", "is_peer_failure",
    "latest_checkpoint", "load_policies",
]
