"""``--against REF`` of the benchmarks (``benchmarks/_against.py``): the side-by-side table,
clear errors for a bad REF, the cache never left half-made, "not in REF" for a benchmark
whose code an older version lacks.

Nothing here times anything: the benchmarks run in their quickest mode and only the shape
of what they print is checked. The "old version" is either the interpreter running these
tests (no install at all) or a tiny fake repository whose venv one session-scoped fixture
builds once (``pip install`` of a two-module package: a few seconds). No spec ids: these
check the tooling, not a guarantee of the contract.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import _against  # noqa: E402  (benchmarks/ is not a package)

QUICK_THROUGHPUT = ["--only", "memory", "--messages", "5", "--fast-messages", "20", "--repeat", "1",
                    "--count-messages", "5"]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def _fake_repo(where: Path, pyproject: str) -> tuple[Path, str]:
    """A git repository with a one-commit package ``botmesh`` + ``botmesh_testkit``; (repo, commit)."""
    repo = where / "repo"
    (repo / "botmesh").mkdir(parents=True)
    (repo / "botmesh_testkit").mkdir()
    (repo / "botmesh" / "__init__.py").write_text('WHO = "fake old version"\n')
    (repo / "botmesh_testkit" / "__init__.py").write_text("")
    (repo / "pyproject.toml").write_text(pyproject)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "fake")
    return repo, _git(repo, "rev-parse", "HEAD")


GOOD = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
[project]
name = "botmesh-testkit"
version = "0.0.1"
[tool.setuptools]
packages = ["botmesh", "botmesh_testkit"]
"""


