"""Durable state: what background checkpoints cost a step, and what a total loss costs a job.

    python benchmarks/checkpoint.py [--interval 3] [--frameworks torch deepspeed]

* ``overhead_pct``: in one process, side by side in alternating blocks, the torch trainer
  (one compute thread) on an MLP of ~4.2 M parameters (a 32 MB checkpoint with its
  momentum) with a checkpoint every ``--overhead-interval`` seconds (5) against the same
  trainer without; the mean step time's increase (goal: <= 1 %). The snapshot (a copy,
  ``snapshot_s``) is taken on the training thread, the write (``write_s``) runs in the
  background.
* For each framework (torch, DeepSpeed ZeRO-1): a real etcd, a coordinator and one node
  agent with 2 slots run a 2-replica digits job (``checkpoint_worker.py``) with
  ``--checkpoint-dir`` and ``--checkpoint-interval``; once a checkpoint exists, every
  worker of the job is SIGKILLed at once. The agent starts them again, the job resumes
  from the newest checkpoint and must finish. ``resume_s``: from the kill to the first
  step after it; ``epochs_lost_on_total_loss``: the steps trained twice (rank 0's step
  count falling back), in epochs; ``interval_epochs``: one checkpoint interval of
  training in epochs (goal: lost <= one interval). Horovod (``examples/horovod_elastic.py``
  with pollux's ``TorchState``): its driver cannot go on once every worker died, so the
  job is relaunched at once with the same ``--checkpoint-dir``, as a batch system would
  (``relaunched``); work lost is counted in samples. The top-level figures are the worst
  over the frameworks.

The LAST line printed is one JSON object: ``{"overhead_pct", "write_s", "resume_s",
"epochs_lost_on_total_loss", "frameworks": {"torch", "deepspeed", "horovod"}, ...}``, with
``"failed": {"total_loss_<framework>": why, ...}`` when a case failed. ``--smoke``: short
blocks, a one-epoch job per framework, a 1 s interval.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # the tests' harness

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cluster import Cluster, read_jsonl  # noqa: E402  (tests/e2e/cluster.py)
from etcd_server import EtcdServer  # noqa: E402  (tests/etcd_server.py)
from harness import Report, run_benchmark  # noqa: E402  (beside this script)
from torch.utils.data import TensorDataset  # noqa: E402

WORKER = ROOT / "benchmarks" / "checkpoint_worker.py"
STEPS_PER_EPOCH = 1257 // 32 + 1  # digits' training split at batch 32 (examples/digits.py)


def overhead(seconds: float, blocks: int, interval: float) -> dict:
    import pollux_launch.adapters.torch as pollux

    os.environ.pop("POLLUX_JOB", None)  # a standalone trainer
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1024), torch.randint(0, 10, (4096,)))

    def trainer(folder: str | None):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                                    torch.nn.Linear(2048, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loader = pollux.AdaptiveDataLoader(data, batch_size=32)
        return pollux.ElasticTrainer(model, opt, loader, checkpoint_dir=folder,
                                     checkpoint_interval=interval)

    def block(t) -> list[float]:
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            for x, y in t.loader:
                t0 = time.perf_counter()
                t.step(F.cross_entropy(t.model(x), y))
                times.append(time.perf_counter() - t0)
                if time.monotonic() >= end:
                    break
        return times

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # training on one core, as beside a GPU: the writer gets one
    writes: list[float] = []
    snaps: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            plain, ckpt = trainer(None), trainer(folder)
            block(plain), block(ckpt)  # warm-up
            ratios, steps = [], []
            for i in range(blocks):  # side by side in pairs, ABBA (order effects cancel)
                print(f"  overhead block {i + 1}/{blocks}", file=sys.stderr, flush=True)
                done = ckpt.checkpoints.saved
                if i % 2:
                    b = block(ckpt)
                    ckpt.checkpoints.flush()  # (its write must not spill into plain's block)
                    a = block(plain)
                else:
                    a = block(plain)
                    b = block(ckpt)
                    ckpt.checkpoints.flush()
                if ckpt.checkpoints.saved > done:
                    writes.append(ckpt.checkpoints.write_s)
                    snaps.append(ckpt.checkpoints.snapshot_s)
                ratios.append(statistics.mean(b) / statistics.mean(a))
                steps.append(statistics.mean(a))
            saved = ckpt.checkpoints.saved
            size = sum(f.stat().st_size for f in Path(folder).rglob("state.pt")) / max(
                1, len(list(Path(folder).glob("ckpt-*"))))
    finally:
        torch.set_num_threads(threads)
    return {"overhead_pct": round(100 * (statistics.mean(ratios) - 1), 2),
            "overhead_interval_s": interval,
            "write_s": round(statistics.mean(writes), 3) if writes else None,
            "snapshot_s": round(statistics.mean(snaps), 4) if snaps else None,
            "checkpoints_written": saved, "checkpoint_mb": round(size / 2**20, 1),
            "step_s": round(statistics.median(steps), 4)}


def kill_all(pids: set[int], interval: float) -> float:
    """SIGKILL every worker at once, somewhere inside a checkpoint interval; the time."""
    time.sleep(interval * 0.6)
    t_kill = time.time()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return t_kill


def total_loss(framework: str, folder: Path, interval: float, epochs: float) -> dict:
    (folder / "etcd").mkdir(parents=True)
    etcd = EtcdServer(folder / "etcd").start()
    c = Cluster(etcd.url, folder)
    ckpt = folder / "checkpoints"
    try:
        c.coordinator()
        c.agent("n1", 2)
        job = c.start("job", "--store", etcd.url, "--job-name", f"ckpt-{framework}",
                      "--framework", framework, "-np", "2", "--min-np", "2", "--max-np", "2",
                      "--checkpoint-dir", str(ckpt), "--checkpoint-interval", str(interval),
                      sys.executable, str(WORKER), "--framework", framework,
                      "--epochs", str(epochs))
        steps = lambda: [s for s in read_jsonl(folder / "logs") if s["rank"] == 0]  # noqa: E731

        def trained() -> bool:
            if job.poll() is not None:  # (not 10 minutes of waiting for a dead job)
                raise RuntimeError(f"ended with exit code {job.returncode} before the kill: "
                                   + last_error(folder / "job.log"))
            return (ckpt / "latest").exists() and len(steps()) > 2 * STEPS_PER_EPOCH / 3

        c.wait(trained, 600, f"{framework}: training with a checkpoint written")
        pids = {s["pid"] for s in read_jsonl(folder / "logs")}
        t_kill = kill_all(pids, interval)
        print(f"  {framework}: killed {len(pids)} workers", file=sys.stderr, flush=True)
        code = job.wait(timeout=900)
        rank0 = sorted(steps(), key=lambda s: s["t"])
        before = [s for s in rank0 if s["t"] < t_kill]
        after = [s for s in rank0 if s["t"] > t_kill]
        if code != 0 or not after:
            return {"ok": False, "why": f"exit code {code}, {len(after)} steps after the kill: "
                                        + last_error(folder / "job.log")}
        lost = before[-1]["step"] - after[0]["step"] + 1
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(before)]
        step_s = statistics.median(gaps)
        return {"ok": True, "resume_s": round(after[0]["t"] - t_kill, 2),
                "steps_lost": lost, "epochs_lost": round(lost / STEPS_PER_EPOCH, 3),
                "interval_epochs": round(interval / step_s / STEPS_PER_EPOCH, 3),
                "workers_replaced": not pids & {s["pid"] for s in read_jsonl(folder / "logs")
                                                 if s["t"] > t_kill}}
    finally:
        c.close()
        etcd.stop()


def last_error(log: Path) -> str:
    """The last line of a job's output naming an error (a worker's, before the launcher's
    own "failed" line), else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for word in ("error", "failed"):
        if found := [ln for ln in lines if word in ln.lower()]:
            return found[-1][:200]
    return (lines or ["no output"])[-1][:200]


