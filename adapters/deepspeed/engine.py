"""``initialize``: ``deepspeed.initialize`` with a ``"pollux"`` section, and the engine
handle that survives live rescales.

* No section, section disabled: exactly ``deepspeed.initialize`` (the section is removed
  from the config DeepSpeed sees).
* Section enabled, outside pollux-run (no ``POLLUX_JOB`` in the environment): plain
  DeepSpeed objects at the section's ``initial_batch_size`` for the current world size.
* Section enabled under pollux-run: the same four-tuple, but the engine is a
  :class:`PolluxEngine` handle (it forwards everything to the current
  ``DeepSpeedEngine``) and the optimizer, dataloader and scheduler are live views that
  follow the engine across rebuilds. The handle adds batch-size / accumulation changes at
  accumulation boundaries, an LR factor applied around each optimizer step (the user's
  scheduler is never overwritten), gradient-noise statistics, and :meth:`PolluxEngine.rescale`.
  The worker joins the job's live rendezvous first, and :class:`.elastic.ElasticDeepSpeed`
  makes the job goodput-adaptive and rescales it at optimizer-step boundaries (inside
  ``engine.step()``). With ``training_data`` the returned dataloader is a pollux
  ``AdaptiveDataLoader`` whose position survives rescales.

Without a GPU, ``DS_ACCELERATOR`` defaults to ``cpu`` (set before DeepSpeed is imported).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pollux_launch import env as envvars
from pollux_launch.rendezvous.process_group import release_at_exit

from . import compat
from .config import (
    PolluxConfig,
    PolluxConfigError,
    derive_ds_config,
    load_ds_config,
    parse_pollux_config,
)
from .gradients import DeepSpeedGradStats
from .state import (
    EngineState,
    capture,
    current_world_size,
    detach,
    restore,
    share_module,
    state_holders,
)

JOB_ENV = envvars.JOB
NEWCOMER_WAIT_S = 120.0  # the longest survivors keep training while a grow's newcomers start

release_at_exit(compat.release_groups)  # DeepSpeed's cached groups, whatever engines live


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None:
        return config
    if config_params is not None:
        return config_params
    return getattr(args, "deepspeed_config", None)


def _without_args_config(args: Any) -> Any:
    """``args`` with ``deepspeed_config`` cleared (DeepSpeed refuses both it and config=)."""
    if getattr(args, "deepspeed_config", None) is None:
        return args
    args = copy.copy(args)
    args.deepspeed_config = None
    return args


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None,
               policies: Any = None) -> tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize`` (same arguments, same returned
    ``(engine, optimizer, training_dataloader, lr_scheduler)``); see the module docstring.
    ``policies``: adaptation policies (``pollux_launch.elastic.AdaptationPolicy``) that
    replace the section's ``policies`` (under pollux-run only).
    Raises :class:`~.config.PolluxConfigError` for a bad ``"pollux"`` section."""
    kwargs = dict(args=args, model=model, optimizer=optimizer,
                  model_parameters=model_parameters, training_data=training_data,
                  lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
                  collate_fn=collate_fn, mesh_param=mesh_param)
    return _initialize(kwargs, distributed_port, config, config_params,
                       "elastic" if JOB_ENV in os.environ else "static", policies)


def initialize_handle(args: Any = None, model: torch.nn.Module | None = None,
                      optimizer: Any = None, model_parameters: Any = None,
                      lr_scheduler: Any = None, mpu: Any = None,
                      config: Any = None, config_params: Any = None
                      ) -> tuple[Any, Any, Any, Any]:
    """A :class:`PolluxEngine` on the process group the *caller* manages (no rendezvous,
    no agent): for custom launchers and tests, which drive ``engine.rescale(reform)``
    themselves. Needs an enabled ``"pollux"`` section; returns ``initialize``'s tuple
    (no dataloader)."""
    kwargs = dict(args=args, model=model, optimizer=optimizer,
                  model_parameters=model_parameters, training_data=None,
                  lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=None,
                  collate_fn=None, mesh_param=None)
    return _initialize(kwargs, None, config, config_params, "handle")


