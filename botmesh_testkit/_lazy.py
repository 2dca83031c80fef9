"""Lazy re-exports (PEP 562) for the package ``__init__`` modules whose import must stay
light: importing ``botmesh_testkit`` (as loading the pytest plugin does) imports none of
the modules it re-exports until one of their names is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to the
    module (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