@pytest.fixture(scope="session")
def fake_old(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    """(cache, repo, commit, interpreter): the fake repository's commit installed in a cached venv."""
    where = tmp_path_factory.mktemp("against")
    repo, commit = _fake_repo(where, GOOD)
    cache = where / "cache"
    log = io.StringIO()
    version = _against.prepare(commit[:10], cache=str(cache), root=str(repo), log=log)
    assert "installed" in log.getvalue()
    return cache, repo, commit, version.python


def test_a_git_ref_is_installed_once_in_the_cache_under_its_commit(fake_old: tuple[Path, Path, str, str]) -> None:
    cache, repo, commit, python = fake_old
    assert sorted(os.listdir(cache)) == [commit], "only the finished venv, under the full commit, nothing else"
    assert python == str(cache / commit / "venv" / "bin" / "python")
    who = subprocess.run([python, "-c", "import botmesh; print(botmesh.WHO, botmesh.__file__)"],
                         capture_output=True, text=True, check=True).stdout
    assert who.startswith("fake old version ") and str(cache / commit) in who, who
    log = io.StringIO()
    again = _against.prepare("HEAD", cache=str(cache), root=str(repo), log=log)
    assert again.python == python and log.getvalue() == "", "the second time comes from the cache"


def test_a_failing_install_names_the_ref_and_leaves_nothing_in_the_cache(tmp_path: Path) -> None:
    repo, commit = _fake_repo(tmp_path, GOOD.replace('packages = ["botmesh", "botmesh_testkit"]',
                                                     'packages = ["botmesh", "no_such_package"]'))
    _git(repo, "tag", "broken-release")
    cache = tmp_path / "cache"
    with pytest.raises(_against.AgainstError) as info:
        _against.prepare("broken-release", cache=str(cache), root=str(repo))
    assert "broken-release" in str(info.value) and commit[:7] in str(info.value)
    assert not cache.exists() or os.listdir(cache) == [], "no half-made venv, no build folder left"


def test_an_unknown_ref_is_a_clear_error_with_a_non_zero_exit(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, str(BENCH / "durable_throughput.py"), *QUICK_THROUGHPUT,
                          "--against", "no-such-ref-4711"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BOTMESH_AGAINST_CACHE": str(cache)})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no-such-ref-4711" in out.stderr and "neither" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not cache.exists()


def test_a_folder_that_is_no_venv_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(_against.AgainstError, match="not a venv"):
        _against.prepare(str(tmp_path))


def test_side_by_side_table_has_both_versions_and_the_ratio(tmp_path: Path) -> None:
    """The current interpreter as the 'old' version: no install, both columns, a ratio per figure."""
    report = tmp_path / "side.json"
    out = subprocess.run([sys.executable, str(BENCH / "durable_throughput.py"), *QUICK_THROUGHPUT,
                          "--against", sys.executable, "--rounds", "2", "--json", str(report)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("figure "))
    assert header.split() == ["figure", "current", "REF", "new/old", "new/old", "per", "round"]
    row = next(line for line in lines if line.startswith("memory: msg/s best"))
    numbers = row.removeprefix("memory: msg/s best").split()
    assert len(numbers) == 5 and float(numbers[2]) > 0, row  # current, REF, ratio, 2 ratios per round
    assert [line.split(":")[0].strip() for line in lines if line.strip().startswith("round ")] == \
        ["round 1", "round 1", "round 2", "round 2"], "alternating: current, REF, current, REF"
    data = json.loads(report.read_text())
    fig = data["figures"]["memory: journal writes/msg"]
    assert fig["current"] == fig["ref"] == [4.0, 4.0] and fig["ratio_of_medians"] == 1.0
    assert "--against" not in data["options"] and "--json" not in data["options"]


def test_a_benchmark_on_code_the_ref_lacks_says_not_in_ref(fake_old: tuple[Path, Path, str, str]) -> None:
    """events_journal.py needs ``botmesh.events``; the fake old version has no such module."""
    _, _, _, python = fake_old
    out = subprocess.run([sys.executable, str(BENCH / "events_journal.py"), "--ops", "2", "--messages", "2",
                          "--against", python], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines() == [
        f"events_journal.py: not in REF {python}: botmesh.core (ModuleNotFoundError: No module named 'botmesh.core'), "
        f"botmesh.core.file_backend (ModuleNotFoundError: No module named 'botmesh.core'), "
        f"botmesh.core.testing (ModuleNotFoundError: No module named 'botmesh.core'), "
        f"botmesh.events (ModuleNotFoundError: No module named 'botmesh.events')"]


def test_children_get_the_command_line_without_the_side_by_side_options() -> None:
    argv = ["--messages", "5", "--against", "main", "--rounds=3", "--json", "x.json", "--only", "memory"]
    assert _against.child_argv(argv) == ["--messages", "5", "--only", "memory"]


def test_every_benchmark_offers_against() -> None:
    """Each script's --help lists --against and --rounds (engine_cost: --against, its --repeat alternates)."""
    for script in sorted(BENCH.glob("[a-z]*.py")):
        out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (script.name, out.stderr)
        assert "--against REF" in out.stdout, script.name
        if script.name != "engine_cost.py":
            assert "--rounds N" in out.stdout, script.name


def test_crash_cells_passes_run_the_chosen_cells_over_again(tmp_path: Path) -> None:
    """``crash_cells.py --passes N`` runs the chosen cells N times over, each counted: with
    ``--cells 3 --passes 2`` six cells ran (of the profile's own number), none failed; a
    pass count below one is refused naming the option."""
    out = tmp_path / "cells.json"
    run = subprocess.run([sys.executable, str(BENCH / "crash_cells.py"), "--backends", "memory", "--parts", "cells",
                          "--cells", "3", "--passes", "2", "--baseline-runs", "1", "--json", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(out.read_text())["backends"]["memory"]["cells"]
    assert (summary["cells"], summary["failed"]) == (6, 0), summary
    assert summary["cells_in_profile"] > 3
    assert "x 2 passes" in run.stdout
    bad = subprocess.run([sys.executable, str(BENCH / "crash_cells.py"), "--parts", "cells", "--passes", "0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--passes must be >= 1" in bad.stderr
