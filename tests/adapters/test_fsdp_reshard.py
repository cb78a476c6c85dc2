"""FSDP2 re-sharded in place (``adapters.torch.fsdp.FSDPResharder``), on plain gloo
groups: processes join and leave between rounds as under pollux-run (2 -> 3 -> 1 -> 2
replicas), and after every change the whole model and Adam state, gathered, equal bit
for bit what they were before it; training then goes on as a run that never changed
size does. This is also the canary for the FSDP2 internals the resharder uses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROUNDS = [("w0", "w1"), ("w0", "w1", "w2"), ("w1",), ("w1", "w3")]
STEPS_PER_ROUND = 2
BATCH = 12  # divisible by every world size used


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(),
                               torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _step(model, opt, step: int, rank: int, world: int) -> None:
    from pollux_launch.rendezvous.reshard import shard_rows

    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
    lo, hi = shard_rows(BATCH, world, rank)
    loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(model, opt) -> dict[str, list]:
    """The whole model and Adam state (collective: every rank gathers every shard)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().tolist()
        for k, v in sorted(opt.state.get(p, {}).items()):
            out[f"{name}/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
    return out


def _form(store_dir: str, r: int, members: tuple[str, ...], me: str) -> None:
    import torch.distributed as dist

    from pollux_launch.rendezvous.process_group import destroy_group

    destroy_group()
    store = dist.FileStore(os.path.join(store_dir, f"round{r}"), len(members))
    dist.init_process_group("gloo", store=store, rank=members.index(me),
                            world_size=len(members))


def _worker(me: str, out_dir: str, rounds: list[tuple[str, ...]]) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pollux_launch.adapters.torch.fsdp import FSDPResharder, device_mesh
    from pollux_launch.rendezvous.process_group import broadcast_state, destroy_group

    torch.use_deterministic_algorithms(True)
    model = opt = rs = None
    step, log = 0, {}
    for r, members in enumerate(rounds):
        was_in = r > 0 and me in rounds[r - 1]
        if me not in members and not was_in:
            continue
        if was_in:  # phase 1 on the old group, then the old group goes
            log[f"before{r}"] = _full(model, opt)
            rs.hand_off(rounds[r - 1], members, me)
            if me not in members:
                destroy_group()
                break
        _form(out_dir, r, members, me)
        world, rank = len(members), members.index(me)
        if model is None:  # a newcomer builds the model on its first round's mesh
            model = _model()
            mesh = device_mesh()
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            rs = FSDPResharder(model, opt)
        if r > 0:
            newcomer = not was_in
            light = broadcast_state({"step": step, "opt": rs.light_optimizer_state(),
                                     "layout": rs.state_layout()} if rank == 0 else None)
            if newcomer:
                step = light["step"]
                opt.load_state_dict(light["opt"])
            rs.finish(rounds[r - 1], members, me, device_mesh(),
                      light["layout"] if newcomer else None)
            log[f"after{r}"] = _full(model, opt)
            log[f"moved{r}"] = rs.bytes_moved
        for _ in range(STEPS_PER_ROUND):
            _step(model, opt, step, rank, world)
            step += 1
    if me in rounds[-1]:
        log["final"] = _full(model, opt)
    destroy_group()
    Path(out_dir, f"{me}.json").write_text(json.dumps(log))
    dist.destroy_process_group() if dist.is_initialized() else None


def _run(tmp_path: Path, rounds: list[tuple[str, ...]]) -> dict[str, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    workers = sorted({w for members in rounds for w in members})
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(w, str(tmp_path), rounds), name=w)
             for w in workers]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, f"worker {p.name} ended with {p.exitcode}"
    finally:
        for p in procs:
            p.kill()
    return {w: json.loads((tmp_path / f"{w}.json").read_text()) for w in workers}


@pytest.mark.skipif(sys.platform != "linux", reason="gloo processes on linux")
def test_fsdp2_reshards_in_place_2_3_1_2_bit_for_bit(tmp_path: Path) -> None:
    got = _run(tmp_path / "elastic", ROUNDS)
    for r in range(1, len(ROUNDS)):
        # every member of the new round gathers the same whole state, equal to the old
        before = next(got[w][f"before{r}"] for w in ROUNDS[r - 1])
        for w in ROUNDS[r]:
            assert got[w][f"after{r}"] == before, f"round {r}, worker {w}"
    assert got["w3"]["moved3"] > 0 and got["w1"]["moved1"] > 0  # rows moved
    # training went on as a run that never changed size (same global batches)
    ref = _run(tmp_path / "ref", [("w0", "w1")] * len(ROUNDS))
    final, expect = got["w1"]["final"], ref["w0"]["final"]
    assert final.keys() == expect.keys()
    for k in final:
        assert torch.allclose(torch.tensor(final[k], dtype=torch.float64),
                              torch.tensor(expect[k], dtype=torch.float64),
                              rtol=1e-5, atol=1e-6), k


