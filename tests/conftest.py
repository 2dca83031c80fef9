"""Shared test machinery: coroutine tests run on a fresh event loop; backends are
parametrised by name."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
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
