"""``--botmesh-coverage=PATH`` (issue 14): a coverage.py data file whose dynamic contexts
are the crash-matrix cells (their recovery) and the other in-process items, measuring
the engine and the backend's own package — a third party's included — run through
pytester (and the CLI) as users run it, the data file read with coverage's own API."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import coverage
import pytest

from botmesh.sqlite_store import kv as sqlite_kv
from botmesh_testkit.matrix import coverage as rc

pytest_plugins = ["pytester"]

spec = pytest.mark.spec


@pytest.fixture
def untraced() -> None:
    if rc.tracer_active():  # the suite itself under pytest-cov: the option then measures nothing, by design
        pytest.skip(rc.NOTE_TRACER_ACTIVE)


def _body_lines(fn: object) -> set[int]:
    source, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return set(range(first + 1, first + len(source)))


def _contexts(path: Path) -> tuple[coverage.CoverageData, set[str]]:
    data = coverage.CoverageData(str(path))
    data.read()
    return data, set(data.measured_contexts())


def _file(data: coverage.CoverageData, tail: str) -> str:
    found = [f for f in data.measured_files() if f.replace(os.sep, "/").endswith(tail)]
    assert len(found) == 1, (tail, sorted(data.measured_files()))
    return found[0]


@spec("TEST-4", "GUAR-3", "GUAR-4")
def test_the_data_file_names_the_crash_points_that_ran_each_backend_line(pytester: pytest.Pytester,
                                                                          untraced: None) -> None:
    """SQLite's matrix on two xdist workers: the workers' files are combined into one
    data file; a crash cell's recovery is a context of its own, and the lines of the
    SQLite kv's read path carry the contexts of the crash points whose recovery read the
    journal; the per-point summary is printed from the same measurement."""
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--botmesh-backend=sqlite", "--botmesh-parts=matrix", "--botmesh-seed=3",
        "-k", "one-send/skip", "--botmesh-coverage=cov.data")
    assert result.ret == 0, result.stdout.str()[-3000:]
    path = pytester.path / "cov.data"
    result.stdout.fnmatch_lines([f"botmesh coverage data written to {path}, combined from 2 xdist worker file(s); *"
                                 f"coverage html --data-file={path} --show-contexts"])
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith("cov.data")) == ["cov.data"]
    data, contexts = _contexts(path)
    cell = "matrix:sqlite/one-send/skip/before:outbox.mark_sent#1"
    assert {cell, cell + " (outside recovery)"} <= contexts
    assert not {c for c in contexts if c.startswith("matrix:") and "/one-send/skip/" not in c}  # -k chose these
    # the SQLite kv's read path ran in the recovery of crash cells, each named
    kv_file = _file(data, "botmesh/sqlite_store/kv.py")
    by_line = data.contexts_by_lineno(kv_file)
    read_lines = _body_lines(sqlite_kv.SQLiteKv.get) | _body_lines(sqlite_kv.SQLiteKv.scan)
    recovering = {c for n in read_lines for c in by_line.get(n, ()) if c.startswith("matrix:sqlite/one-send/skip/")
                  and not c.endswith("(outside recovery)")}
    assert cell in recovering and len(recovering) > 3, sorted(recovering)
    # the engine's recovery: the sweep ran in that cell's recovery context, not outside it
    engine_lines = data.contexts_by_lineno(_file(data, "botmesh/core/engine.py"))
    sweep = rc.RECOVERY_CODE["sweep"].lines
    assert any(cell in engine_lines.get(n, ()) for n in sweep)
    # the per-point summary on top of it
    result.stdout.fnmatch_lines(["*recovery coverage of engine.py (* recovery functions, * lines): * reached * cells*"])


THIRD_PARTY = {
    "mykv/__init__.py": "",
    "mykv/store.py": '''
from botmesh.core.memory import MemoryKv

_STORES = {}


class CountingKv(MemoryKv):
    """A third party's kv: its own code around the memory kv."""

    async def get(self, scope, space, key):
        found = await super().get(scope, space, key)
        return found

    async def scan(self, scope, space, **kwargs):
        rows = await super().scan(scope, space, **kwargs)
        return rows


def make(workdir):
    return _STORES.setdefault(workdir, CountingKv())
