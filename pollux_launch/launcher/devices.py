"""A node's GPUs as its slots: which GPUs it has, and which worker holds which.

Protocol:

* A node's GPUs are ids as ``CUDA_VISIBLE_DEVICES`` names them (indices, ``GPU-<uuid>``
  or ``MIG-<uuid>``): the operator's ``--gpus N`` (the first N) or ``--gpus 0,2,5``,
  else the entries of ``CUDA_VISIBLE_DEVICES`` the agent was started with (a batch
  system's grant), else the driver's GPUs (:func:`detect_gpus`). A node with GPUs has
  one slot per GPU: one replica, one GPU.
* A worker holds exactly one GPU from before its process starts until its agent has
  reaped it (exited: a leaver that has not exited still holds its GPU), and no other
  worker - of its job or another - is given that GPU meanwhile.
* A claim is exclusive across every process of this machine that shares the node's
  name (several ``pollux-run`` in local mode share one machine's GPUs): an ``flock``
  on ``<lock_dir>/<gpu>.lock``, which the kernel drops when the claiming process ends.
* A worker sees (``CUDA_VISIBLE_DEVICES``) the GPUs its job's unreaped workers on the
  node hold, oldest first, with its own at position ``LOCAL_RANK`` - so torchrun's
  ``cuda:LOCAL_RANK`` is its own GPU and ``LOCAL_WORLD_SIZE`` GPUs are its job's on the
  node, as under torchrun on a node of its own - never a GPU of another job; its own
  GPU is also in ``POLLUX_GPUS`` (:func:`worker_env`).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

from pollux_launch.errors import PolluxError

from .. import env as envvars
from ..arguments import OptionsError
from ..messages import GPU_ID

# Device files of a GPU driver torch can use (NVIDIA's, AMD's ROCm): without any, the
# machine has no GPU and nothing needs to import torch (about 1 s) to count none.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


class DevicesBusy(PolluxError):
    """No GPU of this node is free now (another process on the machine holds them): the
    worker waits for one, as for a slot."""


def inherited_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The GPUs this process was given (``CUDA_VISIBLE_DEVICES``), None if it was not
    restricted. CUDA stops at the first entry it cannot parse (``-1``): so do we."""
    environ = os.environ if environ is None else environ
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    out: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry or entry.startswith("-") or not GPU_ID.fullmatch(entry):
            break
        out.append(entry)
    return tuple(out)


def detect_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """This machine's GPUs: ``CUDA_VISIBLE_DEVICES``' entries where it is set, else the
    driver's (``nvidia-smi``, else torch), else none."""
    given = inherited_gpus(environ)
    if given is not None:
        return given
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return ()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20,
                                 stdin=subprocess.DEVNULL)
            ids = tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and all(i.isdigit() for i in ids):
                return ids
        except (OSError, subprocess.SubprocessError):
            pass  # torch may still see them
    try:
        import torch

        return tuple(str(i) for i in range(torch.cuda.device_count()))
    except Exception:  # any torch trouble: no GPUs we can use, CPU slots then
        return ()


def gpu_type(gpus: Sequence[str]) -> str:
    """The type of this node's GPUs (its first GPU's model, e.g. ``H100`` from "NVIDIA
    H100 80GB HBM3", from ``nvidia-smi``, else torch); ``cpu`` for CPU slots; ``gpu``
    when the driver does not say."""
    if not gpus:
        return "cpu"
    model = ""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader", "-i",
                                  gpus[0]], capture_output=True, text=True, timeout=20,
                                 stdin=subprocess.DEVNULL)
            model = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError, IndexError):
            model = ""  # (torch may still say)
    if not model:
        try:
            import torch

            model = torch.cuda.get_device_name(0)
        except Exception:  # any torch trouble: a GPU of no known type
            model = ""
    return gpu_type_name(model)


def gpu_type_name(model: str) -> str:
    """A driver's model name as a GPU type: its model number (``A100``, ``L40S``,
    ``MI300X``), else the whole name with what a type may not hold replaced."""
    found = re.search(r"\b([A-Z]{1,4}\d{2,4}[A-Z]?)\b", model)
    if found:
        return found.group(1)
    cleaned = re.sub(r"[^A-Za-z0-9_.+-]+", "-", model).strip("-")[:64]
    return cleaned or "gpu"


