"""Worker for test_horovod_measure.py (run under horovodrun): compares the drop-in
DistributedOptimizer's gradient statistics with a reference computed from every rank's
local gradients gathered explicitly, and writes one JSON result per rank."""

from __future__ import annotations

import copy
import json
import sys

import horovod.torch as hvd
import torch

from pollux_launch.adapters.horovod import DistributedOptimizer
from pollux_launch.tuning.gns import GNSEstimator


def main(out_dir: str, accum: int, optim: str, steps: int) -> None:
    hvd.init()
    torch.manual_seed(0)
    local_bsz, m0 = 8, 8 * hvd.size()
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    shadow = copy.deepcopy(model)  # same weights, no Horovod: gives the local gradients
    base = (torch.optim.SGD(model.parameters(), lr=0.1) if optim == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = DistributedOptimizer(base, named_parameters=model.named_parameters(),
                               backward_passes_per_step=accum, local_bsz=local_bsz,
                               init_batch_size=m0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = GNSEstimator(m0)
    prev: torch.Tensor | None = None
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    k = hvd.size()
    for _ in range(steps):
        shadow.load_state_dict(model.state_dict())
        opt.zero_grad()
        shadow.zero_grad()
        for _ in range(accum):
            x = torch.randn(local_bsz, 5, generator=gen)
            y = torch.randint(0, 3, (local_bsz,), generator=gen)
            loss_fn = torch.nn.functional.cross_entropy
            (loss_fn(model(x), y) / accum).backward()
            (loss_fn(shadow(x), y) / accum).backward()
        opt.step()
        local = torch.cat([p.grad.reshape(-1) for p in shadow.parameters()]).double()
        scale_one = local_bsz * accum / m0
        if k > 1:
            every = hvd.allgather(local.reshape(1, -1), name="ref.local")
            local_sqr = float((every ** 2).sum(dim=1).mean())
            total_sqr = float(every.mean(dim=0).square().sum())
            ref.update(local_sqr, total_sqr, k, k * scale_one)
        else:
            if prev is not None:
                ref.update(float((local.square().sum() + prev.square().sum()) / 2),
                           float(((local + prev) / 2).square().sum()), 2, 2 * scale_one,
                           differenced=True)
            prev = local
    mine, want = opt.pollux.stats(), ref.stats()
    rows = opt.pollux.profile.state_dict()["rows"]
    result = {
        "rank": hvd.rank(), "size": k,
        "mine": None if mine is None else [mine.sqr, mine.var],
        "ref": None if want is None else [want.sqr, want.var],
        "updates": opt.pollux.estimator.updates, "ref_updates": ref.updates,
        "profile_rows": rows,
        "digest": float(sum(p.double().sum() for p in model.parameters())),
    }
    with open(f"{out_dir}/rank{hvd.rank()}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
