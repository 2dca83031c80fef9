"""The ground every mixin of the durability suite stands on: the suite's clock and
owners (explicit numbers: nothing sleeps), :class:`DurabilityTest` (what a test body
gets: a harness, a started backend, scopes of its own) and :class:`DurabilitySuiteBase`
(the fixture a binding overrides, the tuning knobs, and the runner every test goes
through)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar

import pytest
from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi_types import Capabilities
from botmesh.core.store import Store

from ...backends import BackendHarness
from ...kill.spec import HarnessError
from ..kv.base import INF, Scopes

__all__ = [
    "FAR",
    "INC_1",
    "INC_2",
    "INF",
    "LEASE_MS",
    "OWNER_A",
    "OWNER_B",
    "T0",
    "DurabilitySuiteBase",
    "DurabilityTest",
    "HarnessFactory",
]

HarnessFactory = Callable[[str], BackendHarness]
"""What the ``botmesh_harness_factory`` fixture returns: ``factory(workdir)`` gives a new
harness whose storage lives in (or is named after) ``workdir``."""

T0 = 1_767_225_600_000.0
"""The suite's "now" (2026-01-01T00:00:00Z in milliseconds, also where a
:class:`~botmesh.core.clock.VirtualClock` starts); every time is an explicit offset."""
LEASE_MS = 60_000.0
OWNER_A = "conformance/owner-a"
OWNER_B = "conformance/owner-b"
INC_1 = "incarnation-1"
INC_2 = "incarnation-2"
FAR = T0 + 10 * 365 * 86_400_000.0
"""Far beyond any lease or retry time of a test: a claim or a purge "at the end of time"."""


class _Skip(Exception):
    """Internal: a capability the test needs is not claimed (turned into pytest.skip
    outside the event loop)."""


class DurabilityTest:
    """One test's harness, backend and scopes. ``backend`` is started; ``reopen()``
    simulates the death of the process and opens the same storage again;
    ``another_process()`` opens a second backend on the same storage through a second
    harness on the same ``workdir``."""

    def __init__(self, factory: HarnessFactory, workdir: str) -> None:
        self.factory = factory
        self.workdir = workdir
        self.harness = factory(workdir)
        self.scopes = Scopes()
        self.backend: DurabilityBackend = None  # type: ignore[assignment]  # set by open()
        self.store: Store = None  # type: ignore[assignment]
        self._live: list[DurabilityBackend] = []
        self._harnesses: list[BackendHarness] = [self.harness]
        self.bot_scopes: list[str] = []
        """Scopes of the bots a test ran on the backend (cleaned up with the others)."""

    @property
    def a(self) -> str:
        """The test's main scope."""
        return self.scopes.a

    @property
    def b(self) -> str:
        """A second scope whose name extends the first one's."""
        return self.scopes.b

    @property
    def caps(self) -> Capabilities:
        """What the harness claims (read after ``open()``)."""
        return self.harness.capabilities

    def require(self, capability: str) -> None:
        """Skip the test unless the harness claims ``capability``."""
        if not getattr(self.caps, capability, False):
            raise _Skip(f"capability not claimed: {capability}")

    async def open(self) -> DurabilityBackend:
        backend, store = await self.harness.open()
        self._live.append(backend)
        await backend.start()
        self.backend, self.store = backend, store
        return backend

    async def reopen(self) -> DurabilityBackend:
        """The process holding the backend dies (it is never stopped) and a new one
        opens the same storage."""
        old = self.backend
        self._live = [b for b in self._live if b is not old]
        backend, store = await self.harness.reopen()
        self._live.append(backend)
        await backend.start()
        self.backend, self.store = backend, store
        return backend

    async def another_process(self) -> DurabilityBackend:
        """A backend of a second harness on the same ``workdir`` — what another process
        on the same storage holds."""
        harness = self.factory(self.workdir)
        self._harnesses.append(harness)
        backend, _ = await harness.open()
        self._live.append(backend)
        await backend.start()
        return backend

    async def clean_up(self) -> None:
        """Delete, best effort, every record of the test's scopes."""
        b = self.backend
        for scope in (*self.scopes.all, *self.bot_scopes):
            with contextlib.suppress(Exception):
                for out in await b.outbox_list(scope, limit=10_000):
                    with contextlib.suppress(Exception):
                        await b.outbox_discard(scope, out.key)
            with contextlib.suppress(Exception):
                for rec in await b.inbox_list(scope, limit=10_000):
                    with contextlib.suppress(Exception):
                        if rec.state != "leased":
                            await b.inbox_replay(scope, rec.id, now=FAR)
                        got = await b.inbox_claim(
                            scope, rec.id, owner="conformance/cleanup", incarnation="cleanup", now=FAR,
                            lease_ms=1.0, recover=True,
                        )
                        if got is not None:
                            await b.inbox_complete(scope, rec.id, token=got.token, now=FAR, expires_at=0.0)
                await b.inbox_purge(scope, now=FAR, limit=10_000)

    async def close(self) -> None:
        """Stop every live backend, then close every harness; the first error is
        raised once all were tried."""
        errors: list[BaseException] = []
        for backend in reversed(self._live):
            try:
                await backend.stop()
            except Exception as exc:  # noqa: BLE001 - collected, raised below
                errors.append(exc)
        self._live.clear()
        for harness in reversed(self._harnesses):
            try:
                await harness.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        self._harnesses.clear()
        if errors:
            raise errors[0]


