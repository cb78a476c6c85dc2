"""Which framework a job uses and how it can change size, given by ``--framework`` /
``--elasticity`` or detected from its command.

Detection reads (never executes) the training script named on the command line: a
``horovod`` import means Horovod; a ``deepspeed`` import, a ``--deepspeed``/
``--deepspeed_config`` argument or a ds_config JSON argument means DeepSpeed; anything
else is native torch.

Kinds of elasticity (:func:`detect_elasticity`):

* ``live`` - the script uses pollux-launch's API (an ``import pollux_launch``) or
  Horovod Elastic (``hvd.elastic``): survivors re-form their group in place;
* ``restart`` - any other torchrun-style script that may change size: on a new
  allocation every worker is stopped (SIGTERM, then SIGKILL after a grace period) and
  started again with the new ``WORLD_SIZE``/``RANK``/... (torchrun's contract); the
  script resumes from its own checkpoint;
* ``fixed`` - a job that may not change size (``-np`` without ``--min-np``/``--max-np``
  and a script that could not re-form live, or ``--elasticity fixed``, which pins a
  range to ``-np``): never resized or moved.

A restart-elastic job whose script shows no sign of saving and loading its state
(:func:`saves_state`) gets a warning at submission (:func:`state_warning`): each new
allocation would start its training over.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..arguments import OptionsError
from ..registry import Registry

FRAMEWORKS = ("torch", "horovod", "deepspeed")  # the ones detection knows

#: The entry-point group through which a framework's adapter plugs its launch side into
#: the launcher (pyproject's ``[project.entry-points."pollux_launch.adapters"]``): each
#: entry is a ``module:function`` called once, which registers the framework's
#: :class:`FrameworkLaunch` here and its drivers in ``drivers.DRIVERS``.
PLUGINS = "pollux_launch.adapters"


@dataclass(frozen=True)
class FrameworkLaunch:
    """What the launcher needs of a framework: the names of its drivers (registered in
    ``drivers.DRIVERS``), the primary one first, for jobs that re-form live and for jobs
    that restart; and ``check(command, cwd)``, run on the job's command before anything
    is written or started (raises ``OptionsError`` naming the file at fault)."""

    live: tuple[str, ...] = ("replicas",)
    restart: tuple[str, ...] = ("restart",)
    check: Callable[[Sequence[str], Path], None] | None = None


#: framework name -> its FrameworkLaunch (a framework nobody registered runs as replicas)
LAUNCH: Registry[FrameworkLaunch] = Registry(
    "framework", check=lambda e: isinstance(e, FrameworkLaunch), expects="a FrameworkLaunch",
    plugins=PLUGINS)
DEFAULT_LAUNCH = FrameworkLaunch()


# the frameworks whose adapters in this package have a launch side of their own
SHIPPED = ("horovod", "deepspeed")


def framework_launch(framework: str) -> FrameworkLaunch:
    """``framework``'s launch side (the default for one nobody registered). Raises
    OptionsError when one this package ships is missing: the install's metadata predates
    its entry points, and running it as plain replicas would go wrong silently."""
    if framework in LAUNCH:
        return LAUNCH.get(framework)
    if framework in SHIPPED:
        raise OptionsError(f"the {framework} adapter's launch side is not registered (no "
                           f"entry point in group {PLUGINS!r}): this install is stale; "
                           "reinstall pollux-launch (pip install -e . in a checkout)")
    return DEFAULT_LAUNCH

_IMPORT = re.compile(r"^\s*(?:import|from)\s+(horovod|deepspeed)\b", re.MULTILINE)
# (pollux_launch.constant_batch is a stdlib-only helper for restart-elastic scripts: it
# is not the pollux API, and a script importing it stays restart-elastic)
_POLLUX = re.compile(r"^\s*(?:import|from)\s+pollux_launch\b(?!\.constant_batch\b)",
                     re.MULTILINE)
# Signs that a script saves its training state and reads it back (state_signs): a call
# that writes a checkpoint and one that loads it, or Hugging Face Trainer's resume.
_SAVES = re.compile(r"\b(?:torch\.save|save_checkpoint|save_state|save_model|save_pretrained|"
                    r"save_file|pickle\.dump|np\.save|numpy\.save|json\.dump|dcp\.save|"
                    r"checkpoint\.save|async_save)\s*\(")
_LOADS = re.compile(r"\b(?:torch\.load|load_checkpoint|load_state|load_state_dict|load_file|"
                    r"pickle\.load|np\.load|numpy\.load|json\.load|dcp\.load|"
                    r"checkpoint\.load)\s*\(|\bresume_from_checkpoint\s*=\s*(?!None\b|False\b)")
_HVD_ELASTIC = re.compile(r"\b(?:hvd|horovod\.torch|horovod)\.elastic\.run\b|"
                          r"^\s*from\s+horovod\.\w+\.elastic\b|@\s*\w*elastic\.run\b",
                          re.MULTILINE)


def detect_framework(command: Sequence[str], cwd: str | Path = ".") -> str:
    """Best guess of the framework of ``command`` (one of FRAMEWORKS)."""
    if any(a.startswith(("--deepspeed", "--ds_config", "--ds-config")) for a in command):
        return "deepspeed"
    found = set()
    for path in script_files(command, cwd):
        found.update(_IMPORT.findall(_read(path)))
    for arg in command:
        path = Path(cwd, arg)
        if arg.endswith(".json") and path.is_file() and '"train_micro_batch_size' in _read(path):
            found.add("deepspeed")
    if "horovod" in found:
        return "horovod"
    if "deepspeed" in found:
        return "deepspeed"
    return "torch"


def script_files(command: Sequence[str], cwd: str | Path = ".") -> list[Path]:
    """The Python files ``command`` runs: ``*.py`` arguments that exist, and the module of
    ``python -m MODULE`` when it lies under ``cwd``."""
    out = [Path(cwd, a) for a in command if a.endswith(".py") and Path(cwd, a).is_file()]
    if "-m" in command[:-1]:
        base = Path(cwd, *command[list(command).index("-m") + 1].split("."))
        out += [p for p in (base.with_suffix(".py"), base / "__main__.py") if p.is_file()]
    return out


def insert_local_rank(command: Sequence[str], local_rank: int) -> list[str]:
    """``command`` with ``--local_rank=N`` right after its script (or module), as the
    ``deepspeed`` launcher passes it; unchanged if it already has one."""
    command = list(command)
    if any(a.startswith(("--local_rank", "--local-rank")) for a in command):
        return command
    at = next((i + 1 for i, a in enumerate(command) if a.endswith(".py")), None)
    if at is None and "-m" in command[:-1]:
        at = command.index("-m") + 2
    if at is None:
        return command
    return [*command[:at], f"--local_rank={local_rank}", *command[at:]]


def uses_pollux_api(command: Sequence[str], cwd: str | Path = ".") -> bool:
    """Whether the script imports pollux_launch (then it reports a goodput model)."""
    return any(_POLLUX.search(_read(path)) for path in script_files(command, cwd))


def detect_elasticity(framework: str, command: Sequence[str], cwd: str | Path,
                      min_np: int, max_np: int, asked: str = "auto") -> tuple[str, str]:
    """The job's kind of elasticity (one of ELASTICITY) and why, in a few words for the
    launcher's first line. ``asked``: ``--elasticity`` (``auto``: detected; ``fixed``
    over a range means fixed at ``-np``, and the reason says the range is ignored).
    Raises ``OptionsError`` (one line) for a kind this job cannot have."""
    text = "".join(_read(path) for path in script_files(command, cwd))
    pollux = uses_pollux_api(command, cwd)
    hvd_elastic = framework == "horovod" and bool(_HVD_ELASTIC.search(text))
    resizable = min_np != max_np
    if asked == "restart" and framework == "horovod":
        raise OptionsError("--elasticity restart: Horovod jobs re-form live with hvd.elastic "
                         "(or run fixed); restarting applies to torchrun-style scripts")
    if asked == "fixed" and resizable:  # (the caller pins the range to -np)
        return "fixed", "as asked by --elasticity fixed; the --min-np/--max-np range is ignored"
    if asked != "auto":
        return asked, f"as asked by --elasticity {asked}"
    if pollux:
        return "live", "script uses the pollux API: re-forms in place"
    if hvd_elastic:
        return "live", "script uses Horovod Elastic: re-forms in place"
    if framework == "horovod":
        if resizable:
            raise OptionsError("this Horovod script does not use hvd.elastic, so it cannot change "
                             "size: drop --min-np/--max-np, or use hvd.elastic.run")
        return "fixed", "script does not use Horovod Elastic"
    if resizable:
        return "restart", "script does not use the pollux API"
    return "fixed", "script does not use the pollux API"


def saves_state(command: Sequence[str], cwd: str | Path = ".") -> bool:
    """Whether the script shows a sign of saving its training state and reading it back
    (a heuristic over the files ``command`` runs, read, never executed): a call that
    writes state (``torch.save``, DeepSpeed's ``save_checkpoint``, ``save_state``,
    ``save_pretrained``/``save_model``, ``dcp.save``, ``pickle``/``json``/``np`` dumps...)
    *and* one that loads it (``torch.load``, ``load_checkpoint``, ``load_state_dict``,
    ``dcp.load``, ... or Hugging Face Trainer's ``resume_from_checkpoint=``). A script
    that only saves (a final model) restarts from scratch all the same. False when no
    script file is found (``python -c``, a binary): nothing says it resumes."""
    text = "".join(_read(path) for path in script_files(command, cwd))
    return bool(_SAVES.search(text)) and bool(_LOADS.search(text))


def state_warning(command: Sequence[str], cwd: str | Path, elasticity: str) -> str:
    """One line warning that a restart-elastic job shows no sign of resuming from saved
    state (``saves_state``): each new allocation would start its training again from
    scratch. Empty when there is nothing to warn of (a fixed job's restarts follow only
    failures, which lose its work whether or not it is restarted)."""
    if elasticity != "restart" or saves_state(command, cwd):
        return ""
    files = script_files(command, cwd)
    what = files[0].name if files else "the command"
    return (f"warning: {what} shows no sign of saving and loading its state (no torch.save/"
            f"torch.load, save_checkpoint/load_checkpoint, resume_from_checkpoint=...): every "
            f"new allocation restarts its workers and training starts again from scratch; "
            f"resume from a checkpoint, or run it at one size with --elasticity fixed")


def ds_config_paths(command: Sequence[str], cwd: str | Path = ".") -> list[Path]:
    """The ds_config files ``command`` names (``--deepspeed_config X``, ``--ds_config=X``,
    ``--ds-config X``), relative to ``cwd``: the launcher checks them before starting."""
    flags = ("--deepspeed_config", "--ds_config", "--ds-config")
    out = []
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            value = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            if value:
                out.append(Path(cwd, value))
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[:1_000_000]
    except OSError:
        return ""