HOROVOD_EXAMPLE = ROOT / "examples" / "horovod_elastic.py"
DIGITS = 1797  # samples in the Horovod example's data set (all of scikit-learn's digits)


def _hvd_steps(folder: Path) -> list[dict]:
    return [r for r in read_jsonl(folder, "worker-*.jsonl") if r["event"] == "step"]


def total_loss_horovod(folder: Path, interval: float) -> dict:
    """Horovod's driver cannot go on once every worker died, so the job is relaunched with
    the same ``--checkpoint-dir`` (as a batch system would) and resumes there."""
    from pollux_launch.elastic.checkpoint import latest_checkpoint

    ckpt = folder / "checkpoints"

    def launch(name: str, epochs: int) -> subprocess.Popen:
        out = open(folder / f"{name}.out", "w")
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("pollux-run")), "--store",
             f"embedded://{folder / name}.db", "--job-name", name, "-np", "2",
             "--checkpoint-dir", str(ckpt), "--checkpoint-interval", str(interval),
             sys.executable, str(HOROVOD_EXAMPLE), "--epochs", str(epochs), "--step-sleep",
             "0.05", "--commit-every", "5", "--log-dir", str(folder / name)],
            cwd=folder, stdout=out, stderr=subprocess.STDOUT)

    folder.mkdir(parents=True)
    first = launch("first", 1000)
    try:
        deadline = time.monotonic() + 600
        while not ((ckpt / "latest").exists() and len(_hvd_steps(folder / "first")) > 100):
            if time.monotonic() > deadline or first.poll() is not None:
                return {"ok": False, "why": "never trained with a checkpoint written"}
            time.sleep(0.5)
        before = _hvd_steps(folder / "first")
        t_kill = kill_all({s["pid"] for s in before}, interval)
        before = [s for s in _hvd_steps(folder / "first") if s["t"] < t_kill]
        first.wait(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    saved = latest_checkpoint(ckpt)
    second = launch("second", int(saved.state["values"]["epoch"]) + 1)
    code = second.wait(timeout=600)
    after = sorted(_hvd_steps(folder / "second"), key=lambda s: s["t"])
    if code != 0 or not after:
        return {"ok": False, "why": f"relaunch exit code {code}"}
    rank0 = sorted((s for s in before if s["rank"] == 0), key=lambda s: s["t"])
    resumed_at = after[0]["step"] - 1
    lost = [s for s in rank0 if s["step"] > resumed_at]
    samples = sum(s["batch"] * s["size"] for s in lost)
    recent = rank0[-min(50, len(rank0)):]
    rate = sum(s["batch"] * s["size"] for s in recent[1:]) / (recent[-1]["t"] - recent[0]["t"])
    return {"ok": True, "relaunched": True, "resume_s": round(after[0]["t"] - t_kill, 2),
            "steps_lost": len(lost), "epochs_lost": round(samples / DIGITS, 3),
            "interval_epochs": round(interval * rate / DIGITS, 3)}


def bench(args: argparse.Namespace, report: Report) -> None:
    print("overhead of background checkpoints (torch trainer)", file=sys.stderr, flush=True)
    with report.case("overhead"):
        report.update(overhead(args.block, args.blocks, args.overhead_interval))
        print(f"  {dict(report)}", file=sys.stderr, flush=True)
    per: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pollux-ckpt-bench-") as tmp:
        for fw in args.frameworks:
            print(f"total loss of a {fw} job", file=sys.stderr, flush=True)
            with report.case(f"total_loss_{fw}"):
                if fw == "horovod":
                    per[fw] = total_loss_horovod(Path(tmp) / fw, args.interval)
                else:
                    per[fw] = total_loss(fw, Path(tmp) / fw, args.interval, args.epochs)
                print(f"  {fw}: {per[fw]}", file=sys.stderr, flush=True)
                report.check(f"total_loss_{fw}", per[fw]["ok"], per[fw].get("why", ""))
    ok = [r for r in per.values() if r["ok"]]
    report.update({
        "resume_s": max((r["resume_s"] for r in ok), default=None),
        "epochs_lost_on_total_loss": max((r["epochs_lost"] for r in ok), default=None),
        "frameworks": {fw: per.get(fw, {}).get("ok", False)
                       for fw in ("torch", "deepspeed", "horovod")},
        "per_framework": per, "interval_s": args.interval,
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=3.0,
                        help="checkpoint interval of the jobs (seconds)")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--block", type=float, default=10.0,
                        help="seconds per overhead block")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--overhead-interval", type=float, default=5.0,
                        help="checkpoint interval while the overhead is measured (seconds)")
    parser.add_argument("--frameworks", nargs="+", default=["torch", "deepspeed", "horovod"],
                        choices=("torch", "deepspeed", "horovod"))
    return run_benchmark(parser, bench, smoke={"interval": 1.0, "epochs": 1.0, "block": 0.5,
                                               "blocks": 2, "overhead_interval": 0.2})


if __name__ == "__main__":
    sys.exit(main())
