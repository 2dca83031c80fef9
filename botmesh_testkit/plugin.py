"""The pytest plugin (entry point ``pytest11``: loaded wherever botmesh-testkit is
installed). Import-light: nothing heavy happens unless a ``--botmesh-*`` option is used.

``pytest --botmesh-backend=NAME`` (repeatable) adds the crash matrix of the selected
profile (``--botmesh-matrix``, default ``smoke``) as test items, one per cell, named
``botmesh-matrix::BACKEND/WORKLOAD/POLICY/WHEN:POINT#N``. A failing item prints the
violated requirement ids, the crash points passed, what was delivered and the command
that reproduces it. The terminal summary lists the guarantees held and broken per
backend, the cells passed/failed, and the seed (``--botmesh-seed``, printed on every
run).

Fixtures for one's own tests: ``botmesh_harness`` (a fresh
:class:`~botmesh_testkit.backends.BackendHarness` of the first selected backend, default
``memory``) and ``botmesh_world`` (a factory of :class:`~botmesh_testkit.world.World` on
it). Marker: ``spec(*ids)`` names the requirement ids a test checks.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .matrix import Cell, Oracle, Outcome

SEED_KEY = pytest.StashKey[int]()
OUTCOMES_KEY = pytest.StashKey[list["Outcome"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("botmesh", "botmesh durability conformance and crash matrix")
    group.addoption("--botmesh-backend", action="append", default=None, metavar="NAME",
                    help="backend to certify (repeatable): memory, file, file+log, sqlite, or pkg.module:factory")
    group.addoption("--botmesh-matrix", default=None, metavar="PROFILE",
                    help="crash matrix profile: smoke (default), full, or a path to a .toml file")
    group.addoption("--botmesh-seed", type=int, default=None, metavar="N",
                    help="seed of the random crash cells (default: drawn and printed)")
    parser.addini("botmesh_backend", "default backends for --botmesh-backend (space separated)", type="args", default=[])
    parser.addini("botmesh_matrix", "default crash matrix profile", default="smoke")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spec(*ids): the spec requirement ids a test checks")
    from .backends import BackendSpecError, resolve
    from .profiles import ProfileError, load_profile

    backends = config.getoption("--botmesh-backend") or []
    for name in backends:
        try:
            resolve(name)
        except BackendSpecError as exc:
            raise pytest.UsageError(f"--botmesh-backend: {exc}") from None
    matrix = config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix")
    try:
        load_profile(matrix)
    except ProfileError as exc:
        raise pytest.UsageError(f"--botmesh-matrix: {exc}") from None
    seed = config.getoption("--botmesh-seed")
    config.stash[SEED_KEY] = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
    config.stash[OUTCOMES_KEY] = []


def _selected(config: pytest.Config) -> list[str]:
    return list(config.getoption("--botmesh-backend") or [])


def pytest_report_header(config: pytest.Config) -> str | None:
    backends = _selected(config)
    if not backends:
        return None
    matrix = config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix")
    return f"botmesh: backends {', '.join(backends)}; matrix {matrix}; seed {config.stash[SEED_KEY]}"


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

    def runtest(self) -> None:
        from .matrix import run_cell

        with tempfile.TemporaryDirectory(prefix="botmesh-cell-") as tmp:
            self.outcome = asyncio.run(run_cell(self.cell, self.seed, self.oracle, tmp))
        self.config.stash[OUTCOMES_KEY].append(self.outcome)
        if not self.outcome.passed:
            raise CellFailed(self.outcome.report(self.seed))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-matrix", 0, f"crash cell {self.cell.id}"


class CellFailed(Exception):
    """A crash cell broke a guarantee; the message is the cell's report."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    backends = _selected(config)
    if not backends:
        return
    from .matrix import cells_for, oracle, random_cells
    from .profiles import load_profile

    profile = load_profile(config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix"))
    seed = config.stash[SEED_KEY]
    rng = random.Random(seed)
    for backend in backends:
        for workload in profile.workloads:
            with tempfile.TemporaryDirectory(prefix="botmesh-oracle-") as tmp:
                truth = asyncio.run(oracle(backend, workload, seed, tmp))
            cells = cells_for(backend, workload, truth.history, profile.policies, truth.raised)
            cells += random_cells(backend, workload, truth.history, profile.random_per_workload, rng)
            for cell in cells:
                items.append(MatrixCellItem.from_parent(session, name=f"botmesh-matrix::{cell.id}", cell=cell,
                                                        oracle=truth, seed=seed))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    outcomes = config.stash.get(OUTCOMES_KEY, [])
    if not _selected(config) and not outcomes:
        return
    from .cli import summarize

    seed = config.stash[SEED_KEY]
    terminalreporter.section("botmesh durability report")
    if not outcomes:
        terminalreporter.write_line(f"no crash cells ran (seed {seed})")
        return
    from .matrix import MatrixResult

    per_backend: dict[str, int] = defaultdict(int)
    for o in outcomes:
        per_backend[o.cell.backend] += 1
    result = MatrixResult(seed, outcomes, sum(o.seconds for o in outcomes))
    for line in summarize(result, sorted(per_backend), f"seed {seed}").splitlines():
        terminalreporter.write_line(line)


@pytest.fixture
def botmesh_harness(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A fresh harness of the first selected backend (default ``memory``)."""
    from .backends import resolve

    names = _selected(request.config) or list(request.config.getini("botmesh_backend")) or ["memory"]
    harness = resolve(names[0])(str(tmp_path))
    yield harness
    asyncio.run(harness.close())


@pytest.fixture
def botmesh_world(botmesh_harness: Any) -> Any:
    """``botmesh_world(setup=..., **options)`` -> a World on ``botmesh_harness``."""
    from .world import World

    def make(**kwargs: Any) -> World:
        return World(botmesh_harness, **kwargs)

    return make
