"""Recovery coverage per crash point (TEST-4 reports): which lines of the engine's
recovery code a crash-matrix cell runs after its restart."""

from __future__ import annotations

import inspect
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

import coverage
import pytest

from botmesh.core import engine
from botmesh_testkit.matrix import coverage as rc
from botmesh_testkit.matrix import Cell, Oracle, Outcome, oracle, run_cell, run_matrix

pytest_plugins = ["pytester"]

spec = pytest.mark.spec


@pytest.fixture
def untraced() -> None:
    if rc.tracer_active():  # e.g. the suite itself runs under pytest-cov
        pytest.skip(rc.NOTE_TRACER_ACTIVE)


def _line_of(function: str, needle: str) -> int:
    """The statement line of ``function`` whose source contains ``needle``."""
    f = rc.RECOVERY_CODE[function]
    source, first = inspect.getsourcelines(getattr(engine.DurabilityRuntime, function))
    hits = [first + i for i, text in enumerate(source) if needle in text]
    assert len(hits) == 1, (function, needle, hits)
    line = max(n for n in f.lines if n <= hits[0])  # a statement over several lines counts as its first
    return line


async def _truth(workload: str) -> Oracle:
    with tempfile.TemporaryDirectory() as tmp:
        return await oracle("memory", workload, 0, tmp)


async def _cell(cell: Cell, truth: Oracle, *, measure_recovery: bool = True) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        outcome = await run_cell(cell, 0, truth, tmp, measure_recovery=measure_recovery)
    assert outcome.crashed and outcome.passed, outcome.report(0)
    return outcome


def test_recovery_code_follows_the_engine_source() -> None:
    """Each recovery function's range and lines, checked against the engine file's text
    read here line by line (not with the module's own inspect/AST formula): the range
    starts at its ``def`` line and ends where the next definition of the class begins; its
    statement lines are body lines, neither blank, nor comments, nor the docstring."""
    assert list(rc.RECOVERY_CODE) == [name for name, _ in rc.RECOVERY_FUNCTIONS]
    text = Path(rc.ENGINE_FILE).read_text(encoding="utf-8").splitlines()
    for f in rc.RECOVERY_CODE.values():
        defs = [i + 1 for i, line in enumerate(text) if re.match(rf"\s+(async )?def {f.name}\(", line)]
        assert defs == [f.first], (f.name, defs)
        indent = len(text[f.first - 1]) - len(text[f.first - 1].lstrip())
        after = next((i + 1 for i in range(f.first, len(text)) if text[i].strip()
                      and len(text[i]) - len(text[i].lstrip()) <= indent), len(text) + 1)
        assert f.last == max(i for i in range(f.first, after) if text[i - 1].strip()), f.name
        assert f.lines and all(f.first < n <= f.last for n in f.lines), f.name
        for n in f.lines:
            line = text[n - 1].strip()
            assert line and not line.startswith(("#", '"""')), (f.name, n, line)
        assert rc.function_of(min(f.lines)) == f.name
    assert rc.ENGINE_FILE == os.path.realpath(engine.__file__)
    # a tracer reports every line of a statement over several lines: counted as its first
    claim = rc.RECOVERY_CODE["_claim_inbound"]
    (stmt,) = claim.lines
    assert rc.recovery_lines([stmt + 1, stmt + 2]) == {stmt}
    assert rc.recovery_lines([claim.first, 1, 10_000]) == frozenset()  # def line, outside


@spec("TEST-4", "OUT-14", "GUAR-3")
async def test_an_ambiguous_send_exercises_the_ambiguity_resolution(untraced: None) -> None:
    truth = await _truth("one-send")
    mark_unknown = _line_of("_ambiguous", "outbox_mark_unknown")
    resend = _line_of("_ambiguous", 'on_ambiguous == "resend"') + 1
    ambiguous = rc.RECOVERY_CODE["_ambiguous"].lines

    skip = await _cell(Cell("memory", "one-send", "skip", "after", "provider.send", 1), truth)
    assert skip.recovery_note is None and skip.recovery_lines is not None
    assert mark_unknown in skip.recovery_lines and resend not in skip.recovery_lines
    assert skip.ambiguous  # the checker saw the event the measured lines emitted

    again = await _cell(Cell("memory", "one-send", "resend", "after", "provider.send", 1), truth)
    assert again.recovery_lines is not None
    assert resend in again.recovery_lines and mark_unknown not in again.recovery_lines

    # the send settled before the crash: replayed from the outbox, nothing ambiguous
    settled = await _cell(Cell("memory", "one-send", "skip", "before", "inbox.complete", 1), truth)
    assert settled.recovery_lines is not None and not settled.recovery_lines & ambiguous
    assert settled.recovery_lines & rc.RECOVERY_CODE["sweep"].lines
    assert settled.recovery_lines & rc.RECOVERY_CODE["_drive_existing"].lines

    journaled = await _cell(Cell("memory", "one-send", "skip", "after", "inbox.journal", 1), truth)
    assert journaled.recovery_lines is not None and not journaled.recovery_lines & ambiguous
    assert _line_of("_replay_due", "self._count(\"inbound_replayed\")") in journaled.recovery_lines


