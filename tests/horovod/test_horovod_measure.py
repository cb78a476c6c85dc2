"""The drop-in DistributedOptimizer under real horovodrun: same statistics as a reference
computed from explicitly gathered local gradients (Pollux Eqn 4-6)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")

from pollux_launch.adapters.horovod.launch.command import horovodrun_path

WORKER = Path(__file__).with_name("gns_worker.py")


def _run(tmp_path: Path, np: int, accum: int, optim: str, steps: int) -> list[dict]:
    cmd = [horovodrun_path(), "--gloo", "-np", str(np), "-H", f"localhost:{np}",
           "--network-interface", "lo", sys.executable, str(WORKER), str(tmp_path),
           str(accum), optim, str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np)]


@pytest.mark.parametrize("np, accum", [(3, 2), (1, 1)])
def test_noise_statistics_match_reference(tmp_path, np, accum):
    steps = 12
    results = _run(tmp_path, np, accum, "sgd", steps)
    for res in results:
        assert res["mine"] is not None and res["ref"] is not None
        assert res["updates"] == res["ref_updates"] == (steps if np > 1 else steps - 1)
        assert res["mine"] == pytest.approx(res["ref"], rel=1e-6)
        # Step time profile: one key (nodes=1, replicas=np, local_bsz=8, accum-1), warm-up
        # steps and the first step (no previous step to time from) excluded.
        [row] = res["profile_rows"]
        assert row[:4] == [1, np, 8, accum - 1]
        assert row[4] == steps - 1 - 3
        assert row[5] > 0
    # Every rank ends with the same parameters and the same statistics.
    assert len({r["digest"] for r in results}) == 1
    assert len({tuple(r["mine"]) for r in results}) == 1


def test_adam_preconditioned_statistics_are_finite(tmp_path):
    # Past Adam's warm-up the local norms are pre-conditioned per parameter (PGNS).
    results = _run(tmp_path, 2, 1, "adam", 15)
    for res in results:
        sqr, var = res["mine"]
        assert math.isfinite(sqr) and sqr > 0 and math.isfinite(var) and var >= 0
        assert res["updates"] == 15
    assert results[0]["mine"] == results[1]["mine"]
