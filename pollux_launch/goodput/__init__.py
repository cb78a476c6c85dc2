"""Pure goodput core of pollux-launch (Pollux, OSDI'21, Sec. 3-4).

* :mod:`.throughput` - throughput model T_iter(N, K, m, s) (Eqn 7-11), its fit,
  the exploration cap
* :mod:`.efficiency` - gradient statistics and statistical efficiency (Eqn 4-6)
* :mod:`.function`   - goodput and the best (m, s) per allocation (Eqn 13)
* :mod:`.speedup`    - memoised speedup relative to a reference allocation (Eqn 15)
* :mod:`.capacity`   - memoised throughput at the best batch size, no efficiency (Eqn 7-11)
* :mod:`.lr`         - learning-rate scaling rules (linear, sqrt, AdaScale, LEGW)

Numpy arrays and frozen dataclasses in, arrays out; no I/O, clocks or globals.
"""

from .capacity import ThroughputFunction
from .efficiency import GradParams, efficiency, gain, noise_scale
from .function import GoodputFunction, GridCache
from .lr import LEGWState, lr_rules, register_lr_rule, scale_lr, unregister_lr_rule
from .speedup import SpeedupFunction
from .throughput import (
    PerfParams,
    exploration_cap,
    fit_perf_params,
    predict_grad_time,
    predict_step_time,
    predict_sync_time,
)

__all__ = [
    "GoodputFunction",
    "GradParams",
    "GridCache",
    "LEGWState",
    "PerfParams",
    "SpeedupFunction",
    "ThroughputFunction",
    "efficiency",
    "exploration_cap",
    "fit_perf_params",
    "gain",
    "lr_rules",
    "noise_scale",
    "predict_grad_time",
    "predict_step_time",
    "predict_sync_time",
    "register_lr_rule",
    "scale_lr",
    "unregister_lr_rule",
]
