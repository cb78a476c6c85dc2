"""Every benchmark runs with ``--smoke`` (seconds, tiny sizes) as a real process, so that none
can rot unnoticed (issue 27): exit 0, and a last stdout line that is one JSON object naming
no failure. The benchmarks are found in ``benchmarks/`` - a new one without ``--smoke``
fails here - less the helper scripts in ``HELPERS``. Also: the JSON line comes whatever
happens (a bad command line, SIGTERM, Ctrl-C). Speed is only printed, never asserted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_server import ETCD  # tests/etcd_server.py
from waiting import wait_for  # tests/waiting.py

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from hosts import netns_available  # noqa: E402  (tests/e2e/hosts.py)
from slurm import slurm_available  # noqa: E402  (tests/e2e/slurm.py)

# scripts in benchmarks/ that are imported or started by the benchmarks, not benchmarks
HELPERS = {"harness", "checkpoint_worker", "local_etcd", "sharded_worker", "startup_worker",
           "startup_worker_hvd", "step_overhead_frameworks", "worker_events"}
# what a benchmark needs beyond the base install: "etcd", "netns", "slurm" (Debian's
# slurm-wlm and munge, as root), or a module to import
NEEDS: dict[str, tuple[str, ...]] = {
    "adaptation_policies": ("sklearn",),
    "checkpoint": ("etcd", "sklearn", "deepspeed", "horovod"),
    "deepspeed_rebuild": ("deepspeed",),
    "faults": ("netns", "etcd", "sklearn"),
    "horovod_rescale": ("horovod",),
    "hostile_inputs": ("etcd", "sklearn"),
    "rendezvous_scale": ("etcd",),
    "slurm": ("netns", "etcd", "slurm", "sklearn"),
    "startup": ("deepspeed", "horovod"),
    "store_latency": ("etcd",),
}
TIMEOUT = 420  # seconds, then SIGTERM (the benchmark still prints its line), then SIGKILL
GRACE = 60
# DeepSpeed JIT-builds its CPU op (deepspeed_shm_comm) with the first `ninja` on PATH, and
# the venv's and the system's rebuild each other's build (60-150 s each time they
# alternate): the benchmarks run as from the activated venv, as pollux-run's workers do,
# building into the folder tests/compat uses in the same way (one build for both).
BIN = Path(sys.executable).parent
TORCH_EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
    Path.home() / ".cache" / "pollux-launch" / "compat-torch-extensions"
    / hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])


def _missing(need: str) -> str | None:
    """Why ``need`` is not met here (one line), or None."""
    if need == "etcd":
        return None if os.access(ETCD, os.X_OK) else (
            "etcd is not installed (scripts/test.sh installs Debian's etcd-server)")
    if need == "netns":
        return None if netns_available() else "needs root and network namespaces"
    if need == "slurm":
        return slurm_available()
    return None if importlib.util.find_spec(need) else f"{need} is not installed"


def _benchmarks() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPERS)


def _start(name: str, *args: str, out: Path) -> subprocess.Popen:
    """``benchmarks/<name>.py ARGS`` in its own session (so nothing it started outlives a
    SIGKILL), stdout and stderr to files under ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS,
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
        return subprocess.Popen([sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
                                cwd=ROOT, env=env, stdout=stdout, stderr=stderr,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    """Its exit code; past ``timeout`` it gets SIGTERM, then SIGKILL (its whole session)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _last_json(out: Path) -> dict:
    """The last line of the benchmark's stdout ``out``, which must be a JSON object (else
    the test fails with the tail of its stderr, beside ``out``)."""
    lines = [ln for ln in out.read_text(errors="replace").splitlines() if ln.strip()]
    try:
        parsed = json.loads(lines[-1]) if lines else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        pytest.fail(f"{out.stem}: the last line is not a JSON object: "
                    f"{lines[-1][:300] if lines else '(no output)'}\n{_tail(out)}")
    return parsed


def _tail(out: Path, chars: int = 3000) -> str:
    return out.with_suffix(".err").read_text(errors="replace")[-chars:]


def test_the_helpers_exist():
    """(a renamed helper would otherwise run here as a benchmark, or hide one)"""
    assert {p.stem for p in BENCHMARKS.glob("*.py")} >= HELPERS


@pytest.mark.parametrize("name", _benchmarks())
def test_smoke(name, tmp_path):
    for need in NEEDS.get(name, ()):
        if why := _missing(need):
            pytest.skip(why)
    t0 = time.monotonic()
    proc = _start(name, "--smoke", out=tmp_path)
    code = _finish(proc, TIMEOUT)
    print(f"{name} --smoke: {time.monotonic() - t0:.1f} s, exit code {code}")
    out = _last_json(tmp_path / f"{name}.out")
    assert not out.get("failed"), f"{name}: {out['failed']}\n{_tail(tmp_path / f'{name}.out')}"
    assert code == 0, f"{name} exited {code}\n{_tail(tmp_path / f'{name}.out')}"
    assert out.get("smoke") is True, f"{name} did not run through benchmarks/harness.py"


def test_a_bad_command_line_is_named_in_the_json_line(tmp_path):
    proc = _start("goodput_fit", "--smoke", "--traces", str(tmp_path / "absent"), out=tmp_path)
    assert _finish(proc, TIMEOUT) == 2
    assert "arguments" in _last_json(tmp_path / "goodput_fit.out")["failed"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_benchmark_still_prints_its_line(sig, tmp_path):
    proc = _start("gns_accuracy", "--smoke", "--steps", "100000000", out=tmp_path)
    try:
        # its progress bar says it is measuring (its imports and handlers are in place)
        wait_for(lambda: "replica" in (tmp_path / "gns_accuracy.err").read_text(), 120,
                 "gns_accuracy to start measuring")
        proc.send_signal(sig)
        code = _finish(proc, GRACE)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = _last_json(tmp_path / "gns_accuracy.out")
    assert code != 0
    assert "interrupted" in out["failed"]
    assert out["smoke"] is True
