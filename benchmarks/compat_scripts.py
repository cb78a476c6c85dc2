"""Other people's scripts, unchanged: each under its own launcher and under ``pollux-run``,
side by side - wall time, exit code and final loss.

    python benchmarks/compat_scripts.py [--repeats 3] [--cases ddp,horovod,deepspeed,hf]

The scripts are tests/compat's (they never import pollux_launch): ``torchrun_ddp.py``
(pytorch/examples' DDP tutorial's shape) under ``torchrun --standalone``,
``horovod_elastic.py`` (Horovod's elastic PyTorch example's shape) under ``horovodrun
--gloo``, ``deepspeed_cifar.py`` (DeepSpeedExamples' CIFAR-10 script's shape) under the
``deepspeed`` launcher, and ``hf_trainer_clm.py`` (a Hugging Face ``Trainer`` on a tiny
random GPT-2) under ``torchrun``; each also under ``pollux-run -np 2`` (local mode, fixed size,
its own embedded store). Two replicas each, CPU, gloo, runs interleaved ``--repeats``
times; a script that writes no result counts as failed (named in ``failed``).

The LAST line printed is one JSON object: per case ``{"launcher": name, "launcher_s",
"pollux_s", "ratio", "launcher_rc", "pollux_rc", "launcher_loss", "pollux_loss"}``
(wall times: medians, seconds; losses: the last run's final loss, HF's its eval loss).
``--smoke``: the DDP script alone, one epoch, one repeat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Report, UsageError, run_benchmark

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "tests" / "compat"
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def _cases(epochs: int) -> dict[str, tuple[str, list[str], list[str]]]:
    """name -> (launcher, its argv before the script's, the script's argv)."""
    e = str(epochs)
    return {
        "ddp": ("torchrun", [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
                [str(COMPAT / "torchrun_ddp.py"), "--epochs", e]),
        "horovod": ("horovodrun", [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H",
                                   "localhost:2", PYTHON],
                    [str(COMPAT / "horovod_elastic.py"), "--epochs", e]),
        "deepspeed": ("deepspeed", [str(BIN / "deepspeed"), "--num_gpus", "2"],
                      [str(COMPAT / "deepspeed_cifar.py"), "--epochs", e,
                       "--deepspeed_config", str(COMPAT / "ds_config.json")]),
        "hf": ("torchrun", [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
               [str(COMPAT / "hf_trainer_clm.py"), "--epochs", e, "--output-dir", "out"]),
    }


def _env() -> dict[str, str]:
    """As from a shell with the venv activated (tests/compat/test_compat.py's reasons)."""
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(  # (one DeepSpeed op build)
        Path.home() / ".cache" / "pollux-launch" / "compat-torch-extensions"
        / hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
         "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extensions,
         "PATH": os.pathsep.join([str(BIN), os.environ["PATH"]])}
    for name in ("POLLUX_STORE", "POLLUX_STORE_PREFIX", "POLLUX_JOB"):
        e.pop(name, None)
    return e


def _run(argv: list[str], cwd: Path, timeout: float) -> tuple[int, float, float | None, str]:
    """(exit code, wall seconds, final loss or None, output's tail)."""
    result = cwd / "result.json"
    start = time.monotonic()
    done = subprocess.run([*argv, "--result", str(result)], cwd=cwd, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    seconds = time.monotonic() - start
    loss = None
    if result.exists():
        got = json.loads(result.read_text())
        loss = got.get("final_loss", got.get("eval_loss"))  # (HF's script: its eval loss)
    return done.returncode, seconds, loss, done.stdout[-2000:]


def bench(args: argparse.Namespace, report: Report) -> None:
    cases = _cases(args.epochs)
    chosen = [c for c in args.cases.split(",") if c]
    unknown = [c for c in chosen if c not in cases]
    if unknown or not chosen:
        raise UsageError(f"--cases: choose from {', '.join(cases)}")
    pollux = [str(BIN / "pollux-run"), "--elasticity", "fixed", "-np", "2"]
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        for name in chosen:
            if not Path(cases[name][2][0]).exists():
                report.fail(name, f"{cases[name][2][0]} is missing")
                continue
            with report.case(name):
                launcher, head, script = cases[name]
                work = Path(tmp) / name
                work.mkdir()
                times: dict[str, list[float]] = {"launcher": [], "pollux": []}
                got: dict[str, tuple[int, float | None]] = {}
                for i in range(args.repeats):
                    for side in (("launcher", "pollux") if i % 2 == 0
                                 else ("pollux", "launcher")):
                        # (a folder per run: the scripts resume from what they find)
                        here = work / f"{side}-{i}"
                        here.mkdir()
                        argv = [*head, *script] if side == "launcher" else [
                            *pollux, "--store", f"embedded://{here}/store.db",
                            "--job-name", f"{name}-{i}", PYTHON, *script]
                        rc, seconds, loss, tail = _run(argv, here, args.timeout)
                        print(f"{name} {side}: exit {rc}, {seconds:.1f} s, loss {loss}",
                              file=sys.stderr, flush=True)
                        report.check(name, rc == 0 and loss is not None,
                                     f"{side} exit {rc}, no result: {tail[-300:]}")
                        times[side].append(seconds)
                        got[side] = (rc, loss)
                lo, po = (statistics.median(times[s]) for s in ("launcher", "pollux"))
                report[name] = {
                    "launcher": launcher, "launcher_s": round(lo, 2),
                    "pollux_s": round(po, 2), "ratio": round(po / lo, 3),
                    "launcher_rc": got["launcher"][0], "pollux_rc": got["pollux"][0],
                    "launcher_loss": got["launcher"][1], "pollux_loss": got["pollux"][1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="ddp,horovod,deepspeed,hf",
                        help="comma-separated: ddp, horovod, deepspeed, hf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    return run_benchmark(parser, bench, smoke={"cases": "ddp", "repeats": 1, "epochs": 1})


if __name__ == "__main__":
    sys.exit(main())
