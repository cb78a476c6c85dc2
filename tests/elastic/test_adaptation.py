"""Adaptation policies on the shared controller: composition, consistency, collectives,
actions and state, on a real GoodputTuner and real gloo process groups.

The controller, tuner and minimal framework hooks are those of ``test_controller``.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_controller import _Group, _Hooks, spawn_ranks
from torch.utils.data import TensorDataset

from pollux_launch.adapters.torch.data import AdaptiveDataLoader
from pollux_launch.elastic.adaptation import (
    Actions,
    AdaptationPolicy,
    GoodputPolicy,
    PolicyContext,
    PolicyError,
    fit_total,
    load_policies,
    resolve_batch,
    resolve_policies,
)
from pollux_launch.elastic.controller import ElasticController
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.profile import StepProfile
from pollux_launch.tuning.progress import StatisticalProgress
from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig

CONFIG = TunerConfig(init_batch_size=8, max_batch_size=64, local_bsz_bounds=(4, 16),
                     lr_scaling="adascale", min_gain=0.0)


def _controller(policies=None, group=None, decide_every: int = 4, loader=None
                ) -> ElasticController:
    profile = StepProfile(warmup_steps=0)
    hooks = _Hooks(profile)
    box: list[ElasticController] = []
    tuner = GoodputTuner(CONFIG, profile, lambda: box[0].grad, StatisticalProgress(8, 800))
    ctl = ElasticController(hooks, tuner, group or _Group(), decide_every=decide_every,
                            policies=policies, loader=loader)
    box.append(ctl)
    return ctl


def _train(ctl: ElasticController, steps: int) -> None:
    for _ in range(steps):
        ctl.hooks.profile.record(0.01 + 0.0001 * ctl.hooks.m)
        ctl.after_step(ctl.hooks.m)


class Cap(AdaptationPolicy):
    """A user cap on the total batch, placed after the goodput policy."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def after_step(self, ctx: PolicyContext) -> None:
        if ctx.proposed_batch_size > self.cap:
            ctx.set_batch_size(self.cap)


class Recorder(AdaptationPolicy):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []
        self.count = 0

    def on_rescale(self, ctx: PolicyContext) -> None:
        self.seen.append(("rescale", ctx.previous_world_size, ctx.world_size))

    def before_epoch(self, ctx: PolicyContext) -> None:
        self.seen.append(("before", ctx.epoch, ctx.step))

    def after_epoch(self, ctx: PolicyContext) -> None:
        self.seen.append(("after", ctx.epoch, ctx.step))

    def after_step(self, ctx: PolicyContext) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def test_batch_actions_resolve_within_the_jobs_limits():
    assert fit_total(64, 2, CONFIG) == (16, 1)  # 2 x 16 x 2: the fewest micro-batches
    assert fit_total(20, 2, CONFIG) == (10, 0)
    assert fit_total(64, 2, CONFIG, accum_steps=3) == (8, 3)
    current = (8, 0)
    assert resolve_batch(Actions(), 2, current, CONFIG) is None
    assert resolve_batch(Actions(batch_size=1000), 2, current, CONFIG) == (16, 1)  # max 64
    assert resolve_batch(Actions(batch_size=1), 1, current, CONFIG) == (4, 0)  # lo 4
    assert resolve_batch(Actions(local_bsz=99, accum_steps=2), 2, current, CONFIG) == (16, 2)
    assert resolve_batch(Actions(accum_steps=1), 2, current, CONFIG) == (4, 1)  # total kept


def test_the_default_is_the_goodput_policy_and_a_cap_composes_after_it():
    alone = _controller()
    assert [type(p) for p in alone.policies] == [GoodputPolicy]
    capped = _controller(policies=[GoodputPolicy(), Cap(12)])
    for ctl in (alone, capped):
        ctl.start(fresh=True, sync=False)
        ctl.hooks.grad = GradNoise(sqr=1.0, var=50.0, init_batch_size=8)  # noisy: grow
        _train(ctl, 12)
    assert alone.hooks.m * (alone.hooks.s + 1) > 12  # goodput alone grows past the cap
    assert capped.hooks.applied[-1] == (12, 0)  # ...the cap holds it there
    assert all(m * (s + 1) <= 12 for m, s in capped.hooks.applied)
    assert capped.lr_factor > 1.0  # the LR rule follows the capped batch


def test_lr_factor_and_replica_requests_persist_until_changed_and_state_travels():
    class Act(AdaptationPolicy):
        def after_step(self, ctx: PolicyContext) -> None:
            if ctx.step == 2:
                ctx.set_lr_factor(0.5)
                ctx.request_range(2, 4)
            if ctx.step == 6:
                ctx.set_lr_factor(None)  # back to the rule
                ctx.request_range(1)  # no request

    rec = Recorder()
    ctl = _controller(policies=[Act(), rec])
    ctl.start(fresh=True, sync=False)
    assert rec.seen == [("rescale", 0, 1)]  # the start is a new group too
    _train(ctl, 5)
    assert ctl.lr_factor == 0.5 and ctl.replica_request == (2, 4)  # decided at step 4
    state = ctl.state_dict()
    assert state["replicas"] == [2, 4] and state["policies"]["1:Recorder"] == {"count": 5}
    _train(ctl, 3)
    assert ctl.lr_factor == 1.0 and ctl.replica_request is None  # decided at step 8

    newcomer = _controller(policies=[Act(), Recorder()])
    newcomer.load_state_dict(state)
    assert newcomer.replica_request == (2, 4) and newcomer.policies[1].count == 5
    assert newcomer.lr_factor == 0.5


