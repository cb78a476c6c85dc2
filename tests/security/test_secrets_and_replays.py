"""The security model, enforced: the operator's secrets never reach a job's processes,
and a signed spec that is copied, renamed, replayed, re-pended or expired runs nothing."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from types import SimpleNamespace

import pytest

from pollux_launch import keys
from pollux_launch.launcher import security
from pollux_launch.launcher.node_agent import REFUSED, NodeAgent
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

SECRET = b"s3cr3t-cluster-key-0123456789"
PASSWORD = "st0re-passw0rd-9876"
DUMP = "import os, sys\nopen(sys.argv[1], 'w').write(repr(dict(os.environ)) + repr(sys.argv))\n"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("POLLUX_SECRET", SECRET.decode())
    monkeypatch.setenv("POLLUX_STORE_PASSWORD", PASSWORD)
    url = f"embedded://{tmp_path / 'store.db'}"
    store = open_store(url)
    (tmp_path / "dump.py").write_text(DUMP)
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
    agents = []

    def agent() -> NodeAgent:
        a = NodeAgent(store, NodeInfo("n1", 2), url, secret=SECRET,
                      state_dir=str(tmp_path / "state"))
        agents.append(a)
        return a

    def submit(name: str, out: str, expires: float | None = None, key: str | None = None,
               sign: bool = True) -> JobSpec:
        spec = JobSpec(name, (sys.executable, str(tmp_path / "dump.py"), str(tmp_path / out)),
                       workdir=str(tmp_path), submission=f"sub-{name}-{time.time()}",
                       expires=time.time() + 3600 if expires is None else expires)
        text = encode(spec)
        key = key or name
        store.put(keys.job(key, "spec"), text)
        store.put(keys.job(key, "status"), encode(JobStatus("pending")))
        if sign:
            store.put(keys.job(key, "signature"), f'"{security.sign(text, SECRET)}"')
        store.put(keys.job(key, "allocation"), encode(Allocation(1, ("n1",))))
        return spec

    def status(name: str) -> JobStatus:
        return decode(JobStatus, store.get(keys.job(name, "status")).value)

    def run(a: NodeAgent, name: str, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            a.step()
            if status(name).finished:
                return
            time.sleep(0.1)

    yield SimpleNamespace(store=store, agent=agent, submit=submit, status=status, run=run,
                          tmp=tmp_path)
    for a in agents:
        a.drain()
    store.close()


def test_secrets_never_reach_a_jobs_processes_or_the_logs(cluster, caplog):
    store, agent, submit, status, run, tmp = (cluster.store, cluster.agent, cluster.submit,
                                              cluster.status, cluster.run, cluster.tmp)
    caplog.set_level(logging.DEBUG)
    submit("j", "env.txt")
    run(agent(), "j")
    assert status("j").state == "succeeded"
    seen = (tmp / "env.txt").read_text()
    assert "POLLUX_JOB" in seen  # (the dump is of the worker's own environment)
    assert SECRET.decode() not in seen and PASSWORD not in seen
    assert "POLLUX_SECRET" not in seen and "POLLUX_STORE_PASSWORD" not in seen
    assert SECRET.decode() not in caplog.text and PASSWORD not in caplog.text
    assert all(SECRET.decode() not in kv.value and PASSWORD not in kv.value
               for kv in store.get_prefix(""))


@pytest.mark.parametrize("attack", ["renamed", "unsigned", "expired", "tampered"])
def test_a_spec_not_admitted_runs_nothing_and_frees_its_slots(cluster, attack):
    store, agent, submit, status, _run, tmp = (cluster.store, cluster.agent, cluster.submit,
                                              cluster.status, cluster.run, cluster.tmp)
    if attack == "renamed":  # the victim's signed spec copied under another job's key
        victim = submit("victim", "victim.txt")
        text = store.get(keys.job("victim", "spec")).value
        store.delete(keys.job("victim"), prefix=True)
        store.put(keys.job("copy", "spec"), text)
        store.put(keys.job("copy", "signature"), f'"{security.sign(text, SECRET)}"')
        store.put(keys.job("copy", "allocation"), encode(Allocation(1, ("n1",))))
        name = "copy"
        assert victim.name == "victim"
    elif attack == "tampered":
        submit("t", "t.txt")
        spec = decode(JobSpec, store.get(keys.job("t", "spec")).value)
        store.put(keys.job("t", "spec"), encode(dataclasses.replace(
            spec, command=(sys.executable, "-c", "print('pwned')"))))
        name = "t"
    else:
        submit(attack, f"{attack}.txt", sign=attack != "unsigned",
               expires=time.time() - 1 if attack == "expired" else None)
        name = attack
    a = agent()
    for _ in range(5):
        a.step()
    assert not list(tmp.glob("*.txt"))  # nothing ran
    if attack != "renamed":  # (a spec under another job's key is not that job's at all)
        assert status(name).state == "failed" and status(name).exit_code == REFUSED
        assert "refused" in status(name).message


def test_a_finished_job_set_back_to_pending_is_not_run_again(cluster):
    store, agent, submit, status, run, tmp = (cluster.store, cluster.agent, cluster.submit,
                                              cluster.status, cluster.run, cluster.tmp)
    submit("once", "once.txt")
    first = agent()
    run(first, "once")
    assert status("once").state == "succeeded"
    (tmp / "once.txt").unlink()
    first.drain()
    # replayed: pending again (or its status deleted), seen by a restarted agent
    store.put(keys.job("once", "status"), encode(JobStatus("pending")))
    second = agent()
    for _ in range(5):
        second.step()
    assert not (tmp / "once.txt").exists()
    assert status("once").exit_code == REFUSED and "replay" in status("once").message


def test_a_secret_file_others_may_read_is_warned_about_in_one_line(tmp_path, caplog):
    """Like ssh's "UNPROTECTED PRIVATE KEY FILE", but one line, and a warning (a cluster
    may share its secret as a group-readable file): never the secret itself."""
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    for mode, warned in ((0o644, True), (0o640, True), (0o600, False), (0o400, False)):
        path.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pollux_launch.launcher.security"):
            assert security.load_secret(str(path)) == SECRET
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == int(warned), (oct(mode), said)
        for line in said:
            assert f"secret file {path} is accessible by group or others (mode {mode:04o})" \
                in line and f"chmod 600 {path}" in line
            assert "\n" not in line and SECRET.decode() not in line
