"""A Horovod job's warm zygote: one pre-started Python that has imported what the job's
workers import, and forks a newcomer for every hand-off (:mod:`.handoff`).

    POLLUX_HVD_WARM_COMMAND='["python", "train.py", ...]' \\
        python [its flags] -m pollux_launch.adapters.horovod.launch.zygote SOCKET

Started by :class:`~.warm.WarmStart` with the job's interpreter, interpreter flags and
environment (the command comes through the environment so that the zygote's own command
line is not taken for a worker's). It

1. sets ``sys.path[0]`` as ``python COMMAND`` would, imports ``torch``, ``horovod.torch``,
   pollux's Horovod adapter and the installed modules the script imports (not its own
   folder's: those may read the rank at import), and steps a throw-away optimizer (the
   first one imports ``torch._dynamo``: seconds); nothing that starts threads (no
   backward pass: autograd starts its device threads on the first);
2. refuses to serve (exit 3, one line) if that started a Python thread or CUDA: a fork
   would not be safe;
3. listens on ``SOCKET`` (bound under a temporary name, then renamed: the path exists
   only once the zygote is ready), and for each hand-off whose argv is the job's command
   forks a child that takes the sender's stdio, environment and directory, starts its
   own session, dies when the sender's connection closes, and runs the command from the
   top (a script in a fresh ``__main__``, as ``python`` runs it; ``-m`` through
   ``runpy``); the zygote reports ``pid N`` then ``exit N`` to the sender;
4. ends when the process that started it is gone, or on SIGTERM (its children live on:
   each ends with its own sender).

A newcomer therefore runs the user's script from its first line, as a cold one would;
only the imports (and the first optimizer's) are already done. Horovod is not
initialised here: ``hvd.init()`` runs in the child, with the rank Horovod's driver gave it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path

from .warm import ENV_COMMAND, PythonCommand, python_command

# Always worth importing for a Horovod worker (each only if installed).
PRELOAD = ("torch", "horovod.torch", "pollux_launch.adapters.horovod.optimizer",
           "pollux_launch.adapters.horovod.state")
POLL = 0.2  # seconds between checks for ended children and a vanished parent


@dataclass
class Request:
    conn: socket.socket
    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]


# ------------------------------------------------------------------ warm-up (the zygote)
def script_imports(path: str) -> list[str]:
    """Modules a script imports anywhere in its body (absolute imports only)."""
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
    return list(dict.fromkeys(names))


def _installed(name: str, local: str | None) -> bool:
    """Whether ``name``'s top-level package is found outside the script's own folder
    ``local`` (asked of the top level only: finding a submodule imports its parents)."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError, AttributeError):
        return False
    if spec is None:
        return False
    where = spec.origin or next(iter(spec.submodule_search_locations or ()), None)
    if local is None or where in (None, "built-in", "frozen"):
        return True
    return not Path(where).resolve().is_relative_to(local)


def warm_up(target: PythonCommand) -> None:
    """Import what the target will (see the module docstring); errors are the child's."""
    local = None
    if target.script is not None:
        local = str(Path(target.script).resolve().parent)
        sys.path[0] = local
        extra = script_imports(target.script)
    else:
        extra = [target.module.partition(".")[0]] if target.module else []
        local = os.getcwd() if target.module else None
    for name in (*PRELOAD, *extra):
        try:
            if name in PRELOAD or _installed(name, local):
                importlib.import_module(name)
        except BaseException:  # the child meets (and reports) it itself
            continue
    torch = sys.modules.get("torch")
    if torch is not None:  # the first optimizer imports torch._dynamo (seconds), its first
        # step more (what Horovod's broadcast_optimizer_state runs in a newcomer)
        param = torch.zeros(1, requires_grad=True)
        param.grad = torch.zeros(1)
        torch.optim.SGD([param], lr=0.1, momentum=0.9).step()


def fork_hazard() -> str | None:
    """Why forking now would not be safe (None: it is). Python threads and CUDA are
    not; native pools that re-create themselves after a fork (OpenBLAS, loaded by numpy
    with its threads running unless ``OMP_NUM_THREADS=1``) are."""
    if threading.active_count() > 1:
        return f"the warm-up started {threading.active_count() - 1} Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the warm-up initialised CUDA"
    return None


