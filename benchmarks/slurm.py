"""``pollux-run --slurm`` in batch jobs of a real Slurm: how soon it trains, next to
``srun torchrun``; how long a node's loss pauses it; how soon a requeued job trains again.

    python benchmarks/slurm.py                     # about 3-4 min
    python benchmarks/slurm.py --repeats 5 --only first_step

A real Slurm (Debian's slurm-wlm 22.05 and munge: ``tests/e2e/slurm.py``) runs on this
machine: munged and slurmctld in the root network namespace, one slurmd per "machine"
(a network namespace on a bridge, ``tests/e2e/hosts.py``; root needed), nodes n1 and n2
with one CPU each, so a 2-replica job has one replica per node. The jobs are ``sbatch``
scripts that ``exec pollux-run --slurm ... python tests/e2e/digits_worker.py`` (the digits
MLP on the native adapter, one JSON line per optimiser step with its wall time), run from
a temporary folder with ``OMP_NUM_THREADS=1`` and the venv's ``bin`` first on PATH:

* ``first_step_s``: from ``sbatch -N 2`` of ``pollux-run --slurm -np 2`` to the first
  optimiser step logged (the median over ``--repeats``);
  ``first_step_vs_srun_torchrun``: that over the same measure for the same allocation
  running a tiny torch DDP script (gloo, one linear layer) under ``srun
  --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` with
  the batch node's address as the endpoint (``torchrun_first_step_s``; the two
  alternate, pollux first; ``sbatch_to_script_s``: Slurm's part of both, from sbatch to
  the batch script's first line; ``script_to_first_step_s``: each launcher's own part);
* ``node_loss_pause_s``: ``sbatch -N 2 --no-kill`` of ``pollux-run --slurm -np 2
  --min-np 1``; once it trains at world 2 with a replica on each node, every process of
  the node that is not the batch node is killed (slurmd, the agent, the worker: a failed
  machine); the pause runs from the kill to the survivor's first step (at world 1).
  Then the job is told to stop: ``node_loss_job_ok`` says whether pollux-run then ended
  with ``succeeded`` (``node_loss_stop_to_end_s`` after the stop file), and
  ``node_loss_batch_exited`` whether the batch script itself then ended within 60 s
  (pollux-run's teardown: the agents' srun step spans the lost node);
* ``requeue_to_step_s``: ``sbatch -N 2 --requeue`` with ``--checkpoint-dir``; after
  ``--requeue-steps`` steps, ``scancel --signal=USR1 --batch`` (Slurm's warning before a
  time limit): from that signal to the resumed run's first step. It includes the 10 s a
  requeued job waits before it may start again here (the fixture's ``cred_expire``):
  ``requeue_run_start_to_step_s`` starts at the requeued batch script's first line
  instead, ``requeue_restart_wait_s`` is the signal to that line and
  ``requeue_signal_to_requeued_s`` the signal to pollux-run's "requeued" (the workers'
  final checkpoints written, everything stopped);
  ``requeue_resumed_ok`` whether the resumed run's first step follows the last one.

The LAST line printed is one JSON object: ``{"first_step_s", "first_step_vs_srun_torchrun",
"node_loss_pause_s", "requeue_to_step_s", ...}``, with ``"failed": {case: why}`` for a case
that could not be measured or misbehaved (its batch output's tail goes to stderr).
Without root, network namespaces, Slurm, etcd or scikit-learn it is ``{"skipped": why}``
(exit code 0). ``--smoke``: one repeat of each, the fewest steps (about 2 min).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # the tests' harness

from cluster import read_jsonl  # noqa: E402  (tests/e2e/cluster.py)
from harness import Report, UsageError, run_benchmark  # noqa: E402  (beside this script)
from hosts import HostNet, netns_available  # noqa: E402  (tests/e2e/hosts.py)
from slurm import Slurm, slurm_available  # noqa: E402  (tests/e2e/slurm.py)
from waiting import wait_for  # noqa: E402  (tests/waiting.py)

DIGITS = ROOT / "tests" / "e2e" / "digits_worker.py"
BIN = Path(sys.executable).parent
RDZV_PORT = 29400  # (on the batch node's own address, in its own network namespace)
CASES = ("first_step", "node_loss", "requeue")
LIVE = ("PENDING", "CONFIGURING", "RUNNING")  # a batch job's squeue states before its end
VERDICT = re.compile(r"\[pollux\] b: (\w+), exit code (-?\d+)")  # pollux-run's last line

DDP = """\
import json, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
log = open(os.path.join(sys.argv[1], f"ddp-{os.getpid()}.jsonl"), "a")
for step in range(1, 6):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    log.write(json.dumps({"pid": os.getpid(), "rank": dist.get_rank(),
                          "world": dist.get_world_size(), "step": step,
                          "node": os.environ.get("SLURMD_NODENAME"), "t": time.time()}) + "\\n")
    log.flush()
