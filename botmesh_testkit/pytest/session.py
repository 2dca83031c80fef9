"""The state of one botmesh run, kept in a :class:`BotmeshSession` registered with the
plugin manager (``"botmesh_session"``), never in module globals: the seed, the results
gathered from the test reports (so they are complete under pytest-xdist, whose
controller sees every report), the kill-loop summaries, recovery coverage, skip
reasons, servers that could not be provisioned; and the terminal summary built from
them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..requirements import title
from .options import PARTS, selected
from .results import Result, held_and_broken, part_of, skip_reason

if TYPE_CHECKING:
    from ..matrix.coverage import RecoveryCoverage
    from .verdict import Verdict

PLUGIN_NAME = "botmesh_session"


class PowerCutCount:
    """The power-cut crash states of one backend's matrix cells
    (:mod:`botmesh_testkit.matrix.powercut_states`): cells that had them checked, states
    recovered, states that broke a guarantee."""

    def __init__(self) -> None:
        self.cells = 0
        self.states = 0
        self.failed = 0

    def add(self, states: int, failed: int) -> None:
        self.cells += 1
        self.states += states
        self.failed += failed

    def line(self) -> str:
        from ..matrix.powercut_states import MAX_STATES_PER_CELL

        return (f"matrix power-cut states: {self.states} recovered in {self.cells} crashed cells, besides each cell's own "
                f"recovery (at most {MAX_STATES_PER_CELL} a cell); {self.failed} broke a guarantee")

    def to_json(self) -> dict[str, int]:
        return {"cells": self.cells, "states": self.states, "failed": self.failed}


class BotmeshSession:
    """What one run of the plugin established (see the module docstring)."""

    def __init__(self, config: pytest.Config, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.results: list[Result] = []
        self.failures: list[dict[str, Any]] = []
        """Every failed item: backend, part, item (node id), outcome, violated ids, message, reproduce."""
        self.kill_reports: list[tuple[str, str, list[str]]] = []
        self.cells: list[tuple[str, dict[str, Any]]] = []
        """``(backend, record)`` of each crash-matrix item run: its coordinates, outcome,
        reproduce command and what running it gave (the report's grid)."""
        self.recovery: dict[str, RecoveryCoverage] = {}
        self.power_cut_states: dict[str, PowerCutCount] = {}
        """Backend -> the power-cut crash states its matrix cells recovered from."""
        self.skip_reasons: list[tuple[str, str, str]] = []
        """``(backend, part, reason)`` of each skipped item."""
        self.service_skips: dict[str, str] = {}
        """Backend -> why its server could not be provisioned."""
        self.report_path: Path | None = None
        self.report_line: str | None = None
        self._probed: dict[str, tuple[dict[str, bool] | None, str | None, dict[str, str]]] = {}

    def probe(self, name: str) -> tuple[dict[str, bool] | None, str | None, dict[str, str]]:
        """``(claims, error, versions)`` of a backend, opened once per run (on the
        controller: under xdist the workers' probes do not reach it)."""
        if name not in self._probed:
            from .probe import backend_versions, probe_backend

            if name in self.service_skips:
                self._probed[name] = (None, self.service_skips[name], backend_versions(name))
            else:
                self._probed[name] = probe_backend(name)
        return self._probed[name]

    def why_not_run(self) -> dict[str, str]:
        """Why a part may have no item in this run (for the verdict)."""
        from ..matrix.profiles import load_profile
        from .options import matrix_name, parts

        why = {part: "not selected with --botmesh-parts" for part in PARTS if part not in parts(self.config)}
        try:
            profile = load_profile(matrix_name(self.config))
            if not profile.explore_examples:
                why.setdefault("explore", f"profile {profile.name!r} explores no stories (explore_examples = 0)")
            if not profile.kills:
                why.setdefault("kills", f"profile {profile.name!r} has no kill loops (kills = 0)")
            if not profile.power_cuts and not profile.held_ops and not profile.io_errors:
                why.setdefault("powercuts", f"profile {profile.name!r} has no power cuts (power_cuts = 0), "
                                            "no held-operation sweep (held_ops = 0) and no I/O-error loop")
            if not profile.corruption_variants:
                why.setdefault("corruption", f"profile {profile.name!r} damages no files (corruption_variants = 0)")
        except ValueError:
            pass
        if self.config.getoption("--botmesh-cell"):
            for part in PARTS:
                why.setdefault(part, "only one cell was run (--botmesh-cell)")
        return why

    def verdict(self, name: str, exitstatus: int | None) -> Verdict:
        """The verdict on backend ``name`` (see :mod:`.verdict`)."""
        from ..matrix.profiles import load_profile
        from .options import matrix_name
        from .verdict import judge

        interrupted = None
        if exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
            interrupted = f"the run did not complete (exit status {int(exitstatus or 0)})"
        try:
            profile = load_profile(matrix_name(self.config)).name
        except ValueError:
            profile = matrix_name(self.config)
        from .corruption import files_in_workdir
        from .items import powercuts_apply

        claims, _, _ = self.probe(name)
        return judge([r for r in self.results if r.backend == name], claims, profile=profile,
                     service_skip=self.service_skips.get(name), interrupted=interrupted,
                     why_not_run=self.why_not_run(), storage_in_workdir=powercuts_apply(name),
                     files_in_workdir=files_in_workdir(name))

    # -- hooks ----------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props: dict[str, Any] = dict(report.user_properties)
        backend = props.get("botmesh_backend")
        if backend is None:
            return
        if not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
            return
        outcome: str = report.outcome
        if outcome == "failed" and "botmesh_scenario_error" in props:
            outcome = "error"  # a mistake of the scenario: no requirement broken, nothing held
        spec = tuple(props.get("botmesh_spec", ()))
        violated = tuple(props.get("botmesh_violated", spec if outcome == "failed" else ()))
        part = part_of(report.nodeid)
        why = skip_reason(report.longrepr) if outcome == "skipped" else ""
        self.results.append(Result(str(backend), part, outcome, spec, violated, why))
        if outcome in ("failed", "error"):
            self.failures.append({
                "backend": str(backend), "part": part, "item": report.nodeid, "outcome": outcome,
                "spec": list(spec), "violated": list(violated), "message": failure_message(report),
                "reproduce": props.get("botmesh_reproduce"),
            })
        record = getattr(report, "botmesh_cell", None)  # a matrix item's (set by the plugin; crosses xdist)
        if isinstance(record, dict):
            cell: dict[str, Any] = {**record, "outcome": outcome}
            if props.get("botmesh_reproduce"):
                cell["reproduce"] = props["botmesh_reproduce"]
            self.cells.append((str(backend), cell))
        if "botmesh_recovery" in props:
            from ..matrix.coverage import RecoveryCoverage

            self.recovery.setdefault(str(backend), RecoveryCoverage()).add_record(props["botmesh_recovery"])
        if "botmesh_powercut_states" in props:
            states, failed = props["botmesh_powercut_states"]
            self.power_cut_states.setdefault(str(backend), PowerCutCount()).add(int(states), int(failed))
        if "botmesh_kill_report" in props:
            self.kill_reports.append((str(backend), part, list(props["botmesh_kill_report"])))
        if outcome == "skipped":
            self.skip_reasons.append((str(backend), part, why))

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        self._summary(terminalreporter, exitstatus)
        if self.report_line is not None:
            terminalreporter.write_line(self.report_line, red=" NOT " in self.report_line)

    # -- the summary ----------------------------------------------------------------------
    def kill_lines(self, parts: tuple[str, ...] = ("kills", "powercuts")) -> dict[str, list[str]]:
        """Backend -> the headline lines of its loops in ``parts`` (the kill and power-cut
        loops by default; ``("explore",)`` for the explore runs)."""
        lines: dict[str, list[str]] = defaultdict(list)
        for backend, part, mine in self.kill_reports:
            if part in parts:
                lines[backend].extend(mine)
        return lines

    def _summary(self, terminalreporter: Any, exitstatus: int) -> None:
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
        kill_lines = self.kill_lines(PARTS)
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
                    errors = sum(r.outcome == "error" for r in mine)
                    counts.append(f"{part} {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
                                  + (f", {errors} scenario error(s)" if errors else ""))
            write(f"{backend}: " + "; ".join(counts))
            for line in kill_lines.get(backend, []):
                write(f"  {line}")
            cuts = self.power_cut_states.get(backend)
            if cuts is not None:
                write(f"  {cuts.line()}")
            recovery = self.recovery.get(backend)
            if recovery is not None:
                for line in recovery.format().splitlines():
                    write(f"  {line}")
            held, broken = held_and_broken(rows)
            if held:
                write(f"  held ({len(held)}): {', '.join(held)}")
            if broken:
                write(f"  BROKEN ({len(broken)}): " + ", ".join(f"{i} in {n} item(s)" for i, n in broken.items()))
                for rid in broken:
                    write(f"    {rid}: {title(rid)}")
            if backend in selected(self.config):
                verdict = self.verdict(backend, exitstatus)
                write(f"  verdict: {verdict.line()}", bold=True, red=verdict.status != "certified",
                      green=verdict.status == "certified")


def session_of(config: pytest.Config) -> BotmeshSession:
    """The run's :class:`BotmeshSession` (registered at configure time)."""
    found = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if not isinstance(found, BotmeshSession):
        raise RuntimeError("the botmesh plugin is not configured in this session")
    return found


def failure_message(report: pytest.TestReport, limit: int = 800) -> str:
    """What a failed item said, short: the exception's own message when pytest kept it
    (a suite test's assertion), else the head of the item's report (a cell's, a kill
    loop's, a scenario's)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", "") or "") or report.longreprtext
    lines = [line for line in text.splitlines() if line.strip()]
    out = "\n".join(lines[:12])
    return out if len(out) <= limit else out[: limit - 1] + "…"
