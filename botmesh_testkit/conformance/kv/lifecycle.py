"""Lifecycle: calls after ``close()`` raise ``BackendUnavailableError``; ``open`` and
``close`` are idempotent (BACK-7)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from botmesh.core.spi import DurableKv, Versioned

from .base import INF, KvFactory, KvSuiteBase, Scopes, _cleanup, _expect_unavailable, _guarded


class LifecycleTests(KvSuiteBase):
    """The lifecycle tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    @pytest.mark.spec("BACK-7")
    def test_calls_after_close_raise_backend_unavailable(self, kv_factory: KvFactory) -> None:
        """BACK-7: after ``close()`` every call raises ``BackendUnavailableError``."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {}, expected_version=0, due=1.0)
            await _cleanup(kv, s)
            await kv.close()
            # Coroutines are created one at a time, so none is left un-awaited on a failure.
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("get", lambda: kv.get(s.a, "inbox", "k")),
                ("put", lambda: kv.put(s.a, "inbox", "k2", {}, expected_version=0)),
                ("delete", lambda: kv.delete(s.a, "inbox", "k", expected_version=1)),
                ("range", lambda: kv.range(s.a, "inbox", "due", upto=INF, limit=10)),
                ("scan", lambda: kv.scan(s.a, "inbox")),
            ]
            for name, call in calls:
                await _expect_unavailable(
                    call(),
                    f"BACK-7: calls after close() raise BackendUnavailableError; {name}() after close()",
                )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_open_and_close_are_idempotent(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``open()`` is idempotent (a second call changes nothing, the kv keeps
        working) and so is ``close()`` (a second call raises nothing)."""

        async def main() -> None:
            kv = kv_factory()
            s = Scopes()
            await kv.open()
            try:
                await kv.put(s.a, "inbox", "k", {"n": 1}, expected_version=0, due=1.0)
                await kv.open()
                got = await kv.get(s.a, "inbox", "k")
                assert got == Versioned({"n": 1}, 1), (
                    f"BACK-7: open() is idempotent: a second open() must keep the kv and its data; got {got!r}"
                )
                v = await kv.put(s.a, "inbox", "k", {"n": 2}, expected_version=1)
                assert v == 2, f"BACK-7: open() is idempotent: the kv must keep working after a second open(); got {v!r}"
                await _cleanup(kv, s)
            finally:
                await kv.close()
            try:
                await kv.close()
            except Exception as exc:
                raise AssertionError(
                    f"BACK-7: close() is idempotent: a second close() raised {type(exc).__name__}: {exc}"
                ) from exc

        asyncio.run(asyncio.wait_for(_guarded(main()), self.timeout_seconds))

