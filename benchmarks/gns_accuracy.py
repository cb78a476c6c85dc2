"""Accuracy of the gradient-noise-scale estimator against a closed form.

Linear regression ``y = x . w* + eps`` with ``x ~ N(0, I_d)``, ``eps ~ N(0, sigma^2)`` and
per-example loss ``(x . w - y)^2 / 2``. At fixed weights ``w`` with ``delta = w - w*`` the
per-example gradient is ``g = x (x . delta - eps)``, so

* the true gradient is ``G = E[x x^T] delta = delta``, ``|G|^2 = |delta|^2``;
* ``E[g g^T] = E[x x^T (x . delta)^2] + sigma^2 I = |delta|^2 I + 2 delta delta^T + sigma^2 I``
  (Isserlis), hence ``tr(Sigma) = (d + 1) |delta|^2 + d sigma^2`` and the noise scale is
  ``B = tr(Sigma) / |G|^2 = d + 1 + d sigma^2 / |delta|^2``.

The weights are held fixed while measuring (no optimiser step), so every step samples the
same distribution. The estimator under test is the real ``GradientNoiseMonitor``:
"multi" simulates 4 replicas in one process (each replica's local gradient computed
separately, then their average as the all-reduced gradient), "single" is one replica
without accumulation (the differenced estimator over consecutive steps).

Prints one line per case and, LAST, {"rel_err_multi": ..., "rel_err_single": ...}
(``--smoke``: 50 steps in 8 dimensions).
"""

from __future__ import annotations

import argparse
import sys

import torch
from harness import Report, run_benchmark  # beside this script
from tqdm import tqdm

from pollux_launch.tuning.grad_monitor import GradientNoiseMonitor


def true_noise_scale(d: int, sigma: float, delta_sqr: float) -> float:
    return d + 1 + d * sigma**2 / delta_sqr


def measure(
    replicas: int, steps: int, d: int, sigma: float, local_bsz: int, m0: int, seed: int
) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=gen)
    delta = torch.randn(d, generator=gen)
    delta = delta / delta.norm()  # |delta|^2 = 1
    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = GradientNoiseMonitor(opt, m0, smoothing=0.999, overhead_budget=None)  # every step
    mon.configure(num_replicas=replicas, local_bsz=local_bsz, reduce_local=False)
    for _ in tqdm(range(steps), desc=f"{replicas} replica(s)", leave=False):
        grads = []
        for _ in range(replicas):
            x = torch.randn(local_bsz, d, generator=gen)
            y = x @ w_star + sigma * torch.randn(local_bsz, generator=gen)
            loss = 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()
            (g,) = torch.autograd.grad(loss, [model.weight])
            grads.append(g)
            mon.add_local([g])
        mon.end_micro_step()  # one micro-batch on every (simulated) replica
        mon.reduce_local_async()
        mon.finish_step([torch.stack(grads).mean(0)])
    stats = mon.stats()
    assert stats is not None
    return stats.noise_scale, true_noise_scale(d, sigma, 1.0)


def bench(args: argparse.Namespace, report: Report) -> None:
    for name, replicas in (("multi", 4), ("single", 1)):
        with report.case(name):
            est, true = measure(
                replicas, args.steps, args.dim, args.sigma, args.local_bsz, args.m0, args.seed
            )
            err = abs(est / true - 1.0)
            print(f"{name}: replicas={replicas} estimated B={est:.1f} true B={true:.1f} "
                  f"rel_err={err:.3f}")
            report[f"rel_err_{name}"] = round(err, 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--local-bsz", type=int, default=32)
    ap.add_argument("--m0", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    return run_benchmark(ap, bench, smoke={"steps": 50, "dim": 8})


if __name__ == "__main__":
    sys.exit(main())
