"""A rebuilt ZeRO-2 engine keeps its parameters where its predecessor flattened them
(``compat.flat_buffers_reused``): same memory, same values, and it trains on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

SCRIPT = r"""
import json, os, socket, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
from pollux_launch.adapters.deepspeed import initialize_handle
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 63), torch.nn.ReLU(), torch.nn.Linear(63, 10))
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
cfg = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
       "steps_per_print": 10**9, "pollux": {"enabled": True, "initial_batch_size": 8,
       "micro_batch_size_range": [4, 8], "lr_scaling": "none"}}
eng, _, _, _ = initialize_handle(model=m, optimizer=opt, config=cfg)
x = torch.randn(8, 64)
eng.backward(eng(x).pow(2).mean())
eng.step()
ptrs = [p.data_ptr() for p in m.parameters()]
before = [p.detach().clone() for p in m.parameters()]
eng.rescale(lambda: True)
same_memory = [p.data_ptr() for p in m.parameters()] == ptrs
same_values = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
eng.backward(eng(x).pow(2).mean())
eng.step()
trains = all(not torch.equal(a, p) for a, p in zip(before, m.parameters()))
print(json.dumps({"same_memory": same_memory, "same_values": same_values, "trains": trains}))
dist.destroy_process_group()
"""


def test_a_rebuilt_engine_flattens_its_parameters_in_place():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == '{"same_memory": true, "same_values": true, "trains": true}', last
