"""The coordinator at many jobs: a round that changes more allocations than etcd takes in
one transaction (--max-txn-ops, 128: comparisons and operations each) writes them in
several, each guarded by the term and by each job's spec."""

from __future__ import annotations

import numpy as np

from pollux_launch import keys
from pollux_launch.coordinator.service import TXN_OPS, Coordinator, _placement
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, decode, encode
from pollux_launch.policy import make_policy
from pollux_launch.rendezvous.store import open_store


def test_a_round_of_many_changes_writes_transactions_etcd_accepts(tmp_path):
    jobs = TXN_OPS + 72
    with open_store(f"embedded://{tmp_path / 'store.db'}") as store:
        for i in range(jobs // 4):
            store.put(keys.node(f"n{i:03d}"), encode(NodeInfo(f"n{i:03d}", 4)))
        for i in range(jobs):
            store.put(keys.job(f"j{i:03d}", "spec"), encode(JobSpec(
                f"j{i:03d}", ("python",), initial_replicas=1, max_replicas=1,
                submit_time=1000.0)))
        sizes: list[int] = []
        txn = store.txn

        def counted(compare, success, failure=()):
            sizes.append(max(len(compare), len(success)))  # (etcd limits each)
            return txn(compare, success, failure)

        store.txn = counted
        coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0),
                            clock=lambda: 1000.0)
        writes = coord.schedule_once()
        assert len(writes) == jobs and max(sizes) <= TXN_OPS and len(sizes) == 2
        placed = [decode(Allocation, kv.value) for kv in store.get_prefix(keys.JOBS)
                  if kv.key.endswith("/allocation")]
        assert len(placed) == jobs and all(a.num_replicas == 1 for a in placed)


def test_placement_keeps_survivors_in_order_and_appends_in_node_order():
    names = ["a", "b", "c", "d"]
    assert _placement(("b", "a", "b"), np.array([1, 2, 0, 0]), names) == ("b", "a", "b")
    assert _placement(("c",), np.array([2, 0, 1, 0]), names) == ("c", "a", "a")
    assert _placement(("d", "c"), np.array([0, 1, 0, 1]), names) == ("d", "b")
    assert _placement(("a",), np.zeros(4, dtype=int), names) == ()
