"""The ground every mixin of the kv suite stands on: :class:`Scopes` (fresh scope names
per test), the helpers that await a call and name the contract it broke, the full view
of a ``(scope, space)`` that the tests compare, and :class:`KvSuiteBase` (the fixture a
binding overrides and the runner every test goes through)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import pytest
from botmesh.core.errors import BackendUnavailableError, VersionConflict
from botmesh.core.spi import INDEXES, DurableKv

from ...kill.spec import HarnessError

T = TypeVar("T")

KvFactory = Callable[[], DurableKv]
"""What the ``kv_factory`` fixture returns: each call gives a new, unopened kv on the
same storage."""

SPACES: tuple[str, ...] = ("inbox", "outbox", "archive_1")
"""The spaces the suite writes to: the two the engine uses and one more, since a backend
must accept any short identifier-like space name."""

INF = math.inf


class Scopes:
    """Fresh scope names for one test, so that tests never see each other's records even
    on a shared server. ``b`` starts with ``a`` and adds characters that are special in
    key prefixes and SQL patterns (``:``, ``/``, ``%``, ``_``), so that a backend matching
    scopes by prefix or by pattern leaks and is caught."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:12]
        self.a = f"conformance/{tag}/a"
        self.b = f"conformance/{tag}/a:%_b"

    @property
    def all(self) -> tuple[str, str]:
        """Both scopes."""
        return (self.a, self.b)


_Body = Callable[[DurableKv, Scopes], Coroutine[Any, Any, None]]
"""A test's coroutine: it gets an open kv and the test's scopes."""


def crash(kv: DurableKv) -> None:
    """Let ``kv`` go as a dead process would: no ``close()``. A kv with an ``abandon()``
    method (release in-process handles and locks without flushing anything, as
    :class:`botmesh.core.file_backend.FileKv` has) gets it called; the caller then drops
    its last reference."""
    abandon = getattr(kv, "abandon", None)
    if callable(abandon):
        abandon()


async def _expect(call: Awaitable[Any], error: type[Exception], message: str) -> None:
    """Await ``call``; it must raise ``error``. Otherwise fail with ``message`` and what
    happened instead."""
    try:
        result = await call
    except error:
        return
    except Exception as exc:  # the backend raised the wrong type: say which
        raise AssertionError(f"{message}; it raised {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{message}; it returned {result!r} and raised nothing")


async def _expect_conflict(call: Awaitable[Any], message: str) -> None:
    """Await ``call``; it must raise ``VersionConflict``."""
    await _expect(call, VersionConflict, message)


async def _expect_unavailable(call: Awaitable[Any], message: str) -> None:
    """Await ``call``; it must raise ``BackendUnavailableError``."""
    await _expect(call, BackendUnavailableError, message)


async def _guarded(call: Awaitable[T]) -> T:
    """Await a test's coroutine, turning an error a kv raised where the contract says the
    call succeeds into an ``AssertionError`` that names the contract (the original stays
    chained, with its traceback)."""
    try:
        return await call
    except (AssertionError, HarnessError):  # a HarnessError is the testkit's (or the binding's), not the kv's
        raise
    except VersionConflict as exc:
        raise AssertionError(
            "BACK-7: a put()/delete() with the record's current version must succeed (a record's version is 1 "
            "when it is created and grows by exactly 1 with every successful put); the kv raised "
            f"VersionConflict: {exc}"
        ) from exc
    except BackendUnavailableError as exc:
        raise AssertionError(
            f"BACK-7: a call on an open kv must succeed; the kv raised BackendUnavailableError: {exc}"
        ) from exc
    except Exception as exc:
        raise AssertionError(
            "BACK-7: errors of the underlying driver are raised as BackendUnavailableError (never the "
            f"driver's type), and a valid call must succeed; the kv raised {type(exc).__name__}: {exc}"
        ) from exc


async def _state(kv: DurableKv, scope: str, space: str) -> dict[str, Any]:
    """Everything a kv shows of ``(scope, space)``: every record by scan, and both
    indexes in full."""
    return {
        "records": await kv.scan(scope, space, after=None, limit=10_000),
        **{index: await kv.range(scope, space, index, upto=INF, limit=10_000) for index in INDEXES},
    }


async def _cleanup(kv: DurableKv, scopes: Scopes) -> None:
    """Delete what a test wrote (best effort: a broken or closed kv must not hide the
    test's own failure)."""
    try:
        for scope in scopes.all:
            for space in SPACES:
                for key, found in await kv.scan(scope, space, after=None, limit=10_000):
                    with contextlib.suppress(Exception):
                        await kv.delete(scope, space, key, expected_version=found.version)
    except Exception:  # noqa: BLE001, S110 - best effort, see the docstring
        pass


class KvSuiteBase:
    """What every mixin of the kv suite shares: the ``kv_factory`` fixture a binding
    overrides, ``timeout_seconds`` (a class attribute a binding may override too) and
    :meth:`run_kv`, which runs a test's coroutine on an open kv."""

    timeout_seconds: ClassVar[float] = 60.0
    """Upper bound for one test's coroutine (and for one step of the state machine)."""

    @pytest.fixture
    def kv_factory(self) -> KvFactory:
        """Override me: return a callable giving a new, unopened ``DurableKv`` on the
        same storage at each call."""
        raise NotImplementedError(
            f"{type(self).__name__} must define a `kv_factory` fixture returning a zero-argument "
            "callable that builds a new, unopened DurableKv on the same storage"
        )

    # -- running -------------------------------------------------------------------------
    def run_kv(self, kv_factory: KvFactory, body: _Body) -> None:
        """Open a kv from ``kv_factory``, run ``body(kv, scopes)`` on a fresh event loop,
        then delete what it wrote and close the kv."""

        async def main() -> None:
            kv = kv_factory()
            await kv.open()
            scopes = Scopes()
            try:
                await _guarded(body(kv, scopes))
            except BaseException:
                try:
                    await _cleanup(kv, scopes)
                    await kv.close()
                except Exception:  # noqa: BLE001, S110 - the test's own failure is the one to report
                    pass
                raise
            await _cleanup(kv, scopes)
            await kv.close()

        asyncio.run(asyncio.wait_for(main(), self.timeout_seconds))

    @staticmethod
    def claims_survives_crash(kv_factory: KvFactory) -> bool:
        """Whether the kv claims ``capabilities.survives_crash`` (read from an instance
        that is never opened)."""
        return bool(kv_factory().capabilities.survives_crash)
