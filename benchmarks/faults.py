"""Faults injected for real into a cluster of two hosts, and what each cost the job.

    python benchmarks/faults.py                    # every fault (about 12 min)
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
entry in ``FAULTS``: the nodes up at the start, and that function.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # the tests' harness

from cluster import Cluster  # noqa: E402  (tests/e2e/cluster.py)
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
}
SMOKE = ("worker_sigkill",)  # --smoke: what every fault shares, in a few seconds


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
    names = args.only or list(FAULTS)
    out: dict[str, dict] = report.setdefault("faults", {})
    with tempfile.TemporaryDirectory(prefix="pollux-faults-") as tmp, HostNet() as net:
        hosts = {"n1": net.add_host("h1"), "n2": net.add_host("h2")}
        report["hosts"] = len(hosts)
        for i, name in enumerate(names):
            t0 = time.monotonic()
            with report.case(name):
                out[name] = measure(name, net, hosts, Path(tmp) / name, args.epochs)
                print(f"[{i + 1}/{len(names)}] {name}: {json.dumps(out[name])} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
                report.check(name, out[name]["survived"], out[name].get("why", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FAULTS), help="faults to run")
    parser.add_argument("--epochs", type=int, default=6, help="statistical epochs per job")
    # (SIGTERM and Ctrl-C end the run through the normal exits: hosts and services removed)
    return run_benchmark(parser, bench, smoke={"only": list(SMOKE), "epochs": 2})


if __name__ == "__main__":
    sys.exit(main())
