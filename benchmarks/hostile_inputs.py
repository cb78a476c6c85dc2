"""Hostile inputs, tried for real: store values written into a live cluster, and bad
command lines given to ``pollux-run``.

    python benchmarks/hostile_inputs.py            # about 2.5 min

* ``store_values``: a real etcd, a coordinator and two node agents; a job trains while
  the adversarial table of ``tests/hostile.py`` and random hostile values (``--per-family``
  of each key family) are written; ``services_alive``: no service died;
  ``jobs_completed``: the job succeeded with all its epochs.
* ``cli_inputs``: every case of ``tests/launcher/test_bad_inputs.py`` run as a
  ``pollux-run`` process: ``one_line`` counts those that ended with exit code 2 and one
  line on stderr, ``tracebacks`` those that printed a traceback.
* ``log_flood``: a node's job log server (``LogServer``, no cluster) with a real log;
  ``--flood-connections`` slow clients from 127.0.0.2 each send a request one byte every
  ``--flood-trickle`` seconds (and connect again once let go, as an attacker would) for
  ``--flood-seconds``, while a client at 127.0.0.1 asks for the log every 0.5 s:
  ``log_server_available_under_flood`` is the share of those asks answered 200 (goal 1.0).

* ``agent_memory``: ``pollux-run -np 1`` (its node agent pumps the worker's output) with
  a worker that prints ``--long-line-mb`` MiB without a newline, and with an idle one:
  ``agent_peak_rss_mb_longline`` is the first's peak RSS (goal: at most twice the idle
  one's, ``agent_memory.idle_mb``).

The LAST line printed is one JSON object: ``{"store_values": {"tried": N,
"services_alive": bool, "jobs_completed": bool}, "cli_inputs": {"tried": N,
"one_line": M, "tracebacks": T}, "log_server_available_under_flood": F, "log_flood":
{"probes": N, "served": M, "flood_connections": C, "refused": R, "cut_off": X},
"agent_peak_rss_mb_longline": M, "agent_memory": {"megabytes": N, "idle_mb": I,
"longline_mb": M}}``
(``refused``: flood connections answered 429/503, ``cut_off``: let go without an answer);
a service that died, a job that did not complete, a traceback, a case that was not one
line or a probe not served are named under ``"failed"``. ``--smoke``: the first 3 command
lines, 2 random values per family, a one-epoch job, a 4 s flood trickling every 0.5 s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e"), str(ROOT / "tests" / "launcher")]

from cluster import POLLUX_RUN, Cluster  # noqa: E402  (tests/e2e/cluster.py)
from etcd_server import EtcdServer  # noqa: E402  (tests/etcd_server.py)
from harness import Report, run_benchmark  # noqa: E402  (beside this script)
from test_bad_inputs import CASES, _inputs  # noqa: E402
from test_hostile_store import fuzz  # noqa: E402

from pollux_launch.launcher.logs import (  # noqa: E402
    AUTH_HEADER,
    FETCH_TIMEOUT,
    LogServer,
    LogSink,
    log_path,
    sign_request,
)

FLOODER, PROBER = "127.0.0.2", "127.0.0.1"  # two loopback addresses: two peers
PROBE_EVERY = 0.5  # seconds between the prober's asks


def store_values(folder: Path, per_family: int, epochs: int) -> dict:
    (folder / "etcd").mkdir(parents=True)
    etcd = EtcdServer(folder / "etcd").start()
    c = Cluster(etcd.url, folder)
    try:
        c.coordinator()
        c.agent("n1", 1)
        c.agent("n2", 1)
        c.wait(lambda: len(c.store.get_prefix("nodes/")) >= 2, 60, "two nodes")
        job = c.submit("victim", "-np", "2", "--min-np", "2", "--max-np", "2", target=0.0,
                       epochs=epochs)
        c.wait(lambda: sum(s["world"] == 2 for s in c.steps()) >= 10, 180, "training")
        tried = fuzz(c.store, "victim", seed=1, per_family=per_family)
        print(f"wrote {tried} hostile values; waiting for the job", flush=True)
        code = job.wait(timeout=600)
        alive = all(c.procs[n].poll() is None for n in ("coordinator", "agent-n1", "agent-n2"))
        agents = c.log("agent-n1") + c.log("agent-n2")
        finals = [ln for ln in agents.splitlines() if "final val_acc" in ln]
        done = code == 0 and len(finals) == 1 and float(finals[0].rsplit(" ", 1)[1]) >= epochs
        return {"tried": tried, "services_alive": alive, "jobs_completed": done}
    finally:
        c.close()
        etcd.stop()


def cli_inputs(folder: Path, cases: int | None) -> dict:
    one_line = tracebacks = 0
    for i, (argv, _) in enumerate(CASES[:cases]):
        cwd = folder / f"case{i}"
        cwd.mkdir(parents=True)
        _inputs(cwd)
        out = subprocess.run([POLLUX_RUN, *argv], cwd=cwd, capture_output=True, text=True,
                             timeout=120)
        one_line += out.returncode == 2 and out.stderr.count("\n") == 1
        tracebacks += "Traceback" in out.stderr
    return {"tried": len(CASES[:cases]), "one_line": one_line, "tracebacks": tracebacks}


def _slow_client(port: int, every: float, stop: threading.Event, counts: Counter,
                 lock: threading.Lock) -> None:
    """Send a request that never ends, a byte every ``every`` seconds; once the server
    lets go (an answer, its end, a reset), connect again at the next tick."""
    request = b"GET /logs/victim/0001 HTTP/1.0\r\nX-Slow: "
    while not stop.is_set():
        sock = socket.socket()
        outcome = "held"
        try:
            sock.bind((FLOODER, 0))
            sock.settimeout(FETCH_TIMEOUT)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)  # (a recv only looks)
            with lock:
                counts["flood_connections"] += 1
            sent = 0
            while not stop.wait(every if sent else 0):
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    sock.send(request[sent:sent + 1] or b"a")
                    sent += 1
                    continue
                outcome = "refused" if data[:13] in (b"HTTP/1.0 429 ", b"HTTP/1.0 503 ") \
                    else "cut_off"
                break
        except OSError:
            outcome = "cut_off"  # (a reset, or a connect refused: let go all the same)
        finally:
            sock.close()
        if outcome != "held":
            with lock:
                counts[outcome] += 1
            stop.wait(every)


def log_flood(folder: Path, seconds: float, every: float, connections: int) -> dict:
    secret = b"hostile-inputs-benchmark"
    server = LogServer(folder / "logs", "127.0.0.1", secret)
    server.start()
    sink = LogSink(log_path(server.root, "victim", "0001"))
    sink.write("".join(f"[0]<stdout>:line {i}\n" for i in range(1000)))
    sink.close()
    target = "/logs/victim/0001?offset=0"
    stop, lock, counts = threading.Event(), threading.Lock(), Counter()
    flood = [threading.Thread(target=_slow_client, args=(server.port, every, stop, counts, lock),
                              daemon=True) for _ in range(connections)]
    probes = served = 0
    try:
        for thread in flood:
            thread.start()
        time.sleep(min(every, 1.0))  # (the flood has connected)
        end = time.monotonic() + seconds
        while (start := time.monotonic()) < end:
            probes += 1
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=FETCH_TIMEOUT,
                                              source_address=(PROBER, 0))
            try:
                conn.request("GET", target, headers={AUTH_HEADER: sign_request(
                    secret, "GET", "127.0.0.1", server.port, target, time.time())})
                reply = conn.getresponse()
                reply.read()
                served += reply.status == 200
            except (OSError, http.client.HTTPException):
                pass  # (not served)
            finally:
                conn.close()
            time.sleep(max(0.0, PROBE_EVERY - (time.monotonic() - start)))
    finally:
        stop.set()
        for thread in flood:
            thread.join(timeout=2 * FETCH_TIMEOUT)
        server.stop()
    return {"probes": probes, "served": served, **{k: counts[k] for k in (
        "flood_connections", "refused", "cut_off")}}


# a worker printing ``mb`` MiB without a newline, 1 MiB per write (it holds no more itself)
LONG_LINE_WORKER = ("import sys\nout, chunk = sys.stdout.buffer, b'x' * (1 << 20)\n"
                    "for _ in range({mb}):\n    out.write(chunk)\n    out.flush()\n")
IDLE_WORKER = "import time\ntime.sleep(2)\n"
# runs pollux-run and prints the peak RSS (KiB) of the largest process it waited for: the
# launcher, whose in-process agent pumps the worker's output (the worker holds 1 MiB)
PEAK_RSS = ("import resource, subprocess, sys\n"
            "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def agent_memory(folder: Path, mb: int) -> dict:
    """Peak RSS of ``pollux-run -np 1`` (its node agent pumping the output) while its
    worker prints ``mb`` MiB without a newline, against the same with an idle worker."""
    folder.mkdir(parents=True)
    peaks = {}
    for name, code in (("idle", IDLE_WORKER), ("longline", LONG_LINE_WORKER.format(mb=mb))):
        script = folder / f"{name}.py"
        script.write_text(code)
        out = subprocess.run([sys.executable, "-c", PEAK_RSS, POLLUX_RUN, "-np", "1",
                              "--gpus", "none", sys.executable, str(script)],
                             capture_output=True, text=True, timeout=600, cwd=folder)
        if out.returncode:
            raise RuntimeError(f"pollux-run with the {name} worker failed: {out.stderr[-500:]}")
        peaks[name] = round(int(out.stdout.split()[-1]) / 1024, 1)
    return {"megabytes": mb, "idle_mb": peaks["idle"], "longline_mb": peaks["longline"]}


def bench(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="pollux-hostile-") as tmp:
        with report.case("log_flood"):
            flood = log_flood(Path(tmp) / "flood", args.flood_seconds, args.flood_trickle,
                              args.flood_connections)
            print(f"log flood: {json.dumps(flood)}", flush=True)
            report["log_flood"] = flood
            available = flood["served"] / flood["probes"] if flood["probes"] else 0.0
            report["log_server_available_under_flood"] = round(available, 4)
            report.check("log_flood", available == 1.0,
                         f"{flood['probes'] - flood['served']} of {flood['probes']} log "
                         "requests were not served during the flood")
        with report.case("agent_memory"):
            mem = report["agent_memory"] = agent_memory(Path(tmp) / "memory", args.long_line_mb)
            print(f"agent memory: {json.dumps(mem)}", flush=True)
            report["agent_peak_rss_mb_longline"] = mem["longline_mb"]
            report.check("agent_memory", mem["longline_mb"] <= 2 * mem["idle_mb"],
                         f"a {mem['megabytes']} MiB line without a newline took the agent to "
                         f"{mem['longline_mb']} MB (idle: {mem['idle_mb']} MB)")
        with report.case("cli_inputs"):
            cli = report["cli_inputs"] = cli_inputs(Path(tmp) / "cli", args.cli_cases)
            print(f"cli inputs: {json.dumps(cli)}", flush=True)
            report.check("cli_inputs", not cli["tracebacks"],
                         f"{cli['tracebacks']} command lines printed a traceback")
            report.check("cli_inputs", cli["one_line"] == cli["tried"],
                         f"{cli['tried'] - cli['one_line']} of {cli['tried']} command lines "
                         "did not end with exit code 2 and one line")
        with report.case("store_values"):
            values = store_values(Path(tmp) / "store", args.per_family, args.epochs)
            report["store_values"] = values
            report.check("store_values", values["services_alive"], "a service died")
            report.check("store_values", values["jobs_completed"], "the job did not complete")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-family", type=int, default=20,
                        help="random values per key family")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the job")
    parser.add_argument("--cli-cases", type=int, default=None,
                        help="only the first N bad command lines (default: all)")
    parser.add_argument("--flood-seconds", type=float, default=30.0,
                        help="how long the log server is flooded and probed")
    parser.add_argument("--flood-trickle", type=float, default=2.0,
                        help="seconds between the bytes of each slow client")
    parser.add_argument("--flood-connections", type=int, default=32,
                        help="slow clients at once")
    parser.add_argument("--long-line-mb", type=int, default=300,
                        help="MiB the worker prints without a newline")
    return run_benchmark(parser, bench, smoke={"per_family": 2, "epochs": 1, "cli_cases": 3,
                                               "flood_seconds": 4.0, "flood_trickle": 0.5,
                                               "long_line_mb": 20})


if __name__ == "__main__":
    sys.exit(main())
