"""The ``"pollux"`` section of a DeepSpeed config (ds_config), validated up front.

Modelled on DeepSpeed's own ``elasticity`` section: the section is parsed once, every
mistake is one line naming the key and the fix, and the result is a frozen dataclass.
When the section is enabled, pollux owns the three batch keys of the ds_config
(``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``)
and :func:`derive_ds_config` writes them for each allocation; DeepSpeed's ``elasticity``
section cannot be enabled at the same time (both would pick the batch size).

Example (all keys; see README.md next to this file)::

    "pollux": {
        "enabled": true,
        "initial_batch_size": 64,
        "max_batch_size": 1024,
        "micro_batch_size_range": [4, 64],
        "lr_scaling": "adascale",
        "gradient_accumulation": true,
        "report_interval": 30,
        "checkpoint_dir": "/shared/ckpt/my-job",
        "checkpoint_interval": 120,
        "policies": ["pollux", "mypkg.policies:GNSBatch"]
    }

This module is pure: no DeepSpeed import, no I/O except reading a JSON file named by
the caller.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollux_launch.errors import UserError

SECTION = "pollux"
# The ds_config keys that the section takes over when enabled.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")
NO_LR_SCALING = "none"


class PolluxConfigError(UserError, ValueError):
    """A bad ``"pollux"`` section or a ds_config that conflicts with it (one-line message)."""


@dataclass(frozen=True)
class PolluxConfig:
    """The validated ``"pollux"`` section.

    Attributes:
        enabled: pollux adapts the batch size, accumulation and LR of this job and rescales
            it live. Default ``False`` (as DeepSpeed's ``elasticity.enabled``): with it off,
            the section is ignored and the ds_config is used as written.
        initial_batch_size: ``M0``, the total batch size (over all replicas and
            accumulation steps) at which the model's hyper-parameters - above all the LR -
            were tuned. Training starts there and the gradient noise scale is normalised
            to it (Pollux Eqn 4-6).
        max_batch_size: the largest total batch size pollux may choose (Pollux's ``M``
            upper limit in the (m, s) search, Eqn 13). Default: ``initial_batch_size`` (no growth).
        min_batch_size: the smallest total batch size pollux may choose (the lower end of
            the job's batch-size range). Default: none.
        micro_batch_size_range: ``(min, max)`` per-GPU micro batch ``m`` (memory limits:
            the largest that fits, the smallest that still runs efficiently). Default
            ``(1, initial_batch_size)``.
        lr_scaling: how the LR follows the batch size: a rule of
            ``pollux_launch.goodput.lr_rules()`` (``adascale``, ``linear``, ``sqrt``,
            ``legw``) or ``none``. Default ``adascale`` (Pollux Sec. 3.1).
        gradient_accumulation: whether pollux may use gradient accumulation steps
            (``s > 0``) to reach batch sizes beyond ``world_size * max micro batch``.
            Default ``False`` (as adaptdl).
        report_interval: seconds between two reports of the job's hints (fitted throughput
            model, gradient statistics) to the store by rank 0 under pollux-run. Default 30.
        checkpoint_dir: where the job's durable state goes (the consolidated engine state,
            the same for every ZeRO stage and world size); default: ``pollux-run
            --checkpoint-dir``, else none. A job whose workers all died resumes there.
        checkpoint_interval: seconds between two checkpoints (written in the background);
            default: ``pollux-run --checkpoint-interval``.
        policies: the job's adaptation policies in order, each a built-in name
            (``pollux``: Pollux's goodput policy) or ``module:Class`` import path
            (``pollux_launch.elastic.adaptation``). Default: ``["pollux"]``; a list given
            replaces it. ``pollux-run --policy-module`` adds to it.
        decide_every: steps between the job's decisions (what its policies see as
            ``decision_due``). Default: at least 20, more where a decision would cost
            over 0.5 % of the training time between two (very fast steps).
    """

    enabled: bool = False
    initial_batch_size: int = 1
    max_batch_size: int = 1
    micro_batch_size_range: tuple[int, int] = (1, 1)
    lr_scaling: str = "adascale"
    gradient_accumulation: bool = False
    report_interval: float = 30.0
    checkpoint_dir: str | None = None
    checkpoint_interval: float | None = None
    policies: tuple[str, ...] | None = None
    min_batch_size: int | None = None
    decide_every: int | None = None

    @property
    def min_micro_batch_size(self) -> int:
        return self.micro_batch_size_range[0]

    @property
    def max_micro_batch_size(self) -> int:
        return self.micro_batch_size_range[1]

    def initial_micro_batch(self, world_size: int) -> tuple[int, int]:
        """``(m, accumulation_steps)`` reaching ``initial_batch_size`` on ``world_size``
        replicas: the smallest number of micro-batches whose size fits the range.

        The total batch is then ``world_size * m * accumulation_steps``, which equals
        ``initial_batch_size`` when it divides evenly and is the nearest reachable size
        otherwise (rounded, never below one micro batch per replica).
        """
        if world_size < 1:
            raise PolluxConfigError(f"world size must be >= 1, got {world_size}")
        lo, hi = self.micro_batch_size_range
        per_replica = max(1, round(self.initial_batch_size / world_size))
        steps = 1
        if self.gradient_accumulation:
            steps = max(1, -(-per_replica // hi))  # ceil: fewest micro-batches that fit
        m = min(hi, max(lo, round(per_replica / steps)))
        return m, steps


_FIELDS = {
    "enabled": bool,
    "initial_batch_size": int,
    "max_batch_size": int,
    "min_batch_size": int,
    "micro_batch_size_range": list,
    "lr_scaling": str,
    "gradient_accumulation": bool,
    "report_interval": float,
    "checkpoint_dir": str,
    "checkpoint_interval": float,
    "policies": list,
    "decide_every": int,
}


def load_ds_config(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ds_config as a fresh dict (a deep copy, or a JSON file read from ``config``)."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise PolluxConfigError(f"cannot read ds_config {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise PolluxConfigError(
                f"ds_config {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
        if not isinstance(data, dict):
            raise PolluxConfigError(f"ds_config {path} must hold a JSON object")
        return data
    raise PolluxConfigError(
        f"ds_config must be a dict or a path to a JSON file, got {type(config).__name__}")


def _type_name(t: type) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", list: "a list",
            str: "a string"}[t]


def _check_type(key: str, value: Any, want: type) -> None:
    ok = isinstance(value, (int, float) if want is float else want)
    if want in (int, float) and isinstance(value, bool):
        ok = False  # JSON true is not a batch size
    if not ok:
        raise PolluxConfigError(
            f'pollux.{key} must be {_type_name(want)}, got {json.dumps(value, default=str)}')


def parse_pollux_config(config: str | Path | Mapping[str, Any] | None) -> PolluxConfig | None:
    """Validate the ``"pollux"`` section of a ds_config (a dict or a JSON file path).

    Returns ``None`` when there is no section; a :class:`PolluxConfig` otherwise (with
    ``enabled=False`` when it is switched off: its values are still validated). Raises
    :class:`PolluxConfigError` (a ``ValueError``) with one line on any mistake.
    """
    ds = load_ds_config(config)
    if ds is None or SECTION not in ds:
        return None
    section = ds[SECTION]
    if not isinstance(section, Mapping):
        raise PolluxConfigError('the "pollux" section of the ds_config must be a JSON object')
    unknown = sorted(set(section) - set(_FIELDS))
    if unknown:
        raise PolluxConfigError(
            f"unknown key(s) in the pollux section: {', '.join(unknown)}; "
            f"valid keys are {', '.join(_FIELDS)}")
    for key, value in section.items():
        _check_type(key, value, _FIELDS[key])

    enabled = section.get("enabled", False)
    if "initial_batch_size" not in section:
        if enabled:
            raise PolluxConfigError(
                "pollux.initial_batch_size is required: the total batch size your "
                "hyper-parameters were tuned for")
    init = section.get("initial_batch_size", 1)
    if init < 1:
        raise PolluxConfigError(f"pollux.initial_batch_size must be >= 1, got {init}")
    max_bsz = section.get("max_batch_size", init)
    if max_bsz < init:
        raise PolluxConfigError(
            f"pollux.max_batch_size ({max_bsz}) must be >= initial_batch_size ({init})")

    min_bsz = section.get("min_batch_size")
    if min_bsz is not None and not 1 <= min_bsz <= max_bsz:
        raise PolluxConfigError(
            f"pollux.min_batch_size ({min_bsz}) must be in [1, max_batch_size ({max_bsz})]")

    rng = section.get("micro_batch_size_range", [1, init])
    if len(rng) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in rng):
        raise PolluxConfigError(
            f"pollux.micro_batch_size_range must be [min, max] integers, got {json.dumps(rng)}")
    lo, hi = rng
    if not 1 <= lo <= hi:
        raise PolluxConfigError(
            f"pollux.micro_batch_size_range [{lo}, {hi}] needs 1 <= min <= max")
    if lo > max_bsz:
        raise PolluxConfigError(
            f"pollux.micro_batch_size_range min ({lo}) exceeds max_batch_size ({max_bsz}): "
            "no allocation could run")
    accumulate = section.get("gradient_accumulation", False)
    if not accumulate and lo > init:
        raise PolluxConfigError(
            f"pollux.micro_batch_size_range min ({lo}) exceeds initial_batch_size ({init}): "
            "lower the min or raise initial_batch_size")
    if not accumulate and hi < init:
        raise PolluxConfigError(
            f"pollux.initial_batch_size ({init}) needs more than micro_batch_size_range max "
            f"({hi}) per GPU on one GPU; set gradient_accumulation to true or raise the max")

    lr = section.get("lr_scaling", "adascale")
    rules = _lr_rule_names()
    if lr not in rules:
        raise PolluxConfigError(
            f"pollux.lr_scaling {lr!r} is not a known rule; choose one of {', '.join(rules)}")

    report = section.get("report_interval", 30.0)
    if not 0 < report < float("inf"):
        raise PolluxConfigError(f"pollux.report_interval must be > 0 seconds, got {report}")

    ckpt_dir = section.get("checkpoint_dir")
    if ckpt_dir is not None and not ckpt_dir.strip():
        raise PolluxConfigError("pollux.checkpoint_dir must name a folder, got an empty string")
    ckpt_every = section.get("checkpoint_interval")
    if ckpt_every is not None and not 0 < ckpt_every < float("inf"):
        raise PolluxConfigError(
            f"pollux.checkpoint_interval must be > 0 seconds, got {ckpt_every}")

    decide_every = section.get("decide_every")
    if decide_every is not None and decide_every < 1:
        raise PolluxConfigError(f"pollux.decide_every must be >= 1 step, got {decide_every}")

    policies = section.get("policies")
    if policies is not None:
        from pollux_launch.elastic.adaptation import PolicyError, check_spec

        for p in policies:
            if not isinstance(p, str):
                raise PolluxConfigError(
                    "pollux.policies entries must be strings (module:Class or a built-in "
                    f"name), got {json.dumps(p, default=str)[:80]}")
        try:
            policies = tuple(check_spec(p) for p in policies)
        except PolicyError as exc:
            raise PolluxConfigError(f"pollux.policies: {str(exc).removeprefix('--policy-module ')}"
                                    ) from None

    cfg = PolluxConfig(enabled=enabled, initial_batch_size=init, max_batch_size=max_bsz,
                       micro_batch_size_range=(lo, hi), lr_scaling=lr, min_batch_size=min_bsz,
                       gradient_accumulation=accumulate, report_interval=float(report),
                       checkpoint_dir=ckpt_dir,
                       checkpoint_interval=None if ckpt_every is None else float(ckpt_every),
                       policies=policies, decide_every=decide_every)
    if enabled:
        _check_conflicts(ds, cfg)
    return cfg


def _lr_rule_names() -> list[str]:
    from pollux_launch.goodput import lr_rules  # pure numpy module

    return [*lr_rules(), NO_LR_SCALING]


def _check_conflicts(ds: Mapping[str, Any], cfg: PolluxConfig) -> None:
    """Reject ds_config values that fight the enabled section."""
    elastic = ds.get("elasticity")
    if isinstance(elastic, Mapping) and elastic.get("enabled", False):
        raise PolluxConfigError(
            "DeepSpeed's elasticity section and the pollux section are both enabled; both "
            "choose the batch size - set elasticity.enabled to false")
    zero = ds.get("zero_optimization")
    if isinstance(zero, Mapping) and zero.get("stage") == 3:
        raise PolluxConfigError(
            "zero_optimization.stage 3 with the pollux section: ZeRO-3 does not re-shard "
            "live yet - use stage 1 or 2 for a live job, or remove the pollux section to run "
            "ZeRO-3 fixed or restart-elastic (pollux-run --elasticity restart)")
    bsz = ds.get("train_batch_size")
    if bsz is not None and bsz != cfg.initial_batch_size:
        raise PolluxConfigError(
            f"train_batch_size={bsz} conflicts with pollux.initial_batch_size="
            f"{cfg.initial_batch_size}; remove train_batch_size (pollux sets it)")
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro == "auto":
        raise PolluxConfigError(
            'train_micro_batch_size_per_gpu="auto" (an HF Accelerate placeholder) with the '
            "pollux section: remove it (pollux sets it)")
    lo, hi = cfg.micro_batch_size_range
    if micro is not None and not (isinstance(micro, int) and lo <= micro <= hi):
        raise PolluxConfigError(
            f"train_micro_batch_size_per_gpu={micro} lies outside pollux.micro_batch_size_range "
            f"[{lo}, {hi}]; remove it (pollux sets it)")
    gas = ds.get("gradient_accumulation_steps")
    if gas is not None and (not isinstance(gas, int) or isinstance(gas, bool) or gas < 1):
        raise PolluxConfigError(
            f"gradient_accumulation_steps={gas!r} must be a positive integer; remove it "
            "(pollux sets it)")
    if gas is not None and gas != 1 and not cfg.gradient_accumulation:
        raise PolluxConfigError(
            f"gradient_accumulation_steps={gas} but pollux.gradient_accumulation is false; "
            "remove gradient_accumulation_steps or set pollux.gradient_accumulation to true")


def derive_ds_config(ds_config: str | Path | Mapping[str, Any], world_size: int,
                     micro_batch_size: int, accumulation_steps: int) -> dict[str, Any]:
    """The ds_config DeepSpeed should see for ``world_size`` replicas, per-GPU micro batch
    ``micro_batch_size`` and ``accumulation_steps`` micro-batches per optimizer step
    (DeepSpeed's ``gradient_accumulation_steps``, >= 1).

    A new dict: the ``"pollux"`` section removed, the three batch keys set consistently
    (``train_batch_size = world_size * micro_batch_size * accumulation_steps``).
    """
    for name, value in (("world_size", world_size), ("micro_batch_size", micro_batch_size),
                        ("accumulation_steps", accumulation_steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PolluxConfigError(f"{name} must be a positive integer, got {value!r}")
    ds = load_ds_config(ds_config)
    assert ds is not None
    ds.pop(SECTION, None)
    ds["train_micro_batch_size_per_gpu"] = micro_batch_size
    ds["gradient_accumulation_steps"] = accumulation_steps
    ds["train_batch_size"] = world_size * micro_batch_size * accumulation_steps
    return ds
