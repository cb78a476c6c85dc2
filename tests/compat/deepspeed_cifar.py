"""DeepSpeed training in the style of DeepSpeedExamples' ``training/cifar/cifar10_deepspeed.py``:
argparse with ``--local_rank`` and ``deepspeed.add_config_arguments``, the tutorial's small
conv net, ``deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...)``,
``model_engine.backward(loss)`` / ``model_engine.step()``. Plain DeepSpeed, no pollux::

    deepspeed --num_gpus 2 deepspeed_cifar.py --deepspeed_config ds_config.json --result r.json
    torchrun --standalone --nproc-per-node 2 deepspeed_cifar.py --deepspeed_config ds_config.json

The data is synthetic and CIFAR-shaped (3x32x32 images, 10 classes, seeded; no download).
The result does not depend on the number of replicas: ``ds_config.json`` fixes the
GLOBAL batch (``train_batch_size``; DeepSpeed derives the micro batch per replica), the
loader's ``DistributedSampler`` splits each global batch among the ranks, the engine
averages the gradients, and the initial weights are seeded.

``--checkpoint DIR``: DeepSpeed's own checkpoints, as its examples take them -
``model_engine.save_checkpoint(DIR, client_state=...)`` on every rank after each epoch, and
``model_engine.load_checkpoint(DIR)`` at start when DIR has one - so that a run started
again (at any size: ZeRO stage 0 keeps the whole optimizer state in one file) resumes
where the last one saved. ``--events``, ``--step-sleep`` and ``--pace-file`` are
``torchrun_ddp.py``'s: rank 0's JSON-lines log of attempts and epochs, and pacing.

Rank 0 writes the result JSON at the end (final loss on the whole set, a checksum and
the flat weights, steps and epochs run, the world size and the sizes of every attempt).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.data import TensorDataset


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR-shaped synthetic data with DeepSpeed")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", type=int, default=2, help="number of total epochs")
    parser.add_argument("--samples", type=int, default=256, help="synthetic images")
    parser.add_argument("--result", default="result.json")
    parser.add_argument("--checkpoint", default=None, help="DeepSpeed checkpoint folder")
    parser.add_argument("--events", default=None, help="JSON-lines log (RESULT.log.jsonl)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="pace steps (seconds)")
    parser.add_argument("--pace-file", default=None,
                        help="with --step-sleep: pace only while this file exists")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, 10, (n,), generator=g)
    # a class-dependent mean, so that there is something to learn
    means = torch.randn(10, 3, 1, 1, generator=g)
    images = means[labels] + torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset(images, labels)


def append(path: str, **record: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")


def main() -> None:
    args = add_argument()
    deepspeed.init_distributed()
    torch.set_num_threads(1)
    trainset = synthetic_cifar(args.samples)
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    local_device = get_accelerator().device_name(model_engine.local_rank)  # "cpu" here
    start_epoch, history = 0, []
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "latest")):
        _path, client = model_engine.load_checkpoint(args.checkpoint)
        start_epoch, history = client["epochs_run"], list(client["history"])
        print(f"Resuming from {_path} at epoch {start_epoch}", flush=True)
    attempt = {"world_size": world, "start_epoch": start_epoch,
               "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))}
    history.append(attempt)
    events = args.events or args.result + ".log.jsonl"
    if rank == 0:
        append(events, event="start", **attempt, master_port=os.environ.get("MASTER_PORT"))
    steps = 0
    for epoch in range(start_epoch, args.epochs):
        running_loss, batches = 0.0, 0
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = F.cross_entropy(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            steps += 1
            batches += 1
            running_loss += loss.item()
            if args.step_sleep and (args.pace_file is None or os.path.exists(args.pace_file)):
                time.sleep(args.step_sleep)
        if rank == 0:
            print(f"[{epoch + 1}] loss: {running_loss / batches:.4f}", flush=True)
        if args.checkpoint:  # (every rank: DeepSpeed's protocol)
            model_engine.save_checkpoint(args.checkpoint, client_state={
                "epochs_run": epoch + 1, "history": history})
        if rank == 0:
            append(events, event="epoch", epoch=epoch, world_size=world)

    if rank == 0:
        net = model_engine.module
        with torch.no_grad():
            x, y = trainset.tensors
            final = float(F.cross_entropy(net(x), y))
        flat = torch.cat([p.detach().reshape(-1).float() for p in net.parameters()])
        result = {"final_loss": final, "checksum": float(flat.sum()),
                  "abs_checksum": float(flat.abs().sum()), "weights": flat.tolist(),
                  "epochs_run": args.epochs, "steps": steps,
                  "world_size": world, "world_sizes": [h["world_size"] for h in history],
                  "history": history,
                  "micro_batch": model_engine.train_micro_batch_size_per_gpu(),
                  "local_rank_arg": args.local_rank,
                  "env_local_rank": os.environ.get("LOCAL_RANK")}
        with open(args.result + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(args.result + ".tmp", args.result)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
