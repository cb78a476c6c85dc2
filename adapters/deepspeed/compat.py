"""Every use of DeepSpeed internals by this adapter, in one place.

Targets DeepSpeed 0.19.8 (``deepspeed/runtime/engine.py``,
``deepspeed/runtime/zero/stage_1_and_2.py``, ``deepspeed/utils/groups.py``). A DeepSpeed
upgrade should need changes here only; :func:`check_version` warns once when the running
version differs.

What is touched and why:

* ``deepspeed.utils.groups._release_process_group_references`` - DeepSpeed caches its
  data-parallel / world group clones in module globals; after the default process group
  is destroyed and re-formed with another size, they point to dead groups.
  ``deepspeed.comm.destroy_process_group`` would call it, but the rendezvous tears the group
  down through ``torch.distributed`` directly. ``groups._WORLD_GROUP`` is then set to the
  default group, which saves a group creation per rebuild.
* What holds a process group (:func:`release_groups`, when a replica leaves and at exit):
  those caches; the engine's and its optimizer's attributes (``data_parallel_group``,
  ``seq_data_parallel_group``, ZeRO's ``dp_process_group``, ``real_dp_process_group``...),
  since the engine outlives its handle while a ``loss`` the script keeps reaches it through
  DeepSpeed's backward hooks; and ``_dp_group``, which ZeRO-1/2 and the bf16 optimizer set
  on each of the module's parameters (``utils/mixed_precision_linkage.link_hp_params``) and
  never clear.
* ``deepspeed.comm.torch.build_shm_op`` - loaded early by :func:`prewarm`.
* The engine's module hooks (``module_forward_pre_hook``, ``module_forward_post_hook``,
  ``first_dataloader_check``) - ``engine.destroy()`` leaves them on the user's module, and
  the module is reused by the rebuilt engine.
* ZeRO-1/2 flat-partition layout of ``DeepSpeedZeroOptimizer``: ``round_robin_bit16_groups``,
  ``round_robin_bit16_offsets``, ``single_partition_of_fp32_groups``,
  ``parallel_partitioned_bit16_groups``, ``real_dp_process_group`` - to gather each
  replica's partition of the fp32 master weights and optimizer state into per-parameter
  tensors, and to cut them again for a new data-parallel size.
* That building an engine broadcasts its module's parameters from rank 0 (stages 0-2):
  ``DeepSpeedEngine._broadcast_model``, replaced during a rebuild where some replicas hold
  the job's state by a point-to-point share from them (:func:`module_sync`).
* ZeRO-1/2's ``_flatten_dense_tensors`` (``stage_1_and_2``), while an engine is built:
  parameters that already lie in a flat buffer of this adapter's, as the new engine lays
  them out (a rebuilt engine's, in its predecessor's buffer), are not copied into new
  memory (:func:`flat_buffers_reused`).
* Engine counters ``global_steps``, ``global_samples``, ``skipped_steps``, ``micro_steps``.
* ``_is_gradient_accumulation_boundary`` - cleared after a step whose boundary was forced
  with the public ``set_gradient_accumulation_boundary`` (which cannot reset it to "use
  the micro-step counter").
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

TARGET_VERSION = "0.19.8"
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_warned = False


def check_version() -> None:
    """Warn once if the running DeepSpeed is not the version these workarounds target."""
    global _warned
    import deepspeed

    if not _warned and deepspeed.__version__ != TARGET_VERSION:
        _warned = True
        warnings.warn(f"pollux DeepSpeed adapter targets DeepSpeed {TARGET_VERSION}, running "
                      f"{deepspeed.__version__}: live rescaling is untested there",
                      stacklevel=2)


def release_group_caches() -> None:
    """Forget DeepSpeed's cached process groups (call once the default group is gone), and
    let the new engine use the default group itself as its "world clone".

    DeepSpeed clones the world group (``groups._clone_world_group``: a ``new_group`` - a
    full gloo/nccl connection set-up, ~20 ms on loopback, inside every rebuild) only
    because ``torch.distributed.get_global_rank`` did not accept ``group.WORLD`` in old
    torch releases; torch >= 2.0 returns the identity there.
    """
    import torch.distributed as dist
    from deepspeed.utils import groups

    groups._release_process_group_references(None)
    if dist.is_initialized():
        groups._WORLD_GROUP = dist.group.WORLD


def release_groups(engine: Any = None) -> None:
    """Let go of every process group DeepSpeed holds: its cached groups and, for
    ``engine``, the engine's and its optimizer's group attributes and the parameters'
    ``_dp_group``. A group destroyed while something holds it keeps its gloo threads
    running into the interpreter's finalisation (``pollux_launch.rendezvous.process_group``,
    "Leaving at exit"). Local; imports nothing DeepSpeed has not loaded."""
    from pollux_launch.rendezvous.process_group import forget_groups_in

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._release_process_group_references(None)
    if engine is None:
        return
    module = getattr(engine, "module", None)
    for obj in (engine, getattr(engine, "optimizer", None),
                *(module.parameters() if module is not None else ())):
        if obj is not None:
            forget_groups_in(obj)


def detach_engine(engine: Any) -> None:
    """Release an engine so that its module can be wrapped by a new one (local, no
    collectives): optimizer hooks, the engine's forward hooks on the module, references."""
    try:
        engine.destroy()  # ZeRO: removes the gradient hooks, drops _hp_mapping
    finally:
        for name in ("module_forward_pre_hook", "module_forward_post_hook",
                     "first_dataloader_check"):
            handle = getattr(engine, name, None)
            if handle is not None:
                handle.remove()
                setattr(engine, name, None)
        engine.__dict__.pop("_deepspeed_pollux_state", None)


