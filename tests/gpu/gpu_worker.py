"""A training worker for the GPU suite (``tests/gpu``): the native adapter's public API
(``init``, ``AdaptiveDataLoader``, ``ElasticTrainer``) with the model on a device, as a
GPU training script would write it. Started by ``tests/gpu/conftest.py`` with the
environment ``pollux-run``'s node agent gives a worker (``POLLUX_STORE``, ``POLLUX_JOB``,
``POLLUX_NODE``, ``POLLUX_WORKER_ID``, ...) plus these knobs:

* ``GPU_DEVICE``   ``cpu``; ``cuda``: this worker's own GPU, ``cuda:$LOCAL_RANK`` (modulo
                   the GPUs there are), chosen after ``init()`` as a torchrun-style script
                   does; ``cuda:N``: pinned to GPU N (several processes may share it);
* ``GPU_BACKEND``  ``gloo`` or ``nccl``; empty: the rendezvous' default (nccl with a GPU);
* ``GPU_AMP``      ``1``: autocast (float16 on cuda, bfloat16 on cpu) and a ``GradScaler``
                   (init scale ``INIT_SCALE``, growth every ``GROWTH_INTERVAL`` steps).

It imports everything slow first, then waits for ``$LOG_DIR/<worker>.go`` (the test
creates it: at once, or to let a newcomer in when it wants) before it joins the job. It
appends JSON lines (each with ``t``, the time) to ``$LOG_DIR/<worker>.jsonl``:

* ``ready``   imported, waiting for ``.go``;
* ``start``   after ``init()``: pid, round, rank, local rank (the placement's and
              ``$LOCAL_RANK``), the device it picked, the current CUDA device, and the
              digest of its freshly initialised parameters (each process seeds itself
              differently, so replicas start different);
* ``joined``  right after ``ElasticTrainer(...)``: what the worker holds before its own
              first step (a newcomer: rank 0's state) - steps, digests of parameters and
              optimizer state, the optimizer state's size, the devices of every tensor
              (Adam's step counts apart), the grad scaler's state;
* ``round``   at the first batch of every round the worker is in: the backend, the
              round's TCPStore port, an all-reduce of ``rank + 1`` on the device, and
              ``broadcast_state`` probes (the trainer's default device, and the worker's);
* ``step``    after every optimiser step: the job's step count (rank 0's count when
              the worker joined, then one per step), round, world, rank, digests,
              devices, loss, the grad scaler's scale and growth tracker;
* ``left``    the worker leaves (``SystemExit``: removed by a rescale -> code 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pollux_launch.adapters.torch as pollux
from pollux_launch.rendezvous.process_group import broadcast_state
from pollux_launch.rendezvous.protocol import RendezvousConfig

INIT_SCALE, GROWTH_INTERVAL = 256.0, 3
MAX_STEPS = 20_000  # a worker the test forgot does not train forever
PACE = float(os.environ.get("GPU_PACE", "0.02"))  # seconds between steps: 2 cores here

log = open(os.path.join(os.environ["LOG_DIR"], os.environ["POLLUX_WORKER_ID"] + ".jsonl"), "a")


def write(**record: object) -> None:
    log.write(json.dumps({**record, "t": round(time.time(), 3)}) + "\n")
    log.flush()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_tensors(optimizer: torch.optim.Optimizer, with_step: bool = True):
    """The optimizer's state tensors in a fixed order (Adam's ``step`` is a CPU scalar by
    design unless capturable/fused: left out of device checks)."""
    state = optimizer.state_dict()["state"]
    return [v for i in sorted(state) for k, v in sorted(state[i].items())
            if isinstance(v, torch.Tensor) and (with_step or k != "step")]


def devices(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    tensors = [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer, False)]
    return sorted({str(t.device) for t in tensors})


def step_devices(optimizer: torch.optim.Optimizer) -> list[str]:
    """Where Adam keeps its step counts (the CPU, as it places them itself)."""
    return sorted({str(s["step"].device) for s in optimizer.state_dict()["state"].values()
                   if isinstance(s.get("step"), torch.Tensor)})


def main() -> None:
    # What is slow comes before joining (torch imports its compiler on the first
    # optimizer), so that a held worker joins, and a newcomer enters its job, promptly.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    write(kind="ready", pid=os.getpid())
    go = os.path.join(os.environ["LOG_DIR"], os.environ["POLLUX_WORKER_ID"] + ".go")
    held_until = time.monotonic() + 300  # (a test that died never releases it)
    while not os.path.exists(go):  # the test releases it (at once, or when it wants)
        if time.monotonic() > held_until:
            raise SystemExit("never released")
        time.sleep(0.02)
    backend = os.environ.get("GPU_BACKEND") or None
    amp = os.environ.get("GPU_AMP") == "1"
    config = RendezvousConfig(lease_ttl=2.0, join_timeout=60.0, collective_timeout=60.0,
                              backend=backend, addr="127.0.0.1", grow_grace=20.0)
    job = pollux.init(config=config)
    local_rank = int(os.environ["LOCAL_RANK"])  # exported by init() for this round
    want = os.environ["GPU_DEVICE"]
    if want == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device(want)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)  # replicas start different: the state sync must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(device)
    p = job.placement
    write(kind="start", pid=os.getpid(), round=p.round, rank=p.rank, world=p.world_size,
          local_rank=p.local_rank, env_local_rank=local_rank, device=str(device),
          current_cuda=torch.cuda.current_device() if device.type == "cuda" else None,
          backend=dist.get_backend() if dist.is_initialized() else None,
          params=digest(model.parameters()))

    gen = torch.Generator().manual_seed(0)  # the same data set on every worker
    x = torch.randn(1024, 16, generator=gen)
    y = (x[:, :4].sum(dim=1) > 0).long()
    loader = pollux.AdaptiveDataLoader(TensorDataset(x, y), batch_size=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = (torch.amp.GradScaler(device.type, init_scale=INIT_SCALE,
                                   growth_interval=GROWTH_INTERVAL) if amp else None)
    trainer = pollux.ElasticTrainer(model, optimizer, loader, grad_scaler=scaler,
                                    report_interval=3600.0)

    def scaler_state() -> dict:
        if scaler is None:
            return {}
        return {"scale": scaler.get_scale(), "tracker": scaler.state_dict()["_growth_tracker"]}

    # The job's optimiser steps: what the trainer says when it starts (a newcomer: rank
    # 0's count, received with its state), then one per step() that stepped. (Counted
    # here: when trainer.steps counts a step - in step() or at the boundary after it - is
    # the adapter's business.)
    done = trainer.steps

    def held(**extra: object) -> dict:
        p = job.placement
        return {"round": p.round, "rank": p.rank, "world": p.world_size, "pid": os.getpid(),
                "step": done, "params": digest(model.parameters()),
                "opt": digest(optimizer_tensors(optimizer)),
                "opt_entries": len(optimizer.state_dict()["state"]),
                "devices": devices(model, optimizer), "step_devices": step_devices(optimizer),
                **scaler_state(), **extra}

    write(kind="joined", **held())

    def round_checks() -> None:
        p, info = job.placement, job.info
        probe = torch.full((1,), float(p.rank + 1), device=device)
        dist.all_reduce(probe)
        value = torch.full((3,), 100.0 * p.round + p.rank, device=device)
        default = broadcast_state({"x": value})["x"]  # as the trainer calls it
        mine = broadcast_state({"x": value}, device=device)["x"]
        write(kind="round", round=p.round, rank=p.rank, world=p.world_size, pid=os.getpid(),
              local_rank=p.local_rank, env_local_rank=int(os.environ["LOCAL_RANK"]),
              backend=dist.get_backend(), port=info.master_port if info else None,
              reason=info.reason if info else None, allreduce=probe.item(),
              bcast_default_device=str(default.device), bcast_default=default.tolist(),
              bcast_device=str(mine.device), bcast=mine.tolist())

    autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    seen_round = None
    try:
        for _ in trainer.epochs(1e9):
            for xb, yb in loader:
                if job.elastic and job.placement.round != seen_round:
                    seen_round = job.placement.round  # every member is at this batch now
                    round_checks()
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=amp):
                    loss = F.cross_entropy(trainer.model(xb), yb)
                value = float(loss)
                if trainer.step(loss):
                    done += 1
                    write(kind="step", loss=value, finite=math.isfinite(value), **held())
                    if done >= MAX_STEPS:
                        raise SystemExit(3)
                time.sleep(PACE)
    except SystemExit as exc:
        write(kind="left", pid=os.getpid(), code=exc.code, step=done)
        raise


if __name__ == "__main__":
    main()
