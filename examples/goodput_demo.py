"""Goodput in one screen: learn a job's throughput model, then pick its batch per GPU count.

A CIFAR-10 ResNet job from the Pollux traces (measured on 4-GPU AWS nodes) has run a few
configurations. From those step times alone we fit the throughput model (Pollux Eqn
7-11), combine it with the gradient noise scale (Eqn 4-6), and ask: with N GPUs, which
per-GPU batch m and gradient-accumulation steps s make training progress fastest?

    .venv/bin/python examples/goodput_demo.py [--model cifar10]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from pollux_launch.goodput import (
    GoodputFunction,
    GradParams,
    SpeedupFunction,
    exploration_cap,
    fit_perf_params,
    predict_step_time,
)

TRACES = Path(__file__).resolve().parents[1] / "pollux_launch/sim/traces/models"
GPUS_PER_NODE = 4


def read(path: Path) -> dict[str, np.ndarray]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description="fit a goodput model and print the best (m, s)")
    ap.add_argument("--model", default="cifar10", help="a folder of the Pollux traces")
    args = ap.parse_args()
    folder = TRACES / args.model
    if not (folder / "placements.csv").is_file():
        known = sorted(p.name for p in TRACES.iterdir() if p.is_dir())
        raise SystemExit(f"error: unknown model {args.model!r}; choose one of {known}")

    table = read(folder / "placements.csv")
    nodes = np.array([len(p) for p in table["placement"]])
    replicas = np.array([sum(map(int, p)) for p in table["placement"]])
    local_bsz = table["local_bsz"].astype(float)
    step, sync = table["step_time"].astype(float), table["sync_time"].astype(float)

    # What the job has seen so far: 1, 2 and 4 GPUs on one node, 8 GPUs on two nodes,
    # and three per-GPU batch sizes (the agent measures these while training).
    sizes = np.unique(local_bsz)[[0, len(np.unique(local_bsz)) // 2, -1]]
    seen = (((nodes == 1) & np.isin(replicas, [1, 2, 4])) | ((nodes == 2) & (replicas == 8)))
    seen &= np.isin(local_bsz, sizes)
    params = fit_perf_params(nodes[seen], replicas[seen], local_bsz[seen],
                             np.zeros(seen.sum()), step[seen], sync[seen])
    pred = predict_step_time(params, nodes, replicas, local_bsz, 0)
    err = np.abs(pred / step - 1)

    # Gradient statistics and batch limits, as the Pollux authors' simulator used them.
    runs = sorted(folder.glob("validation-*.csv"), key=lambda p: int(p.stem[11:]))
    m0, max_batch = int(runs[0].stem[11:]), int(runs[-1].stem[11:])
    stats = read(runs[0])
    # Mid-training gradient statistics (the noise scale grows as training goes on).
    grad = GradParams(sqr=float(np.median(stats["grad_sqr"].astype(float))),
                      var=float(np.median(stats["grad_var"].astype(float))))
    bounds = (int(local_bsz.min()), int(local_bsz.max()))

    print(f"model {args.model}: fitted on {seen.sum()} of {len(step)} measured steps")
    print("  " + ", ".join(f"{k}={v:.3g}" for k, v in params.to_dict().items()))
    print(f"  step-time error: {err[seen].mean():.1%} on what it saw, "
          f"{err[~seen].mean():.1%} on the {(~seen).sum()} configurations it did not")
    print(f"  initial batch M0={m0}, max batch {max_batch}, per-GPU batch {bounds}, "
          f"may explore up to {exploration_cap(int(replicas[seen].max()))} GPUs\n")

    goodput_fn = GoodputFunction(params, grad, m0)
    speedup = SpeedupFunction(goodput_fn, max_batch, bounds, accumulation=True)
    gpus = np.array([1, 2, 4, 8, 16, 32, 64])
    n = -(-gpus // GPUS_PER_NODE)  # fewest nodes that hold them
    good, m, s = goodput_fn.optimize(n, gpus, max_batch, bounds, accumulation=True)
    batch = gpus * m * (s + 1)
    thr = goodput_fn.throughput(n, gpus, m, s)
    eff = goodput_fn.efficiency(batch)
    sp = speedup(n, gpus)
    print(f"{'GPUs':>4} {'nodes':>5} {'m':>5} {'s':>2} {'batch M':>8} {'samples/s':>10} "
          f"{'efficiency':>10} {'goodput':>8} {'speedup':>7}")
    for row in zip(gpus, n, m, s, batch, thr, eff, good, sp, strict=True):
        k, nn, mm, ss, bb, tt, ee, gg, su = row
        print(f"{k:4d} {nn:5d} {mm:5d} {ss:2d} {bb:8d} {tt:10.0f} {ee:10.2f} {gg:8.0f} {su:7.2f}")
    print("\ngoodput = samples/s x efficiency (progress per second in M0-sized samples);"
          "\nspeedup = goodput relative to 1 GPU; s = extra gradient-accumulation steps.")


if __name__ == "__main__":
    main()
