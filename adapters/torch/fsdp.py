"""FSDP2 (``fully_shard``) models re-sharded in place when the job's group changes.

FSDP2 has no public way to move a sharded model to another mesh: this module is the one
place that reaches into its internals (torch 2.11-2.13: ``FSDPParamGroup.mesh_info``,
``FSDPParam._init_sharded_param`` and the padded ``_sharded_param_data``), and
``tests/adapters/test_fsdp_reshard.py`` fails the day they change. The two shapes of
``_init_sharded_param`` seen so far (2.13 takes the mesh info, 2.11 reads it from the
parameter) are told apart by its signature: ``tests/gpu`` ran 2.11 on a GPU machine.

A model is re-sharded in two phases (:mod:`pollux_launch.rendezvous.reshard`):
:meth:`FSDPResharder.hand_off` on the old group, once the new round is known (survivors
receive the rows of their new shards they lack; leavers give theirs away and go), and
:meth:`FSDPResharder.finish` on the new group (newcomers receive their shards; then every
rank points FSDP at the new mesh and swaps the new shards in). Every parameter keeps its
``nn.Parameter`` object (``torch.utils.swap_tensors``), so the optimizer, its state and
anything else holding the parameters stay valid; each optimizer-state tensor sharded like
its parameter (Adam's moments) is re-sharded beside it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pollux_launch.errors import UserError
from pollux_launch.rendezvous.reshard import Holding, exchange, plan_rows, shard_rows

log = logging.getLogger(__name__)

__all__ = ["FSDPResharder", "ShardingError", "device_mesh", "is_sharded", "shard_model"]


class ShardingError(UserError, ValueError):
    """A model or mesh this adapter cannot shard or re-shard (says what and how to fix)."""


def _fsdp() -> Any:
    from torch.distributed.fsdp import _fully_shard as fs

    return fs


def is_sharded(model: nn.Module) -> bool:
    """The model (or a submodule) was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def device_mesh(device_type: str | None = None) -> Any:
    """A 1-D mesh over the current group (this round's), as ``fully_shard(mesh=...)``
    takes it; ``device_type`` defaults to cuda where the group is nccl, else cpu."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Any = None
                ) -> nn.Module:
    """``sharding="fsdp"``: every direct child that holds parameters, then the root, each
    one FSDP unit (one all-gather per block: what FSDP's docs advise for a stack of
    transformer blocks; a model whose blocks are nested deeper shards itself). The
    optimizer, built on the unsharded parameters, is pointed at the sharded ones; it
    must not have stepped yet (raises ShardingError)."""
    from torch.distributed.fsdp import fully_shard

    if any(optimizer.state.values()):
        raise ShardingError("sharding='fsdp': the optimizer has stepped already; shard "
                            "before the first step")
    places = [(m, name, p) for m in model.modules()
              for name, p in m.named_parameters(recurse=False)]
    mesh = mesh or device_mesh()
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = {id(p): getattr(m, name) for m, name, p in places}
    for group in optimizer.param_groups:
        group["params"] = [sharded.get(id(p), p) for p in group["params"]]
    return model


@dataclass
class _Entry:
    """One sharded tensor: a parameter's (``state`` None) or one of its optimizer states."""

    key: str
    fp: Any  # FSDPParam
    state: str | None
    rows: int  # full dim-0 size


