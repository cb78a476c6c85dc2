"""Compatibility: ordinary torchrun / Horovod Elastic / DeepSpeed / torch.distributed.elastic
scripts (this folder's ``*.py``, which never import pollux_launch), first under their own
launchers, then unmodified under ``pollux-run`` in local mode.

A. Baselines: ``torchrun``, ``horovodrun``, ``deepspeed`` (and torchrun running the
   DeepSpeed script), ``torchrun --max-restarts``: exit codes and result files. Each
   script's result does not depend on its number of replicas (a fixed global batch split
   among the ranks, seeded data and weights), so 1 and 2 replicas - and a run restarted
   from its snapshot at another size - end with the same weights within float rounding.
B. The same scripts under ``pollux-run -np 2`` (fixed size): the baseline's exit code and
   result. Horovod also live-elastic (1 -> 2 replicas, the survivor keeps its process).
C. (``restart_elastic``) scripts without the pollux API rescaled by restarts with
   torchrun's contract: shrink 2 -> 1 for a second job and grow back, never more workers
   than slots, resumed from the snapshot; torchrun's command-line form; ``--max-restarts``.

Every ``pollux-run`` gets its own embedded store under the test's tmp_path (so its own
coordinator); ``--standalone`` (which refuses ``--store``) gets its own through
``XDG_RUNTIME_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
from waiting import jsonl_records as log_records  # tests/waiting.py

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent
POLLUX_RUN, TORCHRUN = str(BIN / "pollux-run"), str(BIN / "torchrun")
HOROVODRUN, DEEPSPEED = str(BIN / "horovodrun"), str(BIN / "deepspeed")
DDP, HVD = str(HERE / "torchrun_ddp.py"), str(HERE / "horovod_elastic.py")
DS, RECORD = str(HERE / "deepspeed_cifar.py"), str(HERE / "elastic_record.py")
DS_CONFIG = str(HERE / "ds_config.json")
SCRIPTS = ("torchrun_ddp.py", "horovod_elastic.py", "deepspeed_cifar.py", "elastic_record.py")

DDP_EPOCHS = 6  # fixed-size runs (a few seconds)
DDP_LONG_EPOCHS = 80  # the restart-elastic run: paced while rescaled, then at full speed
HVD_EPOCHS = 12
HVD_LONG_EPOCHS = 40  # grown and shrunk while paced, then at full speed
DS_EPOCHS = 2  # the DeepSpeed script's default
DS_LONG_EPOCHS = 40
TOL = {"rtol": 1e-4, "atol": 1e-4}  # weights; measured differences are ~1e-7..1e-6

# torchrun: `RuntimeError` in the script exits 1 and torchrun exits 1 on any failure
# (ChildFailedError), whatever the worker's own exit code.
TORCHRUN_FAILED = 1


# DeepSpeed JIT-builds its CPU shared-memory op (deepspeed_shm_comm) in every process
# (torch.utils.cpp_extension, with the first `ninja` on PATH). This venv has ninja 1.13
# and the system 1.11; pollux-run puts the venv's bin first on its workers' PATH, torchrun
# and deepspeed run from a shell without the venv activated do not, and each ninja
# rebuilds what the other built (60-75 s on two cores, every time they alternate, in the
# ~/.cache/torch_extensions that every run on the machine shares). So every launcher
# here runs as from an activated venv (its bin first on PATH), with a build folder of its
# own: one build, then seconds.
TORCH_EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
    Path.home() / ".cache" / "pollux-launch" / "compat-torch-extensions"
    / hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])


def env(**extra: str) -> dict[str, str]:
    """The launchers' environment: as from a shell with the venv activated."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
         "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": TORCH_EXTENSIONS,
         "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]), **extra}
    for name in ("POLLUX_STORE", "POLLUX_STORE_PREFIX", "POLLUX_JOB"):
        e.pop(name, None)
    return e


@dataclass
class Run:
    argv: list[str]
    rc: int
    out: str
    seconds: float

    def tail(self, n: int = 4000) -> str:
        return f"$ {' '.join(self.argv)}\nexit {self.rc} after {self.seconds:.1f} s\n" \
               + self.out[-n:]


TIMED_OUT = -999