def _initialize(kwargs: dict[str, Any], distributed_port: int | None, config: Any,
                config_params: Any, mode: str, policies: Any = None
                ) -> tuple[Any, Any, Any, Any]:
    _default_accelerator()
    import deepspeed

    compat.check_version()
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    args = kwargs["args"]
    source = _config_source(args, config, config_params)
    pollux = parse_pollux_config(source) if source is not None else None
    if pollux is None or not pollux.enabled:
        if mode == "handle":
            raise PolluxConfigError('initialize_handle needs a "pollux" section with '
                                    '"enabled": true in the ds_config')
        if pollux is None:
            return deepspeed.initialize(config=config, config_params=config_params, **kwargs)
    ds_config = load_ds_config(source)
    assert ds_config is not None
    kwargs["args"] = _without_args_config(args)
    if not pollux.enabled:
        ds_config.pop("pollux", None)
        return deepspeed.initialize(config=ds_config, **kwargs)
    if mode == "elastic":
        return _initialize_elastic(deepspeed, kwargs, ds_config, pollux, policies)
    deepspeed.init_distributed(dist_init_required=kwargs["dist_init_required"])
    world = current_world_size()
    micro, steps = pollux.initial_micro_batch(world)
    if mode == "handle":
        handle = PolluxEngine(_Recipe.record(kwargs, ds_config), pollux, micro, steps)
        return handle, handle.live("optimizer"), None, handle.live("lr_scheduler")
    return deepspeed.initialize(config=derive_ds_config(ds_config, world, micro, steps),
                                **kwargs)


