"""Waiting in tests: poll a condition until it holds or a deadline passes, and read the
records a running worker is still writing."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


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


def end_processes(procs, timeout: float = 30) -> None:
    """SIGTERM every process of ``procs`` (``subprocess.Popen``), then wait for each,
    killing one that outlives ``timeout``."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def jsonl_records(path: Path) -> list[dict]:
    """The records of a JSON-lines file a process may still be writing (none if it is
    not there yet; a line being written is skipped)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return out