def run(argv: list[str], cwd: Path, timeout: float = 240, raise_on_timeout: bool = True,
        **extra_env: str) -> Run:
    """Run to completion (stdout and stderr together); on timeout kill it and everything
    it started, then raise (or return exit ``TIMED_OUT``)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env(**extra_env), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        if raise_on_timeout:
            raise AssertionError(
                f"timed out after {timeout} s: {' '.join(argv)}\n{out[-4000:]}") from None
        rc = TIMED_OUT
    result = Run(argv, rc, out, time.monotonic() - start)
    print(f"[compat] exit {result.rc} in {result.seconds:5.1f} s: {' '.join(argv)}")
    return result


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant (torchrun starts its
    workers in sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def assert_same_result(got: dict, want: dict, what: str) -> None:
    a, b = np.asarray(got["weights"]), np.asarray(want["weights"])
    assert a.shape == b.shape, what
    diff = float(np.max(np.abs(a - b)))
    assert np.allclose(a, b, **TOL), f"{what}: weights differ by up to {diff:.3g}"
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=1e-4, abs=1e-6), what
    assert got["checksum"] == pytest.approx(want["checksum"], rel=1e-4, abs=1e-4), what
    assert got["epochs_run"] == want["epochs_run"], what
    print(f"[compat] {what}: same result (max weight difference {diff:.3g}, "
          f"loss {got['final_loss']:.6f} vs {want['final_loss']:.6f})")


def store(tmp: Path) -> list[str]:
    return ["--store", f"embedded://{tmp / 'store.db'}"]


# --------------------------------------------------------------------------- baselines
class Baselines:
    """Baseline runs, each made once per session (by the first test that needs it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, tuple[Run, dict | None]] = {}
        self.tries: dict[tuple, list[int]] = {}
        self.lock = threading.Lock()

    def _dir(self, key: tuple) -> Path:
        d = self.root / "-".join(str(k).replace("/", "_") for k in key)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def get(self, key: tuple, make) -> tuple[Run, dict | None]:
        with self.lock:
            if key not in self.cache:
                d = self._dir(key)
                r = make(d)
                result = d / "result.json"
                self.cache[key] = (r, load(result) if result.exists() else None)
            return self.cache[key]

    def ddp(self, nproc: int, epochs: int = DDP_EPOCHS) -> tuple[Run, dict | None]:
        return self.get(("ddp", nproc, epochs), lambda d: run(
            [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), DDP,
             "--epochs", str(epochs), "--snapshot", str(d / "snap.pt"),
             "--result", str(d / "result.json")], d))

    def horovod(self, nproc: int, epochs: int = HVD_EPOCHS) -> tuple[Run, dict | None]:
        return self.get(("hvd", nproc, epochs), lambda d: run(
            [HOROVODRUN, "--gloo", "-np", str(nproc), "-H", f"localhost:{nproc}",
             PYTHON, HVD, "--epochs", str(epochs), "--result", str(d / "result.json")], d))

    def deepspeed_torchrun(self, nproc: int, epochs: int = DS_EPOCHS) -> tuple[Run, dict | None]:
        return self.get(("ds-torchrun", nproc, epochs), lambda d: run(
            [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), DS, "--epochs",
             str(epochs), "--deepspeed_config", DS_CONFIG, "--result", str(d / "result.json")],
            d))

    def record(self, flags: tuple[str, ...] = ()) -> tuple[Run, dict | None]:
        """torchrun running elastic_record.py (``--fail-once`` with ``--max-restarts``).

        torch 2.13's restart with gloo is flaky here: the restarted workers often read the
        previous attempt's gloo addresses from torchrun's agent store and fail with
        "Gloo connectFullMesh failed ... Connection refused" or hang in
        init_process_group (measured 3/5 and 1/5 good with --standalone and
        --rdzv-backend static). So a restarting baseline is tried up to 3 times and
        every try is kept in ``self.tries``."""
        def make(d: Path) -> Run:
            restarting = "--max-restarts" in flags and flags[flags.index("--max-restarts")
                                                               + 1] != "0"
            for attempt in range(3 if restarting else 1):
                for old in d.glob("result.json*"):
                    old.unlink()
                r = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", *flags, RECORD,
                         "--result", str(d / "result.json")]
                        + (["--fail-once"] if "--max-restarts" in flags else []), d,
                        timeout=60, raise_on_timeout=False)
                self.tries.setdefault(flags, []).append(r.rc)
                if r.rc == 0 or not restarting:
                    break
                print(f"[compat] torchrun restart baseline try {attempt + 1} failed "
                      f"(exit {r.rc}): torch's gloo restart flake")
            return r
        return self.get(("record", *flags), make)


@pytest.fixture(scope="session")
def baselines(tmp_path_factory) -> Baselines:
    return Baselines(tmp_path_factory.mktemp("baselines"))


def ok(pair: tuple[Run, dict | None]) -> dict:
    r, result = pair
    assert r.rc == 0 and result is not None, r.tail()
    return result


