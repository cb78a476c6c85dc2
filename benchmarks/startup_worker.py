"""The minimal training script of ``benchmarks/startup.py`` (plain torch.distributed).

Started by torchrun, DeepSpeed's launcher or ``pollux-run`` (each sets torchrun's
variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): it records wall-clock marks
(``time.time()``) at its start, after ``import torch``, after ``init_process_group`` and
after its first training step, and writes them as JSON to the file named by its first
argument (rank 0; rank r > 0: that name + ``.rank<r>``), then it exits. Nothing from
pollux_launch is imported.

    python benchmarks/startup_worker.py MARKS.json [--local_rank=N]
"""

import json
import os
import sys
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T_IMPORT = time.time()


def write_marks(marks_path: str, rank: int, world: int, *times: float) -> None:
    """The marks (start, imported, initialized, now: the first step) of this rank, written
    atomically (shared with startup_worker_hvd.py)."""
    marks = dict(zip(("start", "imported", "initialized"), times, strict=True))
    marks.update(first_step=time.time(), pid=os.getpid(), world_size=world)
    path = marks_path if rank == 0 else f"{marks_path}.rank{rank}"
    with open(path + ".tmp", "w") as f:
        json.dump(marks, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    marks_path = next(a for a in sys.argv[1:] if not a.startswith("--"))  # (deepspeed adds
    dist.init_process_group("gloo")                                        #  --local_rank=N)
    t_init = time.time()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # the gradient allreduce: every rank took part in the step
    opt.step()
    write_marks(marks_path, dist.get_rank(), dist.get_world_size(), T_START, T_IMPORT, t_init)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
