"""Hostile inputs, tried for real: store values written into a live cluster, and bad
command lines given to ``pollux-run``.

    python benchmarks/hostile_inputs.py            # about 2 min

* ``store_values``: a real etcd, a coordinator and two node agents; a job trains while
  the adversarial table of ``tests/hostile.py`` and random hostile values (``--per-family``
  of each key family) are written; ``services_alive``: no service died;
  ``jobs_completed``: the job succeeded with all its epochs.
* ``cli_inputs``: every case of ``tests/launcher/test_bad_inputs.py`` run as a
  ``pollux-run`` process: ``one_line`` counts those that ended with exit code 2 and one
  line on stderr, ``tracebacks`` those that printed a traceback.

The LAST line printed is one JSON object: ``{"store_values": {"tried": N,
"services_alive": bool, "jobs_completed": bool}, "cli_inputs": {"tried": N,
"one_line": M, "tracebacks": T}}``; a service that died, a job that did not complete, a
traceback or a case that was not one line are named under ``"failed"``. ``--smoke``: the
first 3 command lines, 2 random values per family, a one-epoch job.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e"), str(ROOT / "tests" / "launcher")]

from cluster import POLLUX_RUN, Cluster  # noqa: E402  (tests/e2e/cluster.py)
from etcd_server import EtcdServer  # noqa: E402  (tests/etcd_server.py)
from harness import Report, run_benchmark  # noqa: E402  (beside this script)
from test_bad_inputs import CASES, _inputs  # noqa: E402
from test_hostile_store import fuzz  # noqa: E402


def store_values(folder: Path, per_family: int, epochs: int) -> dict:
    (folder / "etcd").mkdir(parents=True)
    etcd = EtcdServer(folder / "etcd").start()
    c = Cluster(etcd.url, folder)
    try:
        c.coordinator()
        c.agent("n1", 1)
        c.agent("n2", 1)
        c.wait(lambda: len(c.store.get_prefix("nodes/")) >= 2, 60, "two nodes")
        job = c.submit("victim", "-np", "2", "--min-np", "2", "--max-np", "2", target=0.0,
                       epochs=epochs)
        c.wait(lambda: sum(s["world"] == 2 for s in c.steps()) >= 10, 180, "training")
        tried = fuzz(c.store, "victim", seed=1, per_family=per_family)
        print(f"wrote {tried} hostile values; waiting for the job", flush=True)
        code = job.wait(timeout=600)
        alive = all(c.procs[n].poll() is None for n in ("coordinator", "agent-n1", "agent-n2"))
        agents = c.log("agent-n1") + c.log("agent-n2")
        finals = [ln for ln in agents.splitlines() if "final val_acc" in ln]
        done = code == 0 and len(finals) == 1 and float(finals[0].rsplit(" ", 1)[1]) >= epochs
        return {"tried": tried, "services_alive": alive, "jobs_completed": done}
    finally:
        c.close()
        etcd.stop()


def cli_inputs(folder: Path, cases: int | None) -> dict:
    one_line = tracebacks = 0
    for i, (argv, _) in enumerate(CASES[:cases]):
        cwd = folder / f"case{i}"
        cwd.mkdir(parents=True)
        _inputs(cwd)
        out = subprocess.run([POLLUX_RUN, *argv], cwd=cwd, capture_output=True, text=True,
                             timeout=120)
        one_line += out.returncode == 2 and out.stderr.count("\n") == 1
        tracebacks += "Traceback" in out.stderr
    return {"tried": len(CASES[:cases]), "one_line": one_line, "tracebacks": tracebacks}


def bench(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="pollux-hostile-") as tmp:
        with report.case("cli_inputs"):
            cli = report["cli_inputs"] = cli_inputs(Path(tmp) / "cli", args.cli_cases)
            print(f"cli inputs: {json.dumps(cli)}", flush=True)
            report.check("cli_inputs", not cli["tracebacks"],
                         f"{cli['tracebacks']} command lines printed a traceback")
            report.check("cli_inputs", cli["one_line"] == cli["tried"],
                         f"{cli['tried'] - cli['one_line']} of {cli['tried']} command lines "
                         "did not end with exit code 2 and one line")
        with report.case("store_values"):
            values = store_values(Path(tmp) / "store", args.per_family, args.epochs)
            report["store_values"] = values
            report.check("store_values", values["services_alive"], "a service died")
            report.check("store_values", values["jobs_completed"], "the job did not complete")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-family", type=int, default=20,
                        help="random values per key family")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the job")
    parser.add_argument("--cli-cases", type=int, default=None,
                        help="only the first N bad command lines (default: all)")
    return run_benchmark(parser, bench, smoke={"per_family": 2, "epochs": 1, "cli_cases": 3})


if __name__ == "__main__":
    sys.exit(main())
