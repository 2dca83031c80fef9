"""Coverage of the engine's recovery code per crash point (TEST-4 reports).

A crash-matrix cell restarts the bot after the crash and lets it recover. Run with
``run_cell(..., measure_recovery=True)``, the cell records which lines of the engine's
*recovery code* (:data:`RECOVERY_CODE`: the sweep, the claim helpers, the background
delivery, ambiguity resolution, the replayed send, part handling, the inbound retry or
dead-letter path) ran between the restart and the end of the drain.
:class:`RecoveryCoverage` aggregates the cells per crash point and tells which recovery
lines no cell reached.

Lines are statements as ``coverage`` counts them (a statement over several lines counts
as its first line); a function's ``def`` line and docstring are not part of its lines.
Measuring uses the ``coverage`` library (the ``testkit`` extra); it is imported only
when something is measured, and it is skipped, with :data:`NOTE_TRACER_ACTIVE`, when
another tracer (pytest-cov, a debugger) is already running, so that tracer keeps working.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import functools
import inspect
import os
import sys
import textwrap
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from botmesh.core import engine as _engine

if TYPE_CHECKING:
    from .cells import Outcome

ENGINE_FILE: str = os.path.realpath(inspect.getsourcefile(_engine) or _engine.__file__)
"""The measured file: ``botmesh/core/engine.py`` of the installed reference
implementation."""

ENGINE_NAME = "engine.py"

NOTE_TRACER_ACTIVE = "recovery coverage off: another tracer is active"

RECOVERY_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("sweep", "the pass after a start: finds the due inbound records (INB-3) and hands them to the replay "
              "task, delivers due sends"),
    ("_replay_due", "a due inbound record: claimed (LEASE-4 takes back a dead incarnation's lease), replayed "
                    "or dead-lettered (INB-3, INB-7)"),
    ("_claim_inbound", "inbox claim helper (recover=True takes a dead incarnation's lease)"),
    ("_claim_send", "outbox claim helper: returns the previous state, 'sending' is an ambiguous send"),
    ("_deliver", "background delivery of a due send: part order (OUT-12), split before claim (OUT-13), "
                 "ambiguity (OUT-14), retry of a failed send"),
    ("_ambiguous", "ambiguity resolution (OUT-14, GUAR-3): event, then resend or mark_unknown"),
    ("_drive_existing", "a replayed handler's send whose key is journaled: dedupe (OUT-2), finish it, "
                        "or resolve its ambiguity"),
    ("_split_claimed", "OUT-13: split a claimed over-limit record before sending it"),
    ("_journal_parts", "OUT-12: journal the later parts before the first is sent"),
    ("_inbox_failed", "an inbound record whose handling failed: retry later or dead-letter (INB-5, INB-7)"),
)
"""The recovery functions of ``DurabilityRuntime`` with why each is one. Not included:
the live send path (``_inline``, ``_attempt``, ``_next_part``), the handler runner
(``_execute``), the operator API (``replay_inbound``, ``retry_send``) and the sweep
loop driver: they run after a restart too, but are not recovery code."""


@dataclass(frozen=True)
class RecoveryFunction:
    """One recovery function: its source range in :data:`ENGINE_FILE` (``first`` is the
    ``def`` or first decorator line, ``last`` its last line) and its statement lines."""

    name: str
    first: int
    last: int
    lines: frozenset[int]
    why: str

    @property
    def qualname(self) -> str:
        return f"DurabilityRuntime.{self.name}"


def _statements() -> frozenset[int]:
    """The statement lines of the engine file, as ``coverage`` counts them."""
    import coverage

    cov = _new_coverage(coverage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, statements, _, _, _ = cov.analysis2(ENGINE_FILE)
    return frozenset(statements)


def _new_coverage(coverage: Any) -> Any:
    cov = coverage.Coverage(data_file=None, include=[ENGINE_FILE], branch=False, config_file=False)
    cov.set_option("run:disable_warnings", [
        "no-data-collected", "module-not-measured", "module-not-imported", "already-imported",
        "include-ignored", "couldnt-parse",
    ])
    return cov


def _recovery_code() -> dict[str, RecoveryFunction]:
    statements = _statements()
    code: dict[str, RecoveryFunction] = {}
    for name, why in RECOVERY_FUNCTIONS:
        fn = getattr(_engine.DurabilityRuntime, name, None)
        if fn is None:
            raise AttributeError(f"recovery_coverage: DurabilityRuntime.{name} is gone from {ENGINE_FILE}; "
                                 "update RECOVERY_FUNCTIONS")
        fn = inspect.unwrap(fn)
        source, first = inspect.getsourcelines(fn)
        last = first + len(source) - 1
        tree = ast.parse(textwrap.dedent("".join(source)))
        node = tree.body[0]
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str) and len(body) > 1:
            body = body[1:]  # the docstring
        body_first = first + body[0].lineno - 1
        lines = frozenset(n for n in statements if body_first <= n <= last)
        code[name] = RecoveryFunction(name, first, last, lines, why)
    return code


@functools.cache
def recovery_code() -> Mapping[str, RecoveryFunction]:
    """name -> :class:`RecoveryFunction`, in :data:`RECOVERY_FUNCTIONS` order; computed
    from the engine's source on first use (not at import: that needs a coverage
    analysis), so it follows the file when it changes. Also as the module attribute
    ``RECOVERY_CODE``."""
    return MappingProxyType(_recovery_code())


@functools.cache
def all_recovery_lines() -> frozenset[int]:
    """Every statement line of :func:`recovery_code` (also ``RECOVERY_LINES``)."""
    return frozenset().union(*(f.lines for f in recovery_code().values()))


@functools.cache
def _bodies() -> list[tuple[int, int, list[int]]]:
    return sorted((min(f.lines), f.last, sorted(f.lines)) for f in recovery_code().values() if f.lines)


def __getattr__(name: str) -> Any:
    # RECOVERY_CODE / RECOVERY_LINES stay readable as constants, computed on first use
    if name == "RECOVERY_CODE":
        return recovery_code()
    if name == "RECOVERY_LINES":
        return all_recovery_lines()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def function_of(line: int) -> str | None:
    """The recovery function a line of :data:`ENGINE_FILE` belongs to, if any."""
    for f in recovery_code().values():
        if f.first <= line <= f.last:
            return f.name
    return None


def recovery_lines(raw: Iterable[int]) -> frozenset[int]:
    """Lines reported by a tracer (any line of a statement over several lines) ->
    :data:`RECOVERY_CODE` statement lines (each statement's first line)."""
    hit: set[int] = set()
    for n in raw:
        for lo, hi, stmts in _bodies():
            if lo <= n <= hi:
                hit.add(stmts[bisect.bisect_right(stmts, n) - 1])
                break
    return frozenset(hit)


# -- measuring ----------------------------------------------------------------------------
def tracer_active() -> bool:
    """True when another tracer runs in this thread: a ``coverage`` measurement
    (pytest-cov ...), a ``sys.settrace`` tracer (a debugger), or a ``sys.monitoring``
    coverage tool. :func:`measure` then measures nothing."""
    if sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None and monitoring.get_tool(monitoring.COVERAGE_ID) is not None:
        return True
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    return current is not None and current() is not None


@dataclass
class Measurement:
    """What :func:`measure` yields. ``lines`` (the :data:`RECOVERY_CODE` lines that
    ran) is filled when the block exits; ``note`` says why nothing was measured."""

    lines: frozenset[int] = frozenset()
    note: str | None = None

    @property
    def measured(self) -> bool:
        return self.note is None


@contextlib.contextmanager
def measure() -> Iterator[Measurement]:
    """Record the :data:`RECOVERY_CODE` lines executed while the block runs (in this
    thread, and in threads started inside it)::

        with measure() as m:
            await world.restart()
            await world.drain()
        m.lines  # frozenset of engine.py line numbers; m.note is None

    When another tracer is active, nothing is started: ``m.lines`` stays empty and
    ``m.note`` is :data:`NOTE_TRACER_ACTIVE`. Inside an item that ``--botmesh-coverage``
    measures (:mod:`.coverage_file`), the block is that cell's recovery context, and its
    lines are read from that measurement.
    """
    result = Measurement()
    from .coverage_file import active

    data_file = active()
    if data_file is not None:  # --botmesh-coverage measures this cell: its recovery context is the measurement
        with data_file.recovery():
            yield result
        assert data_file.label is not None
        result.lines = recovery_lines(data_file.lines(data_file.label, ENGINE_FILE))
        return
    if tracer_active():
        result.note = NOTE_TRACER_ACTIVE
        yield result
        return
    import coverage

    cov = _new_coverage(coverage)
    cov.start()
    try:
        yield result
    finally:
        cov.stop()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = cov.get_data()
        raw: set[int] = set()
        for path in data.measured_files():
            if os.path.realpath(path) == ENGINE_FILE:
                raw.update(data.lines(path) or ())
        result.lines = recovery_lines(raw)


# -- aggregating --------------------------------------------------------------------------
def crash_point_of(outcome: Outcome, *, moment: bool = True) -> str | None:
    """The crash point a cell hit: ``"after provider.send"`` (``"provider.send"`` with
    ``moment=False``), from ``Outcome.crash_point`` (so a random cell counts under the
    point it actually hit), else from the cell. None when the crash did not fire."""
    if not outcome.crashed:
        return None
    text = outcome.crash_point or f"{outcome.cell.when} {outcome.cell.point}"
    when, _, op = text.partition(" ")
    op = op.rsplit(" #", 1)[0]
    return f"{when} {op}" if moment else op


def record_of(outcome: Outcome) -> dict[str, Any]:
    """A JSON-serializable summary of one measured cell, for
    :meth:`RecoveryCoverage.add_record`: ``{"point": "after provider.send" | None,
    "lines": [...] | None, "note": str | None}``."""
    lines = outcome.recovery_lines
    return {"point": crash_point_of(outcome), "lines": None if lines is None else sorted(lines),
            "note": outcome.recovery_note}


def _ranges(missing: Iterable[int], statements: Iterable[int]) -> list[tuple[int, int]]:
    """Missing statements -> (first, last) runs, merged over statements (not lines)."""
    order = sorted(statements)
    missing = set(missing)
    runs: list[tuple[int, int]] = []
    start = prev = None
    for n in order:
        if n in missing:
            if start is None:
                start = n
            prev = n
        elif start is not None:
            runs.append((start, prev))  # type: ignore[arg-type]
            start = None
    if start is not None:
        runs.append((start, prev))  # type: ignore[arg-type]
    return runs


def _where(lo: int, hi: int) -> str:
    return f"{ENGINE_NAME}:{lo}" if lo == hi else f"{ENGINE_NAME}:{lo}-{hi}"


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


@dataclass
class PointCoverage:
    """The cells that crashed at one point and the union of the recovery lines they ran."""

    point: str
    cells: int = 0
    lines: set[int] = field(default_factory=set)

    def functions(self) -> dict[str, int]:
        """name -> lines of it this point's cells ran, for the functions they ran."""
        out = {}
        for f in recovery_code().values():
            n = len(self.lines & f.lines)
            if n:
                out[f.name] = n
        return out


@dataclass(frozen=True)
class FunctionCoverage:
    name: str
    first: int
    last: int
    total: int
    hit: int
    never: tuple[tuple[int, int], ...]
    """Runs of statements no cell ran, ``(first line, last line)``."""

    @property
    def percent(self) -> float:
        return _pct(self.hit, self.total)


class RecoveryCoverage:
    """Recovery coverage of a set of cells, per crash point and per function.

    ``add(outcome)`` takes an :class:`~botmesh_testkit.matrix.Outcome` run with
    ``measure_recovery=True`` (others are counted as not measured); ``add_lines`` is the
    same from plain values (an xdist worker's report). ``moment=False`` groups the
    points by operation only (``provider.send`` instead of ``after provider.send``).
    """

    def __init__(self, *, moment: bool = True) -> None:
        self.moment = moment
        self.points: dict[str, PointCoverage] = {}
        self.no_crash = 0
        """Cells whose crash did not fire: no restart, nothing to measure."""
        self.unmeasured = 0
        """Cells that crashed but were not measured (measure off, another tracer)."""
        self.notes: list[str] = []

    @classmethod
    def from_outcomes(cls, outcomes: Iterable[Outcome], *, moment: bool = True) -> RecoveryCoverage:
        agg = cls(moment=moment)
        for o in outcomes:
            agg.add(o)
        return agg

    def add(self, outcome: Outcome) -> None:
        self.add_lines(crash_point_of(outcome, moment=self.moment), outcome.recovery_lines,
                       note=outcome.recovery_note)

    def add_record(self, record: Mapping[str, Any]) -> None:
        """A cell as :func:`record_of` wrote it (e.g. carried from an xdist worker in a
        test report's ``user_properties``)."""
        point = record.get("point")
        if point is not None and not self.moment:
            point = point.partition(" ")[2] or point
        self.add_lines(point, record.get("lines"), note=record.get("note"))

    def add_lines(self, point: str | None, lines: Iterable[int] | None, *, note: str | None = None) -> None:
        """One cell: it crashed at ``point`` (``"after provider.send"``; None: the crash
        did not fire) and its recovery ran ``lines`` (None, or a ``note``: not
        measured)."""
        if point is None:
            self.no_crash += 1
            return
        if lines is None or note is not None:
            self.unmeasured += 1
            if note is not None and note not in self.notes:
                self.notes.append(note)
            return
        pc = self.points.setdefault(point, PointCoverage(point))
        pc.cells += 1
        pc.lines.update(n for n in lines if n in all_recovery_lines())

    def merge(self, other: RecoveryCoverage) -> None:
        for point, pc in other.points.items():
            mine = self.points.setdefault(point, PointCoverage(point))
            mine.cells += pc.cells
            mine.lines |= pc.lines
        self.no_crash += other.no_crash
        self.unmeasured += other.unmeasured
        self.notes += [n for n in other.notes if n not in self.notes]

    # -- figures ----------------------------------------------------------------------------
    @property
    def cells(self) -> int:
        """Cells measured (crashed and measured)."""
        return sum(pc.cells for pc in self.points.values())

    @property
    def hit(self) -> frozenset[int]:
        """Recovery lines run by at least one cell."""
        return frozenset().union(*(pc.lines for pc in self.points.values()))

    @property
    def total(self) -> int:
        return len(all_recovery_lines())

    @property
    def percent(self) -> float:
        return _pct(len(self.hit), self.total)

    def functions(self) -> list[FunctionCoverage]:
        hit = self.hit
        return [
            FunctionCoverage(f.name, f.first, f.last, len(f.lines), len(f.lines & hit),
                             tuple(_ranges(f.lines - hit, f.lines)))
            for f in recovery_code().values()
        ]

    def never_reached(self) -> list[tuple[str, str]]:
        """``(function, "engine.py:LO-HI")`` for every run of recovery statements no
        cell ran, in file order."""
        out = [(f.name, lo, hi) for f in self.functions() for lo, hi in f.never]
        return [(name, _where(lo, hi)) for name, lo, hi in sorted(out, key=lambda t: t[1])]

    # -- output -----------------------------------------------------------------------------
    def format(self) -> str:
        lines = [
            f"recovery coverage of {ENGINE_NAME} ({len(recovery_code())} recovery functions, {self.total} lines): "
            f"{len(self.hit)}/{self.total} lines reached ({self.percent}%) by {self.cells} cells",
        ]
        extra = []
        if self.no_crash:
            extra.append(f"{self.no_crash} cell(s) did not crash")
        if self.unmeasured:
            extra.append(f"{self.unmeasured} crashed cell(s) not measured")
        if extra:
            lines.append("  (" + "; ".join(extra) + ")")
        lines += [f"  {note}" for note in self.notes]
        if not self.points:
            return "\n".join(lines)
        width = max(len("crash point"), *(len(p) for p in self.points))
        lines.append("")
        lines.append(f"{'crash point':<{width}}  cells  lines  recovery  functions exercised (lines)")
        for point in sorted(self.points):
            pc = self.points[point]
            funcs = ", ".join(f"{name} {n}" for name, n in pc.functions().items())
            lines.append(f"{point:<{width}}  {pc.cells:>5}  {len(pc.lines):>5}  {_pct(len(pc.lines), self.total):>7.1f}%"
                         f"  {funcs or '-'}")
        func_cov = self.functions()
        fw = max(len("function"), *(len(f.name) for f in func_cov))
        lines.append("")
        lines.append(f"{'function':<{fw}}  {'source':<{len(ENGINE_NAME) + 8}}  reached")
        for f in func_cov:
            src = f"{ENGINE_NAME}:{f.first}-{f.last}"
            lines.append(f"{f.name:<{fw}}  {src:<{len(ENGINE_NAME) + 8}}  {f.hit:>3}/{f.total:<3} {f.percent:>5.1f}%")
        never = self.never_reached()
        lines.append("")
        if never:
            lines.append("never reached by any cell:")
            lines += [f"  {where:<20} {name}" for name, where in never]
        else:
            lines.append("every recovery line was reached by some cell")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        funcs = self.functions()
        return {
            "file": ENGINE_FILE,
            "cells": self.cells,
            "no_crash": self.no_crash,
            "unmeasured": self.unmeasured,
            "notes": list(self.notes),
            "total_lines": self.total,
            "hit_lines": len(self.hit),
            "percent": self.percent,
            "points": [
                {"point": p, "cells": pc.cells, "hit_lines": len(pc.lines), "percent": _pct(len(pc.lines), self.total),
                 "functions": pc.functions(), "lines": sorted(pc.lines)}
                for p, pc in sorted(self.points.items())
            ],
            "functions": [
                {"name": f.name, "first": f.first, "last": f.last, "total_lines": f.total, "hit_lines": f.hit,
                 "percent": f.percent, "never": [_where(lo, hi) for lo, hi in f.never]}
                for f in funcs
            ],
            "never_reached": [{"function": name, "lines": where} for name, where in self.never_reached()],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, moment: bool = True) -> RecoveryCoverage:
        """The inverse of :meth:`to_json` (to merge the reports of xdist workers)."""
        agg = cls(moment=moment)
        for p in data.get("points", ()):
            agg.points[p["point"]] = PointCoverage(p["point"], int(p["cells"]), set(p["lines"]) & all_recovery_lines())
        agg.no_crash = int(data.get("no_crash", 0))
        agg.unmeasured = int(data.get("unmeasured", 0))
        agg.notes = list(data.get("notes", ()))
        return agg
