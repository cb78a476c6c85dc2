"""Forming a ``torch.distributed`` process group inside a running process, once per round,
and moving training state across it.

Each round's rank 0 hosts a fresh ``TCPStore`` on a port the OS picks (a few ms) and
publishes it in the round's state; the others connect to it. ``init_process_group`` with
that store takes ~20 ms for 4 gloo ranks on loopback and ``destroy_process_group`` ~30 ms,
so a survivor's whole pause is dominated by noticing the change, not by torch.

State moves without pickle: a JSON skeleton of the nested structure (dicts, lists,
tuples, numbers, strings), then the tensors - the small ones in one flat buffer per dtype,
each large one straight from the sender's memory into the receiver's (into the tensor it
replaces when the receiver passes its own state). ``broadcast_state`` sends rank 0's state
to every rank (a failure: survivors may be a step apart); ``share_state`` only to the
ranks that lack it (newcomers), point to point from the ranks that hold it, in parallel.

A process leaves no group behind at exit (see "Leaving at exit" below): gloo's threads must
be gone before the interpreter finalises, or it may abort the process.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import inspect
import json
import logging
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .sever import sever_sockets, tcp_sockets

log = logging.getLogger(__name__)
# the TCP sockets (inodes) made while the current round's group formed (sever.py)
_round_sockets: set[int] = set()


def default_backend() -> str:
    """nccl when this process can use a GPU, else gloo."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def host_store(addr: str, world_size: int, timeout: float) -> dist.TCPStore:
    """A TCPStore server for a new round on ``addr``, port chosen by the OS (``.port``)."""
    return dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


@dataclass
class Group:
    """The process group of one round. ``control`` is a gloo group for tiny CPU
    collectives (the per-step rescale vote) - the default group itself when it is gloo."""

    backend: str
    rank: int
    world_size: int
    store: dist.Store
    control: Any = None


def form_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout: float,
               hosted: dist.TCPStore | None = None) -> Group:
    """Destroy any current default group and initialise a new one (rank 0 passes the
    ``hosted`` store it published; the others connect to ``addr:port``)."""
    destroy_group()
    with round_connections():
        return _form(backend, addr, port, rank, world_size, timeout, hosted)


def _form(backend: str, addr: str, port: int, rank: int, world_size: int, timeout: float,
          hosted: dist.TCPStore | None) -> Group:
    # torch names a process's groups by a counter that only a successful group's destroy
    # resets, and prefixes their store keys with it: after a failed init, this process
    # would wait on other keys than its peers, for ever
    dist.distributed_c10d._world.group_count = 0
    td = datetime.timedelta(seconds=timeout)
    store = hosted if hosted is not None else dist.TCPStore(
        addr, port, world_size, is_master=False, timeout=td)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return Group(backend, rank, world_size, store, control)


@contextmanager
def round_connections() -> Iterator[None]:
    """Count the TCP connections made inside (gloo's pairs of a group formed there, the
    round's store) as the current round's: :func:`destroy_group` shuts them down."""
    before = tcp_sockets()
    try:
        yield
    finally:
        _round_sockets.update(tcp_sockets() - before)


def destroy_group() -> None:
    """Tear down the default process group and every other group, if any (a broken one
    included), and let go of the references torch itself kept to them
    (:func:`forget_destroyed_groups`). The connections made for the group are shut down
    first: whatever still holds it (FSDP2's mesh) cannot keep a peer waiting on this rank
    (``sever.py``)."""
    sever_sockets(set(_round_sockets))
    _round_sockets.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_destroyed_groups()


# -- leaving at exit ---------------------------------------------------------------------
#
# A gloo process group ends its threads (two workers and gloo's TCP loop) only when its
# last reference goes. A worker thread that finished a collective then drops the
# collective's tensors, and dropping a tensor that has a Python object takes the GIL. If
# the group is still alive when the interpreter finalises and a worker only then asks for
# the GIL, the finalising interpreter ends that thread (pthread_exit) - an unwind through
# a noexcept destructor: std::terminate, "terminate called without an active exception",
# SIGABRT, whatever way the script ended. A race: a few exits in a thousand to a few in a
# hundred on a busy 2-core machine, one in 7 when the GIL's switch interval keeps the
# worker waiting. Destroying a group joins its threads (the GIL released meanwhile), so it
# cannot happen once every group is destroyed and released before the finalisation:
#
# * torch 2.13 and DeepSpeed evaluate ``group.WORLD`` as a default argument in a few
#   modules; imported while a group exists they hold that group for good, past
#   ``destroy_process_group``. ``torch._dynamo`` imports ``torch.distributed.nn.functional``
#   when a script builds its first optimizer - typically just after its group formed.
#   Imported here, before any group exists, it holds None (the default group at call
#   time, as torch means it); a group they captured anyway is let go by
#   :func:`forget_destroyed_groups` (which also keeps them from calling a destroyed group
#   after a live rescale).
# * our objects that hold a group (the trainer's DDP wrapper, a DeepSpeed engine) register
#   a release with :func:`release_at_exit`;
# * :func:`_leave_at_exit` (registered when this module is imported, so it runs after the
#   atexit handlers registered later - ``ElasticJob.close`` among them) runs those
#   releases, destroys what is still formed and collects what only cycles still hold.

