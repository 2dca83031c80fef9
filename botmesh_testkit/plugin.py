"""The pytest plugin (entry point ``pytest11``: loaded wherever botmesh-testkit is
installed). Import-light: nothing heavy happens unless a ``--botmesh-*`` option is used.

``pytest --botmesh-backend=NAME`` (repeatable) certifies a backend. Three parts run, as
test items beside the project's own tests (``--botmesh-parts`` picks some):

* ``suite`` — the durability-level conformance suite
  (:mod:`botmesh_testkit.conformance.durability`) bound to each selected backend, the
  ``DurableKv``-level suite when the backend is built on a ``DurableKv``, and the
  server-fault suite (:mod:`botmesh_testkit.conformance.faults`) when its storage is on
  a server;
* ``scenarios`` — the GUAR table as scenarios (``botmesh_testkit/scenarios/``), plus the
  folders given with ``--botmesh-scenarios`` / ini ``botmesh_scenarios``;
* ``matrix`` — the crash matrix of the selected profile (``--botmesh-matrix``, default
  ``smoke``), one item per cell, named ``botmesh-matrix::BACKEND/WORKLOAD/POLICY/WHEN:POINT#N``;
* ``kills`` — the profile's real kill loops (``kills = N``): a child process running
  the bot on the backend is killed with SIGKILL N times per policy
  (:mod:`botmesh_testkit.kill`), for backends that claim ``survives_crash``.

A failing item prints the violated requirement ids, what happened and the command that
reproduces it. The terminal summary lists, per backend, the requirement ids held and
broken, and the items passed/failed per part, with the seed (``--botmesh-seed``, printed
on every run). It is built from the test reports, so it is complete under pytest-xdist.

Backends: the built-in names, ``postgres`` and ``redis`` (servers provisioned by
:mod:`botmesh_testkit.services`: ``--botmesh-postgres-url`` / ``--botmesh-redis-url`` or
the ``BOTMESH_*_URL`` environment variables, else private servers; skipped when none can
be had, or a usage error under ``--botmesh-require-services``), names registered by the
``pytest_botmesh_register_backends`` hook (:mod:`botmesh_testkit.hookspecs`) or the
entry-point group ``botmesh_testkit.backends``, and ``pkg.module:factory`` paths.

Fixtures for one's own tests: ``botmesh_harness`` (a fresh
:class:`~botmesh_testkit.backends.BackendHarness` of the first selected backend, else the
ini ``botmesh_backend``, else ``sqlite``), ``botmesh_world`` (a factory of
:class:`~botmesh_testkit.world.World` on it) and ``botmesh_bot`` (a factory of started
bots on it). Marker: ``spec(*ids)`` names the requirement ids a test checks.
"""

from __future__ import annotations

import asyncio
import os
import random
import shlex
import tempfile
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .matrix import Cell, Oracle, Outcome