# ============================================================ A. under their own launchers
def test_a_torchrun_ddp_baseline_is_independent_of_world_size(baselines, tmp_path):
    two, one = ok(baselines.ddp(2)), ok(baselines.ddp(1))
    assert two["world_sizes"] == [2] and one["world_sizes"] == [1]
    assert two["restart_counts"] == [0] and one["restart_counts"] == [0]
    assert_same_result(two, one, "torchrun 2 vs 1 procs")
    # stopped after 3 epochs at 2 procs, resumed from the snapshot at 1 proc
    snap, result = tmp_path / "snap.pt", tmp_path / "result.json"
    first = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", DDP, "--epochs", "3",
                 "--snapshot", str(snap), "--result", str(tmp_path / "first.json")], tmp_path)
    assert first.rc == 0, first.tail()
    second = run([TORCHRUN, "--standalone", "--nproc-per-node", "1", DDP, "--epochs",
                  str(DDP_EPOCHS), "--snapshot", str(snap), "--result", str(result)], tmp_path)
    assert second.rc == 0, second.tail()
    assert "Resuming training from snapshot at Epoch 3" in second.out
    resumed = load(result)
    assert resumed["world_sizes"] == [2, 1]
    assert [h["start_epoch"] for h in resumed["history"]] == [0, 3]
    assert_same_result(resumed, one, "torchrun 2 procs, then resumed at 1 proc")


def test_a_horovodrun_baseline(baselines, tmp_path):
    two, one = ok(baselines.horovod(2)), ok(baselines.horovod(1))
    assert two["world_sizes"] == [2] and one["world_sizes"] == [1]
    assert_same_result(two, one, "horovodrun -np 2 vs -np 1")
    # the same script, horovodrun in elastic mode (discovery script, --min-np/--max-np)
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    elastic = run([HOROVODRUN, "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
                   "--host-discovery-script", str(discover), "--network-interface", "lo",
                   PYTHON, HVD, "--epochs", str(HVD_EPOCHS),
                   "--result", str(tmp_path / "result.json")], tmp_path)
    assert elastic.rc == 0, elastic.tail()
    assert_same_result(load(tmp_path / "result.json"), two, "horovodrun elastic -np 2")


def elastic_growth_files(tmp: Path) -> tuple[Path, Path, Path, Path]:
    """(hosts file saying ``localhost:1``, the discovery script printing it, the pace file,
    the event log) for a Horovod Elastic run whose hosts the test changes."""
    hosts, discover, pace = tmp / "hosts", tmp / "discover.sh", tmp / "pace"
    hosts.write_text("localhost:1\n")
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    pace.touch()
    return hosts, discover, pace, tmp / "log.jsonl"


@pytest.mark.slow
def test_a_horovodrun_elastic_growth_keeps_the_result(baselines, tmp_path):
    """horovodrun itself grows the job 1 -> 2 (its discovery script's hosts change while it
    trains): the script is reset-safe, the result is the baseline's."""
    want = ok(baselines.horovod(2))
    hosts, discover, pace, log = elastic_growth_files(tmp_path)
    argv = [HOROVODRUN, "--gloo", "-np", "1", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discover), "--network-interface", "lo",
            PYTHON, HVD, "--epochs", str(HVD_EPOCHS), "--step-sleep", "0.05",
            "--pace-file", str(pace), "--result", str(tmp_path / "result.json"),
            "--events", str(log)]
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                            env=env(), start_new_session=True)
    try:
        # Horovod drops a host change it sees before rank 0 registered: change it only
        # once the worker trains
        wait_for(proc, lambda: any(r["event"] == "epoch" for r in log_records(log)),
                 "the first epoch", 120)
        hosts.write_text("localhost:2\n")
        wait_for(proc, lambda: any(r["event"] == "start" and r["size"] == 2
                                   for r in log_records(log)), "growth to 2", 120)
        pace.unlink()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_group(proc)
            proc.wait()
        out.close()
    assert rc == 0, (tmp_path / "out.txt").read_text()[-4000:]
    got = load(tmp_path / "result.json")
    assert got["world_sizes"] == [1, 2]
    assert_same_result(got, want, "horovodrun elastic 1 -> 2")


@pytest.mark.slow
def test_a_deepspeed_launcher_baseline(baselines, tmp_path):
    """``deepspeed --num_gpus 2`` runs on this CPU machine (DS_ACCELERATOR=cpu); the script
    gets ``--local_rank=N``; torchrun running the same script gives the same result."""
    tr2, tr1 = ok(baselines.deepspeed_torchrun(2)), ok(baselines.deepspeed_torchrun(1))
    assert_same_result(tr2, tr1, "DeepSpeed script under torchrun, 2 vs 1 procs")
    assert tr2["micro_batch"] == 8 and tr1["micro_batch"] == 16  # DeepSpeed split the batch
    port = free_port()
    ds = run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), DS,
              "--deepspeed_config", DS_CONFIG, "--result", str(tmp_path / "result.json")],
             tmp_path, timeout=300)
    assert ds.rc == 0, ds.tail()
    assert "--local_rank=1" in ds.out
    got = load(tmp_path / "result.json")
    assert got["world_size"] == 2 and got["local_rank_arg"] == 0
    assert_same_result(got, tr2, "deepspeed launcher vs torchrun")


