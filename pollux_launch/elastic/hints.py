"""``HintsReporter``: rank 0's path for the job's hints to the store (Pollux Sec. 4.1).

The tuner computes the hints (``GoodputTuner.hints``) and says when a report is due; the
reporter alone writes them, to ``jobs/<job>/hints``. A store that cannot be reached is
logged once per outage and tried again at the next report: training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pollux_launch import env as envvars
from pollux_launch import keys
from pollux_launch.messages import JobHints, encode

from .failures import first_line

if TYPE_CHECKING:
    from pollux_launch.tuning.tuner import GoodputTuner

log = logging.getLogger(__name__)

__all__ = ["HintsReporter"]


class HintsReporter:
    """Rank 0's path for the job's hints to the store (Pollux Sec. 4.1's reports).

    ``store``: a callable returning the store (or None: nothing is reported); a store
    that cannot be reached is logged once per outage and tried again at the next report.
    """

    def __init__(self, store: Callable[[], Any], job: str | None) -> None:
        self._store, self.job = store, job
        self._failing = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> HintsReporter:
        """The store and job named by pollux-run's environment ``environ`` (as read by
        the caller; the store opened lazily, once)."""
        opened: list[Any] = []

        def store() -> Any:
            if not opened and environ.get(envvars.STORE):
                from pollux_launch.rendezvous.store import StoreError
                from pollux_launch.rendezvous.store.environ import store_from_env

                try:
                    opened.append(store_from_env(environ))
                except StoreError as exc:
                    log.warning("no hints: cannot open the store (%s)", first_line(exc))
                    opened.append(None)
            return opened[0] if opened else None

        return cls(store, environ.get(envvars.JOB))

    def report(self, tuner: GoodputTuner, hints: Callable[[], JobHints]) -> None:
        """Write ``hints()`` now (rank 0; the caller asked ``tuner.report_due()``). Store
        trouble is not the training's problem: it is logged, and the next report tries
        again."""
        from pollux_launch.rendezvous.store import StoreError

        store = self._store()
        if store is None or not self.job:
            return
        try:
            made = hints()
            tuner.reported()
            store.put(keys.job(self.job, "hints"), encode(made))
            if self._failing:
                log.info("hints reported again")
            self._failing = False
        except StoreError as exc:  # the store may be away for a while: training goes on
            if not self._failing:
                log.warning("could not report hints (%s); training goes on", first_line(exc))
            self._failing = True
