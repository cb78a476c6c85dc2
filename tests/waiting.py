"""Waiting in tests: poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    """``predicate()``'s first truthy value within ``timeout`` seconds (polled every
    ``every``), else AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