FLAKE = ("Gloo connectFullMesh failed", "Connection refused")


def test_a_torchrun_max_restarts_baseline(baselines):
    r, result = baselines.record(("--max-restarts", "1"))
    tries = baselines.tries[("--max-restarts", "1")]
    print(f"[compat] torchrun --max-restarts 1 exit codes over tries: {tries}")
    if r.rc != 0 and (r.rc == TIMED_OUT or all(f in r.out for f in FLAKE)):
        pytest.xfail(f"torch's own restart failed {len(tries)} times (gloo connectFullMesh to "
                     "the previous attempt's address, or a hang): not a pollux matter")
    assert r.rc == 0, r.tail()
    assert result["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert [x["TORCHELASTIC_RESTART_COUNT"] for x in result["ranks"]] == ["1", "1"]
    failed, none = baselines.record(("--max-restarts", "0"))
    assert failed.rc == TORCHRUN_FAILED and none is None, failed.tail()


# ================================================================ B. pollux-run, fixed size
def test_b_torchrun_ddp_under_pollux_run(baselines, tmp_path):
    want = ok(baselines.ddp(2))
    r = run([POLLUX_RUN, *store(tmp_path), "-np", "2", "python", DDP, "--epochs",
             str(DDP_EPOCHS), "--snapshot", str(tmp_path / "snap.pt"),
             "--result", str(tmp_path / "result.json")], tmp_path)
    assert r.rc == baselines.ddp(2)[0].rc == 0, r.tail()
    got = load(tmp_path / "result.json")
    assert got["world_sizes"] == [2]
    assert got["restart_counts"] == [0]  # TORCHELASTIC_RESTART_COUNT is set, as torchrun does
    assert_same_result(got, want, "pollux-run -np 2 vs torchrun --nproc-per-node 2")


def test_b_elastic_variables_under_pollux_run(baselines, tmp_path):
    """torchrun's variables as a torch.distributed.elastic script reads them."""
    want = ok(baselines.record())
    r = run([POLLUX_RUN, *store(tmp_path), "-np", "2", "python", RECORD,
             "--result", str(tmp_path / "result.json")], tmp_path)
    assert r.rc == 0, r.tail()
    got = load(tmp_path / "result.json")
    same = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "rank", "world", "rank_sum")
    for mine, theirs in zip(got["ranks"], want["ranks"], strict=True):
        assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}
        for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                     "TORCHELASTIC_ERROR_FILE"):
            assert mine[name], (name, mine)
    assert len({x["TORCHELASTIC_RUN_ID"] for x in got["ranks"]}) == 1


def test_b_horovod_elastic_under_pollux_run(baselines, tmp_path):
    want = ok(baselines.horovod(2))
    r = run([POLLUX_RUN, *store(tmp_path), "-np", "2", "python", HVD, "--epochs",
             str(HVD_EPOCHS), "--result", str(tmp_path / "result.json")], tmp_path)
    assert r.rc == baselines.horovod(2)[0].rc == 0, r.tail()
    got = load(tmp_path / "result.json")
    assert got["world_sizes"] == [2]
    assert_same_result(got, want, "pollux-run -np 2 vs horovodrun -np 2")


@pytest.mark.slow
def test_b_horovod_elastic_grows_live_under_pollux_run(baselines, tmp_path):
    """``pollux-run -np 1 --min-np 1 --max-np 2``: an unmodified Horovod Elastic script is
    live-elastic, and - reporting no goodput model - takes what is free: it starts on
    the one slot another job leaves, and grows live onto the second when that job ends.
    The worker survives the reset in place and the result is the baseline's."""
    want = ok(baselines.horovod(2))
    pace, log, job = tmp_path / "pace", tmp_path / "log.jsonl", "hvd-grow"
    hold = tmp_path / "hold"
    pace.touch()
    hold.touch()
    common = [*store(tmp_path), "-H", "localhost:2", "--interval", "2"]
    blocker = subprocess.Popen(
        [POLLUX_RUN, *common, "--job-name", "blocker", "-np", "1", "python", "-c",
         f"import os, time\nwhile os.path.exists({str(hold)!r}): time.sleep(0.1)"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env(),
        start_new_session=True)
    argv = [POLLUX_RUN, *common, "--job-name", job, "-np", "1", "--min-np", "1",
            "--max-np", "2", "python", HVD,
            "--epochs", str(HVD_EPOCHS), "--step-sleep", "0.05", "--pace-file", str(pace),
            "--result", str(tmp_path / "result.json"), "--events", str(log)]
    out = open(tmp_path / "out.txt", "w")
    proc = None
    try:
        time.sleep(2)  # the blocker holds its slot first
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env=env(), start_new_session=True)
        wait_for(proc, lambda: any(r["event"] == "epoch" for r in log_records(log)),
                 "the first epoch at one replica", 120)
        hold.unlink()  # the other job ends: its slot is free
        assert blocker.wait(timeout=60) == 0
        wait_for(proc, lambda: any(r["event"] == "start" and r["size"] == 2
                                   for r in log_records(log)), "the reset to 2 replicas", 120)
        pace.unlink()
        rc = proc.wait(timeout=120)
    finally:
        for p in (blocker, proc):
            if p is not None and p.poll() is None:
                kill_group(p)
                p.wait()
        out.close()
    text = (tmp_path / "out.txt").read_text()
    assert rc == 0, text[-4000:]
    assert f"job {job}: live-elastic 1..2" in text, text[:2000]
    got = load(tmp_path / "result.json")
    assert got["world_sizes"] == [1, 2]
    starts = [r for r in log_records(log) if r["event"] == "start"]
    assert len({r["pid"] for r in starts}) == 1, "rank 0 must keep its process (live reset)"
    assert_same_result(got, want, "pollux-run live 1 -> 2 vs horovodrun -np 2")


