"""The tuner is pure: no store, no environment. The hints reporter writes the hints and
the worker-side factory reads the environment (``elastic.factory``), handing it in."""

from __future__ import annotations

import ast
from pathlib import Path

import pollux_launch.tuning.tuner as tuner_module
from pollux_launch.tuning.tuner import GoodputTuner, batch_range

SOURCE = Path(tuner_module.__file__)
# modules that reach a store or the environment
IMPURE = ("os", "pollux_launch.rendezvous", "pollux_launch.keys", "rendezvous", "keys",
          "store", "environ")


def _imported(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}".lstrip(".") for a in node.names)
    return out


def test_the_tuner_module_touches_no_store_and_no_environment():
    tree = ast.parse(SOURCE.read_text())
    imported = _imported(tree)
    bad = {m for m in imported for i in IMPURE if m == i or m.startswith(i + ".")
           or m.endswith("." + i) or m.split(".")[-1] in ("encode", "store_from_env")}
    assert not bad, f"tuner.py imports {bad}"
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"environ", "getenv", "putenv", "put", "store_from_env"}, attrs
    assert not hasattr(GoodputTuner, "report")  # (the reporter writes: elastic.hints)


def test_batch_range_reads_only_what_it_is_given(monkeypatch):
    monkeypatch.setenv("POLLUX_MAX_BATCH_SIZE", "16")  # not read: the caller hands it in
    assert batch_range(32, 1024) == (None, 1024)
    assert batch_range(32, 1024, None, {"POLLUX_MAX_BATCH_SIZE": "64"}) == (None, 64)
