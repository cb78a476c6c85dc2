"""Hostile values written into every key family of a live cluster, on a real etcd and
on the embedded store, while a job trains: services stay up, the job finishes with all
its epochs, each bad value is logged at most once per service (per key and revision)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
from cluster import Cluster
from hostile import FAMILIES, HOSTILE, random_value, running_job_keys

from pollux_launch import keys
from pollux_launch.rendezvous.store import StoreError

EPOCHS = 4


def fuzz(store, job: str, seed: int = 0, per_family: int = 6) -> int:
    """Write the adversarial table and random values; returns how many were tried."""
    rng = random.Random(seed)
    # (the table's well-formed unsigned specs would compete for the job's slots until
    # the agents refuse them: tests/security covers that)
    writes = [(k, v) for k, v in HOSTILE if not re.fullmatch(r"jobs/h\d/spec", k)]
    writes += [(fam.format(n=f"fz{i}"), random_value(rng))
               for fam in FAMILIES for i in range(per_family)]
    writes += [(key, random_value(rng, well_formed=False))
               for key in running_job_keys(job) for _ in range(per_family)]
    rng.shuffle(writes)
    for key, value in writes:
        try:
            store.put(key, value)
        except StoreError:  # e.g. etcd refuses a value over its request size: fine too
            pass
    return len(writes)


@pytest.mark.parametrize("backend", ["etcd", "embedded"])
def test_hostile_values_while_a_job_trains(backend, request, tmp_path):
    url = (request.getfixturevalue("etcd_private").url if backend == "etcd"
           else f"embedded://{tmp_path}/store.db")
    c = Cluster(url, tmp_path)
    try:
        c.coordinator()
        c.agent("n1", 1)
        c.agent("n2", 1)
        c.wait(lambda: {"n1", "n2"} <= {kv.key[len(keys.NODES):]
                                        for kv in c.store.get_prefix(keys.NODES)}, 60, "nodes")
        proc = c.submit("victim", "-np", "2", "--min-np", "2", "--max-np", "2", target=0.0,
                        epochs=EPOCHS)
        c.wait(lambda: sum(s["world"] == 2 for s in c.steps()) >= 10, 120, "training")
        tried = fuzz(c.store, "victim")
        assert tried > 80
        assert proc.wait(timeout=300) == 0, c.log("victim")[-3000:]
        for name in ("coordinator", "agent-n1", "agent-n2"):
            assert c.procs[name].poll() is None, f"{name} died:\n{c.log(name)[-3000:]}"
        # the job's output where the user is: the submitting pollux-run shows it (from the
        # node agents' logs on etcd; from its own node's workers on the embedded store),
        # each line once, whatever the hostile values did to the node records
        finals = [line for line in c.log("victim").splitlines() if "final val_acc" in line]
        assert len(finals) == 1 and float(finals[0].rsplit(" ", 1)[1]) >= EPOCHS
        logs = "".join(c.log(n) for n in ("agent-n1", "agent-n2", "victim"))
        assert "pwned" not in logs
        for name in ("coordinator", "agent-n1", "agent-n2"):
            said = Counter(re.findall(r"ignoring malformed (\S+ \(revision \d+\))", c.log(name)))
            assert said and max(said.values()) == 1, (name, said.most_common(3))
        c.wait(lambda: not c.workers_left(), 30, "no worker left behind")
    finally:
        c.close()
