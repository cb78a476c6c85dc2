"""FSDP2 on CUDA tensors through a re-shard (NCCL, one rank; gloo for the cpu variant):
the model and Adam state, sharded on the device, are handed off on the old group and
installed on a new group and mesh; they stay on the device, equal, and training goes
on. The many-rank re-shard is tests/adapters/test_fsdp_reshard.py (gloo, CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.cuda


def _run(device: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pollux_launch.adapters.torch.fsdp import FSDPResharder, device_mesh
    from pollux_launch.rendezvous.process_group import destroy_group

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)

    def form(r: int) -> None:
        destroy_group()
        store = dist.FileStore(os.path.join(out, f"round{r}"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)

    form(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(),
                                torch.nn.Linear(13, 3)).to(device)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=device_mesh())
    fully_shard(model, mesh=device_mesh())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rs = FSDPResharder(model, opt)
    rs.instrument(None)

    def train(steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(6, 8, device=device)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def state() -> list:
        return [p.full_tensor().cpu().tolist() for p in model.parameters()] + [
            v.full_tensor().cpu().tolist() for p in model.parameters()
            for k, v in sorted(opt.state[p].items()) if k != "step"]

    train(3)
    before = state()
    rs.hand_off(("w",), ("w",), "w")
    form(1)
    rs.finish(("w",), ("w",), "w", device_mesh())
    after = state()
    where = {p.to_local().device.type for p in model.parameters()}
    train(2)
    Path(out, "result.json").write_text(json.dumps(
        {"equal": before == after, "where": sorted(where),
         "finite": all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())}))
    destroy_group()


def test_fsdp2_reshard_keeps_the_state_on_its_device(device, tmp_path):
    proc = mp.get_context("spawn").Process(target=_run, args=(device, str(tmp_path)))
    proc.start()
    proc.join(timeout=180)
    assert proc.exitcode == 0
    got = json.loads((tmp_path / "result.json").read_text())
    assert got == {"equal": True, "where": [device], "finite": True}
