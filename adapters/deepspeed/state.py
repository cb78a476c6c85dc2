"""Live rebuild of a DeepSpeed engine for a new data-parallel size, inside the process.

A DeepSpeed engine fixes its data-parallel size when it is built (ZeRO-1/2 cut the flat
fp32 master weights and the optimizer state into one partition per replica). To rescale
without restarting, the adapter:

1. :func:`capture` - on the *old* group, every old replica together: gather the training
   state into a **consolidated**, world-size-independent form keyed by parameter name
   (module state dict, fp32 master weights, per-parameter optimizer state, parameter-group
   hyper-parameters, LR scheduler, loss scaler, engine step counters, client state).
   ZeRO-1/2 partitions are gathered (each replica broadcasts its own in turn),
   so every old replica ends up with the whole state; the fp32 master weights are left
   out when they equal the module's parameters (fp32 training).
2. :func:`detach` - release the old engine (hooks off the user's module).
3. the rendezvous destroys the process group and forms the new one (not this module);
4. :func:`rebuild` / :func:`restore` - on the *new* group, every new replica together:
   build a new engine (``PolluxEngine`` has the survivors send newcomers the module's
   parameters point to point, :func:`share_module`, where DeepSpeed would broadcast them
   from rank 0 to everyone), then restore: replicas without the state (newcomers)
   receive, point to point from a survivor, what they need - the state's light part (a
   JSON skeleton and the small tensors, no pickle) and only their own partitions of the
   optimizer state, straight into the engine's buffers (:func:`_share`); each survivor
   cuts its own partitions for the new size. The module's tensors in the state are not
   copies: a rebuilt engine flattens the parameters where they lie
   (``compat.flat_buffers_reused``), so they may be the live parameters.

The consolidated state is plain nested dicts/lists of tensors and numbers, the format of
``pollux_launch.rendezvous.process_group.send_state`` and ``broadcast_state``::

    {"format": 1, "zero_stage": 2,
     "module": {name: tensor},                 # module.state_dict(): params and buffers
     "master": {name: fp32 tensor} | None,     # fp32 master weights (ZeRO-1/2), None
                                               # when equal to the module's parameters
     "optimizer": {"param_groups": [{hyper-parameters..., "param_names": [...]}],
                   "state": {param name: {"exp_avg": tensor, "step": tensor, ...}}},
     "lr_scheduler": {...} | None, "loss_scaler": {...} | None,
     "counters": {"global_steps": .., "global_samples": .., "skipped_steps": .., "micro_steps": ..},
     "client": {...}}

The same format comes out of every ZeRO stage, so states can be compared across sizes
(the tests do) and even across stages.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from pollux_launch.rendezvous.process_group import recv_state, send_state, share_state

from . import compat

FORMAT = 1
MASTER = "__master__"  # a newcomer's received master partition, in state["partitions"]
EngineState = dict[str, Any]


def current_world_size() -> int:
    """The replicas of the current group (``WORLD_SIZE`` before one is formed)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


# -- capture --------------------------------------------------------------------------

