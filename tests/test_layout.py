"""The layout the architecture asks for, held by tests: no import cycle inside either
package, no module over ~800 lines without a reason at its top, the plugin import-light,
every package installed.

The import graph is built from the source (AST), counting every import: at module
level, inside functions and under ``if TYPE_CHECKING:`` — a cycle that only a lazy
import hides is still a cycle of the design. ``from .x import y`` is an edge to the
module ``x`` (or to ``x.y`` when that is a module), not to the package that holds ``x``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"botmesh": ROOT / "reference_impl" / "botmesh", "botmesh_testkit": ROOT / "botmesh_testkit"}
MAX_LINES = 800
REASON = "over 800 lines"
"""A longer module says why in its docstring, with these words."""


def modules_of(package: str, root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root``."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (every import statement)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        edges.add(f"{target}.{alias.name}")
                    elif target in modules:
                        edges.add(target)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_inside_the_package(package: str) -> None:
    cycle = find_cycle(import_graph(modules_of(package, PACKAGES[package])))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle or [])}"


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function_or_type_checking(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from .a import A\n")
    (root / "sub" / "a.py").write_text("def f():\n    from ..b import B\n")
    (root / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.a import A\n")
    (root / "c.py").write_text("from . import b\nfrom .sub import a\n")
    modules = modules_of("pkg", root)
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg.b", "pkg.sub.a"}
    assert graph["pkg.sub"] == {"pkg.sub.a"}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.a", "pkg.b"]
    (root / "b.py").write_text("X = 1\n")
    assert find_cycle(import_graph(modules)) is None


def test_a_self_import_is_a_cycle(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "m.py").write_text("def main():\n    from pkg.m import main\n")
    assert find_cycle(import_graph(modules_of("pkg", root))) == ["pkg.m", "pkg.m"]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_over_800_lines_without_a_reason(package: str) -> None:
    long = []
    for name, path in modules_of(package, PACKAGES[package]).items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_LINES and REASON not in (ast.get_docstring(ast.parse(text)) or "").lower():
            long.append(f"{name} ({text.count(chr(10))} lines)")
    assert not long, f"modules over {MAX_LINES} lines whose docstring does not say why ({REASON!r}): {long}"


def test_importing_the_plugin_imports_nothing_of_botmesh() -> None:
    probe = ("import sys, botmesh_testkit.plugin, botmesh_testkit.hookspecs; "
             "print(sorted(m for m in sys.modules if m == 'botmesh' or m.startswith('botmesh.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"loading the plugin imported {out.stdout.strip()}"


def test_a_pytest_run_without_botmesh_options_imports_nothing_of_botmesh(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="""
        import sys

        def test_nothing_of_botmesh_was_imported():
            loaded = sorted(m for m in sys.modules if m == "botmesh" or m.startswith("botmesh."))
            assert loaded == []
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_every_package_of_the_tree_is_in_the_distribution() -> None:
    """pyproject.toml lists the packages (the scenarios and matrices are mapped from
    top-level folders): a subpackage added to the tree and not listed would be missing
    from the wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    in_tree = {name for package, root in PACKAGES.items() for name, path in modules_of(package, root).items()
               if path.name == "__init__.py"}
    assert in_tree - listed == set(), "packages of the tree missing from pyproject.toml's list"
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in listed - in_tree:
        assert name in mapped and (ROOT / mapped[name] / "__init__.py").is_file(), f"{name} is listed but not in the tree"