# the modules that evaluate ``group.WORLD`` as a default argument at import (torch 2.13,
# DeepSpeed 0.19: its ``TorchBackend.barrier``); tests/adapters/test_clean_exit.py reads
# the installed sources for others
CAPTURING_MODULES = ("torch.distributed.nn.functional",
                     "torch.distributed.optim.zero_redundancy_optimizer",
                     "torch.distributed.fsdp.sharded_grad_scaler",
                     "deepspeed.comm.torch")

if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn.functional  # (see above: it holds None, not a group)


def _functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """The functions defined in ``module``, its classes' methods included, unwrapped."""
    for obj in list(vars(module).values()):
        found: list[Any] = []
        if isinstance(obj, types.FunctionType):
            found.append(obj)
        elif isinstance(obj, type) and obj.__module__ == module.__name__:
            found.extend(getattr(v, "__func__", v) for v in vars(obj).values())
        for fn in found:
            while isinstance(fn, types.FunctionType):
                yield fn
                fn = getattr(fn, "__wrapped__", None)


def forget_destroyed_groups() -> None:
    """Set the default arguments of torch's functions that hold a process group other than
    the current default one back to None, the default group at call time (see "Leaving at
    exit"). About 0.2 ms."""
    world = dist.group.WORLD if dist.is_initialized() else None

    def stale(v: Any) -> bool:
        return isinstance(v, dist.ProcessGroup) and v is not world

    for name in CAPTURING_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for fn in _functions(module):
            if fn.__defaults__ and any(stale(v) for v in fn.__defaults__):
                fn.__defaults__ = tuple(None if stale(v) else v for v in fn.__defaults__)
            kw = fn.__kwdefaults__
            if kw and any(stale(v) for v in kw.values()):
                fn.__kwdefaults__ = {k: None if stale(v) else v for k, v in kw.items()}


def forget_groups_in(obj: Any) -> None:
    """Set ``obj``'s attributes that hold process groups (alone, or in a list, tuple or
    dict) to None: for framework objects that outlive their groups and are not ours to
    drop - an engine a user's ``loss`` still reaches through its backward hooks, say."""
    attrs = getattr(obj, "__dict__", None)
    for name, value in list(attrs.items()) if isinstance(attrs, dict) else ():
        if isinstance(value, dist.ProcessGroup):
            attrs[name] = None
        elif isinstance(value, (list, tuple)) and any(
                isinstance(v, dist.ProcessGroup) for v in value):
            attrs[name] = type(value)(None if isinstance(v, dist.ProcessGroup) else v
                                      for v in value)
        elif isinstance(value, dict) and any(
                isinstance(v, dist.ProcessGroup) for v in value.values()):
            attrs[name] = {k: None if isinstance(v, dist.ProcessGroup) else v
                           for k, v in value.items()}


_releases: list[Callable[[], Callable[[], None] | None]] = []


def release_at_exit(release: Callable[[], None]) -> None:
    """Call ``release`` at exit, before the process groups are destroyed for good: it
    drops what its object holds of them (a DDP model, an engine). A bound method is held
    weakly (an object gone by then needs nothing), a function for good."""
    _releases[:] = [r for r in _releases if r() is not None]
    if inspect.ismethod(release):
        _releases.append(weakref.WeakMethod(release))
    else:
        _releases.append(lambda: release)


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (of groups not yet released); Linux."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return names


def _leave_at_exit() -> None:
    """At exit: every group destroyed and released, its threads joined, before the
    interpreter finalises (see "Leaving at exit")."""
    if not dist.is_available():
        return
    while _releases:
        method = _releases.pop()()
        if method is not None:
            try:
                method()
            except Exception as exc:  # leaving goes on: the rest still needs releasing
                log.debug("releasing process groups at exit: %r", exc)
    try:
        destroy_group()
    except Exception as exc:
        log.debug("destroying the process group at exit: %r", exc)
    if gloo_threads():
        gc.collect()  # groups held in reference cycles only (an engine, a DDP model)
        left = gloo_threads()
        if left:
            log.debug("a process group is still referenced at exit (%d gloo threads): "
                      "delete what holds it (e.g. a DDP model) before the process ends",
                      len(left))


