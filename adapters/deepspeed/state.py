"""Live rebuild of a DeepSpeed engine for a new data-parallel size, inside the process.

A DeepSpeed engine fixes its data-parallel size when it is built (ZeRO-1/2 cut the flat
fp32 master weights and the optimizer state into one partition per replica). To rescale
without restarting, the adapter:

1. :func:`capture` - on the *old* group, every old replica together: gather the training
   state into a **consolidated**, world-size-independent form keyed by parameter name
   (module state dict, fp32 master weights, per-parameter optimizer state, parameter-group
   hyper-parameters, LR scheduler, loss scaler, engine step counters, client state).
   ZeRO-1/2 partitions are all-gathered (one collective per tensor kind and group), so
   every old replica ends up with the whole state.
2. :func:`detach` - release the old engine (hooks off the user's module).
3. the rendezvous destroys the process group and forms the new one (not this module);
4. :func:`rebuild` / :func:`restore` - on the *new* group, every new replica together:
   build a new engine, then restore: if some replica (a newcomer) lacks the state, it is
   broadcast from the lowest rank that has it (one JSON skeleton + one flat buffer per
   dtype, no pickle); each replica then cuts its own partition for the new size.

The consolidated state is plain nested dicts/lists of tensors and numbers, the format of
``pollux_launch.rendezvous.process_group.broadcast_state``::

    {"format": 1, "zero_stage": 2,
     "module": {name: tensor},                 # module.state_dict(): params and buffers
     "master": {name: fp32 tensor},            # full fp32 master weights (ZeRO-1/2)
     "optimizer": {"param_groups": [{hyper-parameters..., "param_names": [...]}],
                   "state": {param name: {"exp_avg": tensor, "step": tensor, ...}}},
     "lr_scheduler": {...} | None, "loss_scaler": {...} | None,
     "counters": {"global_steps": .., "global_samples": .., "skipped_steps": .., "micro_steps": ..},
     "client": {...}}

The same format comes out of every ZeRO stage, so states can be compared across sizes
(the tests do) and even across stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pollux_launch.rendezvous.process_group import broadcast_state

from . import compat

FORMAT = 1
EngineState = dict[str, Any]


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
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
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


def _gather_flat(zg: compat.ZeroGroup, partition: torch.Tensor) -> torch.Tensor:
    """The whole padded flat buffer from every replica's partition (one all-gather)."""
    if len(set(zg.partition_sizes)) != 1:
        raise RuntimeError("unequal ZeRO partitions: not produced by DeepSpeed 0.19.8")
    parts = [torch.empty_like(partition) for _ in range(zg.world)]
    dist.all_gather(parts, partition.contiguous(), group=zg.group)
    return torch.cat(parts)


def _split_flat(zg: compat.ZeroGroup, flat: torch.Tensor, names: dict[int, str]
                ) -> dict[str, torch.Tensor]:
    return {names[id(p)]: flat.narrow(0, off, p.numel()).view(p.shape)
            for p, off in zip(zg.params, zg.offsets, strict=True)}


def _capture_zero(engine: Any, names: dict[int, str]) -> tuple[dict, dict]:
    basic = compat.basic_optimizer(engine)
    master: dict[str, torch.Tensor] = {}
    groups, per_param = [], {}
    for zg, group in zip(compat.zero_groups(engine), basic.param_groups, strict=True):
        master.update(_split_flat(zg, _gather_flat(zg, zg.fp32.detach()), names))
        gnames = [names[id(p)] for p in zg.params]
        groups.append({**_hyper(group), "param_names": gnames})
        pstates: dict[str, dict[str, Any]] = {n: {} for n in gnames}
        for key, value in basic.state.get(zg.fp32, {}).items():
            if torch.is_tensor(value) and value.shape == zg.fp32.shape:
                for n, t in _split_flat(zg, _gather_flat(zg, value.detach()), names).items():
                    pstates[n][key] = t
            else:  # shared by the whole group (e.g. Adam's step): same on every replica
                for n in gnames:
                    pstates[n][key] = value.detach().clone() if torch.is_tensor(value) else value
        per_param.update(pstates)
    return master, {"param_groups": groups, "state": per_param}


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


def _source_rank(have: bool) -> tuple[int | None, bool]:
    """(lowest rank holding the state or None, whether every rank holds it)."""
    world = dist.get_world_size()
    flags = torch.zeros(world, dtype=torch.int32)
    flags[dist.get_rank()] = int(have)
    dist.all_reduce(flags)
    holders = flags.nonzero().flatten().tolist()
    return (holders[0] if holders else None), len(holders) == world


def restore(engine: Any, state: EngineState | None) -> EngineState | None:
    """Load a consolidated state into ``engine`` (built for the current world size).

    Collective: every rank calls it, with its state or ``None``. If nobody has a state
    (a fresh start) nothing happens and ``None`` is returned; otherwise the state is
    broadcast to the ranks without one, loaded everywhere and returned.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        src, everyone = _source_rank(state is not None)
        if src is None:
            return None
        if not everyone:
            state = broadcast_state(state if dist.get_rank() == src else None, src=src)
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
                   names: dict[int, str], dtype: torch.dtype) -> torch.Tensor:
    """This replica's partition of the padded flat buffer built from per-param tensors."""
    start, size = zg.start, zg.partition_sizes[zg.rank]
    out = torch.zeros(size, dtype=dtype, device=zg.fp32.device)
    for p, off in zip(zg.params, zg.offsets, strict=True):
        lo, hi = max(off, start), min(off + p.numel(), start + size)
        if lo < hi:  # the parameter overlaps this partition
            src = tensors[names[id(p)]].reshape(-1)
            out[lo - start: hi - start] = src[lo - off: hi - off]
    return out


def _restore_zero(engine: Any, state: EngineState) -> None:
    basic = compat.basic_optimizer(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    zgroups = list(compat.zero_groups(engine))
    saved = state["optimizer"]
    _check_groups(basic.param_groups, saved["param_groups"],
                  [[names[id(p)] for p in zg.params] for zg in zgroups])
    master = state.get("master") or {n: t for n, t in state["module"].items()}
    for zg, group, sg in zip(zgroups, basic.param_groups, saved["param_groups"], strict=True):
        zg.fp32.data.copy_(_cut_partition(zg, master, names, zg.fp32.dtype))
        group.update({k: v for k, v in sg.items() if k != "param_names"})
        first = saved["state"].get(sg["param_names"][0], {})
        new_state: dict[str, Any] = {}
        for key, value in first.items():
            per = {n: saved["state"][n][key] for n in sg["param_names"]}
            if torch.is_tensor(value) and all(
                    per[names[id(p)]].shape == p.shape for p in zg.params):
                new_state[key] = _cut_partition(zg, per, names, value.dtype)
            else:
                new_state[key] = value.clone() if torch.is_tensor(value) else value
        basic.state[zg.fp32] = new_state
