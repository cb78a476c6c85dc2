"""An adaptation policy attached from the command line drives a real job end to end.

``pollux-run --policy-module probe:Probe`` on this machine (embedded store, the
in-process coordinator, real worker processes and gloo): the policy asks for 2 replicas,
the coordinator grows the job live, the policy's collective runs on the new group, then
it asks for 1 (the leaving worker's hook sees ``detached``) and stops training; the job
ends successfully with every worker stopped at the same step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).with_name("policies")
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))


def test_a_policy_from_the_command_line_grows_shrinks_and_stops_the_job(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "LOG_DIR": str(logs)}
    out = subprocess.run(
        [POLLUX_RUN, "--store", f"embedded://{tmp_path}/store.db", "--job-name", "probe",
         "-np", "1", "--max-np", "2", "--policy-module", "probe:Probe",
         sys.executable, "worker.py"],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "probe: succeeded" in out.stdout
    records = {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
               for f in logs.glob("*.jsonl")}
    assert len(records) == 2  # the first worker and the newcomer
    events = [r for rs in records.values() for r in rs]
    grown = [r for r in events if r["ev"] == "rescale" and r["world"] == 2]
    assert len(grown) == 2 and {r["total"] for r in grown} == {3.0}  # 1 + 2 on the new group
    assert len({r["step"] for r in grown}) == 1  # both at the same step
    assert {r["prev"] for r in grown} == {1}  # the newcomer sees what the survivor does
    assert sum(r["ev"] == "detached" for r in events) == 1  # the leaver's on_rescale
    shrunk = [r for r in events if r["ev"] == "rescale" and r["prev"] == 2]
    assert len(shrunk) == 1 and shrunk[0]["world"] == 1 and shrunk[0]["total"] == 1.0
    ends = [r for r in events if r["ev"] == "end"]
    assert len(ends) == 1 and ends[0]["stopped"] and ends[0]["world"] == 1
    steps_at_2 = [r for r in events if r["ev"] == "step" and r["world"] == 2]
    assert steps_at_2 and all(r["phase"] == "shrink" for r in steps_at_2)  # state travelled