''',
    "mykv/unused.py": "VALUE = 1\n",
}


@spec("TEST-4", "BACK-7")
def test_a_third_party_backend_s_own_package_is_measured(pytester: pytest.Pytester, untraced: None) -> None:
    """``mykv.store:make``: the package ``mykv`` (derived from the factory's module) is
    measured — its kv's lines carry crash-cell contexts, its never imported module is
    listed unexecuted — and so is the engine; the testkit itself is not."""
    for name, text in THIRD_PARTY.items():
        (pytester.path / name).parent.mkdir(exist_ok=True)
        (pytester.path / name).write_text(text)
    pytester.syspathinsert()
    (pytester.path / "out").mkdir()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--botmesh-backend=mykv.store:make", "--botmesh-parts=matrix,scenarios",
        "--botmesh-seed=3", "-k", "one-send/skip or guar_1", "--botmesh-coverage=out/cov.data")
    assert result.ret == 0, result.stdout.str()[-3000:]
    data, contexts = _contexts(pytester.path / "out" / "cov.data")
    own = _file(data, "mykv/store.py")
    by_line = data.contexts_by_lineno(own)
    get_line = next(n for n, text in enumerate((pytester.path / "mykv/store.py").read_text().splitlines(), 1)
                    if "found = await super().get" in text)
    cells = {c for c in by_line.get(get_line, ()) if c.startswith("matrix:mykv.store:make/one-send/skip/")}
    assert any(not c.endswith("(outside recovery)") for c in cells), sorted(by_line.get(get_line, ()))
    assert _file(data, "mykv/unused.py") and not data.lines(_file(data, "mykv/unused.py"))
    assert any(c.startswith("scenarios:botmesh-scenarios/") for c in contexts), sorted(contexts)[:5]
    assert _file(data, "botmesh/core/engine.py")
    assert not [f for f in data.measured_files() if f"{os.sep}botmesh_testkit{os.sep}" in f]


@spec("TEST-4")
@pytest.mark.parametrize("where, why", [
    ("missing/cov.data", "the directory of 'missing/cov.data' (*missing*) does not exist"),
    ("adir", "'adir' is a directory; give the path of the coverage data file to write"),
])
def test_a_bad_path_is_a_usage_error_naming_the_option(pytester: pytest.Pytester, where: str, why: str) -> None:
    (pytester.path / "adir").mkdir()
    result = pytester.runpytest_subprocess("--botmesh-backend=sqlite", f"--botmesh-coverage={where}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--botmesh-coverage: {why}*"])
    # the CLI names the option as typed
    cli = subprocess.run([sys.executable, "-m", "botmesh_testkit.cli", "run", "--coverage", where],
                         cwd=pytester.path, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stdout + cli.stderr
    assert cli.stderr.startswith("botmesh-testkit: --coverage: "), cli.stderr
    assert "--botmesh-coverage" not in cli.stderr


@spec("TEST-4")
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into any directory")
def test_a_directory_that_is_not_writable_is_refused(pytester: pytest.Pytester) -> None:
    locked = pytester.path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = pytester.runpytest_subprocess("--botmesh-backend=sqlite", "--botmesh-coverage=locked/cov.data")
    finally:
        locked.chmod(0o700)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--botmesh-coverage: the directory of 'locked/cov.data' (*) is not writable*"])


@spec("BACK-7")
def test_what_is_measured_for_each_kind_of_backend_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built-in names: their botmesh.*_store package; pkg.module:factory and a name
    registered by hook: the factory's top-level package; a module outside any package:
    that module by name. The engine's package comes first, each source once."""
    from botmesh_testkit.backends.registry import REGISTRY
    from botmesh_testkit.matrix.coverage_file import backend_sources, sources

    (tmp_path / "ownpkg" / "sub").mkdir(parents=True)
    (tmp_path / "ownpkg" / "__init__.py").write_text("")
    (tmp_path / "ownpkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "ownpkg" / "sub" / "kvmod.py").write_text("def make(workdir):\n    return None\n")
    (tmp_path / "loose_kv_module.py").write_text("def make(workdir):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    own = os.path.realpath(tmp_path / "ownpkg")
    assert [s.replace(os.sep, "/") for s in backend_sources("sqlite")][0].endswith("/botmesh/sqlite_store")
    assert backend_sources("ownpkg.sub.kvmod:make") == [own]
    assert backend_sources("loose_kv_module:make") == ["loose_kv_module"]
    REGISTRY.add_factory("cov-test-kv", importlib.import_module("ownpkg.sub.kvmod").make)
    try:
        assert backend_sources("cov-test-kv") == [own]
    finally:
        REGISTRY._factories.pop("cov-test-kv", None)
    both = sources(["memory", "file", "ownpkg.sub.kvmod:make"])
    assert both[0].replace(os.sep, "/").endswith("/botmesh/core") and both[1:] == [own]
