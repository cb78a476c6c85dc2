"""Throughput-model fit error and speed on the Pollux trace models.

For each model, fits the throughput model (pollux_launch.goodput.fit_perf_params) on the
model's whole placements.csv and reports the in-sample error of step_time, the median
wall time of one fit, and the median wall time of one best-(m, s) search for one
allocation (GoodputFunction.optimize). Prints a table, then, as its LAST line, one JSON
object:

    {"models": {"<model>": {"mean_err": ..., "p90_err": ...}, ...},
     "fit_ms_median": ..., "optimize_us_median": ...}

Usage: python benchmarks/goodput_fit.py [--traces DIR] [--fit-repeats N] [--opt-repeats N]
(``--smoke``: one fit and two optimize calls per model). Timings are medians over many
repeats (the machine may be shared: expect noise).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
from harness import Report, UsageError, run_benchmark  # beside this script
from tqdm import tqdm

from pollux_launch.goodput import (
    GoodputFunction,
    GradParams,
    fit_perf_params,
    predict_step_time,
)
from pollux_launch.goodput.function import _grid

DEFAULT_TRACES = Path(__file__).resolve().parents[1] / "pollux_launch/sim/traces/models"
MAX_LOCAL_BSZ_OVERRIDE = {"yolov3": 8}  # traces README: largest per-GPU batch in memory


def read_csv(path: Path) -> dict[str, np.ndarray]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"error: {path} has no rows")
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def load_model(folder: Path) -> dict:
    """Observations of placements.csv plus the job limits the Pollux simulator used."""
    table = read_csv(folder / "placements.csv")
    placements = table["placement"]
    validations = sorted(folder.glob("validation-*.csv"), key=lambda p: int(p.stem[11:]))
    if not validations:
        raise SystemExit(f"error: no validation-<M>.csv in {folder}")
    first = read_csv(validations[0])
    local = table["local_bsz"].astype(float)
    return {
        "num_nodes": np.array([len(p) for p in placements]),
        "num_replicas": np.array([sum(int(c) for c in p) for p in placements]),
        "local_bsz": local,
        "step_time": table["step_time"].astype(float),
        "sync_time": table["sync_time"].astype(float),
        "init_batch_size": int(validations[0].stem[11:]),
        "max_batch_size": int(validations[-1].stem[11:]),
        "bounds": (int(local.min()), MAX_LOCAL_BSZ_OVERRIDE.get(folder.name, int(local.max()))),
        "grad": GradParams(
            float(np.median(first["grad_sqr"].astype(float))),
            float(np.median(first["grad_var"].astype(float))),
        ),
    }


def bench(args: argparse.Namespace, report: Report) -> None:
    if not args.traces.is_dir():
        raise UsageError(f"--traces {args.traces} is not a folder")
    folders = sorted(p for p in args.traces.iterdir() if (p / "placements.csv").is_file())
    if not folders:
        raise UsageError(f"no <model>/placements.csv under {args.traces}")

    results: dict[str, dict[str, float]] = {}
    fit_ms: list[float] = []
    opt_us: list[float] = []
    cold_us: list[float] = []
    rows = []
    # Allocations as the scheduler sees them: 4 GPUs per node, 1 to 64 GPUs.
    replicas = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
    nodes = (replicas + 3) // 4
    for folder in tqdm(folders, desc="models", file=sys.stderr):
        d = load_model(folder)
        obs = (
            d["num_nodes"],
            d["num_replicas"],
            d["local_bsz"],
            np.zeros_like(d["local_bsz"]),
            d["step_time"],
            d["sync_time"],
        )
        times = []
        for _ in range(args.fit_repeats):
            t0 = time.perf_counter()
            params = fit_perf_params(*obs)
            times.append(time.perf_counter() - t0)
        fit_ms.extend(1e3 * t for t in times)
        model_fit_ms = 1e3 * float(np.median(times))
        pred = predict_step_time(params, d["num_nodes"], d["num_replicas"], d["local_bsz"], 0)
        err = np.abs(pred / d["step_time"] - 1)
        results[folder.name] = {
            "mean_err": round(float(err.mean()), 4),
            "p90_err": round(float(np.percentile(err, 90)), 4),
        }

        fn = GoodputFunction(params, d["grad"], d["init_batch_size"])
        limits = (d["max_batch_size"], d["bounds"])
        key = (
            float(d["init_batch_size"]),
            float(d["max_batch_size"]),
            float(d["bounds"][0]),
            float(d["bounds"][1]),
            True,
            None,
        )
        for n, k in zip(nodes, replicas, strict=True):
            fn.optimize(n, k, *limits)  # the (memoised) candidate grid of this allocation
            for _ in range(args.opt_repeats):
                t0 = time.perf_counter()
                fn.optimize(n, k, *limits)
                opt_us.append(1e6 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            _grid(np.array([[float(k)]]), *key)  # what a cold (un-memoised) call adds
            cold_us.append(1e6 * (time.perf_counter() - t0))
        good, m, s = fn.optimize(nodes, replicas, *limits)
        rows.append(
            (
                folder.name,
                err.mean(),
                np.percentile(err, 90),
                model_fit_ms,
                params,
                list(zip(replicas, m, s, good, strict=True)),
            )
        )

    print(f"{'model':<12} {'mean_err':>8} {'p90_err':>8} {'fit_ms':>7}  fitted parameters")
    for name, mean, p90, ms, params, _ in rows:
        shown = ", ".join(f"{k}={v:.3g}" for k, v in params.to_dict().items())
        print(f"{name:<12} {mean:8.4f} {p90:8.4f} {ms:7.2f}  {shown}")
    print("\nbest configuration per GPU count (4 GPUs per node), as GPUs:m x (s + 1):")
    for name, *_, best in rows:
        cells = "  ".join(f"{k}:{m}x{s + 1}" for k, m, s, _ in best)
        print(f"  {name:<12} {cells}")
    report.update({
        "models": results,
        "fit_ms_median": round(float(np.median(fit_ms)), 3),
        "optimize_us_median": round(float(np.median(opt_us)), 2),
    })
    print(
        f"\nfit: median of {len(fit_ms)} fits over all models; "
        f"optimize: median of {len(opt_us)} single-allocation calls "
        f"(memoised candidate grid; building one grid adds {np.median(cold_us):.0f} us)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--traces",
        type=Path,
        default=DEFAULT_TRACES,
        help="folder with one sub-folder per model (default: %(default)s)",
    )
    ap.add_argument("--fit-repeats", type=int, default=21, help="timed fits per model")
    ap.add_argument(
        "--opt-repeats", type=int, default=300, help="timed optimize calls per allocation and model"
    )
    return run_benchmark(ap, bench, smoke={"fit_repeats": 1, "opt_repeats": 2}, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