def capture(engine: Any, client_state: dict[str, Any] | None = None) -> EngineState:
    """The engine's full training state, consolidated (see module docstring).

    Collective at ZeRO-1/2: every replica of the engine's (old) group must call it.
    Call it at an optimizer-step boundary (no accumulated gradients are captured).
    """
    stage = compat.check_supported(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    state: EngineState = {
        "format": FORMAT,
        "zero_stage": stage,
        # not copied: a rebuild flattens the parameters into new memory and leaves these
        # as they are (the build's broadcast of rank 0's parameters, equal on every
        # replica, aside)
        "module": {k: v.detach() for k, v in engine.module.state_dict().items()},
        "counters": compat.get_counters(engine),
        "lr_scheduler": (engine.lr_scheduler.state_dict()
                         if engine.lr_scheduler is not None else None),
        "loss_scaler": _loss_scaler_state(engine),
        "client": dict(client_state or {}),
    }
    if stage == 0:
        state["optimizer"] = _capture_torch_optimizer(engine.optimizer, names)
    else:
        state["master"], state["optimizer"] = _capture_zero(engine, names)
    return state


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _capture_torch_optimizer(opt: torch.optim.Optimizer, names: dict[int, str]
                             ) -> dict[str, Any]:
    groups, per_param = [], {}
    for group in opt.param_groups:
        groups.append({**_hyper(group), "param_names": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            per_param[names[id(p)]] = {
                k: (v.detach().clone() if torch.is_tensor(v) else v)
                for k, v in opt.state.get(p, {}).items()}
    return {"param_groups": groups, "state": per_param}


def _gather_flats(zg: compat.ZeroGroup, partitions: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole padded flat buffers of several same-size tensor kinds (master weights,
    exp_avg, ...) from every replica's partitions, each straight into its own flat
    buffer: every replica broadcasts its partition in turn (gloo's all-gather moves
    ~100 MB/s on loopback, its broadcast ~1 GB/s)."""
    if len(set(zg.partition_sizes)) != 1:
        raise RuntimeError("unequal ZeRO partitions: not produced by DeepSpeed 0.19.8")
    out = []
    for t in partitions:
        n = t.numel()
        flat = torch.empty(zg.world * n, dtype=t.dtype, device=t.device)
        flat[zg.rank * n:(zg.rank + 1) * n] = t.detach().reshape(-1)
        for r in range(zg.world):
            dist.broadcast(flat[r * n:(r + 1) * n], group=zg.group, group_src=r)
        out.append(flat)
    return out


def _split_flat(zg: compat.ZeroGroup, flat: torch.Tensor, names: dict[int, str]
                ) -> dict[str, torch.Tensor]:
    return {names[id(p)]: flat.narrow(0, off, p.numel()).view(p.shape)
            for p, off in zip(zg.params, zg.offsets, strict=True)}


def _master_is_module(engine: Any, zgroups: list[compat.ZeroGroup]) -> bool:
    """Whether every replica's fp32 master partition equals its module parameters (fp32
    training: DeepSpeed copies the master into the parameters after every step), so the
    consolidated state needs no separate master copy. Collective (one 4-byte all-reduce)."""
    zopt = engine.optimizer
    same = all(
        zg.fp32.dtype == zopt.parallel_partitioned_bit16_groups[i][zg.rank].dtype
        and torch.equal(zg.fp32, zopt.parallel_partitioned_bit16_groups[i][zg.rank])
        for i, zg in enumerate(zgroups))
    flag = torch.tensor([int(same)], dtype=torch.int32)
    if zgroups and zgroups[0].world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=zgroups[0].group)
    return bool(flag.item())


def _capture_zero(engine: Any, names: dict[int, str]) -> tuple[dict | None, dict]:
    """(master weights or None when they equal the module's, optimizer state); one
    gather per parameter group and tensor kind."""
    basic = compat.basic_optimizer(engine)
    zgroups = list(compat.zero_groups(engine))
    keep_master = not _master_is_module(engine, zgroups)
    master: dict[str, torch.Tensor] = {}
    groups, per_param = [], {}
    for zg, group in zip(zgroups, basic.param_groups, strict=True):
        gnames = [names[id(p)] for p in zg.params]
        groups.append({**_hyper(group), "param_names": gnames})
        pstates: dict[str, dict[str, Any]] = {n: {} for n in gnames}
        flat_kinds: dict[torch.dtype, list[tuple[str | None, torch.Tensor]]] = {}
        if keep_master:
            flat_kinds.setdefault(zg.fp32.dtype, []).append((None, zg.fp32))
        for key, value in basic.state.get(zg.fp32, {}).items():
            if torch.is_tensor(value) and value.shape == zg.fp32.shape:
                flat_kinds.setdefault(value.dtype, []).append((key, value))
            else:  # shared by the whole group (e.g. Adam's step): same on every replica
                for n in gnames:
                    pstates[n][key] = value.detach().clone() if torch.is_tensor(value) else value
        for dtype in sorted(flat_kinds, key=str):  # the same order on every replica
            kinds = flat_kinds[dtype]
            flats = _gather_flats(zg, [t for _, t in kinds])
            for (key, _), flat in zip(kinds, flats, strict=True):
                split = _split_flat(zg, flat, names)
                if key is None:
                    master.update(split)
                else:
                    for n, t in split.items():
                        pstates[n][key] = t
        per_param.update(pstates)
    return (master if keep_master else None), {"param_groups": groups, "state": per_param}


def _loss_scaler_state(engine: Any) -> dict[str, Any] | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items()
            if isinstance(v, (bool, int, float)) and not k.startswith("_")}


# -- detach / rebuild / restore -------------------------------------------------------

def detach(engine: Any) -> None:
    """Release the old engine (local): its hooks leave the module, which the new engine
    reuses. Call after :func:`capture`, before the process group is destroyed or after."""
    compat.detach_engine(engine)


def rebuild(build: Callable[[], Any], state: EngineState | None) -> Any:
    """Build a new engine on the current (new) process group and restore ``state``.

    ``build()`` returns the new engine (or ``deepspeed.initialize``'s tuple); survivors
    pass their captured state, newcomers ``None``. Collective over the new group. Returns
    what ``build()`` returned.
    """
    compat.release_group_caches()
    built = build()
    engine = built[0] if isinstance(built, tuple) else built
    restore(engine, state)
    return built


def share_module(engine: Any, holders: list[int]) -> None:
    """The module's parameters from the ranks in ``holders`` (alike on each, as on
    data-parallel replicas) to the others, in place and point to point
    (``share_state``): what building the engine would broadcast from rank 0 to every
    rank, survivors included. Nothing moves when every rank holds them (a shrink)."""
    params = {n: p.data for n, p in engine.module.named_parameters()}
    share_state(params, holders, into=params)


def state_holders(have: bool) -> list[int]:
    """The ranks that hold a state (one small all-reduce on the current group)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    flags[dist.get_rank()] = int(have)
    dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()


def restore(engine: Any, state: EngineState | None, holders: list[int] | None = None
            ) -> EngineState | None:
    """Load a consolidated state into ``engine`` (built for the current world size).

    Collective: every rank calls it, with its state or ``None`` (``holders``: the ranks
    with one, if :func:`state_holders` was asked already). If nobody has a state (a fresh
    start) nothing happens and ``None`` is returned. Otherwise ranks without one
    (newcomers) receive what they need (:func:`_share`), every rank loads it, and the
    state is returned - a newcomer's at ZeRO-1/2 with ``"partial": True`` (its own
    partitions of the optimizer state only).
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        holders = state_holders(state is not None) if holders is None else holders
        if not holders:
            return None
        if len(holders) < dist.get_world_size():
            state = _share(engine, state, holders)
    if state is None:
        return None
    if state.get("format") != FORMAT:
        raise ValueError(f"engine state format {state.get('format')!r}, expected {FORMAT}")
    stage = compat.check_supported(engine)
    with torch.no_grad():
        engine.module.load_state_dict(state["module"], strict=True)
        if stage == 0:
            _restore_torch_optimizer(engine, state["optimizer"])
        else:
            _restore_zero(engine, state)
    if state.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and state.get("loss_scaler"):
        for k, v in state["loss_scaler"].items():
            setattr(scaler, k, v)
    compat.set_counters(engine, state["counters"])
    compat.align_micro_steps(engine)
    return state


# -- sending the state to newcomers -----------------------------------------------------

def _share(engine: Any, state: EngineState | None, holders: list[int]) -> EngineState:
    """Give every rank without a state what it needs to load one (collective).

    Rather than broadcasting the whole consolidated state to every rank (survivors
    already hold it), each newcomer receives from one holder, point to point: the state's
    *light* part (everything but the parameter-shaped tensors: buffers, counters,
    hyper-parameters, scheduler, client) and the parameter-shaped optimizer tensors it
    needs - at ZeRO-1/2 only its own partitions, at ZeRO-0 all of them. The module's
    parameters are already the holders' everywhere: building the engine synced them
    (:func:`share_module`, or DeepSpeed's own broadcast from rank 0:
    ``compat.engine_broadcasts_module``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = compat.check_supported(engine)
    params = dict(engine.module.named_parameters())
    module_synced = holders[0] == 0 and compat.engine_broadcasts_module(engine)
    newcomers = [r for r in range(world) if r not in set(holders)]
    zgroups = list(compat.zero_groups(engine)) if stage else []
    light = _light(state, params, module_synced) if state is not None else None
    for i, r in enumerate(newcomers):
        sender = holders[i % len(holders)]  # spread the sending over the holders
        if rank == sender:
            send_state(light, r)
            _send_heavy(state, light, zgroups, params, r, stage)
        elif rank == r:
            state = recv_state(sender)
            for name, p in params.items():  # the engine's own, as synced when built
                state["module"].setdefault(name, p.detach())
            if stage:
                _recv_partitions(engine, state, zgroups, sender)
            else:
                _recv_heavy(state, params, sender)
    assert state is not None
    return state


def _heavy_keys(state: EngineState, names: list[str], shapes: dict[str, torch.Size]
                ) -> list[str]:
    """Optimizer-state keys whose tensors have their parameter's shape (e.g. exp_avg)."""
    first = state["optimizer"]["state"].get(names[0], {}) if names else {}
    return [k for k, v in first.items()
            if torch.is_tensor(v) and all(
                torch.is_tensor(state["optimizer"]["state"][n].get(k))
                and state["optimizer"]["state"][n][k].shape == shapes[n] for n in names)]


def _light(state: EngineState, params: dict[str, torch.nn.Parameter], module_synced: bool
           ) -> EngineState:
    """``state`` without its parameter-shaped tensors (the module's parameters too when
    ``module_synced``); ``"heavy"`` lists, per parameter group, the left-out keys."""
    shapes = {n: p.shape for n, p in params.items()}
    light = {k: v for k, v in state.items() if k not in ("module", "master", "optimizer")}
    light["module"] = {k: v for k, v in state["module"].items()
                       if not (module_synced and k in params)}
    if "master" in state:
        light["master"] = None
    opt = state["optimizer"]
    heavy = [_heavy_keys(state, g["param_names"], shapes) for g in opt["param_groups"]]
    heavy_of = {n: keys for g, keys in zip(opt["param_groups"], heavy, strict=True)
                for n in g["param_names"]}
    light["optimizer"] = {"param_groups": opt["param_groups"], "state": {
        n: {k: v for k, v in entry.items() if k not in heavy_of.get(n, ())}
        for n, entry in opt["state"].items()}}
    dtypes = [[str(opt["state"][g["param_names"][0]][k].dtype).removeprefix("torch.")
               for k in keys] for g, keys in zip(opt["param_groups"], heavy, strict=True)]
    light["heavy"] = {"keys": heavy, "dtypes": dtypes,
                      "master": state.get("master") is not None}
    return light


def _heavy_tensors(state: EngineState, light: EngineState, zgroups: list[compat.ZeroGroup],
                   params: dict[str, torch.nn.Parameter], rank: int, stage: int
                   ) -> Iterator[torch.Tensor]:
    """What a newcomer at ``rank`` needs, in a fixed order: per parameter group, the
    master weights (if the state has them) and each heavy key - cut to ``rank``'s
    partition at ZeRO-1/2 (into one buffer per dtype, reused: take each before the
    next), whole per-parameter tensors at ZeRO-0."""
    names = {id(p): n for n, p in params.items()}
    heavy = light["heavy"]
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for gi, (keys, group) in enumerate(zip(heavy["keys"], state["optimizer"]["param_groups"],
                                          strict=True)):
        gnames = group["param_names"]
        per_key = [{n: state["optimizer"]["state"][n][k] for n in gnames} for k in keys]
        if stage == 0:
            yield from (t for per in per_key for t in per.values())
            continue
        zg = dataclasses.replace(zgroups[gi], rank=rank)  # the newcomer's partition
        size = zg.partition_sizes[rank]
        kinds = [state["master"]] if heavy["master"] else []
        for tensors in kinds + per_key:
            dtype = next(iter(tensors.values())).dtype
            buf = scratch.get(dtype)
            if buf is None or buf.numel() != size:
                buf = scratch[dtype] = torch.empty(size, dtype=dtype, device=zg.fp32.device)
            yield _cut_partition(zg, tensors, names, dtype, out=buf)


def _send_heavy(state: EngineState, light: EngineState, zgroups: list[compat.ZeroGroup],
                params: dict[str, torch.nn.Parameter], rank: int, stage: int) -> None:
    """Send the newcomer at ``rank`` its heavy tensors: at ZeRO-1/2 one message per
    partition, at ZeRO-0 (one tensor per parameter) one per dtype."""
    tensors = _heavy_tensors(state, light, zgroups, params, rank, stage)
    for t in (_by_dtype(list(tensors)) if stage == 0 else tensors):
        dist.send(t, rank)


def _by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat buffer per dtype (in a fixed order), for one message each."""
    dtypes = sorted({t.dtype for t in tensors}, key=str)
    return [torch.cat([t.reshape(-1) for t in tensors if t.dtype == d]) for d in dtypes]


def _recv_heavy(state: EngineState, params: dict[str, torch.nn.Parameter], sender: int
                ) -> None:
    """ZeRO-0: receive the heavy tensors a holder sends in :func:`_share` into ``state``
    (a newcomer's)."""
    heavy = state.pop("heavy")
    per_param = state["optimizer"]["state"]
    # the sender's layout, rebuilt from the light state and the local engine
    slots: list[tuple[torch.Size, torch.dtype, Callable[[torch.Tensor], None]]] = []
    for keys, dtypes, group in zip(heavy["keys"], heavy["dtypes"],
                                   state["optimizer"]["param_groups"], strict=True):
        for k, dt in zip(keys, dtypes, strict=True):
            for n in group["param_names"]:
                slots.append((params[n].shape, getattr(torch, dt),
                              lambda t, n=n, k=k: per_param[n].__setitem__(k, t)))
    for dtype in sorted({d for _, d, _ in slots}, key=str):
        mine = [(shape, put) for shape, d, put in slots if d == dtype]
        sizes = [shape.numel() for shape, _ in mine]
        flat = torch.empty(sum(sizes), dtype=dtype)
        dist.recv(flat, sender)
        for (shape, put), piece in zip(mine, torch.split(flat, sizes), strict=True):
            put(piece.view(shape))


def _recv_partitions(engine: Any, state: EngineState, zgroups: list[compat.ZeroGroup],
                     sender: int) -> None:
    """ZeRO-1/2: receive this newcomer's partitions (:func:`_share`), each straight into
    the engine's own tensor where one fits (the fp32 master partition; the optimizer
    state DeepSpeed created when it built the engine), else into a new one."""
    heavy = state.pop("heavy")
    basic = compat.basic_optimizer(engine)
    partitions: list[dict[str, torch.Tensor]] = []
    for zg, keys, dtypes in zip(zgroups, heavy["keys"], heavy["dtypes"], strict=True):
        size, own = zg.partition_sizes[zg.rank], basic.state.get(zg.fp32, {})
        slots = [(MASTER, zg.fp32.dtype, zg.fp32.data)] if heavy["master"] else []
        slots += [(k, getattr(torch, dt), own.get(k))
                  for k, dt in zip(keys, dtypes, strict=True)]
        part: dict[str, torch.Tensor] = {}
        for key, dtype, target in slots:
            buf = _fitting(target, size, dtype)
            if buf is None:
                buf = torch.empty(size, dtype=dtype, device=zg.fp32.device)
            dist.recv(buf, sender)
            part[key] = buf
        partitions.append(part)
    state["partitions"] = partitions
    state["partial"] = True


def _fitting(t: Any, size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` if a partition of ``size`` elements of ``dtype`` can be written into it."""
    ok = (torch.is_tensor(t) and t.dtype == dtype and t.dim() == 1 and t.numel() == size
          and t.is_contiguous())
    return t if ok else None


def _check_groups(groups: list[dict[str, Any]], saved: list[dict[str, Any]],
                  names: list[list[str]]) -> None:
    if [g["param_names"] for g in saved] != names:
        raise ValueError("the engine's parameter groups differ from the captured state's: "
                         "build the model and optimizer the same way on every worker")


def _restore_torch_optimizer(engine: Any, saved: dict[str, Any]) -> None:
    opt = engine.optimizer
    by_name = dict(engine.module.named_parameters())
    names = {id(p): n for n, p in by_name.items()}
    _check_groups(opt.param_groups, saved["param_groups"],
                  [[names[id(p)] for p in g["params"]] for g in opt.param_groups])
    for group, sg in zip(opt.param_groups, saved["param_groups"], strict=True):
        group.update({k: v for k, v in sg.items() if k != "param_names"})
        for p in group["params"]:
            entry = saved["state"].get(names[id(p)], {})
            opt.state[p] = {k: (v.clone().to(p.device) if torch.is_tensor(v) and v.dim() > 0
                                else (v.clone() if torch.is_tensor(v) else v))
                            for k, v in entry.items()}


def _cut_partition(zg: compat.ZeroGroup, tensors: dict[str, torch.Tensor],
                   names: dict[int, str], dtype: torch.dtype, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """This replica's partition of the padded flat buffer built from per-param tensors
    (written into ``out`` if given)."""
    start, size = zg.start, zg.partition_sizes[zg.rank]
    pieces = []
    for p, off in zip(zg.params, zg.offsets, strict=True):
        lo, hi = max(off, start), min(off + p.numel(), start + size)
        if lo < hi:  # the parameter overlaps this partition
            pieces.append((lo, hi, tensors[names[id(p)]].reshape(-1)[lo - off: hi - off]))
    if out is None:
        out = torch.zeros(size, dtype=dtype, device=zg.fp32.device)
    elif sum(hi - lo for lo, hi, _ in pieces) < size:  # padding
        out.zero_()
    for lo, hi, src in pieces:
        out[lo - start: hi - start] = src
    return out


def _restore_zero(engine: Any, state: EngineState) -> None:
    """Cut this replica's partitions out of the consolidated tensors, or take the ones a
    newcomer received (``state["partitions"]``, see :func:`_share`)."""
    basic = compat.basic_optimizer(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    zgroups = list(compat.zero_groups(engine))
    saved = state["optimizer"]
    _check_groups(basic.param_groups, saved["param_groups"],
                  [[names[id(p)] for p in zg.params] for zg in zgroups])
    master = state.get("master") or {n: t for n, t in state["module"].items()}
    received = state.get("partitions") or [{} for _ in zgroups]
    for zg, group, sg, got in zip(zgroups, basic.param_groups, saved["param_groups"],
                                  received, strict=True):
        if MASTER in got:
            zg.fp32.data.copy_(got[MASTER])
        else:
            _cut_partition(zg, master, names, zg.fp32.dtype, out=zg.fp32.data)
        group.update({k: v for k, v in sg.items() if k != "param_names"})
        first = saved["state"].get(sg["param_names"][0], {})
        own = basic.state.get(zg.fp32, {})  # as DeepSpeed's build created it
        new_state: dict[str, Any] = {}
        for key, value in first.items():
            if key in got:
                continue  # a newcomer's, received
            per = {n: saved["state"][n][key] for n in sg["param_names"]}
            if torch.is_tensor(value) and all(
                    per[names[id(p)]].shape == p.shape for p in zg.params):
                out = _fitting(own.get(key), zg.partition_sizes[zg.rank], value.dtype)
                new_state[key] = _cut_partition(zg, per, names, value.dtype, out=out)
            else:
                new_state[key] = value.clone() if torch.is_tensor(value) else value
        new_state.update({k: t for k, t in got.items() if k != MASTER})
        basic.state[zg.fp32] = new_state
