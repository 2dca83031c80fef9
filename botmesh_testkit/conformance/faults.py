"""Network-fault conformance of backends on a server (PostgreSQL, Redis, a third party's
own): the backend reaches its server through a
:class:`~botmesh_testkit.faultproxy.FaultProxy`, which breaks the connection in the ways
networks do, and the backend must report, recover, and never lose an acknowledged
write nor apply one twice.

Bind it like the durability suite::

    class TestMyServerBackend(ServerFaultConformance):
        @pytest.fixture
        def botmesh_harness_factory(self):
            return resolve("my_pkg.backend:make_harness")

The harness must implement :meth:`~botmesh_testkit.backends.BackendHarness.server_address`
and :meth:`~botmesh_testkit.backends.BackendHarness.via` (a harness on the same storage
reaching the server at another address); a harness without a server address is skipped
with ``not a server backend``. Each test opens the backend *through* the proxy, and a
second, direct backend on the same storage to look at what really landed.

What is checked:

* **outcome unknown** (OUT-14, BACK-7): the write that records a send as ``sent`` reaches
  the server, then the connection dies before the reply. The call must come back with
  the outcome resolved by reading the record back by key (``KvDurability``'s rule: it
  returns True, the record is ``sent`` once, with its message id) — a client that
  replays the write on its own, or a backend that gives up, fails here. The same through
  a whole bot: the channel gets the reply exactly once.
* **connection reset** (BACK-2, BACK-3): every connection is reset between two writes;
  the backend may report the failure of one call, then works again; nothing acknowledged
  before the reset is lost.
* **latency**: 5 ms each way on every chunk changes no outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import pytest
from botmesh.core.backend import DurabilityBackend
from botmesh.core.errors import BackendUnavailableError

from ..backends.base import BackendHarness
from ..servers.faultproxy import FaultProxy
from .durability.base import INC_1, LEASE_MS, OWNER_A, T0, HarnessFactory
from .durability.records import inbound, outbound

__all__ = ["ServerFaultConformance"]


class _Skip(Exception):
    pass


class FaultTest:
    """A backend through a proxy (``backend``) and a direct one on the same storage
    (``direct``)."""

    def __init__(self, factory: HarnessFactory, workdir: str) -> None:
        self.direct_harness = factory(workdir)
        self.proxy: FaultProxy | None = None
        self.harness: BackendHarness | None = None
        self.backend: DurabilityBackend = None  # type: ignore[assignment]
        self.direct: DurabilityBackend = None  # type: ignore[assignment]
        self.scope = f"faults-{uuid.uuid4().hex[:10]}"
        self._live: list[DurabilityBackend] = []

    async def open(self) -> None:
        address = self.direct_harness.server_address()
        if address is None:
            raise _Skip("not a server backend: the harness gives no server_address()")
        self.proxy = await FaultProxy(*address).start()
        self.harness = self.direct_harness.via(*self.proxy.address)
        self.direct, _ = await self.direct_harness.open()
        await self.direct.start()
        self._live.append(self.direct)
        self.backend, _ = await self.harness.open()
        await self.backend.start()
        self._live.append(self.backend)

    async def close(self) -> None:
        for backend in reversed(self._live):
            with contextlib.suppress(Exception):
                await backend.stop()
        if self.harness is not None:
            with contextlib.suppress(Exception):
                await self.harness.close()
        with contextlib.suppress(Exception):
            await self.direct_harness.close()
        if self.proxy is not None:
            await self.proxy.stop()


_Body = Callable[[FaultTest], Coroutine[Any, Any, None]]


class ServerFaultConformance:
    """The server-fault suite (see the module docstring). Override
    ``botmesh_harness_factory``."""

    timeout_seconds: ClassVar[float] = 60.0

    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        """Override me: return ``factory(workdir) -> BackendHarness``."""
        raise NotImplementedError(f"{type(self).__name__} must define a `botmesh_harness_factory` fixture")

    def run_faults(self, factory: HarnessFactory, workdir: Any, body: _Body) -> None:
        """Run ``body`` on a fresh :class:`FaultTest`. When it does not end within
        ``timeout_seconds``, the test fails with where every task of the event loop was
        waiting at that moment (a hang is reported by its place, not only its length)."""
        stage = ["opening the backends"]
        spent: list[str] = []  # "opening the backends 1.2s", ... (what a hang's report gives)

        def next_stage(name: str, since: float) -> float:
            now = time.monotonic()
            spent.append(f"{stage[0]} {now - since:.1f}s")
            stage[0] = name
            return now

        async def main() -> None:
            t = FaultTest(factory, str(workdir))
            since = time.monotonic()
            try:
                await t.open()
                since = next_stage("running the test body", since)
                await body(t)
            finally:
                next_stage("closing the backends", since)
                await t.close()

        async def watched() -> None:
            task = asyncio.ensure_future(main())
            done, _ = await asyncio.wait({task}, timeout=self.timeout_seconds)
            if task in done:
                return task.result()
            where, during, before = _where_tasks_wait(exclude=asyncio.current_task()), stage[0], list(spent)
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait({task}, timeout=10.0)
            pytest.fail(
                f"the fault test did not end within {self.timeout_seconds:g}s while {during} "
                f"(before that: {', '.join(before) or 'nothing'}); where each task was waiting then:\n{where}",
                pytrace=False,
            )

        try:
            asyncio.run(watched())
        except _Skip as skip:
            pytest.skip(str(skip))


    @pytest.mark.spec("OUT-14", "BACK-7")
    def test_out14_a_sent_write_whose_reply_is_lost_is_resolved_by_key(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-14/BACK-7: the write recording ``sent`` lands on the server and the
        connection dies before its reply: the call resolves the outcome by reading the
        record back (True, the record ``sent`` with its message id), never by replaying
        the write."""

        async def body(t: FaultTest) -> None:
            assert t.proxy is not None
            rec = outbound("m1:1", text="hello")
            await t.backend.outbox_journal(t.scope, rec)
            t.proxy.cut_after_request(b'"sent"')
            try:
                ok = await t.backend.outbox_mark_sent(t.scope, "m1:1", token=1, message_id="wamid.1", now=T0 + 1,
                                                      expires_at=None)
            except BackendUnavailableError as exc:
                raise AssertionError(f"OUT-14: mark_sent raised {exc!r} although its write had landed; the outcome "
                                     "of a write that raised must be resolved by reading the record back by key") from None
            fired = t.proxy.stats.faults_fired.get("cut_after_request", 0)
            assert fired == 1, f"OUT-14: the fault never fired (stats {t.proxy.stats}): the write did not contain '\"sent\"'"
            stored = await t.direct.outbox_get(t.scope, "m1:1")
            assert stored is not None and stored.state == "sent" and stored.message_id == "wamid.1", (
                f"OUT-14: after the lost reply the record is {stored!r}, expected sent with message id wamid.1")
            assert ok is True, (f"OUT-14: mark_sent returned {ok!r} for a write that landed (a client that replayed "
                                "the write sees its own first write as a conflict)")

        self.run_faults(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-14", "OUT-2", "GUAR-3")
    def test_out14_a_bot_sends_once_when_the_sent_write_outcome_is_unknown(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-14/OUT-2: a bot on the proxied backend; the write recording its reply as
        sent lands but its reply is lost: the channel gets the reply exactly once and no
        ambiguity is reported."""
        from botmesh.core.bot import Bot
        from botmesh.core.store import MemoryStore
        from botmesh.core.testing import MockProvider

        async def body(t: FaultTest) -> None:
            assert t.proxy is not None
            provider = MockProvider()
            bot = Bot(provider, MemoryStore(), durability={"backend": t.backend, "instance_id": "faults-1"},
                      bot_id=t.scope)
            events: list[tuple[str, dict[str, Any]]] = []
            bot.on("durability:ambiguous", lambda e: events.append(("ambiguous", e)))

            @bot.otherwise
            async def echo(ctx: Any) -> None:
                await ctx.reply(f"echo {ctx.text}")

            await bot.start()
            try:
                t.proxy.cut_after_request(b'"sent"')
                await provider.receive("c1", "hi", id="m1")
            finally:
                await bot.stop()
            assert t.proxy.stats.faults_fired.get("cut_after_request", 0) == 1, "OUT-14: the fault never fired"
            assert provider.texts() == ["echo hi"], f"OUT-2: the channel got {provider.texts()}, expected exactly once"
            assert events == [], f"OUT-14: a send whose outcome could be read back was reported ambiguous: {events}"

        self.run_faults(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("BACK-2", "BACK-3", "INB-1")
    def test_a_reset_connection_is_reported_then_replaced_and_nothing_acknowledged_is_lost(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """BACK-2/BACK-3: every connection is reset between writes; at most the next call
        fails (reported as BackendUnavailableError), later ones work, and every record
        acknowledged before or after the reset is stored."""

        async def body(t: FaultTest) -> None:
            assert t.proxy is not None
            acked: list[str] = []
            for i in range(10):
                if i == 5:
                    t.proxy.reset()
                rid = f"r{i}"
                for attempt in range(2):
                    try:
                        await t.backend.inbox_journal(t.scope, inbound(rid, owner=OWNER_A, incarnation=INC_1))
                        acked.append(rid)
                        break
                    except BackendUnavailableError:
                        if attempt:
                            raise AssertionError(f"BACK-2: {rid}: still failing on the second call after a "
                                                 "connection reset: the dropped connection was not replaced") from None
            stored = {r.id for r in await t.direct.inbox_list(t.scope)}
            missing = [r for r in acked if r not in stored]
            assert not missing, f"INB-1: acknowledged records missing after a reset: {missing}"

        self.run_faults(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2", "BACK-7")
    def test_latency_changes_no_outcome(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """5 ms each way on every chunk: claims, fencing and completion behave exactly as
        without it."""

        async def body(t: FaultTest) -> None:
            assert t.proxy is not None
            t.proxy.latency(5)
            await t.backend.inbox_journal(t.scope, inbound("m1"))
            assert await t.backend.inbox_claim(t.scope, "m1", owner=OWNER_A, incarnation=INC_1, now=T0 + 1,
                                               lease_ms=LEASE_MS, recover=False) is None, \
                "LEASE-2: an unexpired lease was claimed again under latency"
            again = await t.backend.inbox_claim(t.scope, "m1", owner=OWNER_A, incarnation="inc-2",
                                                now=T0 + 2, lease_ms=LEASE_MS, recover=True)
            assert again is not None and again.token == 2, f"LEASE-2: recovery claim gave {again!r}"
            assert not await t.backend.inbox_complete(t.scope, "m1", token=1, now=T0 + 3, expires_at=None), \
                "LEASE-2: a stale token completed the record under latency"
            assert await t.backend.inbox_complete(t.scope, "m1", token=2, now=T0 + 3, expires_at=None)
            stored = await t.direct.inbox_get(t.scope, "m1")
            assert stored is not None and stored.state == "done" and stored.token == 2, f"LEASE-2: stored {stored!r}"

        self.run_faults(botmesh_harness_factory, tmp_path, body)


def _where_tasks_wait(exclude: Any) -> str:
    """Each pending task of the running loop with the innermost frames it waits in."""
    lines: list[str] = []
    for task in asyncio.all_tasks():
        if task is exclude or task.done():
            continue
        frames: list[Any] = []
        awaited: Any = task.get_coro()
        while awaited is not None and len(frames) < 40:  # down the chain of awaits
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                frames.append(frame)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        trail = " <- ".join(
            f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
            for frame in reversed(frames[-6:])
        )
        lines.append(f"  {task.get_name()}: {trail or 'not started'}")
    return "\n".join(sorted(lines)) or "  (no other task)"
