"""The interfaces of the elastic step boundary: what the controller is given and what its
policies see. Types only: :mod:`.controller` and :mod:`.adaptation` both import them,
and this module imports neither (no cycle between the two).

* :class:`Collectives` - the job's current group (torch's gloo control group, Horovod);
* :class:`Membership` - how the group changes (pollux's rendezvous), with
  :class:`MemberRemoved`, what its ``next_round`` raises for a worker not in the new
  round: the controller knows this exception only, never the rendezvous's own;
* :class:`FrameworkHooks` - what an adapter does for the controller;
* :class:`ControlledJob` - the controller as an adaptation policy's context reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pollux_launch.errors import PolluxError

if TYPE_CHECKING:
    import torch

    from pollux_launch.tuning.gns import GradNoise
    from pollux_launch.tuning.tuner import GoodputTuner

__all__ = ["Collectives", "ControlledJob", "FrameworkHooks", "MemberRemoved", "Membership"]


class MemberRemoved(PolluxError):
    """This worker is not in the job's new round (``Membership.next_round``): it leaves
    the job. A membership translates its own signal (the rendezvous's ``WorkerRemoved``)
    into this one."""


class Collectives(Protocol):
    """The current group as the controller sees it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    def broadcast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Rank 0's ``tensor`` (CPU) on every rank (returned; may be ``tensor`` itself)."""
        ...

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        """``op`` ("sum", "mean", "max", "min") of a small CPU float64 tensor over every
        rank (returned, on the CPU)."""
        ...

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's 1-D CPU float64 ``tensor`` (same length everywhere), one row per
        rank in rank order."""
        ...


class Membership(Protocol):
    """How the job's group changes: pollux's rendezvous (``adapters.torch.job.
    JobMembership``, over the worker's ``ElasticJob``)."""

    @property
    def elastic(self) -> bool: ...

    @property
    def name(self) -> str | None: ...

    @property
    def store(self) -> Any: ...

    def vote(self, ending: bool) -> tuple[bool, bool]:
        """Collective, one small all-reduce: (any rank saw a reason to re-form, any rank
        is ``ending``: it got SIGTERM); raises like any collective when a peer died."""
        ...

    def next_round(self, hand_off: Any = None) -> Any:
        """Enter the next round (raises :class:`MemberRemoved` when not in it).
        ``hand_off(old_members, new_members, worker)`` runs first on the old group, on
        every member of it, once the new round is known (not after a failure)."""
        ...

    def credit_resumed(self, progress: float) -> None: ...

    def record_rollback(self, lost: float) -> None:
        """The job went back to a durable checkpoint in place, losing ``lost``."""
        ...

    def close(self) -> None: ...


class FrameworkHooks(Protocol):
    """What an adapter does for the controller (all ranks call each at the same point)."""

    def batch(self) -> tuple[int, int]:
        """``(m, s)`` in force: per-GPU micro-batch and accumulation steps (s + 1 micro-
        batches per optimiser step)."""
        ...

    def apply_batch(self, m: int, s: int) -> None:
        """Use ``(m, s)`` from the next optimiser step on."""
        ...

    def set_lr_factor(self, factor: float) -> None:
        """Multiply the LR by ``factor`` inside every optimiser step from now on."""
        ...

    def grad_stats(self) -> GradNoise | None:
        """The gradient statistics now (same on every rank; may flush a monitor)."""
        ...

    def capture(self, controller_state: dict[str, Any]) -> Any:
        """On the old group, before it is left: what ``rebuild`` needs (DeepSpeed: the
        consolidated engine state; DDP: nothing)."""
        ...

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool
                ) -> dict[str, Any] | None:
        """On the new group: rebuild the engine or wrapper. With ``from_rank0`` every rank
        takes rank 0's state; else survivors keep theirs and newcomers receive it.
        Returns the controller state received (None where this rank kept its own)."""
        ...

    def leave(self) -> None:
        """This worker leaves the job: remove hooks (the group is gone already)."""
        ...

    # Optional - adapters of sharded state define it (the controller looks it up):
    # hand_off(old_members, new_members, worker) on the old group once the new round is
    # known, every member of the old group (``Membership.next_round``); a leaver's part
    # of a rescale ends there. ``rebuild`` may raise ``failures.StateLost`` (every rank
    # of the new group alike): the controller resumes the group from a checkpoint.

    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool
                         ) -> dict[str, Any] | None:
        """The durable state (tensors, numbers, strings, lists, dicts); ``collective``
        False: without collectives (None if that is impossible, e.g. ZeRO partitions).
        A sharded adapter whose ranks write their shards themselves adds ``"shards"``
        (the folder, in the checkpoint directory, they write to) and ``"pending"`` (its
        write's future): rank 0's writer commits the checkpoint once it completed."""
        ...

    def checkpoint_needs_peers(self) -> bool:
        """Whether ``checkpoint_state`` needs every rank (``collective``): the state is
        spread over the ranks (shards, ZeRO partitions). A SIGTERM then ends the ranks
        together, after a final checkpoint that they all write."""
        ...

    def restore_checkpoint(self, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Rank 0, fresh round: load a checkpoint; returns (what ``rebuild`` takes with
        ``from_rank0``, the controller state in it)."""
        ...


class ControlledJob(Protocol):
    """What an adaptation policy's context (``adaptation.PolicyContext``) reads of the
    controller that drives the job (``controller.ElasticController``)."""

    steps: int
    epoch: int
    lr_factor: float
    replica_request: tuple[int, int] | None
    step_time: float | None
    throughput: float | None
    tuner: GoodputTuner
    group: Collectives
    hooks: FrameworkHooks
