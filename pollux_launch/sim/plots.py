"""PNG plots of one or more simulation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pollux_launch.sim.simulator import SimResult


def plot_jct_cdf(results: Sequence[SimResult], path: str | Path) -> Path:
    """Cumulative distribution of job completion times, one line per result."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for res in results:
        jct = np.sort(np.array(list(res.jcts.values()), dtype=float)) / 3600.0
        if not jct.size:  # nothing completed (e.g. a short horizon)
            continue
        ax.step(jct, np.arange(1, jct.size + 1) / jct.size, where="post",
                label=f"{res.policy} (avg {jct.mean():.2f} h)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_timeline(results: Sequence[SimResult], path: str | Path) -> Path:
    """Allocated GPUs and average statistical efficiency of running jobs over time."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for res in results:
        t = np.array(res.times, dtype=float) / 3600.0
        top.plot(t, res.allocated_gpus, label=res.policy, lw=1)
        bottom.plot(t, res.avg_efficiency, label=res.policy, lw=1)
    if results:
        top.axhline(results[0].config.total_gpus, color="gray", ls="--", lw=0.8)
    top.set_ylabel("allocated GPUs")
    bottom.set_ylabel("avg. statistical efficiency")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("time (hours)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="upper right")
    return _save(fig, path)


def plot_nodes(results: Sequence[SimResult], path: str | Path) -> Path:
    """Autoscaled clusters over time: nodes held (billed, booting included) and the
    autoscaler's target, above the active jobs; one colour per result."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for k, res in enumerate(results):
        row = res.cluster
        if not row["time"]:
            continue
        color = f"C{k}"
        t = np.array(row["time"], dtype=float) / 3600.0
        top.step(t, row["held"], where="post", color=color, lw=1.2,
                 label=f"{res.policy}: held ({res.node_hours:.1f} node-h)")
        top.step(t, row["target"], where="post", color=color, lw=0.8, ls="--",
                 label=f"{res.policy}: target")
        bottom.step(t, row["active_jobs"], where="post", color=color, lw=1, label=res.policy)
        a = res.config.autoscale
        if a is not None and k == 0:
            top.axhline(a.max_nodes, color="gray", ls=":", lw=0.8)
            top.axhline(a.min_nodes, color="gray", ls=":", lw=0.8)
    top.set_ylabel("nodes")
    bottom.set_ylabel("active jobs")
    bottom.set_xlabel("time (hours)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="best", fontsize=7)
    return _save(fig, path)


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
