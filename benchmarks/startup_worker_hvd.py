"""The Horovod variant of ``benchmarks/startup_worker.py`` (for ``horovodrun``): the same
marks, with ``hvd.init()`` in place of ``init_process_group`` and Horovod's optimizer
doing the step's allreduce.

    python benchmarks/startup_worker_hvd.py MARKS.json
"""

import sys
import time

T_START = time.time()

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from startup_worker import write_marks  # noqa: E402  (beside this script)

T_IMPORT = time.time()


def main() -> None:
    marks_path = next(a for a in sys.argv[1:] if not a.startswith("--"))
    hvd.init()
    t_init = time.time()
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()  # waits for the gradient allreduce
    write_marks(marks_path, hvd.rank(), hvd.size(), T_START, T_IMPORT, t_init)
    hvd.join()
    hvd.shutdown()


if __name__ == "__main__":
    main()
