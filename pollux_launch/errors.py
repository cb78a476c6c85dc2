"""The one error hierarchy of pollux-launch.

Every exception this package raises on purpose derives from :class:`PolluxError`. Its
:class:`UserError` branch is for what a user can cause and fix (a bad flag, hostfile,
ds_config section, spec or store URL; a store that cannot be reached): ``pollux-run``
prints such an error as one line and exits 2. Anything else - a bug in our code
included - keeps its traceback.

Subclasses keep the builtin base they had (``ValueError``, ``RuntimeError``) as a
second base, so ``except ValueError`` in a caller's code goes on working.

Two deliberate exceptions to the root: ``elastic.controller.LeaveJob`` is a
``SystemExit`` (a worker leaving its job is an exit, not an error), and
``adapters/horovod/launch/handoff.py`` imports nothing of ours (it runs in the warm
zygote before anything else is imported).
"""

from __future__ import annotations

__all__ = ["PolluxError", "UserError"]


class PolluxError(Exception):
    """Root of every error pollux-launch raises on purpose."""


class UserError(PolluxError):
    """Something the user can fix; the message is one line that says what and how.

    The CLI prints ``pollux-run: error: <message>`` and exits 2, without a traceback.
    """
