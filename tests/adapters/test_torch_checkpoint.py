"""The torch trainer's durable state: a new trainer (a restarted job) resumes exactly
where the newest checkpoint was taken - model, optimizer, loader position, progress."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pollux_launch.adapters.torch as pollux


def _trainer(folder):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 4), torch.randint(0, 2, (512,)))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = pollux.AdaptiveDataLoader(data, batch_size=32)
    return pollux.ElasticTrainer(model, optimizer, loader, checkpoint_dir=str(folder),
                                 checkpoint_interval=3600.0)


def test_a_new_trainer_resumes_from_the_newest_checkpoint(tmp_path, monkeypatch):
    monkeypatch.delenv("POLLUX_JOB", raising=False)  # a standalone worker
    first = _trainer(tmp_path)
    assert first.resumed_from is None
    taken = None
    for i, (x, y) in enumerate(first.loader):
        first.step(F.cross_entropy(first.model(x), y))
        if i == 6:  # mid-epoch
            first.save_checkpoint(wait=True)
            taken = (first.steps, first.loader.state_dict(),
                     {k: v.clone() for k, v in first.module.state_dict().items()},
                     first.tuner.progress.iterations)
        if i == 9:
            break  # the worker dies three steps later
    second = _trainer(tmp_path)
    steps, loader_state, weights, progress = taken
    assert second.resumed_from == progress > 0
    assert second.steps == steps and second.loader.state_dict() == loader_state
    for k, v in second.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    momentum = second.optimizer.state_dict()["state"]
    assert momentum and all("momentum_buffer" in s for s in momentum.values())
