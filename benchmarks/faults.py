"""Faults injected for real into a cluster of two hosts, and what each cost the job.

    python benchmarks/faults.py                    # every fault (about 25 min)
    python benchmarks/faults.py --only etcd_stall_20s worker_sigkill

Two hosts are network namespaces on a bridge (``tests/e2e/hosts.py``; root needed), each
running a ``pollux-run agent`` with one slot; one etcd and the coordinator run in the root
namespace, and the job (``tests/e2e/digits_worker.py``: the digits MLP with the native
adapter, ``--epochs`` statistical epochs) is launched from there with ``-np 2 --min-np 1
--max-np 2 --checkpoint-dir DIR --checkpoint-interval 5``. For each fault, on a fresh
etcd:

* ``survived``: the launcher exited 0 with ``succeeded``, rank 0 ended the job once with
  every epoch trained, every service not killed on purpose is alive, and no worker
  process is left;
* ``resume_s``: the longest pause of training (gap between rank 0's steps) from the
  fault's injection until 60 s after it was lifted;
* ``epochs_lost``: data epochs trained twice (rank 0's epoch falling back after a
  restart, which resumes from the newest checkpoint).

The LAST line printed is one JSON object:
``{"faults": {name: {"survived": bool, "resume_s": float, "epochs_lost": int}}, "hosts": 2}``,
with ``"failed": {name: why}`` for each fault not survived (or that could not be run).
``--smoke``: the faults of ``SMOKE`` on a two-epoch job.

A new fault is one function ``inject(run)`` (it returns once the fault is lifted) and one
entry in ``FAULTS``: the nodes up at the start, and that function. A *scenario* brings a
job of its own (``SCENARIOS``: a rank that exits early, 200 worker starts) and returns the
same three figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # the tests' harness

from cluster import WORKER, Cluster  # noqa: E402  (tests/e2e/cluster.py)
from etcd_server import EtcdServer  # noqa: E402  (tests/etcd_server.py)
from harness import Report, run_benchmark  # noqa: E402  (beside this script)
from hosts import HostNet, netns_available  # noqa: E402  (tests/e2e/hosts.py)

from pollux_launch import keys  # noqa: E402

JOB = "faulty"


class Run:
    """One fault's cluster: etcd, coordinator, node agents on the hosts, the job."""

    def __init__(self, net: HostNet, hosts: dict, folder: Path, epochs: int) -> None:
        self.hosts, self.epochs = hosts, epochs
        (folder / "etcd").mkdir(parents=True)
        self.etcd = EtcdServer(folder / "etcd", host=net.gateway).start()
        self.cluster = Cluster(self.etcd.url, folder)
        self.killed: set[str] = set()  # services killed on purpose and not restarted

    def agent(self, node: str) -> None:
        self.cluster.agent(node, 1, host=self.hosts[node])

    def close(self) -> None:
        self.cluster.close()
        self.etcd.stop()


# -- the faults: each gets a Run whose job trains, injects, and returns when it is lifted --

def stall(seconds: float) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        run.etcd.pause()
        time.sleep(seconds)
        run.etcd.resume()
    return inject


def etcd_restart(run: Run) -> None:
    run.etcd.kill()
    time.sleep(5)
    run.etcd.start()


def coordinator_kill_during_change(run: Run) -> None:
    c = run.cluster
    run.agent("n2")  # the job may grow: kill the coordinator as it writes the change
    c.wait(lambda: len(c.allocation(JOB)) == 2, 120, "the grow allocation")
    c.procs["coordinator"].kill()
    c.procs["coordinator"].wait()
    time.sleep(5)
    c.coordinator()


def agent_kill_one_of_two(run: Run) -> None:
    run.cluster.procs["agent-n2"].kill()  # the host is lost, its worker with it
    run.killed.add("agent-n2")


def agent_kill_only_node(run: Run) -> None:
    c = run.cluster
    c.procs["agent-n1"].kill()
    c.procs["agent-n1"].wait()
    time.sleep(3)
    run.agent("n1")  # restarted, as systemd would


def worker_sigkill(run: Run) -> None:
    c = run.cluster
    victim = max((s for s in c.steps() if s["node"] == "n2"), key=lambda s: s["t"])
    os.kill(victim["pid"], signal.SIGKILL)


def host_partition(run: Run) -> None:
    host = run.hosts["n2"]  # drops off the network without a word for 30 s, then returns
    host.run(["ip", "link", "set", host.ifname, "down"], check=True)
    time.sleep(30)
    host.run(["ip", "link", "set", host.ifname, "up"], check=True)


def newcomer_etcd_stall(run: Run) -> None:
    """etcd stalls for 20 s just as a grow's newcomer starts: it cannot even open the
    store (it must wait for it, and never fail the job)."""
    c = run.cluster
    run.agent("n2")
    c.wait(lambda: len(c.allocation(JOB)) == 2, 120, "the grow allocation")
    c.wait(lambda: sum(p.cmdline()[1:2] == [WORKER] for p in c.workers_left()) == 2, 60,
           "the newcomer's process")
    stall(20)(run)