dist.barrier()
dist.destroy_process_group()
"""

# The batch script: one torchrun per node through srun, the batch node's address as Slurm
# knows it (NodeAddr) the rendezvous endpoint. What torchrun needs besides on these
# "machines", whose host name resolves to 127.0.0.1 (as on a badly configured cluster):
# ``is_host`` on the batch node (torchrun does not know that address as its own), the
# node's own address as ``--local-addr`` (else rank 0 publishes its host name as
# MASTER_ADDR) and GLOO_SOCKET_IFNAME (gloo binds to what the host name resolves to).
TORCHRUN = """\
#!/bin/sh
export BATCH_NODE="$SLURMD_NODENAME"
exec srun --ntasks-per-node=1 {folder}/node.sh
"""
TORCHRUN_NODE = """\
#!/bin/sh
node_addr() {{
    scontrol show node "$1" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p'
}}
export GLOO_SOCKET_IFNAME=$(ip route show default | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p')
[ "$SLURMD_NODENAME" = "$BATCH_NODE" ] && is_host=1 || is_host=0
exec torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
    --rdzv-endpoint "$(node_addr "$BATCH_NODE"):{port}" --rdzv-id "$SLURM_JOB_ID" \\
    --rdzv-conf is_host=$is_host --local-addr "$(node_addr "$SLURMD_NODENAME")" \\
    {folder}/ddp.py {logs}
"""


class Batch:
    """One batch job: its script in a folder of its own (``logs/``, ``stop``), submitted
    with ``sbatch`` (``submitted``: the wall time just before)."""

    def __init__(self, slurm: Slurm, folder: Path, name: str) -> None:
        self.slurm, self.folder = slurm, folder / name
        self.logs, self.stop = self.folder / "logs", self.folder / "stop"
        self.logs.mkdir(parents=True)
        self.env = {**slurm.env, "OMP_NUM_THREADS": "1", "LOG_DIR": str(self.logs),
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.job_id, self.submitted = "", 0.0

    def pollux(self, *flags: str, epochs: int = 10_000) -> str:
        """A script running ``pollux-run --slurm FLAGS`` on the digits worker."""
        return ("#!/bin/sh\nexec pollux-run --slurm --job-name b " + " ".join(flags)
                + f" {sys.executable} {DIGITS} --stop-file {self.stop} --target 0 "
                f"--epochs {epochs} --step-delay 0.05\n")

    def submit(self, script: str, *sbatch: str) -> str:
        """``sbatch`` of ``script`` (a shell script), which first notes when it started."""
        path = self.folder / "job.sh"
        shebang, rest = script.split("\n", 1)
        path.write_text(f"{shebang}\ndate +%s.%N >> {self.folder / 'started'}\n{rest}")
        self.submitted = time.time()
        self.job_id = subprocess.run(
            ["sbatch", "--parsable", "-N", "2", *sbatch, "--chdir", str(self.folder),
             "--output", str(self.folder / "batch.out"), "--open-mode", "append",
             str(path)], env=self.env, capture_output=True, text=True, check=True,
            timeout=30).stdout.strip().split(";")[0]
        return self.job_id

    def steps(self) -> list[dict]:
        return sorted(read_jsonl(self.logs), key=lambda r: r["t"])

    def starts(self) -> list[float]:
        """When each run of its batch script started (a requeued job runs it again)."""
        path = self.folder / "started"
        text = path.read_text() if path.exists() else ""
        return [float(line) for line in text.splitlines() if line.strip()]

    def output(self) -> str:
        path = self.folder / "batch.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> str:
        """Its state in ``squeue`` ("" once Slurm forgot it)."""
        return next((s for j, s, _ in self.slurm.jobs() if j == self.job_id), "")

    def show(self) -> dict[str, str]:
        """``scontrol show job``'s fields."""
        text = self.slurm.run("scontrol", "show", "job", self.job_id)
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def until(self, predicate, timeout: float, what: str):
        """``predicate()``'s first truthy value (polled every 0.1 s), else AssertionError:
        past ``timeout``, or at once once the batch job no longer runs (checked every s)."""
        deadline, checked = time.monotonic() + timeout, time.monotonic()
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            if time.monotonic() - checked > 1:
                checked = time.monotonic()
                if (state := self.state()) not in LIVE:
                    if value := predicate():
                        return value
                    raise AssertionError(f"batch job {self.job_id} ended ({state or 'gone'}) "
                                         f"before {what}")
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_ended(self, timeout: float) -> None:
        """Until the batch job left RUNNING (and every earlier state)."""
        wait_for(lambda: self.state() not in LIVE,
                 timeout, f"batch job {self.job_id} to end", every=0.5)

    def cancel(self, wait: bool = True) -> None:
        """(whatever still runs of it: before the next case's allocation)"""
        with contextlib.suppress(subprocess.SubprocessError):
            self.slurm.run("scancel", self.job_id)
        with contextlib.suppress(AssertionError, subprocess.SubprocessError):
            if wait:
                wait_for(lambda: not self.state(), 60, "the cancelled job to go", every=0.5)

    def tail(self, chars: int = 3000) -> str:
        return f"--- batch job {self.job_id} output ({self.folder}) ---\n" \
               + self.output()[-chars:]


def _say(text: str) -> None:
    print(text, flush=True)


def _fail_tail(batch: Batch) -> None:
    print(batch.tail(), file=sys.stderr, flush=True)


# -- the cases: each returns its figures (one repeat) -------------------------------------

def first_step_pollux(slurm: Slurm, folder: Path, timeout: float) -> dict:
    batch = Batch(slurm, folder, "pollux")
    batch.stop.touch()  # (--target 0: it ends after its first epoch)
    batch.submit(batch.pollux("-np", "2", epochs=1))
    with _measuring(batch):
        first = batch.until(batch.steps, timeout, "the first pollux step")[0]
        batch.wait_ended(180)
    return _first_step(batch, first, "b: succeeded" in batch.output())


@contextlib.contextmanager
def _measuring(batch: Batch):
    """The batch job cancelled at the end, its output's tail shown if a wait failed."""
    try:
        yield
    except AssertionError:
        _fail_tail(batch)
        raise
    finally:
        batch.cancel()


def _first_step(batch: Batch, first: dict, ok: bool) -> dict:
    if not ok:
        _fail_tail(batch)
    return {"first_step_s": first["t"] - batch.submitted, "ok": ok,
            "script_start_s": batch.starts()[0] - batch.submitted}


def first_step_torchrun(slurm: Slurm, folder: Path, timeout: float) -> dict:
    batch = Batch(slurm, folder, "torchrun")
    (batch.folder / "ddp.py").write_text(DDP)
    node = batch.folder / "node.sh"
    node.write_text(TORCHRUN_NODE.format(port=RDZV_PORT, folder=batch.folder, logs=batch.logs))
    node.chmod(0o755)
    batch.submit(TORCHRUN.format(folder=batch.folder))
    with _measuring(batch):
        first = batch.until(batch.steps, timeout, "the first torchrun step")[0]
        # (both ranks' first steps; then it is cancelled: how torchrun ends is not measured)
        steps = batch.until(lambda: len({r["rank"] for r in batch.steps()}) == 2 and
                            batch.steps(), 60, "both torchrun ranks' first steps")
    return _first_step(batch, first, {r["world"] for r in steps} == {2}
                       and len({r["node"] for r in steps}) == 2)


def node_loss(slurm: Slurm, folder: Path, timeout: float) -> dict:
    """(the Slurm given is spent: one of its slurmd is killed)"""
    batch = Batch(slurm, folder, "node-loss")
    batch.submit(batch.pollux("-np", "2", "--min-np", "1", "--max-np", "2"), "--no-kill")
    lost = ""
    try:
        def spread() -> bool:
            recent = [r for r in batch.steps() if r["world"] == 2][-6:]
            return len({r["node"] for r in recent}) == 2
        batch.until(spread, timeout, "training at world 2 on both nodes")
        batch_host = batch.show().get("BatchHost", slurm.nodes[0])
        [other] = [n for n in slurm.nodes if n != batch_host]
        host = slurm.hosts[slurm.nodes.index(other)]
        t_kill, lost = time.time(), other
        host.kill_all()  # the machine fails: slurmd, the agent, its worker
        _say(f"    killed every process of {lost} (batch node {batch_host})")
        # (a step in flight at the kill may still end at world 2: the survivor's first
        # step at world 1 ends the pause)
        after = batch.until(lambda: [r for r in batch.steps() if r["t"] > t_kill
                                     and r["world"] == 1], timeout,
                            "the survivor's first step at world 1")[0]
        in_flight = [r for r in batch.steps() if t_kill < r["t"] < after["t"]]
        batch.stop.touch()
        t_stop = time.monotonic()
        with contextlib.suppress(AssertionError):
            wait_for(lambda: VERDICT.search(batch.output()), 180, "pollux-run's last line",
                     every=0.5)
        ended_s = time.monotonic() - t_stop
        with contextlib.suppress(AssertionError):  # (its teardown: srun's agent step too)
            batch.wait_ended(60)
        exited_s = time.monotonic() - t_stop if batch.state() not in LIVE else None
    except AssertionError:
        _fail_tail(batch)
        raise
    finally:
        if lost:  # (else its job stays COMPLETING until slurmctld gives up on the lost
            # node's slurmd: minutes)
            with contextlib.suppress(subprocess.SubprocessError):
                slurm.run("scontrol", "update", f"NodeName={lost}", "State=DOWN",
                          "Reason=lost")
        batch.cancel()
    text = batch.output()
    verdict = VERDICT.search(text)
    ok = bool(verdict) and verdict.group(1) == "succeeded" and verdict.group(2) == "0"
    if not ok:
        _fail_tail(batch)
    return {"pause_s": after["t"] - t_kill, "world_2_steps_after_kill": len(in_flight),
            "survivor": after["node"], "lost_node": lost,
            "job_ok": ok, "stop_to_end_s": ended_s if verdict else None,
            "stop_to_batch_exit_s": exited_s,
            "verdict": verdict.group(0) if verdict else None}


def requeue(slurm: Slurm, folder: Path, timeout: float, min_steps: int) -> dict:
    batch = Batch(slurm, folder, "requeue")
    batch.submit(batch.pollux("-np", "2", "--checkpoint-dir", "ckpt",
                              "--checkpoint-interval", "600"), "--requeue")
    try:
        def rank0() -> list[dict]:
            return [r for r in batch.steps() if r["rank"] == 0]
        batch.until(lambda: len(rank0()) >= min_steps, timeout, f"{min_steps} steps")
        first = {r["pid"] for r in rank0()}
        t_signal = time.time()
        slurm.run("scancel", "--signal=USR1", "--batch", batch.job_id)
        t_requeued = None  # when pollux-run's "requeued" was seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = batch.output()
            if t_requeued is None and "checkpoints; requeued" in text:
                t_requeued = time.time()
            resumed = [r for r in rank0() if r["pid"] not in first]
            if resumed:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("timed out waiting for the requeued run's first step")
        restarts = batch.show().get("Restarts", "?")
        t_run = batch.starts()[1] if len(batch.starts()) > 1 else None  # the requeued run
        batch.stop.touch()
        batch.wait_ended(180)
    except AssertionError:
        _fail_tail(batch)
        raise
    finally:
        batch.cancel()
    text = batch.output()
    before = [r["step"] for r in rank0() if r["pid"] in first]
    ok = "requeued" in text and "b: succeeded" in text
    if not ok:
        _fail_tail(batch)
    return {"to_step_s": resumed[0]["t"] - t_signal,
            "run_start_to_step_s": resumed[0]["t"] - t_run if t_run else None,
            "restart_wait_s": t_run - t_signal if t_run else None,
            "signal_to_requeued_s": t_requeued - t_signal if t_requeued else None,
            "resumed_ok": resumed[0]["step"] == max(before) + 1, "job_ok": ok,
            "restarts": restarts, "steps_before": len(before)}


# -- the benchmark -------------------------------------------------------------------------

class Cluster:
    """A fresh Slurm on the hosts, started when asked (the node-loss case spends one)."""

    def __init__(self, net: HostNet, hosts: list, folder: Path) -> None:
        self.net, self.hosts, self.folder, self.count = net, hosts, folder, 0
        self.slurm: Slurm | None = None

    def fresh(self) -> Slurm:
        self.close()
        self.count += 1
        self.slurm = Slurm(self.folder / f"slurm-{self.count}", str(self.net.gateway),
                           self.hosts, cpus=1)
        self.slurm.__enter__()
        self.slurm.wait_idle()
        return self.slurm

    def get(self) -> Slurm:
        return self.slurm or self.fresh()

    def close(self) -> None:
        if self.slurm is not None:
            self.slurm.close()
            self.slurm = None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def bench(args: argparse.Namespace, report: Report) -> None:
    for flag in ("repeats", "node_loss_repeats", "requeue_repeats", "requeue_steps"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if not netns_available():
        report["skipped"] = "needs root and network namespaces (ip netns) for the nodes"
        return
    if why := slurm_available():
        report["skipped"] = why
        return
    if shutil.which("etcd") is None:  # (pollux-run --slurm starts one on the batch node)
        report["skipped"] = "needs etcd (Debian's etcd-server)"
        return
    if importlib.util.find_spec("sklearn") is None:  # (the digits worker's data set)
        report["skipped"] = "needs scikit-learn (the digits worker's data set)"
        return
    only = args.only or list(CASES)
    for key in ("first_step_s", "first_step_vs_srun_torchrun", "node_loss_pause_s",
                "requeue_to_step_s"):
        report[key] = None
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pollux-slurm-bench-") as tmp, \
            HostNet() as net:
        folder = Path(tmp)
        cluster = Cluster(net, [net.add_host("s1"), net.add_host("s2")], folder)
        try:
            if "first_step" in only:
                with report.case("first_step"):
                    measure_first_step(args, report, cluster, folder)
            if "requeue" in only:
                with report.case("requeue"):
                    measure_requeue(args, report, cluster, folder)
            if "node_loss" in only:  # (last: each repeat spends its Slurm)
                with report.case("node_loss"):
                    measure_node_loss(args, report, cluster, folder)
        finally:
            cluster.close()
    report["repeats"] = {"first_step": args.repeats, "node_loss": args.node_loss_repeats,
                         "requeue": args.requeue_repeats}
    report["total_s"] = round(time.monotonic() - t_all, 1)


def measure_first_step(args: argparse.Namespace, report: Report, cluster: Cluster,
                       folder: Path) -> None:
    pollux: list[float] = []
    torchrun: list[float] = []
    starts: dict[str, list[float]] = {"pollux": [], "torchrun": []}
    for i in range(args.repeats):
        for name, fn, out in (("pollux", first_step_pollux, pollux),
                              ("torchrun", first_step_torchrun, torchrun)):
            t0 = time.monotonic()
            got = fn(cluster.get(), folder / f"first-{i}", args.timeout)
            out.append(got["first_step_s"])
            starts[name].append(got["script_start_s"])
            _say(f"[first_step {i + 1}/{args.repeats}] {name}: first step "
                 f"{got['first_step_s']:.2f} s after sbatch, its batch script started at "
                 f"{got['script_start_s']:.2f} s ({time.monotonic() - t0:.0f} s)")
            report.check("first_step", got["ok"], f"the {name} job did not end as it should")
    report["first_step_s"] = _median(pollux)
    report["torchrun_first_step_s"] = _median(torchrun)
    report["first_step_all_s"] = {"pollux": [round(v, 2) for v in pollux],
                                  "torchrun": [round(v, 2) for v in torchrun]}
    # (Slurm's part, the same for both: sbatch to the batch script's first line; then the
    # launchers' own: from that line to the first step)
    report["sbatch_to_script_s"] = _median(starts["pollux"] + starts["torchrun"])
    report["script_to_first_step_s"] = {
        "pollux": _median([a - b for a, b in zip(pollux, starts["pollux"], strict=True)]),
        "torchrun": _median([a - b for a, b in zip(torchrun, starts["torchrun"],
                                                   strict=True)])}
    if pollux and torchrun:
        report["first_step_vs_srun_torchrun"] = round(
            statistics.median(pollux) / statistics.median(torchrun), 2)


def measure_requeue(args: argparse.Namespace, report: Report, cluster: Cluster,
                    folder: Path) -> None:
    runs = []
    for i in range(args.requeue_repeats):
        t0 = time.monotonic()
        got = requeue(cluster.get(), folder / f"requeue-{i}", args.timeout,
                      args.requeue_steps)
        runs.append(got)
        _say(f"[requeue {i + 1}/{args.requeue_repeats}] {json.dumps(_rounded(got))} "
             f"({time.monotonic() - t0:.0f} s)")
        report.check("requeue", got["job_ok"], "the requeued job did not succeed")
        report.check("requeue", got["resumed_ok"], "the requeued run did not resume at "
                                                   "the step after the last")
    report["requeue_to_step_s"] = _median([r["to_step_s"] for r in runs])
    starts = [r["run_start_to_step_s"] for r in runs if r["run_start_to_step_s"] is not None]
    waits = [r["restart_wait_s"] for r in runs if r["restart_wait_s"] is not None]
    report["requeue_run_start_to_step_s"] = _median(starts)
    report["requeue_restart_wait_s"] = _median(waits)
    report["requeue_signal_to_requeued_s"] = _median(
        [r["signal_to_requeued_s"] for r in runs if r["signal_to_requeued_s"] is not None])
    report["requeue_resumed_ok"] = all(r["resumed_ok"] for r in runs)


def measure_node_loss(args: argparse.Namespace, report: Report, cluster: Cluster,
                      folder: Path) -> None:
    runs = []
    for i in range(args.node_loss_repeats):
        t0 = time.monotonic()
        slurm = cluster.get()
        cluster.slurm = None  # spent: the next repeat (or case) starts a fresh one
        try:
            got = node_loss(slurm, folder / f"node-loss-{i}", args.timeout)
        finally:
            slurm.close()
        runs.append(got)
        _say(f"[node_loss {i + 1}/{args.node_loss_repeats}] {json.dumps(_rounded(got))} "
             f"({time.monotonic() - t0:.0f} s)")
        report.check("node_loss", got["job_ok"],
                     f"the job did not succeed after the node's loss: {got['verdict']}")
    report["node_loss_pause_s"] = _median([r["pause_s"] for r in runs])
    report["node_loss_job_ok"] = all(r["job_ok"] for r in runs)
    ends = [r["stop_to_end_s"] for r in runs if r["stop_to_end_s"] is not None]
    report["node_loss_stop_to_end_s"] = _median(ends)
    exits = [r["stop_to_batch_exit_s"] for r in runs]
    report["node_loss_batch_exited"] = all(e is not None for e in exits)


def _rounded(fields: dict) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in fields.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=CASES, help="cases to run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="first-step repeats (pollux and torchrun alternate)")
    parser.add_argument("--node-loss-repeats", type=int, default=2)
    parser.add_argument("--requeue-repeats", type=int, default=2)
    parser.add_argument("--requeue-steps", type=int, default=10,
                        help="rank 0's steps before the warning signal")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds to wait for each step awaited")
    # (SIGTERM and Ctrl-C end the run through the normal exits: Slurm and the hosts removed)
    return run_benchmark(parser, bench, smoke={"repeats": 1, "node_loss_repeats": 1,
                                               "requeue_repeats": 1, "requeue_steps": 3})


if __name__ == "__main__":
    sys.exit(main())
