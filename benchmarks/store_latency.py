"""How fast each store backend answers: operation latency, cross-process wake-up of
``wait``, and how long after its TTL a dead member's lease is noticed.

    python benchmarks/store_latency.py [--store embedded|etcd|both] [--etcd-url etcd://...]

Without --etcd-url a temporary etcd (/usr/bin/etcd, loopback, heartbeat 50 ms so that
1 s leases are allowed) is started and removed. The LAST line printed is one JSON object
{"<store>": {"put_ms", "get_ms", "txn_ms", "wait_wake_ms", "wait_wake_p95_ms",
"lease_notice_after_ttl_s"}, ...}; times are medians unless named p95; a store whose
measurement failed is named under ``"failed"``. ``--smoke``: 20 operations, 5 wake-ups and
one lease of each.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness import Report, run_benchmark  # beside this script
from local_etcd import LocalEtcd  # benchmarks/local_etcd.py, beside this script
from tqdm import tqdm

from pollux_launch.rendezvous.store import open_store


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def _waiter(url: str, prefix: str, after: int, n: int, ready, out) -> None:
    with open_store(url, prefix) as store:
        ready.set()
        lat = []
        while len(lat) < n:
            events = store.wait("wake/", after, 30)
            now = time.time()
            lat += [now - float(e.value) for e in events]
            after = events[-1].revision
        out.put(lat)


def _lease_holder(url: str, prefix: str, out) -> None:
    with open_store(url, prefix) as store:
        lease = store.lease_grant(1)
        store.put("member", "1", lease=lease)
        out.put(time.time())  # then never refreshed


def measure(url: str, bar: tqdm, ops: int = 200, wakes: int = 40, leases: int = 3) -> dict:
    prefix = f"/bench-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    result = {}
    with open_store(url, prefix) as store:
        for name, op in (
            ("put_ms", lambda i: store.put(f"k/{i % 10}", "1")),
            ("get_ms", lambda i: store.get(f"k/{i % 10}")),
            ("txn_ms", lambda i: store.create(f"c/{i}", "1")),
        ):
            samples = []
            for i in range(ops):
                t0 = time.perf_counter()
                op(i)
                samples.append(time.perf_counter() - t0)
            result[name] = _ms(samples)
        bar.update()

        ready, out = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=_waiter, args=(url, prefix, store.revision(), wakes, ready, out))
        p.start()
        ready.wait(60)
        time.sleep(0.5)
        for _ in range(wakes):
            store.put("wake/x", repr(time.time()))
            time.sleep(0.03)
        lat = sorted(out.get(timeout=60))
        p.join()
        result["wait_wake_ms"] = _ms(lat)
        result["wait_wake_p95_ms"] = round(lat[int(0.95 * (len(lat) - 1))] * 1000, 3)
        bar.update()

        notices = []
        for _ in range(leases):
            rev = store.revision()
            p = ctx.Process(target=_lease_holder, args=(url, prefix, out))
            p.start()
            granted = out.get(timeout=60)
            p.join()
            while True:
                events = store.wait("member", rev, 30)
                rev = events[-1].revision if events else rev
                if any(e.kind == "delete" for e in events):
                    break
            notices.append(time.time() - granted - 1.0)
        result["lease_notice_after_ttl_s"] = round(statistics.median(notices), 3)
        bar.update()
        store.delete("", prefix=True)
    return result


def bench(args: argparse.Namespace, report: Report) -> None:
    stores = ["embedded", "etcd"] if args.store == "both" else [args.store]
    sizes = {"ops": args.ops, "wakes": args.wakes, "leases": args.leases}
    with tempfile.TemporaryDirectory(prefix="pollux-bench-") as tmp:
        for name in stores:
            with report.case(name), tqdm(total=3, desc=name, leave=False) as bar:
                if name == "embedded":
                    report[name] = measure(f"embedded://{Path(tmp) / 'store.db'}", bar, **sizes)
                elif args.etcd_url:
                    report[name] = measure(args.etcd_url, bar, **sizes)
                else:
                    with LocalEtcd.temporary() as etcd:
                        report[name] = measure(etcd.url, bar, **sizes)
                print(f"{name:9s} " + "  ".join(f"{k}={v}" for k, v in report[name].items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=["embedded", "etcd", "both"], default="both")
    ap.add_argument("--etcd-url", help="use this etcd instead of starting a temporary one")
    ap.add_argument("--ops", type=int, default=200, help="timed calls of each operation")
    ap.add_argument("--wakes", type=int, default=40, help="timed cross-process wake-ups")
    ap.add_argument("--leases", type=int, default=3, help="leases left to expire")
    return run_benchmark(ap, bench, smoke={"ops": 20, "wakes": 5, "leases": 1})


if __name__ == "__main__":
    sys.exit(main())
