"""The README's promises: its example runs and prints what it says; its two commands are
the ones .ci/run uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.spec("ENABLE-3", "INB-4")
def test_the_durable_bot_example_runs(tmp_path: Path) -> None:
    block = re.search(r"## A durable bot in 20 lines\n\n```python\n(.*?)```", README, re.S)
    assert block is not None, "README lost its example"
    code = block.group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 26
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['hello!'] 1"


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    assert len(commands) >= 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.spec("GUAR-4", "TEST-3")
def test_the_custom_scenario_example_runs(tmp_path: Path) -> None:
    block = re.search(r"### Scenarios of your own\n\n```python\n(.*?)```", README, re.S)
    assert block is not None, "README lost its scenario example"
    code = block.group(1)
    assert len([line for line in code.splitlines() if line.strip()]) < 25
    (tmp_path / "stories").mkdir()
    (tmp_path / "stories" / "echo.py").write_text(code, encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--botmesh-scenarios=stories",
                          "--botmesh-backend=sqlite", "--botmesh-parts=scenarios", "-q"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sqlite: scenarios 12 passed, 0 failed" in out.stdout, out.stdout
