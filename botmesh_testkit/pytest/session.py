"""The state of one botmesh run, kept in a :class:`BotmeshSession` registered with the
plugin manager (``"botmesh_session"``), never in module globals: the seed, the results
gathered from the test reports (so they are complete under pytest-xdist, whose
controller sees every report), the kill-loop summaries, recovery coverage, skip
reasons, servers that could not be provisioned; and the terminal summary built from
them."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from .options import PARTS, selected

if TYPE_CHECKING:
    from ..matrix.coverage import RecoveryCoverage

PLUGIN_NAME = "botmesh_session"


class Result(NamedTuple):
    """One botmesh item's outcome, as the summary and the report count it."""

    backend: str
    part: str
    outcome: str
    """``passed``, ``failed`` or ``skipped``."""
    spec: tuple[str, ...]
    """The requirement ids the item checks (its ``spec`` marker)."""
    violated: tuple[str, ...]
    """The ids it broke (a failing item's own, else its whole marker)."""


def part_of(nodeid: str) -> str:
    """The part an item belongs to, from its node id (``tests`` for the project's own)."""
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


def skip_reason(longrepr: Any) -> str:
    """The reason of a skipped test report (``Skipped: `` removed)."""
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ")


def _id_key(s: str) -> tuple[str, int]:
    prefix, _, num = s.partition("-")
    return prefix, int(num) if num.isdigit() else 0


def held_and_broken(rows: Iterable[Result]) -> tuple[list[str], dict[str, int]]:
    """The ids held (exercised by a non-skipped item and broken by none) and the ids
    broken (named by a failing item's violated ids) with how many items broke each —
    the rule of the terminal summary."""
    exercised: set[str] = set()
    broken: Counter[str] = Counter()
    for _, _, outcome, spec, violated in rows:
        if outcome == "skipped":
            continue
        exercised.update(spec)
        exercised.update(violated)
        broken.update(violated)
    held = sorted((i for i in exercised if not broken[i]), key=_id_key)
    return held, {i: broken[i] for i in sorted(broken, key=_id_key)}


class BotmeshSession:
    """What one run of the plugin established (see the module docstring)."""

    def __init__(self, config: pytest.Config, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.results: list[Result] = []
        self.kill_reports: list[tuple[str, list[str]]] = []
        self.recovery: dict[str, RecoveryCoverage] = {}
        self.skip_reasons: list[tuple[str, str, str]] = []
        """``(backend, part, reason)`` of each skipped item."""
        self.service_skips: dict[str, str] = {}
        """Backend -> why its server could not be provisioned."""
        self.report_path: Path | None = None
        self.report_line: str | None = None

    # -- hooks ----------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props: dict[str, Any] = dict(report.user_properties)
        backend = props.get("botmesh_backend")
        if backend is None:
            return
        if not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
            return
        outcome = report.outcome
        spec = tuple(props.get("botmesh_spec", ()))
        violated = tuple(props.get("botmesh_violated", spec if outcome == "failed" else ()))
        part = part_of(report.nodeid)
        self.results.append(Result(str(backend), part, outcome, spec, violated))
        if "botmesh_recovery" in props:
            from ..matrix.coverage import RecoveryCoverage

            self.recovery.setdefault(str(backend), RecoveryCoverage()).add_record(props["botmesh_recovery"])
        if "botmesh_kill_report" in props:
            self.kill_reports.append((str(backend), list(props["botmesh_kill_report"])))
        if outcome == "skipped":
            self.skip_reasons.append((str(backend), part, skip_reason(report.longrepr)))

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        self._summary(terminalreporter)
        if self.report_line is not None:
            terminalreporter.write_line(self.report_line, red=" NOT " in self.report_line)

    # -- the summary ----------------------------------------------------------------------
    def kill_lines(self) -> dict[str, list[str]]:
        """Backend -> the headline lines of its kill loops."""
        lines: dict[str, list[str]] = defaultdict(list)
        for backend, mine in self.kill_reports:
            lines[backend].extend(mine)
        return lines

    def _summary(self, terminalreporter: Any) -> None:
        if not selected(self.config) and not self.results:
            return
        write = terminalreporter.write_line
        terminalreporter.section("botmesh durability report")
        write(f"seed {self.seed} (rerun the same cells with --botmesh-seed={self.seed})")
        for name, reason in self.service_skips.items():
            write(f"{name}: SKIPPED — {reason.removeprefix(name + ': ')}")
        if not self.results:
            write("no botmesh items ran")
            return
        kill_lines = self.kill_lines()
        by_backend: dict[str, list[Result]] = defaultdict(list)
        for row in self.results:
            by_backend[row.backend].append(row)
        for backend in sorted(by_backend):
            rows = by_backend[backend]
            write("")
            counts = []
            for part in PARTS:
                mine = [r for r in rows if r.part == part]
                if mine:
                    passed = sum(r.outcome == "passed" for r in mine)
                    failed = sum(r.outcome == "failed" for r in mine)
                    skipped = sum(r.outcome == "skipped" for r in mine)
                    counts.append(f"{part} {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
            write(f"{backend}: " + "; ".join(counts))
            for line in kill_lines.get(backend, []):
                write(f"  {line}")
            recovery = self.recovery.get(backend)
            if recovery is not None:
                for line in recovery.format().splitlines():
                    write(f"  {line}")
            held, broken = held_and_broken(rows)
            if held:
                write(f"  held ({len(held)}): {', '.join(held)}")
            if broken:
                write(f"  BROKEN ({len(broken)}): " + ", ".join(f"{i} in {n} item(s)" for i, n in broken.items()))


def session_of(config: pytest.Config) -> BotmeshSession:
    """The run's :class:`BotmeshSession` (registered at configure time)."""
    found = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if not isinstance(found, BotmeshSession):
        raise RuntimeError("the botmesh plugin is not configured in this session")
    return found
