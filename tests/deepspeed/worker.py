"""One worker of the live-rescale test: real DeepSpeed (CPU, gloo), 2 -> 3 -> 2 replicas.

Run as ``python worker.py ID PORT OUT STAGES``. Worker 0 hosts a TCPStore on PORT; each
round's process group uses its own key prefix. For every ZeRO stage in STAGES (comma
separated) the job runs on workers {0, 1}, grows to {0, 1, 2} (worker 2 starts that
stage as a newcomer: fresh model, fresh optimizer) and shrinks back to {0, 1} (worker 2
leaves). After each rescale every replica checks that the parameters are identical on all
ranks and that the consolidated state equals the one captured before the rescale. The
results (PIDs per round, losses, checks) go to OUT/worker{ID}.json.

The process groups are this harness's own (``initialize_handle``); the real rendezvous
path is tested by ``test_deepspeed_pollux.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from state_compare import as_held_by, close  # beside this script

from pollux_launch.adapters import deepspeed as pds

WID, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
STAGES = [int(s) for s in sys.argv[4].split(",")]
TIMEOUT = datetime.timedelta(seconds=120)
STEPS = 12  # optimizer steps per phase
BASE = dist.TCPStore("127.0.0.1", PORT, is_master=WID == 0, wait_for_workers=False,
                     timeout=TIMEOUT)
ROUND = 0
log: dict = {"id": WID, "pids": [], "checks": [], "losses": {}}

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target, dtype=torch.long)
ORDER = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))


def join_round(members: list[int]) -> None:
    """Destroy the current group (if any) and form round ``ROUND``'s with ``members``."""
    global ROUND
    ROUND += 1
    if dist.is_initialized():
        dist.destroy_process_group()
    rank, world = members.index(WID), len(members)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    store = dist.PrefixStore(f"round{ROUND}", BASE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    log["pids"].append([ROUND, world, os.getpid()])


def skip_round() -> None:
    global ROUND
    ROUND += 1


def make_job(stage: int):
    torch.manual_seed(100 + WID)  # differs per worker: the engine must broadcast
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    config = {
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "pollux": {"enabled": True, "initial_batch_size": 16, "max_batch_size": 256,
                   "micro_batch_size_range": [2, 16], "lr_scaling": "adascale",
                   "gradient_accumulation": True},
    }
    return pds.initialize_handle(model=model, optimizer=opt, lr_scheduler=sched,
                                 config=config)


def eval_loss(engine) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(engine.module(X), Y))


def train(engine, steps: int, pos: int) -> tuple[int, list[float]]:
    """``steps`` optimizer steps; the sample position is global (same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m, s = engine.batch
    losses = []
    for _ in range(steps):
        for _ in range(s):
            idx = ORDER[(pos + rank * m + torch.arange(m)) % len(X)]
            pos += world * m
            loss = torch.nn.functional.cross_entropy(engine(X[idx]), Y[idx])
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return pos, losses


def check_after_rescale(engine, before, what: str) -> None:
    """Identical parameters everywhere; consolidated state equal to ``before``."""
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], t) for t in everyone)
    after = engine.capture()
    n_opt = sum(len(v) for v in after["optimizer"]["state"].values())
    diffs = close(as_held_by(before, {}), as_held_by(after, before))
    log["checks"].append({"what": what, "world": dist.get_world_size(), "params_identical": same,
                          "state_diffs": diffs, "optimizer_tensors": n_opt,
                          "zero_stage": after["zero_stage"]})
    assert same, f"{what}: parameters differ between ranks"
    assert not diffs, f"{what}: state changed across the rescale: {diffs[:5]}"
    assert n_opt > 0, f"{what}: no optimizer state was carried over"


def run_stage(stage: int) -> None:
    key = f"zero{stage}"
    losses: list[float] = []
    if WID in (0, 1):
        join_round([0, 1])
        engine, optimizer, _, sched = make_job(stage)
        start = eval_loss(engine)
        pos, ls = train(engine, STEPS, 0)
        losses += ls
        engine.set_batch_size(4, 2)  # (m, s) change at a boundary
        engine.set_lr_factor(1.25)
        lr_before = [g["lr"] for g in optimizer.param_groups]
        pos, ls = train(engine, STEPS, pos)
        losses += ls
        # the scheduler's value is untouched outside the step (factor applied inside)
        assert [g["lr"] for g in optimizer.param_groups] == [sched.get_last_lr()[0]] * len(
            lr_before), "LR factor leaked into the param groups"
        assert engine.batch == (4, 2)

        # 2 -> 3
        before = engine.rescale(lambda: join_round([0, 1, 2]) is None, 4, 2,
                                client_state={"pos": pos})
    else:
        skip_round()
        join_round([0, 1, 2])
        engine, optimizer, _, sched = make_job(stage)  # newcomer: receives the state
        before = engine.restored_state
        assert before is not None, "the newcomer received no state"
        pos, start = before["client"]["pos"], None
        assert engine.batch == (4, 2), f"newcomer batch {engine.batch}"
    check_after_rescale(engine, before, f"{key} 2->3")
    assert engine.lr_factor == 1.25
    pos, ls = train(engine, STEPS, pos)
    losses += ls

    # 3 -> 2: worker 2 leaves
    stays = WID in (0, 1)

    def reform() -> bool:
        if stays:
            join_round([0, 1])
        else:
            dist.destroy_process_group()
            skip_round()
        return stays

    before = engine.rescale(reform, 8, 1, client_state={"pos": pos})
    if stays:
        check_after_rescale(engine, before, f"{key} 3->2")
        pos, ls = train(engine, STEPS, pos)
        losses += ls
        stats = engine.grad_stats.stats()
        end = eval_loss(engine)
        log["losses"][key] = {"start": start, "end": end, "train": losses,
                              "gns_updates": engine.grad_stats.estimator.updates,
                              "noise_scale": stats.noise_scale if stats else None}
        engine.destroy()
    else:
        assert before is None


def main() -> None:
    t0 = time.perf_counter()
    for stage in STAGES:
        run_stage(stage)
    if dist.is_initialized():
        dist.destroy_process_group()
    log["seconds"] = time.perf_counter() - t0
    (OUT / f"worker{WID}.json").write_text(json.dumps(log))
    if WID == 0:  # keep the store up until the others are done with it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                (OUT / f"worker{i}.json").exists() for i in (1, 2)):
            time.sleep(0.1)


if __name__ == "__main__":
    main()
