"""Benchmark workers report by printing one JSON object per line; the driver reads each
worker's stdout into one queue (shared by rescale.py, deepspeed_rebuild.py and
rendezvous_scale.py, imported beside them)."""

from __future__ import annotations

import json
import queue
import subprocess
from collections.abc import Callable


def read_events(wid: str, proc: subprocess.Popen, events: queue.Queue,
                keep: Callable[[dict], bool] = lambda event: True) -> None:
    """Put every JSON object line of ``proc``'s stdout that ``keep`` accepts on ``events``,
    tagged with ``worker: wid``, until the stream ends."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the worker's own output, not an event
        if isinstance(event, dict) and keep(event):
            event["worker"] = wid
            events.put(event)
