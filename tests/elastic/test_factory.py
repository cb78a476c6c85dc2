"""The one construction of a worker side (``elastic.factory``): every adapter builds its
tuner, hints reporter, policies and controller through it, from one ``JobDescription``
whose environment was read once; the interfaces around it (``MemberRemoved``, the
error root, the policy registry) and the import cycles it removed."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from pollux_launch import keys
from pollux_launch.adapters.torch.job import JobMembership
from pollux_launch.elastic.adaptation import (
    ADAPTATION_POLICIES,
    AdaptationPolicy,
    GoodputPolicy,
    PolicyError,
    check_spec,
    load_policy,
    register_adaptation_policy,
)
from pollux_launch.elastic.checkpoint import CheckpointError
from pollux_launch.elastic.controller import ElasticController, LeaveJob
from pollux_launch.elastic.factory import JobDescription, WorkerEnv, build_controller
from pollux_launch.elastic.protocols import MemberRemoved
from pollux_launch.errors import PolluxError, UserError
from pollux_launch.messages import JobHints, decode
from pollux_launch.registry import Registry
from pollux_launch.rendezvous.protocol import WorkerRemoved
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.profile import StepProfile

ROOT = Path(__file__).resolve().parents[2]
WORKER_SIDES = {  # each adapter's worker side
    "torch": ROOT / "adapters/torch/trainer.py",
    "deepspeed": ROOT / "adapters/deepspeed/elastic.py",
    "horovod": ROOT / "adapters/horovod/control.py",
}
# what only the factory may construct or call
BUILT_BY_THE_FACTORY = {"GoodputTuner", "TunerConfig", "HintsReporter", "ElasticController",
                        "StatisticalProgress", "resolve_policies", "batch_range", "from_env",
                        "from_environ"}


class _Probe(AdaptationPolicy):
    name = "probe"


class _Group:
    rank, world_size, num_nodes = 0, 1, 1

    def broadcast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        return tensor

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.reshape(1, -1)


class _Hooks:
    def __init__(self) -> None:
        self.m, self.s = 8, 0

    def batch(self) -> tuple[int, int]:
        return self.m, self.s

    def apply_batch(self, m: int, s: int) -> None:
        self.m, self.s = m, s

    def set_lr_factor(self, factor: float) -> None:
        pass

    def grad_stats(self) -> GradNoise | None:
        return GradNoise(sqr=1.0, var=2.0, init_batch_size=8)

    def capture(self, controller_state: dict[str, Any]) -> None:
        return None

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool):
        return None

    def leave(self) -> None:
        self.left = True

    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool):
        return None

    def checkpoint_needs_peers(self) -> bool:
        return False

    def restore_checkpoint(self, state: dict[str, Any]):
        raise ValueError("none here")


class _Store:
    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes]] = []

    def put(self, key: str, value: bytes) -> None:
        self.puts.append((key, value))


class _Identity:
    name = "job-a"

    def __init__(self) -> None:
        self.store = _Store()


def _job(**kw: Any) -> JobDescription:
    base: dict[str, Any] = dict(init_batch_size=8, max_batch_size=64, local_bsz_bounds=(4, 32),
                                env=WorkerEnv.read({}))
    return JobDescription(**{**base, **kw})


# -- every adapter goes through the factory ------------------------------------------------
def _called_names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return out


def _spy_on(monkeypatch, module: Any) -> list[tuple[JobDescription, ElasticController]]:
    """What ``module`` builds through the factory: (description, controller) per call."""
    made: list[tuple[JobDescription, ElasticController]] = []

    def spy(description: JobDescription, *args: Any, **kw: Any) -> ElasticController:
        made.append((description, build_controller(description, *args, **kw)))
        return made[-1][1]

    monkeypatch.setattr(module, "build_controller", spy)
    return made


@pytest.mark.parametrize("adapter", sorted(WORKER_SIDES))
def test_every_adapters_worker_side_is_built_by_the_factory_alone(adapter):
    called = _called_names(ast.parse(WORKER_SIDES[adapter].read_text()))
    assert "build_controller" in called
    assert "JobDescription" in called
    assert not called & BUILT_BY_THE_FACTORY, f"{adapter} builds {called & BUILT_BY_THE_FACTORY}"


def test_the_torch_trainer_is_built_through_the_factory(monkeypatch):
    import pollux_launch.adapters.torch as pollux
    from pollux_launch.adapters.torch import job as job_module
    from pollux_launch.adapters.torch import trainer as trainer_module

    for var in ("POLLUX_JOB", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("POLLUX_MIN_BATCH_SIZE", "64")
    monkeypatch.setenv("POLLUX_POLICIES", "pollux")
    monkeypatch.setattr(job_module, "_current", None)
    made = _spy_on(monkeypatch, trainer_module)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    model = torch.nn.Linear(4, 2)
    loader = pollux.AdaptiveDataLoader(data, batch_size=32, max_batch_size=128,
                                       local_bsz_bounds=(16, 128))
    probe = _Probe()
    trainer = pollux.ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    loader, policies=[probe], decide_every=3)
    try:
        [(description, controller)] = made
        assert trainer.controller is controller and trainer.tuner is controller.tuner
        assert description.identity is trainer.job and description.decide_every == 3
        assert controller.tuner.config.min_batch_size == 64  # the environment, narrowed
        assert controller.tuner.config.max_batch_size == 128
        assert [type(p) for p in controller.policies] == [_Probe, GoodputPolicy]
        assert controller.membership is None  # a standalone worker: nothing re-forms
    finally:
        trainer.job.close()


def test_the_horovod_control_is_built_through_the_factory_at_its_first_sync(monkeypatch):
    from pollux_launch.adapters.horovod import control as control_module

    class Hvd:
        Sum = Average = Max = Min = None

        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

        def cross_size(self) -> int:
            return 1

        def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
            return tensor

    class Optimizer:
        backward_passes_per_step = 1

        def set_backward_passes_per_step(self, n: int) -> None:
            self.backward_passes_per_step = n

    class Measurement:
        profile, estimator, smoothing = StepProfile(warmup_steps=0), None, 0.999
        local_bsz, accum_steps = 8, 0

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

        def abort_step(self) -> None:
            pass

        def set_batch(self, m: int, s: int) -> None:
            self.local_bsz, self.accum_steps = m, s

        def stats(self) -> None:
            return None

    monkeypatch.setenv("POLLUX_POLICIES", "pollux")
    monkeypatch.delenv("POLLUX_STORE", raising=False)
    made = _spy_on(monkeypatch, control_module)
    measurement = Measurement()
    control = control_module.HorovodControl(Hvd(), Optimizer(), measurement, local_bsz=8,
                                            max_batch_size=64, policies=[_Probe()])
    assert control.controller is None and not made  # (M0 is known at the first sync)
    assert [type(p) for p in control.policies] == [_Probe, GoodputPolicy]  # resolved at once
    control.sync()
    [(description, controller)] = made
    assert control.controller is controller and control.tuner is controller.tuner
    assert description.init_batch_size == 16 == control.tuner.config.init_batch_size
    assert control.controller.policies == control.policies  # not resolved a second time
    assert measurement.estimator.init_batch_size == 16


def test_the_deepspeed_driver_is_built_through_the_factory(monkeypatch):
    from types import SimpleNamespace

    from pollux_launch.adapters.deepspeed import elastic as ds_elastic
    from pollux_launch.adapters.deepspeed.config import parse_pollux_config
    from pollux_launch.adapters.torch.job import ElasticJob

    class Handle:  # the engine handle as the driver uses it
        pollux = parse_pollux_config({"pollux": {
            "enabled": True, "initial_batch_size": 16, "max_batch_size": 64,
            "micro_batch_size_range": [4, 32], "lr_scaling": "none"}})
        restored_state = driver = None
        batch = (16, 1)
        grad_stats = SimpleNamespace(stats=lambda: None)

        def set_batch_size(self, micro: int, steps: int) -> None:
            self.batch = (micro, steps)

        def set_lr_factor(self, factor: float) -> None:
            self.factor = factor

    monkeypatch.setenv("POLLUX_MAX_BATCH_SIZE", "32")
    made = _spy_on(monkeypatch, ds_elastic)
    handle = Handle()
    driver = ds_elastic.ElasticDeepSpeed(handle, ElasticJob(None, None), decide_every=7)
    [(description, controller)] = made
    assert handle.driver is driver and driver.controller is controller
    assert driver.tuner is controller.tuner
    assert driver.config is description.config and driver.config.max_batch_size == 32
    assert description.decide_every == 7 and not description.adapt_lr  # lr_scaling "none"
    assert driver.progress is driver.tuner.progress and driver.tuner.profile is driver.profile
    assert driver.controller.membership is None and driver.controller.resets == 1


# -- the factory ---------------------------------------------------------------------------
def test_the_environment_is_read_once_and_narrows_the_scripts_range():
    source = {"POLLUX_MIN_BATCH_SIZE": "16", "POLLUX_MAX_BATCH_SIZE": "32"}
    env = WorkerEnv.read(source)
    source["POLLUX_MAX_BATCH_SIZE"] = "8"  # a snapshot: later changes are not seen
    job = _job(env=env)
    assert (job.config.min_batch_size, job.config.max_batch_size) == (16, 32)
    assert job.config.adaptive_batch_size
    assert not _job(max_batch_size=8).config.adaptive_batch_size
    with pytest.raises(ValueError, match="below the initial batch size"):
        _job(env=WorkerEnv.read({"POLLUX_MAX_BATCH_SIZE": "4"}))  # when it is described


def test_build_controller_wires_the_tuner_reporter_and_policies():
    who = _Identity()
    job = _job(policies=[_Probe()], identity=who, decide_every=4, adapt_lr=False,
               env=WorkerEnv.read({"POLLUX_POLICIES": "pollux"}), dataset_size=800)
    ctl = build_controller(job, _Hooks(), _Group(), StepProfile(warmup_steps=0))
    assert (ctl.decide_every, ctl.adapt_lr) == (4, False)
    assert [type(p) for p in ctl.policies] == [_Probe, GoodputPolicy]
    assert ctl.tuner.config is job.config and ctl.tuner.progress.dataset_size == 800
    assert ctl.tuner._grad_stats() is None  # no decision yet
    ctl.start(fresh=True, sync=False)
    assert ctl.tuner._grad_stats() is ctl.grad is not None  # the last decision's statistics
    assert ctl.tuner.report_due()
    ctl.reporter.report(ctl.tuner, lambda: ctl.tuner.hints(1, 1, 8, 0))
    [(key, value)] = who.store.puts  # the reporter writes; the tuner only says when
    assert key == keys.job("job-a", "hints") and decode(JobHints, value).init_batch_size == 8
    assert not ctl.tuner.report_due()
    given = build_controller(_job(env=job.env), _Hooks(), _Group(), StepProfile(),
                             policies=ctl.policies)  # resolved already: not again
    assert given.policies == ctl.policies


def test_without_an_identity_the_hints_go_where_the_environment_says():
    assert _job().hints_reporter().job is None
    reporter = _job(env=WorkerEnv.read({"POLLUX_JOB": "j"})).hints_reporter()
    assert reporter.job == "j" and reporter._store() is None  # no POLLUX_STORE: none


def test_a_removed_member_leaves_the_job():
    class Removed:
        elastic, name, store = True, "j", None

        def vote(self, ending: bool) -> tuple[bool, bool]:
            return True, ending

        def next_round(self) -> Any:
            raise WorkerRemoved("not in round 2")

        def credit_resumed(self, progress: float) -> None:
            pass

        def record_rollback(self, lost: float) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    job = Removed()
    membership = JobMembership(job)  # the rendezvous's signal, translated
    with pytest.raises(MemberRemoved, match="not in round 2"):
        membership.next_round()
    hooks = _Hooks()
    ctl = build_controller(_job(), hooks, _Group(), StepProfile(), membership=membership)
    ctl.start(fresh=False, sync=False)
    with pytest.raises(LeaveJob) as left:
        ctl.after_step(8)
    assert left.value.code == 0 and hooks.left and job.closed


# -- errors, registry, cycles ----------------------------------------------------------------
def test_errors_have_the_root_and_keep_their_builtin_base():
    from pollux_launch.adapters.deepspeed.elastic import PeerFailure

    for cls, builtin in ((PolicyError, ValueError), (CheckpointError, ValueError)):
        assert issubclass(cls, UserError) and issubclass(cls, builtin)
    assert issubclass(PeerFailure, PolluxError) and issubclass(PeerFailure, RuntimeError)
    assert not issubclass(PeerFailure, UserError)
    assert issubclass(MemberRemoved, PolluxError)
    assert issubclass(LeaveJob, SystemExit) and not issubclass(LeaveJob, PolluxError)


def test_the_adaptation_policies_are_a_registry():
    assert isinstance(ADAPTATION_POLICIES, Registry)
    assert "pollux" in ADAPTATION_POLICIES and isinstance(load_policy("pollux"), GoodputPolicy)
    with pytest.raises(PolicyError, match=r"or a built-in \(pollux\)"):
        check_spec("not a spec")
    register_adaptation_policy("probe-test", _Probe)
    try:
        assert check_spec(" probe-test ") == "probe-test"
        assert isinstance(load_policy("probe-test"), _Probe)
        with pytest.raises(ValueError, match="already registered"):
            register_adaptation_policy("probe-test", _Probe)
    finally:
        ADAPTATION_POLICIES.unregister("probe-test")
    assert "probe-test" not in ADAPTATION_POLICIES


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions, TYPE_CHECKING included),
    as written (relative imports resolved within its package)."""
    package = path.parent
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                stem = str(base.relative_to(ROOT)).replace("/", ".")
                mod = f"{stem}.{node.module}" if node.module else stem
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("a, b, a_name, b_name", [
    ("pollux_launch/elastic/adaptation.py", "pollux_launch/elastic/controller.py",
     "pollux_launch.elastic.adaptation", "pollux_launch.elastic.controller"),
    ("adapters/deepspeed/elastic.py", "adapters/deepspeed/engine.py",
     "adapters.deepspeed.elastic", "adapters.deepspeed.engine"),
])
def test_no_import_cycle(a, b, a_name, b_name):
    def names(module: str) -> set[str]:  # its own, and as installed (pollux_launch.adapters)
        return {module, module.replace("adapters.", "pollux_launch.adapters.", 1)}

    assert names(a_name) & _imports(ROOT / b)  # (b uses a)
    assert not names(b_name) & _imports(ROOT / a)  # and a does not use b, even lazily
