"""Command-line values, checked where argparse reads them: every bad one ends as ONE line
naming the flag and the fix (``pollux-run: error: ...``, exit code 2), never a usage
dump or a traceback. Every ``pollux-run`` parser is a :class:`OneLineParser`, and every
number flag takes one of the types below (``nan`` and ``inf`` are never a setting).

Shared by the launcher and the coordinator subcommands, so that neither imports the other."""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import socket
from typing import NoReturn

from pollux_launch.errors import UserError

from . import keys
from .messages import GPU_TYPE, MAX_REPLICAS, MAX_SLOTS


class OptionsError(UserError, ValueError):
    """Bad command-line input; the message is one line that says how to fix it."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise OptionsError(f"{message} (see {self.prog} --help)")


def _number(text: str, cast=float):
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive seconds")
    return value


def seconds_or_zero(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more seconds")
    return value


def lease_seconds(text: str) -> float:
    """A lease TTL: etcd grants whole seconds, at least one."""
    value = _number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1 second")
    return value


def count(text: str) -> int:
    """A positive count (replicas, restarts)."""
    value = _number(text, int)
    if not 1 <= value <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"{text} must be a whole number from 1 to "
                                         f"{MAX_REPLICAS}")
    return value


def slots(text: str) -> int:
    value = _number(text, int)
    if not 1 <= value <= MAX_SLOTS:
        raise argparse.ArgumentTypeError(f"{text} must be a whole number from 1 to {MAX_SLOTS}")
    return value


def fairness(text: str) -> float:
    """Pollux's fairness knob p (Eqn 14): 1 is the plain sum of speedups, lower is fairer;
    p > 1 would favour the fastest jobs and p = 0 is undefined."""
    value = _number(text)
    if not -100 <= value <= 1 or value == 0:
        raise argparse.ArgumentTypeError(
            f"{text} must lie in [-100, 1] and not be 0 (e.g. -1 for fair, 1 for plain sum)")
    return value


def name(text: str) -> str:
    """A node or job name: one level of a store key."""
    if not keys.NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be 1-128 characters from A-Z a-z 0-9 _ . @ : + -")
    return text


# a host name (RFC 1123): dot-separated labels of letters, digits and inner hyphens
_HOST_NAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def gpu_type_flag(text: str) -> str:
    """A GPU type (``--gpu-type``; messages.GPU_TYPE)."""
    if not GPU_TYPE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a GPU type: use letters, "
                                          "digits and '_.+-' (at most 64), e.g. A100")
    return text


def gpu_types_flag(text: str) -> tuple[str, ...]:
    """``--gpu-types A100,H100``: the types a job may run on."""
    return tuple(dict.fromkeys(gpu_type_flag(t.strip()) for t in text.split(",")))


def node_address(text: str) -> str:
    """An address other nodes reach this one at: an IP address, or a host name that
    resolves here. A name whose last label is all digits is no name (RFC 3696): such
    text is a mistyped IP address (999.1.1.1). Resolving here proves the name exists,
    not that every node resolves it alike - an IP address is the surer choice."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(text) or text.rstrip(".").rpartition(".")[2].isdigit():
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is neither an IP address nor a host "
                                         "name")
    try:
        socket.getaddrinfo(text, None)
    except (OSError, UnicodeError):  # (socket.gaierror is an OSError)
        raise argparse.ArgumentTypeError(f"{text!r} does not resolve on this host; give "
                                         "this node's IP address") from None
    return text


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """``--admission``, ``--max-wait``, ``--max-running``: the coordinator's and the
    simulator's admission control (``pollux_launch.policy.admission``)."""
    from .policy.admission import ADMISSION_MODES

    parser.add_argument("--admission", default="none", choices=ADMISSION_MODES,
                        help="none: every job competes from its arrival (Pollux); queue: "
                        "admit in arrival order while every admitted job can run, the rest "
                        "wait; drop: reject a job that cannot run when it arrives")
    parser.add_argument("--max-wait", type=seconds_or_zero, default=None, metavar="S",
                        help="--admission queue: reject a job not admitted within S seconds")
    parser.add_argument("--max-running", type=count, default=None, metavar="N",
                        help="--admission queue/drop: at most N admitted jobs at once")


def admission_from_args(ns: argparse.Namespace):  # -> AdmissionConfig
    """The admission configuration of parsed arguments; a bad combination is one line."""
    from .policy.admission import AdmissionConfig

    try:
        return AdmissionConfig(ns.admission, ns.max_wait, ns.max_running)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def node_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` nodes of an autoscaled cluster."""
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be MIN:MAX node counts, e.g. 1:16"
                                         ) from None
    if not sep or not 0 <= low <= high or high < 1 or high > 100_000:
        raise argparse.ArgumentTypeError(f"{text!r} must be MIN:MAX with 0 <= MIN <= MAX, "
                                         "1 <= MAX <= 100000")
    return low, high


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    """``--autoscale MIN:MAX`` and its knobs: the coordinator's and the simulator's
    cluster autoscaler (``pollux_launch.policy.autoscale``)."""
    parser.add_argument("--autoscale", type=node_range, default=None, metavar="MIN:MAX",
                        help="grow and shrink the cluster between MIN and MAX nodes by "
                        "Pollux's utility rule (default: a fixed cluster)")
    parser.add_argument("--utility-high", type=float, default=2 / 3, metavar="U",
                        help="grow when the utility is above U (default 2/3)")
    parser.add_argument("--utility-low", type=float, default=0.5, metavar="L",
                        help="...to the size whose utility is about L; shrink below L "
                        "(default 1/2)")
    parser.add_argument("--scale-interval", type=seconds, default=60.0, metavar="S",
                        help="seconds between autoscaling decisions (default 60)")
    parser.add_argument("--min-node-lifetime", type=seconds_or_zero, default=300.0,
                        metavar="S", help="seconds a node stays before it may be released "
                        "(default 300)")
    parser.add_argument("--autoscale-rule", default="goodput", choices=("goodput", "throughput"),
                        help="goodput: Pollux's utility; throughput: the same rule blind to "
                        "statistical efficiency (Or et al.'s baseline)")


def autoscale_from_args(ns: argparse.Namespace):  # -> AutoscaleConfig | None
    """The autoscaler's configuration of parsed arguments (None without --autoscale)."""
    from .policy.autoscale import AutoscaleConfig

    if ns.autoscale is None:
        return None
    try:
        return AutoscaleConfig(ns.autoscale[0], ns.autoscale[1], ns.utility_high,
                               ns.utility_low, ns.scale_interval, ns.min_node_lifetime,
                               ns.autoscale_rule)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
