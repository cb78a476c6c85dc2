"""The Horovod adapter's steps read no tensor outside scheduled points (issue 31).

As ``tests/adapters/test_step_syncs.py`` does for the torch trainer: every tensor read
method (``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``...) is wrapped, and a call
made from pollux's own code outside a scheduled point (``pollux_launch.tuning.
sync_points``) is a violation. 150 steps of pollux's ``DistributedOptimizer`` with its
control started by ``TorchState``'s sync (as ``hvd.elastic.run`` does) must make none,
while the decisions, counted, read the statistics: at one rank (consecutive steps
differenced; SGD, and Adam with two backward passes a step, whose 1/P is refreshed at
the decisions) and at two ranks under horovodrun (the local norms all-reduced and
sampled). Each configuration runs in processes of its own (this file, as a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")

ROOT = Path(__file__).resolve().parents[2]
STEPS, DECIDE_EVERY = 150, 5


def _run(tmp_path: Path, np: int, config: str) -> list[dict]:
    from pollux_launch.adapters.horovod.launch.command import horovodrun_path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("POLLUX_JOB", None)
    cmd = [sys.executable, __file__, config, str(tmp_path)]
    if np > 1:
        cmd = [horovodrun_path(), "--gloo", "-np", str(np), "-H", f"localhost:{np}",
               "--network-interface", "lo", *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np)]


@pytest.mark.parametrize("np, config", [(1, "sgd"), (1, "adam-accumulation"), (2, "sgd")],
                         ids=["one-rank-sgd", "one-rank-adam-accumulation", "two-ranks-sgd"])
def test_steps_read_no_tensor_outside_scheduled_points(tmp_path, np, config):
    for out in _run(tmp_path, np, config):
        assert out["reads"] == [], "\n".join(out["reads"][:20])
        assert out["decisions"] >= STEPS // DECIDE_EVERY - 1  # each one a counted point
        assert out["syncs"] >= 1  # the control's start, in TorchState's sync
        assert out["updates"] >= STEPS // 2 and out["noise_scale"] is not None
    if np == 1:  # the checker itself: the statistics' flush, caught outside a point
        assert out["caught"] and all(".tolist()" in r for r in out["caught"])


# -- the worker (run as a script) ---------------------------------------------------------

def _main(config: str, out_dir: str) -> None:
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT / "tests"))  # (run as a script: tests/ is not on the path)
    from tensor_reads import watch_reads

    from pollux_launch.adapters.horovod import DistributedOptimizer, TorchState

    seen = watch_reads()

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    accum = 2 if config == "adam-accumulation" else 1
    base = (torch.optim.Adam(model.parameters(), lr=1e-3) if config.startswith("adam")
            else torch.optim.SGD(model.parameters(), lr=0.05))
    opt = DistributedOptimizer(base, named_parameters=model.named_parameters(),
                               backward_passes_per_step=accum, local_bsz=8,
                               decide_every=DECIDE_EVERY)
    state = TorchState(model, opt, step=0)
    state.sync()  # (what hvd.elastic.run does first: the control starts here)
    control, m = opt.pollux_control, opt.pollux
    g = torch.Generator().manual_seed(1 + hvd.rank())
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        opt.zero_grad()
        for _ in range(opt.backward_passes_per_step):
            x = torch.randn(control.local_bsz, 16, generator=g)
            loss = F.cross_entropy(model(x), (x @ w).argmax(1))
            (loss / opt.backward_passes_per_step).backward()
        opt.step()

    seen.clear()  # (the set-up's reads)
    while control.steps < STEPS:
        step()
    reads = list(seen)
    with m.sync_points.scheduled("test"):
        noise = m.stats()
    caught: list[str] = []
    if hvd.size() == 1 and not seen:  # a pending row, flushed outside a scheduled point
        step()
        while not m._pending:
            step()
        m.flush()
        caught = list(seen)
    counts = m.sync_points.counts
    result = {"reads": reads, "caught": caught, "decisions": counts["decision"],
              "syncs": counts["sync"], "updates": m.estimator.updates,
              "noise_scale": None if noise is None else noise.noise_scale}
    Path(out_dir, f"rank{hvd.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