# ------------------------------------------------------------------ serving (the zygote)
def _receive(conn: socket.socket) -> Request:
    conn.settimeout(5.0)  # a sender writes all at once; a stuck one must not stall others
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) != 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("bad hand-off header")
    size = struct.unpack(">I", head)[0]
    chunks, got = [], 0
    while got < size:
        chunk = conn.recv(min(size - got, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    # Blocking from now on, for good: after the fork the zygote and the child share the
    # socket's file status flags, so a timeout set by one would make the other's reads
    # fail with EAGAIN (the few bytes the zygote still sends never block).
    conn.settimeout(None)
    try:
        msg = json.loads(b"".join(chunks))
        return Request(conn, list(msg["argv"]), dict(msg["env"]), str(msg["cwd"]), fds)
    except (ValueError, KeyError, TypeError):
        for fd in fds:
            os.close(fd)
        raise ValueError("bad hand-off") from None


def serve(path: str, command: list[str]) -> Request | None:
    """Serve hand-offs until the parent is gone (None, in the zygote); returns the
    request in each forked child."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}")
    sock.bind(tmp)
    sock.listen(64)
    os.rename(tmp, path)  # ready: the path appears only now
    parent = os.getppid()
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        _reap(children)
        if not select.select([sock], [], [], POLL)[0]:
            continue
        conn, _ = sock.accept()
        try:
            req = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if req.argv != command:
            _send(conn, "refuse not this job's command")
            for fd in req.fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the newcomer: none of the zygote's sockets but its own
            sock.close()
            for other in children.values():
                other.close()
            return req
        for fd in req.fds:
            os.close(fd)
        _send(conn, f"pid {pid}")
        children[pid] = conn
    sock.close()
    Path(path).unlink(missing_ok=True)
    return None


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, f"exit {os.waitstatus_to_exitcode(status)}")
            conn.close()


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(f"{line}\n".encode())
    except OSError:
        pass  # the sender is gone: its worker dies with the connection anyway


# ------------------------------------------------------------------ the newcomer (a child)
def become(req: Request, target: PythonCommand) -> int:
    """In a forked child: take over the sender's process context and run the target."""
    os.setsid()  # as Horovod's middleman starts every worker: off the terminal's group
    for fd, std in zip(req.fds, (0, 1, 2), strict=True):
        if fd != std:
            os.dup2(fd, std)
            os.close(fd)
    os.chdir(req.cwd)
    os.environ.clear()
    os.environ.update(req.env)
    _reseed()
    threading.Thread(target=_die_with_sender, args=(req.conn,), daemon=True,
                     name="pollux-handoff").start()
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if target.script is not None:  # as ``python SCRIPT`` sets up its __main__
        path = os.path.abspath(target.script)
        sys.argv = [target.script, *target.args]
        sys.path[0] = str(Path(path).resolve().parent)
        main.__file__ = path
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
        exec(code, main.__dict__)  # the job's own script, as python runs it
    elif target.module is not None:
        import runpy

        sys.argv = [target.module, *target.args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *target.args]
        sys.path[0] = ""
        exec(compile(target.code or "", "<string>", "exec"), main.__dict__)
    return 0


def _reseed() -> None:
    """Fresh seeds where a fork would share the zygote's: numpy's global generator is
    seeded from the OS once, at import (Python's ``random`` reseeds itself after fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _die_with_sender(conn: socket.socket) -> None:
    """The sender (Horovod's worker process) never writes again: EOF means it died."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pollux_launch.adapters.horovod.launch.zygote SOCKET "
              f"(with ${ENV_COMMAND})", file=sys.stderr)
        return 2
    try:
        command = json.loads(os.environ.pop(ENV_COMMAND))
        target = python_command(command)
    except (KeyError, ValueError, TypeError):
        target = None
    if target is None:
        print(f"zygote: ${ENV_COMMAND} must be a python command", file=sys.stderr)
        return 2
    warm_up(target)
    hazard = fork_hazard()
    if hazard is not None:
        print(f"[pollux] newcomers start cold: {hazard}", file=sys.stderr)
        return 3
    req = serve(args[0], command)
    if req is None:
        return 0
    return become(req, target)


if __name__ == "__main__":
    sys.exit(main())
