"""Launch-to-first-step: how long each launcher takes to get a 2-process job to the end of
its first training step (issue 16), on this machine's CPU with gloo.

    python benchmarks/startup.py                   # torchrun, horovodrun, deepspeed, pollux-run
    python benchmarks/startup.py --repeats 5 --launchers torchrun,pollux-run
    python benchmarks/startup.py --tree /tmp/copy  # pollux-run from another source tree

The same minimal script runs under every launcher (``startup_worker.py``: plain
``init_process_group("gloo")`` from torchrun's variables, a DDP ``Linear``, one SGD step;
``startup_worker_hvd.py``, its Horovod twin, under horovodrun):

* ``torchrun --standalone --nproc-per-node 2 startup_worker.py``
* ``horovodrun -np 2 --gloo python startup_worker_hvd.py``
* ``deepspeed --num_gpus 2 --master_port P startup_worker.py`` (DeepSpeed's launcher on
  its CPU accelerator; it passes ``--local_rank=N``, which the script ignores)
* ``pollux-run -np 2 python startup_worker.py`` (local mode: embedded store, in-process
  coordinator and node agent; by default a private store file in a temp dir, so that
  other jobs on the machine neither share its slots nor lead its coordinator; give
  ``--pollux-store embedded://`` for the user's default file)

Launch-to-first-step = rank 0's ``time.time()`` at the end of its first step minus the
``time.time()`` taken just before the launcher's process was started. Rounds are
interleaved (one run of each launcher per round, the order rotating each round) after
one unmeasured warm-up run of each (page cache, ``.pyc``); medians are reported. Also per
launcher: when rank 0's interpreter ran its first line (``worker_started_s``), its
``import torch`` (``worker_import_s``), ``init_process_group`` / ``hvd.init``
(``init_s``: it waits there for every rank), the step itself (``step_s``), the
launcher's exit (``exit_s``), the CPU its own processes (not the workers) used up to the
first step (``launcher_cpu_s``: on a small machine that CPU is taken from the workers),
and when rank 1 started and reached its init (``peer_started_s``, ``peer_at_init_s``).

``--timeline`` (on by default) adds probed runs of pollux-run and torchrun: the
launcher runs inside this script (``--_probe``), which wraps a few of its functions to
stamp when each phase ended (launcher modules imported, slots counted, store opened, job
submitted, leader elected, node registered, first allocation written, worker spawned;
on the way out: a worker reaped, the job's final status written and seen, the services
stopped), with the workers' own marks; medians over ``--timeline-repeats`` runs. Probed runs are
not part of the medians above.

Prints progress lines; the LAST line printed is one JSON object, with ``"failed":
{launcher: why}`` for a launcher that failed a run (``errors`` keeps the same). ``--smoke``:
one measured run of each launcher, no warm-up, one probed timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import Report, UsageError, run_benchmark  # beside this script

HERE = Path(__file__).resolve().parent
WORKER = HERE / "startup_worker.py"
WORKER_HVD = HERE / "startup_worker_hvd.py"
LAUNCHERS = ("torchrun", "horovodrun", "deepspeed", "pollux-run")
GOAL_RATIO = 1.2
NP = 2


# ======================================================================================
# probe mode: run a launcher in this process, stamping its phases (--timeline)
# ======================================================================================


class _Stamps:
    """Appends ``{"event": name, "t": time.time()}`` lines to a file, each event once."""

    def __init__(self, path: str) -> None:
        self.path, self.seen, self.lock = path, set(), threading.Lock()

    def __call__(self, event: str, once: bool = True) -> None:
        t = time.time()
        with self.lock:
            if once and event in self.seen:
                return
            self.seen.add(event)
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "t": t}) + "\n")


def _wrap(owner: object, name: str, after=None, before=None) -> None:
    """Replace ``owner.name`` by a wrapper calling ``before(*args)`` / ``after(result,
    *args)`` around it."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args)
        return result

    setattr(owner, name, wrapper)