atexit.register(_leave_at_exit)


def vote_any(flag: bool, group: Group | None) -> bool:
    """True on every rank if ``flag`` is True on any rank (one tiny gloo all-reduce)."""
    return vote_each((flag,), group)[0]


def vote_each(flags: Sequence[bool], group: Group | None) -> tuple[bool, ...]:
    """For each of ``flags`` (the same number on every rank): True on every rank if it is
    True on any rank - several questions in one tiny gloo all-reduce."""
    if group is None or group.world_size == 1:
        return tuple(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.control)
    return tuple(bool(v) for v in t.tolist())


# -- state transfer ----------------------------------------------------------------------

_SCALARS = (bool, int, float, str, type(None))


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"T": len(tensors) - 1, "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape)}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"broadcast_state: dict keys must be str or int, got {k!r}")
            items.append([k, _skeleton(v, tensors)])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "t": [_skeleton(v, tensors) for v in obj]}
    if isinstance(obj, _SCALARS):
        return {"v": obj}
    raise TypeError(f"broadcast_state: cannot send a {type(obj).__name__}; use tensors, "
                    "dicts, lists, tuples, numbers, strings or None")


def _rebuild(sk: Any, tensors: list[torch.Tensor]) -> Any:
    if "T" in sk:
        return tensors[sk["T"]]
    if "d" in sk:
        return {k: _rebuild(v, tensors) for k, v in sk["d"]}
    if "l" in sk:
        return [_rebuild(v, tensors) for v in sk["l"]]
    if "t" in sk:
        return tuple(_rebuild(v, tensors) for v in sk["t"])
    return sk["v"]


def _specs(sk: Any, out: list[tuple[str, list[int]]]) -> None:
    if "T" in sk:
        out.append((sk["dtype"], sk["shape"]))
    for key in ("l", "t"):
        for v in sk.get(key, ()):
            _specs(v, out)
    for _, v in sk.get("d", ()):
        _specs(v, out)


def _targets(sk: Any, into: Any, out: list[torch.Tensor | None], seen: set[int]) -> None:
    """For each tensor of the skeleton (in ``_specs`` order), the tensor at the same place
    in ``into`` (same keys and indices), or None; a tensor found twice is used once."""
    if "T" in sk:
        fits = isinstance(into, torch.Tensor) and into.data_ptr() not in seen
        if fits:
            seen.add(into.data_ptr())
        out.append(into if fits else None)
        return
    for key in ("l", "t"):
        for i, v in enumerate(sk.get(key, ())):
            ok = isinstance(into, (list, tuple)) and i < len(into)
            _targets(v, into[i] if ok else None, out, seen)
    for k, v in sk.get("d", ()):
        _targets(v, into.get(k) if isinstance(into, dict) else None, out, seen)


# Tensors under this size travel together, one flat buffer per dtype (one message for
# the many small ones); larger ones travel alone, straight from and into their own
# memory: no concatenation on the sender, no buffer to copy out of on the receivers.
COALESCE_BYTES = 1 << 20


def _plan(specs: list[tuple[str, list[int]]]) -> list[tuple[torch.dtype, list[int]]]:
    """The messages of a state, in the order every rank derives from the skeleton: the
    small tensors' indices by dtype, then each large tensor alone."""
    small: dict[str, list[int]] = {}
    large: list[tuple[torch.dtype, list[int]]] = []
    for i, (name, shape) in enumerate(specs):
        dtype = getattr(torch, name)
        if _numel(shape) * dtype.itemsize < COALESCE_BYTES:
            small.setdefault(name, []).append(i)
        else:
            large.append((dtype, [i]))
    return [(getattr(torch, name), idx) for name, idx in sorted(small.items())] + large


def _send_tensors(tensors: list[torch.Tensor], specs: list[tuple[str, list[int]]],
                  device: torch.device, send: Callable[[torch.Tensor], Any]) -> None:
    for _, idx in _plan(specs):
        if len(idx) == 1:  # as it is (no copy when it is on the device and contiguous)
            send(tensors[idx[0]].detach().to(device).contiguous())
        else:
            send(torch.cat([tensors[i].detach().reshape(-1).to(device) for i in idx]))


