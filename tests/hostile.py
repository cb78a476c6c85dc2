"""Hostile store values, shared by the unit tests (tests/security), the end-to-end fuzzer
(tests/e2e/test_hostile_store.py) and ``benchmarks/hostile_inputs.py``."""

from __future__ import annotations

import json
import random

from pollux_launch import keys
from pollux_launch.messages import JobSpec, encode

HINTS = {"v": 1, "init_batch_size": 32, "max_batch_size": 256, "local_bsz_bounds": [8, 64]}
ZERO_MODEL = {"alpha_grad": 0, "beta_grad": 0, "alpha_local": 0, "beta_local": 0,
              "alpha_node": 0, "beta_node": 0, "gamma": 1}

# (key, raw value): what a buggy or hostile party may put in each key family
HOSTILE = [
    ("nodes/big", '{"v":1,"name":"big","slots":1e30}'),
    ("nodes/big2", '{"v":1,"name":"big2","slots":' + "9" * 40 + "}"),
    ("nodes/neg", '{"v":1,"name":"neg","slots":-4}'),
    ("nodes/dup", '{"v":1,"name":"n1","slots":64}'),  # another node's name
    ("nodes/nan", '{"v":1,"name":"nan","slots":2,"timestamp":NaN}'),
    ("nodes/wk", '{"v":1,"name":"wk","slots":2,"workers":{"../x":1}}'),
    ("jobs/deep/spec", "[" * 200_000),
    ("jobs/obj/spec", '{"a":' * 5000 + "1" + "}" * 5000),
    ("jobs/huge/spec", '{"v":1,"name":"huge","command":["x"],"env":{"A":"' + "x" * 2_000_000
     + '"}}'),
    ("jobs/other/spec", encode(JobSpec("victim", ("python",)))),  # a copy, renamed
    ("jobs/str/spec", '"just a string"'),
    ("jobs/h1/spec", encode(JobSpec("h1", ("python",), initial_replicas=1))),
    ("jobs/h1/hints", json.dumps({**HINTS, "perf_params": {"bogus": 1.0}})),
    ("jobs/h2/spec", encode(JobSpec("h2", ("python",), initial_replicas=1))),
    ("jobs/h2/hints", json.dumps({**HINTS, "perf_params": {**ZERO_MODEL, "alpha_grad": -1}})),
    ("jobs/h3/spec", encode(JobSpec("h3", ("python",), initial_replicas=1))),
    ("jobs/h3/hints", json.dumps({**HINTS, "grad_sqr": 1.0, "grad_var": 1.0,
                                  "perf_params": ZERO_MODEL})),  # valid, but infinite goodput
    ("jobs/h4/spec", encode(JobSpec("h4", ("python",), initial_replicas=1))),
    ("jobs/h4/hints", json.dumps({**HINTS, "local_bsz_bounds": [64, 8]})),
    ("jobs/h5/spec", encode(JobSpec("h5", ("python",), initial_replicas=1))),
    ("jobs/h5/hints", '{"v":1,"init_batch_size":32,"max_batch_size":1e999,'
                      '"local_bsz_bounds":[8,64]}'),
    ("jobs/h5/allocation", '{"v":1,"version":1,"nodes":["n1","../../etc"]}'),
    ("jobs/h5/status", '{"v":1,"state":"exploded"}'),
    ("coordinator/nonsense", "\x00\x01"),
]


def running_job_keys(job: str) -> list[str]:
    """The keys of a running job that anyone with store access can overwrite without
    stopping it (its spec, status and rendezvous are its own to lose)."""
    return [keys.job(job, "hints"), keys.job(job, "allocation"), keys.job(job, "restarts")]


FAMILIES = ["nodes/{n}", "jobs/{n}/spec", "jobs/{n}/hints", "jobs/{n}/allocation",
            "jobs/{n}/status", "jobs/{n}/signature", "jobs/{n}/restarts", "jobs/{n}/tasks/t",
            "jobs/{n}/exits/t"]


def random_value(rng: random.Random, well_formed: bool = True) -> str:
    """One random hostile value: garbage, deep nesting, huge or odd numbers, wrong types,
    (``well_formed``) a well-formed message of another kind or for another job."""
    kind = rng.choice(range(8) if well_formed else (0, 1, 2, 3, 4, 7))
    if kind == 0:
        return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(1, 64)))
    if kind == 1:
        return rng.choice("[{") * rng.randrange(10, 100_000)
    if kind == 2:
        return json.dumps({"v": 1, "name": "x", "slots": rng.choice(
            [10**30, -1, 0, 2**63, 1e308]), "version": rng.randrange(-5, 10**20)})
    if kind == 3:
        return '{"v":1,"slots":NaN,"version":Infinity,"count":-Infinity}'
    if kind == 4:
        return json.dumps(rng.choice([[], "s", 1, None, True, {"v": 2}]))
    if kind == 5:
        return json.dumps({"v": 1, "nodes": ["n1"] * rng.randrange(0, 50),
                           "version": rng.randrange(0, 10**6), "term": rng.randrange(0, 10)})
    if kind == 6:
        return encode(JobSpec(f"j{rng.randrange(100)}", ("sh", "-c", "echo pwned")))
    return "x" * rng.randrange(1, 3_000_000)
