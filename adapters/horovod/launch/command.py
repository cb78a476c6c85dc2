"""What ``pollux-run`` needs to launch a Horovod Elastic job: the ``horovodrun``
command line and how to read workers' exit codes.

Horovod's own elastic driver launches and resets the workers; ``pollux-run`` runs one
``horovodrun --gloo`` process whose host list comes from the job's allocation (a
discovery script, see :mod:`.hosts`). Facts this encodes (measured with Horovod 0.28.1):

* on a single host the driver needs ``--network-interface lo`` (else it waits for a
  second host's interface to appear);
* a worker removed by a reset aborts with exit code 134 (SIGABRT) - expected, not a
  failure; ``horovodrun`` itself exits 0 when the job completes;
* the driver polls the discovery script about once a second, so it must be cheap;
* it starts every worker (a newcomer too, while the survivors wait in their reset)
  through ``safe_shell_exec``, whose middleman is a ``multiprocessing`` *spawn* child:
  a fresh Python that re-runs horovodrun's ``__main__`` file, and the ``horovodrun``
  console script imports ``horovod.runner.launch`` at module level (0.4-1 s per worker
  on a busy 2-core machine, ~0.15 s without). :func:`write_horovodrun_script` writes the
  same entry point (``run_commandline()``) with its import under the ``__main__`` guard,
  run by :func:`.local_run.main` (each replica a host of its own: a dead worker costs
  one replica, not the job; removed workers' aborts kept to the job's log).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from pollux_launch.arguments import OptionsError

from ..available import HOROVOD_INSTALL_HINT, HorovodMissing

# A worker that Horovod's driver removed in a reset exits with SIGABRT's status.
REMOVED_WORKER_EXIT_CODE = 134


def horovodrun_path() -> str:
    """The ``horovodrun`` next to this Python (a virtualenv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("horovodrun")
    if beside.exists():
        return str(beside)
    found = shutil.which("horovodrun")
    if found is None:
        raise HorovodMissing(HOROVOD_INSTALL_HINT)
    return found


_HOROVODRUN_SCRIPT = """\
import sys

if __name__ == "__main__":  # (not when Horovod's spawned middleman re-runs this file)
    from pollux_launch.adapters.horovod.launch.local_run import main

    sys.exit(main())
"""


def write_horovodrun_script(path: str | os.PathLike[str]) -> list[str]:
    """Write horovodrun's entry point, import guarded and with :mod:`.local_run`'s
    changes (see the module docstring), as the
    file ``path`` (name it ``horovodrun``: it names itself after it); returns the argv
    prefix that runs it (this Python, where Horovod is installed)."""
    path = Path(path)
    path.write_text(_HOROVODRUN_SCRIPT)
    return [sys.executable, str(path)]


def horovodrun_command(
    command: Sequence[str],
    *,
    discovery_script: str,
    np: int,
    min_np: int | None = None,
    max_np: int | None = None,
    network_interface: str | None = "lo",
    slots_per_host: int | None = None,
    elastic_timeout: int | None = None,
    reset_limit: int | None = None,
    start_timeout: int | None = None,
    verbose: bool = False,
    extra_args: Sequence[str] = (),
    horovodrun: str | Sequence[str] | None = None,
) -> list[str]:
    """``horovodrun --gloo`` in elastic mode for ``command`` (the user's script argv).

    ``network_interface`` "lo" is right on one host; pass None (or the NIC) across hosts.
    ``extra_args`` are the user's other horovodrun flags, passed through unchanged.
    ``horovodrun``: its path, or the argv that runs it (:func:`write_horovodrun_script`).
    """
    if not command:
        raise OptionsError("no training command given; e.g. pollux-run -np 2 python train.py")
    if np < 1 or (min_np is not None and not 1 <= min_np <= np) or (
            max_np is not None and max_np < np):
        raise OptionsError(f"need 1 <= min-np <= np <= max-np, got np={np}, "
                         f"min-np={min_np}, max-np={max_np}")
    launcher = [horovodrun] if isinstance(horovodrun, str) else list(
        horovodrun or [horovodrun_path()])
    argv = [*launcher, "--gloo", "-np", str(np),
            "--host-discovery-script", discovery_script]
    for flag, value in (("--min-np", min_np), ("--max-np", max_np),
                        ("--network-interface", network_interface),
                        ("--slots-per-host", slots_per_host),
                        ("--elastic-timeout", elastic_timeout), ("--reset-limit", reset_limit),
                        ("--start-timeout", start_timeout)):
        if value is not None:
            argv += [flag, str(value)]
    if verbose:
        argv.append("--verbose")
    return [*argv, *extra_args, *command]


def worker_failed(exit_code: int | None, removed_by_reset: bool = True) -> bool:
    """Whether a worker's exit code is a real failure: 0 is success, and 134 is how
    Horovod ends a worker that a reset removed (expected when ``removed_by_reset``)."""
    if exit_code is None or exit_code == 0:
        return False
    return not (removed_by_reset and exit_code == REMOVED_WORKER_EXIT_CODE)
