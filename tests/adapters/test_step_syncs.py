"""The step path never reads a tensor outside its scheduled points (issue 31).

On a GPU, reading a tensor (``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``...) makes
the host wait for the device; ``tests/gpu/test_gpu_step_syncs.py`` runs the trainer under
CUDA's sync debug mode. Here, on a CPU, every such method is wrapped: a call made from
pollux's own code outside a scheduled point (``pollux_launch.tuning.sync_points``) is a
violation, whatever the device. 200 steps of ``ElasticTrainer`` in the configurations
that take different paths (SGD; Adam with gradient accumulation, which samples local
gradients; a GradScaler with clipping) must make none, while their decisions - counted -
do read tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tensor_reads import watch_reads  # (tests/ is on the path)
from training_loops import run_steps

import pollux_launch.adapters.torch as pollux


@pytest.fixture
def reads(monkeypatch) -> Iterator[list[str]]:
    """Every tensor read by pollux's code outside a scheduled point, as ``where: what``."""
    yield watch_reads(monkeypatch.setattr)


def _train(steps: int, *, optimizer: str = "sgd", accum: bool = False, amp: bool = False
           ) -> pollux.ElasticTrainer:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 16), torch.randint(0, 4, (2048,)))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05))
    # accumulation: M0 16 over micro-batches of at most 8 - two a step, whose local
    # gradients the monitor samples (no differencing of consecutive steps)
    loader = pollux.AdaptiveDataLoader(data, batch_size=16, max_batch_size=64,
                                       local_bsz_bounds=(8, 8) if accum else (16, 64))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if amp else None
    trainer = pollux.ElasticTrainer(model, opt, loader, grad_scaler=scaler,
                                    max_grad_norm=1.0 if amp else None, decide_every=5)
    assert not accum or loader.accum_steps >= 1
    run_steps(trainer, loader, steps)
    return trainer


@pytest.mark.parametrize("config", [{}, {"optimizer": "adam", "accum": True}, {"amp": True}],
                         ids=["sgd", "adam-accumulation", "scaler-clipping"])
def test_steps_read_no_tensor_outside_scheduled_points(reads, config):
    trainer = _train(200, **config)
    assert reads == [], "\n".join(reads[:20])
    counts = trainer.controller.sync_points.counts
    assert counts["decision"] >= 200 // 5 - 1  # decide_every=5: each one a counted point
    assert trainer.hooks.monitor.estimator.stats() is not None  # (its rows were read there)


def test_a_read_outside_a_scheduled_point_is_caught(reads):
    """The checker itself: the monitor's flush reads its rows back - allowed at a
    scheduled point, a violation anywhere else."""
    trainer = _train(10)
    monitor = trainer.hooks.monitor

    def pending_row() -> None:
        monitor._pending.append(torch.zeros(2, dtype=torch.float64))
        monitor._meta.append((2, 1.0, True, 1))

    pending_row()
    with trainer.controller.sync_points.scheduled("test"):
        monitor.flush()
    assert reads == []
    pending_row()
    monitor.flush()
    assert reads and all(".cpu()" in r or ".numpy()" in r for r in reads)


def test_job_device_is_the_workers_own_gpu_or_the_cpu(monkeypatch):
    """``job.device``: the CPU without CUDA; with it, the GPU the node agent gave the
    worker (its position in CUDA_VISIBLE_DEVICES), else cuda:LOCAL_RANK."""
    from pollux_launch import env as envvars
    from pollux_launch.adapters.torch.job import ElasticJob

    job = ElasticJob(None, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert job.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv(envvars.GPUS, raising=False)
    assert job.device == torch.device("cuda", 1)  # (5 mod 4 GPUs)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,7")
    monkeypatch.setenv(envvars.GPUS, "7")
    assert job.device == torch.device("cuda", 1)  # the agent's GPU 7, the 2nd visible
