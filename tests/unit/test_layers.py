"""The pure modules import alone: without torch (the block-id hash, the cost model, the
policy, the frontend, the scheduler, the simulator) and without kopf (the builders). The
import-linter contracts in pyproject.toml check the static edges; this checks what actually
runs at import time (a package `__init__` that imports eagerly would show only here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_BLOCKER = """
import importlib, sys
blocked = set(sys.argv[1].split(","))
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, Blocker())
for name in sys.argv[2:]:
    importlib.import_module(name)
print("imported", len(sys.argv) - 2)
"""

WITHOUT_TORCH = [
    "dualpath.kv.ids",
    "dualpath.kv.format",
    "dualpath.kv.events",
    "dualpath.engine.cost",
    "dualpath.config",
    "dualpath.trace",
    "dualpath.scheduler.policy",
    "dualpath.scheduler.service",
    "dualpath.scheduler.client",
    "dualpath.frontend.app",
    "dualpath.frontend.grpc_backend",
    "dualpath.worker.wire",
    "dualpath.grpc_bounds",
    "dualpath.frontend.cli",
    "dualpath.sim.cli",
    "dualpath.cli",
]
WITHOUT_KOPF = ["dualpath_operator.builders", "dualpath_operator.status", "dualpath.cli"]


def _import_blocking(blocked: list[str], modules: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'workers'}{os.pathsep}{ROOT / 'operator'}"}
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER, ",".join(blocked), *modules],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("blocked", "modules"),
    [(["torch"], WITHOUT_TORCH), (["kopf", "kubernetes", "torch"], WITHOUT_KOPF)],
    ids=["without-torch", "without-kopf"],
)
def test_pure_modules_import_without_the_heavy_dependencies(blocked, modules):
    r = _import_blocking(blocked, modules)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"imported {len(modules)}" in r.stdout


def test_the_blocker_does_block():
    """The check above can fail: the store needs torch."""
    r = _import_blocking(["torch"], ["dualpath.kv.store"])
    assert r.returncode != 0 and "torch is blocked" in r.stderr


def test_the_leaf_contract_names_every_other_top_level_module():
    """ "Nothing imports local or sim" lists its sources: a new top-level module must join it
    (only the CLI's entry points, `dualpath.cli` and `dualpath.demo`, may import them)."""
    import pkgutil
    import tomllib

    import dualpath

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    leaf = next(c for c in contracts["contracts"] if c["name"].startswith("local cluster and"))
    top = {f"dualpath.{m.name}" for m in pkgutil.iter_modules(dualpath.__path__)}
    entry_points = {"dualpath.cli", "dualpath.demo"}
    assert set(leaf["source_modules"]) - {"dualpath_operator"} == top - entry_points - set(
        leaf["forbidden_modules"]
    )


def test_the_layers_contract_places_every_top_level_module():
    """The runtime's layers (pyproject.toml) name every top-level module once: a new one must
    take its place in the order, or an upward import through it would go unchecked."""
    import pkgutil
    import re
    import tomllib

    import dualpath

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contracts["contracts"] if c["name"].startswith("the runtime's layers"))
    placed = [m for layer in layers["layers"] for m in re.split(r"[|:]", layer)]
    placed = [m.strip() for m in placed]
    top = {f"dualpath.{m.name}" for m in pkgutil.iter_modules(dualpath.__path__)}
    assert len(placed) == len(set(placed))
    assert set(placed) == top


def _container_layers() -> list[dict]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in contracts["contracts"] if c["type"] == "layers" and "containers" in c]


@pytest.mark.parametrize("contract", _container_layers(), ids=lambda c: c["containers"][0])
def test_each_folders_layers_place_every_module_of_it(contract):
    """A folder's layers (the worker's, the local cluster's, the policy's, ...) name each of its
    modules once: a new file must take its floor, or its imports would go unchecked."""
    import importlib
    import pkgutil
    import re

    placed = [m.strip() for layer in contract["layers"] for m in re.split(r"[|:]", layer)]
    (container,) = contract["containers"]
    package = importlib.import_module(container)
    assert len(placed) == len(set(placed))
    assert set(placed) == {m.name for m in pkgutil.iter_modules(package.__path__)}