def _recv_tensors(specs: list[tuple[str, list[int]]], targets: list[torch.Tensor | None],
                  device: torch.device, recv: Callable[[torch.Tensor], Any]
                  ) -> list[torch.Tensor]:
    """Receive the messages of ``_plan``; a large tensor lands directly in its target
    when the target fits (same shape, dtype and device, contiguous), else in a new one;
    small ones are copied out of their shared buffer (into their targets when they fit)."""
    out: list[torch.Tensor | None] = [None] * len(specs)
    for dtype, idx in _plan(specs):
        shapes = [specs[i][1] for i in idx]
        if len(idx) == 1:
            buf = _fitting(targets[idx[0]], shapes[0], dtype, device)
            if buf is None:
                buf = torch.empty(shapes[0], dtype=dtype, device=device)
            recv(buf)
            out[idx[0]] = buf
            continue
        sizes = [_numel(shape) for shape in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        recv(flat)
        for i, shape, part in zip(idx, shapes, torch.split(flat, sizes), strict=True):
            target = _fitting(targets[i], shape, dtype, device)
            out[i] = (target.copy_(part.view(shape)) if target is not None
                      else part.view(shape).clone())
    return out  # type: ignore[return-value]


def _fitting(t: torch.Tensor | None, shape: list[int], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | None:
    """``t`` if a received tensor can be written into it in place."""
    if (t is None or list(t.shape) != shape or t.dtype != dtype or t.device != device
            or not t.is_contiguous() or t.requires_grad):
        return None
    return t


def _header(obj: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(_skeleton(obj, tensors)).encode()),
                            dtype=torch.uint8)


def _unpack(header: torch.Tensor, into: Any) -> tuple[Any, list[tuple[str, list[int]]],
                                                      list[torch.Tensor | None]]:
    skeleton = json.loads(bytes(header.cpu().numpy()).decode())
    specs: list[tuple[str, list[int]]] = []
    _specs(skeleton, specs)
    targets: list[torch.Tensor | None] = []
    _targets(skeleton, into, targets, set())
    return skeleton, specs, targets


def _device_for(backend: str, device: str | torch.device | None) -> torch.device:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    return torch.device(device)


def broadcast_state(obj: Any = None, src: int = 0, device: str | torch.device | None = None,
                    group: Any = None, into: Any = None) -> Any:
    """Send ``obj`` (e.g. ``{"model": model.state_dict(), "opt": opt.state_dict(),
    "step": 12}``) from rank ``src`` to every rank of ``group``; returns it everywhere.

    Tensors arrive on ``device`` (default: cuda for nccl, else cpu). Two collectives for
    the skeleton, one for the small tensors of each dtype and one per large tensor. A
    receiver passing ``into`` (e.g. its own state, of the same structure) gets each
    tensor written into the one at the same place in ``into`` where it fits (e.g. the
    model's parameters): no new memory to fault in, nothing to copy when loading it.
    """
    backend = dist.get_backend(group)
    device = _device_for(backend, device)
    me = dist.get_rank(group)
    tensors: list[torch.Tensor] = []
    if me == src:
        header = _header(obj, tensors)
        length = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    if me != src:
        header = torch.empty(int(length.item()), dtype=torch.uint8)
    header = header.to(device)
    dist.broadcast(header, src, group=group)
    skeleton, specs, targets = _unpack(header, into if me != src else None)

    def bcast(t: torch.Tensor) -> None:
        dist.broadcast(t, src, group=group)

    if me == src:
        _send_tensors(tensors, specs, device, bcast)
        return obj
    return _rebuild(skeleton, _recv_tensors(specs, targets, device, bcast))


def send_state(obj: Any, dst: int, group: Any = None,
               device: str | torch.device | None = None) -> None:
    """Send ``obj`` (as for :func:`broadcast_state`) to rank ``dst`` alone, which calls
    :func:`recv_state`: two messages for the skeleton, one for the small tensors of each
    dtype and one per large tensor (on ``device``: default cuda for nccl, else cpu)."""
    device = _device_for(dist.get_backend(group), device)
    tensors: list[torch.Tensor] = []
    header = _header(obj, tensors)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=device), dst,
              group=group)
    dist.send(header.to(device), dst, group=group)
    specs: list[tuple[str, list[int]]] = []
    _specs(json.loads(bytes(header.numpy()).decode()), specs)
    _send_tensors(tensors, specs, device, lambda t: dist.send(t, dst, group=group))


