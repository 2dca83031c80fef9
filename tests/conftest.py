"""Shared test machinery: coroutine tests run on a fresh event loop; backends are
parametrised by name."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from botmesh_testkit.backends import HARNESSES, BackendHarness


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(asyncio.wait_for(pyfuncitem.obj(**args), timeout=120))
        return True
    return None


DURABLE = ["memory", "file", "file+log", "sqlite"]


@pytest.fixture(params=DURABLE)
def harness(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[BackendHarness]:
    """Each behavioural test runs against every built-in backend."""
    h = HARNESSES[request.param](str(tmp_path))
    yield h
    asyncio.run(h.close())


@pytest.fixture(params=[n for n in DURABLE if n != "memory"])
def durable_harness(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[BackendHarness]:
    """Backends that survive a process death (restart tests that reopen storage)."""
    h = HARNESSES[request.param](str(tmp_path))
    yield h
    asyncio.run(h.close())


def collected_parts(output: str) -> dict[str, int]:
    """The plugin's header line ``botmesh: N items in all (suite a, scenarios b, ...)``
    as ``{"all": N, "suite": a, "scenarios": b, ...}``: what the plugin collected, counted
    independently of the reports and the summary (tests compare those with it instead of
    hard-coding how many items the shipped scenarios or the suite make)."""
    found = re.search(r"^botmesh: (\d+) items in all \(([^)]*)\)$", output, re.M)
    assert found, f"no 'botmesh: N items in all' header in the output:\n{output[-2000:]}"
    parts = {"all": int(found.group(1))}
    for piece in found.group(2).split(", "):
        name, _, count = piece.rpartition(" ")
        parts[name] = int(count)
    return parts


def shipped_scenario_files() -> list[Path]:
    """The GUAR scenario files the distribution ships (each must yield items)."""
    from botmesh_testkit.scenario.collect import scenario_files, shipped_dir

    return scenario_files(shipped_dir())


def require_fuse() -> None:
    """Skip, naming why, when this machine cannot mount the power-cut file system — or
    fail, when ``$BOTMESH_REQUIRE_SERVICES`` is set (as .ci/run sets it): there the power
    cuts must run."""
    import os

    from botmesh_testkit.crash.fs import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("BOTMESH_REQUIRE_SERVICES", "") not in ("", "0"):
            pytest.fail(f"power cuts must run here (BOTMESH_REQUIRE_SERVICES), but: {reason}")
        pytest.skip(f"power cuts cannot run here: {reason}")


def require_chromium() -> str:
    """The path of a headless-capable Chromium (Debian's ``chromium`` package), to check
    the HTML report in a real browser. Skip, naming why, when there is none — or fail,
    when ``$BOTMESH_REQUIRE_SERVICES`` is set (as .ci/run sets it, after installing it):
    there the browser check must run."""
    import os
    import shutil

    found = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    if found is None:
        reason = "no chromium on PATH (Debian: apt-get install chromium)"
        if os.environ.get("BOTMESH_REQUIRE_SERVICES", "") not in ("", "0"):
            pytest.fail(f"the HTML report must be checked in a browser here (BOTMESH_REQUIRE_SERVICES), but: {reason}")
        pytest.skip(f"the HTML report cannot be checked in a browser here: {reason}")
    return found