def import_circles(graph) -> list[list[str]]:
    """The circles between files: each set of modules that reach one another through imports
    (the strongly connected components of more than one module, by Tarjan), sorted."""
    edges = {
        m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while (w := stack.pop()) != v:
                        on_stack.discard(w)
                        component.append(w)
                    on_stack.discard(v)
                    if component:
                        circles.append(sorted([v, *component]))
    return sorted(circles)


def describe_circle(graph, circle: list[str]) -> str:
    """One circle as its arrows, each with the line that makes it."""
    arrows = []
    for a in circle:
        for b in sorted(graph.find_modules_directly_imported_by(a) & set(circle)):
            lines = sorted(
                d["line_number"] for d in graph.get_import_details(importer=a, imported=b)
            )
            arrows.append(f"  {a} -> {b} (l.{', '.join(map(str, lines))})")
    return f"{len(circle)} files:\n" + "\n".join(arrows)


def build_graph():
    """Every import of the runtime and the operator, in a function or under TYPE_CHECKING too."""
    import grimp

    return grimp.build_graph(
        "dualpath", "dualpath_operator", exclude_type_checking_imports=False, cache_dir=None
    )


def add_loaded_by_name(graph) -> list[tuple[str, str]]:
    """The arrows `_loaded_by_name` finds, added to `graph`; returns them."""
    arrows = _loaded_by_name(graph)
    for a, b, line in arrows:
        graph.add_import(importer=a, imported=b, line_number=line, line_contents="import_module")
    return [(a, b) for a, b, _ in arrows]


def test_no_circles_between_files():
    """No two files import each other, directly or round a longer loop: the house has floors.
    The graph counts every import statement, in a function or under TYPE_CHECKING too (a circle
    of type hints is still a circle to the reader), and the module loaded by name at run time
    (the zygote's `dualpath.cli`: nothing the CLI reaches imports the zygote). `make lint` checks
    the running imports (the acyclic_siblings contract in pyproject.toml)."""
    graph = build_graph()
    add_loaded_by_name(graph)
    circles = import_circles(graph)
    assert circles == [], "circles between files:\n" + "\n".join(
        describe_circle(graph, c) for c in circles
    )


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a loop of three and a pair, apart from a chain, are found."""
    import grimp

    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.e"), ("p.e", "p.d")]:
        graph.add_import(importer=a, imported=b, line_number=1, line_contents="import")
    graph.add_import(importer="p.x", imported="p.a")
    assert import_circles(graph) == [["p.a", "p.b", "p.c"], ["p.d", "p.e"]]


def _loaded_by_name(graph) -> list[tuple[str, str, int]]:
    """(module, the module it loads, the line) for each `importlib.import_module("literal")`: a
    run-time arrow no import statement shows (the zygote's `dualpath.cli`)."""
    import ast
    import importlib.util

    arrows = []
    for module in sorted(graph.modules):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in graph.modules
            ):
                arrows.append((module, node.args[0].value, node.lineno))
    return arrows


def test_the_zygote_alone_loads_a_module_by_name():
    """Modules import each other with import statements (the arrows the checks above see); the
    one module loaded by a name string is `dualpath.cli`, by the zygote that forks the local
    workers, the drawing's one arrow up."""
    assert add_loaded_by_name(build_graph()) == [("dualpath.local.zygote", "dualpath.cli")]


def draw() -> str:
    """The house as rooms (each top-level module or folder of `dualpath`; the operator is one)
    on floors (a room's floor: the longest way down its import arrows), top floor first, with
    the arrows loaded by name at run time and the count of circles between files (those arrows
    counted)."""
    graph = build_graph()

    def room(module: str) -> str:
        parts = module.split(".")
        return parts[0] if parts[0] != "dualpath" else ".".join(parts[:2])

    arrows = {
        (room(a), room(b))
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a) & graph.modules
        if room(a) != room(b)
    }
    floor: dict[str, int] = {}

    def floor_of(r: str) -> int:
        if r not in floor:
            floor[r] = 0  # ends a circle between rooms (none: acyclic_siblings, the test above)
            floor[r] = 1 + max((floor_of(b) for a, b in arrows if a == r), default=-1)
        return floor[r]

    for r in sorted({room(m) for m in graph.modules}):
        floor_of(r)
    file_arrows = sum(
        len(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules
    )
    by_name = add_loaded_by_name(graph)
    lines = [
        f"{len(floor)} rooms on {max(floor.values()) + 1} floors, {len(arrows)} arrows between "
        f"rooms; {len(graph.modules)} files, {file_arrows} arrows between files, "
        f"{len(import_circles(graph))} circles between files",
    ]
    for f in range(max(floor.values()), -1, -1):
        lines.append(f"floor {f:2}: " + ", ".join(sorted(r for r in floor if floor[r] == f)))
    for a, b in by_name:
        up = "up" if floor[room(b)] > floor[room(a)] else "down"
        lines.append(f"loaded by name at run time ({up}): {a} -> {b}")
    return "\n".join(lines)


if __name__ == "__main__":  # the drawing: python tests/unit/test_layers.py
    print(draw())