def etcd_wiped(run: Run) -> None:
    run.etcd.wipe()  # an empty etcd in its place: every key, lease and revision gone


def agent_restart_then_shrink(run: Run) -> None:
    """n2's agent gets SIGTERM (its worker drains) and is restarted, and a second job
    takes a slot at once, so the job shrinks while n2's fresh replica holds no state."""
    c = run.cluster
    c.procs["agent-n2"].send_signal(signal.SIGTERM)
    c.procs["agent-n2"].wait(timeout=60)
    run.agent("n2")
    (c.tmp / "sleep.py").write_text("import time\ntime.sleep(20)\n")
    blocker = c.start("a-blocker", "--store", c.url, "--job-name", "a-blocker", "-np", "1",
                      sys.executable, str(c.tmp / "sleep.py"))
    run.killed.add("a-blocker")  # (a job's launcher: it ends with its job)
    if blocker.wait(timeout=300) != 0:
        raise AssertionError(f"the second job failed: {c.log('a-blocker')[-500:]}")


def leader_overwrite(run: Run) -> None:
    c = run.cluster
    c.store.put(keys.LEADER, json.dumps("somebody-else"))  # held by no lease
    c.wait(lambda: (kv := c.store.get(keys.LEADER)) is not None and kv.lease != 0, 60,
           "a coordinator leading again")


# name -> (nodes up at the start, inject)
FAULTS: dict[str, tuple[tuple[str, ...], Callable[[Run], None]]] = {
    "etcd_stall_20s": (("n1", "n2"), stall(20)),
    "etcd_stall_40s": (("n1", "n2"), stall(40)),
    "etcd_restart": (("n1", "n2"), etcd_restart),
    "coordinator_kill_during_change": (("n1",), coordinator_kill_during_change),
    "node_agent_kill_one_of_two": (("n1", "n2"), agent_kill_one_of_two),
    "node_agent_kill_only_node": (("n1",), agent_kill_only_node),
    "worker_sigkill": (("n1", "n2"), worker_sigkill),
    "host_partition_30s": (("n1", "n2"), host_partition),
    "leader_overwrite": (("n1", "n2"), leader_overwrite),
    "newcomer_etcd_stall_20s": (("n1",), newcomer_etcd_stall),
    "etcd_wiped": (("n1", "n2"), etcd_wiped),
    "agent_restart_then_shrink": (("n1", "n2"), agent_restart_then_shrink),
}
SMOKE = ("worker_sigkill",)  # --smoke: what every fault shares, in a few seconds


# -- scenarios with a job of their own: each returns the same figures as ``measure`` -----

SAVE = """import os, sys, time
if int(os.environ["RANK"]) == 0:  # rank 0 saves its model for 20 s; rank 1 is done at once
    time.sleep(20)
    with open(sys.argv[1], "w") as f:
        f.write("saved")
"""


