"""The package installs as documented: every sub-package importable under pollux_launch."""

import importlib
from pathlib import Path

import pytest
import tomllib

from pollux_launch import cli
from pollux_launch.messages import Allocation, JobHints, MessageError, decode, encode

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> set[str]:
    """Every folder with an __init__.py, named as it installs."""
    names = set()
    for pkg, folder in CONFIG["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            names.add(".".join((pkg, *rel)))
    return names


def test_every_source_package_is_listed_and_importable():
    listed = set(CONFIG["packages"])
    assert _source_packages() <= listed, "add new sub-packages to pyproject.toml"
    for name in sorted(listed):
        importlib.import_module(name)


def test_messages_round_trip_and_reject_malformed():
    alloc = Allocation(version=3, nodes=("n1", "n1", "n2"))
    assert decode(Allocation, encode(alloc)) == alloc
    assert (alloc.num_replicas, alloc.num_nodes) == (3, 2)
    hints = JobHints(init_batch_size=64, max_batch_size=1024, local_bsz_bounds=(4, 64))
    assert decode(JobHints, encode(hints)) == hints
    for raw in ['{"v":1,"version":"x","nodes":[]}', "[1]", "not json",
                '{"v":99,"version":1,"nodes":[]}', '{"v":1,"version":1,"nodes":[],"evil":1}']:
        with pytest.raises(MessageError):
            decode(Allocation, raw)


def test_cli_help_and_unknown_usage(capsys):
    assert cli.main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out