class FSDPResharder:
    """The re-shard of one FSDP2 model and its optimizer (module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.groups = [g for g in (_param_group(m) for m in model.modules()) if g is not None]
        if not self.groups:
            raise ShardingError("the model has no fully_shard'ed module: shard it with "
                                "torch.distributed.fsdp.fully_shard or pass sharding='fsdp'")
        for g in self.groups:
            if type(g.mesh_info) is not _fsdp()._fsdp_param_group.FSDPMeshInfo or (
                    g.post_forward_mesh_info not in (None, g.mesh_info)
                    and g.post_forward_mesh_info.mesh is not g.mesh_info.mesh):
                raise ShardingError(
                    "only a 1-D FSDP mesh with reshard_after_forward True or False can be "
                    "re-sharded live (HSDP and integer reshard_after_forward cannot yet)")
        self.params = [fp for g in self.groups for fp in g.fsdp_params]
        self._pending: dict[str, Holding] | None = None
        self.bytes_moved = 0

    def instrument(self, monitor: Any) -> CommClock:
        """FSDP's collectives, measured: ``monitor`` (a ``GradientNoiseMonitor``, or
        None) gets each micro-batch's local gradient - FSDP reduce-scatters it, so a
        reduce-scatter that first takes its squared norm sees exactly what DDP's hooks
        see (fp32/bf16: FSDP does not pre-divide it) - and the returned clock the time
        spent in all-gathers and reduce-scatters (their whole time where they are
        synchronous, as on CPU; a GPU's asynchronous ones count their launch only)."""
        clock = CommClock()
        gather, scatter = _measured_comms(monitor, clock)
        for m in self.model.modules():
            if _param_group(m) is not None:
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
        return clock

    # -- what moves ------------------------------------------------------------------
    def _state_keys(self, param: nn.Parameter) -> list[str]:
        state = self.optimizer.state.get(param, {})
        return sorted(k for k, v in state.items()
                      if isinstance(v, torch.Tensor) and v.shape == param.shape and v.dim())

    def entries(self, state_keys: Sequence[Sequence[str]] | None = None) -> list[_Entry]:
        """Every sharded tensor, in the same order on every rank (``state_keys``: the
        optimizer-state names per parameter where this rank has none yet)."""
        out = []
        for i, fp in enumerate(self.params):
            n = fp._orig_size[0]
            out.append(_Entry(f"{i}", fp, None, n))
            keys = state_keys[i] if state_keys is not None else self._state_keys(
                fp.sharded_param)
            out += [_Entry(f"{i}/{k}", fp, k, n) for k in keys]
        return out

    def state_layout(self) -> list[list[str]]:
        """The sharded optimizer-state names per parameter (rank 0 sends it to
        newcomers with :meth:`light_optimizer_state`)."""
        return [self._state_keys(fp.sharded_param) for fp in self.params]

    def light_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict`` without its sharded tensors (hyper-parameters,
        step counts): small, the same on every rank, what a newcomer loads before
        :meth:`finish` fills in the rest."""
        sd = self.optimizer.state_dict()
        from torch.distributed.tensor import DTensor

        sd["state"] = {i: {k: v for k, v in st.items() if not isinstance(v, DTensor)}
                       for i, st in sd["state"].items()}
        return sd

    def _old_local(self, e: _Entry) -> torch.Tensor:
        if e.state is None:
            return e.fp._sharded_param_data.view(e.fp.padded_sharded_param_size)
        return self.optimizer.state[e.fp.sharded_param][e.state]._local_tensor

    @staticmethod
    def _new_local(e: _Entry, like: torch.Tensor, world: int, rank: int) -> torch.Tensor:
        """A new shard: FSDP's padded storage for a parameter (its padding zeroed), the
        exact rows for a state. Uninitialised otherwise: every row is received or
        copied (a zero fill would cost a pass over the shard)."""
        lo, hi = shard_rows(e.rows, world, rank)
        rows = -(-e.rows // world) if e.state is None else hi - lo
        out = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
        out[hi - lo:].zero_()
        return out

    # -- phase 1: on the old group -----------------------------------------------------
    def hand_off(self, old: Sequence[str], new: Sequence[str], me: str) -> None:
        """Old group, new round known: survivors receive what their new shard lacks from
        any old shard; what only leavers hold and newcomers need is staged at survivors.
        A leaver's part ends here."""
        old, new = tuple(old), tuple(new)
        holdings: dict[str, Holding] = {}
        moves = []
        old_rank, j = old.index(me), new.index(me) if me in new else None
        for e in self.entries():
            local = self._old_local(e)
            h = Holding(old=local, old_start=shard_rows(e.rows, len(old), old_rank)[0])
            if j is not None:
                h.new, h.new_start = (self._new_local(e, local, len(new), j),
                                      shard_rows(e.rows, len(new), j)[0])
            holdings[e.key] = h
            moves += [(e.key, mv) for mv in plan_rows(e.rows, old, new).before]
        self.bytes_moved = exchange(moves, holdings, me, {w: i for i, w in enumerate(old)})
        self._pending = holdings if me in new else None

    # -- phase 2: on the new group -----------------------------------------------------
    def finish(self, old: Sequence[str], new: Sequence[str], me: str, mesh: Any,
               state_layout: list[list[str]] | None = None) -> None:
        """New group: newcomers receive their shards from survivors, then every rank
        re-points FSDP at ``mesh`` and swaps its new shards in. A newcomer passes rank
        0's ``state_layout``; a survivor must have run :meth:`hand_off`."""
        old, new = tuple(old), tuple(new)
        newcomer = me not in old
        entries = self.entries(state_layout if newcomer else None)
        j = new.index(me)
        if newcomer:
            holdings = {}
            for e in entries:
                like = e.fp._sharded_param_data.view(e.fp.padded_sharded_param_size)
                holdings[e.key] = Holding(new=self._new_local(e, like, len(new), j),
                                          new_start=shard_rows(e.rows, len(new), j)[0])
        else:
            if self._pending is None:
                raise RuntimeError("FSDPResharder.finish: this survivor did not hand off")
            holdings = self._pending
        moves = [(e.key, mv) for e in entries for mv in plan_rows(e.rows, old, new).after]
        self.bytes_moved += exchange(moves, holdings, me, {w: i for i, w in enumerate(new)})
        self._pending = None
        self._install(entries, holdings, mesh)

    def blank(self, new: Sequence[str], me: str, mesh: Any) -> None:
        """New group, after a failure took a shard: re-point FSDP at ``mesh`` with new,
        unfilled shards of this rank's size (a durable checkpoint is loaded into them
        next). A survivor's; a newcomer's model is on ``mesh`` already."""
        new = tuple(new)
        j = new.index(me)
        entries = self.entries()
        holdings = {e.key: Holding(new=self._new_local(e, self._old_local(e), len(new), j))
                    for e in entries}
        self._pending = None  # (a hand-off cut short by the failure)
        self._install(entries, holdings, mesh)

    def _repoint(self, mesh: Any) -> Any:
        """Every FSDP group at ``mesh``; returns its mesh info."""
        info = _fsdp()._fsdp_param_group.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        for g in self.groups:
            post = info if g.post_forward_mesh_info is not None else None
            g.mesh_info, g.post_forward_mesh_info = info, post
            g._all_gather_output = torch.empty(0, device=g.device)
            g._all_gather_result = None
        return info

    def _install(self, entries: list[_Entry], holdings: dict[str, Holding], mesh: Any) -> None:
        info = self._repoint(mesh)
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for e in entries:
            by_param.setdefault(id(e.fp), {})[e.state or ""] = holdings[e.key].new
        for g in self.groups:
            for fp in g.fsdp_params:
                new = by_param[id(fp)]
                _reinit(fp, info, g.post_forward_mesh_info, new.pop(""))
                param = fp.sharded_param
                if new:
                    state = self.optimizer.state.setdefault(param, {})
                    for k, local in new.items():
                        state[k] = fp.to_sharded_dtensor(local)


class CommClock:
    """Seconds spent in FSDP's collectives since the last :meth:`take`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _measured_comms(monitor: Any, clock: CommClock) -> tuple[Any, Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class MeasuredAllGather(DefaultAllGather):
        """FSDP's all-gather, timed."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            t0 = time.perf_counter()
            try:
                return super().__call__(output_tensor, input_tensor, group, async_op)
            finally:
                clock.seconds += time.perf_counter() - t0

    class MeasuredReduceScatter(DefaultReduceScatter):
        """FSDP's reduce-scatter, timed, after the local gradient's squared norm (issued
        without a host sync; the monitor measures only on its scheduled steps)."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if monitor is not None:
                monitor.add_local([input_tensor])
            t0 = time.perf_counter()
            try:
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            finally:
                clock.seconds += time.perf_counter() - t0

    return MeasuredAllGather(), MeasuredReduceScatter()


def _param_group(module: nn.Module) -> Any:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    return module._get_fsdp_state()._fsdp_param_group


def reset_iteration(model: nn.Module) -> None:
    """FSDP's per-iteration state back to idle and sharded after a failure cut a forward
    or backward short (the failed iteration's gradients are dropped): torch 2.13's
    ``FSDPModule.reset_iter_state`` on the root; before it, the same fields by hand."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return
    for m in model.modules():  # a failed all-gather's: waiting on it would raise its error
        g = _param_group(m)    # again, and nothing of it is read
        if g is not None:
            g._all_gather_result = None
    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()
        return
    fs = _fsdp()
    state = model._get_fsdp_state()
    for st in state._state_ctx.all_states:  # torch 2.11-2.12
        st._training_state = fs._fsdp_common.TrainingState.IDLE
        g = st._fsdp_param_group
        if g is not None:
            g._post_forward_indices.clear()
            g._training_state = fs._fsdp_common.TrainingState.IDLE
            g._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


@functools.cache
def _takes_mesh_info(cls: type) -> bool:
    return "mesh_info" in inspect.signature(cls._init_sharded_param).parameters


def _init_sharded_param(fp: Any, meta: nn.Parameter, info: Any) -> None:
    """``FSDPParam._init_sharded_param`` on the mesh ``info``, in either of its shapes
    (module docstring)."""
    if _takes_mesh_info(type(fp)):
        fp._init_sharded_param(meta, fp.device, None, info)
    else:  # torch 2.11-2.12: the mesh is the parameter's own attribute
        fp.mesh_info = info
        fp._init_sharded_param(meta, fp.device, None)


@torch.no_grad()
def _reinit(fp: Any, info: Any, post: Any, padded: torch.Tensor) -> None:
    """Point one FSDPParam at the new mesh with ``padded`` (its new padded shard) as its
    storage, keeping its ``nn.Parameter`` object."""
    keep = fp.sharded_param
    meta = nn.Parameter(torch.empty(fp._orig_size, dtype=padded.dtype, device="meta"),
                        requires_grad=keep.requires_grad)
    fp.post_forward_mesh_info = post
    _init_sharded_param(fp, meta, info)  # sizes, spec and mesh; no memory
    if post is not None:
        fp._init_sharded_post_forward_param_metadata(meta)
    if tuple(padded.shape) != tuple(fp.padded_sharded_param_size):
        raise AssertionError(f"new shard {tuple(padded.shape)} != FSDP's "
                             f"{tuple(fp.padded_sharded_param_size)}")
    fp._sharded_param_data = padded.view(-1)
    length = fp.sharded_size[0]
    fresh = nn.Parameter(fp.to_sharded_dtensor(padded.narrow(0, 0, length)),
                         requires_grad=keep.requires_grad)
    torch.utils.swap_tensors(keep, fresh)  # the optimizer's object, the new contents
    fp.sharded_param = keep
    fp._setattr_on_modules(keep)
    fp.all_gather_outputs = []
    fp._unsharded_inner_tensors = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param  # its size was the old world's all-gather output



# -- durable checkpoints of sharded state (torch.distributed.checkpoint) ------------------
def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state as DCP saves and loads it (DTensor shards, keyed
    by parameter name: loadable at any world size, and by FSDP users elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                 group: Any) -> Any:
    """Every rank: write its shards into the DCP folder ``path`` in the background
    (staged first, so training may go on); returns the future. ``group``: a process
    group of the checkpoint's own (the writes' collectives run beside training's)."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(sharded_state(model, optimizer), checkpoint_id=path,
                          process_group=group)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank: load the DCP folder ``path`` into the model and optimizer, re-sharded
    by DCP for this group, whatever group wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)  # (gives a fresh optimizer its state's shape)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