def engine_broadcasts_module(engine: Any) -> bool:
    """Whether building ``engine`` broadcast the module's parameters from rank 0 of its
    data-parallel group (``DeepSpeedEngine._configure_distributed_model`` ->
    ``_broadcast_model``, for every model not built under ZeRO-3's ``zero.Init``), so
    that a newcomer need not be sent them."""
    return engine.zero_optimization_stage() in (0, 1, 2)


@contextlib.contextmanager
def module_sync(sync: Callable[[Any], None]) -> Iterator[None]:
    """While an engine is built: ``sync(engine)`` instead of DeepSpeed's
    ``_broadcast_model`` (rank 0's parameters to every replica, one broadcast each)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model
    DeepSpeedEngine._broadcast_model = sync
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original


# Room left after each flat parameter buffer this adapter allocates (elements): the
# padding at its end grows with the data-parallel size (to a multiple of 2 x world).
FLAT_SLACK = 1 << 16
_flats: dict[int, int] = {}  # storage address -> bytes, of the flat buffers allocated here
_building = 0


@contextlib.contextmanager
def flat_buffers_reused() -> Iterator[None]:
    """While an engine is built, ZeRO-1/2 flatten each parameter group into the memory
    that already holds it when the parameters lie there in the new layout - a rebuilt
    engine's parameters in its predecessor's buffer (the offsets of the parameters do
    not depend on the world size, only the padding at the end does) - instead of
    copying them into new memory, whose page faults alone cost ~0.8 s per GB on a CPU.
    Buffers allocated here get room to spare for a larger padding later."""
    global _building
    from deepspeed.runtime.zero import stage_1_and_2

    original = stage_1_and_2._flatten_dense_tensors
    stage_1_and_2._flatten_dense_tensors = _flatten  # the engine keeps it as self.flatten
    _building += 1
    try:
        yield
    finally:
        _building -= 1
        stage_1_and_2._flatten_dense_tensors = original


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch._utils._flatten_dense_tensors``, but see :func:`flat_buffers_reused`."""
    from torch._utils import _flatten_dense_tensors

    if not _building or len({t.dtype for t in tensors}) != 1:
        return _flatten_dense_tensors(tensors)  # (after the build: gradients, checkpoints)
    flat = _flat_in_place(tensors)
    if flat is None:
        total = sum(t.numel() for t in tensors)
        whole = torch.empty(total + FLAT_SLACK, dtype=tensors[0].dtype,
                            device=tensors[0].device)
        _flats[whole.untyped_storage().data_ptr()] = whole.untyped_storage().nbytes()
        while len(_flats) > 64:  # (freed ones linger: a few per engine build at most)
            del _flats[next(iter(_flats))]
        flat = whole[:total]
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)
    return flat


