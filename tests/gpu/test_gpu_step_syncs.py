"""200 steps of ``ElasticTrainer`` on a GPU never wait for the device outside the
scheduled points (issue 31): the loop runs under ``torch.cuda.set_sync_debug_mode("error")``,
which raises on any synchronising CUDA call; ``tuning.sync_points`` lifts the mode for
the scheduled points (decisions, counted), and only for them. With bf16 autocast, and
with fp16 and a ``GradScaler`` over a fused Adam (whose step takes the scaler's
inf-check on the device: a non-fused optimizer's ``scaler.step`` reads it back, in torch
itself). The loop is what a user writes: pinned batches moved with ``non_blocking``, the
loss never read. The ``cpu`` variant runs the same loop (the harness's check)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("amp", ["bf16", "fp16-scaler"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_steps_make_no_sync_outside_scheduled_points(device, amp):
    import pollux_launch.adapters.torch as pollux

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=cuda)
    scaler = None
    dtype = torch.bfloat16
    if amp == "fp16-scaler":
        dtype = torch.float16 if cuda else torch.bfloat16
        scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    loader = pollux.AdaptiveDataLoader(data, batch_size=64, max_batch_size=256,
                                       local_bsz_bounds=(32, 256))
    trainer = pollux.ElasticTrainer(model, opt, loader, grad_scaler=scaler, decide_every=10)
    steps = 0
    debug = torch.cuda.get_sync_debug_mode() if cuda else 0
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with contextlib.suppress(StopIteration):
            for _ in trainer.epochs(100):
                for x, y in loader:
                    x = x.pin_memory().to(dev, non_blocking=True) if cuda else x
                    y = y.pin_memory().to(dev, non_blocking=True) if cuda else y
                    with torch.autocast(dev.type, dtype=dtype):
                        loss = torch.nn.functional.cross_entropy(trainer.model(x), y)
                    steps += trainer.step(loss)
                    if steps >= 200:
                        raise StopIteration
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(debug)
    assert steps == 200
    assert trainer.controller.sync_points.counts["decision"] >= 19  # every 10 steps
    assert trainer.hooks.monitor.stats() is not None  # its rows were read at those points
    assert all(p.device.type == dev.type for p in model.parameters())
