"""What a local launcher says about waiting and about bounds this machine cannot honour:
real ``pollux-run`` processes on the embedded store (issue 32, item 6)."""

import os
import subprocess
import sys
import time
from pathlib import Path

from pollux_launch import keys
from pollux_launch.launcher.run import WAIT_SAID_AFTER
from pollux_launch.rendezvous.store import open_store

PYTHON = sys.executable
POLLUX_RUN = str(Path(PYTHON).with_name("pollux-run"))
WAITING = "waiting for free slots"


def run(args, cwd, timeout=120):
    return subprocess.run([POLLUX_RUN, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_job_on_an_idle_machine_never_says_it_waits_for_slots(tmp_path):
    store = f"embedded://{tmp_path}/store.db"
    for kind in ("fixed", "restart"):
        out = run(["--store", store, "--job-name", f"idle-{kind}", "--elasticity", kind,
                   "-H", "localhost:2", "-np", "2", PYTHON, "-c", "print('ran')"], tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("<stdout>:ran") == 2
        assert WAITING not in out.stdout, out.stdout


def test_a_job_that_does_wait_says_so(tmp_path):
    store = f"embedded://{tmp_path}/store.db"
    (tmp_path / "hold.py").write_text(
        "import os, sys, time\n"
        "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.1)\n")
    holder = subprocess.Popen([POLLUX_RUN, "--store", store, "--job-name", "holder",
                               "--elasticity", "fixed", "-H", "localhost:2", "-np", "2",
                               PYTHON, "hold.py", str(tmp_path / "go")],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        with open_store(store) as st:
            deadline = time.time() + 60
            while not st.get(keys.job("holder", "allocation")):
                assert time.time() < deadline, "the first job was never placed"
                time.sleep(0.2)
        waiter = subprocess.Popen([POLLUX_RUN, "--store", store, "--job-name", "waiter",
                                   "--elasticity", "fixed", "-H", "localhost:2", "-np", "1",
                                   PYTHON, "-c", "print('ran')"],
                                  cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        time.sleep(WAIT_SAID_AFTER + 3)  # (past the grace before a launcher says it waits)
        (tmp_path / "go").touch()
        out, _ = waiter.communicate(timeout=120)
        holder.communicate(timeout=60)
    finally:
        holder.kill()
    assert waiter.returncode == 0, out
    lines = out.splitlines()
    said = lines.index(f"[pollux] waiter: {WAITING}")
    assert said < lines.index("[0]<stdout>:ran")


def test_torchrun_bounds_this_machine_cannot_honour_are_said_at_the_start(tmp_path):
    """``--nnodes 1:2 --nproc-per-node <all slots>`` means 'never below all slots, up to
    twice that': on one machine it can only ever run at all slots and make no room."""
    slots = os.cpu_count()
    (tmp_path / "noop.py").write_text("pass\n")
    out = run(["--store", f"embedded://{tmp_path}/store.db", "--rdzv-id", "tr",
               "--nproc-per-node", str(slots), "--nnodes", "1:2", "noop.py"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    said = f"[pollux] job tr: up to {2 * slots} replicas, but this machine has {slots} " \
        f"slot(s), and it never goes below {slots}: it runs at {slots} and other jobs here " \
        "wait until it ends"
    assert any(line.startswith(said) for line in lines[:4]), lines[:4]
    # a minimum below the machine's size: only the maximum is said to be out of reach
    out = run(["--store", f"embedded://{tmp_path}/store.db", "--rdzv-id", "tr2",
               "--nproc-per-node", "1", "--nnodes", f"1:{slots + 1}", "noop.py"],
              tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"[pollux] job tr2: up to {slots + 1} replicas, but this machine has {slots} " \
        f"slot(s): it runs at most {slots} here" in out.stdout.splitlines()
