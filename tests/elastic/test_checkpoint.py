"""Durable checkpoints: written in the background, atomically, read back without
unpickling anything but tensors and plain data."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pollux_launch.elastic.checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint


def _state(value: float) -> dict:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "loader": {"v": 1, "epoch": 3, "position": 96}, "steps": 7}


def test_a_saved_state_reads_back_and_later_training_does_not_change_it(tmp_path):
    writer = CheckpointWriter(tmp_path, every=60.0)
    assert latest_checkpoint(tmp_path) is None
    state = _state(1.0)
    expected = state["model"]["weight"].clone()
    assert writer.save(state, step=7, progress=12.5, replicas=3)
    state["model"]["weight"].add_(100.0)  # training goes on while the write is in progress
    writer.flush()
    ckpt = latest_checkpoint(tmp_path)
    assert (ckpt.step, ckpt.progress, ckpt.replicas) == (7, 12.5, 3)
    assert torch.equal(ckpt.state["model"]["weight"], expected)
    assert ckpt.state["loader"]["position"] == 96 and ckpt.state["steps"] == 7
    torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9) \
        .load_state_dict(ckpt.state["optimizer"])  # momentum buffers came back


def test_only_the_newest_are_kept_and_a_half_written_one_is_never_read(tmp_path):
    writer = CheckpointWriter(tmp_path, every=60.0, keep=2)
    for step in range(1, 5):
        writer.save(_state(step), step=step, progress=step, replicas=1, wait=True)
    done = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
    assert len(done) == 2 and latest_checkpoint(tmp_path).step == 4
    # a writer killed mid-write leaves a .tmp folder; a new writer (a new rank 0) goes on
    (tmp_path / "ckpt-00000099.tmp").mkdir()
    (tmp_path / "ckpt-00000099.tmp" / "state.pt").write_bytes(b"trunc")
    assert latest_checkpoint(tmp_path).step == 4
    CheckpointWriter(tmp_path).save(_state(5.0), step=5, progress=5, replicas=2, wait=True)
    assert latest_checkpoint(tmp_path).step == 5


def test_a_save_while_one_is_written_is_skipped_not_waited_for(tmp_path):
    writer = CheckpointWriter(tmp_path, every=60.0)
    assert writer._busy.acquire()  # a write in progress
    assert writer.save(_state(1.0), step=1, progress=1, replicas=1) is False
    writer._busy.release()
    assert writer.save(_state(1.0), step=1, progress=1, replicas=1, wait=True)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("damage", ["pickle", "pointer", "escape", "truncated"])
def test_a_malformed_or_hostile_checkpoint_is_refused(tmp_path, damage):
    writer = CheckpointWriter(tmp_path)
    writer.save(_state(1.0), step=1, progress=1, replicas=1, wait=True)
    name = json.loads((tmp_path / "latest").read_text())["name"]
    if damage == "pickle":  # code smuggled into the state file is never run
        torch.save({"model": Evil()}, tmp_path / name / "state.pt")
    elif damage == "pointer":
        (tmp_path / "latest").write_text("{not json")
    elif damage == "escape":
        (tmp_path / "latest").write_text(json.dumps({"name": "../../etc"}))
    else:
        (tmp_path / name / "state.pt").write_bytes(b"PK\x03\x04")
    with pytest.raises(CheckpointError):
        latest_checkpoint(tmp_path)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs: room for a small checkpoint, not for a big one."""
    import subprocess

    folder = tmp_path / "full"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_full_file_system_is_one_line_and_leaves_the_last_good_checkpoint(tiny_fs, caplog):
    """torch's own error on a full disk ("unexpected pos ...") becomes one line naming
    the folder and the size; the partial ckpt-*.tmp goes; the previous checkpoint stays
    the latest; and once there is room again the next one is written."""
    import errno
    import logging

    writer = CheckpointWriter(tiny_fs, every=60.0)
    writer.save(_state(1.0), step=1, progress=1, replicas=1, wait=True)
    big = {**_state(2.0), "table": torch.zeros(1_000_000)}  # 4 MB
    with caplog.at_level(logging.ERROR, logger="pollux_launch.elastic.checkpoint"):
        writer.save(big, step=2, progress=2, replicas=1, wait=True)
        writer.save(big, step=3, progress=3, replicas=1, wait=True)  # (said once)
    assert isinstance(writer.error, OSError) and writer.error.errno == errno.ENOSPC
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"no space left on {tiny_fs} (checkpoint of 4.0 MB not written; the "
                    "last good checkpoint is kept)"]
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["ckpt-00000001", "latest"]
    assert latest_checkpoint(tiny_fs).step == 1
    writer.save(_state(4.0), step=4, progress=4, replicas=1, wait=True)
    assert writer.error is None and latest_checkpoint(tiny_fs).step == 4
