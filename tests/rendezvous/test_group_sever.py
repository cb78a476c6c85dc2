"""A survivor that leaves a broken round cuts that round's connections, even where
something still holds the group (FSDP2's mesh and DTensors do): a peer blocked in a
collective with it fails at once instead of waiting out the collective timeout. Three
real gloo processes: rank 2 is SIGKILLed, rank 1 sees it and leaves the group (holding a
reference to it, as FSDP does), rank 0 is blocked on a receive from rank 1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

WORKER = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from pollux_launch.rendezvous import process_group as pg

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
hosted = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False) \\
    if rank == 0 else None
pg.form_group("gloo", "127.0.0.1", port, rank, 3, timeout=TIMEOUT, hosted=hosted)
held = dist.group.WORLD  # what FSDP's mesh holds: the group outlives its destroy
dist.barrier()
t = torch.zeros(1)
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1:
    try:
        dist.recv(t, src=2)  # rank 2 is gone: this fails at once
    except RuntimeError:
        pass
    pg.destroy_group()  # the survivor's failure round leaves the broken group
    time.sleep(TIMEOUT + 5)  # (alive, and still holding it)
if rank == 0:
    t0 = time.monotonic()
    try:
        dist.recv(t, src=1)
        error = None
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    with open(out, "w") as f:
        json.dump({"waited": time.monotonic() - t0, "error": error}, f)
    os._exit(0)
"""
TIMEOUT = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_leaving_a_broken_group_wakes_a_peer_blocked_on_this_rank(tmp_path: Path) -> None:
    script, out = tmp_path / "worker.py", tmp_path / "rank0.json"
    script.write_text(WORKER.replace("TIMEOUT", str(TIMEOUT)))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(out)])
             for r in range(3)]
    try:
        assert procs[0].wait(timeout=TIMEOUT + 60) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    got = json.loads(out.read_text())
    assert got["error"] is not None, got
    assert got["waited"] < TIMEOUT / 3, got  # not the collective timeout