_Body = Callable[[DurabilityTest], Coroutine[Any, Any, None]]


async def _guarded(call: Awaitable[None], ids: tuple[str, ...]) -> None:
    """Await a test's coroutine, turning an error the backend raised where the contract
    says the call succeeds into an ``AssertionError`` starting with the test's first
    spec id (the original stays chained, with its traceback)."""
    try:
        await call
    except (AssertionError, _Skip, HarnessError):  # a HarnessError is the testkit's (or the binding's)
        raise
    except Exception as exc:
        raise AssertionError(
            f"{ids[0]}: every call of this test is valid and must succeed on a started backend ({', '.join(ids)}); "
            f"the backend raised {type(exc).__name__}: {exc}"
        ) from exc


class DurabilitySuiteBase:
    """What every mixin of the durability suite shares: the ``botmesh_harness_factory``
    fixture a binding overrides, the tuning knobs (class attributes a binding may
    override too) and :meth:`run_backend`, which runs a test's coroutine on a fresh
    harness."""

    timeout_seconds: ClassVar[float] = 60.0
    """Upper bound for one test's coroutine."""
    concurrent_tasks: ClassVar[int] = 20
    """How many tasks race for one claim or one journal write."""
    clean_up_records: ClassVar[bool | None] = None
    """Delete what a test wrote at its end: True, False, or None — only when the harness
    claims ``shared`` (its storage outlives the test's directory)."""

    _spec_ids: tuple[str, ...] = ("BACK-7",)

    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        """Override me: return ``factory(workdir) -> BackendHarness``."""
        raise NotImplementedError(
            f"{type(self).__name__} must define a `botmesh_harness_factory` fixture returning a callable "
            "factory(workdir) -> BackendHarness (e.g. botmesh_testkit.backends.resolve('pkg.module:factory'))"
        )

    @pytest.fixture(autouse=True)
    def _botmesh_spec_ids(self, request: pytest.FixtureRequest) -> None:
        marker = request.node.get_closest_marker("spec")
        if marker is not None and marker.args:
            self._spec_ids = tuple(str(a) for a in marker.args)

    # -- running -------------------------------------------------------------------------
    def run_backend(self, factory: HarnessFactory, workdir: Any, body: _Body) -> None:
        """Build a harness with ``factory(str(workdir))``, open it, start the backend, run
        ``body(test)`` on a fresh event loop, then clean up (when configured), stop the
        backends and close the harness — also when the body fails."""
        ids = self._spec_ids

        async def main() -> None:
            t = DurabilityTest(factory, str(workdir))
            try:
                await t.open()
                await _guarded(body(t), ids)
            except BaseException:
                with contextlib.suppress(Exception):
                    if self._cleans(t):
                        await t.clean_up()
                with contextlib.suppress(Exception):
                    await t.close()
                raise
            if self._cleans(t):
                await t.clean_up()
            await t.close()

        try:
            asyncio.run(asyncio.wait_for(main(), self.timeout_seconds))
        except _Skip as skip:
            pytest.skip(str(skip))

    def _cleans(self, t: DurabilityTest) -> bool:
        if self.clean_up_records is None:
            return bool(t.backend is not None and t.caps.shared)
        return self.clean_up_records