def _probe_pollux(stamp: _Stamps, argv: list[str]) -> int:
    import pollux_launch.cli as cli
    import pollux_launch.launcher.run as run

    stamp("launcher_imported")  # pollux-run's modules (not torch: local_gpus)
    from pollux_launch.coordinator.service import Coordinator
    from pollux_launch.launcher.node_agent import NodeAgent
    from pollux_launch.launcher.workers import WorkerGroup

    _wrap(run, "local_gpus", after=lambda r, *a: stamp("slots_counted"))
    _wrap(run, "open_store", after=lambda r, *a: stamp("store_opened"))
    _wrap(run, "_submit", after=lambda r, *a: stamp("job_submitted"))
    _wrap(Coordinator, "_campaign", after=lambda r, *a: r and stamp("leader_elected"))
    _wrap(Coordinator, "schedule_once",
          before=lambda *a: stamp("round_started"),
          after=lambda r, *a: r and stamp("allocation_written"))
    _wrap(NodeAgent, "register", after=lambda r, *a: stamp("node_registered"))
    _wrap(NodeAgent, "step", before=lambda *a: stamp("agent_first_pass"))
    _wrap(WorkerGroup, "start", before=lambda *a: stamp("worker_spawning"),
          after=lambda r, *a: stamp("worker_spawned"))
    # the way out: the job's end seen, the services stopped
    _wrap(WorkerGroup, "reap", after=lambda r, *a: r and stamp("worker_reaped"))
    _wrap(NodeAgent, "_set_status", before=lambda self, job, status: stamp(
        f"status_{status.state}"))
    _wrap(run, "_follow", after=lambda r, *a: stamp("launcher_saw_end"))
    _wrap(NodeAgent, "drain", after=lambda r, *a: stamp("node_agent_stopped"))
    _wrap(Coordinator, "_resign", after=lambda r, self: stamp("coordinator_stopped"))
    code = int(cli.main(argv) or 0)
    stamp("launcher_returned")
    return code


def _probe_torchrun(stamp: _Stamps, argv: list[str]) -> int:
    from torch.distributed import run

    stamp("launcher_imported")  # torch included
    from torch.distributed.elastic.agent.server import api

    _wrap(api.SimpleElasticAgent, "_rendezvous", after=lambda r, *a: stamp("rendezvous_done"))
    _wrap(subprocess.Popen, "__init__", before=lambda *a: stamp("worker_spawning"),
          after=lambda r, *a: stamp("worker_spawned"))
    sys.argv = ["torchrun", *argv]
    run.main(argv)
    return 0


def probe_main(which: str, argv: list[str]) -> int:
    stamp = _Stamps(os.environ["STARTUP_PROBE_FILE"])
    stamp("interpreter_up")
    return {"pollux-run": _probe_pollux, "torchrun": _probe_torchrun}[which](stamp, argv)