def _gns_worker(rank: int, sharded: bool, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from pollux_launch.adapters.torch.fsdp import FSDPResharder, device_mesh
    from pollux_launch.tuning.hooks import attach_measurement

    store = dist.FileStore(os.path.join(out_dir, f"gns-{sharded}"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = _model()
    if sharded:
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=device_mesh())
        fully_shard(model, mesh=device_mesh())
        run = model
    else:
        run = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = attach_measurement(run, opt, 12, num_replicas=2, local_bsz=6, sharded=sharded,
                               preconditioner="identity", overhead_budget=None)
    if sharded:
        FSDPResharder(model, opt).instrument(hooks.monitor)
    rows = []
    for step in range(3):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
        lo = rank * 6
        torch.nn.functional.mse_loss(run(x[lo:lo + 6]), y[lo:lo + 6]).backward()
        if sharded:
            hooks.micro_step_done(True)
        rows.append([float(v) for v in hooks.monitor._pending[-1]])
        opt.step()
        opt.zero_grad(set_to_none=True)
    Path(out_dir, f"gns-{sharded}-{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def test_the_noise_scale_from_shards_equals_ddps(tmp_path: Path) -> None:
    """Each step's (mean local squared norm, squared norm of the average) measured on FSDP2
    shards - local gradients from its reduce-scatter, the average's norm summed over
    shards - equals what DDP's hooks measure on the same batches."""
    ctx = mp.get_context("spawn")
    got = {}
    for sharded in (False, True):
        procs = [ctx.Process(target=_gns_worker, args=(r, sharded, str(tmp_path)))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0
        got[sharded] = [json.loads((tmp_path / f"gns-{sharded}-{r}.json").read_text())
                        for r in range(2)]
    assert got[True][0] == got[True][1]  # every replica records the same
    for ddp_row, fsdp_row in zip(got[False][0], got[True][0], strict=True):
        assert fsdp_row == pytest.approx(ddp_row, rel=1e-5)


def test_fsdp_internal_init_is_called_in_the_shape_of_the_installed_torch() -> None:
    """``FSDPParam._init_sharded_param`` takes the mesh info from torch 2.13 on and reads
    it from the parameter before (2.11 on the GPU machine): each shape gets its call."""
    from pollux_launch.adapters.torch.fsdp import _init_sharded_param

    class New:  # torch 2.13's shape
        device = "cpu"

        def _init_sharded_param(self, param, device, shard_placement_fn, mesh_info):
            self.seen = (param, device, shard_placement_fn, mesh_info)

    class Old:  # torch 2.11's
        device = "cpu"
        mesh_info = "stale"

        def _init_sharded_param(self, param, device, shard_placement_fn):
            self.seen = (param, device, shard_placement_fn, self.mesh_info)

    for cls in (New, Old):
        fp = cls()
        _init_sharded_param(fp, "meta-param", "new-mesh")
        assert fp.seen == ("meta-param", "cpu", None, "new-mesh")


def test_a_sharded_forward_cut_short_returns_zeros_shaped_like_the_last_output() -> None:
    """A failure in FSDP's forward gives the caller zeros shaped like the last output
    (the batch dimension, or batch x sequence, following this input), so that nothing
    of the forward runs again on the new group; before any output, the old path."""
    from pollux_launch.adapters.torch.trainer import _Guarded

    class Flaky(torch.nn.Module):
        fail = False

        def forward(self, x, *, seq=3):
            if self.fail:
                raise RuntimeError("Connection closed by peer")
            return {"logits": torch.ones(x.shape[0] * seq, 5), "aux": [x.sum(), 7]}

    got: list = []
    module = Flaky()
    guarded = _Guarded(module, lambda exc, inputs, kwargs: ("redo", inputs),
                       lambda exc, zeros: got.append((str(exc), zeros)) or zeros)
    module.fail = True
    assert guarded(torch.ones(4, 2))[0] == "redo"  # no output seen yet
    module.fail = False
    guarded(torch.ones(4, 2), seq=3)
    module.fail = True
    out = guarded(torch.ones(6, 2), seq=3)
    assert got and got[0][0] == "Connection closed by peer"
    assert out["logits"].shape == (18, 5) and out["logits"].requires_grad
    assert not out["logits"].any() and out["aux"][0].shape == () and out["aux"][1] == 7