@pytest.mark.slow
def test_b_horovodrun_discovery_command_line_under_pollux_run(baselines, tmp_path):
    """horovodrun's elastic command line as it is (``--gloo``, ``--host-discovery-script``,
    ``--network-interface``), with ``pollux-run`` in its place: the script's hosts are
    this machine's slots, polled; the job grows live 1 -> 2 when the script says two
    slots and shrinks live 2 -> 1 when it says one, rank 0 keeping its process, and ends
    with horovodrun's result."""
    want = ok(baselines.horovod(2, HVD_LONG_EPOCHS))  # (paced: time to grow and shrink)
    hosts, discover, pace, log = elastic_growth_files(tmp_path)
    argv = [POLLUX_RUN, *store(tmp_path), "--interval", "2",
            "--gloo", "-np", "1", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discover), "--network-interface", "lo",
            PYTHON, HVD, "--epochs", str(HVD_LONG_EPOCHS), "--step-sleep", "0.1",
            "--pace-file", str(pace), "--result", str(tmp_path / "result.json"),
            "--events", str(log)]
    sampler = Sampler(str(tmp_path))
    sampler.start()
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                            env=env(), start_new_session=True)

    def sizes() -> list[int]:
        return [r["size"] for r in log_records(log) if r["event"] == "start"]

    try:
        wait_for(proc, lambda: any(r["event"] == "epoch" for r in log_records(log)),
                 "the first epoch", 120)
        assert sampler.most == 1
        hosts.write_text("localhost:2\n")
        wait_for(proc, lambda: sizes()[-1:] == [2], "growth to 2", 120)
        grown = len(log_records(log))
        wait_for(proc, lambda: any(r["event"] == "epoch" for r in log_records(log)[grown:]),
                 "an epoch at 2", 120)
        hosts.write_text("localhost:1\n")
        wait_for(proc, lambda: sizes()[-1:] == [1] and len(sizes()) >= 3, "shrink to 1", 120)
        shrunk = time.monotonic()
        while time.monotonic() - shrunk < 3:  # no worker beyond the one slot stays
            time.sleep(0.2)
        most_after = sum(workers_of(str(tmp_path)).values())
        pace.unlink()
        rc = proc.wait(timeout=120)
    finally:
        sampler.halt.set()
        if proc.poll() is None:
            kill_group(proc)
            proc.wait()
        out.close()
    text = (tmp_path / "out.txt").read_text()
    assert rc == 0, text[-4000:]
    assert most_after <= 1
    got = load(tmp_path / "result.json")
    assert got["world_sizes"] == [1, 2, 1], got
    starts = [r for r in log_records(log) if r["event"] == "start"]
    assert len({r["pid"] for r in starts}) == 1, "rank 0 must keep its process (live reset)"
    assert_same_result(got, want, "pollux-run with horovodrun's discovery, 1 -> 2 -> 1")


@pytest.mark.slow
def test_b_deepspeed_under_pollux_run(baselines, tmp_path):
    want = ok(baselines.deepspeed_torchrun(2))
    r = run([POLLUX_RUN, *store(tmp_path), "-np", "2", "python", DS, "--deepspeed_config",
             DS_CONFIG, "--result", str(tmp_path / "result.json")], tmp_path, timeout=300)
    assert r.rc == 0, r.tail()
    got = load(tmp_path / "result.json")
    assert got["world_size"] == 2 and got["micro_batch"] == 8
    assert_same_result(got, want, "pollux-run -np 2 vs torchrun (DeepSpeed script)")


