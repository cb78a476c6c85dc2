"""One call from a workload file and a policy name to a :class:`SimResult`.

Policy names are those of :func:`pollux_launch.policy.make_policy` (the Pollux objective
searched by different engines, and Saxena et al.'s ``saxena-dp``) plus the baselines of
:mod:`pollux_launch.sim.baselines`: the non-adaptive TunedJobs ones and ``max-bs``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pollux_launch.arguments import OptionsError
from pollux_launch.calibration import load_rescale_cost
from pollux_launch.policy import DEFAULT_POLICY, POLICIES, Policy, make_policy
from pollux_launch.policy.rescale_cost import RescaleCost
from pollux_launch.sim.baselines import BASELINES, FIXED_BATCH_BASELINES
from pollux_launch.sim.simulator import SimConfig, SimResult, simulate
from pollux_launch.sim.traces import MODELS_DIR, available_models, load_model
from pollux_launch.sim.workload import TraceJob, load_workload


def config_for(rescale_model: str, cost: RescaleCost | None = None,
               interval: float | None = None, **fields) -> SimConfig:
    """A SimConfig for ``rescale_model`` with the calibrated ``cost`` (None: the bundled
    calibration) and, unless given, the round interval that model implies."""
    cost = load_rescale_cost() if cost is None else cost
    cfg = SimConfig(rescale_model=rescale_model, cost=cost, **fields)
    if interval is None:
        interval = cfg.rescale_cost.round_interval(rescale_model)
    return dataclasses.replace(cfg, interval=interval)


def policy_names() -> list[str]:
    """Every name ``--policy`` accepts."""
    return sorted(set(POLICIES) | set(BASELINES) | set(FIXED_BATCH_BASELINES))


def build_policy(name: str | None, cfg: SimConfig, seed: int = 0,
                 options: dict | None = None) -> tuple[str, Policy, SimConfig]:
    """(resolved name, policy, ``cfg`` as the policy needs it) for ``name`` (None: the
    default policy): TunedJobs baselines make the jobs non-adaptive, ``max-bs`` fixes
    their batch at its maximum.

    Engines get the re-allocation delay as their penalty's delta, the seed, and any
    further ``options`` (e.g. ``p``).
    """
    name = name or DEFAULT_POLICY
    if name in BASELINES:
        return name, BASELINES[name](), dataclasses.replace(cfg, adaptive=False)
    engine = FIXED_BATCH_BASELINES.get(name, name)
    if engine not in POLICIES:
        raise OptionsError(f"unknown policy {name!r}; choose one of: {', '.join(policy_names())}")
    changes = {"adaptive": True}
    if name in FIXED_BATCH_BASELINES:
        changes["fixed_max_batch"] = True
    options = {"delta": cfg.policy_delta(), "seed": seed, **(options or {})}
    return name, make_policy(engine, **options), dataclasses.replace(cfg, **changes)


def run_workload(workload: str | Path, policy: str | None = None, cfg: SimConfig | None = None,
                 *, seed: int = 0, progress: bool = False, options: dict | None = None,
                 models_dir: str | Path = MODELS_DIR) -> SimResult:
    """Load ``workload`` and simulate it under ``policy`` on a ``cfg`` cluster."""
    specs = load_workload(workload, available_models(models_dir))
    return run_specs(specs, policy, cfg, seed=seed, progress=progress, options=options,
                     models_dir=models_dir)


def run_specs(specs: list[TraceJob], policy: str | None = None, cfg: SimConfig | None = None,
              *, seed: int = 0, progress: bool = False, options: dict | None = None,
              models_dir: str | Path = MODELS_DIR) -> SimResult:
    """Simulate the jobs ``specs`` (e.g. from :mod:`.generate`) under ``policy``."""
    cfg = cfg or SimConfig()
    name, engine, cfg = build_policy(policy, cfg, seed, options)
    traces = {app: load_model(app, models_dir) for app in {s.application for s in specs}}
    return simulate(specs, traces, engine, cfg, policy_name=name, progress=progress)
