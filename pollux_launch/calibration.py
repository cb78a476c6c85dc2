"""The calibrated rescale costs on disk: one JSON file, read through one validating layer.

``benchmarks/rescale.py --write-calibration FILE`` measures the figures of
:class:`~pollux_launch.policy.rescale_cost.RescaleCost` on a machine and merges them into
FILE; the package ships the figures measured on the project's reference machine
(``pollux_launch/data/rescale_calibration.json``). The simulator (``pollux-run simulate
--rescale-calibration``) and the coordinator (``--rescale-calibration``) read it; a bad
file is an error with one line saying what is wrong, never a silent default.

Format: ``{"version": 1, "start_s": ..., "shrink_s": ..., ..., "source": "...",
"measured": {...free-form figures the benchmark saw...}}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import UserError
from .policy.rescale_cost import RescaleCost

VERSION = 1
BUNDLED = Path(__file__).parent / "data" / "rescale_calibration.json"
_MAX_BYTES = 1 << 20


class CalibrationError(UserError, ValueError):
    """A rescale-calibration file that cannot be read or is not one."""


def add_calibration_argument(parser: argparse.ArgumentParser) -> None:
    """``--rescale-calibration FILE``, as every command that models rescale costs takes it."""
    parser.add_argument("--rescale-calibration", metavar="FILE", default=None,
                        help="calibrated rescale costs (benchmarks/rescale.py "
                        "--write-calibration; default: the figures shipped with the package)")


def load_rescale_cost(path: str | Path | None = None) -> RescaleCost:
    """The costs in ``path`` (None: the bundled calibration). Raises ``CalibrationError``
    (a ValueError) with one line naming the file and the problem."""
    path = Path(path) if path is not None else BUNDLED
    try:
        raw = path.read_bytes()[: _MAX_BYTES + 1]
        if len(raw) > _MAX_BYTES:
            raise CalibrationError("larger than 1 MiB")
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise CalibrationError(f"expected a JSON object with \"version\": {VERSION}")
        return RescaleCost.from_dict(data)
    except OSError as exc:
        raise CalibrationError(f"cannot read rescale calibration {path}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise CalibrationError(f"bad rescale calibration {path}: {exc}; re-create it with "
                         "benchmarks/rescale.py --write-calibration") from None


def write_rescale_cost(path: str | Path, figures: dict, measured: dict | None = None) -> dict:
    """Merge ``figures`` (RescaleCost field names) into the calibration at ``path``
    (started from the bundled one if absent), validate, write; returns what was written."""
    path = Path(path)
    base = load_rescale_cost(path if path.exists() else None).to_dict()
    merged = RescaleCost.from_dict({**base, **figures}).to_dict()
    old_measured = {}
    if path.exists():
        old_measured = json.loads(path.read_text()).get("measured") or {}
    out = {"version": VERSION, **merged, "measured": {**old_measured, **(measured or {})}}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return out
