"""A job end to end on an etcd that speaks only TLS with client certificates and has
authentication on: a coordinator, a node agent and ``pollux-run`` (the operator's ``root``
login, given with ``--password-file``), two workers training digits with the native
adapter, which reach the store with the TLS files and the job's own scoped user that
their agent made (``pollux_launch.env``), report hints, and end with exit code 0.

(tests/security/test_store_credentials.py checks what a scoped user may and may not
reach; this checks that a real job gets through the whole path with it.)
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from cluster import SECRET, Cluster

from pollux_launch import env, keys
from pollux_launch.messages import JobHints, JobStatus, decode
from pollux_launch.rendezvous.store import StoreError, open_store

ROOT_PASSWORD = "pw-root-tls-e2e-0123456789"
JOB = "tls-job"


@pytest.fixture
def cluster(etcd_factory, etcd_certs, tmp_path):
    server = etcd_factory(tls=etcd_certs)
    server.enable_auth(ROOT_PASSWORD)
    password_file = tmp_path / "root.password"
    password_file.write_text(ROOT_PASSWORD + "\n")
    password_file.chmod(0o600)
    tls = {"ca_cert": str(etcd_certs / "ca.pem"), "cert_cert": str(etcd_certs / "client.pem"),
           "cert_key": str(etcd_certs / "client.key")}
    flags = ("--ca-cert", tls["ca_cert"], "--cert", tls["cert_cert"], "--key", tls["cert_key"],
             "--user", "root", "--password-file", str(password_file))
    c = Cluster(server.url, tmp_path, flags, user="root", password=ROOT_PASSWORD, **tls)
    # the operator's environment holds the password too, as $POLLUX_STORE_PASSWORD may:
    # the workers must not inherit it
    c.env[env.STORE_PASSWORD] = ROOT_PASSWORD
    c.server, c.tls = server, tls
    yield c
    c.close()


def _hints(cluster: Cluster) -> JobHints | None:
    kv = cluster.store.get(keys.job(JOB, "hints"))
    return decode(JobHints, kv.value) if kv else None


def test_job_trains_on_a_tls_etcd_with_auth_as_its_own_store_user(cluster):
    # the premise: a TLS client without a login gets nothing (its certificate's name is no
    # etcd user), so the job's hints below can only come from a worker that logged in
    with pytest.raises(StoreError, match="permission denied"):
        open_store(cluster.url, **cluster.tls, timeout=2)
    cluster.coordinator()
    cluster.agent("n1", 2)
    cluster.wait(lambda: cluster.store.get_prefix(keys.NODES), 60, "the node registered")
    job = cluster.submit(JOB, "-np", "2", target=0.0)  # runs until its stop file exists

    def training() -> bool:
        """Rank 0 reports hints through the store while both replicas train."""
        if job.poll() is not None:
            logs = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                           for p in cluster.tmp.glob("*.log"))
            raise AssertionError(f"pollux-run ended with {job.returncode} early\n{logs}")
        hints = _hints(cluster)
        return bool(hints and hints.num_replicas == 2 and hints.progress > 0
                    and {s["rank"] for s in cluster.steps()} == {0, 1})

    cluster.wait(training, 90, "hints from a job training on 2 replicas")
    workers = [w for w in cluster.workers_left() if w.pid != job.pid]  # not pollux-run
    assert len(workers) == 2, workers
    seen = [(w.environ(), w.cmdline()) for w in workers]
    # the job user's password, in the file its agent wrote (gone with the job's user)
    password_files = {Path(environ[env.STORE_PASSWORD_FILE]) for environ, _ in seen}
    assert len(password_files) == 1, password_files
    password_file = password_files.pop()
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    scoped_password = password_file.read_text().strip()
    assert scoped_password
    cluster.stop_job(JOB)
    assert job.wait(timeout=60) == 0, cluster.log(JOB)[-3000:]
    assert f"{JOB}: succeeded, exit code 0" in cluster.log(JOB)
    status = cluster.store.get(keys.job(JOB, "status"))
    assert status is None or decode(JobStatus, status.value).state == "succeeded"

    # each worker was given the TLS files and the job's own user, never the operator's
    user = seen[0][0][env.STORE_USER]
    assert user.startswith(f"/pollux/job.{JOB}.n1.") and user != "root"
    for environ, argv in seen:
        assert environ[env.STORE_USER] == user
        assert environ[env.STORE].startswith("etcd://127.0.0.1:")
        assert (environ[env.STORE_CA_CERT], environ[env.STORE_CERT], environ[env.STORE_KEY]) \
            == (cluster.tls["ca_cert"], cluster.tls["cert_cert"], cluster.tls["cert_key"])
        assert not set(env.SECRETS) & environ.keys()
        text = repr(environ) + " ".join(argv)
        for secret in (ROOT_PASSWORD, SECRET, scoped_password):
            assert secret not in text

    # no password anywhere in the services' and workers' output or in the job's keys
    logs = "".join(p.read_text() for p in [*cluster.tmp.glob("*.log"),
                                            *(cluster.tmp / "logs").glob("*")])
    assert "final val_acc" in logs  # rank 0's output reached its agent's log
    stored = "".join(kv.value for kv in cluster.store.get_prefix(""))
    for secret in (ROOT_PASSWORD, scoped_password):
        assert secret not in logs and secret not in stored

    # the job's user went with the job
    deadline = time.monotonic() + 15
    while user in cluster.server.users(ROOT_PASSWORD) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert user not in cluster.server.users(ROOT_PASSWORD)
    assert not cluster.workers_left()