def parse_gpus(text: str, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``--gpus``: ``N`` (this machine's first N GPUs, counting from its
    ``CUDA_VISIBLE_DEVICES`` where set, else 0..N-1 - how tests declare GPUs a machine
    lacks), ``0,2,5`` (those ids), ``none`` or ``0`` (CPU slots). One-line OptionsError."""
    text = text.strip()
    if text.lower() in ("none", "0", ""):
        return ()
    if text.isdigit():
        n = int(text)
        given = inherited_gpus(environ)
        if given is None:
            return tuple(str(i) for i in range(n))
        if n > len(given):
            raise OptionsError(f"--gpus {n}: this process was given only {len(given)} "
                               f"(CUDA_VISIBLE_DEVICES={','.join(given) or 'none'})")
        return given[:n]
    ids = tuple(e.strip() for e in text.split(","))
    bad = [e for e in ids if not GPU_ID.fullmatch(e)]
    if bad:
        raise OptionsError(f"--gpus {text!r}: {bad[0]!r} is not a GPU id; give a count (4) "
                           "or ids as CUDA_VISIBLE_DEVICES names them (0,2,5)")
    if len(set(ids)) != len(ids):
        raise OptionsError(f"--gpus {text!r} names a GPU twice")
    return ids


def cpu_slots(env: Mapping[str, str] | None = None) -> int:
    """The CPU cores this process may use: inside a Slurm job, the allocation's cores on
    this node (``SLURM_CPUS_ON_NODE``: a node shared with other jobs is not all ours),
    else those of its CPU affinity."""
    env = os.environ if env is None else env
    given = env.get(envvars.SLURM_CPUS_ON_NODE, "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return len(os.sched_getaffinity(0)) or os.cpu_count() or 1


def node_slots(gpus: Sequence[str], slots: int | None, flag: str = "--slots") -> int:
    """A node's slots: one per GPU when it has GPUs (``slots``, if given, must not ask for
    more), else ``slots`` or its CPU cores."""
    if not gpus:
        return slots if slots is not None else cpu_slots()
    if slots is not None and slots > len(gpus):
        raise OptionsError(f"{flag} {slots} but this node has {len(gpus)} GPU(s) "
                           f"({','.join(gpus)}): every replica holds a GPU of its own; "
                           "lower it, or declare the GPUs with --gpus")
    return slots if slots is not None else len(gpus)


def default_lock_dir(node: str) -> str:
    """Where the claims on a node's GPUs are kept: the same for every process of this user
    on the machine that runs that node (so that local launchers share them)."""
    return os.path.join(tempfile.gettempdir(), f"pollux-launch-{os.getuid()}", "gpus", node)


class DevicePool:
    """One process's view of a node's GPUs: which it claimed, for whom. Not thread-safe:
    used from its agent's loop only."""

    def __init__(self, gpus: Sequence[str], lock_dir: str) -> None:
        self.gpus = tuple(gpus)
        self.lock_dir = lock_dir
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        self._held: dict[str, tuple[str, int]] = {}  # gpu -> (owner, its lock's fd)

    def _lock(self, gpu: str) -> int | None:
        """The fd of a fresh lock on ``gpu``, None if another process holds it."""
        path = os.path.join(self.lock_dir, gpu.replace("/", "_") + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def free(self) -> int:
        """How many GPUs a claim could get now (this process's and others' claims off)."""
        n = 0
        for gpu in self.gpus:
            if gpu in self._held:
                continue
            fd = self._lock(gpu)
            if fd is not None:
                os.close(fd)  # (closing the only fd drops the lock)
                n += 1
        return n

    def claim(self, owner: str) -> str:
        """A free GPU, now held for ``owner`` (its job's name); DevicesBusy if none is
        free."""
        for gpu in self.gpus:
            if gpu not in self._held:
                fd = self._lock(gpu)
                if fd is not None:
                    self._held[gpu] = (owner, fd)
                    return gpu
        raise DevicesBusy(f"all {len(self.gpus)} GPUs of this node are held")

    def release(self, gpu: str) -> None:
        held = self._held.pop(gpu, None)
        if held is not None:
            os.close(held[1])

    def owners(self) -> dict[str, str]:
        """gpu -> owner, for the GPUs this process holds."""
        return {gpu: owner for gpu, (owner, _) in self._held.items()}

    def close(self) -> None:
        for gpu in list(self._held):
            self.release(gpu)


def worker_env(own: str, job_gpus: Sequence[str], local_rank: int | None) -> dict[str, str]:
    """The GPU variables of a worker that holds ``own`` and starts beside the job's other
    workers on the node holding ``job_gpus`` (oldest first): its own GPU at position
    ``local_rank`` (where the job's GPUs reach that far; else after them)."""
    at = len(job_gpus) if local_rank is None else min(max(0, local_rank), len(job_gpus))
    visible = [*job_gpus[:at], own, *job_gpus[at:]]
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible), envvars.GPUS: own}


def local_slots_default(gpus_only: bool = False) -> int:
    """This machine's GPUs, or its CPU cores when it has none (``gpus_only``: 0 then)."""
    gpus = len(detect_gpus())
    return gpus if gpus_only else gpus or cpu_slots()
