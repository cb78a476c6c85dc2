"""Pause of surviving DeepSpeed workers per live engine rebuild (CPU, gloo, loopback).

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_rebuild.py [--stages 2,0] [--repeats 2]

Three real processes train a ~1M-parameter MLP (Adam) with
``pollux_launch.adapters.deepspeed``; the job goes 2 -> 3 -> 2 replicas ``--repeats``
times per ZeRO stage. The newcomer is prewarmed (DeepSpeed imported, model built, waiting
to join) before the survivors start. Pause = on a survivor, from the step boundary where
the rescale starts (capture of the consolidated state on the old group) until the rebuilt
engine has restored its state on the new group; it includes the test harness's process
group re-formation (destroy + init on a TCPStore, ~tens of ms), which the real rendezvous
replaces. Reported per direction: the median over survivors and repeats, and its split
into capture / group re-formation / build+restore.

The LAST line printed is one JSON object:
``{"deepspeed_down_pause_s": .., "deepspeed_up_pause_s": .., ...}`` (ZeRO-2 when measured,
else the first stage).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMEOUT = datetime.timedelta(seconds=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- worker -----------------------------------------------------------------------------

def worker(wid: int, port: int, out: Path, stages: list[int], repeats: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["POLLUX_JOB"] = "bench-deepspeed"
    import torch
    import torch.distributed as dist

    from pollux_launch.adapters import deepspeed as pds

    base = dist.TCPStore("127.0.0.1", port, is_master=wid == 0, wait_for_workers=False,
                         timeout=TIMEOUT)
    rnd = [0]
    events: list[dict] = []

    def join(members: list[int]) -> None:
        rnd[0] += 1
        if dist.is_initialized():
            dist.destroy_process_group()
        rank = members.index(wid)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(len(members)), LOCAL_RANK="0")
        dist.init_process_group("gloo", store=dist.PrefixStore(f"r{rnd[0]}", base), rank=rank,
                                world_size=len(members), timeout=TIMEOUT)

    def make(stage: int):
        torch.manual_seed(wid)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        cfg = {"zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
               "pollux": {"enabled": True, "initial_batch_size": 32,
                          "micro_batch_size_range": [4, 32]}}
        return pds.initialize(model=model, optimizer=opt, config=cfg)[0]

    def train(engine, steps: int = 3) -> None:
        m = engine.batch[0]
        for _ in range(steps):
            x, y = torch.randn(m, 512), torch.randint(0, 10, (m,))
            engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
            engine.step()

    def timed_rescale(engine, members: list[int] | None, label: str, stage: int):
        t: dict[str, float] = {}

        def reform() -> bool:
            t["captured"] = time.perf_counter()
            if members is None:
                dist.destroy_process_group()
                rnd[0] += 1
                return False
            join(members)
            t["formed"] = time.perf_counter()
            return True

        t0 = time.perf_counter()
        engine.rescale(reform, 8, 1)
        if members is not None:
            t1 = time.perf_counter()
            events.append({"stage": stage, "dir": label, "pause": t1 - t0,
                           "capture": t["captured"] - t0, "reform": t["formed"] - t["captured"],
                           "rebuild": t1 - t["formed"],
                           "params": sum(p.numel() for p in engine.module.parameters())})

    for stage in stages:
        for rep in range(repeats):
            key = f"s{stage}r{rep}"
            if wid < 2:
                if rep == 0:
                    join([0, 1])
                    engine = make(stage)
                train(engine)
                base.wait([f"{key}/ready"])  # the newcomer is waiting to join
                timed_rescale(engine, [0, 1, 2], "up", stage)
                train(engine)
                timed_rescale(engine, [0, 1], "down", stage)
            else:
                rnd[0] += 1 if rep == 0 else 0
                pds.prewarm()  # a newcomer imports DeepSpeed's lazy parts before joining
                base.set(f"{key}/ready", "1")
                join([0, 1, 2])
                engine = make(stage)  # receives the survivors' state
                train(engine)
                timed_rescale(engine, None, "leave", stage)
        if wid < 2:
            engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    (out / f"events{wid}.json").write_text(json.dumps(events))
    print(json.dumps(events), file=sys.stderr)
    if wid == 0:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                (out / f"events{i}.json").exists() for i in (1, 2)):
            time.sleep(0.05)


# -- driver -----------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,0")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", nargs=3, metavar=("ID", "PORT", "OUT"),
                        help=argparse.SUPPRESS)
    opts = parser.parse_args()
    stages = [int(s) for s in opts.stages.split(",")]
    if opts.worker:
        wid, port, out = opts.worker
        worker(int(wid), int(port), Path(out), stages, opts.repeats)
        return

    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="ds-rebuild-") as tmp:
        out, port = Path(tmp), _free_port()
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--stages", opts.stages, "--repeats", str(opts.repeats),
             "--worker", str(i), str(port), str(out)],
            stdout=subprocess.DEVNULL, stderr=open(out / f"log{i}.txt", "w"), env=env)
            for i in range(3)]
        with tqdm(total=3, desc="workers done", unit="proc") as bar:
            for p in procs:
                p.wait(timeout=900)
                bar.update(1)
        if any(p.returncode for p in procs):
            for i in range(3):
                print(f"--- worker {i}\n" + (out / f"log{i}.txt").read_text()[-2000:])
            raise SystemExit("a worker failed")
        events = [e for i in (0, 1) for e in json.loads((out / f"events{i}.json").read_text())]

    result: dict[str, float | int] = {}
    for stage in stages:
        for direction in ("down", "up"):
            rows = [e for e in events if e["stage"] == stage and e["dir"] == direction]
            per_rep = rows  # both survivors, every repeat
            pause = statistics.median(sorted(e["pause"] for e in per_rep))
            for part in ("capture", "reform", "rebuild"):
                result[f"zero{stage}_{direction}_{part}_s"] = round(
                    statistics.median(e[part] for e in per_rep), 4)
            result[f"zero{stage}_{direction}_pause_s"] = round(pause, 4)
            result["params"] = per_rep[0]["params"]
            print(f"ZeRO-{stage} {direction:4s}: pause {pause:.3f} s over {len(per_rep)} "
                  "survivor-rescales", flush=True)
    main_stage = 2 if 2 in stages else stages[0]
    final = {"deepspeed_down_pause_s": result[f"zero{main_stage}_down_pause_s"],
             "deepspeed_up_pause_s": result[f"zero{main_stage}_up_pause_s"],
             "zero_stage": main_stage, **result}
    print(json.dumps(final))


if __name__ == "__main__":
    main()
