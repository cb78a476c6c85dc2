"""The CLI's error contract: a UserError (anything a user can fix) is one line and exit 2;
anything else - a bug of ours, even a ValueError - keeps its traceback."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from pollux_launch import cli
from pollux_launch.errors import PolluxError, UserError

# A subcommand whose run raises what the test puts in RAISE (added to SUBCOMMANDS).
SUBCOMMAND = """
import sys, types
from pollux_launch import cli
from pollux_launch.errors import UserError
mod = types.ModuleType("pollux_test_sub")
mod.add_arguments = lambda parser: None
def run(args):
    raise {raise_}
mod.run = run
sys.modules["pollux_test_sub"] = mod
cli.SUBCOMMANDS["boom"] = ("pollux_test_sub", "a test subcommand")
sys.exit(cli.main(["boom"]))
"""


def _run(raise_: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SUBCOMMAND.format(raise_=raise_)],
                          capture_output=True, text=True, timeout=120)


def test_a_user_error_in_a_subcommand_is_one_line():
    done = _run('UserError("--thing 3: must be even; pass --thing 4")')
    assert done.returncode == 2
    assert done.stderr == "pollux-run: error: --thing 3: must be even; pass --thing 4\n"


def test_a_bug_in_a_subcommand_keeps_its_traceback():
    done = _run('ValueError("a bug of ours")')
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "ValueError: a bug of ours" in done.stderr
    assert "pollux-run: error" not in done.stderr


@pytest.fixture
def subcommand(monkeypatch):
    """``pollux-run boom`` raising the exception the test sets."""
    mod = types.ModuleType("pollux_test_sub_inproc")
    mod.add_arguments = lambda parser: None
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(cli.SUBCOMMANDS, "boom", (mod.__name__, "test"))
    return mod


@pytest.mark.parametrize("exc", [RuntimeError("bug"), KeyError("bug"), PolluxError("bug")])
def test_errors_that_are_not_the_users_propagate(subcommand, exc):
    def run(args):
        raise exc

    subcommand.run = run
    with pytest.raises(type(exc)):
        cli.main(["boom"])


def test_every_user_facing_error_class_is_a_user_error():
    from pollux_launch.arguments import OptionsError
    from pollux_launch.calibration import CalibrationError
    from pollux_launch.launcher.hosts import HostsError
    from pollux_launch.launcher.security import SecretError
    from pollux_launch.messages import MessageError
    from pollux_launch.registry import RegistryError
    from pollux_launch.rendezvous.store import StoreError

    for cls in (OptionsError, CalibrationError, HostsError, SecretError, MessageError,
                RegistryError, StoreError):
        assert issubclass(cls, UserError), cls
