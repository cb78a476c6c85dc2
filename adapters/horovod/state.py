"""``TorchState``: ``hvd.elastic.TorchState`` with durable checkpoints under pollux-run.

Horovod Elastic keeps a job's state in memory (``state.commit()``) and moves it to
newcomers itself (``state.sync()``); when every worker dies, that copy dies with them.
This subclass adds the durable copy, at the two points Horovod already defines:

* ``commit()`` - every rank commits at the same step; rank 0 also snapshots the state it
  just committed into the job's checkpoint directory when a checkpoint is due (every
  ``checkpoint_interval`` seconds; written in the background, atomically:
  ``pollux_launch.elastic.checkpoint``). Replicas are identical, so rank 0's copy is the
  job's, whatever the number of workers;
* ``sync()`` - the first sync of a job in which *every* worker is new (its start, or a
  relaunch after all workers died; one all-reduce tells) makes rank 0 load the newest
  checkpoint first, so that Horovod's own sync hands it to every rank.

What is kept: the state dicts of the model, the optimizer and any other object with one
(the ``ElasticSampler``: its epoch and position), the plain values (``epoch``, ``step``...:
numbers, strings, booleans), and the Pollux control's statistics and progress when the
optimizer is pollux's ``DistributedOptimizer``. Read back with ``torch.load
(weights_only=True)``; a checkpoint that does not fit is logged and training starts
afresh. The directory comes from ``checkpoint_dir=`` or ``pollux-run --checkpoint-dir``.
"""

from __future__ import annotations

import logging
from typing import Any

import horovod.torch as hvd
import torch

from pollux_launch.elastic.checkpoint import CheckpointError, latest_checkpoint
from pollux_launch.elastic.controller import checkpoint_writer
from pollux_launch.elastic.failures import first_line
from pollux_launch.tuning.sync_points import SyncPoints

log = logging.getLogger(__name__)

_PLAIN = (bool, int, float, str, type(None))


class TorchState(hvd.elastic.TorchState):
    """``hvd.elastic.TorchState(model, optimizer, **kwargs)`` plus ``checkpoint_dir`` and
    ``checkpoint_interval`` (see the module docstring); ``resumed_from`` is the progress
    of the checkpoint this job resumed from, if it did."""

    def __init__(self, model: Any = None, optimizer: Any = None, *,
                 checkpoint_dir: str | None = None, checkpoint_interval: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        self._pollux_writer = checkpoint_writer(checkpoint_dir, checkpoint_interval)
        self._pollux_synced = False
        self.resumed_from: float | None = None

    @property
    def checkpoints(self) -> Any:
        return self._pollux_writer

    # -- Horovod's points ---------------------------------------------------------------
    def sync(self) -> None:
        with self._sync_points().scheduled("reset"):  # (every rank syncs: it may read)
            self._sync()

    def _sync(self) -> None:
        if self._pollux_writer is not None:
            # collective on every sync (all ranks sync together): did any rank sync before?
            seen = hvd.allreduce(torch.tensor([int(self._pollux_synced)]), op=hvd.Max,
                                 name="pollux.state.fresh")
            if not int(seen[0]) and hvd.rank() == 0:
                self._resume()
        self._pollux_synced = True
        super().sync()

    def commit(self) -> None:
        self.save()
        writer = self._pollux_writer
        if writer is not None and hvd.rank() == 0 and writer.due():
            self.save_checkpoint(wait=False)
        self.check_host_updates()

    # -- durable state ------------------------------------------------------------------
    def save_checkpoint(self, wait: bool = True) -> None:
        """Rank 0: write the state now (as last changed; ``commit()`` writes when due)."""
        if self._pollux_writer is None:
            raise ValueError("save_checkpoint: no checkpoint directory (checkpoint_dir= or "
                             "pollux-run --checkpoint-dir)")
        with self._sync_points().scheduled("checkpoint"):  # (it reads the statistics)
            self._save_checkpoint(wait)

    def _save_checkpoint(self, wait: bool) -> None:
        assert self._pollux_writer is not None
        state = self._durable_state()
        control = self._control()
        steps = control.steps if control is not None else int(state["values"].get("step", 0)
                                                                or 0)
        progress = float(control.controller.tuner.progress.iterations) if (
            control is not None and control.controller is not None) else float(steps)
        self._pollux_writer.save(state, step=steps, progress=progress, replicas=hvd.size(),
                                 wait=wait)

    def _sync_points(self) -> SyncPoints:
        """The pollux optimizer's scheduled points (a private count without one)."""
        for handler in self._handlers.values():
            measurement = getattr(handler.value, "pollux", None)
            if isinstance(getattr(measurement, "sync_points", None), SyncPoints):
                return measurement.sync_points
        return SyncPoints()

    def _control(self) -> Any:
        for handler in self._handlers.values():
            control = getattr(handler.value, "pollux_control", None)
            if control is not None:
                return control
        return None

    def _durable_state(self) -> dict[str, Any]:
        objects = {name: h.value.state_dict() for name, h in self._handlers.items()
                   if hasattr(h.value, "state_dict")}
        values = {}
        for name in self._saved_state:
            value = getattr(self, name)
            if isinstance(value, _PLAIN):
                values[name] = value
        out: dict[str, Any] = {"objects": objects, "values": values}
        control = self._control()
        if control is not None and control.controller is not None:
            out["pollux"] = control.durable_state()
        return out

    def _resume(self) -> None:
        """Rank 0, every worker new: load the newest checkpoint into this state (then
        ``save()``, so that Horovod's sync hands the loaded values to every rank)."""
        assert self._pollux_writer is not None
        try:
            ckpt = latest_checkpoint(self._pollux_writer.directory)
        except CheckpointError as exc:
            log.error("not resuming: %s; training starts from scratch", exc)
            return
        if ckpt is None:
            return
        try:
            state = ckpt.state
            for name, sd in state["objects"].items():
                if name in self._handlers and hasattr(self._handlers[name].value,
                                                      "load_state_dict"):
                    self._handlers[name].value.load_state_dict(sd)
            for name, value in state["values"].items():
                if name in self._saved_state:
                    setattr(self, name, value)
            control = self._control()
            if control is not None and "pollux" in state:
                control.resume_from(state["pollux"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            log.error("resuming from %s failed part-way (%s): training goes on from the "
                      "state as loaded so far", ckpt.path, first_line(exc))
            self.save()
            return
        self.save()
        self.resumed_from = ckpt.progress
        log.warning("resumed from %s (step %d, %.0f iterations of progress, taken on %d "
                    "replicas)", ckpt.path, ckpt.step, ckpt.progress, ckpt.replicas)