@spec("TEST-4")
async def test_no_measurement_by_default() -> None:
    truth = await _truth("one-send")
    outcome = await _cell(Cell("memory", "one-send", "skip", "after", "provider.send", 1), truth,
                          measure_recovery=False)
    assert outcome.recovery_lines is None and outcome.recovery_note is None


@spec("TEST-4")
async def test_the_aggregate_per_crash_point_and_per_function(untraced: None) -> None:
    result = await run_matrix(["memory"], ["one-send", "three-sends"], policies=["skip"], random_per_workload=3,
                              seed=5, measure_recovery=True)
    assert not result.failed
    assert all(o.recovery_lines is not None for o in result.outcomes)
    agg = rc.RecoveryCoverage.from_outcomes(result.outcomes)
    assert agg.cells + agg.no_crash == len(result.outcomes) and agg.unmeasured == 0
    assert "after provider.send" in agg.points and "before inbox.complete" in agg.points
    assert agg.points["after provider.send"].lines & rc.RECOVERY_CODE["_ambiguous"].lines
    assert not agg.points["before inbox.complete"].lines & rc.RECOVERY_CODE["_ambiguous"].lines
    # random cells count under the point they hit
    hit_points = {rc.crash_point_of(o) for o in result.outcomes if o.cell.point == "*" and o.crashed}
    assert hit_points <= set(agg.points)
    assert "*" not in " ".join(agg.points)

    funcs = agg.functions()
    assert [f.name for f in funcs] == list(rc.RECOVERY_CODE)
    assert all(0.0 <= f.percent <= 100.0 and 0 <= f.hit <= f.total for f in funcs)
    assert 0.0 < agg.percent < 100.0
    never = agg.never_reached()
    assert never
    for name, where in never:
        f = rc.RECOVERY_CODE[name]
        span = where.removeprefix("engine.py:")
        lo, _, hi = span.partition("-")
        lo_n, hi_n = int(lo), int(hi or lo)
        assert f.first < lo_n <= hi_n <= f.last
        assert lo_n in f.lines and hi_n in f.lines
        assert not {n for n in f.lines if lo_n <= n <= hi_n} & agg.hit

    text = agg.format()
    assert "after provider.send" in text and "_ambiguous" in text and "never reached" in text
    assert never[0][1] in text
    data = agg.to_json()
    assert data["hit_lines"] == len(agg.hit) and data["total_lines"] == len(rc.RECOVERY_LINES)
    assert rc.RecoveryCoverage.from_json(data).format() == text
    from_records = rc.RecoveryCoverage()
    for o in result.outcomes:
        from_records.add_record(json.loads(json.dumps(rc.record_of(o))))
    assert from_records.format() == text
    by_operation = rc.RecoveryCoverage.from_outcomes(result.outcomes, moment=False)
    assert "provider.send" in by_operation.points and by_operation.hit == agg.hit
    merged = rc.RecoveryCoverage()
    merged.merge(agg)
    merged.merge(rc.RecoveryCoverage.from_json(data))
    assert merged.cells == 2 * agg.cells and merged.hit == agg.hit


def _after_the_cell() -> int:
    return 1  # a line only run once the measured cell is over


@spec("TEST-4")
async def test_another_tracer_is_left_alone() -> None:
    """Under pytest-cov (here: a Coverage started by the test) nothing is measured, a
    note says so, and the outer measurement keeps recording, during the cell and after."""
    here = os.path.realpath(__file__)
    outer = None
    if not rc.tracer_active():
        outer = coverage.Coverage(data_file=None, include=[rc.ENGINE_FILE, here], branch=False, config_file=False)
        outer.start()
    try:
        truth = await _truth("one-send")
        outcome = await _cell(Cell("memory", "one-send", "skip", "after", "provider.send", 1), truth)
        assert outcome.recovery_lines == frozenset()
        assert outcome.recovery_note == rc.NOTE_TRACER_ACTIVE
        if outer is not None:
            assert coverage.Coverage.current() is outer
        _after_the_cell()
    finally:
        if outer is not None:
            outer.stop()
    agg = rc.RecoveryCoverage.from_outcomes([outcome])
    assert agg.cells == 0 and agg.unmeasured == 1 and agg.notes == [rc.NOTE_TRACER_ACTIVE]
    assert rc.NOTE_TRACER_ACTIVE in agg.format()
    if outer is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = outer.get_data()
    lines = {os.path.realpath(p): set(data.lines(p) or ()) for p in data.measured_files()}
    assert inspect.getsourcelines(_after_the_cell)[1] + 1 in lines[here]
    # the recovery ran under the outer tracer, which recorded it
    assert _line_of("_ambiguous", "outbox_mark_unknown") in lines[rc.ENGINE_FILE]


@pytest.mark.spec("TEST-4", "OUT-14")
def test_the_plugin_prints_and_reports_recovery_coverage_per_crash_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--botmesh-backend=memory", "--botmesh-parts=matrix", "--botmesh-seed=3",
        "--botmesh-cell=memory/one-send/skip/after:provider.send#1", "--botmesh-recovery-coverage",
        "--botmesh-report=r.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*recovery coverage of engine.py (* recovery functions, * lines): * reached * by 1 cells*",
                                 "*after provider.send * 1 *_ambiguous*"])
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["backends"][0]["recovery_coverage"]["cells"] == 1