SEED_KEY = pytest.StashKey[int]()
RESULTS_KEY = pytest.StashKey[list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]]]()
KILL_REPORTS_KEY = pytest.StashKey[list[tuple[str, list[str]]]]()
RECOVERY_KEY = pytest.StashKey[dict[str, Any]]()
"""Per backend, the :class:`~botmesh_testkit.recovery_coverage.RecoveryCoverage` of its cells."""
SKIP_REASONS_KEY = pytest.StashKey[list[tuple[str, str, str]]]()  # (backend, part, reason) of skipped items
REPORT_PATH_KEY = pytest.StashKey[Path]()
REPORT_WRITTEN_KEY = pytest.StashKey[str]()  # the summary's line about the report file
PARTS = ("suite", "scenarios", "matrix", "kills")
DEFAULT_BACKEND = "sqlite"
DEFAULT_CELL_TIMEOUT = 120.0


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("botmesh", "botmesh durability conformance and crash matrix")
    group.addoption("--botmesh-backend", action="append", default=None, metavar="NAME",
                    help="backend to certify (repeatable): memory, file, file+log, sqlite, postgres, redis, "
                         "a registered name, or pkg.module:factory")
    group.addoption("--botmesh-matrix", default=None, metavar="PROFILE",
                    help="crash matrix profile: smoke (default), full, or a path to a .toml file")
    group.addoption("--botmesh-seed", type=int, default=None, metavar="N",
                    help="seed of the random crash cells (default: drawn and printed)")
    group.addoption("--botmesh-parts", default=None, metavar="LIST",
                    help=f"comma-separated parts to run for the selected backends: {', '.join(PARTS)} (default: all)")
    group.addoption("--botmesh-scenarios", action="append", default=None, metavar="DIR",
                    help="run the scenario files of DIR (repeatable)")
    group.addoption("--botmesh-cell", default=None, metavar="ID",
                    help="run only this crash cell (BACKEND/WORKLOAD/POLICY/WHEN:POINT#N)")
    group.addoption("--botmesh-cell-timeout", type=float, default=None, metavar="SECONDS",
                    help=f"real-time budget of one crash cell (default {DEFAULT_CELL_TIMEOUT:g})")
    group.addoption("--botmesh-recovery-coverage", action="store_true", default=False,
                    help="measure which lines of the engine's recovery code each crash cell's restart runs, and "
                         "print them per crash point (off under pytest-cov; about 25 ms per cell)")
    group.addoption("--botmesh-require-services", action="store_true",
                    default=os.environ.get("BOTMESH_REQUIRE_SERVICES", "") not in ("", "0"),
                    help="fail (instead of skipping) when a PostgreSQL or Redis server cannot be provisioned "
                         "(default: on when $BOTMESH_REQUIRE_SERVICES is set, as .ci/run does)")
    group.addoption("--botmesh-postgres-url", default=None, metavar="URL",
                    help="PostgreSQL server for the postgres backend (else $BOTMESH_POSTGRES_URL, else a private server)")
    group.addoption("--botmesh-redis-url", default=None, metavar="URL",
                    help="Redis server for the redis backend (else $BOTMESH_REDIS_URL, else a private server)")
    group.addoption("--botmesh-report", default=None, metavar="PATH",
                    help="write the certification report to PATH after the run: JSON, or Markdown when PATH ends in .md")
    parser.addini("botmesh_report", "certification report file (relative to the ini file; .md: Markdown, else JSON)",
                  default="")
    parser.addini("botmesh_backend", "default backends (space separated)", type="args", default=[])
    parser.addini("botmesh_matrix", "default crash matrix profile", default="smoke")
    parser.addini("botmesh_scenarios", "scenario folders to run (relative to the ini file)", type="paths", default=[])
    parser.addini("botmesh_cell_timeout", "real-time budget of one crash cell, seconds", default=str(DEFAULT_CELL_TIMEOUT))