def early_exiting_rank(run: Run) -> dict:
    """A torchrun-style job on both nodes whose rank 1 exits 0 at once while rank 0 saves
    its model for 20 s: it succeeds only after that, with the model saved and nothing
    killed (``resume_s``: 0, nothing pauses; ``epochs_lost``: 1 if the model is lost)."""
    c = run.cluster
    for node in ("n1", "n2"):
        run.agent(node)
    c.wait(lambda: len(c.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
    (c.tmp / "save.py").write_text(SAVE)
    model = c.tmp / "model.pt"
    job = c.start("early", "--store", c.url, "--job-name", "early", "--nproc-per-node", "1",
                  "--nnodes", "2", "save.py", str(model))
    code = job.wait(timeout=300)
    agents = c.log("agent-n1") + c.log("agent-n2")
    status = c.status("early")
    return _verdict({
        f"exit code {code}": code == 0,
        f"status {status}": status is not None and status.state == "succeeded",
        "the model was not saved": model.exists(),
        "a worker was stopped": "exited -15" not in agents,
    }, 0.0, 0 if model.exists() else 1)


def worker_starts_200(run: Run) -> dict:
    """200 worker starts from one node agent, whose etcd client's gRPC threads run all
    along: a group that fails (exit 3) and is restarted 199 times (``--max-restarts``).
    Survived: every start ran the command (200 exits of 3: none aborted in the fork
    child), the job failed with its code after the last restart, the agent lives on.
    ``resume_s``: the median time from one start's exit to the next start's."""
    c = run.cluster
    run.agent("n1")
    c.wait(lambda: c.store.get(keys.node("n1")), 60, "n1 registered")
    job = c.start("flood", "--store", c.url, "--job-name", "flood", "--nproc-per-node", "1",
                  "--max-restarts", "199", "--no-python", "/bin/sh", "-c", "exit 3")
    code = job.wait(timeout=900)
    exits = [line for line in c.log("agent-n1").splitlines() if "job flood process" in line]
    codes = [int(line.split(" exited ")[1].split()[0]) for line in exits]
    stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
              for line in exits]
    cycle = sorted(b - a for a, b in itertools.pairwise(stamps))
    return _verdict({
        f"exit code {code}": code == 3,
        f"{len(codes)} starts ended": len(codes) == 200,
        f"aborted: {[k for k in codes if k != 3][:5]}": all(k == 3 for k in codes),
        "the agent died": c.procs["agent-n1"].poll() is None,
    }, round(cycle[len(cycle) // 2], 3) if cycle else None, 0)


def _verdict(checks: dict[str, bool], resume: float | None, lost: int) -> dict:
    why = "; ".join(k for k, ok in checks.items() if not ok)
    return {"survived": not why, "resume_s": resume, "epochs_lost": lost,
            **({"why": why} if why else {})}


SCENARIOS: dict[str, Callable[[Run], dict]] = {
    "early_exiting_rank": early_exiting_rank,
    "worker_starts_200": worker_starts_200,
}


def measure_scenario(name: str, net: HostNet, hosts: dict, folder: Path) -> dict:
    run = Run(net, hosts, folder, 0)
    try:
        run.cluster.coordinator()
        return SCENARIOS[name](run)
    except AssertionError as exc:  # a wait timed out
        return {"survived": False, "resume_s": None, "epochs_lost": 0,
                "why": str(exc).splitlines()[0]}
    finally:
        run.close()


def measure(name: str, net: HostNet, hosts: dict, folder: Path, epochs: int) -> dict:
    nodes, inject = FAULTS[name]
    run = Run(net, hosts, folder, epochs)
    c = run.cluster
    why = ""
    try:
        c.coordinator()
        for node in nodes:
            run.agent(node)
        job = c.submit(JOB, "-np", "2", "--min-np", "1", "--max-np", "2",
                       "--checkpoint-dir", str(folder / "checkpoints"),
                       "--checkpoint-interval", "5", target=0.0, epochs=epochs)
        # a whole epoch first, so that a restart from scratch shows as epochs lost
        c.wait(lambda: any(s["rank"] == 0 and s["epoch"] >= 1 for s in c.steps()), 180,
               "an epoch trained")
        t_fault = time.time()
        inject(run)
        t_lifted = time.time()
        code = job.wait(timeout=600)
        rank0 = sorted(s["t"] for s in c.steps() if s["rank"] == 0)
        window = [t_fault, *(t for t in rank0 if t_fault < t < t_lifted + 60)]
        resume = max((b - a for a, b in itertools.pairwise(window)), default=0.0)
        agents = "".join(c.log(n) for n in c.procs if n.startswith("agent-"))
        finals = [line for line in agents.splitlines() if "final val_acc" in line]
        alive = [n for n, p in c.procs.items()
                 if n != JOB and n not in run.killed and p.poll() is not None]
        status = c.status(JOB)
        c.wait(lambda: not c.workers_left(), 30, "workers to end")
        checks = {
            f"exit code {code}": code == 0,
            f"status {status}": status is not None and status.state == "succeeded",
            f"rank 0 ended {len(finals)} times": len(finals) == 1,
            "not every epoch trained": bool(finals)
            and float(finals[-1].rsplit(" ", 1)[1]) >= epochs,
            f"services died: {alive}": not alive,
        }
        why = "; ".join(k for k, ok in checks.items() if not ok)
        return {"survived": not why, "resume_s": round(resume, 2),
                "epochs_lost": c.epochs_lost(), **({"why": why} if why else {})}
    except AssertionError as exc:  # a wait timed out: the fault was not survived
        return {"survived": False, "resume_s": None, "epochs_lost": c.epochs_lost(),
                "why": str(exc).splitlines()[0]}
    finally:
        run.close()


def bench(args: argparse.Namespace, report: Report) -> None:
    if not netns_available():
        report.fail("hosts", "needs root and network namespaces (ip netns) for the two hosts")
        return
    names = args.only or [*FAULTS, *SCENARIOS]
    out: dict[str, dict] = report.setdefault("faults", {})
    with tempfile.TemporaryDirectory(prefix="pollux-faults-") as tmp, HostNet() as net:
        hosts = {"n1": net.add_host("h1"), "n2": net.add_host("h2")}
        report["hosts"] = len(hosts)
        for i, name in enumerate(names):
            t0 = time.monotonic()
            with report.case(name):
                out[name] = (measure_scenario(name, net, hosts, Path(tmp) / name)
                             if name in SCENARIOS else
                             measure(name, net, hosts, Path(tmp) / name, args.epochs))
                print(f"[{i + 1}/{len(names)}] {name}: {json.dumps(out[name])} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
                report.check(name, out[name]["survived"], out[name].get("why", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted([*FAULTS, *SCENARIOS]),
                        help="faults to run")
    parser.add_argument("--epochs", type=int, default=6, help="statistical epochs per job")
    # (SIGTERM and Ctrl-C end the run through the normal exits: hosts and services removed)
    return run_benchmark(parser, bench, smoke={"only": list(SMOKE), "epochs": 2})


if __name__ == "__main__":
    sys.exit(main())
