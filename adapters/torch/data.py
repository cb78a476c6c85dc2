"""Elastic data loading: exactly-once epochs across rescales and batch-size changes.

Each epoch has one global order (a permutation seeded by ``(seed, epoch)``, identical on
every worker) and one global *position*: the number of samples consumed so far in the
epoch by all replicas together. A step with ``W`` replicas of local batch ``b`` takes the
next ``W * b`` samples of the order and gives rank ``r`` the ``r``-th contiguous slice.
Because the position is global and advances by exactly what the step consumed, any
sequence of rescales (``W``) and batch-size changes (``b``) between steps re-partitions
only the *remaining* samples: none is skipped or seen twice within an epoch. After a
rescale, new workers need just ``(epoch, position)`` (``state_dict``) from rank 0.

The end of an epoch (``drop_last=False``, the default):

* if a full step would leave fewer than ``W`` samples (too few to give every rank one),
  that step absorbs them: some ranks get ``b + 1`` samples;
* a final step with fewer than ``W * b`` samples is split as evenly as possible (local
  sizes differ by at most one); every rank gets the same number of steps, so DDP never
  waits on a rank that ran out;
* only if a scale-up leaves fewer samples than replicas do the ranks without a sample get
  *padding*: a repeat of a sample from that final step (at most ``W - 1`` repeats per
  epoch, counted in :attr:`ElasticSampler.padded`). Weight them out if that matters.

With ``drop_last=True`` a final step smaller than ``W * b`` is dropped (every sample at
most once; fewer than ``W * b`` unseen).

Fetching. Each micro-batch is one list of indices, fetched as ``DataLoader`` fetches a
batch: a data set with ``__getitems__`` gets the whole list in one call (then
``collate_fn``), and a ``TensorDataset`` (or a ``Subset`` of one) is indexed once per
tensor with the list (:class:`TensorBatches`: no per-sample tuples, no stacking) unless a
``collate_fn`` is given; other data sets sample by sample. ``num_workers``,
``pin_memory`` and the rest go to ``DataLoader`` unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

log = logging.getLogger(__name__)

STATE_VERSION = 1


def plan_step(remaining: int, num_replicas: int, local_bsz: int, drop_last: bool) -> list[int]:
    """Per-rank sample counts of the next step (``[]``: the epoch is over).

    A count can be 0 only in the padding case (fewer samples left than replicas); the
    sampler then pads those ranks with one repeated sample.
    """
    if num_replicas < 1 or local_bsz < 1:
        raise ValueError(
            f"need num_replicas >= 1 and local_bsz >= 1, got {num_replicas}, {local_bsz}"
        )
    full = num_replicas * local_bsz
    if remaining <= 0:
        return []
    if remaining >= full:
        if not drop_last and 0 < remaining - full < num_replicas:
            return _split(remaining, num_replicas)  # absorb a tail too small to share
        return [local_bsz] * num_replicas
    return [] if drop_last else _split(remaining, num_replicas)


def _split(total: int, parts: int) -> list[int]:
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


class ElasticSampler:
    """Global order + global position; hands out each rank's slice of each step."""

    def __init__(
        self, dataset_len: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        if not isinstance(dataset_len, int) or dataset_len < 1:
            raise ValueError(f"dataset length must be a positive integer, got {dataset_len!r}")
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self.padded = 0  # repeated samples handed out this epoch (see module docstring)
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    def set_epoch(self, epoch: int, position: int = 0) -> None:
        if epoch < 0 or not 0 <= position <= self.dataset_len:
            raise ValueError(
                f"need epoch >= 0 and 0 <= position <= {self.dataset_len}, got {epoch}, {position}"
            )
        self.epoch, self.position, self.padded = int(epoch), int(position), 0

    def order(self) -> np.ndarray:
        """This epoch's global sample order (same on every worker)."""
        if self._perm is None or self._perm_epoch != self.epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._perm = rng.permutation(self.dataset_len)
            else:
                self._perm = np.arange(self.dataset_len)
            self._perm_epoch = self.epoch
        return self._perm

    @property
    def remaining(self) -> int:
        return self.dataset_len - self.position

    def exhausted(self, num_replicas: int, local_bsz: int) -> bool:
        remaining = self.dataset_len - self.position  # (plan_step's rule, inline: per step)
        return remaining <= 0 or (self.drop_last and remaining < num_replicas * local_bsz)

    def batch(
        self, rank: int, num_replicas: int, local_bsz: int, position: int | None = None
    ) -> list[int]:
        """Rank ``rank``'s indices for the step at ``position`` (default: the current one);
        ``[]`` when the epoch is over. Does not advance."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        pos = self.position if position is None else position
        if self.dataset_len - pos - num_replicas * local_bsz >= num_replicas:
            start = pos + rank * local_bsz  # a full step, no tail to absorb: even slices
            return self.order()[start : start + local_bsz].tolist()
        sizes = plan_step(self.dataset_len - pos, num_replicas, local_bsz, self.drop_last)
        if not sizes:
            return []
        order = self.order()
        if sizes[rank] == 0:  # padding: repeat one of this final step's samples
            real = sum(sizes)
            return [int(order[pos + rank % real])]
        start = pos + sum(sizes[:rank])
        return order[start : start + sizes[rank]].tolist()

    def advance(self, num_replicas: int, local_bsz: int) -> int:
        """Move past one step; returns how many samples it consumed (all ranks)."""
        full = num_replicas * local_bsz
        if self.dataset_len - self.position - full >= num_replicas:  # (batch()'s fast case)
            self.position += full
            return full
        sizes = plan_step(self.remaining, num_replicas, local_bsz, self.drop_last)
        consumed = sum(sizes)
        self.padded += sum(1 for s in sizes if s == 0)
        self.position += consumed
        return consumed

    def batches(self, rank: int, num_replicas: int, local_bsz: int) -> Iterator[list[int]]:
        """This rank's batches for the rest of the epoch under a fixed configuration, from
        the current position, *without* advancing (a snapshot for a DataLoader)."""
        self.batch(rank, num_replicas, local_bsz, self.dataset_len)  # validate eagerly
        return self._batches_from(self.position, rank, num_replicas, local_bsz)

    def _batches_from(
        self, pos: int, rank: int, num_replicas: int, local_bsz: int
    ) -> Iterator[list[int]]:
        order, full, off = self.order(), num_replicas * local_bsz, rank * local_bsz
        while self.dataset_len - pos - full >= num_replicas:  # (batch()'s fast case: a
            yield order[pos + off : pos + off + local_bsz].tolist()  # full step, no tail)
            pos += full
        while True:
            sizes = plan_step(self.dataset_len - pos, num_replicas, local_bsz, self.drop_last)
            if not sizes:
                return
            yield self.batch(rank, num_replicas, local_bsz, pos)
            pos += sum(sizes)

    def state_dict(self) -> dict[str, Any]:
        return {
            "v": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "padded": self.padded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"ElasticSampler state: expected a dict with v={STATE_VERSION}")
        try:
            self.seed = int(state["seed"])
            self.set_epoch(int(state["epoch"]), int(state["position"]))
            self.padded = int(state["padded"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"ElasticSampler state is malformed: {exc}") from None


class TensorBatches(Dataset):
    """A ``TensorDataset`` (or a ``Subset`` of one) fetched a batch at a time: a list of
    indices indexes each tensor once (``__getitems__``) and is already the batch - pass
    ``collate_fn=whole_batch`` to a ``DataLoader`` over it. Sample by sample as before
    through ``__getitem__``."""

    def __init__(self, dataset: TensorDataset | Subset) -> None:
        self.dataset = dataset
        base, rows = dataset, None
        if isinstance(dataset, Subset):
            base, rows = dataset.dataset, torch.as_tensor(dataset.indices, dtype=torch.long)
        if not isinstance(base, TensorDataset):
            raise TypeError(f"TensorBatches needs a TensorDataset, got {type(base).__name__}")
        self.tensors, self._rows = base.tensors, rows

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self._rows is not None:
            idx = self._rows[idx]
        return tuple(t[idx] for t in self.tensors)


def whole_batch(batch: Any) -> Any:
    """``collate_fn`` for a data set whose ``__getitems__`` returns the batch itself."""
    return batch


def batched_fetch(dataset: Dataset, loader_kwargs: dict[str, Any]
                  ) -> tuple[Dataset, dict[str, Any]]:
    """What a ``DataLoader`` should fetch from, and its arguments: a tensor data set (no
    ``collate_fn`` of the user's) as :class:`TensorBatches`; anything else as it is."""
    if loader_kwargs.get("collate_fn") is not None:
        return dataset, loader_kwargs
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    if type(base) is not TensorDataset:  # (a subclass may override __getitem__)
        return dataset, loader_kwargs
    return TensorBatches(dataset), {**loader_kwargs, "collate_fn": whole_batch}  # type: ignore[arg-type]


class _Plan:
    """A one-shot batch sampler over a snapshot of the remaining steps."""

    def __init__(self, batches: Iterator[list[int]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches


class AdaptiveDataLoader:
    """A ``torch.utils.data.DataLoader`` whose replicas and per-replica batch size can
    change at any optimiser-step boundary, with exactly-once epochs (module docstring).

    ``batch_size`` is the initial total batch size ``M0``. ``max_batch_size`` (default
    ``M0``: a fixed batch size) and ``min_batch_size`` (default none) bound the total
    batch the agent may choose (the job's batch-size range) and
    ``local_bsz_bounds = (lo, hi)`` the per-replica micro-batch. Iterating yields this
    rank's micro-batches for the rest of the current epoch; with ``accum_steps = s`` every
    ``s + 1`` micro-batches form one optimiser step (:attr:`is_sync_step` tells which one
    synchronises). Changes requested with :meth:`set_replicas` / :meth:`set_batch_size`
    while iterating take effect after the current optimiser step. When the epoch is done
    the loader moves to the next one. Other keyword arguments go to ``DataLoader``.

    The loader enforces ``local_bsz_bounds``; ``max_batch_size`` is carried for the agent,
    which picks ``(local_bsz, accum_steps)`` within it for the current number of replicas.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        min_batch_size: int | None = None,
        local_bsz_bounds: tuple[int | None, int | None] = (None, None),
        gradient_accumulation: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        num_replicas: int = 1,
        **loader_kwargs: Any,
    ) -> None:
        for bad in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if bad in loader_kwargs:
                raise ValueError(f"AdaptiveDataLoader chooses {bad} itself; do not pass it")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size (M0) must be a positive integer, got {batch_size!r}")
        max_batch_size = batch_size if max_batch_size is None else max_batch_size
        if not isinstance(max_batch_size, int) or max_batch_size < batch_size:
            raise ValueError(
                f"max_batch_size must be an integer >= batch_size ({batch_size}), "
                f"got {max_batch_size!r}"
            )
        if min_batch_size is not None and (not isinstance(min_batch_size, int)
                                           or not 1 <= min_batch_size <= max_batch_size):
            raise ValueError(f"min_batch_size must be an integer in [1, max_batch_size "
                             f"{max_batch_size}], got {min_batch_size!r}")
        lo, hi = local_bsz_bounds
        lo = 1 if lo is None else lo
        hi = max_batch_size if hi is None else hi
        if not 1 <= lo <= hi:
            raise ValueError(f"local_bsz_bounds must satisfy 1 <= lo <= hi, got {local_bsz_bounds}")
        self.dataset = dataset
        self._fetch_from, loader_kwargs = batched_fetch(dataset, loader_kwargs)
        self.init_batch_size = batch_size
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.local_bsz_bounds = (lo, hi)
        self.gradient_accumulation = gradient_accumulation
        self.sampler = ElasticSampler(len(dataset), shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        self._loader_kwargs = loader_kwargs
        self._check_replicas(rank, num_replicas)
        self.rank, self.num_replicas = rank, num_replicas
        self.local_bsz = min(max(math.ceil(batch_size / num_replicas), lo), hi)
        self.accum_steps = 0
        self._pending: dict[str, Any] = {}
        self._micro = 0  # micro-batches yielded in the current optimiser step
        self._aborted = False
        self.is_sync_step = True
        self.padded_last_epoch = 0  # repeated samples in the last completed epoch
        # Called after every optimiser step, before the next batch: where the trainer
        # rescales and applies the agent's decisions (they arrive as set_* calls).
        self.on_step_boundary: Callable[[], None] | None = None
        # set by the trainer's epochs(): the loop counts statistical epochs, not data ones
        self.statistical_epochs = False
        self._warned_loop = False
        self.stopped = False  # an adaptation policy ended training (stop())

    # -- configuration -----------------------------------------------------------------
    @staticmethod
    def _check_replicas(rank: int, num_replicas: int) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}"
            )

    def set_replicas(self, rank: int, num_replicas: int) -> None:
        """This worker's new rank and the new number of replicas (next step boundary)."""
        self._check_replicas(rank, num_replicas)
        self._pending.update(rank=rank, num_replicas=num_replicas)
        self._apply_if_idle()

    def set_batch_size(self, local_bsz: int, accum_steps: int = 0) -> None:
        """New per-replica micro-batch and accumulation steps (next step boundary)."""
        lo, hi = self.local_bsz_bounds
        if not lo <= local_bsz <= hi:
            raise ValueError(
                f"local_bsz {local_bsz} is outside local_bsz_bounds {self.local_bsz_bounds}"
            )
        if accum_steps < 0 or (accum_steps and not self.gradient_accumulation):
            raise ValueError(
                f"accum_steps must be 0 (gradient_accumulation=False) or >= 0, got {accum_steps}"
            )
        self._pending.update(local_bsz=local_bsz, accum_steps=accum_steps)
        self._apply_if_idle()

    def _apply_if_idle(self) -> None:
        if self._micro == 0:
            self._apply()

    def _apply(self) -> bool:
        if not self._pending:
            return False
        for name, value in self._pending.items():
            setattr(self, name, value)
        self._pending = {}
        return True

    def stop(self) -> None:
        """End iteration after the current optimiser step, for good (every rank calls it
        at the same step: an adaptation policy's ``stop()``)."""
        self.stopped = True

    def abort_step(self) -> None:
        """Drop the optimiser step in flight and re-plan from the (possibly just loaded)
        sampler position at the next batch: used after a peer failure."""
        self._aborted = True
        self._micro = 0

    @property
    def batch_size(self) -> int:
        """Current total batch per optimiser step: ``W * b * (s + 1)``."""
        return self.num_replicas * self.local_bsz * (self.accum_steps + 1)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self.stopped:
            return
        self._warn_fixed_loop()
        self._micro = 0
        self._apply()
        while not self.sampler.exhausted(self.num_replicas, self.local_bsz):
            restart = False
            plan = _Plan(self.sampler.batches(self.rank, self.num_replicas, self.local_bsz))
            loader = DataLoader(self._fetch_from, batch_sampler=plan, **self._loader_kwargs)
            for batch in loader:
                self.sampler.advance(self.num_replicas, self.local_bsz)
                self._micro += 1
                end = self.sampler.exhausted(self.num_replicas, self.local_bsz)
                self.is_sync_step = end or self._micro == self.accum_steps + 1
                yield batch
                if self._aborted:  # the step in flight was lost (a peer failed)
                    self._aborted = False
                    self._micro = 0
                    self._apply()
                    restart = not self.sampler.exhausted(self.num_replicas, self.local_bsz)
                    break
                if self.is_sync_step:
                    if self.on_step_boundary is not None:
                        self.on_step_boundary()  # set_* calls in it stay pending until...
                    self._micro = 0
                    if self.stopped:
                        return  # (the epoch is left where it stands: nothing is skipped)
                    if self._apply():  # ...here, so the rest of the epoch is re-planned
                        restart = True  # re-plan the rest of the epoch for the new shape
                        break
            if not restart:
                break
        self._micro = 0
        self.padded_last_epoch = self.sampler.padded
        self.sampler.set_epoch(self.sampler.epoch + 1)

    def _warn_fixed_loop(self) -> None:
        """Said once: an adaptive batch under a loop of data epochs trains less."""
        if (self.statistical_epochs or self._warned_loop or self.on_step_boundary is None
                or self.max_batch_size == self.init_batch_size):
            return
        self._warned_loop = True
        log.warning(
            "the adaptive loader is iterated outside epochs(N): when pollux grows the batch, "
            "a data epoch takes fewer optimiser steps, so `for epoch in range(N)` trains "
            "less than with the initial batch; loop `for epoch in trainer.epochs(N)` "
            "(DeepSpeed: `engine.epochs(N)`) to train N epochs' worth of progress")

    def __len__(self) -> int:
        """Micro-batches left in this epoch under the current configuration."""
        return sum(1 for _ in self.sampler.batches(self.rank, self.num_replicas, self.local_bsz))

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: where the epoch stands and the batch shape (broadcast on rescale)."""
        return {
            "sampler": self.sampler.state_dict(),
            "local_bsz": self.local_bsz,
            "accum_steps": self.accum_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.sampler.load_state_dict(state["sampler"])
            self.local_bsz = int(state["local_bsz"])
            self.accum_steps = int(state["accum_steps"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"AdaptiveDataLoader state is malformed: {exc}") from None
