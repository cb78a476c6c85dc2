"""The DeepSpeed adapter's steps read no tensor outside scheduled points (issue 31).

As ``tests/adapters/test_step_syncs.py`` does for the torch trainer: every tensor read
method (``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``...) is wrapped, and a call
made from pollux's own code outside a scheduled point (``pollux_launch.tuning.
sync_points``) is a violation. 150 optimizer steps of a ``PolluxEngine`` driven by
``ElasticDeepSpeed`` (a static job at one replica; DeepSpeed on the CPU) in the two paths
the gradient statistics take - one gradient a step (consecutive steps differenced) and
gradient accumulation (local micro-batch gradients sampled) - must make none, while
their decisions, counted, read the pending rows. Each configuration runs in a process of
its own (this file, as a script: DeepSpeed initialises torch.distributed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS, DECIDE_EVERY = 150, 5


@pytest.mark.parametrize("config", ["single", "accumulation"])
def test_steps_read_no_tensor_outside_scheduled_points(config):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("POLLUX_JOB", None)
    done = subprocess.run([sys.executable, __file__, config], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["reads"] == [], "\n".join(out["reads"][:20])
    assert out["decisions"] >= STEPS // DECIDE_EVERY - 1  # each one a counted point
    assert out["updates"] >= STEPS // 2 and out["noise_scale"] is not None
    # the checker itself: the statistics' flush is a read, caught outside a point
    assert out["caught"] and all(".tolist()" in r for r in out["caught"])


# -- the worker (run as a script) ---------------------------------------------------------

def _main(config: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT / "tests"))  # (run as a script: tests/ is not on the path)
    from tensor_reads import watch_reads

    from pollux_launch.adapters.deepspeed import initialize_handle
    from pollux_launch.adapters.deepspeed.elastic import ElasticDeepSpeed
    from pollux_launch.adapters.torch.job import ElasticJob

    seen = watch_reads()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    accum = config == "accumulation"
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if accum
           else torch.optim.SGD(model.parameters(), lr=0.05))
    section = {"enabled": True, "initial_batch_size": 16, "max_batch_size": 64,
               "micro_batch_size_range": [8, 8] if accum else [16, 64],
               "gradient_accumulation": accum}
    engine = initialize_handle(model=model, optimizer=opt, config={
        "steps_per_print": 10**9, "zero_optimization": {"stage": 0}, "pollux": section})[0]
    driver = ElasticDeepSpeed(engine, ElasticJob(None, None), decide_every=DECIDE_EVERY)
    assert not accum or engine.batch[1] >= 2
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    seen.clear()  # (the set-up's reads: a start is a scheduled point, DeepSpeed's aside)
    while driver.steps < STEPS:
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 16, generator=g)
        y = (x @ w).argmax(1)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    reads = list(seen)
    stats = engine.grad_stats
    with driver.controller.sync_points.scheduled("test"):
        noise = stats.stats()
    caught: list[str] = []
    if not seen:  # a pending row, flushed outside a scheduled point: a violation
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        while not engine.grad_stats._pending and driver.steps < STEPS + 10:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        stats.flush()
        caught = list(seen)
    print(json.dumps({"reads": reads, "caught": caught,
                      "decisions": driver.controller.sync_points.counts["decision"],
                      "updates": stats.estimator.updates,
                      "noise_scale": None if noise is None else noise.noise_scale}))


if __name__ == "__main__":
    _main(sys.argv[1])
