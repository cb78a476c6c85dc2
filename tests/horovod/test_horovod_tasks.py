"""Horovod workers started by node agents (no Horovod needed): what a node takes from a
task, and the store path between a launcher's StoreExec and a real node agent."""

import shlex
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from pollux_launch import keys
from pollux_launch.adapters.horovod.launch.tasks import StoreExec, split_command, task_variables
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, WorkerTask, encode
from pollux_launch.rendezvous.store import open_store

COMMAND = ("/venv/bin/python", "train script.py", "--lr", "0.1")


def horovod_line(**env: str) -> str:
    """The worker command line as Horovod 0.28.1's gloo launcher writes it."""
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"env {assigns} {' '.join(shlex.quote(a) for a in COMMAND)}"


def test_split_recovers_the_variables_and_checks_the_command():
    line = horovod_line(HOROVOD_RANK="1", HOROVOD_HOSTNAME="n2", PYTHONUNBUFFERED="1",
                        LD_PRELOAD="/tmp/evil.so", HOROVOD_GLOO_IFACE="eth0")
    env = split_command(line, COMMAND)
    assert env["HOROVOD_RANK"] == "1" and env["LD_PRELOAD"] == "/tmp/evil.so"
    assert task_variables(env) == {"HOROVOD_RANK": "1", "HOROVOD_HOSTNAME": "n2",
                                   "HOROVOD_GLOO_IFACE": "eth0"}


@pytest.mark.parametrize("line", [
    "env HOROVOD_RANK=0 /bin/sh -c 'rm -rf /'",  # not the job's command
    "env HOROVOD_RANK=0 stray /venv/bin/python 'train script.py' --lr 0.1",
])
def test_split_refuses_other_commands(line):
    with pytest.raises(ValueError):
        split_command(line, COMMAND)


# -- the store path between a launcher's StoreExec and a node agent's HorovodTaskDriver --

@pytest.fixture
def node(tmp_path):
    """A real store and a real node agent ``n1`` running a Horovod job's tasks."""
    url = f"embedded://{tmp_path / 'store.db'}"
    store = open_store(url)
    script = tmp_path / "task.py"
    script.write_text("import os, sys, time\n"
                      "print('rank', os.environ['HOROVOD_RANK'], flush=True)\n"
                      "time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))\n")
    agent = NodeAgent(store, NodeInfo("n1", 2), url, only_jobs=None, poll=0.1)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()

    def submit(name: str, *args: str) -> tuple[str, ...]:
        command = (sys.executable, str(script), *args)
        spec = JobSpec(name, command, framework="horovod", workdir=str(tmp_path))
        store.put(keys.job(name, "spec"), encode(spec))
        store.put(keys.job(name, "allocation"), encode(Allocation(1, ("n1",))))
        return command

    yield SimpleNamespace(store=store, agent=agent, submit=submit)
    stop.set()
    thread.join(timeout=30)
    store.close()


def slot(rank: int = 0):  # what Horovod's driver passes: host name, ranks
    return SimpleNamespace(hostname="n1", rank=rank, local_rank=rank)


def horovod_text(command, rank: int = 0) -> str:
    """Horovod's command line for one worker (as ``horovod_line``, for ``command``)."""
    return f"env HOROVOD_RANK={rank} HOROVOD_SIZE=1 PYTHONUNBUFFERED=1 " + \
        " ".join(shlex.quote(a) for a in command)


def test_node_agent_runs_the_task_and_reports_its_exit_code(node):
    command = node.submit("hj", "0.2", "3")
    code, _ = StoreExec(node.store, "hj", command, poll=0.1)(horovod_text(command), slot(), [])
    assert code == 3
    assert node.store.get_prefix(keys.job("hj", "tasks/")) == []  # cleaned up


def test_a_stopped_worker_is_terminated_by_its_agent(node):
    command = node.submit("hs", "600", "0")
    stopped = threading.Event()
    threading.Timer(3.0, stopped.set).start()  # Horovod's driver stops the worker
    t0 = time.monotonic()
    code, _ = StoreExec(node.store, "hs", command, poll=0.1)(horovod_text(command), slot(),
                                                             [stopped])
    assert code == 128 + 15 and time.monotonic() - t0 < 60  # SIGTERM'd, not run out
    assert not node.agent._drivers_of("hs")[0].alive()


def test_a_task_for_another_command_is_refused(node):
    node.submit("hr", "0", "0")
    node.store.put(keys.job("hr", "tasks/rogue"), encode(WorkerTask(
        "n1", ("/bin/sh", "-c", "touch /tmp/pwned"), {"HOROVOD_RANK": "0"})))
    deadline = time.monotonic() + 30
    while node.store.get(keys.job("hr", "exits/rogue")) is None:
        assert time.monotonic() < deadline, "no refusal reported"
        time.sleep(0.1)
    assert '"code":126' in node.store.get(keys.job("hr", "exits/rogue")).value


def test_a_malformed_allocation_never_makes_a_worker_lost(tmp_path, caplog):
    """A bad allocation value is logged once and tells nothing about a host: the worker
    is not taken for lost (it used to raise out of Horovod's exec function)."""
    with open_store(f"embedded://{tmp_path / 'store.db'}") as store:
        store.put(keys.job("j", "allocation"), '{"v": 1, "version": "x"}')
        exe = StoreExec(store, "j", COMMAND)
        with caplog.at_level("WARNING"):
            assert not exe._host_lost("gone-node")
            assert not exe._host_lost("gone-node")
    said = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(said) == 1 and "jobs/j/allocation" in said[0], said
