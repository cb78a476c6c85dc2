"""No import cycles: every module's imports, parsed under the names the package installs
(pyproject's package-dir mapping: ``rendezvous/`` is ``pollux_launch.rendezvous``,
``adapters/`` is ``pollux_launch.adapters``), so that the folder layout hides nothing.

Every import counts - at module level, inside functions and under ``TYPE_CHECKING``: a
deferred import is still a dependency. ``python tests/test_import_graph.py`` prints the
package graph (the root package's modules are nodes of their own).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"]


def modules() -> dict[str, tuple[Path, bool]]:
    """Installed module name -> (its file, whether it is a package's ``__init__``)."""
    out = {}
    for pkg, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[0] in PACKAGE_DIR and (ROOT / parts[0]).resolve() != base.resolve():
                continue  # (a mapped folder seen from above: not under this name)
            is_pkg = parts[-1] == "__init__"
            out[".".join([pkg, *(parts[:-1] if is_pkg else parts)])] = (path, is_pkg)
    return out


def _target(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from pkg import mod`` names ``mod``)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [_target(a.name, mods) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                found = [_target(f"{base}.{a.name}", mods) for a in node.names]
            else:
                continue
            edges[mod].update(t for t in found if t and t != mod)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def package_graph(mods: dict, edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the packages it imports (the root package's modules stand alone)."""

    def package(mod: str) -> str:
        pkg = mod if mods[mod][1] else mod.rpartition(".")[0]
        return mod if pkg == "pollux_launch" else pkg

    out: dict[str, set[str]] = {package(m): set() for m in mods}
    for mod, targets in edges.items():
        out[package(mod)].update(package(t) for t in targets if package(t) != package(mod))
    return out


def test_the_tree_is_parsed_under_its_installed_names():
    mods = modules()
    edges = imports(mods)
    for name in ("pollux_launch.rendezvous.store.base", "pollux_launch.adapters.torch.trainer",
                 "pollux_launch.elastic.controller", "pollux_launch.cli"):
        assert name in mods
    assert "pollux_launch.rendezvous.store" in edges["pollux_launch.rendezvous.protocol"]
    assert len(mods) > 100


def test_no_import_cycle_between_modules():
    found = cycles(imports(modules()))
    assert not found, "import cycles (break each: move the shared part into a module " \
        f"both import): {found}"


def test_no_import_cycle_between_packages():
    mods = modules()
    found = cycles(package_graph(mods, imports(mods)))
    assert not found, f"package import cycles: {found}"


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


if __name__ == "__main__":
    mods = modules()
    graph = package_graph(mods, imports(mods))
    short = lambda name: name.removeprefix("pollux_launch.") or name  # noqa: E731
    for pkg in sorted(graph, key=short):
        if graph[pkg]:
            print(f"{short(pkg)} -> {', '.join(sorted(map(short, graph[pkg])))}")
    print("module cycles:", cycles(imports(mods)) or "none", file=sys.stderr)
