"""On an etcd with authentication, a job's processes reach the store as the job's own
user, made by their node agent: they read and write the job's keys and read node
records, nothing else, and never see the operator's credentials."""

from __future__ import annotations

import json
import sys
import time

import grpc
from pyetcd import etcdrpc

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

ROOT_PASSWORD = "pw-root-0123456789"
WORKER = """
import json, os, sys
from pollux_launch.rendezvous.store import StoreError
from pollux_launch.rendezvous.store.environ import store_from_env
store = store_from_env()
job = os.environ["POLLUX_JOB"]
out = {"user": os.environ.get("POLLUX_STORE_USER"), "environ": repr(dict(os.environ)),
       "argv": sys.argv}
store.put(f"jobs/{job}/mine", '"ok"')
out["nodes"] = len(store.get_prefix("nodes/"))
for what, call in (("other job", lambda: store.put("jobs/other/spec", '"x"')),
                   ("leader", lambda: store.get("coordinator/leader")),
                   ("node record", lambda: store.put("nodes/n1", '"x"'))):
    try:
        call()
        out[what] = "allowed"
    except StoreError:
        out[what] = "refused"
open(sys.argv[1], "w").write(json.dumps(out))
"""


def _enable_auth(port: int) -> None:
    auth = etcdrpc.AuthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=ROOT_PASSWORD), timeout=5)
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)


def test_a_jobs_processes_get_their_own_scoped_store_user(etcd_private, tmp_path):
    _enable_auth(etcd_private.client_port)
    store = open_store(etcd_private.url, user="root", password=ROOT_PASSWORD)
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out.json"
    store.put(keys.node("n1"), encode(NodeInfo("n1", 1)))
    store.put(keys.job("j", "spec"), encode(JobSpec(
        "j", (sys.executable, str(tmp_path / "worker.py"), str(out)), workdir=str(tmp_path))))
    store.put(keys.job("j", "status"), encode(JobStatus("pending")))
    store.put(keys.job("j", "allocation"), encode(Allocation(1, ("n1",))))
    agent = NodeAgent(store, NodeInfo("n1", 1), etcd_private.url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            agent.step()
            status = decode(JobStatus, store.get(keys.job("j", "status")).value)
            if status.finished:
                break
            time.sleep(0.2)
        assert status.state == "succeeded", status
        seen = json.loads(out.read_text())
        assert seen["user"].startswith("/pollux/job.j.n1")
        assert ROOT_PASSWORD not in seen["environ"] + " ".join(seen["argv"])
        assert seen["other job"] == seen["leader"] == seen["node record"] == "refused"
        assert seen["nodes"] == 1 and store.get(keys.job("j", "mine")).value == '"ok"'
    finally:
        agent.drain()
    store.close()
    auth = etcdrpc.AuthStub(grpc.insecure_channel(f"127.0.0.1:{etcd_private.client_port}"))
    token = auth.Authenticate(etcdrpc.AuthenticateRequest(
        name="root", password=ROOT_PASSWORD), timeout=5).token
    users = auth.UserList(etcdrpc.AuthUserListRequest(), timeout=5,
                          metadata=[("token", token)]).users
    assert seen["user"] not in users  # the job's user went with the job