def recv_state(src: int, group: Any = None, into: Any = None,
               device: str | torch.device | None = None) -> Any:
    """Receive what rank ``src`` sent with :func:`send_state` (``into``: as for
    :func:`broadcast_state`)."""
    device = _device_for(dist.get_backend(group), device)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src, group=group)
    header = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(header, src, group=group)
    skeleton, specs, targets = _unpack(header, into)
    got = _recv_tensors(specs, targets, device, lambda t: dist.recv(t, src, group=group))
    return _rebuild(skeleton, got)


def share_waves(world_size: int, holders: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Who sends to whom in :func:`share_state`: waves of (sender, receiver) pairs; each
    rank is in at most one pair per wave, and a receiver sends on in the next waves (the
    ranks that have the state double each wave)."""
    have = sorted(set(holders))
    need = [r for r in range(world_size) if r not in set(have)]
    waves = []
    while need and have:
        pairs = list(zip(have, need[: len(have)], strict=False))
        waves.append(pairs)
        need = need[len(pairs):]
        have += [dst for _, dst in pairs]
    return waves


def share_state(obj: Any, holders: Sequence[int], into: Any = None,
                device: str | torch.device | None = None) -> Any:
    """Give the ranks of the default group that are not ``holders`` the state ``obj`` the
    holders all hold, alike (e.g. the model and optimizer state of data-parallel
    replicas): point to point, every holder sending to a different rank at once, and the
    receivers passing it on (``share_waves``). Holders neither receive nor reload
    anything, as a broadcast would make them. Returns ``obj`` on holders, the state
    received elsewhere (written into ``into`` where it fits, as for
    :func:`broadcast_state`)."""
    me = dist.get_rank()
    for wave in share_waves(dist.get_world_size(), holders):
        for sender, receiver in wave:
            if me == sender:
                send_state(obj, receiver, device=device)
            elif me == receiver:
                obj = recv_state(sender, into=into, device=device)
    return obj


def sync_state(obj: Any, info: Any) -> Any:
    """After a round formed (``info``: its ``GroupInfo``), the state this rank must load,
    or None where it keeps its own. ``obj``: this rank's state - what it sends if it holds
    the job's, else where the received tensors are written where they fit.

    A failure round (survivors may be a step apart) or one of newcomers only takes rank
    0's state everywhere (``broadcast_state``); any other round with newcomers gives them
    the survivors' (``share_state``); a round without newcomers moves nothing.
    """
    if info.world_size == 1 or not (info.newcomers or info.reason == "failure"):
        return None
    holders = info.holders
    if info.reason != "failure" and holders:
        got = share_state(obj, holders, into=obj)
        return None if info.rank in holders else got
    # a survivor receives apart from its own state, which stays whole should this fail too
    got = broadcast_state(obj, into=None if info.rank in holders else obj)
    return None if info.rank == 0 else got


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- in-memory commits -------------------------------------------------------------------

def clone_state(obj: Any) -> Any:
    """A deep copy in which every tensor is detached and cloned (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


def copy_state_into(dst: Any, src: Any) -> Any:
    """A copy of ``src`` like :func:`clone_state`, but written into the tensors of an
    older copy ``dst`` where they fit (same place, shape, dtype and device): committing
    every step then allocates nothing (fresh memory costs page faults, ~0.8 s per GB)."""
    if isinstance(src, torch.Tensor):
        if (isinstance(dst, torch.Tensor) and dst.shape == src.shape
                and dst.dtype == src.dtype and dst.device == src.device):
            return dst.copy_(src.detach())
        return src.detach().clone()
    if isinstance(src, dict):
        old = dst if isinstance(dst, dict) else {}
        return {k: copy_state_into(old.get(k), v) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        old = dst if isinstance(dst, (list, tuple)) else ()
        items = [copy_state_into(old[i] if i < len(old) else None, v)
                 for i, v in enumerate(src)]
        return items if isinstance(src, list) else tuple(items)
    return src


class InMemoryCommit:
    """The last committed training state, kept in memory at step boundaries.

    ``commit()`` after a step completes everywhere; after a failure, every survivor
    ``restore()``s its last commit and rank 0's copy is broadcast (``broadcast_state``), so
    at most the uncommitted step is lost. ``get_state``/``set_state`` are passed in, e.g.
    ``lambda: {"model": m.state_dict(), "opt": o.state_dict(), "step": step}``.
    """

    def __init__(self, get_state: Callable[[], Any], set_state: Callable[[Any], None]) -> None:
        self.get_state, self.set_state = get_state, set_state
        self.state: Any = None

    def commit(self) -> None:
        self.state = copy_state_into(self.state, self.get_state())

    def restore(self) -> Any:
        """Load the last commit back (a no-op before the first commit); returns it."""
        if self.state is not None:
            self.set_state(clone_state(self.state))
        return self.state
