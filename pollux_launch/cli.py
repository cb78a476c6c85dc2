"""``pollux-run``: the command-line entry point.

``pollux-run [flags] COMMAND...`` launches and drives one job (horovodrun-compatible
flags); ``pollux-run SUBCOMMAND ...`` runs one of the services or tools below. Each
subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``, so this file only dispatches.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "coordinator": ("pollux_launch.coordinator.cli", "run the cluster's scheduling service"),
    "agent": ("pollux_launch.launcher.agent_cli", "run the node agent of this node"),
    "status": ("pollux_launch.launcher.status", "show nodes and jobs at a glance"),
    "cancel": ("pollux_launch.launcher.cancel", "cancel a job"),
    "drain": ("pollux_launch.launcher.drain", "move every job off nodes (a Slurm "
              "allocation: shrink it)"),
    "logs": ("pollux_launch.launcher.logs", "print a job's output (cluster or local)"),
    "simulate": ("pollux_launch.sim.cli", "replay a workload trace through a simulated cluster"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Errors a user can cause (UserError) end as one line and exit code 2; anything else,
    # a bug of ours included, keeps its traceback.
    from .arguments import OneLineParser
    from .errors import UserError

    try:
        if argv and argv[0] in SUBCOMMANDS:
            module_name, help_text = SUBCOMMANDS[argv[0]]
            module = importlib.import_module(module_name)
            parser = OneLineParser(prog=f"pollux-run {argv[0]}", description=help_text)
            module.add_arguments(parser)
            return int(module.run(parser.parse_args(argv[1:])) or 0)
        if not argv:
            _print_help()
            return 2
        return _launch(argv)
    except UserError as exc:
        print(f"pollux-run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `pollux-run status | head -1`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no flush error)
        return 0


def _launch(argv: list[str]) -> int:
    import logging

    from . import __version__
    from .launcher.options import build_parser
    from .launcher.run import launch
    from .launcher.sweep import launch_jobs, parse_jobs

    if argv[0] in ("-h", "--help"):
        build_parser().print_help()
        _print_help()
        return 0
    if argv[0] in ("-v", "--version"):
        print(f"pollux-run {__version__}")
        return 0
    jobs = parse_jobs(argv)  # (one, or --sweep FILE's: all validated before any starts)
    opts = jobs[0]
    logging.basicConfig(level=opts.log_level.replace("TRACE", "DEBUG").replace("FATAL", "CRITICAL"),
                        format="[pollux] %(levelname)s %(name)s: %(message)s")
    if opts.slurm:
        from .launcher.slurm_allocation import launch_in_allocation

        return launch_in_allocation(jobs, lambda here, got: launch_jobs(here, launch, got))
    return launch_jobs(jobs, launch)


def _print_help() -> None:
    print("\nusage: pollux-run [flags] COMMAND...   |   pollux-run SUBCOMMAND [args]\n")
    print("subcommands (pollux-run SUBCOMMAND --help for each):")
    for name, (_, help_text) in SUBCOMMANDS.items():
        print(f"  {name:<12} {help_text}")


if __name__ == "__main__":
    sys.exit(main())
