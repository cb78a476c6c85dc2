"""Worker for test_horovod_warm.py (run under horovodrun): a paced Horovod Elastic loop
that logs, one JSON line per event to ``LOG_DIR/w-<pid>.jsonl``, whether it was forked
warm (torch imported before its first line ran), its parent, each step's world size,
the step where it was interrupted and a parameter digest after every (re)start."""

from __future__ import annotations

import sys
import time

WARM = "torch" in sys.modules  # imported before this line ran: a warm zygote's fork
T_TOP = time.time()

import hashlib  # noqa: E402 - after the two lines above, on purpose
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from horovod.common.exceptions import HostsUpdatedInterrupt  # noqa: E402


def main(log_dir: str, stop_file: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = open(Path(log_dir) / f"w-{os.getpid()}.jsonl", "a", buffering=1)

    def log(event: str, **fields: object) -> None:
        out.write(json.dumps({"event": event, "pid": os.getpid(), "rank": hvd.rank(),
                              "size": hvd.size(), "t": time.time(), **fields}) + "\n")

    log("init", warm=WARM, t_top=T_TOP, ppid=os.getppid())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes()
                                       for p in model.parameters())).hexdigest()
        log("start", step=state.step, digest=digest)
        while True:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(state.step))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            state.step += 1
            log("step", step=state.step)
            if state.step % 10 == 0:
                stop = torch.tensor([float(hvd.rank() == 0 and os.path.exists(stop_file))])
                if hvd.allreduce(stop, op=hvd.Sum, name="stop")[0] > 0:
                    return
                state.save()  # (commit() would check for host updates unlogged)
            time.sleep(0.02)
            try:
                state.check_host_updates()
            except HostsUpdatedInterrupt:
                log("interrupt", step=state.step)
                raise

    train(state)
    log("done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