# ======================================================================================
# driver side
# ======================================================================================


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_site(tree: Path, folder: Path) -> Path:
    """A folder with a ``sitecustomize`` that imports pollux_launch (and its rendezvous/
    adapters folders) from ``tree`` instead of the installed package."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f'''
import importlib.util, sys
_MAP = {{"pollux_launch": {str(tree / "pollux_launch")!r},
        "pollux_launch.rendezvous": {str(tree / "rendezvous")!r},
        "pollux_launch.adapters": {str(tree / "adapters")!r}}}
class _TreeFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in _MAP:
            return importlib.util.spec_from_file_location(
                name, _MAP[name] + "/__init__.py", submodule_search_locations=[_MAP[name]])
        return None
sys.meta_path.insert(0, _TreeFinder)
''')
    return folder


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.bin = Path(sys.executable).parent
        self.env = dict(os.environ)
        # `python` in the launchers' commands is this interpreter (as in an activated venv)
        self.env["PATH"] = os.pathsep.join([str(self.bin), self.env.get("PATH", "")])
        self.pollux_env = dict(self.env)
        if args.tree:  # (its sitecustomize must be the one found first)
            site = _tree_site(Path(args.tree).resolve(), workdir / "tree-site")
            self.pollux_env["PYTHONPATH"] = os.pathsep.join(
                [str(site), *filter(None, [self.env.get("PYTHONPATH")])])
        self.store = args.pollux_store or f"embedded://{workdir / 'store.db'}"
        self.count = 0

    def exe(self, name: str) -> str | None:
        found = self.bin / name
        return str(found) if found.exists() else shutil.which(name, path=self.env["PATH"])

    def command(self, launcher: str, marks: Path, probe: bool = False) -> tuple[list[str], dict]:
        py = sys.executable
        if launcher == "torchrun":
            args = ["--standalone", "--nproc-per-node", str(NP), str(WORKER), str(marks)]
            if probe:
                return [py, str(Path(__file__).resolve()), "--_probe", "torchrun", *args], self.env
            return [self.exe("torchrun"), *args], self.env
        if launcher == "horovodrun":
            return [self.exe("horovodrun"), "-np", str(NP), "--gloo", "python",
                    str(WORKER_HVD), str(marks)], self.env
        if launcher == "deepspeed":
            return [self.exe("deepspeed"), "--num_gpus", str(NP), "--master_port",
                    str(free_port()), str(WORKER), str(marks)], self.env
        if launcher == "pollux-run":
            args = ["-np", str(NP), "--store", self.store, *self.args.pollux_flags.split(),
                    "python", str(WORKER), str(marks)]
            if probe:
                return ([py, str(Path(__file__).resolve()), "--_probe", "pollux-run", *args],
                        self.pollux_env)
            return [self.exe("pollux-run"), *args], self.pollux_env
        raise ValueError(launcher)

    def run(self, launcher: str, probe: bool = False) -> dict:
        """One launch; returns its figures (or {"error": ...})."""
        self.count += 1
        tag = f"{self.count:03d}-{launcher}"
        marks, log_path = self.workdir / f"{tag}.marks.json", self.workdir / f"{tag}.log"
        stamps = self.workdir / f"{tag}.stamps"
        cmd, env = self.command(launcher, marks, probe)
        if probe:
            env = {**env, "STARTUP_PROBE_FILE": str(stamps)}
        cpu = _TreeCpu()
        with open(log_path, "w") as log:
            t0 = time.time()
            proc = subprocess.Popen(cmd, env=env, cwd=self.workdir, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            deadline = t0 + self.args.timeout
            while proc.poll() is None and time.time() < deadline:
                cpu.sample(proc.pid, (WORKER.name, WORKER_HVD.name))
                time.sleep(0.05)
            if proc.poll() is None:
                _kill_tree(proc)
                return {"error": f"timed out after {self.args.timeout:.0f} s "
                                 f"(log: {log_path})"}
            t_exit = time.time()
        if not marks.exists():
            tail = log_path.read_text(errors="replace")[-600:]
            return {"error": f"exit code {proc.returncode}, no first step; log tail: {tail!r}"}
        m = json.loads(marks.read_text())
        peer_path = Path(f"{marks}.rank1")
        peer = json.loads(peer_path.read_text()) if peer_path.exists() else None
        out = {
            "launch_to_first_step_s": m["first_step"] - t0,
            "worker_started_s": m["start"] - t0,
            "worker_import_s": m["imported"] - m["start"],
            "init_s": m["initialized"] - m["imported"],
            "step_s": m["first_step"] - m["initialized"],
            "exit_s": t_exit - t0,
            "launcher_cpu_s": cpu.at(m["first_step"]),
            "exit_code": proc.returncode,
            # rank 1: when its interpreter started and when it reached init (end of import)
            "peer_started_s": peer["start"] - t0 if peer else None,
            "peer_at_init_s": peer["imported"] - t0 if peer else None,
        }
        if probe:
            events = {}
            if stamps.exists():
                for line in stamps.read_text().splitlines():
                    e = json.loads(line)
                    events.setdefault(e["event"], e["t"] - t0)
            events.update({"worker_started": m["start"] - t0,
                           "worker_imported_torch": m["imported"] - t0,
                           "worker_initialized": m["initialized"] - t0,
                           "first_step": m["first_step"] - t0, "launcher_exited": t_exit - t0})
            if peer:
                events.update({"rank1_started": peer["start"] - t0,
                               "rank1_imported_torch": peer["imported"] - t0})
            out["timeline"] = dict(sorted(events.items(), key=lambda kv: kv[1]))
        return out


class _TreeCpu:
    """CPU seconds (user + system) used by a launcher's process tree, the workers (a
    process running one of the worker scripts) left out: sampled while it runs."""

    def __init__(self) -> None:
        self.per_pid: dict[int, float] = {}
        self.series: list[tuple[float, float]] = []
        self.tick = os.sysconf("SC_CLK_TCK")

    def sample(self, root: int, worker_names: tuple[str, ...]) -> None:
        for pid in _tree(root):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if _is_worker(argv, worker_names):
                continue
            self.per_pid[pid] = (int(fields[11]) + int(fields[12])) / self.tick
        self.series.append((time.time(), sum(self.per_pid.values())))

    def at(self, t: float) -> float | None:
        before = [c for ts, c in self.series if ts <= t]
        return round(before[-1], 3) if before else None


def _is_worker(argv: list[str], names: tuple[str, ...]) -> bool:
    """``python [-u ...] startup_worker.py ...`` (not a launcher given that script)."""
    args = [a for a in argv[1:] if a]
    while args and args[0].startswith("-") and args[0] != "-m":
        args = args[1:]
    return bool(args) and os.path.basename(args[0]) in names and "python" in argv[0]


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the launcher's session (we started it in its own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"FAILED: {r['error'][:300]}"
    return (f"first step {r['launch_to_first_step_s']:.2f} s (worker started "
            f"{r['worker_started_s']:.2f}, import {r['worker_import_s']:.2f}, init "
            f"{r['init_s']:.2f}, step {r['step_s']:.2f}; launcher cpu "
            f"{r['launcher_cpu_s'] if r['launcher_cpu_s'] is not None else float('nan'):.2f} "
            f"s; exit {r['exit_s']:.2f} s)")


def bench(args: argparse.Namespace, report: Report) -> None:
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    for name in launchers:
        if name not in LAUNCHERS:
            raise UsageError(f"unknown launcher {name!r}")
    started = time.time()
    results: dict[str, list[dict]] = {name: [] for name in launchers}
    errors: dict[str, str] = {}
    timelines: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pollux-startup-") as tmp:
        launches = Bench(args, Path(tmp))
        print(f"[startup] {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
              f"pollux-run store {launches.store}" + (f", tree {args.tree}" if args.tree else ""),
              flush=True)
        if not args.no_warmup:
            for name in launchers:
                r = launches.run(name)
                print(f"[startup] warm-up {name}: {_fmt(r)}", flush=True)
                if "error" in r:
                    errors[name] = r["error"]
        live = [n for n in launchers if n not in errors]
        for i in range(args.repeats):
            order = live[i % len(live):] + live[: i % len(live)] if live else []
            for name in order:
                r = launches.run(name)
                print(f"[startup] round {i + 1}/{args.repeats} {name}: {_fmt(r)}", flush=True)
                if "error" in r:
                    errors.setdefault(name, r["error"])
                else:
                    results[name].append(r)
        if args.timeline:
            for i in range(args.timeline_repeats):
                for name in ("torchrun", "pollux-run"):
                    r = launches.run(name, probe=True)
                    print(f"[startup] timeline {i + 1}/{args.timeline_repeats} {name}: "
                          f"{_fmt(r)}", flush=True)
                    if "error" in r:
                        report.fail(f"{name} (timeline)", r["error"])
                    if "timeline" in r:
                        timelines.setdefault(name, []).append(r["timeline"])
                        print("           " + ", ".join(
                            f"{k} {v:.2f}" for k, v in r["timeline"].items()), flush=True)
    fields = ("launch_to_first_step_s", "worker_started_s", "worker_import_s", "init_s",
              "step_s", "exit_s", "launcher_cpu_s", "peer_started_s", "peer_at_init_s")
    out: dict[str, object] = {}
    for field in fields:
        out[field] = {n: _median([r[field] for r in results[n]]) if results[n] else None
                      for n in launchers}
    first = out["launch_to_first_step_s"]
    ratio = (round(first["pollux-run"] / first["torchrun"], 3)
             if first.get("pollux-run") and first.get("torchrun") else None)
    out = {"launch_to_first_step_s": first, "ratio_vs_torchrun": ratio,
           "goal_ratio": GOAL_RATIO, "meets_goal": ratio is not None and ratio <= GOAL_RATIO,
           "extra_vs_torchrun_s": (round(first["pollux-run"] - first["torchrun"], 3)
                                   if ratio is not None else None),
           **{k: v for k, v in out.items() if k != "launch_to_first_step_s"},
           "runs_s": {n: [round(r["launch_to_first_step_s"], 3) for r in results[n]]
                      for n in launchers}}
    if timelines:
        out["timeline_s"] = {n: {e: _median([t.get(e) for t in ts])
                                 for e in sorted(ts[0], key=ts[0].get)}
                             for n, ts in timelines.items()}
    out.update({"repeats": args.repeats, "np": NP, "cores": os.cpu_count(),
                "pollux_tree": args.tree or "installed", "errors": errors,
                "bench_wall_s": round(time.time() - started, 1)})
    report.update(out)
    for name, why in errors.items():
        report.fail(name, why)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--_probe":  # a probed launcher: no report
        return probe_main(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="measured runs per launcher")
    p.add_argument("--launchers", default=",".join(LAUNCHERS),
                   help=f"comma-separated subset of {','.join(LAUNCHERS)}")
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured first runs")
    p.add_argument("--timeline", action=argparse.BooleanOptionalAction, default=True,
                   help="also probe pollux-run's and torchrun's phases (default: on)")
    p.add_argument("--timeline-repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="per launch, seconds")
    p.add_argument("--tree", default=None,
                   help="run pollux-run from this source tree (laid out as the repository)")
    p.add_argument("--pollux-store", default=None,
                   help="pollux-run's --store (default: a private embedded file)")
    p.add_argument("--pollux-flags", default="", help="extra pollux-run flags")
    return run_benchmark(p, bench, smoke={"repeats": 1, "no_warmup": True})


if __name__ == "__main__":
    sys.exit(main())
