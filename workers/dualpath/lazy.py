"""Lazy package exports (PEP 562): a package's `__init__` names each export and its module,
and the module is imported on first use. So a pure submodule (`dualpath.kv.ids`,
`dualpath.engine.cost`) imports without its siblings' heavy dependencies (torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """The package's module-level `__getattr__` over `table` (export name -> module name)."""

    def __getattr__(name: str) -> Any:  # noqa: N807 (the PEP 562 hook's own name)
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
