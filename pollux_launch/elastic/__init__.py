"""The framework-neutral step boundary of an elastic job.

* :mod:`.controller` - ``ElasticController``, which the torch, DeepSpeed and Horovod
  adapters all drive through ``FrameworkHooks``: votes, decisions, hints, re-forming,
  failure recovery, checkpoint cadence, SIGTERM;
* :mod:`.factory` - ``build_controller``: the one construction of a worker side (tuner,
  hints reporter, policies, controller) from a ``JobDescription``, for every adapter;
* :mod:`.protocols` - the interfaces (``Collectives``, ``Membership`` and its
  ``MemberRemoved``, ``FrameworkHooks``);
* :mod:`.hints` - ``HintsReporter``: rank 0's hints to the store;
* :mod:`.adaptation` - ``AdaptationPolicy``: user code at the step boundaries (KungFu's
  APs), with ``GoodputPolicy`` (Pollux's agent) the default, and the registry of named
  policies (``ADAPTATION_POLICIES``);
* :mod:`.failures` - ``is_peer_failure``: one answer to "did a peer die?";
* :mod:`.checkpoint` - durable checkpoints, written in the background, atomically.
"""

from .adaptation import (
    ADAPTATION_POLICIES,
    Actions,
    AdaptationPolicy,
    GoodputPolicy,
    PolicyContext,
    PolicyError,
    load_policies,
    register_adaptation_policy,
)
from .checkpoint import Checkpoint, CheckpointError, CheckpointWriter, latest_checkpoint
from .controller import Decision, ElasticController, LeaveJob, checkpoint_writer
from .factory import JobDescription, WorkerEnv, build_controller
from .failures import is_peer_failure
from .hints import HintsReporter
from .protocols import Collectives, FrameworkHooks, MemberRemoved, Membership

__all__ = [
    "ADAPTATION_POLICIES", "Actions", "AdaptationPolicy", "Checkpoint", "CheckpointError",
    "CheckpointWriter", "Collectives", "Decision", "ElasticController", "FrameworkHooks",
    "GoodputPolicy", "HintsReporter", "JobDescription", "LeaveJob", "MemberRemoved",
    "Membership", "PolicyContext", "PolicyError", "WorkerEnv", "build_controller",
    "checkpoint_writer", "is_peer_failure", "latest_checkpoint", "load_policies",
    "register_adaptation_policy",
]
