"""Which framework a job uses: given by ``--framework`` or detected from its command.

Detection reads (never executes) the training script named on the command line: a
``horovod`` import means Horovod; a ``deepspeed`` import, a ``--deepspeed``/
``--deepspeed_config`` argument or a ds_config JSON argument means DeepSpeed; anything
else is native torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

FRAMEWORKS = ("torch", "horovod", "deepspeed")

_IMPORT = re.compile(r"^\s*(?:import|from)\s+(horovod|deepspeed)\b", re.MULTILINE)


def detect_framework(command: Sequence[str], cwd: str | Path = ".") -> str:
    """Best guess of the framework of ``command`` (one of FRAMEWORKS)."""
    if any(a.startswith(("--deepspeed", "--ds_config", "--ds-config")) for a in command):
        return "deepspeed"
    found = set()
    for arg in command:
        path = Path(cwd, arg)
        if arg.endswith(".py") and path.is_file():
            found.update(_IMPORT.findall(_read(path)))
        elif arg.endswith(".json") and path.is_file() and '"train_micro_batch_size' in _read(path):
            found.add("deepspeed")
    if "horovod" in found:
        return "horovod"
    if "deepspeed" in found:
        return "deepspeed"
    return "torch"


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
