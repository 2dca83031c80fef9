"""The shipped suite runs against the installed wheel, not only the source tree (issue 3,
"How we will know").

The project is copied (the files git knows: tracked, and untracked but not ignored) to a
temporary directory and built there into a wheel with pip, so that nothing (``build/``,
``*.egg-info``) is written into the source tree. The wheel is installed with
``pip install --no-deps --target SITE``. Then, with the venv's python,
``PYTHONPATH=SITE`` and an empty temporary directory as the working directory:

1. ``botmesh``, ``botmesh_testkit`` and ``botmesh_testkit.plugin`` are imported from SITE
   — the venv's editable install of the project registers a meta-path finder placed
   after ``PathFinder``, so the ``PYTHONPATH`` entry wins; that order is checked too —,
   the package data is there (``matrices/*.toml``, ``scenarios/*.py``, ``py.typed``,
   every module of the source tree), and the ``pytest11`` entry point ``botmesh``
   resolves to the wheel's distribution (``importlib.metadata``, and the plugin list of
   ``pytest -VV``);
2. ``python -m pytest --botmesh-backend=sqlite --botmesh-seed=1`` collects the shipped
   conformance suite, the GUAR scenarios and the smoke matrix from the installed package
   alone (the empty directory has no tests) and passes: exit 0, and the summary line
   ``sqlite: suite N passed, 0 failed; scenarios ...; matrix ...``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP_TIMEOUT = 600
RUN_TIMEOUT = 1200

PROBE = r"""
import importlib, importlib.metadata as md, json, sys
from importlib.machinery import PathFinder

mods = {name: importlib.import_module(name).__file__
        for name in ("botmesh", "botmesh.core", "botmesh.sqlite_store", "botmesh_testkit",
                     "botmesh_testkit.plugin", "botmesh_testkit.conformance", "botmesh_testkit.matrix")}
from importlib.resources import files
from botmesh_testkit.matrix.profiles import BUILTIN_PACKAGE, builtin_names
from botmesh_testkit.scenario.collect import scenario_files, shipped_dir

finders = [f if isinstance(f, type) else type(f) for f in sys.meta_path]
eps = [ep for ep in md.entry_points(group="pytest11") if ep.name == "botmesh"]
dist = md.distribution("botmesh-testkit")
print(json.dumps({
    "modules": mods,
    "meta_path": [f"{f.__module__}.{f.__qualname__}" for f in finders],
    "path_finder_index": finders.index(PathFinder),
    "entry_points": [{"value": ep.value, "dist": str(ep.dist.locate_file(""))} for ep in eps],
    "plugin_loaded_from": eps[0].load().__file__ if eps else None,
    "distribution": str(dist.locate_file("")),
    "distribution_files": sorted(str(f) for f in (dist.files or [])),
    "matrices_dir": str(files(BUILTIN_PACKAGE)),
    "matrices": builtin_names(),
    "scenarios_dir": str(shipped_dir()),
    "scenarios": [str(p) for p in scenario_files(shipped_dir())],
}))
"""


def _source_files() -> list[str]:
    """The project's files as git sees them (tracked, and untracked but not ignored)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, check=True, timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs a git work tree to know the project's files: {exc}")
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _ignored_entries() -> set[str]:
    """``git status`` entries of ignored paths, less the caches any test run makes."""
    out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--ignored"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    caches = ("__pycache__", ".pytest_cache", ".hypothesis", ".coverage", "reports/")
    return {line for line in out.splitlines() if line.startswith("!!") and not any(c in line for c in caches)}