def _default_accelerator() -> None:
    """DeepSpeed on a machine without a GPU: say so (it would guess, with a warning)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def _initialize_elastic(deepspeed: Any, kwargs: dict[str, Any], ds_config: dict[str, Any],
                        pollux: PolluxConfig, policies: Any = None
                        ) -> tuple[Any, Any, Any, Any]:
    """Under pollux-run: join the job's rendezvous, build the engine for the current round
    (a newcomer to a running job receives its state), hand it to the elastic driver."""
    from pollux_launch.adapters.torch.data import AdaptiveDataLoader
    from pollux_launch.adapters.torch.job import init as join_job
    from pollux_launch.elastic.controller import checkpoint_writer
    from pollux_launch.rendezvous.protocol import RendezvousConfig

    from .elastic import ElasticDeepSpeed

    if policies is None and pollux.policies is not None:
        policies = section_policies(pollux)  # before joining: a bad entry fails fast
    data = kwargs.pop("training_data", None)
    kwargs["training_data"] = None
    recipe = _Recipe.record(kwargs, ds_config)
    compat.prewarm()  # before announcing ourselves: survivors may wait for us
    _rehearse(recipe, pollux)
    # forms this round's process group (and exports RANK, WORLD_SIZE...); newcomers take
    # long to start (DeepSpeed's import and a rehearsal build): survivors wait longer
    job = join_job(config=RendezvousConfig(grow_grace=NEWCOMER_WAIT_S))
    deepspeed.init_distributed(dist_init_required=False)  # adopt it
    loader = None
    if data is not None:
        p = job.placement
        loader = AdaptiveDataLoader(
            data, pollux.initial_batch_size, max_batch_size=pollux.max_batch_size,
            local_bsz_bounds=pollux.micro_batch_size_range,
            gradient_accumulation=pollux.gradient_accumulation, rank=p.rank,
            num_replicas=p.world_size, collate_fn=kwargs.get("collate_fn"))
    micro, steps = pollux.initial_micro_batch(current_world_size())
    handle = PolluxEngine(recipe, pollux, micro, steps)
    handle.loader = loader
    ElasticDeepSpeed(handle, job, loader, checkpoints=checkpoint_writer(
        pollux.checkpoint_dir, pollux.checkpoint_interval), policies=policies,
        decide_every=pollux.decide_every)
    return handle, handle.live("optimizer"), loader, handle.live("lr_scheduler")


def section_policies(pollux: PolluxConfig) -> list[Any]:
    """The adaptation policies the section's ``policies`` names, imported (on the worker:
    its Python path, then its working directory). Raises :class:`PolluxConfigError` (one
    line) for an entry that cannot be loaded."""
    from pollux_launch.elastic.adaptation import PolicyError, load_policy

    try:
        return [load_policy(spec) for spec in pollux.policies or ()]
    except PolicyError as exc:
        raise PolluxConfigError(f"pollux.policies: {exc}") from None


def _rehearse(recipe: _Recipe, pollux: PolluxConfig) -> None:
    """Build and drop one engine on a private one-process group before joining the job.

    A process's first engine build pays one-time costs (lazy imports, DeepSpeed's config
    classes, first allocations) that later builds do not; a newcomer to a running job
    would pay them inside the collectives of its first build, while the survivors wait
    (about half of a grow's pause). Skipped if a process group already exists.
    """
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    missing = [k for k in ("LOCAL_RANK",) if k not in os.environ]  # DeepSpeed asserts it
    os.environ.update({k: "0" for k in missing})
    try:
        compat.release_group_caches()
        micro, steps = pollux.initial_micro_batch(1)
        detach(recipe.build(1, micro, steps)[0])
    finally:
        for k in missing:
            del os.environ[k]
        dist.destroy_process_group()
        compat.release_group_caches()


@dataclass
class _Recipe:
    """What it takes to build the engine again for another world size."""

    kwargs: dict[str, Any]
    ds_config: dict[str, Any]
    client_params: list[list[torch.nn.Parameter]] | None = field(default=None)

    @classmethod
    def record(cls, kwargs: dict[str, Any], ds_config: dict[str, Any]) -> _Recipe:
        kwargs = dict(kwargs)
        if kwargs.get("model_parameters") is not None:
            # a generator (model.parameters()) would be empty the second time
            kwargs["model_parameters"] = list(kwargs["model_parameters"])
        opt = kwargs.get("optimizer")
        params = None
        if isinstance(opt, torch.optim.Optimizer):
            # ZeRO replaces each group's params by its flat partition: remember them
            params = [list(g["params"]) for g in opt.param_groups]
        return cls(kwargs, ds_config, params)

    def build(self, world_size: int, micro_batch: int, accumulation_steps: int) -> tuple:
        import deepspeed

        opt = self.kwargs.get("optimizer")
        if self.client_params is not None:
            compat.reset_client_optimizer(opt, self.client_params)
        cfg = derive_ds_config(self.ds_config, world_size, micro_batch, accumulation_steps)
        with compat.flat_buffers_reused():
            return deepspeed.initialize(config=cfg, **self.kwargs)


class _Live:
    """A view of one attribute of the current engine (the optimizer, dataloader or
    scheduler object changes when the engine is rebuilt)."""

    def __init__(self, handle: PolluxEngine, name: str) -> None:
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_name", name)

    def _target(self) -> Any:
        return getattr(self._handle.engine, self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)

    def __iter__(self) -> Any:
        return iter(self._target())

    def __len__(self) -> int:
        return len(self._target())

    def __bool__(self) -> bool:
        return self._target() is not None

    def __repr__(self) -> str:
        return f"<live {self._name} of {self._target()!r}>"


class PolluxEngine:
    """The engine handle returned under pollux-run: forwards to the current
    ``DeepSpeedEngine`` (``handle(x)``, ``handle.backward(loss)``, ``handle.step()``,
    ``handle.module`` ... as usual) and adds the pollux controls."""

    def __init__(self, recipe: _Recipe, pollux: PolluxConfig, micro_batch: int,
                 accumulation_steps: int) -> None:
        self._recipe = recipe
        self.pollux = pollux
        self._lr_factor = 1.0
        self._lr_handles: list[Any] = []
        self._saved_lrs: list[Any] = []
        self._pending: tuple[int, int] | None = None
        self.grad_stats = DeepSpeedGradStats(pollux.initial_batch_size)
        self.loader: Any = None  # a pollux AdaptiveDataLoader: its steps set the boundaries
        self.driver: Any = None  # the ElasticDeepSpeed that owns this handle under pollux-run
        self._forced_boundary = False
        self._skip_step = False
        # a newcomer to a running job receives the survivors' state here (its module
        # tensors may be the live parameters: read it before training on)
        self.restored_state = self._build(None, micro_batch, accumulation_steps)
        release_at_exit(self._release_groups)

    # -- building --------------------------------------------------------------------
    def _build(self, state: EngineState | None, micro: int, steps: int) -> EngineState | None:
        """Build the engine on the current group and restore ``state`` (collective; a
        newcomer passes None and receives the survivors' state, if there are any)."""
        compat.release_group_caches()
        holders = state_holders(state is not None) if current_world_size() > 1 else None
        sync = (compat.module_sync(lambda engine: share_module(engine, holders)) if holders
                else contextlib.nullcontext())  # (a fresh start: DeepSpeed's broadcast)
        with sync:
            self.engine = self._recipe.build(current_world_size(), micro, steps)[0]
        compat.check_supported(self.engine)
        restored = restore(self.engine, state, holders)
        self._attach()
        if restored is not None:
            mine = restored.get("client", {}).get("pollux")
            if mine:
                self._lr_factor = float(mine["lr_factor"])
                self.grad_stats.load_state_dict(mine["gns"])
                if tuple(mine["batch"]) != self.batch:  # a newcomer adopts the job's batch
                    self._apply_batch(*mine["batch"])
        return restored

    def _attach(self) -> None:
        opt = compat.basic_optimizer(self.engine)
        self._lr_handles = [opt.register_step_pre_hook(self._scale_lr),
                            opt.register_step_post_hook(self._unscale_lr)]
        self.grad_stats.attach(self.engine)

    def _detach(self) -> None:
        for h in self._lr_handles:
            h.remove()
        self._lr_handles = []
        self.grad_stats.detach()
        detach(self.engine)

    def _release_groups(self) -> None:
        """DeepSpeed lets go of the process groups (``compat.release_groups``): at exit,
        before they are destroyed for good, and when this replica leaves its job. A group
        still held keeps its gloo threads (``process_group``, "Leaving at exit")."""
        engine = self.__dict__.get("engine")
        if engine is not None:
            compat.release_groups(engine)

    def live(self, name: str) -> Any:
        """A view of the current engine's ``name`` attribute (None if it has none)."""
        return _Live(self, name) if getattr(self.engine, name, None) is not None else None

    # -- forwarding ------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # during construction
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        eng = self.engine
        self.grad_stats.begin_micro_step()
        loader = self.loader
        if (loader is not None and loader.is_sync_step
                and not eng.is_gradient_accumulation_boundary()):
            # the loader ends the epoch with a short step: make it a boundary for DeepSpeed
            eng.set_gradient_accumulation_boundary(True)
            self._forced_boundary = True
        try:
            return eng.backward(loss, *args, **kwargs)
        except RuntimeError as exc:
            if self.driver is None or not self.driver.recover(exc):
                raise
            self._skip_step = True  # the micro-batch in flight is lost
            return None

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``step()``; at an accumulation boundary, after the optimizer step,
        also the pollux boundary work (batch changes, rescale votes and rescales)."""
        if self._skip_step:
            self._skip_step = False
            return None
        eng = self.engine
        boundary = eng.is_gradient_accumulation_boundary()
        skipped = eng.skipped_steps
        try:
            out = eng.step(*args, **kwargs)  # collectives too (gradient norm, ZeRO)
        except RuntimeError as exc:
            if self.driver is None or not self.driver.recover(exc):
                raise
            return None  # the step in flight is lost; the job re-formed around it
        if boundary:
            short = self._forced_boundary
            if short:  # back to DeepSpeed's own counting, from a whole step on
                self._forced_boundary = False
                compat.clear_boundary_override(eng)
                compat.align_micro_steps(eng)
            # a short step has fewer micro-batches than the statistics assume: not sampled
            try:  # (a collective: a peer may die here too)
                self.grad_stats.end_step(stepped=eng.skipped_steps == skipped and not short)
            except RuntimeError as exc:
                if self.driver is None or not self.driver.recover(exc):
                    raise
                return out  # the optimizer step was taken; the job re-formed after it
            if self._pending is not None:
                self._apply_batch(*self._pending)
            if self.driver is not None:
                self.driver.on_boundary()
        return out

    def epochs(self, total: float) -> Any:
        """Statistical epochs (Pollux Sec. 3.1) under pollux-run: yields the loader's data
        epoch until ``total`` epochs' worth of progress at ``initial_batch_size`` is done,
        resuming where the job stands (a newcomer starts at the job's epoch)."""
        if self.driver is None or self.loader is None:
            raise ValueError("engine.epochs() needs pollux-run and training_data passed to "
                             "initialize (it follows the returned dataloader)")
        return self.driver.epochs(total)

    # -- batch size, accumulation, LR ------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.engine.dp_world_size

    @property
    def batch(self) -> tuple[int, int]:
        """``(micro batch per GPU, accumulation steps)`` now in force."""
        return (self.engine.train_micro_batch_size_per_gpu(),
                self.engine.gradient_accumulation_steps())

    def set_batch_size(self, micro_batch: int, accumulation_steps: int = 1) -> None:
        """Use ``micro_batch`` per GPU and ``accumulation_steps`` micro-batches per
        optimizer step (DeepSpeed's ``gradient_accumulation_steps``) from the next
        accumulation boundary on (at once if the engine is at one). Every replica must
        call it with the same values."""
        lo, hi = self.pollux.micro_batch_size_range
        if not lo <= micro_batch <= hi:
            raise ValueError(f"micro batch {micro_batch} outside pollux.micro_batch_size_range "
                             f"[{lo}, {hi}]")
        if accumulation_steps < 1 or (accumulation_steps > 1
                                      and not self.pollux.gradient_accumulation):
            raise ValueError(f"accumulation_steps={accumulation_steps} not allowed "
                             "(>= 1, and > 1 only with pollux.gradient_accumulation)")
        eng = self.engine
        if eng.micro_steps % eng.gradient_accumulation_steps() == 0:
            self._apply_batch(micro_batch, accumulation_steps)
        else:
            self._pending = (micro_batch, accumulation_steps)

    def _apply_batch(self, micro: int, steps: int) -> None:
        self._pending = None
        eng = self.engine
        eng.set_train_micro_batch_size(micro)
        eng.set_train_batch_size(micro * steps * eng.dp_world_size)
        compat.align_micro_steps(eng)

    @property
    def lr_factor(self) -> float:
        return self._lr_factor

    def set_lr_factor(self, factor: float) -> None:
        """Multiply the LR by ``factor`` inside every optimizer step (e.g. the AdaScale
        gain or ``scale_lr(rule, M0, M)``); the param groups hold the scheduler's value
        outside the step, so the user's scheduler is never fought."""
        if not factor > 0:
            raise ValueError(f"LR factor must be > 0, got {factor}")
        self._lr_factor = float(factor)

    def _scale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._lr_factor == 1.0:  # (nothing to scale, nothing to restore)
            self._saved_lrs = []
            return
        self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * self._lr_factor

    def _unscale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved_lrs:
            for g, lr in zip(optimizer.param_groups, self._saved_lrs, strict=True):
                g["lr"] = lr

    # -- live rescale ----------------------------------------------------------------
    def capture(self, client_state: dict[str, Any] | None = None) -> EngineState:
        """Consolidated training state (collective on the current group), including the
        adapter's own (LR factor, batch, gradient statistics) under ``client["pollux"]``."""
        client = dict(client_state or {})
        client["pollux"] = {"lr_factor": self._lr_factor, "batch": list(self.batch),
                            "gns": self.grad_stats.state_dict()}
        return capture(self.engine, client)

    def rescale(self, reform: Callable[[], bool], micro_batch: int | None = None,
                accumulation_steps: int | None = None,
                client_state: dict[str, Any] | None = None) -> EngineState | None:
        """Rebuild this replica's engine for a new process group, in place.

        Call at an optimizer-step boundary on every replica of the current group.
        ``reform()`` destroys the process group and forms the new one (the rendezvous);
        it returns False if this process is not part of the new group (it then leaves:
        nothing is rebuilt and None is returned). Returns the restored state (its
        ``client`` part carries ``client_state`` from rank 0's side).
        """
        state = self.capture(client_state)
        self._detach()
        if not reform():
            self._release_groups()
            return None
        if micro_batch is None or accumulation_steps is None:
            micro_batch, accumulation_steps = self.pollux.initial_micro_batch(current_world_size())
        state["client"]["pollux"]["batch"] = [micro_batch, accumulation_steps]
        return self._build(state, micro_batch, accumulation_steps)
