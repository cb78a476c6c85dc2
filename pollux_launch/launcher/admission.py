"""Which job specs a node agent runs: signed, for this job, unexpired, never twice.

With a cluster secret set, a spec is admitted only if

* its signature (``jobs/<job>/signature``, HMAC-SHA256 of the spec's exact text) is
  valid: the text binds the job's name, a random submission id and an expiry, so the
  spec cannot be changed, renamed or copied under another job's key (the key's name
  must be the spec's);
* it has not expired (``JobSpec.expires``): an old signed spec cannot be replayed later;
* its submission has not finished on this node before: a finished job whose status is
  set back to ``pending`` (or deleted) is not run again. Finished submissions are kept
  in ``state_dir`` (until their expiry), so this holds across agent restarts.

Without a secret every spec is admitted (single-user clusters; the agent warns).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..messages import JobSpec
from . import security

log = logging.getLogger(__name__)

FINISHED_FILE = "finished-submissions.json"


class Admission:
    def __init__(self, secret: bytes | None, state_dir: str | os.PathLike | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret, self.clock = secret, clock
        self.path = Path(state_dir) / FINISHED_FILE if state_dir else None
        self._finished: dict[str, float] = self._load()  # submission -> its expiry

    def refusal(self, spec: JobSpec, spec_text: str, signature: str | None) -> str | None:
        """Why ``spec`` must not run here, or None if it may."""
        if self.secret is None:
            return None
        if not security.verify(spec_text, signature, self.secret):
            return "its spec is not signed with this cluster's secret"
        if not spec.submission or not spec.expires:
            return "its signed spec has no submission id or expiry (an old pollux-run?)"
        if spec.expires <= self.clock():
            return "its signed spec expired (submit the job again)"
        if spec.submission in self._finished:
            return "this submission finished already (a replay)"
        return None

    def finished(self, spec: JobSpec) -> None:
        """Remember that ``spec``'s submission ended: it never runs here again."""
        if not spec.submission or spec.submission in self._finished:
            return
        now = self.clock()
        self._finished = {s: t for s, t in self._finished.items() if t > now}
        self._finished[spec.submission] = spec.expires or now
        self._save()

    def _load(self) -> dict[str, float]:
        if self.path is None:
            return {}
        try:
            raw = json.loads(self.path.read_text())
            return {str(k): float(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError) as exc:  # refuse nothing less: start empty
            log.error("%s unreadable (%s); replays of jobs finished before are not "
                      "recognised", self.path, exc)
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._finished))
            os.replace(tmp, self.path)
        except OSError as exc:  # the in-memory record still refuses replays until restart
            log.error("cannot record finished submissions in %s: %s", self.path, exc)
