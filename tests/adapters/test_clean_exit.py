"""A gloo worker never aborts at exit, whatever way it ends (issue 27 item 7).

A gloo process group's threads run until its last reference goes. One still alive when
the interpreter finalises can abort the process - "terminate called without an active
exception", SIGABRT - when a worker thread of it only then drops a finished collective's
tensors (that takes the GIL, and a finalising interpreter ends the thread instead, inside
a noexcept destructor). Groups outlived their destruction: torch 2.13 and DeepSpeed
capture the live default group in default arguments of modules imported after it formed
(``torch._dynamo`` imports one with a script's first optimizer), the trainer's DDP
wrapper and the DeepSpeed engine held it, and nothing destroyed it at exit.
``pollux_launch.rendezvous.process_group`` ("Leaving at exit") now destroys and releases
every group before the interpreter finalises.

The abort is a race (before the fix: a few exits in a thousand to a few in a hundred on a
busy 2-core machine), so these tests check what made it possible, deterministically: no
gloo thread is left after the last atexit handler. ``exit_worker.py`` runs short real
2-rank gloo jobs forked from one parent that imported torch once, ending each way: the
end of the script, ``sys.exit(3)``, an uncaught exception, ``WorkerRemoved``, plain
``torch.distributed`` as the tests/elastic workers use it, the static torchrun-style path.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pollux_launch.rendezvous.process_group import CAPTURING_MODULES

WORKER = Path(__file__).with_name("exit_worker.py")
MODES = ("end", "exit3", "raise", "removed", "raw", "static")
EXPECTED = {"end": 0, "exit3": 3, "raise": 1, "removed": 0, "raw": 0, "static": 0}
PAIRS = 24  # 48 workers, 8 per way to end (about 45 s on 2 idle cores)


def test_gloo_workers_exit_with_their_own_code_and_no_group_left(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(
        [sys.executable, str(WORKER), "--store", f"embedded://{tmp_path}/store.db",
         "--out", str(tmp_path), "--modes", ",".join(MODES), "--pairs", str(PAIRS),
         "--parallel", "3"],
        capture_output=True, text=True, timeout=540, env=env)
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and len(got) == 2 * PAIRS, (r.returncode, r.stderr[-3000:])
    wrong = [g for g in got if g["code"] != EXPECTED[g["mode"]]]
    assert not wrong, "\n".join(f"{g['mode']} rank {g['rank']}: exit {g['code']}\n{g['tail']}"
                                for g in wrong)
    leaked = [g for g in got if g["leak"]]
    assert not leaked, [(g["mode"], g["rank"], g["leak"]) for g in leaked]
    assert {g["mode"] for g in got} == set(MODES)


def test_no_destroyed_group_stays_referenced_by_torch():
    """The two ways torch 2.13 keeps a group alive past its destruction, in a fresh
    interpreter: a module imported before the group formed holds None; one imported
    after it holds the group until ``destroy_group`` (and the exit) lets go of it - and
    then the group's threads end."""
    script = textwrap.dedent("""
        import sys
        import torch.distributed as dist
        from pollux_launch.rendezvous import process_group as pg

        fn = sys.modules["torch.distributed.nn.functional"]  # imported by pg, before
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert pg.gloo_threads(), "a gloo group has threads"
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        world = dist.group.WORLD
        assert fn.all_reduce.__defaults__[-1] is None
        assert world in ShardedGradScaler.__init__.__defaults__  # torch captured it
        del world
        pg.destroy_group()
        assert None in ShardedGradScaler.__init__.__defaults__
        assert not pg.gloo_threads(), pg.gloo_threads()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_every_module_that_captures_the_default_group_is_known():
    """The installed torch and DeepSpeed sources: every module with a default argument
    ``...WORLD`` (evaluated at import: the default group then) is one that
    ``process_group`` releases - an upgrade adding one fails here. (``distributed_c10d``
    itself is imported before any group can exist.)"""
    found = set()
    for package in ("torch.distributed", "deepspeed"):
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        for path in root.rglob("*.py"):
            text = path.read_text(errors="replace")
            if "WORLD" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]
                if any(isinstance(d, ast.Attribute) and d.attr == "WORLD" for d in defaults):
                    parts = path.relative_to(root).with_suffix("").parts
                    found.add(".".join((package, *parts)).removesuffix(".__init__"))
    assert "torch.distributed.nn.functional" in found  # the check sees them
    assert found - {"torch.distributed.distributed_c10d"} <= set(CAPTURING_MODULES), found


DEEPSPEED_SCRIPT = """
import atexit, os, sys

def check():  # registered first: runs after every other atexit handler
    gloo = [n for n in (open(f"/proc/self/task/{t}/comm").read().strip()
                        for t in os.listdir("/proc/self/task")) if "gloo" in n]
    print("left:", gloo, flush=True)

atexit.register(check)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
import torch.distributed as dist

from pollux_launch.adapters import deepspeed as pds

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import deepspeed.comm.torch  # after the group: it captures it (TorchBackend.barrier)

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
config = {"zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
          "pollux": {"enabled": True, "initial_batch_size": 8, "micro_batch_size_range": [4, 8]}}
engine, optimizer, _, _ = pds.initialize_handle(
    model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)
for _ in range(3):
    loss = engine(torch.randn(8, 8)).sum()  # kept: DeepSpeed's hooks on it reach the engine
    engine.backward(loss)
    engine.step()
"""


def test_a_deepspeed_engine_leaves_no_group_at_exit():
    """A DeepSpeed handle's engine, optimizer, parameters and DeepSpeed's caches all hold
    the process group (ZeRO-2 here); at exit they let go of it before it is destroyed,
    though the script still holds the engine through its last ``loss``."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (scripts/test.sh installs every extra)")
    r = subprocess.run([sys.executable, "-c", DEEPSPEED_SCRIPT], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "left: []" in r.stdout, (r.stdout[-1000:], r.stderr[-2000:])
