"""What every benchmark shares: ``--smoke``, and a LAST stdout line that is one JSON object
whatever happens (issue 27), naming what failed.

    from harness import Report, run_benchmark

    def bench(args: argparse.Namespace, report: Report) -> None:
        with report.case("etcd"):              # a failure here is named "etcd"; the rest runs
            report["etcd"] = measure(...)

    if __name__ == "__main__":
        sys.exit(run_benchmark(parser, bench, smoke={"repeats": 1}))

``--smoke`` takes the defaults in ``smoke`` (options given on the command line still win):
the same code paths at tiny sizes, a few seconds, for ``tests/benchmarks``; its figures
mean nothing. The JSON line holds what ``bench`` put in the report, plus ``"smoke": true``
and, when anything failed, ``"failed": {case: "one-line reason"}``: a case that raised, an
exception or ``SystemExit`` out of ``bench`` (``"main"``), Ctrl-C or SIGTERM
(``"interrupted"``: the ``finally`` blocks still stop what the benchmark started), a bad
command line (``"arguments"``, exit code 2; raise ``UsageError`` for one found after
parsing). The exit code is then non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class UsageError(Exception):
    """A bad command line found after parsing (a value out of range, options that exclude
    each other): named ``"arguments"``, exit code 2 as argparse's own errors."""


class Stopped(BaseException):
    """SIGTERM, raised in the benchmark's main thread (never caught as an ``Exception``)."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300].rstrip(": ")


class Report(dict):
    """The figures of the JSON line, and ``failed``: case -> one-line reason."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: dict[str, str] = {}

    def fail(self, case: str, reason: str) -> None:
        """Name a failed case (its first reason is kept), and say so on stderr."""
        reason = (reason.strip().splitlines() or ["failed"])[0][:300]
        print(f"FAILED {case}: {reason}", file=sys.stderr, flush=True)
        self.failed.setdefault(case, reason)

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        """Run a case: an ``Exception`` (or ``SystemExit``) out of it fails ``name``, and
        the benchmark goes on with its other cases. Ctrl-C and SIGTERM still end it."""
        try:
            yield
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.fail(name, one_line(exc))
        except SystemExit as exc:
            self.fail(name, _exit_reason(exc))

    def check(self, case: str, ok: bool, reason: str) -> bool:
        """Fail ``case`` with ``reason`` unless ``ok`` (a correctness property measured by
        the benchmark, as opposed to a figure that misses its goal); returns ``ok``."""
        if not ok:
            self.fail(case, reason)
        return ok

    def line(self) -> dict[str, Any]:
        return {**self, **({"failed": dict(self.failed)} if self.failed else {})}


def _exit_reason(exc: SystemExit) -> str:
    if isinstance(exc.code, str):
        return exc.code
    return f"exit code {exc.code}"


def _plain(value: Any) -> Any:
    """json.dumps' fallback: numpy scalars and arrays as numbers and lists, else the text."""
    for attr in ("item", "tolist"):
        if hasattr(value, attr):
            with contextlib.suppress(Exception):
                return getattr(value, attr)()
    return str(value)


def emit(fields: Mapping[str, Any]) -> None:
    """Print one JSON object as a line, whatever the values are."""
    sys.stdout.flush()
    print(json.dumps(fields, default=_plain), flush=True)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None,
          smoke: Mapping[str, Any] | None) -> argparse.Namespace:
    """``parser``'s arguments plus ``--smoke``, which takes the defaults in ``smoke``."""
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds at tiny sizes (what the test suite runs); its "
                             "figures mean nothing")
    given = sys.argv[1:] if argv is None else argv
    if smoke and "--smoke" in given:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def _on_sigterm(owner: int) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a forked child inherited this: end as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Stopped("SIGTERM")
    return handler


def run_benchmark(parser: argparse.ArgumentParser,
                  bench: Callable[[argparse.Namespace, Report], None],
                  smoke: Mapping[str, Any] | None = None,
                  argv: list[str] | None = None) -> int:
    """Parse the command line, run ``bench(args, report)`` and print the report as the last
    line; the exit code: 0, or 1 when anything failed (2 for a bad command line)."""
    report = Report()
    try:
        args = parse(parser, argv, smoke)
    except SystemExit as exc:
        if not exc.code:
            raise  # --help
        report.fail("arguments", "bad command line (see stderr)")
        emit(report.line())
        return 2
    if args.smoke:
        report["smoke"] = True
    previous = signal.signal(signal.SIGTERM, _on_sigterm(os.getpid()))
    try:
        bench(args, report)
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        report.failed["arguments"] = str(exc)
        return 2
    except KeyboardInterrupt:
        report.fail("interrupted", "KeyboardInterrupt (Ctrl-C)")
    except Stopped:
        report.fail("interrupted", "SIGTERM")
    except SystemExit as exc:
        if exc.code not in (0, None):
            report.fail("main", _exit_reason(exc))
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        report.fail("main", one_line(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
        emit(report.line())
    return 1 if report.failed else 0
