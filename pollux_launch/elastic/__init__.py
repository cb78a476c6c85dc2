"""Framework-neutral pieces of an elastic job's step boundary (durable state first)."""

from .checkpoint import Checkpoint, CheckpointError, CheckpointWriter, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "CheckpointWriter", "latest_checkpoint"]
