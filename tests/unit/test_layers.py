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
