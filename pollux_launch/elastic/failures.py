"""Is this exception a peer's failure? One answer for every adapter.

A collective raises when a peer of its group died, hung past the timeout or had its
connections cut (``rendezvous/sever.py``). torch reports that by type for NCCL and the
TCPStore (``torch.distributed.DistError`` and its subclasses ``DistBackendError``,
``DistNetworkError``, ``DistStoreError``), but gloo (torch 2.13) raises a bare
``RuntimeError`` whose text names the transport error. So: the type first, then - only
for a bare ``RuntimeError`` while a process group exists - the message, and that
fallback is logged (once per kind of message) so that it stays visible.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..errors import PolluxError, UserError
from ..peer_failure import gloo_says_peer_failed

log = logging.getLogger(__name__)

_seen_fallbacks: set[str] = set()


def is_peer_failure(exc: BaseException) -> bool:
    """True if ``exc`` is a collective's failure caused by another member of the group."""
    if isinstance(exc, dist.DistError):
        return True
    if type(exc) is not RuntimeError or not dist.is_initialized():
        return False
    if not gloo_says_peer_failed(str(exc)):
        return False
    kind = first_line(exc)[:60]
    if kind not in _seen_fallbacks:  # bounded: one entry per distinct message start
        if len(_seen_fallbacks) < 64:
            _seen_fallbacks.add(kind)
        log.info("treating a RuntimeError from the process group as a peer's failure by its "
                 "message (gloo raises no typed error): %s", first_line(exc))
    return True


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (no traceback walls in logs)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class StateLost(PolluxError):
    """A peer's failure took training state that no survivor holds (a sharded model's
    shard): the new group cannot go on from the survivors' state.

    Raised by ``FrameworkHooks.rebuild`` on every rank of the new group alike (they vote
    first). The controller then resumes the whole group from the newest durable
    checkpoint - ``reload(captured)`` is the hooks' own loading of one, with what
    ``restore_checkpoint`` returned on rank 0 and None elsewhere, returning the
    controller state on the ranks that did not load it - or, with none, raises
    ``error``: one line saying what was lost and how to resume.
    """

    def __init__(self, error: UserError,
                 reload: Callable[[Any], dict[str, Any] | None]) -> None:
        super().__init__(str(error))
        self.error, self.reload = error, reload
