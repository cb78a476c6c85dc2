"""Horovod workers on a machine with GPUs (declared with --gpus here): its node agent
starts each worker, holding one GPU, visible at the worker's hvd.local_rank() (0: each
slot is a Horovod host of its own, so that a lost worker costs its slot only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")

POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))
SCRIPT = """
import json, os
import horovod.torch as hvd
hvd.init()
print(json.dumps({"local": hvd.local_rank(), "size": hvd.size(),
                  "visible": os.environ["CUDA_VISIBLE_DEVICES"].split(","),
                  "own": os.environ["POLLUX_GPUS"]}), flush=True)
"""


def test_each_horovod_worker_holds_its_own_gpu_at_its_local_rank(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = subprocess.run(
        [POLLUX_RUN, "--store", f"embedded://{tmp_path}/store.db", "--gpus", "3", "-np", "2",
         "--framework", "horovod", sys.executable, "train.py"],
        cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = [json.loads(line.partition(">:")[2]) for line in out.stdout.splitlines()
            if "<stdout>:{" in line]
    assert [s["local"] for s in seen] == [0, 0] and {s["size"] for s in seen} == {2}
    for s in seen:
        assert s["visible"][s["local"]] == s["own"]  # torch.cuda.set_device(hvd.local_rank())
    assert len({s["own"] for s in seen}) == 2