# ======================================================== C. restart-elastic (torchrun's)
def workers_of(marker: str) -> Counter:
    """Live worker processes (the scripts, not launchers) whose command line mentions
    ``marker`` (a tmp path), by script name. A worker's own children (its DataLoader's
    worker processes, forked with its command line) are part of it, not workers."""
    found: dict[int, tuple[int, str]] = {}  # pid -> (parent pid, script)
    for p in psutil.process_iter(["cmdline", "ppid"]):
        try:
            cmd = p.info["cmdline"] or []
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not any(marker in c for c in cmd) or any(
                c.endswith(("pollux-run", "torchrun", "horovodrun")) for c in cmd[:2]):
            continue
        script = next((c for c in cmd if c.endswith(SCRIPTS)), None)
        if script is not None:
            found[p.pid] = (p.info["ppid"], Path(script).name)
    return Counter(name for parent, name in found.values() if parent not in found)


class Sampler(threading.Thread):
    """Counts the workers of a test (by its tmp path) every 0.1 s: the most at once."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.most, self.at = marker, 0, Counter()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            now = workers_of(self.marker)
            if sum(now.values()) > self.most:
                self.most, self.at = sum(now.values()), now
            self.halt.wait(0.1)


def wait_for(proc: subprocess.Popen, predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restart_elastic_argv(script: str, tmp: Path, name: str, epochs: int,
                         step_sleep: float, pace: Path | None = None) -> list[str]:
    """The command line of ``script`` (``ddp`` or ``deepspeed``) saving its own checkpoint
    under ``tmp`` (``NAME.pt``: the tutorial's snapshot; ``NAME.ckpt``: DeepSpeed's
    folder), with its result ``NAME.json`` and its event log ``NAME.log.jsonl``."""
    paced = ["--step-sleep", str(step_sleep)] + (["--pace-file", str(pace)] if pace else [])
    common = ["--epochs", str(epochs), *paced, "--result", str(tmp / f"{name}.json"),
              "--events", str(tmp / f"{name}.log.jsonl")]
    if script == "ddp":
        return ["python", DDP, *common, "--snapshot", str(tmp / f"{name}.pt")]
    return ["python", DS, "--deepspeed_config", DS_CONFIG, *common,
            "--checkpoint", str(tmp / f"{name}.ckpt")]


@pytest.mark.restart_elastic
@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp", "deepspeed"])
def test_c_restart_elastic_shrinks_and_grows_by_restarts(baselines, tmp_path, script):
    """A torchrun script (the tutorial's DDP with its snapshot; DeepSpeed's CIFAR example
    with ``save_checkpoint``/``load_checkpoint``: restart-elastic detected, as neither
    imports pollux_launch and min < max) with ``-np 1 --min-np 1 --max-np 2`` alone on 2
    slots takes both; a second job (``-np 1``) makes it shrink to 1 by a restart; when
    that one ends it grows back to 2 by a restart. It ends with its own launcher's
    result, each restart resumed from the checkpoint, and never did both jobs run more
    workers than the 2 slots."""
    if script == "ddp":
        want, want_short = ok(baselines.ddp(1, DDP_LONG_EPOCHS)), ok(baselines.ddp(1))
        n_epochs, short_epochs, sleep = DDP_LONG_EPOCHS, DDP_EPOCHS, 0.1
    else:
        want = ok(baselines.deepspeed_torchrun(1, DS_LONG_EPOCHS))
        want_short = ok(baselines.deepspeed_torchrun(1, DS_EPOCHS))
        n_epochs, short_epochs, sleep = DS_LONG_EPOCHS, DS_EPOCHS, 0.1
    log, pace = tmp_path / "long.log.jsonl", tmp_path / "pace"
    pace.touch()
    common = [*store(tmp_path), "-H", "localhost:2", "--interval", "2"]
    long_argv = [POLLUX_RUN, *common, "--restart-grace", "5", "--job-name", "long",
                 "-np", "1", "--min-np", "1", "--max-np", "2",
                 *restart_elastic_argv(script, tmp_path, "long", n_epochs, sleep, pace)]
    short_argv = [POLLUX_RUN, *common, "--job-name", "short", "-np", "1",
                  *restart_elastic_argv(script, tmp_path, "short", short_epochs, 0.08)]
    sampler = Sampler(str(tmp_path))
    sampler.start()
    outs = {n: open(tmp_path / f"{n}.out", "w") for n in ("long", "short")}
    long = subprocess.Popen(long_argv, cwd=tmp_path, stdout=outs["long"],
                            stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    short = None
    t0 = time.monotonic()
    marks: dict[str, float] = {}

    def starts() -> list[dict]:
        return [r for r in log_records(log) if r["event"] == "start"]

    try:
        wait_for(long, lambda: any(r["world_size"] == 2 for r in starts()) and any(
            r["event"] == "epoch" and r["world_size"] == 2 for r in log_records(log)),
            "the job alone to train on both slots", 180)
        marks["at 2"] = time.monotonic() - t0
        short = subprocess.Popen(short_argv, cwd=tmp_path, stdout=outs["short"],
                                 stderr=subprocess.STDOUT, env=env(), start_new_session=True)
        wait_for(long, lambda: [r["world_size"] for r in starts()][-1:] == [1]
                 and len(starts()) >= 2, "the shrink to 1 for the second job", 180)
        marks["shrunk"] = time.monotonic() - t0
        short_rc = short.wait(timeout=240)
        marks["second ended"] = time.monotonic() - t0
        wait_for(long, lambda: [r["world_size"] for r in starts()][-1:] == [2]
                 and len(starts()) >= 3, "the growth back to 2", 180)
        marks["grown"] = time.monotonic() - t0
        # one epoch at 2 after the growth, then at full speed to the end
        grown_at = starts()[-1]["t"]
        wait_for(long, lambda: any(r["event"] == "epoch" and r["t"] > grown_at
                                   for r in log_records(log)), "an epoch after growing", 120)
        pace.unlink()
        long_rc = long.wait(timeout=180)
        marks["ended"] = time.monotonic() - t0
    finally:
        sampler.halt.set()
        for proc in (long, short):
            if proc is not None and proc.poll() is None:
                kill_group(proc)
                proc.wait()
        for f in outs.values():
            f.close()
    print(f"[compat] restart-elastic timeline (s): {marks}")
    long_out = (tmp_path / "long.out").read_text()
    short_out = (tmp_path / "short.out").read_text()
    assert "job long: restart-elastic 1..2 replicas (script does not use the pollux API)" \
        in long_out, long_out[:3000]
    assert short_rc == 0, short_out[-3000:]
    assert long_rc == 0, long_out[-4000:]
    got = load(tmp_path / "long.json")
    records = log_records(log)
    attempts = [r for r in records if r["event"] == "start"]
    worlds = [r["world_size"] for r in attempts]
    assert worlds[-3:] == [2, 1, 2] and worlds[0] in (1, 2), worlds
    assert got["world_sizes"][-3:] == [2, 1, 2], got["history"]  # (the snapshot's view)
    # each restart resumed from the snapshot: no epoch trained twice to completion, and
    # every restart started at (or past) the last epoch logged before it, never from 0
    epochs = [r["epoch"] for r in records if r["event"] == "epoch"]
    assert len(epochs) == len(set(epochs)), f"epochs repeated: {Counter(epochs)}"
    # (a restart between saving an epoch's snapshot and logging it loses only its line)
    assert set(epochs) <= set(range(n_epochs))
    assert len(epochs) >= n_epochs - (len(attempts) - 1), sorted(epochs)
    for attempt in attempts[1:]:
        done = sum(1 for r in records if r["event"] == "epoch" and r["t"] < attempt["t"])
        assert attempt["start_epoch"] >= done, (attempt, done)
    assert attempts[-2]["start_epoch"] > 0 and attempts[-1]["start_epoch"] > 0, attempts
    # re-allocations are not failures: torchrun keeps TORCHELASTIC_RESTART_COUNT for a
    # membership change
    assert {r["restart_count"] for r in attempts} == {0}, attempts
    assert len({r["master_port"] for r in attempts}) == len(attempts), attempts
    # (the sampler saw the two slots in use, never more)
    assert sampler.most == 2, f"most workers at once: {sampler.most} ({sampler.at})"
    assert_same_result(got, want, f"restart-elastic 2 -> 1 -> 2 vs torchrun 1 proc ({script})")
    assert_same_result(load(tmp_path / "short.json"), want_short,
                       f"second job vs torchrun ({script})")


@pytest.mark.restart_elastic
def test_c_restart_elastic_grows_alone_from_one(baselines, tmp_path):
    """``--elasticity restart -np 1 --max-np 2`` (asked for, not detected) alone on 2 slots:
    it takes both slots (at once or by one restart, as torchrun's elastic agent would) and
    ends with the result."""
    want = ok(baselines.ddp(1))
    r = run([POLLUX_RUN, *store(tmp_path), "-H", "localhost:2", "--interval", "2",
             "--elasticity", "restart", "--restart-grace", "5", "--job-name", "alone",
             "-np", "1", "--min-np", "1", "--max-np", "2", "python", DDP,
             "--epochs", str(DDP_EPOCHS), "--step-sleep", "0.1",
             "--snapshot", str(tmp_path / "snap.pt"),
             "--result", str(tmp_path / "result.json")], tmp_path)
    assert r.rc == 0, r.tail()
    assert "job alone: restart-elastic 1..2 replicas (as asked by --elasticity restart)" in r.out, \
        r.out[:2000]
    got = load(tmp_path / "result.json")
    assert got["world_sizes"][-1] == 2, got["history"]
    assert_same_result(got, want, "restart-elastic alone vs torchrun")


@pytest.mark.restart_elastic
@pytest.mark.parametrize("form", ["nnodes", "standalone", "module", "no-python"])
def test_c_torchrun_command_line_form(baselines, tmp_path, form):
    """``pollux-run`` with torchrun's command line: the first positional is the script
    (python implied), ``-m module``, ``--no-python PROGRAM``, ``--standalone``."""
    want = ok(baselines.ddp(2))
    args = ["--epochs", str(DDP_EPOCHS), "--snapshot", str(tmp_path / "snap.pt"),
            "--result", str(tmp_path / "result.json")]
    extra: dict[str, str] = {}
    if form == "nnodes":
        argv = [POLLUX_RUN, *store(tmp_path), "--nproc-per-node", "2", "--nnodes", "1", DDP]
    elif form == "standalone":  # --standalone refuses --store: its own default store
        argv = [POLLUX_RUN, "--standalone", "--nproc-per-node", "2", DDP]
        extra["XDG_RUNTIME_DIR"] = str(tmp_path)
    elif form == "module":
        argv = [POLLUX_RUN, *store(tmp_path), "--nproc-per-node", "2", "-m", "torchrun_ddp"]
        extra["PYTHONPATH"] = str(HERE)
    else:
        argv = [POLLUX_RUN, *store(tmp_path), "--nproc-per-node", "2", "--no-python",
                PYTHON, DDP]
    r = run([*argv, *args], tmp_path, **extra)
    assert r.rc == 0, r.tail()
    got = load(tmp_path / "result.json")
    assert got["world_sizes"] == [2]
    assert_same_result(got, want, f"pollux-run torchrun form ({form}) vs torchrun")


@pytest.mark.restart_elastic
@pytest.mark.parametrize("failure", ["exception", "abort"])
def test_c_max_restarts_restarts_a_failed_group(tmp_path, failure):
    """As ``torchrun --max-restarts 1``: rank 1 raises (or crashes by SIGABRT) in the first
    attempt; the whole group restarts and the second attempt (restart count 1 on every
    rank) succeeds."""
    flags = ["--abort"] if failure == "abort" else []
    r = run([POLLUX_RUN, *store(tmp_path), "--nproc-per-node", "2", "--max-restarts", "1",
             RECORD, "--result", str(tmp_path / "result.json"), "--fail-once", *flags],
            tmp_path)
    assert r.rc == 0, r.tail()
    got = load(tmp_path / "result.json")
    assert [x["TORCHELASTIC_RESTART_COUNT"] for x in got["ranks"]] == ["1", "1"]
    assert [x["TORCHELASTIC_MAX_RESTARTS"] for x in got["ranks"]] == ["1", "1"]  # (torchrun's)
    assert "restarting the group (restart 1 of 1)" in r.out, r.tail()
    attempts = sorted(p.name for p in tmp_path.glob("result.json.rank*.attempt*.json"))
    assert attempts == [f"result.json.rank{r}.attempt{a}.json" for r in (0, 1) for a in (0, 1)]
    first = [load(tmp_path / f"result.json.rank{k}.attempt0.json") for k in (0, 1)]
    assert {x["pid"] for x in first}.isdisjoint({x["pid"] for x in got["ranks"]})


@pytest.mark.restart_elastic
@pytest.mark.parametrize("failure", ["exception", "exit-3", "abort"])
def test_c_no_restarts_left_fails_like_torchrun(baselines, tmp_path, failure):
    """``--max-restarts 0``: the job fails. A raised exception exits 1, as under torchrun.
    torchrun itself exits 1 whatever the worker's end (``sys.exit(3)``, SIGABRT); pollux-run
    reports the worker's code - 3 for ``sys.exit(3)`` (the interface's choice, not
    torchrun's) - and for a worker killed by signal N torchrun's 1 or the shell's 128+N
    are both fine, but not N's low byte (``exit(-6)`` is 250). (torch 2.13's gloo may
    abort a process that exits with its group still formed - "terminate called without
    an active exception" - so ``sys.exit(3)`` can end as SIGABRT: 128+6 then.)"""
    failed, _ = baselines.record(("--max-restarts", "0"))
    assert failed.rc == TORCHRUN_FAILED
    flags = {"exit-3": ["--exit-code", "3"], "abort": ["--abort"]}.get(failure, [])
    r = run([POLLUX_RUN, *store(tmp_path), "--nproc-per-node", "2", "--max-restarts", "0",
             RECORD, "--result", str(tmp_path / "result.json"), "--fail-once", *flags],
            tmp_path)
    expected = {"exception": (TORCHRUN_FAILED,), "exit-3": (3, 128 + signal.SIGABRT),
                "abort": (TORCHRUN_FAILED, 128 + signal.SIGABRT)}[failure]
    assert r.rc in expected, r.tail()
    assert not (tmp_path / "result.json").exists()
    assert not list(tmp_path.glob("result.json.rank*.attempt1.json"))  # no second attempt
    if failure == "exception":
        assert "RuntimeError: rank 1 fails in its first attempt" in r.out, r.tail()
