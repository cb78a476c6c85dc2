"""Provisioner calls as real processes: output, failures in one line, a call that starts
a node in the background, and a hung call stopped with everything it started."""

from __future__ import annotations

import os
import stat
import time

import pytest

from pollux_launch.coordinator.provisioners import (
    CommandProvisioner,
    ProvisionerError,
    make_provisioner,
)


def _script(tmp_path, body: str):
    exe = tmp_path / "provision"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not reaped by its parent yet) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1].split()[0] != "Z"


def _gone(pid: int) -> bool:
    for _ in range(200):
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_call_that_leaves_a_node_running_in_the_background_returns(tmp_path, caplog):
    """``EXE up`` that starts an agent with ``&`` and no redirection: the agent keeps the
    call's output open, yet the call is done when EXE exits (its pipe would never end)."""
    pidfile = tmp_path / "agent.pid"
    exe = _script(tmp_path, f'sleep 60 &\necho $! > {pidfile}\necho "started node-$2"\n')
    caplog.set_level("INFO")
    try:
        CommandProvisioner(str(exe), timeout=30).up(1)  # raises if it waited 30 s
        assert "started node-1" in caplog.text
        assert _alive(int(pidfile.read_text()))  # the node it started runs on
    finally:
        os.kill(int(pidfile.read_text()), 9)


def test_a_hung_call_is_stopped_with_everything_it_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    exe = _script(tmp_path, f"sleep 600 &\necho $! > {pidfile}\nwait\n")
    with pytest.raises(ProvisionerError, match=r"no answer within 1 s \(stopped\)") as err:
        CommandProvisioner(str(exe), timeout=1).down(["n1", "n2"])
    assert "\n" not in str(err.value) and "down n1 n2" in str(err.value)
    assert _gone(int(pidfile.read_text()))


def test_a_failed_call_is_one_line_with_its_last_words(tmp_path):
    exe = _script(tmp_path, 'echo "asking the cloud" \necho "quota exceeded\nin zone b" >&2\n'
                            "exit 3\n")
    with pytest.raises(ProvisionerError) as err:
        CommandProvisioner(str(exe)).up(2)
    assert str(err.value).endswith("up 2: exit status 3: in zone b")
    with pytest.raises(ProvisionerError, match="cannot run it"):
        CommandProvisioner(str(tmp_path / "missing")).up(1)


def test_slurm_submits_one_job_per_node_and_cancels_only_its_own(tmp_path):
    log = tmp_path / "calls"
    sbatch = _script(tmp_path, f'echo "sbatch $*" >> {log}\necho "4242;cluster"\n')
    scancel = tmp_path / "scancel"
    scancel.write_text(f'#!/bin/sh\necho "scancel $*" >> {log}\n')
    scancel.chmod(0o755)
    prov = make_provisioner("slurm", agent=["pollux-run", "agent", "--store", "etcd://h:1"],
                            sbatch_args="--partition gpu", sbatch=str(sbatch),
                            scancel=str(scancel))
    prov.up(2)
    prov.down(["pollux-4242", "hand-made", "pollux-x1"])
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and calls[-1] == "scancel 4242"
    assert all("--partition gpu --wrap pollux-run agent --store etcd://h:1 --node-name "
               "pollux-$SLURM_JOB_ID" in c for c in calls[:2])
