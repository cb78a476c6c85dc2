"""Throughput model of one job: time per iteration as a function of its resources.

Pollux (OSDI'21) Sec. 3.2, Eqn 7-11, for ``N`` nodes, ``K`` replicas (GPUs), per-GPU
batch ``m`` and ``s`` gradient-accumulation steps::

    T_grad(m)      = alpha_grad + beta_grad * m ** grad_exponent                  (Eqn 9)
    T_sync(N, K)   = 0                                               if K == 1
                   = alpha_local + beta_local * (K - 2)              if N == 1    (Eqn 10)
                   = alpha_node + beta_node * (K - 2)
                     + node_contention * (1 - N / K) / (N - 1) ** 2  if N > 1
    T_iter         = s * T_grad + (T_grad ** gamma + T_sync ** gamma) ** (1 / gamma)  (Eqn 11)
    THROUGHPUT     = M / T_iter,   M = K * m * (s + 1)

Two bounded extensions of the paper's model, both measured on the Pollux traces
(``benchmarks/goodput_fit.py``) and both reducing to Eqn 7-11 at their defaults:

* ``grad_exponent`` (default 1, bounds [0.5, 2]): compute time is not always linear in
  ``m`` (deepspeech2 pads sequences: super-linear; ncf is latency-bound: sub-linear).
* ``node_contention`` (default 0): replicas that share a node also share its network
  link; ``1 - N/K`` is the fraction of co-located replicas. Its weight fades as
  ``1/(N-1)^2`` because a ring spanning more nodes spreads the traffic (in the traces,
  8 GPUs of yolov3 synchronise in 1.24 s on 2 nodes but in 0.70 s on 4).

Everything here is pure and vectorised; :func:`fit_perf_params` is the only function
that iterates (a bounded Levenberg-Marquardt least-squares fit with analytic Jacobian).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

__all__ = [
    "PerfParams",
    "exploration_cap",
    "fit_perf_params",
    "predict_grad_time",
    "predict_step_time",
    "predict_sync_time",
]

_TINY = 1e-12  # lower bound of every time parameter: keeps logs finite
_GAMMA_BOUNDS = (1.0, 10.0)
_EXPONENT_BOUNDS = (0.5, 2.0)
_COMPUTE_WEIGHT = 0.05  # weight of the compute-time residuals when sync_time is measured
_OPTIMISM = 3e-3  # weight of the optimistic priors (see _residuals)
_MAX_STEP = 2.0  # largest change of a log-parameter per fitting iteration


@dataclass(frozen=True)
class PerfParams:
    """Named parameters of the throughput model (Pollux Eqn 7-11 plus two extensions).

    Times are in seconds. The first seven fields are the paper's; ``grad_exponent`` and
    ``node_contention`` default to the paper's model.
    """

    alpha_grad: float  # constant part of the per-micro-batch compute time
    beta_grad: float  # compute time per sample (per sample ** grad_exponent)
    alpha_local: float  # all-reduce time within one node
    beta_local: float  # ... growth per replica beyond two
    alpha_node: float  # all-reduce time across nodes
    beta_node: float  # ... growth per replica beyond two
    gamma: float  # overlap of compute and sync: 1 = none, 10 ~ perfect
    grad_exponent: float = 1.0
    node_contention: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"PerfParams.{f.name} must be a finite number >= 0, got {value!r}")
        if not _GAMMA_BOUNDS[0] <= self.gamma <= _GAMMA_BOUNDS[1]:
            raise ValueError(f"PerfParams.gamma must lie in [1, 10], got {self.gamma}")
        if not _EXPONENT_BOUNDS[0] <= self.grad_exponent <= _EXPONENT_BOUNDS[1]:
            raise ValueError(
                f"PerfParams.grad_exponent must lie in [0.5, 2], got {self.grad_exponent}"
            )

    def to_dict(self) -> dict[str, float]:
        """Plain JSON-able mapping (the ``perf_params`` of ``messages.JobHints``)."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerfParams:
        """Inverse of :meth:`to_dict`; unknown names are an error, not silently dropped."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown PerfParams fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{k: float(v) for k, v in data.items()})


def _arrays(*args: Any) -> list[np.ndarray]:
    return [np.asarray(a, dtype=float) for a in np.broadcast_arrays(*args)]


def predict_grad_time(params: PerfParams, local_bsz: Any) -> np.ndarray:
    """T_grad(m): compute time of one micro-batch of ``m`` samples per GPU (Eqn 9)."""
    m = np.asarray(local_bsz, dtype=float)
    return params.alpha_grad + params.beta_grad * m**params.grad_exponent


def predict_sync_time(params: PerfParams, num_nodes: Any, num_replicas: Any) -> np.ndarray:
    """T_sync(N, K): gradient all-reduce time (Eqn 10 plus the node-contention term)."""
    n, k = _arrays(num_nodes, num_replicas)
    k_safe = np.maximum(k, 1.0)
    local = params.alpha_local + params.beta_local * (k - 2)
    node = (
        params.alpha_node
        + params.beta_node * (k - 2)
        + params.node_contention * (1 - n / k_safe) / np.maximum(n - 1, 1) ** 2
    )
    sync = np.where(n > 1, node, local)
    return np.where(k > 1, np.maximum(sync, 0.0), 0.0)


def predict_step_time(
    params: PerfParams, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any
) -> np.ndarray:
    """T_iter: seconds per optimizer step with ``accum_steps`` extra micro-batches (Eqn 11)."""
    n, k, m, s = _arrays(num_nodes, num_replicas, local_bsz, accum_steps)
    grad = predict_grad_time(params, m)
    sync = predict_sync_time(params, n, k)
    g = params.gamma
    return s * grad + (grad**g + sync**g) ** (1 / g)


def exploration_cap(max_profiled_replicas: int) -> int:
    """Most replicas the scheduler may try: 2x the most a job has run on (Pollux Sec. 4.1).

    A job that has not run yet (0 profiled replicas) may be given one GPU.
    """
    if max_profiled_replicas < 0:
        raise ValueError(f"max_profiled_replicas must be >= 0, got {max_profiled_replicas}")
    return max(1, 2 * int(max_profiled_replicas))


# --------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------

# Parameter vector order inside the fit (matches PerfParams' field order).
_NAMES = [f.name for f in fields(PerfParams)]
_AG, _BG, _AL, _BL, _AN, _BN, _G, _P, _C = range(len(_NAMES))
_LOG_SCALED = np.array([i not in (_G, _P) for i in range(len(_NAMES))])


def _validated(name: str, value: Any, size: int | None) -> np.ndarray:
    arr = np.asarray(value, dtype=float).ravel()
    if size is not None and arr.size != size:
        raise ValueError(
            f"fit_perf_params: {name} has {arr.size} values but num_nodes has {size}; "
            "pass one value per observation"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"fit_perf_params: {name} contains NaN or infinite values")
    return arr


class _Observations:
    """Observations grouped by distinct configuration (N, K, m, s).

    The squared log error of a group equals count * (log pred - mean log T)^2 plus a
    constant, so fitting the groups' mean logs with their counts as weights is exact and
    much cheaper than fitting every row.
    """

    def __init__(self, num_nodes, num_replicas, local_bsz, accum_steps, step_time, sync_time):
        n = _validated("num_nodes", num_nodes, None)
        size = n.size
        if size == 0:
            raise ValueError("fit_perf_params: no observations; profile at least one step")
        k = _validated("num_replicas", num_replicas, size)
        m = _validated("local_bsz", local_bsz, size)
        s = _validated("accum_steps", accum_steps, size)
        t = _validated("step_time", step_time, size)
        if np.any(n < 1) or np.any(k < n):
            raise ValueError("fit_perf_params: need 1 <= num_nodes <= num_replicas per row")
        if np.any(m <= 0):
            raise ValueError("fit_perf_params: local_bsz must be > 0 (samples per GPU)")
        if np.any(s < 0):
            raise ValueError("fit_perf_params: accum_steps must be >= 0")
        if np.any(t <= 0):
            raise ValueError("fit_perf_params: step_time must be > 0 seconds")
        # Group identical configurations (lexsort + run boundaries: cheaper than
        # np.unique(axis=0)).
        order = np.lexsort((s, m, k, n))
        keys = np.stack([n[order], k[order], m[order], s[order]])
        starts = np.ones(size, dtype=bool)
        starts[1:] = np.any(keys[:, 1:] != keys[:, :-1], axis=0)
        inverse = np.empty(size, dtype=np.intp)
        inverse[order] = np.cumsum(starts) - 1
        counts = np.bincount(inverse)
        self.n, self.k, self.m, self.s = (row[starts] for row in keys)
        self.weight = counts / size
        self.log_step = np.bincount(inverse, np.log(t)) / counts
        self.log_compute = None
        if sync_time is not None:
            sync = _validated("sync_time", sync_time, size)
            if np.any(sync < 0):
                raise ValueError("fit_perf_params: sync_time must be >= 0 seconds")
            # The non-overlapped sync part is measured: the rest is s+1 micro-batches.
            compute = np.maximum(t - sync, 0.05 * t) / (s + 1)
            self.log_compute = np.bincount(inverse, np.log(compute)) / counts
            self.log_sync = np.bincount(inverse, np.log(np.maximum(sync, _TINY))) / counts
        self.single = self.k == 1
        self.local = (self.n == 1) & (self.k > 1)
        self.multi = self.n > 1
        self.log_m = np.log(self.m)
        self.sqrt_weight = np.sqrt(self.weight)
        self.km2 = self.k - 2
        self.contention = (1 - self.n / self.k) / np.maximum(self.n - 1, 1) ** 2


def _initial(obs: _Observations) -> np.ndarray:
    """Data-driven starting point (times from the observations themselves)."""
    step = np.exp(obs.log_step)
    if obs.log_compute is not None:
        compute = np.exp(obs.log_compute)
        sync = np.exp(obs.log_sync)
    else:
        compute = np.where(obs.single, step, 0.5 * step) / (obs.s + 1)
        sync = np.where(obs.single, 0.0, 0.5 * step)
    scale = float(np.median(compute))
    x = np.zeros(len(_NAMES))
    if np.unique(obs.m).size >= 2:
        slope, intercept = np.polyfit(obs.m, compute, 1, w=np.sqrt(obs.weight))
        slope = max(slope, 1e-3 * scale / obs.m.max())
        intercept = min(max(intercept, 0.05 * scale), scale)
    else:
        intercept = 0.5 * scale
        slope = 0.5 * scale / obs.m[0]
    x[_AG], x[_BG] = intercept, slope
    local = float(np.median(sync[obs.local])) if obs.local.any() else 0.0
    node = float(np.median(sync[obs.multi])) if obs.multi.any() else local
    x[_AL], x[_BL] = max(local, 1e-3 * scale), 0.01 * max(local, 1e-3 * scale)
    x[_AN], x[_BN] = max(node, 1e-3 * scale), 0.01 * max(node, 1e-3 * scale)
    x[_C] = 0.1 * max(node, 1e-3 * scale)
    x[_G], x[_P] = 1.5, 1.0
    return x


def _free_and_tied(obs: _Observations) -> tuple[np.ndarray, dict[int, int], dict[int, float]]:
    """Which parameters the observations can determine (Pollux's exploration priors).

    A parameter the job has not been able to observe is held *optimistic* (no cost
    beyond what was seen), so the scheduler is drawn to try the configurations that
    would reveal it. Returns (free mask, tied {param: source}, fixed {param: value}).
    """
    free = np.ones(len(_NAMES), dtype=bool)
    tied: dict[int, int] = {}
    fixed: dict[int, float] = {}
    distinct_m = np.unique(obs.m).size
    if distinct_m < 3:
        fixed[_P] = 1.0  # the exponent needs three batch sizes; linear until then
    if distinct_m < 2:
        fixed[_AG] = float("nan")  # half the observed compute time, set by the caller
    local_k = np.unique(obs.k[obs.local])
    multi_keys = np.unique(np.stack([obs.n[obs.multi], obs.k[obs.multi]], 1), axis=0)
    if local_k.size == 0:
        fixed[_AL] = fixed[_BL] = _TINY  # never synchronised within a node: free sync
    elif local_k.size == 1:
        fixed[_BL] = _TINY  # no growth with replicas seen (yet)
    if multi_keys.shape[0] == 0:
        # Never ran across nodes: assume the network is as fast as the node's bus.
        tied[_AN], tied[_BN] = _AL, _BL
        fixed[_C] = _TINY
    else:
        if np.unique(multi_keys[:, 1]).size == 1:
            fixed[_BN] = _TINY
        crowded = multi_keys[:, 1] > multi_keys[:, 0]
        if multi_keys.shape[0] < 3 or not crowded.any():
            fixed[_C] = _TINY
    if not (obs.local.any() or obs.multi.any()):
        fixed[_G] = 1.0  # nothing to overlap with
    for i in list(tied) + list(fixed):
        free[i] = False
    return free, tied, fixed


def _residuals(x: np.ndarray, obs: _Observations, compute_weight: float):
    """Weighted log residuals of step time (and compute time) and their Jacobian.

    ``x`` holds all parameters in natural units. The loss is ``r @ r``: the mean squared
    log error (RMSLE squared) of step time with each configuration weighted by its
    share of the observations. Returns (r, dr/dx) with dr/dx of shape (len(r), 9).
    """
    ag, bg, al, bl, an, bn, g, p, c = x
    s, km2, contention = obs.s, obs.km2, obs.contention
    m_p = np.exp(p * obs.log_m)
    grad = ag + bg * m_p
    sync = np.where(obs.multi, an + bn * km2 + c * contention, al + bl * km2)
    sync = np.maximum(sync, _TINY)
    # base = (grad^g + sync^g)^(1/g) = grad * (1 + q)^(1/g) with q = (sync/grad)^g;
    # single-GPU rows have no sync at all (q = 0, base = grad).
    q = np.where(obs.single, 0.0, (sync / grad) ** g)
    log1q = np.log1p(q)
    d_base_d_grad = np.exp((1 / g - 1) * log1q)  # (grad/base)^(g-1)
    base = grad * d_base_d_grad * (1 + q)
    step = s * grad + base
    sw = obs.sqrt_weight
    d_log = sw / step  # d r / d step
    d_grad = d_log * (s + d_base_d_grad)
    d_sync = d_log * q * d_base_d_grad * grad / sync
    d_gamma = d_log * base * (q * np.log(sync / grad) / (1 + q) - log1q / g) / g
    jac = np.zeros((len(step), 9))
    jac[:, _AG] = d_grad
    jac[:, _BG] = d_grad * m_p
    jac[:, _P] = d_grad * bg * m_p * obs.log_m
    d_local = d_sync * obs.local
    d_multi = d_sync * obs.multi
    jac[:, _AL] = d_local
    jac[:, _BL] = d_local * km2
    jac[:, _AN] = d_multi
    jac[:, _BN] = d_multi * km2
    jac[:, _C] = d_multi * contention
    jac[:, _G] = d_gamma
    resid = sw * (np.log(step) - obs.log_step)
    if compute_weight and obs.log_compute is not None:
        cw = math.sqrt(compute_weight) * sw
        cres = cw * (np.log(grad) - obs.log_compute)
        cjac = np.zeros_like(jac)
        d_cgrad = cw / grad
        cjac[:, _AG] = d_cgrad
        cjac[:, _BG] = d_cgrad * m_p
        cjac[:, _P] = d_cgrad * bg * m_p * obs.log_m
        resid = np.concatenate([resid, cres])
        jac = np.concatenate([jac, cjac])
    # A faint pull towards little sync growth per replica (beta/alpha) and little hidden
    # (overlapped) sync (gamma -> 1): irrelevant when the data determine these, it picks
    # the optimistic model when they do not.
    lam, lam_g = _OPTIMISM, _OPTIMISM / 3
    reg = np.array([lam * bl / al, lam * bn / an, lam_g * (g - 1)])
    rjac = np.zeros((3, 9))
    rjac[0, _BL], rjac[0, _AL] = lam / al, -lam * bl / al**2
    rjac[1, _BN], rjac[1, _AN] = lam / an, -lam * bn / an**2
    rjac[2, _G] = lam_g
    return np.concatenate([resid, reg]), np.concatenate([jac, rjac])


def fit_perf_params(
    num_nodes: Any,
    num_replicas: Any,
    local_bsz: Any,
    accum_steps: Any,
    step_time: Any,
    sync_time: Any = None,
    init: PerfParams | None = None,
) -> PerfParams:
    """Fit :class:`PerfParams` to a job's own observations (Pollux Sec. 4.1).

    One row per observation (or per averaged configuration): nodes ``N``, replicas ``K``,
    per-GPU batch ``m``, accumulation steps ``s``, measured seconds per optimizer step
    ``T_iter`` and, optionally, the part of it spent synchronising gradients. Minimises
    the RMSLE of ``T_iter`` (plus, when ``sync_time`` is given, a small weight on the
    RMSLE of the compute time, which separates T_grad from T_sync with few
    observations) by bounded Levenberg-Marquardt on log-scaled parameters with an
    analytic Jacobian, under bounds ``a, b >= 0``, ``1 <= gamma <= 10``. Parameters the
    observations cannot determine yet are held at optimistic priors (see
    ``_free_and_tied``); faint priors towards little sync growth and little hidden
    (overlapped) sync pick the optimistic model where the data leave a choice.

    ``init`` (optional) warm-starts the search from a previous fit of the same job (an
    agent refitting after a few new observations): its free parameters start from
    ``init``'s values, except those at the numerical floor, which start from the
    data-driven guess. The optimum is the same up to the solver's tolerance; far fewer
    iterations reach it.

    Raises ValueError on empty, mismatched or non-positive inputs.
    """
    obs = _Observations(num_nodes, num_replicas, local_bsz, accum_steps, step_time, sync_time)
    x0 = _initial(obs)
    free, tied, fixed = _free_and_tied(obs)
    if init is not None:
        if not isinstance(init, PerfParams):
            raise ValueError(f"fit_perf_params: init must be a PerfParams, got {init!r}")
        warm = np.array([getattr(init, name) for name in _NAMES], dtype=float)
        usable = free & (~_LOG_SCALED | (warm > 2 * _TINY))
        x0[usable] = warm[usable]
    if _AG in fixed:
        fixed[_AG] = x0[_AG]
    for i, v in fixed.items():
        x0[i] = v
    for i, src in tied.items():
        x0[i] = x0[src]
    idx = np.flatnonzero(free)
    logs = _LOG_SCALED[idx]
    lower = np.where(logs, math.log(_TINY), [_lower(i) for i in idx])
    upper = np.where(logs, math.log(1e6), [_upper(i) for i in idx])

    def expand(z: np.ndarray) -> np.ndarray:
        x = x0.copy()
        x[idx] = np.where(logs, np.exp(z), z)
        for i, src in tied.items():
            x[i] = x[src]
        return x

    def evaluate(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = expand(z)
        r, full = _residuals(x, obs, _COMPUTE_WEIGHT)
        for i, src in tied.items():
            full[:, src] += full[:, i]
        return r, full[:, idx] * np.where(logs, x[idx], 1.0)

    z0 = np.where(logs, np.log(np.maximum(x0[idx], _TINY)), x0[idx])
    z = _levenberg_marquardt(evaluate, np.clip(z0, lower, upper), lower, upper)
    x = expand(z)
    x = np.where(_LOG_SCALED, np.maximum(x, 0.0), x)
    params = PerfParams(*(float(v) for v in x))
    # Values at the numerical floor are zeros: report them as such.
    zeros = {name: 0.0 for name, v in zip(_NAMES, x, strict=True)
             if v <= 2 * _TINY and name not in ("gamma", "grad_exponent")}
    return replace(params, **zeros)


def _levenberg_marquardt(
    evaluate: Any, z: np.ndarray, lower: np.ndarray, upper: np.ndarray,
    max_iter: int = 200, ftol: float = 1e-7,
) -> np.ndarray:
    """Minimise ``|r(z)|^2`` within box bounds by Levenberg-Marquardt.

    Variables at a bound whose gradient points outward are held there for the step
    (active set); the rest take the damped Gauss-Newton step, clipped to the box. The
    9x9 normal equations keep each iteration a few tens of microseconds, independent
    of BLAS threading (scipy's trust-region solvers run an SVD of the full Jacobian).
    """
    r, jac = evaluate(z)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(max_iter):
        grad = jac.T @ r
        hess = jac.T @ jac
        active = ((z <= lower) & (grad > 0)) | ((z >= upper) & (grad < 0))
        free = ~active
        if not free.any():
            break
        h = hess[np.ix_(free, free)]
        diag = np.diag(h) + 1e-12 * (np.trace(h) + 1e-30)
        improved = False
        while lam < 1e12:
            try:
                step = np.linalg.solve(h + lam * np.diag(diag), -grad[free])
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            # At most a factor e^2 per iteration: a parameter that overshoots to its
            # floor (1e-12 s) would otherwise take many iterations to climb back.
            step *= min(1.0, _MAX_STEP / (np.abs(step).max() + 1e-300))
            z_new = z.copy()
            z_new[free] = np.clip(z[free] + step, lower[free], upper[free])
            r_new, jac_new = evaluate(z_new)
            cost_new = float(r_new @ r_new)
            if np.isfinite(cost_new) and cost_new < cost:
                improved = True
                break
            lam *= 4
        if not improved:
            break
        done = cost - cost_new <= ftol * cost
        z, r, jac, cost = z_new, r_new, jac_new, cost_new
        lam = max(lam / 3, 1e-9)
        if done:
            break
    return z


def _lower(i: int) -> float:
    return {_G: _GAMMA_BOUNDS[0], _P: _EXPONENT_BOUNDS[0]}.get(i, 0.0)


def _upper(i: int) -> float:
    return {_G: _GAMMA_BOUNDS[1], _P: _EXPONENT_BOUNDS[1]}.get(i, 0.0)