def _usage(option: str, message: str) -> pytest.UsageError:
    return pytest.UsageError(f"{option}: {message}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spec(*ids): the spec requirement ids a test checks")
    if not config.pluginmanager.has_plugin("botmesh_testkit.kill_plugin"):
        config.pluginmanager.import_plugin("botmesh_testkit.kill_plugin")
    from .backends import REGISTRY, BackendSpecError, resolve
    from .profiles import ProfileError, load_profile

    config.hook.pytest_botmesh_register_backends(registry=REGISTRY)
    for option, names in (("--botmesh-backend", config.getoption("--botmesh-backend") or []),
                          ("botmesh_backend (ini)", config.getini("botmesh_backend"))):
        for name in names:
            try:
                resolve(name)
            except BackendSpecError as exc:
                raise _usage(option, str(exc)) from None
    matrix = config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix")
    try:
        load_profile(matrix)
    except ProfileError as exc:
        raise _usage("--botmesh-matrix", str(exc)) from None
    _parts(config)  # validates --botmesh-parts
    cell = config.getoption("--botmesh-cell")
    if cell:
        from .matrix import Cell

        try:
            Cell.parse(cell)
        except ValueError as exc:
            raise _usage("--botmesh-cell", str(exc)) from None
    try:
        timeout = _cell_budget(config)
    except ValueError:
        raise _usage("botmesh_cell_timeout", f"{config.getini('botmesh_cell_timeout')!r} is not a number of seconds") from None
    if timeout <= 0:
        raise _usage("--botmesh-cell-timeout", f"{timeout:g} must be > 0 seconds")
    for folder in _scenario_dirs(config):
        if not folder.is_dir():
            raise _usage("--botmesh-scenarios", f"{str(folder)!r} is not a directory")
    _report_path(config)  # validates --botmesh-report / botmesh_report
    seed = config.getoption("--botmesh-seed")
    worker_seed = getattr(config, "workerinput", {}).get("botmesh_seed")
    if seed is None and worker_seed is not None:
        seed = int(worker_seed)  # an xdist worker draws the cells of the controller's seed
    config.stash[SEED_KEY] = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
    config.stash[RESULTS_KEY] = []
    _provision_services(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist: every worker takes the controller's seed, so that all of them
    collect the same random cells (xdist requires identical collections)."""
    node.workerinput["botmesh_seed"] = node.config.stash[SEED_KEY]


def _provision_services(config: pytest.Config) -> None:
    """Provision the servers of the selected service backends (``postgres``, ``redis``)
    once, in the main process, before any xdist worker starts: a database (PostgreSQL) or
    a key prefix (Redis) of this run's own on the server found, exported in the
    environment that the harnesses — and the workers, which inherit it — read. A server
    that cannot be had makes the backend's items one skip naming what was tried (or a
    usage error under ``--botmesh-require-services``, or when a given URL does not
    answer)."""
    from .backends import SERVICE_BACKENDS

    wanted = [n for n in _selected(config) if n in SERVICE_BACKENDS]
    if not wanted:
        return
    skips = config.stash.setdefault(_SKIPS_KEY, {})
    if hasattr(config, "workerinput"):  # an xdist worker: the main process did it
        for name in wanted:
            reason = os.environ.get(_unavailable_env(name))
            if reason:
                skips[name] = reason
        return
    from . import services

    saved = {k: os.environ.get(k) for k in (services.POSTGRES_URL_ENV, services.REDIS_URL_ENV,
                                              services.REDIS_PREFIX_ENV, *map(_unavailable_env, wanted))}

    def restore() -> None:  # the run's database/prefix is gone after it: do not leave them in the environment
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    config.add_cleanup(restore)
    require = bool(config.getoption("--botmesh-require-services"))
    for name in wanted:
        url = config.getoption(f"--botmesh-{name}-url")
        try:
            if name == "postgres":
                pg = services.provision_postgres(url, require=require)
                config.add_cleanup(pg.close)
                os.environ[services.POSTGRES_URL_ENV] = pg.new_database(services.namespace_hint("run"))
            else:
                rd = services.provision_redis(url, require=require)
                config.add_cleanup(rd.close)
                os.environ[services.REDIS_URL_ENV] = rd.url
                os.environ[services.REDIS_PREFIX_ENV] = rd.new_prefix(services.namespace_hint("run"))
        except services.ServiceUnavailable as exc:
            if exc.should_fail:
                raise _usage(f"--botmesh-backend={name}", str(exc)) from None
            skips[name] = f"{name}: no server could be provisioned ({exc}); --botmesh-require-services makes this fail"
            os.environ[_unavailable_env(name)] = skips[name]


def _unavailable_env(name: str) -> str:
    return f"BOTMESH_{name.upper()}_UNAVAILABLE"


def _report_path(config: pytest.Config) -> None:
    """Validate the report file (``--botmesh-report``, relative to the current directory,
    else the ini ``botmesh_report``, relative to the ini file) and keep it in the stash."""
    given = config.getoption("--botmesh-report")
    option, raw = ("--botmesh-report", given) if given else ("botmesh_report (ini)", config.getini("botmesh_report"))
    if not raw:
        return
    base = config.invocation_params.dir if given else (config.inipath.parent if config.inipath else config.rootpath)
    path = (Path(base) / Path(raw).expanduser()).absolute()
    if path.is_dir():
        raise _usage(option, f"{raw!r} is a directory; give a file path (.json, or .md for Markdown)")
    if not path.parent.is_dir():
        raise _usage(option, f"the directory of {raw!r} ({str(path.parent)!r}) does not exist")
    config.stash[REPORT_PATH_KEY] = path


_SKIPS_KEY = pytest.StashKey[dict[str, str]]()


def _parts(config: pytest.Config) -> tuple[str, ...]:
    raw = config.getoption("--botmesh-parts")
    if not raw:
        return PARTS
    parts = tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise _usage("--botmesh-parts", f"{raw!r}: choose from {', '.join(PARTS)}")
    return parts


def _selected(config: pytest.Config) -> list[str]:
    return list(config.getoption("--botmesh-backend") or [])


def _default_backends(config: pytest.Config) -> list[str]:
    return _selected(config) or list(config.getini("botmesh_backend")) or [DEFAULT_BACKEND]


def _scenario_dirs(config: pytest.Config) -> list[Path]:
    given = [Path(p) for p in config.getoption("--botmesh-scenarios") or []]
    return given + [Path(p) for p in config.getini("botmesh_scenarios")]


def pytest_report_header(config: pytest.Config) -> str | None:
    backends = _selected(config)
    if not backends and not _scenario_dirs(config):
        return None
    matrix = config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix")
    return (f"botmesh: backends {', '.join(backends or _default_backends(config))}; parts {', '.join(_parts(config))}; "
            f"matrix {matrix}; seed {config.stash[SEED_KEY]}")


# --------------------------------------------------------------------------------------
# crash cells
# --------------------------------------------------------------------------------------
class MatrixCellItem(pytest.Item):
    """One crash-matrix cell as a test item."""

    def __init__(self, *, cell: Cell, oracle: Oracle, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.oracle = oracle
        self.seed = seed
        self.outcome: Outcome | None = None
        from .cli import POINT_SPEC
        from .workloads import WORKLOADS

        ids = set(WORKLOADS[cell.workload].spec_ids) | set(POINT_SPEC.get(cell.point, ()))
        self.add_marker(pytest.mark.spec(*sorted(ids)))
        self.user_properties.append(("botmesh_backend", cell.backend))

    def runtest(self) -> None:
        from .matrix import run_cell

        budget = _cell_budget(self.config)
        with tempfile.TemporaryDirectory(prefix="botmesh-cell-") as tmp:
            try:
                measure = bool(self.config.getoption("--botmesh-recovery-coverage"))
                self.outcome = asyncio.run(asyncio.wait_for(
                    run_cell(self.cell, self.seed, self.oracle, tmp, measure_recovery=measure), budget))
            except TimeoutError:
                raise CellFailed(
                    f"cell {self.cell.id}: did not finish within its real-time budget of {budget:g} s "
                    "(--botmesh-cell-timeout). A backend that acknowledges updates without storing them, or "
                    "never settles a record, keeps the recovery loop busy until the budget runs out.\n"
                    f"  reproduce: {self.cell.command(self.seed)}") from None
        if self.outcome.recovery_lines is not None or self.outcome.recovery_note is not None:
            from .recovery_coverage import record_of

            self.user_properties.append(("botmesh_recovery", record_of(self.outcome)))
        self.ihook.pytest_botmesh_cell_finished(cell=self.cell, outcome=self.outcome)
        if not self.outcome.passed:
            raise CellFailed(self.outcome.report(self.seed))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-matrix", 0, f"crash cell {self.cell.id}"


def _cell_budget(config: pytest.Config) -> float:
    given = config.getoption("--botmesh-cell-timeout")
    return float(given if given is not None else config.getini("botmesh_cell_timeout"))


class CellFailed(Exception):
    """A crash cell broke a guarantee; the message is the cell's report."""


