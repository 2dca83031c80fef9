"""The crash matrix's plain data (TEST-4): a :class:`Cell` and how cells are drawn from
a dry run (:func:`draw_cells`, the one function every entry point uses), the
:class:`Oracle` of a crash-free run, the :class:`Outcome` of a cell. Nothing here runs a
bot."""

from __future__ import annotations

import random
import shlex
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from botmesh.core.config import ON_AMBIGUOUS

from ..checker.violation import Violation

POLICIES = ON_AMBIGUOUS
"""The ``on_ambiguous`` policies a matrix runs under."""


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: (backend, workload, ``on_ambiguous`` policy, crash point).
    ``point`` is a crash point (:mod:`botmesh_testkit.crash.points`) with ``nth`` its
    occurrence, or ``"*"`` with ``nth`` the n-th crash point passed (a random cell);
    ``when`` is ``"before"`` or ``"after"`` it."""

    backend: str
    workload: str
    policy: str
    when: str
    point: str
    nth: int

    @property
    def id(self) -> str:
        return f"{self.backend}/{self.workload}/{self.policy}/{self.when}:{self.point}#{self.nth}"

    def command(self, seed: int) -> str:
        return f"botmesh-testkit run --backend {shlex.quote(self.backend)} --seed {seed} --cell {shlex.quote(self.id)}"

    @staticmethod
    def parse(text: str) -> Cell:
        try:
            backend, workload, policy, rest = text.split("/", 3)
            when, point_nth = rest.split(":", 1)
            point, nth = point_nth.rsplit("#", 1)
            cell = Cell(backend, workload, policy, when, point, int(nth))
        except ValueError:
            raise ValueError(f"--cell {text!r}: expected BACKEND/WORKLOAD/POLICY/WHEN:POINT#N") from None
        from .workloads import WORKLOADS

        if workload not in WORKLOADS or policy not in POLICIES or when not in ("before", "after"):
            raise ValueError(f"--cell {text!r}: unknown workload, policy or moment")
        return cell


@dataclass
class Outcome:
    """What running one cell gave: whether and where the crash fired, the guarantees it
    broke (``violations``; none: the cell passed), the crash points passed, what the
    channel received, the keys the engine called ambiguous, the real time it took."""

    cell: Cell
    crashed: bool
    crash_point: str | None
    violations: list[Violation] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    deliveries: list[tuple[str, str]] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)
    seconds: float = 0.0
    recovery_lines: frozenset[int] | None = None
    """With ``measure_recovery``: the lines of the engine's recovery code that ran from
    the restart to the end of the drain (:mod:`botmesh_testkit.matrix.coverage`); empty
    when the crash did not fire. None when not measured."""
    recovery_note: str | None = None
    """Why ``recovery_lines`` is empty although measured (another tracer was active)."""
    power_cut_states: int | None = None
    """Power-cut crash states recovered from beside the ordinary recovery
    (:mod:`botmesh_testkit.matrix.powercut_states`); None when the cell has none to check
    (no crash, a backend not doing its file I/O through ``botmesh.core.fileio``, or one
    that does not claim ``survives_crash``)."""
    power_cut_window: int = 0
    """Distinct crash states the unsynced window at the crash allowed (the one on disk
    included); ``power_cut_states`` of them, at most the cap, were recovered."""
    power_cut_failed: int = 0
    """Of the power-cut states recovered, those that broke a guarantee."""

    @property
    def passed(self) -> bool:
        return not self.violations

    def report(self, seed: int) -> str:
        lines = [f"cell {self.cell.id}: {'passed' if self.passed else 'FAILED'}"]
        for v in self.violations:
            lines.append(f"  violated {v}")
        lines.append(f"  crash: {self.crash_point or 'did not fire'}")
        lines.append(f"  crash points passed: {compress(self.history) or '(none)'}")
        lines.append(f"  delivered: {self.deliveries}")
        if self.power_cut_states is not None:
            lines.append(f"  power-cut states recovered: {self.power_cut_states} (of {self.power_cut_window} distinct crash "
                         f"states of the unsynced window, the one on disk included), {self.power_cut_failed} broke a "
                         "guarantee")
        if self.ambiguous:
            lines.append(f"  ambiguous keys: {self.ambiguous}")
        lines.append(f"  reproduce: {self.cell.command(seed)}")
        return "\n".join(lines)


def compress(history: list[str]) -> str:
    """``a > b > b > b`` -> ``a > b x3``: a readable minimal history."""
    parts: list[str] = []
    i = 0
    while i < len(history):
        j = i
        while j + 1 < len(history) and history[j + 1] == history[i]:
            j += 1
        parts.append(history[i] + (f" x{j - i + 1}" if j > i else ""))
        i = j + 1
    return " > ".join(parts)


@dataclass
class Oracle:
    """What a crash-free run of a workload established: what the channel received, the
    final state of each inbound record, how many sends ended in the DLQ, the crash points
    passed in order and the ``(point, occurrence)`` whose call raised (no "after")."""

    deliveries: list[tuple[str, str]]
    inbox_states: dict[str, str]
    outbox_dead: int
    history: list[str]
    raised: set[tuple[str, int]]


def cells_for(
    backend: str, workload: str, history: list[str], policies: Iterable[str] = POLICIES,
    raised: set[tuple[str, int]] | None = None,
) -> list[Cell]:
    """Every (point, occurrence) the dry run passed, before and after (after only when
    the call returned: a call that raised has no "after"), per policy."""
    raised = raised or set()
    seen: Counter[str] = Counter()
    points: list[tuple[str, int]] = []
    for op in history:
        seen[op] += 1
        points.append((op, seen[op]))
    return [
        Cell(backend, workload, policy, when, op, nth)
        for policy in policies
        for op, nth in points
        for when in ("before", "after")
        if when == "before" or (op, nth) not in raised
    ]


def random_cells(backend: str, workload: str, history: list[str], count: int, rng: random.Random) -> list[Cell]:
    """``count`` distinct cells crashing at the n-th point passed, n, the moment and the
    policy drawn from ``rng`` (a draw equal to an earlier one is drawn again, so item ids
    stay unique; fewer when the history has fewer distinct cells)."""
    if not history:
        return []
    room = len(POLICIES) * 2 * len(history)
    cells: list[Cell] = []
    while len(cells) < min(count, room):
        cell = Cell(backend, workload, rng.choice(POLICIES), rng.choice(("before", "after")), "*",
                    rng.randint(1, len(history)))
        if cell not in cells:
            cells.append(cell)
    return cells


def cell_rng(seed: int, backend: str, workload: str) -> random.Random:
    """The one source of a workload's random cells: seeded by the run's seed, the backend
    and the workload only, so the same seed draws the same cells whichever entry point
    (pytest, the CLI, :func:`~botmesh_testkit.matrix.run.run_matrix`, a benchmark) and
    whichever other backends or workloads are selected."""
    return random.Random(f"{seed}/{backend}/{workload}")


def draw_cells(backend: str, workload: str, truth: Oracle, policies: Iterable[str], random_count: int,
               seed: int) -> list[Cell]:
    """THE cell-drawing function: every named cell of the workload's dry run
    (:func:`cells_for`), then ``random_count`` random cells (:func:`random_cells` from
    :func:`cell_rng`)."""
    cells = cells_for(backend, workload, truth.history, policies, truth.raised)
    return cells + random_cells(backend, workload, truth.history, random_count, cell_rng(seed, backend, workload))


@dataclass
class MatrixResult:
    """The outcomes of :func:`~botmesh_testkit.matrix.run.run_matrix`, with its seed and
    real time."""

    seed: int
    outcomes: list[Outcome]
    seconds: float

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.passed]
