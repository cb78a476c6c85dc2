"""``pollux-run``: the command-line entry point.

``pollux-run [flags] COMMAND...`` launches and drives one job (horovodrun-compatible
flags); ``pollux-run SUBCOMMAND ...`` runs one of the services or tools below. Each
subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("pollux_launch.sim.cli", "replay a workload trace through a simulated cluster"),
}


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            module_name, help_text = SUBCOMMANDS[argv[0]]
            module = importlib.import_module(module_name)
            parser = argparse.ArgumentParser(prog=f"pollux-run {argv[0]}", description=help_text)
            module.add_arguments(parser)
            return int(module.run(parser.parse_args(argv[1:])) or 0)
        if not argv or argv[0] in ("-h", "--help"):
            _print_help()
            return 0 if argv else 2
        raise UsageError("launching jobs is not available yet; see `pollux-run --help`")
    except UsageError as exc:
        print(f"pollux-run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _print_help() -> None:
    print("usage: pollux-run [flags] COMMAND...   |   pollux-run SUBCOMMAND [args]\n")
    print("subcommands:")
    for name, (_, help_text) in SUBCOMMANDS.items():
        print(f"  {name:<12} {help_text}")


if __name__ == "__main__":
    sys.exit(main())