class BrokenDryRunItem(pytest.Item):
    """Stands for the cells of a workload whose crash-free dry run failed."""

    def __init__(self, *, backend: str, message: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message
        self.add_marker(pytest.mark.spec("TEST-4"))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        raise CellFailed(self.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        return str(excinfo.value)

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-matrix", 0, self.name


class KillLoopItem(pytest.Item):
    """A real kill loop (:class:`~botmesh_testkit.kill.KillLoop`) on one backend and
    policy: ``kills`` SIGKILLs of a child process running the bot."""

    def __init__(self, *, backend: str, policy: str, kills: int, messages: int, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.policy = policy
        self.kills = kills
        self.messages = messages
        self.seed = seed
        self.add_marker(pytest.mark.spec("GUAR-1", "GUAR-2", "GUAR-3", "GUAR-4", "INB-2", "INB-7", "OUT-2", "OUT-14",
                                         "LEASE-2", "LEASE-4", "TEST-3"))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        from .backends import resolve
        from .kill import KillLoop

        with tempfile.TemporaryDirectory(prefix="botmesh-kills-") as tmp:
            harness = resolve(self.backend)(tmp)
            try:
                asyncio.run(harness.open())  # a factory harness learns its capabilities here
                spec, caps = harness.kill_spec(), harness.capabilities
            finally:
                asyncio.run(harness.close())  # the storage is the children's now (file locks ...)
            if not caps.survives_crash:
                pytest.skip(f"capability not claimed: survives_crash (backend {self.backend})")
            if spec is None:
                pytest.skip(f"backend {self.backend}: a child process cannot reach its storage")
            try:
                result = KillLoop(spec, kills=self.kills, messages=self.messages, seed=self.seed,
                                  on_ambiguous=self.policy, workdir=os.path.join(tmp, "loop")).run()
            finally:
                asyncio.run(resolve(self.backend)(tmp).close())  # drop what the children left (tables, keys)
        self.user_properties.append(("botmesh_kill_report", result.report().splitlines()[0:5]))
        if not result.passed:
            ids = sorted(result.violated_ids)
            self.user_properties.append(("botmesh_violated", tuple(ids)))
            matrix = self.config.getoption("--botmesh-matrix") or self.config.getini("botmesh_matrix")
            raise CellFailed(result.report() + f"\n  rerun: {_rerun_base(self.config)} --botmesh-parts=kills "
                                               f"--botmesh-matrix={matrix} "
                                               f"-k {shlex.quote(f'{self.backend}/{self.policy}/')}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-kills", 0, self.name


class ServiceSkipItem(pytest.Item):
    """Stands for the items of a backend whose server could not be provisioned."""

    def __init__(self, *, reason: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.skip(self.reason)

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-services", 0, self.name


def _matrix_items(session: pytest.Session, config: pytest.Config, backend: str) -> list[pytest.Item]:
    from .matrix import Cell, cells_for, oracle, random_cells
    from .profiles import load_profile

    profile = load_profile(config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix"))
    seed = config.stash[SEED_KEY]
    rng = random.Random(f"{seed}/{backend}")
    only = Cell.parse(config.getoption("--botmesh-cell")) if config.getoption("--botmesh-cell") else None
    if only is not None and only.backend != backend:
        return []
    items: list[pytest.Item] = []
    for workload in profile.workloads:
        if only is not None and only.workload != workload:
            continue
        try:
            with tempfile.TemporaryDirectory(prefix="botmesh-oracle-") as tmp:
                truth = asyncio.run(asyncio.wait_for(oracle(backend, workload, seed, tmp), _cell_budget(config)))
        except Exception as exc:  # the backend cannot even run the workload without a crash
            reason = ("did not finish within the cell budget (--botmesh-cell-timeout)"
                      if isinstance(exc, TimeoutError) else f"raised {exc!r}")
            name = f"botmesh-matrix::{backend}/{workload}/dry-run"
            items.append(BrokenDryRunItem.from_parent(
                session, name=name, nodeid=name, backend=backend,
                message=f"the crash-free dry run of workload {workload!r} on {backend} {reason}; its crash cells "
                        f"cannot be drawn. Reproduce: botmesh-testkit run --backend {shlex.quote(backend)} "
                        f"--seed {seed} --parts matrix"))
            continue
        cells = cells_for(backend, workload, truth.history, profile.policies, truth.raised)
        cells += random_cells(backend, workload, truth.history, profile.random_per_workload, rng)
        if only is not None:
            cells = [only]
        for cell in cells:
            items.append(MatrixCellItem.from_parent(session, name=f"botmesh-matrix::{cell.id}",
                                                    nodeid=f"botmesh-matrix::{cell.id}", cell=cell, oracle=truth,
                                                    seed=seed))
    return items


def _kill_items(session: pytest.Session, config: pytest.Config, backends: list[str]) -> list[pytest.Item]:
    from .profiles import load_profile

    profile = load_profile(config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix"))
    if not profile.kills:
        return []
    seed = config.stash[SEED_KEY]
    items: list[pytest.Item] = []
    for backend in backends:
        if backend == "memory":
            continue  # nothing of it outlives a process: no kill loop to run
        for policy in profile.policies:
            name = f"botmesh-kills::{backend}/{policy}/{profile.kills}-kills"
            items.append(KillLoopItem.from_parent(session, name=name, nodeid=name, backend=backend, policy=policy,
                                                  kills=profile.kills, messages=profile.kill_messages, seed=seed))
    return items


def _scenario_items(session: pytest.Session, config: pytest.Config, folder: Path, backends: list[str],
                    label: str, rerun: str) -> list[pytest.Item]:
    from .scenario import ScenarioFile, scenario_files

    items: list[pytest.Item] = []
    for path in scenario_files(folder):
        node = ScenarioFile.from_parent(session, path=path, nodeid=f"botmesh-scenarios/{label}/{path.name}",
                                        backends=backends, rerun=rerun, seed=config.stash[SEED_KEY])
        items.extend(session.genitems(node))
    return items


def _suite_items(session: pytest.Session) -> list[pytest.Item]:
    from .conformance import _certify

    path = Path(_certify.__file__)
    module = pytest.Module.from_parent(session, path=path, nodeid="botmesh-conformance")
    return list(session.genitems(module))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "botmesh_certified_backend" in metafunc.fixturenames:
        backends = _selected(metafunc.config)
        metafunc.parametrize("botmesh_certified_backend", backends, ids=backends)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    from .scenario import SHIPPED_DIR

    backends = _selected(config)
    parts = _parts(config)
    skips = config.stash.get(_SKIPS_KEY, {})
    live = [b for b in backends if b not in skips]
    added: list[pytest.Item] = []
    base = _rerun_base(config)
    for name, reason in skips.items():
        added.append(ServiceSkipItem.from_parent(session, name=f"botmesh-services::{name}",
                                                 nodeid=f"botmesh-services::{name}", reason=reason))
    only_cell = bool(config.getoption("--botmesh-cell"))
    if live and "suite" in parts and not only_cell:
        local = {b for b in live if not _has_server(b)}
        added.extend(it for it in _suite_items(session) if _param_backend(it) in live
                     and not (_param_backend(it) in local and "::TestServerFaults::" in it.nodeid))
    if "scenarios" in parts and not only_cell:
        if live:
            added += _scenario_items(session, config, SHIPPED_DIR, live, "guar", base)
        dirs = _scenario_dirs(config)
        targets = live if backends else [b for b in _default_backends(config) if b not in skips]
        for folder in dirs:
            rerun = f"{base} --botmesh-scenarios={shlex.quote(str(folder))}"
            added += _scenario_items(session, config, folder, targets, folder.name, rerun)
    if "matrix" in parts:
        for backend in live:
            added += _matrix_items(session, config, backend)
    if "kills" in parts and not only_cell:
        added += _kill_items(session, config, live)
    for item in added:
        marker = item.get_closest_marker("spec")
        if marker is not None:
            item.user_properties.append(("botmesh_spec", tuple(marker.args)))
        param_backend = _param_backend(item)
        if param_backend is not None and ("botmesh_backend", param_backend) not in item.user_properties:
            item.user_properties.append(("botmesh_backend", param_backend))
    items.extend(added)


def _has_server(backend: str) -> bool:
    """Whether the backend's storage is on a server (the fault suite applies)."""
    from .backends import resolve

    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        return resolve(backend)(tmp).server_address() is not None


def _param_backend(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "botmesh_certified_backend" in callspec.params:
        return str(callspec.params["botmesh_certified_backend"])
    return None


def _rerun_base(config: pytest.Config) -> str:
    parts = ["pytest"] + [f"--botmesh-backend={shlex.quote(b)}" for b in _selected(config)]
    return " ".join(parts + [f"--botmesh-seed={config.stash[SEED_KEY]}"])


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if isinstance(item, MatrixCellItem) and item.outcome is not None and not item.outcome.passed:
        ids = sorted({i for v in item.outcome.violations for i in v.ids})
        report.user_properties.append(("botmesh_violated", tuple(ids)))
    return report


def pytest_report_collectionfinish(config: pytest.Config, items: Sequence[pytest.Item]) -> str | None:
    """The plugin's items are added after pytest counted what it collected, so its
    "collected N items" line leaves them out; this line gives the real totals."""
    parts: Counter[str] = Counter(_part_of(item.nodeid) for item in items)
    ours = sum(n for part, n in parts.items() if part != "tests")
    if not ours:
        return None
    detail = ", ".join(f"{part} {parts[part]}" for part in (*PARTS, "services", "tests") if parts[part])
    return f"botmesh: {len(items)} items in all ({detail})"


def _part_of(nodeid: str) -> str:
    if nodeid.startswith("botmesh-matrix::"):
        return "matrix"
    if nodeid.startswith("botmesh-scenarios/"):
        return "scenarios"
    if nodeid.startswith("botmesh-conformance"):
        return "suite"
    if nodeid.startswith("botmesh-kills::"):
        return "kills"
    if nodeid.startswith("botmesh-services::"):
        return "services"
    return "tests"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props: dict[str, Any] = dict(report.user_properties)
    backend = props.get("botmesh_backend")
    if backend is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        spec = tuple(props.get("botmesh_spec", ()))
        violated = tuple(props.get("botmesh_violated", spec if outcome == "failed" else ()))
        config = _CONFIG[0] if _CONFIG else None
        if config is not None:
            config.stash[RESULTS_KEY].append((str(backend), _part_of(report.nodeid), outcome, spec, violated))
            if "botmesh_recovery" in props:
                from .recovery_coverage import RecoveryCoverage

                per = config.stash.setdefault(RECOVERY_KEY, {})
                per.setdefault(str(backend), RecoveryCoverage()).add_record(props["botmesh_recovery"])
            if "botmesh_kill_report" in props:
                config.stash.setdefault(KILL_REPORTS_KEY, []).append((str(backend), list(props["botmesh_kill_report"])))
            if outcome == "skipped":
                from .report import _skip_reason

                config.stash.setdefault(SKIP_REASONS_KEY, []).append(
                    (str(backend), _part_of(report.nodeid), _skip_reason(report.longrepr)))


_CONFIG: list[pytest.Config] = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG[:] = [session.config]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the certification report (``--botmesh-report``), on the controller only: an
    xdist worker saw only its own items."""
    config = session.config
    path = config.stash.get(REPORT_PATH_KEY, None)
    if path is None or hasattr(config, "workerinput"):
        return
    from .report import write_report

    try:
        write_report(config, path, exitstatus)
    except Exception as exc:  # the run's outcome stands; say loudly that the file is missing
        config.stash[REPORT_WRITTEN_KEY] = f"botmesh report NOT written to {path}: {type(exc).__name__}: {exc}"
    else:
        config.stash[REPORT_WRITTEN_KEY] = f"botmesh report written to {path}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    _durability_summary(terminalreporter, config)
    line = config.stash.get(REPORT_WRITTEN_KEY, None)
    if line is not None:
        terminalreporter.write_line(line, red=" NOT " in line)


def _durability_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS_KEY, [])
    skips = config.stash.get(_SKIPS_KEY, {})
    if not _selected(config) and not results:
        return
    from .report import held_and_broken

    seed = config.stash[SEED_KEY]
    write = terminalreporter.write_line
    terminalreporter.section("botmesh durability report")
    write(f"seed {seed} (rerun the same cells with --botmesh-seed={seed})")
    for name, reason in skips.items():
        write(f"{name}: SKIPPED — {reason.removeprefix(name + ': ')}")
    if not results:
        write("no botmesh items ran")
        return
    kill_lines: dict[str, list[str]] = defaultdict(list)
    for backend, lines in config.stash.get(KILL_REPORTS_KEY, []):
        kill_lines[backend].extend(lines)
    by_backend: dict[str, list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]]] = defaultdict(list)
    for row in results:
        by_backend[row[0]].append(row)
    for backend in sorted(by_backend):
        rows = by_backend[backend]
        write("")
        counts = []
        for part in PARTS:
            mine = [r for r in rows if r[1] == part]
            if mine:
                passed = sum(r[2] == "passed" for r in mine)
                failed = sum(r[2] == "failed" for r in mine)
                skipped = sum(r[2] == "skipped" for r in mine)
                counts.append(f"{part} {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
        write(f"{backend}: " + "; ".join(counts))
        for line in kill_lines.get(backend, []):
            write(f"  {line}")
        recovery = config.stash.get(RECOVERY_KEY, {}).get(backend)
        if recovery is not None:
            for line in recovery.format().splitlines():
                write(f"  {line}")
        held, broken = held_and_broken(rows)
        if held:
            write(f"  held ({len(held)}): {', '.join(held)}")
        if broken:
            write(f"  BROKEN ({len(broken)}): " + ", ".join(f"{i} in {n} item(s)" for i, n in broken.items()))


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------
@pytest.fixture
def botmesh_harness(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A fresh harness of the first selected backend (``--botmesh-backend``, else the ini
    ``botmesh_backend``, else ``sqlite``)."""
    from .backends import resolve

    harness = resolve(_default_backends(request.config)[0])(str(tmp_path))
    yield harness
    asyncio.run(harness.close())


@pytest.fixture
def botmesh_world(botmesh_harness: Any) -> Any:
    """``botmesh_world(setup=..., **options)`` -> a World on ``botmesh_harness``."""
    from .world import World

    def make(**kwargs: Any) -> World:
        return World(botmesh_harness, **kwargs)

    return make


@pytest.fixture
def botmesh_bot(botmesh_harness: Any) -> Any:
    """``await botmesh_bot(setup=None, provider=None, **durability)`` -> a started
    :class:`~botmesh.core.bot.Bot` on ``botmesh_harness`` (a
    :class:`~botmesh.core.testing.MockProvider` unless ``provider`` is given). The first
    call opens the backend; each later call abandons the previous bot as a dead process
    and reopens it, as a restart would. ``durability`` options go into ``durability=``
    (``instance_id`` defaults to ``"i1"``, the same for every call)."""
    from botmesh.core.bot import Bot
    from botmesh.core.testing import MockProvider

    bots: list[Any] = []

    async def make(setup: Any = None, provider: Any = None, **durability: Any) -> Any:
        if bots:
            await bots[-1].abandon()
            backend, store = await botmesh_harness.reopen()
        else:
            backend, store = await botmesh_harness.open()
        options = {"backend": backend, "instance_id": "i1", **durability}
        bot = Bot(provider or MockProvider(), store, durability=options)
        if setup is not None:
            setup(bot)
        bots.append(bot)
        await bot.start()
        return bot

    return make
