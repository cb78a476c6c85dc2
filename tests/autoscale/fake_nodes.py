"""Starts and stops local `pollux-run agent` processes as if they were machines.

``fake_nodes.py up N`` / ``fake_nodes.py down NODE...``: a ``command`` provisioner (the
test puts it on PATH).

State (pids, a log of calls) lives in ``$FAKE_NODES_DIR``; agents reach the store at
``$FAKE_NODES_STORE`` under ``$FAKE_NODES_PREFIX``. Each agent has 1 slot. A machine of
``up`` boots for ``$FAKE_NODES_BOOT_S`` seconds (default 0) before its agent starts.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

DIR = Path(os.environ["FAKE_NODES_DIR"])
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))


def log(*call: str) -> None:
    with open(DIR / "calls.jsonl", "a") as f:
        f.write(json.dumps(list(call)) + "\n")


def start(name: str, argv: list[str], env: dict[str, str]) -> None:
    out = open(DIR / f"{name}.log", "ab")
    proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    (DIR / f"{name}.pid").write_text(str(proc.pid))


def stop(name: str) -> None:
    pid = int((DIR / f"{name}.pid").read_text())
    os.kill(pid, signal.SIGTERM)  # the agent drains and exits
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    (DIR / f"{name}.pid").unlink()


def agent(name: str) -> list[str]:
    return [POLLUX_RUN, "agent", "--store", os.environ["FAKE_NODES_STORE"], "--store-prefix",
            os.environ["FAKE_NODES_PREFIX"], "--node-name", name, "--slots", "1",
            "--state-dir", str(DIR / f"state-{name}")]


def main(prog: str, args: list[str]) -> int:
    log(prog, *args)
    if args[0] == "up":
        for _ in range(int(args[1])):
            n = len(list(DIR.glob("made-*"))) + 1
            (DIR / f"made-{n}").touch()
            argv, boot = agent(f"auto-{n}"), float(os.environ.get("FAKE_NODES_BOOT_S", 0))
            if boot > 0:
                argv = ["/bin/sh", "-c", f"sleep {boot:g}; exec {shlex.join(argv)}"]
            start(f"auto-{n}", argv, dict(os.environ))
        return 0
    if args[0] == "down":
        for node in args[1:]:
            stop(node)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[0]).name, sys.argv[1:]))
