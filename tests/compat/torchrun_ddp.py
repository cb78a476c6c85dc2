"""DDP training in the style of PyTorch's torchrun tutorial (``multigpu_torchrun.py``).

Plain torch only: ``init_process_group("gloo")`` from torchrun's environment,
``DistributedSampler``, ``DistributedDataParallel``, and a snapshot file written by rank 0
after every epoch (``{"MODEL_STATE", "EPOCHS_RUN"}``, as in the tutorial) from which a
(re)started run resumes::

    torchrun --standalone --nproc-per-node 2 torchrun_ddp.py --snapshot snap.pt --result r.json

The result does not depend on the number of replicas: the GLOBAL batch is fixed and split
among the ranks (``--global-batch / WORLD_SIZE`` each), DDP averages the gradients, the
data and the initial weights are seeded, the optimizer is plain SGD (its whole state is
the model), so 1 or 2 replicas - or a run restarted from a snapshot at another size -
end with the same weights up to float rounding.

Rank 0 appends one JSON line per attempt (and one per finished epoch) to ``--events``
(default: the result path + ``.log.jsonl``) and writes the result JSON at the end:
final loss, a checksum and the flat weights, epochs run, the WORLD_SIZE values it ran at
and the TORCHELASTIC_RESTART_COUNT values it saw.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before the group: see main()'s end
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int = 512, d: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model(d: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def append(path: str, **record: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path: str, log_path: str,
                 step_sleep: float, pace_file: str | None = None) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.snapshot_path = snapshot_path
        self.log_path = log_path
        self.step_sleep = step_sleep
        self.pace_file = pace_file
        self.epochs_run = 0
        self.history: list[dict] = []
        if os.path.exists(snapshot_path):
            print("Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        self.history = list(snapshot.get("HISTORY", []))
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1,
                    "HISTORY": self.history}
        tmp = f"{self.snapshot_path}.tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)  # a kill while saving leaves the old one
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def _run_batch(self, source, targets) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
            if self.step_sleep and (self.pace_file is None or os.path.exists(self.pace_file)):
                time.sleep(self.step_sleep)

    def train(self, max_epochs: int) -> None:
        attempt = {"world_size": self.world_size,
                   "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
                   "start_epoch": self.epochs_run}
        self.history.append(attempt)
        if self.global_rank == 0:
            append(self.log_path, event="start", **attempt,
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                   master_port=os.environ.get("MASTER_PORT"))
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0:
                self._save_snapshot(epoch)
                append(self.log_path, event="epoch", epoch=epoch, world_size=self.world_size)


def main() -> None:
    p = argparse.ArgumentParser(description="torchrun-style DDP on synthetic data")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--snapshot", default="snapshot.pt")
    p.add_argument("--result", default="result.json")
    p.add_argument("--events", default=None,
                   help="JSON-lines event log (default: RESULT.log.jsonl)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pace steps (seconds)")
    p.add_argument("--pace-file", default=None,
                   help="with --step-sleep: pace only while this file exists (tests let a "
                   "job run slowly while they rescale it, then let it finish at full speed)")
    args = p.parse_args()
    log_path = args.events or args.result + ".log.jsonl"

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    world = dist.get_world_size()
    assert args.global_batch % world == 0, "the global batch must split evenly among ranks"
    dataset = make_data()
    train_data = DataLoader(dataset, batch_size=args.global_batch // world, shuffle=False,
                            sampler=DistributedSampler(dataset, shuffle=True, seed=0))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    trainer = Trainer(model, train_data, optimizer, args.snapshot, log_path, args.step_sleep,
                      args.pace_file)
    trainer.train(args.epochs)

    if dist.get_rank() == 0:
        net = trainer.model.module
        with torch.no_grad():
            x, y = dataset.tensors
            loss = float(F.mse_loss(net(x), y))
        flat = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
        result = {"final_loss": loss, "checksum": float(flat.sum()),
                  "abs_checksum": float(flat.abs().sum()), "weights": flat.tolist(),
                  "epochs_run": args.epochs,
                  "world_sizes": [h["world_size"] for h in trainer.history],
                  "restart_counts": [h["restart_count"] for h in trainer.history],
                  "history": trainer.history,
                  "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))}
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)
    dist.barrier()  # no rank leaves while another still talks to it
    # the DDP model (its reducer holds the group) goes first, so that destroying the group
    # ends its threads: torch 2.13's gloo aborts some exits ("terminate called without an
    # active exception") when the group's threads are still running in interpreter
    # teardown. torch.distributed.nn.functional is imported at the top, before the group
    # forms: torch 2.13 evaluates ``group.WORLD`` as a default argument there, and
    # torch._dynamo imports it with the first optimizer - after init_process_group it
    # would hold the group past destroy_process_group (tests/adapters/test_clean_exit.py;
    # pollux's own API takes care of it for a script)
    del trainer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
