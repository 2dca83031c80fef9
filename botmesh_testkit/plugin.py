"""The pytest plugin (entry point ``pytest11``: loaded wherever botmesh-testkit is
installed). Import-light: this module imports only pytest and the option helpers; the parts live in
:mod:`botmesh_testkit.pytest` and are imported by the hooks that need them, and nothing of
``botmesh`` is imported unless a ``--botmesh-*`` option (or ini key) asks for it.

``pytest --botmesh-backend=NAME`` (repeatable) certifies a backend. Its parts run, as
test items beside the project's own tests (``--botmesh-parts`` picks some):

* ``suite`` — the durability-level conformance suite
  (:mod:`botmesh_testkit.conformance.durability`) bound to each selected backend, the
  ``DurableKv``-level suite when the backend is built on a ``DurableKv``, and the
  server-fault suite (:mod:`botmesh_testkit.conformance.faults`) when its storage is on
  a server;
* ``scenarios`` — the GUAR table as scenarios (the top-level ``scenarios/guar/``), plus the
  folders given with ``--botmesh-scenarios`` / ini ``botmesh_scenarios``;
* ``matrix`` — the crash matrix of the selected profile (``--botmesh-matrix``, default
  ``smoke``), one item per cell, named ``botmesh-matrix::BACKEND/WORKLOAD/POLICY/WHEN:POINT#N``;
* ``explore`` — generated stories (:mod:`botmesh_testkit.explore`): Hypothesis's stateful
  testing drives a bot on the backend through messages with drawn plans, channel faults,
  deaths, restarts and time, and checks a model after every step; a failing story,
  shrunk, is written out as a scenario file (``explore_examples`` of the profile, or
  ``--botmesh-explore-examples``; one item per backend, named
  ``botmesh-explore::BACKEND/N-stories``);
* ``kills`` — the profile's real kill loops (``kills = N``): a child process running
  the bot on the backend is killed with SIGKILL N times per policy
  (:mod:`botmesh_testkit.kill`), for backends that claim ``survives_crash``;
* ``powercuts`` — the profile's power-cut loops (``power_cuts = N``): the kill loop with
  the backend's storage on a FUSE file system that loses every unsynced write, a power
  cut at every kill (:mod:`botmesh_testkit.kill.powercut`), for backends that claim
  ``survives_crash`` and keep their storage in the workdir; the held-operation sweep
  (``held_ops = N``, :mod:`botmesh_testkit.kill.held`: the bot killed while its n-th
  write, truncate or rename waits; ``BACKEND/N-held-ops``); the I/O-error loop
  (``io_errors``). Where nothing can be mounted (tried once) the part is one skip per
  backend saying why, a usage error under ``--botmesh-require-powercuts``.
* ``corruption`` — damaged files between two incarnations (``corruption_variants = N``):
  N seeded truncations, bit flips, zeroed pages and swapped blocks of the backend's files,
  each reopened, which must refuse it with the project's error or answer exactly what was
  acknowledged (:mod:`botmesh_testkit.matrix.corruption`), for backends whose storage is
  files in the workdir.

A failing item prints the violated requirement ids, what happened and the command that
reproduces it. The terminal summary lists, per backend, the requirement ids held and
broken, and the items passed/failed per part, with the seed (``--botmesh-seed``, printed
on every run). It is built from the test reports, so it is complete under pytest-xdist.

Backends: the built-in names, ``postgres`` and ``redis`` (servers provisioned by
:mod:`botmesh_testkit.servers`: ``--botmesh-postgres-url`` / ``--botmesh-redis-url`` or
the ``BOTMESH_*_URL`` environment variables, else private servers; skipped when none can
be had, or a usage error under ``--botmesh-require-services``), names registered by the
``pytest_botmesh_register_backends`` hook (:mod:`botmesh_testkit.hookspecs`) or the
entry-point group ``botmesh_testkit.backends``, and ``pkg.module:factory`` paths.

Fixtures for one's own tests: ``botmesh_harness`` (a fresh
:class:`~botmesh_testkit.backends.base.BackendHarness` of the first selected backend, else the
ini ``botmesh_backend``, else ``sqlite``), ``botmesh_world`` (a factory of
:class:`~botmesh_testkit.crash.world.World` on it) and ``botmesh_bot`` (a factory of started
bots on it), in :mod:`botmesh_testkit.pytest.fixtures`; ``botmesh_kill_loop`` in
:mod:`botmesh_testkit.pytest.kill_plugin`. Marker: ``spec(*ids)`` names the requirement
ids a test checks. The run's state is one :class:`~botmesh_testkit.pytest.session.BotmeshSession`
registered with the plugin manager.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from .pytest.options import (
    DEFAULT_CELL_TIMEOUT,
    DEFAULT_MATRIX,
    PARTS,
    cell_budget,
    default_backends,
    matrix_name,
    parts,
    rerun_base,
    scenario_dirs,
    selected,
    usage,
)
from .pytest.results import part_of
from .pytest.session import PLUGIN_NAME, BotmeshSession, session_of


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("botmesh", "botmesh durability conformance and crash matrix")
    group.addoption("--botmesh-backend", action="append", default=None, metavar="NAME",
                    help="backend to certify (repeatable): memory, file, file+log, sqlite, events, events-shared, "
                         "events-shared+log, postgres, redis, "
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
    group.addoption("--botmesh-item-timeout", type=float, default=None, metavar="SECONDS",
                    help="real-time budget of one conformance-suite item (default: the matrix profile's item_timeout, "
                         "120 s at smoke)")
    group.addoption("--botmesh-dry-run-timeout", type=float, default=None, metavar="SECONDS",
                    help="real-time budget of one workload's crash-free dry run at collection (default 20, at most "
                         "the cell budget)")
    group.addoption("--botmesh-explore-examples", type=int, default=None, metavar="N",
                    help="generated stories per backend in the explore part (default: the profile's explore_examples)")
    group.addoption("--botmesh-explore-seconds", type=float, default=None, metavar="SECONDS",
                    help="real seconds after which explore starts no new story, per backend (default: the profile's "
                         "explore_seconds)")
    group.addoption("--botmesh-shared-prefix", action="store_true", default=False,
                    help="crash cells of one workload and policy share their prefix: one crash-free run forks the "
                         "process at each cell's crash point (backends whose harness is forkable(): memory); off by "
                         "default, as a fork can cost more than a memory cell (botmesh_testkit.matrix.shared)")
    group.addoption("--botmesh-recovery-coverage", action="store_true", default=False,
                    help="measure which lines of the engine's recovery code each crash cell's restart runs, and "
                         "print them per crash point (off under pytest-cov; about 25 ms per cell)")
    group.addoption("--botmesh-require-services", action="store_true",
                    default=os.environ.get("BOTMESH_REQUIRE_SERVICES", "") not in ("", "0"),
                    help="fail (instead of skipping) when a PostgreSQL or Redis server cannot be provisioned "
                         "(default: on when $BOTMESH_REQUIRE_SERVICES is set to anything but 0)")
    group.addoption("--botmesh-require-powercuts", action="store_true", default=False,
                    help="fail (instead of skipping) when the power-cut file system cannot be mounted here "
                         "(also implied by --botmesh-require-services)")
    group.addoption("--botmesh-postgres-url", default=None, metavar="URL",
                    help="PostgreSQL server for the postgres backend (else $BOTMESH_POSTGRES_URL, else a private server)")
    group.addoption("--botmesh-redis-url", default=None, metavar="URL",
                    help="Redis server for the redis backend (else $BOTMESH_REDIS_URL, else a private server)")
    group.addoption("--botmesh-report", default=None, metavar="PATH",
                    help="write the certification report to PATH after the run: JSON, Markdown when PATH ends in .md, "
                         "one self-contained HTML page when it ends in .html")
    group.addoption("--botmesh-coverage", default=None, metavar="PATH",
                    help="write a coverage.py data file to PATH measuring the engine and the backend's own package, "
                         "one context per item (a crash cell's recovery: matrix:<cell id>); view it with coverage "
                         "html --data-file=PATH --show-contexts")
    parser.addini("botmesh_report", "certification report file (relative to the ini file; .md: Markdown, "
                                    ".html: HTML, else JSON)",
                  default="")
    parser.addini("botmesh_backend", "default backends (space separated)", type="args", default=[])
    parser.addini("botmesh_matrix", "default crash matrix profile", default=DEFAULT_MATRIX)
    parser.addini("botmesh_scenarios", "scenario folders to run (relative to the ini file)", type="paths", default=[])
    parser.addini("botmesh_cell_timeout", "real-time budget of one crash cell, seconds", default=str(DEFAULT_CELL_TIMEOUT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spec(*ids): the spec requirement ids a test checks")
    for name in ("botmesh_testkit.pytest.kill_plugin", "botmesh_testkit.pytest.fixtures", "botmesh_testkit.pytest.deadline"):
        if not config.pluginmanager.has_plugin(name):
            config.pluginmanager.import_plugin(name)
    seed = config.getoption("--botmesh-seed")
    worker_seed = getattr(config, "workerinput", {}).get("botmesh_seed")
    if seed is None and worker_seed is not None:
        seed = int(worker_seed)  # an xdist worker draws the cells of the controller's seed
    state = BotmeshSession(config, seed if seed is not None else random.SystemRandom().randrange(1, 2**31))
    config.pluginmanager.register(state, PLUGIN_NAME)
    if not _used(config):
        return  # nothing of botmesh is imported for a run that does not ask for it
    from .backends.registry import REGISTRY, BackendSpecError, resolve
    from .matrix.profiles import ProfileError, load_profile

    from .pytest.imports import invocation_dir_on_path

    invocation_dir_on_path(config)  # pytest's console script does not put the cwd on sys.path
    config.hook.pytest_botmesh_register_backends(registry=REGISTRY)
    for option, names in (("--botmesh-backend", config.getoption("--botmesh-backend") or []),
                          ("botmesh_backend (ini)", config.getini("botmesh_backend"))):
        for name in names:
            try:
                resolve(name)
            except BackendSpecError as exc:
                raise usage(option, str(exc)) from None
    try:
        load_profile(matrix_name(config))
    except ProfileError as exc:
        raise usage("--botmesh-matrix", str(exc)) from None
    parts(config)  # validates --botmesh-parts
    cell = config.getoption("--botmesh-cell")
    if cell:
        from .matrix.cells import Cell

        try:
            Cell.parse(cell)
        except ValueError as exc:
            raise usage("--botmesh-cell", str(exc)) from None
    try:
        timeout = cell_budget(config)
    except ValueError:
        raise usage("botmesh_cell_timeout", f"{config.getini('botmesh_cell_timeout')!r} is not a number of seconds") from None
    if timeout <= 0:
        raise usage("--botmesh-cell-timeout", f"{timeout:g} must be > 0 seconds")
    from .pytest.deadline import validate

    validate(config)  # --botmesh-item-timeout, --botmesh-dry-run-timeout
    examples, seconds = config.getoption("--botmesh-explore-examples"), config.getoption("--botmesh-explore-seconds")
    if examples is not None and examples < 0:
        raise usage("--botmesh-explore-examples", f"{examples} must be >= 0")
    if seconds is not None and not 0 < seconds < float("inf"):
        raise usage("--botmesh-explore-seconds", f"{seconds:g} must be > 0 seconds")
    for folder in scenario_dirs(config):
        if not folder.is_dir():
            raise usage("--botmesh-scenarios", f"{str(folder)!r} is not a directory")
    state.report_path = _report_path(config)
    coverage_file = config.getoption("--botmesh-coverage")
    if coverage_file:
        from .matrix.coverage_file import CoverageFileError, check_path
        from .pytest.coverage_plugin import CoveragePlugin

        try:
            path = check_path(coverage_file, config.invocation_params.dir)
        except CoverageFileError as exc:
            raise usage("--botmesh-coverage", str(exc)) from None
        config.pluginmanager.register(CoveragePlugin(config, path), "botmesh-coverage")
    from .pytest.provisioning import provision_services

    provision_services(config, state)


def _used(config: pytest.Config) -> bool:
    """Whether this run asks for anything of the plugin's (an option or ini key that
    selects backends, scenarios, a cell, a report, or a non-default matrix)."""
    return bool(selected(config) or config.getini("botmesh_backend") or scenario_dirs(config)
                or config.getoption("--botmesh-cell") or config.getoption("--botmesh-report")
                or config.getoption("--botmesh-coverage")
                or config.getini("botmesh_report") or config.getoption("--botmesh-matrix")
                or config.getoption("--botmesh-parts") or config.getoption("--botmesh-cell-timeout") is not None
                or config.getoption("--botmesh-item-timeout") is not None
                or config.getoption("--botmesh-explore-examples") is not None
                or config.getini("botmesh_matrix") != DEFAULT_MATRIX
                or config.getini("botmesh_cell_timeout") != str(DEFAULT_CELL_TIMEOUT))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist: every worker takes the controller's seed, so that all of them
    collect the same random cells (xdist requires identical collections)."""
    node.workerinput["botmesh_seed"] = session_of(node.config).seed