def _artifacts() -> dict[str, int]:
    """Build artifacts in the source tree, with their mtimes (the egg-info of the
    editable install is there already: it must not change either)."""
    found: dict[str, int] = {}
    for top in [ROOT / "build", ROOT / "dist", *ROOT.glob("*.egg-info"), *(ROOT / "reference_impl").glob("*.egg-info")]:
        paths = [top, *top.rglob("*")] if top.is_dir() else [top] if top.exists() else []
        for p in paths:
            found[str(p.relative_to(ROOT))] = p.stat().st_mtime_ns
    found.update({str(p.relative_to(ROOT)): p.stat().st_mtime_ns for p in ROOT.glob("*.whl")})
    return found


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _build_wheel(src: Path, dist: Path, cwd: Path) -> tuple[Path, str]:
    """Build the wheel of ``src`` into ``dist``; returns it and how it was built.

    First offline, with the venv's own setuptools (``--no-build-isolation --no-index``).
    A setuptools older than 70.1 without the ``wheel`` package has no ``bdist_wheel``
    (the venv ``pip install -e .`` makes is like that); then pip builds in an isolated
    environment with the build requirements of pyproject.toml from the configured
    package index, as ``pip install -e .`` itself does."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "-w", str(dist)]
    offline = _run([*pip, "--no-build-isolation", "--no-index", str(src)], cwd=cwd, timeout=PIP_TIMEOUT)
    how = "offline, --no-build-isolation"
    if offline.returncode != 0:
        assert "bdist_wheel" in offline.stdout + offline.stderr, (
            f"pip wheel failed:\n{offline.stdout[-4000:]}\n{offline.stderr[-4000:]}")
        for leftover in ("build", "botmesh_testkit.egg-info"):
            shutil.rmtree(src / leftover, ignore_errors=True)
        isolated = _run([*pip, str(src)], cwd=cwd, timeout=PIP_TIMEOUT)
        assert isolated.returncode == 0, (
            "pip wheel failed, offline (no bdist_wheel in the venv's setuptools) and with build isolation:\n"
            f"{isolated.stdout[-4000:]}\n{isolated.stderr[-4000:]}")
        how = "build isolation (the venv's setuptools has no bdist_wheel)"
    wheels = list(dist.glob("botmesh_testkit-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {dist}, found {wheels}"
    return wheels[0], how


def _under(path: str, site: Path) -> bool:
    return Path(path).resolve().is_relative_to(site.resolve())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[str]]:
    """The wheel built once from a copy of the source tree: (wheel, how, the files)."""
    files = _source_files()
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    wheel, how = _build_wheel(src, tmp / "dist", tmp)
    return wheel, how, files


@pytest.mark.slow
@pytest.mark.spec("BACK-7", "TEST-4")
def test_shipped_suite_runs_against_the_installed_wheel(tmp_path: Path, built: tuple[Path, str, list[str]]) -> None:
    ignored_before, artifacts_before = _ignored_entries(), _artifacts()
    wheel, how, files = built
    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps",
                      "--no-index", "--target", str(site), str(wheel)], cwd=tmp_path, timeout=PIP_TIMEOUT)
    assert installed.returncode == 0, f"pip install --target failed:\n{installed.stdout}\n{installed.stderr}"

    # -- the wheel holds every module and the package data --------------------------------
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    expected = {f"botmesh/{Path(f).relative_to('reference_impl/botmesh').as_posix()}"
                for f in files if f.startswith("reference_impl/botmesh/") and f.endswith((".py", "py.typed"))}
    expected |= {f for f in files if f.startswith("botmesh_testkit/") and f.endswith((".py", ".toml", ".md", "py.typed"))}
    # the top-level scenarios/guar/ and matrices/ install as botmesh_testkit.scenarios / .matrices
    expected |= {"botmesh_testkit/scenarios/" + f.removeprefix("scenarios/guar/")
                 for f in files if f.startswith("scenarios/guar/") and f.endswith(".py")}
    expected |= {"botmesh_testkit/matrices/" + f.removeprefix("matrices/")
                 for f in files if f.startswith("matrices/") and f.endswith((".py", ".toml", ".md"))}
    for needed in ("botmesh_testkit/matrices/smoke.toml", "botmesh_testkit/matrices/full.toml",
                   "botmesh_testkit/py.typed", "botmesh/py.typed", "botmesh_testkit/plugin.py",
                   "botmesh_testkit/durability.md"):
        assert needed in expected, f"{needed} is missing from the source tree itself"
    assert any(n.startswith("botmesh_testkit/scenarios/guar_") for n in expected)
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks files of the source tree: {missing}"
    assert re.search(r"^\[pytest11\]\s*\nbotmesh\s*=\s*botmesh_testkit\.plugin\s*$", entry_points, re.M), entry_points

    # -- (1) everything is imported from SITE -------------------------------------------
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHON"))}
    env["PYTHONPATH"] = str(site)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    probe = _run([sys.executable, "-c", PROBE], cwd=empty, env=env, timeout=120)
    assert probe.returncode == 0, f"the probe failed:\n{probe.stdout}\n{probe.stderr}"
    info = json.loads(probe.stdout)
    for name, file in info["modules"].items():
        assert _under(file, site), f"{name} was imported from {file}, not from the wheel in {site}"
    editable = [i for i, f in enumerate(info["meta_path"]) if "editable" in f.lower()]
    assert all(i > info["path_finder_index"] for i in editable), (
        f"an editable finder comes before PathFinder: {info['meta_path']}")
    assert _under(info["matrices_dir"], site) and {"smoke", "full"} <= set(info["matrices"]), info
    assert _under(info["scenarios_dir"], site), info
    shipped = sorted(Path(f).name for f in files if re.fullmatch(r"scenarios/guar/guar_[^/]+\.py", f))
    assert shipped, "no GUAR scenario file in scenarios/guar/"
    assert sorted(Path(p).name for p in info["scenarios"]) == shipped
    assert all(_under(p, site) for p in info["scenarios"]), info["scenarios"]
    assert info["entry_points"], "no pytest11 entry point named botmesh"
    first = info["entry_points"][0]  # the one pytest registers (later ones of the same name are skipped)
    assert first["value"] == "botmesh_testkit.plugin" and _under(first["dist"], site), info["entry_points"]
    assert _under(info["plugin_loaded_from"], site), info["plugin_loaded_from"]
    assert _under(info["distribution"], site), info["distribution"]
    assert {"botmesh_testkit/matrices/smoke.toml", "botmesh_testkit/py.typed"} <= set(info["distribution_files"])

    pytest_cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(empty)]
    version = _run([*pytest_cmd, "-VV"], cwd=empty, env=env, timeout=120)
    plugins = version.stdout + version.stderr
    assert version.returncode == 0, plugins
    listed = re.search(r"botmesh-testkit-\S+ at (\S+)", plugins)
    assert listed and _under(listed.group(1), site), f"pytest does not load the plugin from the wheel:\n{plugins}"

    # -- (2) the shipped suite, scenarios and smoke matrix pass from the wheel ----------
    parts = ["suite", "scenarios", "matrix", "explore", "kills", "powercuts", "corruption"]
    args = ["--botmesh-backend=sqlite", "--botmesh-seed=1", "-q", "-rfE"]
    run = _run([*pytest_cmd, *args], cwd=empty, env=env, timeout=RUN_TIMEOUT)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"pytest from the wheel exited {run.returncode}:\n{output[-8000:]}"
    summary = re.search(r"^sqlite: (.*)$", output, re.M)
    assert summary, f"no 'sqlite: ...' summary line:\n{output[-4000:]}"
    counts = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"(\w+) (\d+) passed, (\d+) failed", summary.group(1))}
    assert sorted(counts) == sorted(parts), f"{summary.group(0)} (expected the parts {parts}; wheel built {how})"
    for passed, failed in counts.values():
        assert passed > 0 and failed == 0, summary.group(0)
    print(f"wheel built with {how}; {summary.group(0)}")

    # -- nothing was written into the source tree -------------------------------------
    assert _artifacts() == artifacts_before, "build artifacts appeared or changed in the source tree"
    new = _ignored_entries() - ignored_before
    assert not new, f"new ignored paths in the source tree: {sorted(new)}"



@pytest.mark.slow
@pytest.mark.spec("TEST-4")
def test_a_plain_install_of_the_wheel_runs_the_main_job(tmp_path: Path, built: tuple[Path, str, list[str]]) -> None:
    """Issue 14: ``pip install <wheel>`` with no extras, in a fresh venv, gives a working
    CLI: its dependencies (pytest, hypothesis, psutil, multiprocess, coverage) come with it
    from the configured package index, and ``botmesh-testkit run`` on the default backend
    passes. Nothing of the project's own venv is visible (a new venv, no PYTHONPATH)."""
    wheel, _, _ = built
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=PIP_TIMEOUT)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    # a plain install has no FUSE binding: the power cuts skip (the verdict is partial), so
    # CI's "require every part" setting does not apply to this run
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "PYTHON", "VIRTUAL_ENV", "BOTMESH_REQUIRE"))}
    installed = _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                     cwd=tmp_path, env=env, timeout=PIP_TIMEOUT)
    assert installed.returncode == 0, f"pip install <wheel> failed:\n{installed.stdout[-3000:]}\n{installed.stderr[-3000:]}"
    empty = tmp_path / "empty"
    empty.mkdir()
    # the drivers are extras: not installed by a plain install
    probe = _run([str(py), "-c", "import importlib.util as u; print(u.find_spec('psycopg') is None, "
                  "u.find_spec('redis') is None, u.find_spec('pytest') is not None)"], cwd=empty, env=env, timeout=120)
    assert probe.stdout.split() == ["True", "True", "True"], probe.stdout + probe.stderr
    run = _run([str(venv / "bin" / "botmesh-testkit"), "run", "--seed", "1", "-q"], cwd=empty, env=env,
               timeout=RUN_TIMEOUT)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"botmesh-testkit run from a plain install exited {run.returncode}:\n{output[-6000:]}"
    assert "ModuleNotFoundError" not in output
    assert re.search(r"^sqlite: suite \d+ passed, 0 failed; scenarios \d+ passed, 0 failed; matrix \d+ passed, 0 failed",
                     output, re.M), output[-4000:]
