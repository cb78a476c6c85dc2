"""Every bad command-line input: one line naming the input and the fix, exit code 2, no
traceback, and nothing created (not the store, not a folder, not a job)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pollux_launch.cli import main

PY = sys.executable
POLLUX_RUN = str(Path(PY).with_name("pollux-run"))


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _inputs(tmp: Path) -> None:
    (tmp / "t.py").write_text("pass\n")
    (tmp / "huge-hosts").write_text(f"{'localhost'} slots=99999999999999999999\n")
    (tmp / "latin1-hosts").write_bytes(b"h\xf6st slots=2\n")
    (tmp / "a-file").write_text("")
    (tmp / "ds-gas0.json").write_text('{"gradient_accumulation_steps": 0, "pollux": '
                                      '{"enabled": true, "initial_batch_size": 32}}')
    (tmp / "ds-auto.json").write_text('{"train_micro_batch_size_per_gpu": "auto", "pollux": '
                                      '{"enabled": true, "initial_batch_size": 32}}')
    (tmp / "ds-unknown.json").write_text('{"pollux": {"initial_batch_sise": 32}}')


CASES = [
    # the launcher
    (["--interval", "nan", PY, "t.py"], "--interval"),
    (["--interval", "inf", PY, "t.py"], "not a finite number"),
    (["--interval", "0", PY, "t.py"], "positive seconds"),
    (["--start-timeout", "nan", PY, "t.py"], "--start-timeout"),
    (["--elastic-timeout", "-5", PY, "t.py"], "--elastic-timeout"),
    (["--realloc-delay", "-1", PY, "t.py"], "0 or more seconds"),
    (["--fairness", "5", PY, "t.py"], "[-100, 1]"),
    (["--fairness", "0", PY, "t.py"], "not be 0"),
    (["-np", "abc", PY, "t.py"], "argument -np"),
    (["-np", "0", PY, "t.py"], "from 1 to"),
    (["--slots-per-host", "99999999999999999999", PY, "t.py"], "--slots-per-host"),
    (["--hostfile", "huge-hosts", PY, "t.py"], "slots must be a whole number from 1 to"),
    (["--hostfile", "latin1-hosts", PY, "t.py"], "latin1-hosts: not UTF-8"),
    (["-H", "h1:99999999999999999999", PY, "t.py"], "slots must be a whole number"),
    (["--job-name", "Bad/Name", PY, "t.py"], "--job-name"),
    (["--output-filename", "a-file/logs", PY, "t.py"], "--output-filename a-file/logs"),
    (["--checkpoint-dir", "a-file/ck", PY, "t.py"], "--checkpoint-dir a-file/ck"),
    (["--checkpoint-interval", "nan", "--checkpoint-dir", "ck", PY, "t.py"],
     "--checkpoint-interval"),
    (["--store", "embedded:///nonexistent-pollux/dir/store.db", PY, "t.py"], "does not exist"),
    (["--framework", "deepspeed", PY, "t.py", "--deepspeed_config", "ds-gas0.json"],
     "gradient_accumulation_steps=0"),
    (["--framework", "deepspeed", PY, "t.py", "--deepspeed_config=ds-auto.json"],
     '"auto"'),
    (["--framework", "deepspeed", PY, "t.py", "--deepspeed_config", "ds-unknown.json"],
     "initial_batch_sise"),
    (["--log-level", "LOUD", PY, "t.py"], "--log-level"),
    # values the job's spec may not hold (its readers' bounds: messages.JobSpec)
    (["--restart-grace", "4000", "-np", "1", PY, "t.py"],
     "--restart-grace 4000: must lie in [0, 3600]"),
    (["--max-restarts", "2000000", "-np", "1", "--max-np", "2", PY, "t.py"],
     "--max-restarts 2000000: must lie in [0, 1000000]"),
    (["--nnodes", "1000:2000", "--nproc-per-node", "1000", "t.py"],
     "--nnodes x --nproc-per-node 2000000: must lie in [1, 1000000]"),
    (["--policy", "nope", PY, "t.py"], "argument --policy: invalid choice: 'nope'"),
    (["--policy", "nope", "--store", "etcd://127.0.0.1:2379", PY, "t.py"], "--policy"),
    (["--policy", "pollux-dp", "--store", "etcd://127.0.0.1:2379", PY, "t.py"],
     "coordinator service's policy"),
    # the services
    (["coordinator", "--interval", "0"], "--interval"),
    (["coordinator", "--interval", "-1"], "--interval"),
    (["coordinator", "--interval", "nan"], "--interval"),
    (["coordinator", "--lease-ttl", "0"], "at least 1 second"),
    (["coordinator", "--fairness", "5"], "--fairness"),
    (["coordinator", "--node-grace", "nan"], "--node-grace"),
    (["coordinator", "--policy", "nope"], "--policy"),
    (["agent", "--node-name", ""], "--node-name"),
    (["agent", "--node-name", "a/b"], "--node-name"),
    (["agent", "--slots", "0"], "--slots"),
    (["agent", "--slots", "99999999999999999999"], "--slots"),
    (["agent", "--lease-ttl", "0"], "--lease-ttl"),
    (["agent", "--address", "999.1.1.1"], "argument --address: '999.1.1.1' is neither"),
    (["agent", "--address", "a b"], "argument --address: 'a b' is neither"),
    (["status", "--every", "nan"], "--every"),
    (["status", "--store", "embedded:///nonexistent-pollux/x.db"], "does not exist"),
    (["cancel", "a/b"], "job"),
    (["status", "--no-such-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("argv", "needle"), CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_created(argv, needle, tmp_path, monkeypatch,
                                                     capsys):
    _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
    assert _files(tmp_path) == before
    assert not Path("/nonexistent-pollux").exists()


def test_status_into_a_closed_pipe_is_quiet(tmp_path):
    url = f"embedded://{tmp_path}/store.db"
    out = subprocess.run(f"{POLLUX_RUN} status --store {url} | head -1", shell=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("NODE") and out.stderr == "", out.stderr
