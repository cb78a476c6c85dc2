"""Many short 2-rank gloo jobs, each ending one way, for test_clean_exit (and by hand).

``python exit_worker.py --store URL --out DIR --modes end,exit3,... --pairs N`` imports
torch and pollux once, then forks two workers per pair (``--parallel`` pairs at a time):
each joins its own job through the pollux API, trains a few steps and ends as its mode
says - through the interpreter's real exit, as a script's ``python`` would. Prints one JSON
line per worker: ``{"pair", "mode", "rank", "code", "leak", "tail"}``; ``code`` is the exit
status (negative: the signal), ``leak`` the gloo threads still alive after every atexit
handler (the process then finalises with a group's threads running: what aborts it).

The parent also imports ``torch._dynamo`` (what a script's first optimizer imports; 1-2 s)
unless ``--cold``: a worker then costs about a CPU second, most of it the interpreter's
finalisation. Every worker then
imports ``torch.distributed.fsdp.sharded_grad_scaler`` once its group formed: as a script
importing it there would, it captures the live group in a default argument (torch 2.13).

Modes (what a user's script may do; the trainer stays referenced to the end, as a
script's module-level trainer is):

* ``end``     trains, a last collective, the script ends (0);
* ``exit3``   ... ``sys.exit(3)`` (3);
* ``raise``   ... an uncaught exception (1);
* ``removed`` a new allocation leaves one replica: one worker gets ``WorkerRemoved`` and
              leaves (0), the other trains on alone and ends (0);
* ``raw``     no pollux API: ``init_process_group`` on a TCPStore, an optimizer built
              after it, collectives, ``destroy_process_group``, the end (0) - the test
              workers of tests/elastic do this;
* ``static``  the pollux API under a torchrun-style environment (a static group), the end.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import sys
import time

_EXIT_CHECK: list[str] = []


def _check_gloo_threads() -> None:
    """Registered before pollux is imported: runs after every other atexit handler."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    leak = [n for n in names if "gloo" in n]
    if leak and _EXIT_CHECK:
        with open(_EXIT_CHECK[0], "w") as f:
            f.write(json.dumps(leak))


atexit.register(_check_gloo_threads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import pollux_launch.adapters.torch as pollux  # noqa: E402
from pollux_launch.messages import Allocation, encode  # noqa: E402
from pollux_launch.rendezvous.rounds import JobKeys  # noqa: E402
from pollux_launch.rendezvous.store import open_store  # noqa: E402

MODES = ("end", "exit3", "raise", "removed", "raw", "static")
KEEP: list[object] = []  # what a script keeps in its globals to the end


def allocate(url: str, job: str, version: int, replicas: int) -> None:
    with open_store(url) as store:
        store.put(JobKeys(job).allocation,
                  encode(Allocation(version, ("local",) * replicas, time.time())))


def capture_the_group() -> None:
    """Import a module that evaluates ``group.WORLD`` as a default argument (torch 2.13)."""
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401


def native(mode: str, url: str, job: str) -> None:
    """A worker of ``job`` through the pollux API, ending as ``mode`` says."""
    pollux.init()
    capture_the_group()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # (torch._dynamo, if --cold)
    x = torch.randn(256, 8)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    loader = pollux.AdaptiveDataLoader(data, batch_size=8, local_bsz_bounds=(2, 8))
    trainer = pollux.ElasticTrainer(model, optimizer, loader, decide_every=2)
    KEEP.append(trainer)
    steps, shrunk = 0, False
    for _ in trainer.epochs(100):
        for xb, yb in loader:
            trainer.step(F.cross_entropy(trainer.model(xb), yb))
            steps += 1
            world = trainer.job.placement.world_size
            if mode == "removed" and steps == 4 and trainer.job.placement.rank == 0:
                allocate(url, job, 2, 1)  # one worker leaves at a coming boundary
                shrunk = True
            if (mode != "removed" and steps >= 6) or (shrunk and world == 1 and steps >= 8):
                break
        else:
            continue
        break
    if trainer.job.placement.world_size > 1:
        dist.all_reduce(torch.ones(4))  # a last collective just before the end
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise RuntimeError("the script fails")


def raw(rank: int, port_pipe: tuple[int, int]) -> None:
    """Plain torch.distributed, as the tests/elastic workers use it."""
    read, write = port_pipe
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        os.write(write, f"{store.port}\n".encode())
    else:
        port = int(os.read(read, 64).decode())
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    capture_the_group()
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # (torch._dynamo, if --cold)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
    t = torch.ones(3)
    dist.broadcast(t, 0)
    dist.destroy_process_group()


def child(pair: int, mode: str, rank: int, url: str, out: str, pipe: tuple[int, int],
          port: int) -> None:
    """In the forked worker: run, then leave by the caller's normal path (the exit)."""
    base = os.path.join(out, f"{pair}-{rank}")
    _EXIT_CHECK.append(base + ".leak")
    err = os.open(base + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.close(err)
    if mode == "raw":
        raw(rank, pipe)
        return
    if mode == "static":
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    else:
        os.environ.update({"POLLUX_STORE": url, "POLLUX_JOB": f"exit-{pair}",
                           "POLLUX_WORKER_ID": f"w{rank}", "POLLUX_NODE": "local",
                           "POLLUX_ADDR": "127.0.0.1"})
    native(mode, url, f"exit-{pair}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(pair: int, mode: str, rank: int, status: int, out: str) -> None:
    base = os.path.join(out, f"{pair}-{rank}")
    code = os.waitstatus_to_exitcode(status)
    leak = json.load(open(base + ".leak")) if os.path.exists(base + ".leak") else []
    with open(base + ".err", errors="replace") as f:
        tail = f.read()[-1500:]
    print(json.dumps({"pair": pair, "mode": mode, "rank": rank, "code": code, "leak": leak,
                      "tail": tail}), flush=True)


def main() -> str | None:
    """Runs the pairs; returns in a forked worker (which then exits as a script does)."""
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--pairs", type=int, default=len(MODES))
    p.add_argument("--parallel", type=int, default=1, help="pairs at once")
    p.add_argument("--cold", action="store_true", help="each worker imports torch._dynamo")
    a = p.parse_args()
    if not a.cold:
        import torch._dynamo  # noqa: F401
    modes = a.modes.split(",")
    running: dict[int, tuple[int, str, int]] = {}  # pid -> (pair, mode, rank)
    for pair in range(a.pairs):
        mode = modes[pair % len(modes)]
        while len(running) >= 2 * a.parallel:
            reap(running, a.out)
        if mode not in ("raw", "static"):
            allocate(a.store, f"exit-{pair}", 1, 2)
        pipe, port = os.pipe(), free_port()
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                return child(pair, mode, rank, a.store, a.out, pipe, port) or "child"
            running[pid] = (pair, mode, rank)
        os.close(pipe[0])
        os.close(pipe[1])
    while running:
        reap(running, a.out)
    return None


def reap(running: dict[int, tuple[int, str, int]], out: str) -> None:
    pid, status = os.wait()
    if pid in running:
        report(*running.pop(pid), status, out)


if __name__ == "__main__":
    main()
