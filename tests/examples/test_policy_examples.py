"""The adaptation-policy examples (examples/policies/) run for real, briefly, and do what
they claim: each is started as a user would start it (``python -m``, a file path, or
``pollux-run`` with its own embedded store and real worker processes) and its JSON lines
are checked.

* gns_batch: the noise-scale policy grows the batch (and training still reaches a modest
  target); the fixed runs keep theirs;
* replica_search: from 1 replica allowed 2, the search measures 1, asks for 2, gets them
  live, measures 2 and settles at its best count, where the job then runs;
* straggler: one of 2 replicas slowed down in its forward is named, after the injection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(cmd: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def pollux_run(tmp_path: Path, flags: list[str], script: str, args: list[str]
               ) -> list[dict[str, Any]]:
    out = tmp_path / "out.jsonl"
    run([POLLUX_RUN, "--store", f"embedded://{tmp_path}/store.db", *flags, sys.executable,
         script, *args, "--out", str(out)])
    return records(out)


def test_gns_batch_grows_the_batch_as_a_module(tmp_path):
    out = tmp_path / "gns.jsonl"
    proc = run([sys.executable, "-m", "examples.policies.gns_batch", "--every", "10",
                "--factor", "0.5", "--target", "0.9", "--max-epochs", "40", "--out", str(out)])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == records(out)[-1]
    assert result["mode"] == "adaptive" and result["reached"]
    assert result["time_to_target_s"] > 0
    sizes = result["batch_sizes"]
    assert sizes[0] == 32 and sizes[-1] > 32 and sizes == sorted(sizes)  # it grew, only grew
    assert all(b <= 512 for b in sizes)  # within the loader's max_batch_size
    for _step, before, after, gns in result["growths"]:  # each growth had its reason
        assert after == min(512, 2 * before) and gns > 0.5 * before
    epochs = [r for r in records(out) if r["event"] == "epoch"]
    assert epochs[-1]["batch_size"] == sizes[-1] and epochs[-1]["val_acc"] >= 0.9


def test_gns_batch_fixed_runs_keep_their_batch_as_a_file(tmp_path):
    script = str(REPO / "examples" / "policies" / "gns_batch.py")  # run from elsewhere
    for mode, batch in (("small", 32), ("large", 512)):
        out = tmp_path / f"{mode}.jsonl"
        run([sys.executable, script, "--fixed", mode, "--target", "0.8", "--max-epochs", "60",
             "--out", str(out)], cwd=tmp_path)
        result = records(out)[-1]
        assert result["mode"] == mode and result["reached"]
        assert result["batch_sizes"] == [batch] and result["growths"] == []


def test_replica_search_grows_to_2_then_settles(tmp_path):
    recs = pollux_run(tmp_path, ["-np", "1", "--max-np", "2"],
                      "examples/policies/replica_search.py",
                      ["--max-replicas", "2", "--warmup", "3", "--window", "8",
                       "--stop-after", "5", "--epochs", "10000"])
    events = [(r["event"], r.get("replicas")) for r in recs
              if r["event"] in ("measure", "request", "settle", "not-granted")]
    assert events[:4] == [("measure", 1), ("request", 2), ("measure", 2), events[3]]
    assert events[3][0] == "settle" and len(events) == 4
    best = events[3][1]
    measured = [r for r in recs if r["event"] == "measure"]
    assert measured[0]["gain"] is None and measured[1]["samples_per_s"] > 0
    gain = measured[1]["gain"]
    assert best == (2 if gain >= 0.5 else 1)  # the default threshold
    steps = [r for r in recs if r["event"] == "step"]
    worlds = [s["world"] for s in steps]
    assert 2 in worlds and worlds[0] == 1  # grew live
    settled = next(r["step"] for r in recs if r["event"] == "settle")
    assert worlds[-1] == best and all(s["charged"] >= s["world"] for s in steps)
    assert [s["world"] for s in steps if s["step"] > settled][-5:] == [best] * 5
    result = recs[-1]
    assert result["event"] == "result" and result["best"] == best
    assert result["final_world"] == best and result["replica_s"] > 0


def test_straggler_names_the_slowed_rank(tmp_path):
    recs = pollux_run(tmp_path, ["-np", "2"], "examples/policies/straggler.py",
                      ["--slow-rank", "1", "--slow-from", "60", "--slow-delay", "0.03",
                       "--stop-after", "5", "--steps", "3000"])
    inject = [r for r in recs if r["event"] == "inject"]
    assert len(inject) == 1 and inject[0]["rank"] == 1 and inject[0]["step"] == 60
    detect = [r for r in recs if r["event"] == "detect"]
    assert detect and detect[0]["rank"] == 1 and detect[0]["step"] > 60
    slow_time, fast_time = detect[0]["local_times"][1], detect[0]["local_times"][0]
    assert slow_time > 1.5 * fast_time  # the gathered local times show it
    result = recs[-1]
    assert result["event"] == "result" and result["detected"] and result["rank"] == 1
    assert result["false_positives"] == 0
    assert result["detect_t"] > result["inject_t"] and result["detect_s"] > 0