def test_stop_ends_the_loader_and_epochs_at_the_decision_and_epoch_hooks_run():
    class StopAt(AdaptationPolicy):
        def after_step(self, ctx: PolicyContext) -> None:
            if ctx.step == 7:
                ctx.stop()

    data = TensorDataset(torch.arange(400, dtype=torch.float32).reshape(-1, 1))
    loader = AdaptiveDataLoader(data, batch_size=8, local_bsz_bounds=(4, 16))
    rec = Recorder()
    ctl = _controller(policies=[StopAt(), rec], loader=loader)
    loader.on_step_boundary = lambda: ctl.after_step(loader.batch_size)
    ctl.start(fresh=True, sync=False)
    epochs = 0
    for _epoch in ctl.epochs(10):
        epochs += 1
        for _batch in loader:
            pass
    assert ctl.stopped and ctl.steps == 8  # proposed at step 7, decided at step 8
    assert epochs == 1 and loader.sampler.position == 64  # the epoch stopped mid-way
    assert ("before", 0, 0) in rec.seen and ("after", 0, 8) in rec.seen


def test_policies_load_by_name_and_bad_specs_are_one_line():
    assert [type(p) for p in load_policies("pollux")] == [GoodputPolicy]
    got = load_policies("pollux, test_adaptation:Recorder")
    assert [type(p).__name__ for p in got] == ["GoodputPolicy", "Recorder"]
    assert [type(p) for p in resolve_policies([], None)] == []  # an explicit list replaces
    assert [type(p).__name__ for p in resolve_policies([Cap(3)], "pollux")] == [
        "Cap", "GoodputPolicy"]
    for bad, needle in [("os.system('x')", "module:Class"), ("nosuchmod_xyz:P", "no module"),
                        ("test_adaptation:Missing", "no attribute"),
                        ("test_adaptation:CONFIG", "not an AdaptationPolicy")]:
        with pytest.raises(PolicyError, match=needle) as info:
            load_policies(bad)
        assert "\n" not in str(info.value)
    ctx = _controller().ctx
    for call in (lambda: ctx.set_batch_size(0), lambda: ctx.set_lr_factor(float("nan")),
                 lambda: ctx.request_range(3, 2), lambda: ctx.allreduce(1.0, "median")):
        with pytest.raises(PolicyError):
            call()


class Disagree(AdaptationPolicy):
    """Each rank proposes something else; collectives check what every rank gets."""

    def __init__(self) -> None:
        self.got: dict[str, Any] = {}

    def after_step(self, ctx: PolicyContext) -> None:
        r = ctx.rank
        if ctx.step == 3:
            ctx.set_batch_size(16 * (r + 1))
            ctx.set_lr_factor(1.5 + r)
            ctx.request_replicas(2 + r)
            self.got = {
                "sum": ctx.allreduce(r + 1, "sum"), "mean": ctx.allreduce(r + 1),
                "max": ctx.allreduce([r, -r], "max").tolist(),
                "min": ctx.allreduce(r + 1, "min"),
                "gather": ctx.allgather([r, 10 + r]).tolist(),
                "gather1": ctx.allgather(r * 2.0).tolist(),
                "bcast1": ctx.broadcast(7 * r + 1, src=1),
                "bcast0": ctx.broadcast([r, r], src=0).tolist(),
            }
        if ctx.step == 6 and r == 1:
            ctx.stop()  # only rank 1 wants to stop: not decided


def _worker(rank: int, port: int, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=2, timeout=datetime.timedelta(seconds=30))
    policy = Disagree()
    ctl = _controller(policies=[policy])
    ctl.start(fresh=True, sync=False)
    _train(ctl, 8)
    out.put((rank, policy.got, ctl.hooks.applied, ctl.lr_factor, ctl.replica_request,
             ctl.stopped))
    dist.destroy_process_group()


def test_replicas_that_disagree_all_apply_rank_0s_decision_and_collectives_agree():
    results, procs = spawn_ranks(_worker, 2)
    assert all(p.exitcode == 0 for p in procs)
    got = {g[0]: g[1:] for g in results}
    assert got[0] == got[1]  # the same decisions, factors and collective results everywhere
    values, applied, factor, request, stopped = got[0]
    assert values == {"sum": 3.0, "mean": 1.5, "max": [1.0, 0.0], "min": 1.0,
                      "gather": [[0.0, 10.0], [1.0, 11.0]], "gather1": [0.0, 2.0],
                      "bcast1": 8.0, "bcast0": [0.0, 0.0]}
    assert applied[-1] == (8, 0)  # rank 0's total of 16 on 2 replicas, not rank 1's 32
    assert factor == 1.5 and request == (2, 2) and not stopped


def test_a_total_batch_never_rounds_past_the_jobs_maximum():
    cfg = TunerConfig(init_batch_size=479, max_batch_size=479, local_bsz_bounds=(1, 479))
    m, s = fit_total(479, 2, cfg)
    assert 2 * m * (s + 1) <= 479
    m, s = resolve_batch(Actions(batch_size=479), 2, (479, 0), cfg)
    assert 2 * m * (s + 1) <= 479
