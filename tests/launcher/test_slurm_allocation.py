"""``pollux-run --slurm`` outside an allocation: one line saying so, exit 2, nothing
started (the real thing runs in tests/e2e/test_slurm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pollux_launch.launcher.slurm_allocation import AllocationError, read_allocation

POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))


def test_outside_an_allocation_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run([POLLUX_RUN, "--slurm", "-np", "2", sys.executable, "-c", "pass"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        "pollux-run: error: --slurm: not inside a Slurm allocation (no SLURM_JOB_ID / "
        "SLURM_JOB_NODELIST): run it in an sbatch script or salloc"], out.stderr


def test_an_allocation_without_slurm_s_commands_says_which(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(AllocationError, match="`scontrol` is not on PATH"):
        read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
