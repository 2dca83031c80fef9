"""Static checks of the source tree, so that CI holds them like any other test:

* ``mypy`` in strict mode over both packages, ``conformance/`` included (the packages
  ship ``py.typed``: third parties type-check their code against these annotations);
* ``ruff check`` (pyflakes, pycodestyle, bugbear, pyupgrade) over the packages, the tests
  and the benchmarks.

Both read their settings from ``pyproject.toml`` (``[tool.mypy]``, ``[tool.ruff]``); the
tools come with the ``dev`` extra. No spec ids: these check the code, not a guarantee.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: install the dev extra (pip install -e '.[dev]')")
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def test_mypy_strict_over_both_packages() -> None:
    run = _run("mypy")
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"mypy found errors (settings in pyproject.toml [tool.mypy]):\n{out[-6000:]}"
    assert "Success" in out, out  # it really checked something
    print(out.strip().splitlines()[-1])


def test_ruff_check_is_clean() -> None:
    run = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"ruff check found problems (settings in pyproject.toml [tool.ruff]):\n{out[-6000:]}"
    print(out.strip())
