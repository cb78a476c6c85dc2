"""The launching ``pollux-run``'s parsed flags (built by ``options.parse_launch_args``),
in a module of their own so that the drivers that read them need not import the parser."""

from __future__ import annotations

from dataclasses import dataclass, field

from .hosts import Host


@dataclass(frozen=True)
class LaunchOptions:
    command: tuple[str, ...]
    np: int
    min_np: int
    max_np: int
    hosts: tuple[Host, ...] | None
    slots_per_host: int
    host_discovery_script: str | None
    network_interface: str | None
    start_timeout: float
    elastic_timeout: float
    reset_limit: int | None
    blacklist_cooldown_range: tuple[int, int] | None
    output_filename: str | None
    verbose: bool
    log_level: str
    store: str | None
    store_prefix: str
    job_name: str
    fairness: float
    interval: float | None  # None: the calibrated default (RescaleCost.round_interval)
    realloc_delay: float | None  # None: each live job's calibrated pause
    policy: str | None
    framework: str
    horovod_env: dict[str, str] = field(default_factory=dict)
    store_options: dict[str, object] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    secret_file: str | None = None
    elasticity: str = "live"  # messages.ELASTICITY
    elasticity_reason: str = ""  # why, for the launcher's first line
    # a "[pollux]" line after it: a job that will restart shows no sign of resuming
    # (frameworks.state_warning); empty: none
    elasticity_warning: str = ""
    max_restarts: int = 0
    stop_grace: float = 30.0
    reports_goodput: bool = True  # the script uses the pollux API
    min_batch_size: int | None = None  # the job's batch-size range (None: the script's)
    max_batch_size: int | None = None
    gpus: tuple[str, ...] | None = None  # local mode: this machine's GPUs (None: detected)
    slurm: bool = False  # run on the Slurm allocation it is in (launcher/slurm_allocation.py)
    slurm_notice: str = ""  # why, when --slurm was not given but the allocation found
    gpu_types: tuple[str, ...] = ()  # the GPU types it may run on (empty: any)

    @property
    def elastic(self) -> bool:
        return self.min_np != self.max_np