def _report_path(config: pytest.Config) -> Path | None:
    """Validate the report file (``--botmesh-report``, relative to the current directory,
    else the ini ``botmesh_report``, relative to the ini file) and return it (None: no report)."""
    given = config.getoption("--botmesh-report")
    option, raw = ("--botmesh-report", given) if given else ("botmesh_report (ini)", config.getini("botmesh_report"))
    if not raw:
        return None
    base = config.invocation_params.dir if given else (config.inipath.parent if config.inipath else config.rootpath)
    path = (Path(base) / Path(raw).expanduser()).absolute()
    if path.is_dir():
        raise usage(option, f"{raw!r} is a directory; give a file path (.json, .md for Markdown, .html for HTML)")
    if not path.parent.is_dir():
        raise usage(option, f"the directory of {raw!r} ({str(path.parent)!r}) does not exist")
    return path


def pytest_report_header(config: pytest.Config) -> str | None:
    backends = selected(config)
    if not backends and not scenario_dirs(config):
        return None
    return (f"botmesh: backends {', '.join(backends or default_backends(config))}; parts {', '.join(parts(config))}; "
            f"matrix {matrix_name(config)}; seed {session_of(config).seed}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "botmesh_certified_backend" in metafunc.fixturenames:
        backends = selected(metafunc.config)
        metafunc.parametrize("botmesh_certified_backend", backends, ids=backends)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _used(config):
        return
    import shlex

    from .pytest.items import (ServiceSkipItem, explore_items, kill_items, matrix_items, powercut_items,
                               reproduce_command, scenario_items, suite_items)
    from .scenario.collect import shipped_dir

    state = session_of(config)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    counted = getattr(terminal, "_numcollected", None)  # pytest's "collected N items", before ours
    backends = selected(config)
    chosen = parts(config)
    skips = state.service_skips
    live = [b for b in backends if b not in skips]
    added: list[pytest.Item] = []
    base = rerun_base(config, state.seed)
    for name, reason in skips.items():
        added.append(ServiceSkipItem.from_parent(session, name=f"botmesh-services::{name}",
                                                 nodeid=f"botmesh-services::{name}", reason=reason))
    only_cell = bool(config.getoption("--botmesh-cell"))
    if live and "suite" in chosen and not only_cell:
        local = {b for b in live if not _has_server(b)}
        added.extend(it for it in suite_items(session) if _param_backend(it) in live
                     and not (_param_backend(it) in local and "::TestServerFaults::" in it.nodeid))
    if "scenarios" in chosen and not only_cell:
        if live:
            added += scenario_items(session, shipped_dir(), live, "guar", base, state.seed)
        targets = live if backends else [b for b in default_backends(config) if b not in skips]
        for folder in scenario_dirs(config):
            rerun = f"{base} --botmesh-scenarios={shlex.quote(str(folder))}"
            added += scenario_items(session, folder, targets, folder.name, rerun, state.seed)
    if "matrix" in chosen:
        for backend in live:
            added += matrix_items(session, config, backend, state.seed)
    if "explore" in chosen and not only_cell:
        added += explore_items(session, config, live, state.seed)
    if "kills" in chosen and not only_cell:
        added += kill_items(session, config, live, state.seed)
    if "powercuts" in chosen and not only_cell:
        added += powercut_items(session, config, live, state.seed)
    if "corruption" in chosen and not only_cell:
        from .pytest.corruption import corruption_items

        added += corruption_items(session, config, live, state.seed)
    for item in added:
        marker = item.get_closest_marker("spec")
        if marker is not None:
            item.user_properties.append(("botmesh_spec", tuple(marker.args)))
            # the same, readable in a JUnit file's <properties>
            item.user_properties.append(("botmesh_ids", ", ".join(map(str, marker.args))))
        param_backend = _param_backend(item)
        if param_backend is not None and ("botmesh_backend", param_backend) not in item.user_properties:
            item.user_properties.append(("botmesh_backend", param_backend))
        command = reproduce_command(item, base, config)
        if command is not None:
            item.user_properties.append(("botmesh_reproduce", command))
    items.extend(added)
    if isinstance(counted, int):
        # pytest counted what the suite's module collected (classes left out for this backend
        # included) and none of the items built here: make its "collected N items" the truth
        terminal._numcollected = counted + len(added)  # type: ignore[union-attr]


def _has_server(backend: str) -> bool:
    """Whether the backend's storage is on a server (the fault suite applies)."""
    from .backends.registry import resolve

    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        return resolve(backend)(tmp).server_address() is not None


def _param_backend(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "botmesh_certified_backend" in callspec.params:
        return str(callspec.params["botmesh_certified_backend"])
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    cell_record = getattr(item, "cell_record", None)
    if callable(cell_record) and (report.when == "call" or report.outcome != "passed"):
        # the report's grid (an attribute, not a user property: it stays out of JUnit files,
        # and pytest-xdist carries a report's attributes to the controller as they are)
        report.__dict__["botmesh_cell"] = cell_record()
    outcome = getattr(item, "outcome", None)
    if outcome is not None and getattr(item, "cell", None) is not None and not outcome.passed:
        ids = sorted({i for v in outcome.violations for i in v.ids})
        report.user_properties.append(("botmesh_violated", tuple(ids)))
    if report.failed and part_of(item.nodeid) == "suite":
        # the suite's failures are pytest's own tracebacks: say how to rerun one alone
        command = dict(item.user_properties).get("botmesh_reproduce")
        if command:
            report.sections.append(("botmesh", f"reproduce: {command}"))
        named = _ids_named(report)
        if named:  # broken: what the failing assertion names, not the whole marker
            report.user_properties.append(("botmesh_violated", named))
    return report


def _ids_named(report: pytest.TestReport) -> tuple[str, ...]:
    """The requirement ids a failed suite assertion starts with (``"BACK-7/LEASE-2: put()
    ..."``), when each is one the spec defines; empty when it names none."""
    import re

    from .requirements import unknown

    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "") or "")
    message = re.sub(r"^\w+(Error|Exception|Failure): ", "", message)
    head = re.match(r"^\[?((?:[A-Z]+-\d+)(?:\s*[,/]\s*[A-Z]+-\d+)*)\]?:", message)
    if head is None:
        return ()
    ids = tuple(dict.fromkeys(re.findall(r"[A-Z]+-\d+", head.group(1))))
    return ids if ids and not unknown(ids) else ()


def pytest_report_collectionfinish(config: pytest.Config, items: Sequence[pytest.Item]) -> str | None:
    """The totals per part of what is selected (pytest's "collected N items", corrected in
    :func:`pytest_collection_modifyitems` to count the plugin's items, says how many in all)."""
    counted: Counter[str] = Counter(part_of(item.nodeid) for item in items)
    ours = sum(n for part, n in counted.items() if part != "tests")
    if not ours:
        return None
    detail = ", ".join(f"{part} {counted[part]}" for part in (*PARTS, "services", "tests") if counted[part])
    return f"botmesh: {len(items)} items in all ({detail})"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the certification report (``--botmesh-report``), on the controller only: an
    xdist worker saw only its own items."""
    state = session_of(session.config)
    if state.report_path is None or hasattr(session.config, "workerinput"):
        return
    from .pytest.report import write_report

    try:
        write_report(state, state.report_path, exitstatus)
    except Exception as exc:  # the run's outcome stands; say loudly that the file is missing
        state.report_line = f"botmesh report NOT written to {state.report_path}: {type(exc).__name__}: {exc}"
    else:
        state.report_line = f"botmesh report written to {state.report_path}"
