"""``--botmesh-coverage=PATH``: the plugin object that measures each item of the
in-process parts under its own coverage context and writes the data file (what is
measured and how the contexts are named: :mod:`botmesh_testkit.matrix.coverage_file`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from ..matrix.coverage_file import WORKER_SUFFIX, CoverageFile, activate, combine, sources, stale_files
from .options import default_backends
from .results import part_of

MEASURED_PARTS = ("suite", "scenarios", "matrix", "explore")
"""The parts whose items run the backend in the pytest process (the kill and power-cut
loops run it in child processes killed with SIGKILL: not measured)."""


class CoveragePlugin:
    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.file: CoverageFile | None = None
        self.line: str | None = None
        self.worker = getattr(config, "workerinput", {}).get("workerid")
        self.controller = False
        """An xdist controller: its workers measure, it combines (known at the session's start)."""
        if self.worker is None:  # a file of an earlier run would be added to
            for old in stale_files(path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(old)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.controller = self.config.pluginmanager.getplugin("dsession") is not None
        if self.controller:
            return
        from ..matrix.coverage import NOTE_TRACER_ACTIVE, tracer_active

        if tracer_active():
            self.line = f"botmesh coverage NOT written to {self.path}: {NOTE_TRACER_ACTIVE} (pytest-cov, a debugger)"
            return
        suffix = f"{WORKER_SUFFIX}{self.worker}" if self.worker is not None else None
        self.file = CoverageFile(self.path, sources(default_backends(self.config)), suffix)
        activate(self.file)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        part = part_of(item.nodeid)
        if self.file is None or part not in MEASURED_PARTS:
            return (yield)
        cell = getattr(item, "cell", None)
        label = f"{part}:{cell.id}" if part == "matrix" and cell is not None else f"{part}:{item.nodeid}"
        with self.file.item(label, recovery_split=part == "matrix"):
            return (yield)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        try:
            if self.file is not None:
                self.file.save()
                activate(None)
            if self.worker is not None or self.line is not None:
                return
            workers = combine(self.path) if self.controller else 0
            how = f", combined from {workers} xdist worker file(s)" if workers else ""
            self.line = (f"botmesh coverage data written to {self.path}{how}; one context per item (a crash cell's "
                         f"recovery: matrix:<cell id>): coverage html --data-file={self.path} --show-contexts")
        except Exception as exc:  # the run's outcome stands; say loudly that the file is missing
            self.line = f"botmesh coverage NOT written to {self.path}: {type(exc).__name__}: {exc}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.line is not None:
            terminalreporter.write_line(self.line, red=" NOT " in self.line)