def _flat_in_place(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat buffer of this adapter's in which ``tensors`` already lie in order (the
    padding tensors DeepSpeed adds between and after them aside, copied in), or None."""
    first = tensors[0]
    storage, base = first.untyped_storage(), first.storage_offset()
    if _flats.get(storage.data_ptr()) != storage.nbytes():
        return None
    pos, pads = 0, []
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            pads.append((pos, t))  # a padding tensor (zeros) of its own
        elif t.storage_offset() != base + pos or not t.is_contiguous():
            return None
        pos += t.numel()
    if (base + pos) * first.element_size() > storage.nbytes():
        return None
    flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, base, (pos,))
    for start, t in pads:
        flat[start:start + t.numel()] = t.detach().reshape(-1)
    return flat


def get_counters(engine: Any) -> dict[str, int]:
    return {name: int(getattr(engine, name)) for name in COUNTERS}


def set_counters(engine: Any, counters: dict[str, int]) -> None:
    for name in COUNTERS:
        if name in counters:
            setattr(engine, name, int(counters[name]))


def clear_boundary_override(engine: Any) -> None:
    """Let the micro-step counter decide accumulation boundaries again."""
    engine._is_gradient_accumulation_boundary = None


def align_micro_steps(engine: Any) -> None:
    """Round ``micro_steps`` up to a multiple of the current accumulation steps, so that
    the next accumulation boundary comes after exactly that many micro-batches (DeepSpeed
    tests ``(micro_steps + 1) % gradient_accumulation_steps == 0``)."""
    gas = engine.gradient_accumulation_steps()
    engine.micro_steps = -(-engine.micro_steps // gas) * gas


def basic_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer that updates the (fp32) weights: ZeRO's inner one, or the
    engine's own at ZeRO-0."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() in (1, 2):
        return opt.optimizer
    return opt


def check_supported(engine: Any) -> int:
    """The ZeRO stage, if live rescaling supports this engine; a clear error otherwise."""
    stage = engine.zero_optimization_stage()
    if stage not in (0, 1, 2):
        raise NotImplementedError(
            f"live rescaling supports ZeRO stages 0, 1 and 2, this engine uses stage {stage}")
    if stage == 0 and not isinstance(engine.optimizer, torch.optim.Optimizer):
        raise NotImplementedError(
            "live rescaling at ZeRO stage 0 needs fp32 training (the engine's optimizer is a "
            f"{type(engine.optimizer).__name__}); use ZeRO stage 1 or 2 for fp16/bf16")
    if stage in (1, 2):
        zopt = engine.optimizer
        if getattr(zopt, "cpu_offload", False):
            raise NotImplementedError("live rescaling does not support ZeRO CPU offload yet")
        if any(zopt.is_moe_group(g) for g in zopt.optimizer.param_groups):
            raise NotImplementedError("live rescaling does not support MoE parameter groups")
    return stage


@dataclass
class ZeroGroup:
    """One parameter group's flat layout in a ZeRO-1/2 optimizer.

    ``params[j]`` (a module parameter) occupies ``flat[offsets[j] : offsets[j] + numel]``
    of the padded flat buffer, which is cut into ``world`` equal partitions; this replica
    owns partition ``rank`` (``fp32`` is its master copy, the basic optimizer's parameter).
    """

    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat_numel: int
    partition_sizes: list[int]
    rank: int
    world: int
    fp32: torch.Tensor
    group: Any

    @property
    def start(self) -> int:
        return sum(self.partition_sizes[: self.rank])


def zero_groups(engine: Any) -> Iterator[ZeroGroup]:
    """The flat layout of each parameter group of a ZeRO-1/2 engine."""
    import deepspeed.comm as ds_dist

    zopt = engine.optimizer
    for i, fp32 in enumerate(zopt.single_partition_of_fp32_groups):
        group = zopt.real_dp_process_group[i]
        yield ZeroGroup(
            params=list(zopt.round_robin_bit16_groups[i]),
            offsets=list(zopt.round_robin_bit16_offsets[i]),
            flat_numel=zopt.bit16_groups_flat[i].numel(),
            partition_sizes=[p.numel() for p in zopt.parallel_partitioned_bit16_groups[i]],
            rank=ds_dist.get_rank(group=group),
            world=ds_dist.get_world_size(group=group),
            fp32=fp32,
            group=group,
        )


def reset_client_optimizer(optimizer: torch.optim.Optimizer,
                           params: list[list[torch.nn.Parameter]]) -> None:
    """Give a client optimizer back its original parameter lists and an empty state, so
    that a new ZeRO engine can flatten them again (ZeRO-1/2 replace each group's params by
    the flat fp32 partition, and key the state by it)."""
    if len(params) != len(optimizer.param_groups):
        raise RuntimeError("the client optimizer's parameter groups changed since initialize")
    for group, plist in zip(optimizer.param_groups, params, strict=True):
        group["params"] = list(plist)
    optimizer.state = defaultdict(dict)


def prewarm() -> None:
    """Pay DeepSpeed's one-time lazy imports now, not inside the first engine build.

    The first ZeRO engine of a process imports ``deepspeed.runtime.zero.muon`` (it
    ``torch.compile``s a kernel at import, which loads inductor: seconds on CPU), so a
    newcomer that builds its first engine while the survivors wait in the collectives
    would add that to their pause. Call before announcing readiness to join.
    """
    import deepspeed

    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass
    # ``deepspeed.init_distributed`` loads the CPU accelerator's shared-memory op (a JIT
    # extension: ~0.1 s even when cached); OpBuilder keeps loaded ops, so load it now.
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
