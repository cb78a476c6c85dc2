"""The DeepSpeed adapter's launch side: what ``pollux-run`` does for a DeepSpeed job.

Its workers are the launcher's own replicas (live) or restarted group (torchrun's way);
what is DeepSpeed's own is the check of the job's ds_config, its ``"pollux"`` section
above all, before any worker starts. :func:`register` is this adapter's entry point in
the group ``pollux_launch.launcher.frameworks.PLUGINS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pollux_launch.arguments import OptionsError
from pollux_launch.launcher.frameworks import LAUNCH, FrameworkLaunch, ds_config_paths

from .config import PolluxConfigError, parse_pollux_config


def check_ds_configs(command: Sequence[str], cwd: Path) -> None:
    """Each ds_config ``command`` names is parsed; a mistake is an OptionsError that
    names the file."""
    for path in ds_config_paths(command, cwd):
        try:
            parse_pollux_config(path)
        except PolluxConfigError as exc:
            text = str(exc)
            raise OptionsError(text if str(path) in text else f"{path}: {text}") from None


def register() -> None:
    """Plug DeepSpeed's launch side into the launcher (called once per process)."""
    LAUNCH.register("deepspeed", FrameworkLaunch(check=check_ds_configs))
