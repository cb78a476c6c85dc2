"""Forming a ``torch.distributed`` process group inside a running process, once per round,
and moving training state across it.

Each round's rank 0 hosts a fresh ``TCPStore`` on a port the OS picks (a few ms) and
publishes it in the round's state; the others connect to it. ``init_process_group`` with
that store takes ~20 ms for 4 gloo ranks on loopback and ``destroy_process_group`` ~30 ms,
so a survivor's whole pause is dominated by noticing the change, not by torch.

State moves without pickle: ``broadcast_state`` sends a JSON skeleton of the nested
structure (dicts, lists, tuples, numbers, strings) and the tensors, one flat buffer per
dtype.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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
    td = datetime.timedelta(seconds=timeout)
    store = hosted if hosted is not None else dist.TCPStore(
        addr, port, world_size, is_master=False, timeout=td)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return Group(backend, rank, world_size, store, control)


def destroy_group() -> None:
    """Tear down the default process group, if any (a broken one included)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def vote_any(flag: bool, group: Group | None) -> bool:
    """True on every rank if ``flag`` is True on any rank (one tiny gloo all-reduce)."""
    if group is None or group.world_size == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.control)
    return bool(t.item())


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


def broadcast_state(obj: Any = None, src: int = 0, device: str | torch.device | None = None,
                    group: Any = None) -> Any:
    """Send ``obj`` (e.g. ``{"model": model.state_dict(), "opt": opt.state_dict(),
    "step": 12}``) from rank ``src`` to every rank of ``group``; returns it everywhere.

    Tensors arrive on ``device`` (default: cuda for nccl, else cpu). Three collectives for
    the skeleton plus one per tensor dtype, whatever the number of tensors.
    """
    backend = dist.get_backend(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    device = torch.device(device)
    me = dist.get_rank(group)
    tensors: list[torch.Tensor] = []
    if me == src:
        header = torch.frombuffer(bytearray(json.dumps(_skeleton(obj, tensors)).encode()),
                                  dtype=torch.uint8)
        length = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    if me != src:
        header = torch.empty(int(length.item()), dtype=torch.uint8)
    header = header.to(device)
    dist.broadcast(header, src, group=group)
    skeleton = json.loads(bytes(header.cpu().numpy()).decode())
    specs: list[tuple[str, list[int]]] = []
    _specs(skeleton, specs)
    out: list[torch.Tensor | None] = [None] * len(specs)
    for dtype_name in sorted({d for d, _ in specs}):
        dtype = getattr(torch, dtype_name)
        idx = [i for i, (d, _) in enumerate(specs) if d == dtype_name]
        sizes = [_numel(specs[i][1]) for i in idx]
        if me == src:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in idx])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src, group=group)
        for i, part in zip(idx, torch.split(flat, sizes), strict=True):
            out[i] = part.view(specs[i][1]).clone() if me != src else tensors[i]
    return obj if me == src else _rebuild(skeleton, out)  # type: ignore[arg-type]


def send_state(obj: Any, dst: int, group: Any = None) -> None:
    """Send ``obj`` (as for :func:`broadcast_state`) to rank ``dst`` alone, which calls
    :func:`recv_state`: two messages for the skeleton plus one per tensor dtype. CPU
    tensors (gloo point to point)."""
    tensors: list[torch.Tensor] = []
    header = torch.frombuffer(bytearray(json.dumps(_skeleton(obj, tensors)).encode()),
                              dtype=torch.uint8)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64), dst, group=group)
    dist.send(header, dst, group=group)
    for dtype_name in sorted({str(t.dtype).removeprefix("torch.") for t in tensors}):
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors
                          if str(t.dtype).removeprefix("torch.") == dtype_name])
        dist.send(flat, dst, group=group)


def recv_state(src: int, group: Any = None) -> Any:
    """Receive what rank ``src`` sent with :func:`send_state`."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src, group=group)
    header = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(header, src, group=group)
    skeleton = json.loads(bytes(header.numpy()).decode())
    specs: list[tuple[str, list[int]]] = []
    _specs(skeleton, specs)
    out: list[torch.Tensor | None] = [None] * len(specs)
    for dtype_name in sorted({d for d, _ in specs}):
        idx = [i for i, (d, _) in enumerate(specs) if d == dtype_name]
        sizes = [_numel(specs[i][1]) for i in idx]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype_name))
        dist.recv(flat, src, group=group)
        for i, part in zip(idx, torch.split(flat, sizes), strict=True):
            out[i] = part.view(specs[i][1])
    return _rebuild(skeleton, out)  # type: ignore[arg-type]


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
        self.state = clone_state(self.get_state())

    def restore(self) -> Any:
        """Load the last commit back (a no-op before the first commit); returns it."""
        if self.state is not None:
            self.set_state(clone_state(self.state))
        return self.state
