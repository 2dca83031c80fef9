"""Conformance suite of the durability backend contract — the
:class:`~botmesh.core.backend.DurabilityBackend` interface (BACK-7).

Subclass :class:`DurabilityConformance` and provide the ``botmesh_harness_factory``
fixture: a callable ``factory(workdir: str) -> BackendHarness``, exactly what
:func:`botmesh_testkit.backends.resolve` returns::

    import pytest
    from botmesh_testkit.backends import resolve
    from botmesh_testkit.conformance.durability import DurabilityConformance

    class TestMyBackend(DurabilityConformance):
        @pytest.fixture
        def botmesh_harness_factory(self):
            return resolve("mypkg.mod:factory")   # or: lambda workdir: MyHarness(workdir)

Each test builds its own harness with ``botmesh_harness_factory(str(tmp_path))``, opens
it, ``await backend.start()``, works in scopes of its own (a fresh random tag per test,
the second scope's name extending the first with ``:%_`` so that matching scopes by
prefix or pattern leaks and is caught), and stops the backends and closes the harness at
the end, also when it fails. With ``clean_up_records`` (by default when the harness
claims ``shared``: storage that outlives the test's directory) it also deletes, best
effort, what it wrote.

What is checked — the spec ids are on each test, in its docstring and in
``@pytest.mark.spec``; every failure message starts with the id and states the broken
requirement, then what the backend did:

* INB — journaling is create-if-absent and returns the stored record on a redelivery
  (INB-1, INB-4, also under concurrency), completion (INB-2), what is due after a crash
  and in which order (INB-3), retry later (INB-5), charged executions and the DLQ
  (INB-7);
* OUT — the outbox journal keyed by idempotency key, every field stored as given
  (content with base64 bytes, fingerprint, part links: OUT-1, OUT-5, OUT-12, OUT-15),
  ``sent`` with the message id and staying sent (OUT-1, OUT-2), enqueued sends and their
  due time (OUT-10), failures with a retry time (OUT-7), the DLQ (OUT-8), split (OUT-13),
  ambiguity after an expired send lease and ``unknown`` (OUT-14), explicit keys per
  scope (OUT-4);
* LEASE — a claim leases until ``now + lease_ms``; heartbeats extend and never shorten
  (LEASE-1); only expired leases are taken, with a strictly larger fencing token; every
  fenced operation with a stale token is refused and changes nothing (LEASE-2); the
  recovery claim of a restarted incarnation (LEASE-4);
* SCOPE — two scopes never see or change each other's records (SCOPE-1, SCOPE-2);
* OPS — listing by state, replay of a dead inbound, retry, discard (OPS-2), retention
  purges only expired ``done``/``sent`` records (OPS-3);
* REPL — concurrent claims have exactly one winner (REPL-1); with ``multi_process``,
  two backends on the same storage see each other's claims exclusively (REPL-4);
* survival — with ``survives_crash``, everything acknowledged before ``harness.reopen()``
  is there after it: records, states, tokens, and both indexes (a leased record is still
  due at its ``lease_until``);
* end to end — through a :class:`~botmesh.core.Bot` on the backend: journaled before the
  handler and done after it, reprocessed after a restart with its sends answered from
  the outbox, a dead inbound replayed by the operator.

Not checkable at this level (they are the engine's, a configuration's or a document's,
whatever the backend does): INB-6, INB-8, INB-9, OUT-3, OUT-6, OUT-9, OUT-11, OUT-16,
OUT-17, LEASE-3, LEASE-5, SCOPE-3, OPS-1 and the metrics of OPS-2; ``multi_host``
cannot be exercised from one host.

Capabilities are read from the harness after ``open()`` (a factory harness learns them
from the backend it built); a test whose capability is not claimed is skipped with
``capability not claimed: <name>``. ``now``, ``next_at``, ``lease_until`` and
``expires_at`` are explicit numbers: nothing sleeps, and the backend must never read a
clock of its own.

The tests are plain synchronous pytest functions that run their coroutine with
:func:`asyncio.run`; no pytest plugin is needed to import or run this module (the
``spec`` marker is registered by the testkit's plugin). Tuning knobs are class
attributes (``timeout_seconds``, ``concurrent_tasks``, ``clean_up_records``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, cast

import pytest
from botmesh.core.backend import DurabilityBackend
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.spi_types import Capabilities
from botmesh.core.store import Store

from ..backends import BackendHarness
from .kv import Scopes

if TYPE_CHECKING:
    from botmesh.core.bot import Bot

__all__ = [
    "INC_1",
    "INC_2",
    "LEASE_MS",
    "OWNER_A",
    "OWNER_B",
    "T0",
    "DurabilityConformance",
    "DurabilityTest",
    "HarnessFactory",
    "inbound",
    "outbound",
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
INF = float("inf")

# --------------------------------------------------------------------------------------
# records as the engine journals them
# --------------------------------------------------------------------------------------


def inbound(
    id: str,
    *,
    chat_id: str = "chat-1",
    text: str = "hi",
    owner: str = OWNER_A,
    incarnation: str = INC_1,
    now: float = T0,
    lease_ms: float = LEASE_MS,
) -> InboxRecord:
    """An inbox record as the engine journals an admitted event (INB-1): ``leased`` to
    ``owner`` until ``now + lease_ms``, attempts 1, token 1."""
    event: dict[str, Any] = {
        "id": id, "chat_id": chat_id, "text": text, "kind": "message", "user_id": "user-1", "data": {}, "media": None
    }
    return InboxRecord(
        id=id, kind="message", chat_id=chat_id, event=event, state="leased", attempts=1, token=1, owner=owner,
        incarnation=incarnation, lease_until=now + lease_ms, claimed_at=now, created_at=now, updated_at=now,
    )


def outbound(
    key: str,
    *,
    state: str = "sending",
    chat_id: str = "chat-1",
    text: str | None = None,
    content: dict[str, Any] | None = None,
    owner: str = OWNER_A,
    incarnation: str = INC_1,
    now: float = T0,
    lease_ms: float = LEASE_MS,
    next_at: float | None = None,
    previous_part: str | None = None,
    part: int = 1,
    seq: int = 1,
) -> OutboxRecord:
    """An outbox record as the engine journals a send (OUT-1): ``sending`` — an inline
    send leased to ``owner`` (attempts 1, token 1) — or ``pending`` — enqueued, or a
    part waiting behind an earlier one, due at ``next_at`` (default ``now``)."""
    if state not in ("sending", "pending"):
        raise ValueError(f"the engine journals sends as 'sending' or 'pending', not {state!r}")
    sending = state == "sending"
    return OutboxRecord(
        key=key, chat_id=chat_id, content=content or {"type": "text", "text": text or f"reply {key}"},
        fingerprint=f"fp:{key}", rule="explicit", previous_part=previous_part, part=part,
        origin="inline" if sending else "enqueue", state=state, attempts=1 if sending else 0, token=1 if sending else 0,
        owner=owner if sending else None, incarnation=incarnation if sending else None,
        lease_until=now + lease_ms if sending else None, claimed_at=now if sending else None,
        next_at=None if sending else (now if next_at is None else next_at), created_at=now, updated_at=now, seq=seq,
    )


def _j(record: Any) -> dict[str, Any] | None:
    """A record as JSON (None stays None): what is compared."""
    return None if record is None else record.to_json()


def _changes(before: Any, after: Any) -> str:
    """The fields that differ between two records, for messages."""
    a, b = _j(before), _j(after)
    if a is None or b is None:
        return f"{a!r} -> {b!r}"
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    return ", ".join(f"{k}: {x!r} -> {y!r}" for k, (x, y) in diff.items()) or "nothing"


def _when(t: float) -> str:
    """``T0+<ms>`` for messages."""
    if t == INF:
        return "inf"
    d = t - T0
    return "T0" if d == 0 else f"T0{d:+.0f}"


class _Skip(Exception):
    """Internal: a capability the test needs is not claimed (turned into pytest.skip
    outside the event loop)."""


# --------------------------------------------------------------------------------------
# what a test body gets
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# one journal, seen through the interface (for the tests that hold for both)
# --------------------------------------------------------------------------------------


class _Journal:
    """The inbox or the outbox of a backend, with one vocabulary: ``journal`` a record
    leased to its owner, ``claim``, ``heartbeat``, ``settle`` (complete / mark sent),
    ``fenced`` (every fenced operation with a token)."""

    def __init__(self, backend: DurabilityBackend, kind: str) -> None:
        self.b = backend
        self.kind = kind
        self.leased = "leased" if kind == "inbox" else "sending"
        self.settled = "done" if kind == "inbox" else "sent"

    async def journal(
        self, scope: str, id: str, *, owner: str = OWNER_A, incarnation: str = INC_1, now: float = T0,
        lease_ms: float = LEASE_MS,
    ) -> Any:
        stored: InboxRecord | OutboxRecord
        if self.kind == "inbox":
            stored, _ = await self.b.inbox_journal(
                scope, inbound(id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms)
            )
        else:
            stored, _ = await self.b.outbox_journal(
                scope, outbound(id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms)
            )
        return stored

    async def claim(
        self, scope: str, id: str, *, owner: str, incarnation: str, now: float, lease_ms: float = LEASE_MS,
        recover: bool = False,
    ) -> Any:
        if self.kind == "inbox":
            return await self.b.inbox_claim(
                scope, id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms, recover=recover
            )
        got = await self.b.outbox_claim(
            scope, id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms, recover=recover
        )
        return None if got is None else got[0]

    async def heartbeat(self, scope: str, id: str, *, token: int, lease_until: float) -> bool:
        if self.kind == "inbox":
            return await self.b.inbox_heartbeat(scope, id, token=token, lease_until=lease_until)
        return await self.b.outbox_heartbeat(scope, id, token=token, lease_until=lease_until)

    async def settle(self, scope: str, id: str, *, token: int, now: float) -> bool:
        if self.kind == "inbox":
            return await self.b.inbox_complete(scope, id, token=token, now=now, expires_at=None)
        return await self.b.outbox_mark_sent(scope, id, token=token, message_id=f"msg-{id}", now=now, expires_at=None)

    async def get(self, scope: str, id: str) -> Any:
        return await (self.b.inbox_get(scope, id) if self.kind == "inbox" else self.b.outbox_get(scope, id))

    async def due(self, scope: str, *, upto: float, limit: int = 100) -> list[str]:
        if self.kind == "inbox":
            return await self.b.inbox_due(scope, upto=upto, limit=limit)
        return await self.b.outbox_due(scope, upto=upto, limit=limit)

    def fenced(self, scope: str, id: str, token: int, now: float) -> list[tuple[str, Callable[[], Awaitable[bool]]]]:
        """Every fenced operation of this journal with ``token``, by name."""
        b = self.b
        if self.kind == "inbox":
            return [
                ("inbox_heartbeat", lambda: b.inbox_heartbeat(scope, id, token=token, lease_until=FAR)),
                ("inbox_complete", lambda: b.inbox_complete(scope, id, token=token, now=now, expires_at=now)),
                ("inbox_retry_later", lambda: b.inbox_retry_later(scope, id, token=token, next_at=now, error="stale")),
                ("inbox_kill", lambda: b.inbox_kill(scope, id, token=token, now=now, error="stale")),
            ]
        return [
            ("outbox_heartbeat", lambda: b.outbox_heartbeat(scope, id, token=token, lease_until=FAR)),
            ("outbox_mark_sent", lambda: b.outbox_mark_sent(scope, id, token=token, message_id="stale", now=now, expires_at=now)),
            ("outbox_mark_failed", lambda: b.outbox_mark_failed(scope, id, token=token, next_at=now, error="stale")),
            ("outbox_mark_dead", lambda: b.outbox_mark_dead(scope, id, token=token, now=now, error="stale")),
            ("outbox_mark_unknown", lambda: b.outbox_mark_unknown(scope, id, token=token, now=now)),
            ("outbox_split", lambda: b.outbox_split(scope, id, token=token, content={"type": "text", "text": "stale"})),
        ]


JOURNALS = ("inbox", "outbox")


# --------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------


class DurabilityConformance:
    """The durability backend conformance suite (BACK-7).

    Bind it by subclassing (the subclass's name must match pytest's ``python_classes``,
    ``Test*`` by default) and overriding the ``botmesh_harness_factory`` fixture to
    return ``factory(workdir) -> BackendHarness`` (what
    :func:`botmesh_testkit.backends.resolve` returns). The class attributes below may be
    overridden as well.
    """

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

    # ==================================================================================
    # INB — the inbox
    # ==================================================================================
    @pytest.mark.spec("INB-1")
    def test_inb1_journal_stores_the_inbound_record_as_given(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-1: ``inbox_journal`` of a new id creates the record and returns it with
        ``created=True``; ``inbox_get`` and ``inbox_list`` then return exactly the record
        journaled — every field, the event payload, and fields unknown to this version
        (records keep them on read)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            rec = inbound("m1", text="héllo ✓ 🤖 \"quoted\" \\ \n")
            rec.event["data"] = {"n": [1, 2.5, None, True], "nested": {"k": "v"}}
            rec.event["media"] = {"v": 1, "data": {"file_id": "f-1"}}
            rec.extra = {"x_future_field": {"kept": [1, "two"]}}
            absent = await b.inbox_get(t.a, "m1")
            assert absent is None, f"INB-1: inbox_get of an id never journaled must return None; got {absent!r}"
            stored, created = await b.inbox_journal(t.a, rec)
            assert created is True, f"INB-1: inbox_journal of a new id must create it and return created=True; got {created!r}"
            assert _j(stored) == _j(rec), (
                f"INB-1: inbox_journal of a new id returns the record journaled; it differs in {_changes(rec, stored)}"
            )
            got = await b.inbox_get(t.a, "m1")
            assert _j(got) == _j(rec), (
                "INB-1: the journaled record must be readable before any handler runs, exactly as journaled "
                f"(every field, unknown ones included); inbox_get differs in {_changes(rec, got)}"
            )
            listed = await b.inbox_list(t.a)
            assert [_j(r) for r in listed] == [_j(rec)], (
                f"INB-1: inbox_list must list the journaled record exactly; got {[_j(r) for r in listed]!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-4")
    def test_inb4_journal_of_an_existing_id_returns_the_stored_record(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-4: journaling an id that exists returns the stored record and
        ``created=False`` and changes nothing — while it is leased and after it is
        done."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            first = inbound("m1", text="first")
            await b.inbox_journal(t.a, first)
            again = inbound("m1", chat_id="chat-2", text="redelivered", owner=OWNER_B, incarnation=INC_2, now=T0 + 5)
            stored, created = await b.inbox_journal(t.a, again)
            assert created is False, (
                f"INB-4: inbox_journal of an id that exists must return created=False (a redelivery); got {created!r}"
            )
            assert _j(stored) == _j(first), (
                "INB-4: inbox_journal of an id that exists must return the stored record, not the new one; "
                f"it differs from the stored one in {_changes(first, stored)}"
            )
            got = await b.inbox_get(t.a, "m1")
            assert _j(got) == _j(first), (
                f"INB-4: a redelivery must not change the stored record; it changed {_changes(first, got)}"
            )
            assert await b.inbox_complete(t.a, "m1", token=1, now=T0 + 10, expires_at=None) is True, (
                "INB-4: inbox_complete with the record's token must succeed (setting up the done record)"
            )
            done = await b.inbox_get(t.a, "m1")
            stored, created = await b.inbox_journal(t.a, again)
            assert created is False and _j(stored) == _j(done), (
                "INB-4: inbox_journal of an id whose record is done must return (the done record, False); "
                f"got created={created!r}, record differing in {_changes(done, stored)}"
            )
            after = await b.inbox_get(t.a, "m1")
            assert _j(after) == _j(done), (
                f"INB-4: a redelivery must not change a done record; it changed {_changes(done, after)}"
            )
            count = len(await b.inbox_list(t.a))
            assert count == 1, f"INB-4: one id is one record; inbox_list shows {count}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-4", "REPL-1")
    def test_inb4_concurrent_journals_of_one_id_create_it_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-4, REPL-1: the same inbound event journaled by many tasks at once is
        created exactly once; every other call gets the stored (winning) record and
        ``created=False``."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            records = [inbound("m1", text=f"copy {i}", owner=f"owner-{i}") for i in range(n)]
            outcomes = await asyncio.gather(*(b.inbox_journal(t.a, r) for r in records))
            created = [i for i, (_, c) in enumerate(outcomes) if c]
            assert len(created) == 1, (
                f"INB-4/REPL-1: {n} concurrent inbox_journal calls of one id must create it exactly once; "
                f"{len(created)} returned created=True"
            )
            stored = await b.inbox_get(t.a, "m1")
            assert _j(stored) == _j(records[created[0]]), (
                f"INB-4: the stored record must be the one whose journal returned created=True; differs in "
                f"{_changes(records[created[0]], stored)}"
            )
            wrong = [i for i, (r, _) in enumerate(outcomes) if _j(r) != _j(stored)]
            assert not wrong, (
                f"INB-4: every concurrent journal of an existing id must return the stored record; calls {wrong} "
                "returned another one"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-2")
    def test_inb2_complete_marks_the_record_done(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-2: ``inbox_complete`` with the lease's token marks the record ``done``; a
        done record is no longer due, is listed as done, and no fenced operation applies
        to it any more (a second completion returns False)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))
            ok = await b.inbox_complete(t.a, "m1", token=1, now=T0 + 5, expires_at=T0 + 1000)
            assert ok is True, f"INB-2: inbox_complete with the current lease's token must return True; got {ok!r}"
            done = await b.inbox_get(t.a, "m1")
            assert done is not None and done.state == "done", (
                f"INB-2: inbox_complete marks the record done; its state is {getattr(done, 'state', None)!r}"
            )
            assert done.id == "m1" and done.token == 1 and done.event == inbound("m1").event, (
                f"INB-2: inbox_complete changes the state, not the record's identity; got {_j(done)!r}"
            )
            due = await b.inbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"INB-2: a done record is settled: it must not be due; inbox_due lists {due!r}"
            listed = [r.id for r in await b.inbox_list(t.a, state="done")]
            assert listed == ["m1"], f"INB-2: inbox_list(state='done') must list it; got {listed!r}"
            again = await b.inbox_complete(t.a, "m1", token=1, now=T0 + 6, expires_at=None)
            assert again is False, (
                f"INB-2: inbox_complete of a record that is no longer leased must return False; got {again!r}"
            )
            after = await b.inbox_get(t.a, "m1")
            assert _j(after) == _j(done), f"INB-2: a refused completion changes nothing; it changed {_changes(done, after)}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-3", "INB-5")
    def test_inb3_unfinished_records_are_due_earliest_first(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-3: ``inbox_due`` lists the ids of the unfinished records — ``leased``
        (at their ``lease_until``) and ``pending`` (at their ``next_at``) — whose time is
        ``<= upto`` (inclusive), earliest first, up to ``limit``; never a ``done`` or
        ``dead`` one. The ids are chosen so that id order is the reverse of time order."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m3", lease_ms=60_000))  # due T0+60000
            await b.inbox_journal(t.a, inbound("m5", lease_ms=30_000))  # due T0+30000
            await b.inbox_journal(t.a, inbound("m9"))
            assert await b.inbox_retry_later(t.a, "m9", token=1, next_at=T0 + 5_000, error="e") is True  # due T0+5000
            await b.inbox_journal(t.a, inbound("m1"))
            assert await b.inbox_complete(t.a, "m1", token=1, now=T0, expires_at=None) is True
            await b.inbox_journal(t.a, inbound("m2"))
            assert await b.inbox_kill(t.a, "m2", token=1, now=T0, error="e") is True
            cases: list[tuple[float, int, list[str]]] = [
                (INF, 100, ["m9", "m5", "m3"]),
                (T0 + 4_999, 100, []),
                (T0 + 5_000, 100, ["m9"]),
                (T0 + 29_999, 100, ["m9"]),
                (T0 + 30_000, 100, ["m9", "m5"]),
                (T0 + 60_000, 100, ["m9", "m5", "m3"]),
                (INF, 2, ["m9", "m5"]),
                (INF, 1, ["m9"]),
            ]
            for upto, limit, expected in cases:
                got = await b.inbox_due(t.a, upto=upto, limit=limit)
                assert got == expected, (
                    "INB-3: inbox_due lists the ids of leased/pending records whose lease or retry time is <= upto, "
                    f"earliest first, up to limit (never done or dead ones); upto={_when(upto)}, limit={limit}: "
                    f"expected {expected!r}, got {got!r}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-5")
    def test_inb5_retry_later_makes_the_record_pending_until_next_at(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-5: ``inbox_retry_later`` moves a leased record to ``pending`` with its
        ``next_at`` and error; it is due, and claimable, only from ``next_at`` on; the
        claim then leases it with a larger token."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))
            ok = await b.inbox_retry_later(t.a, "m1", token=1, next_at=T0 + 5_000, error="store down")
            assert ok is True, f"INB-5: inbox_retry_later with the lease's token must return True; got {ok!r}"
            rec = await b.inbox_get(t.a, "m1")
            assert rec is not None and (rec.state, rec.next_at, rec.error) == ("pending", T0 + 5_000, "store down"), (
                "INB-5: inbox_retry_later makes the record pending until next_at with the error; got "
                f"state={getattr(rec, 'state', None)!r}, next_at={getattr(rec, 'next_at', None)!r}, "
                f"error={getattr(rec, 'error', None)!r}"
            )
            early = await b.inbox_due(t.a, upto=T0 + 4_999, limit=10)
            assert early == [], f"INB-5: a pending record is not due before next_at; inbox_due(T0+4999) lists {early!r}"
            on_time = await b.inbox_due(t.a, upto=T0 + 5_000, limit=10)
            assert on_time == ["m1"], f"INB-5: a pending record is due at next_at; inbox_due(T0+5000) lists {on_time!r}"
            claimed = await b.inbox_claim(
                t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=T0 + 4_999, lease_ms=LEASE_MS, recover=False
            )
            assert claimed is None, f"INB-5: a pending record is not claimable before next_at; the claim returned {_j(claimed)!r}"
            unchanged = await b.inbox_get(t.a, "m1")
            assert _j(unchanged) == _j(rec), f"INB-5: a refused claim changes nothing; it changed {_changes(rec, unchanged)}"
            claimed = await b.inbox_claim(
                t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=T0 + 5_000, lease_ms=LEASE_MS, recover=False
            )
            assert claimed is not None and claimed.state == "leased" and claimed.owner == OWNER_B, (
                f"INB-5: a pending record is claimable at next_at (leased to the claimer); the claim returned {_j(claimed)!r}"
            )
            assert claimed.token > 1 and claimed.lease_until == T0 + 5_000 + LEASE_MS, (
                "INB-5/LEASE-2: the claim of a pending record gives a larger token and lease_until = now + lease_ms; "
                f"got token {claimed.token!r}, lease_until {claimed.lease_until!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-7")
    def test_inb7_every_claim_charges_one_execution(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-7: an execution is charged when it is claimed: ``attempts`` grows by one
        with every claim (takeover of an expired lease, recovery, claim of a pending
        record) and by nothing else (retry later, heartbeat, kill)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            rec = (await b.inbox_journal(t.a, inbound("m1")))[0]
            assert rec.attempts == 1
            now = T0
            for expected in (2, 3, 4):
                now = cast(float, rec.lease_until)  # set by the journal and by every claim
                got = await b.inbox_claim(t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=now, lease_ms=LEASE_MS, recover=False)
                assert got is not None and got.attempts == expected, (
                    f"INB-7: every claim charges one execution: attempts must be {expected} after this claim; got "
                    f"{getattr(got, 'attempts', None)!r} (record {_j(got)!r})"
                )
                rec = got
            assert await b.inbox_heartbeat(t.a, "m1", token=rec.token, lease_until=now + 2 * LEASE_MS) is True
            assert await b.inbox_retry_later(t.a, "m1", token=rec.token, next_at=now + 10, error="e") is True
            pending = await b.inbox_get(t.a, "m1")
            assert pending is not None and pending.attempts == 4, (
                f"INB-7: only claims charge executions: heartbeat and retry_later keep attempts at 4; got {_j(pending)!r}"
            )
            got = await b.inbox_claim(t.a, "m1", owner=OWNER_A, incarnation=INC_1, now=now + 10, lease_ms=LEASE_MS, recover=False)
            assert got is not None and got.attempts == 5, (
                f"INB-7: the claim of a pending record charges one execution (attempts 5); got {_j(got)!r}"
            )
            assert await b.inbox_kill(t.a, "m1", token=got.token, now=now + 20, error="poison") is True
            dead = await b.inbox_get(t.a, "m1")
            assert dead is not None and dead.attempts == 5, f"INB-7: kill keeps attempts; got {_j(dead)!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-7", "INB-5", "OPS-2")
    def test_inb7_kill_moves_the_record_to_the_dlq(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-7, INB-5: ``inbox_kill`` moves a record to ``dead`` (the DLQ) with its
        error: fenced with a token, unconditional with ``None`` for any record not done;
        a dead record is listed as dead (OPS-2), never due and never claimed."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            for id in ("m1", "m2", "m3"):
                await b.inbox_journal(t.a, inbound(id))
            ok = await b.inbox_kill(t.a, "m1", token=1, now=T0 + 1, error="poison message")
            assert ok is True, f"INB-7: inbox_kill with the lease's token must return True; got {ok!r}"
            dead = await b.inbox_get(t.a, "m1")
            assert dead is not None and dead.state == "dead" and dead.error == "poison message", (
                f"INB-7: inbox_kill moves the record to dead with its error; got {_j(dead)!r}"
            )
            ok = await b.inbox_kill(t.a, "m2", token=None, now=T0 + 1, error="operator")
            assert ok is True, f"INB-7: inbox_kill with token=None moves any record not done to dead; got {ok!r}"
            assert await b.inbox_complete(t.a, "m3", token=1, now=T0, expires_at=None) is True
            done = await b.inbox_get(t.a, "m3")
            refused = await b.inbox_kill(t.a, "m3", token=None, now=T0 + 1, error="operator")
            after = await b.inbox_get(t.a, "m3")
            assert refused is False and _j(after) == _j(done), (
                f"INB-7: inbox_kill never moves a done record; it returned {refused!r} and changed {_changes(done, after)}"
            )
            listed = [r.id for r in await b.inbox_list(t.a, state="dead")]
            assert listed == ["m1", "m2"], f"OPS-2: inbox_list(state='dead') must list the DLQ by id; got {listed!r}"
            due = await b.inbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"INB-7: a dead record is never due; inbox_due lists {due!r}"
            for owner, inc, recover in ((OWNER_A, INC_2, True), (OWNER_B, INC_2, False)):
                got = await b.inbox_claim(t.a, "m1", owner=owner, incarnation=inc, now=FAR, lease_ms=LEASE_MS, recover=recover)
                assert got is None, f"INB-7: a dead record is never claimed; a claim returned {_j(got)!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # LEASE — leases and fencing, for both journals
    # ==================================================================================
    @pytest.mark.spec("LEASE-1")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease1_claim_leases_until_now_plus_lease_ms(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-1: a claim leases the record to ``owner`` (and ``incarnation``) until
        ``now + lease_ms``; the record is due again exactly at that time."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            await j.journal(t.a, "r1", lease_ms=LEASE_MS)
            got = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS + 100, lease_ms=30_000)
            until = T0 + LEASE_MS + 100 + 30_000
            assert got is not None, f"LEASE-1/LEASE-2: the claim of an expired {journal} lease must succeed; got None"
            assert (got.state, got.owner, got.incarnation, got.lease_until) == (j.leased, OWNER_B, INC_2, until), (
                f"LEASE-1: a claim leases the {journal} record to owner/incarnation until now + lease_ms "
                f"({_when(until)}); got state={got.state!r}, owner={got.owner!r}, incarnation={got.incarnation!r}, "
                f"lease_until={got.lease_until!r}"
            )
            stored = await j.get(t.a, "r1")
            assert _j(stored) == _j(got), f"LEASE-1: the claim returns the stored record; differs in {_changes(got, stored)}"
            before = await j.due(t.a, upto=until - 1)
            at = await j.due(t.a, upto=until)
            assert before == [] and at == ["r1"], (
                f"LEASE-1: a leased {journal} record is due at its lease_until, not before; "
                f"due({_when(until - 1)}) = {before!r}, due({_when(until)}) = {at!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-1", "REPL-3")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease1_heartbeat_extends_the_lease_and_never_shortens_it(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-1, REPL-3: a heartbeat with the lease's token extends ``lease_until``:
        the record is no longer due at the old deadline and nobody else can claim it
        there; a heartbeat with an earlier deadline never shortens the lease."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            await j.journal(t.a, "r1")  # lease until T0+60000
            ok = await j.heartbeat(t.a, "r1", token=1, lease_until=T0 + 90_000)
            assert ok is True, f"LEASE-1: a {journal} heartbeat with the lease's token must return True; got {ok!r}"
            rec = await j.get(t.a, "r1")
            assert rec is not None and rec.lease_until == T0 + 90_000, (
                f"LEASE-1: a heartbeat extends lease_until to T0+90000; got {getattr(rec, 'lease_until', None)!r}"
            )
            old = await j.due(t.a, upto=T0 + LEASE_MS)
            assert old == [], f"LEASE-1: after a heartbeat the record is not due at the old deadline; due lists {old!r}"
            stolen = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS)
            assert stolen is None, (
                f"LEASE-1/REPL-3: a lease extended by heartbeat cannot be claimed at the old deadline; got {_j(stolen)!r}"
            )
            await j.heartbeat(t.a, "r1", token=1, lease_until=T0 + 70_000)
            after = await j.get(t.a, "r1")
            assert after is not None and after.lease_until == T0 + 90_000, (
                "LEASE-1: a heartbeat never shortens a lease: after a heartbeat to T0+70000 the lease must stay "
                f"until T0+90000; got lease_until={getattr(after, 'lease_until', None)!r}"
            )
            early = await j.due(t.a, upto=T0 + 89_999)
            assert early == [], f"LEASE-1: a heartbeat never shortens a lease; due(T0+89999) lists {early!r}"
            stolen = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + 89_999)
            assert stolen is None, f"LEASE-1: a heartbeat never shortens a lease; a claim at T0+89999 returned {_j(stolen)!r}"
            due = await j.due(t.a, upto=T0 + 90_000)
            assert due == ["r1"], f"LEASE-1: the extended lease is due at its new lease_until; due lists {due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2", "REPL-1")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease2_an_unexpired_lease_is_never_claimed(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-2, REPL-1: while ``now < lease_until`` nobody claims the record —
        another owner (with or without ``recover``), or the holder's own incarnation —
        and a refused claim changes nothing."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1")
            attempts = [
                (OWNER_B, INC_2, T0, False),
                (OWNER_B, INC_2, T0 + LEASE_MS - 1, False),
                (OWNER_B, INC_2, T0 + LEASE_MS - 1, True),
                (OWNER_A, INC_1, T0 + LEASE_MS - 1, True),
            ]
            for owner, inc, now, recover in attempts:
                got = await j.claim(t.a, "r1", owner=owner, incarnation=inc, now=now, recover=recover)
                assert got is None, (
                    f"LEASE-2: an unexpired {journal} lease (until T0+60000) must not be claimed; a claim by "
                    f"{owner}/{inc} at {_when(now)} (recover={recover}) returned {_j(got)!r}"
                )
                after = await j.get(t.a, "r1")
                assert _j(after) == _j(rec), f"LEASE-2: a refused claim changes nothing; it changed {_changes(rec, after)}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease2_an_expired_lease_is_taken_over_with_a_larger_token(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-2: when a lease expires (``lease_until <= now``) another owner takes
        the record with a new, larger fencing token; and so on, each takeover with a
        larger token."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1")
            owners = [(OWNER_B, INC_2), (OWNER_A, INC_1), (OWNER_B, "incarnation-3")]
            for owner, inc in owners:
                now = rec.lease_until
                got = await j.claim(t.a, "r1", owner=owner, incarnation=inc, now=now)
                assert got is not None, (
                    f"LEASE-2: an expired {journal} lease (lease_until {_when(now)} <= now {_when(now)}) must be "
                    f"taken by another owner; the claim by {owner} returned None"
                )
                assert got.owner == owner and got.state == j.leased, (
                    f"LEASE-2: the takeover leases the record to the new owner {owner!r}; got {_j(got)!r}"
                )
                assert got.token > rec.token, (
                    f"LEASE-2: every new lease carries a larger fencing token; token went from {rec.token!r} to {got.token!r}"
                )
                rec = got

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2")
    def test_lease2_inbox_tokens_grow_across_every_claim(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """LEASE-2: an inbox record's fencing token grows strictly with every claim —
        after a takeover, a retry later, a kill and an operator replay, a completion and
        a replay: a replay never resets it."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            seen = [(await b.inbox_journal(t.a, inbound("m1")))[0].token]

            async def claim(now: float, why: str) -> InboxRecord:
                got = await b.inbox_claim(t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=now, lease_ms=LEASE_MS, recover=False)
                assert got is not None, f"LEASE-2: setting up: the claim {why} at {_when(now)} must succeed; got None"
                assert got.token > max(seen), (
                    f"LEASE-2: fencing tokens grow strictly with every claim; the claim {why} got token {got.token!r} "
                    f"after tokens {seen!r}"
                )
                seen.append(got.token)
                return got

            rec = await claim(T0 + LEASE_MS, "after the lease expired")
            assert await b.inbox_retry_later(t.a, "m1", token=rec.token, next_at=T0 + 70_000, error="e") is True
            rec = await claim(T0 + 70_000, "after retry_later")
            assert await b.inbox_kill(t.a, "m1", token=rec.token, now=T0 + 70_001, error="e") is True
            assert await b.inbox_replay(t.a, "m1", now=T0 + 70_002) is not None
            rec = await claim(T0 + 70_002, "after kill and replay")
            assert await b.inbox_complete(t.a, "m1", token=rec.token, now=T0 + 70_003, expires_at=None) is True
            assert await b.inbox_replay(t.a, "m1", now=T0 + 70_004) is not None
            await claim(T0 + 70_004, "after complete and replay")

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2")
    def test_lease2_outbox_tokens_grow_across_every_claim(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """LEASE-2: an outbox record's fencing token grows strictly with every claim —
        of an enqueued send, after a failure, after ``unknown`` and ``dead`` and an
        operator retry, after an expired lease: a retry never resets it."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            seen = [(await b.outbox_journal(t.a, outbound("k1", state="pending", next_at=T0)))[0].token]

            async def claim(now: float, why: str) -> OutboxRecord:
                got = await b.outbox_claim(t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=now, lease_ms=LEASE_MS, recover=False)
                assert got is not None, f"LEASE-2: setting up: the claim {why} at {_when(now)} must succeed; got None"
                assert got[0].token > max(seen), (
                    f"LEASE-2: fencing tokens grow strictly with every claim; the claim {why} got token {got[0].token!r} "
                    f"after tokens {seen!r}"
                )
                seen.append(got[0].token)
                return got[0]

            rec = await claim(T0, "of an enqueued send")
            assert await b.outbox_mark_failed(t.a, "k1", token=rec.token, next_at=T0 + 1_000, error="e") is True
            rec = await claim(T0 + 1_000, "after mark_failed")
            assert await b.outbox_mark_unknown(t.a, "k1", token=rec.token, now=T0 + 1_001) is True
            assert await b.outbox_retry(t.a, "k1", now=T0 + 1_002) is True
            rec = await claim(T0 + 1_002, "after unknown and retry")
            assert await b.outbox_mark_dead(t.a, "k1", token=rec.token, now=T0 + 1_003, error="e") is True
            assert await b.outbox_retry(t.a, "k1", now=T0 + 1_004) is True
            rec = await claim(T0 + 1_004, "after dead and retry")
            await claim(cast(float, rec.lease_until), "after the lease expired")  # a claimed send has a lease_until

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2", "REPL-1")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease2_a_stale_token_is_refused_and_changes_nothing(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-2, REPL-1: after another owner took the record over, every fenced
        operation of the old owner (its token) returns False and changes nothing — so
        does a token from the future; the new owner's token works. Once settled, no
        fenced operation applies, even with the current token."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            await j.journal(t.a, "r1")
            taken = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS)
            assert taken is not None, f"LEASE-2: setting up: the takeover of an expired {journal} lease must succeed"
            due = await j.due(t.a, upto=INF)
            for stale in (taken.token - 1, taken.token + 1):
                for name, call in j.fenced(t.a, "r1", stale, T0 + LEASE_MS + 1):
                    ok = await call()
                    assert ok is False, (
                        f"LEASE-2: {name} with a stale fencing token ({stale}; the lease's is {taken.token}) must be "
                        f"refused and return False; it returned {ok!r}"
                    )
                    after = await j.get(t.a, "r1")
                    assert _j(after) == _j(taken), (
                        f"LEASE-2: {name} with a stale fencing token ({stale}) must change nothing; it changed "
                        f"{_changes(taken, after)}"
                    )
                    now_due = await j.due(t.a, upto=INF)
                    assert now_due == due, f"LEASE-2: {name} with a stale token changed what is due: {due!r} -> {now_due!r}"
            ok = await j.settle(t.a, "r1", token=taken.token, now=T0 + LEASE_MS + 2)
            assert ok is True, f"LEASE-2: the new owner's token must work; settling with it returned {ok!r}"
            settled = await j.get(t.a, "r1")
            for name, call in j.fenced(t.a, "r1", taken.token, T0 + LEASE_MS + 3):
                ok = await call()
                after = await j.get(t.a, "r1")
                assert ok is False and _j(after) == _j(settled), (
                    f"LEASE-2: fenced operations apply only while the record is leased; {name} on a "
                    f"{settled.state} record returned {ok!r} and changed {_changes(settled, after)}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-4")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease4_a_restarted_incarnation_recovers_its_own_lease_at_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-4: with ``recover``, the same ``owner`` under another ``incarnation``
        takes back its unexpired lease at once, with a larger token; not without
        ``recover``, not under the same incarnation, never another owner. The dead
        incarnation's token is then stale."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1", owner=OWNER_A, incarnation=INC_1)
            refused = [
                (OWNER_A, INC_2, False, "without recover"),
                (OWNER_A, INC_1, True, "by the same incarnation"),
                (OWNER_B, INC_2, True, "by another owner"),
            ]
            for owner, inc, recover, why in refused:
                got = await j.claim(t.a, "r1", owner=owner, incarnation=inc, now=T0 + 1, recover=recover)
                assert got is None, (
                    f"LEASE-4: an unexpired {journal} lease is not recovered {why}; the claim returned {_j(got)!r}"
                )
            got = await j.claim(t.a, "r1", owner=OWNER_A, incarnation=INC_2, now=T0 + 1, recover=True)
            assert got is not None, (
                f"LEASE-4: the same owner under another incarnation must recover its unexpired {journal} lease at once "
                "(recover=True); the claim returned None"
            )
            assert (
                (got.owner, got.incarnation, got.lease_until) == (OWNER_A, INC_2, T0 + 1 + LEASE_MS) and got.token > rec.token
            ), (
                "LEASE-4: the recovered lease belongs to the new incarnation until now + lease_ms with a larger token; "
                f"got owner={got.owner!r}, incarnation={got.incarnation!r}, lease_until={got.lease_until!r}, "
                f"token {rec.token!r} -> {got.token!r}"
            )
            ok = await j.settle(t.a, "r1", token=rec.token, now=T0 + 2)
            assert ok is False, (
                f"LEASE-4/LEASE-2: the dead incarnation's token is stale after the recovery; settling returned {ok!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("REPL-1", "LEASE-2")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_repl1_concurrent_claims_have_exactly_one_winner(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """REPL-1: many owners claiming one expired lease at the same time: exactly one
        gets it (the stored owner is the winner, with a larger token); twice in a
        row."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1")
            for round_ in (1, 2):
                now = rec.lease_until
                results = await asyncio.gather(
                    *(j.claim(t.a, "r1", owner=f"owner-{round_}-{i}", incarnation=f"inc-{i}", now=now) for i in range(n))
                )
                winners = [r for r in results if r is not None]
                assert winners, (
                    f"LEASE-2: an expired {journal} lease must be taken by one of {n} concurrent claimers; none got it"
                )
                assert len(winners) == 1, (
                    f"REPL-1: two replicas never claim the same record: {n} concurrent claims of one expired {journal} "
                    f"lease must have exactly one winner; {len(winners)} claims returned a record "
                    f"(owners {[w.owner for w in winners]!r})"
                )
                stored = await j.get(t.a, "r1")
                assert stored is not None and stored.owner == winners[0].owner and stored.token == winners[0].token, (
                    f"REPL-1: the stored lease is the winner's ({winners[0].owner!r}, token {winners[0].token}); "
                    f"got {_j(stored)!r}"
                )
                assert stored.token > rec.token, (
                    f"LEASE-2: the winner's token must be larger than {rec.token}; got {stored.token}"
                )
                rec = stored

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # OUT — the outbox
    # ==================================================================================
    @pytest.mark.spec("OUT-1", "OUT-5", "OUT-12", "OUT-15")
    def test_out1_journal_stores_the_send_as_given(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-1, OUT-5, OUT-12, OUT-15: ``outbox_journal`` of a new key creates the
        record and returns it with ``created=True``; ``outbox_get`` returns exactly
        what was journaled — the content as JSON with bytes as base64, the fingerprint,
        the part link, unknown fields. A record journaled ``sending`` is leased to its
        owner at once: nobody else can claim it."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            photo = {"type": "image", "image": {"$bytes": "iVBORw0KGgo="}, "caption": "héllo ✓ 🤖"}
            first = outbound("m1:1", content=photo)
            first.rule, first.inbound_id, first.fingerprint = "derived", "m1", "sha256:" + "ab" * 32
            first.extra = {"x_future_field": [1, {"kept": True}]}
            second = outbound("m1:1#2", state="pending", text="part two", previous_part="m1:1", part=2, seq=2)
            for rec in (first, second):
                absent = await b.outbox_get(t.a, rec.key)
                assert absent is None, f"OUT-1: outbox_get of a key never journaled must return None; got {absent!r}"
                stored, created = await b.outbox_journal(t.a, rec)
                assert created is True, f"OUT-1: outbox_journal of a new key must return created=True; got {created!r}"
                assert _j(stored) == _j(rec), (
                    f"OUT-1: outbox_journal returns the record journaled; differs in {_changes(rec, stored)}"
                )
                got = await b.outbox_get(t.a, rec.key)
                assert _j(got) == _j(rec), (
                    "OUT-1: a send is journaled before the provider is called, exactly as given (content with bytes "
                    f"as base64, fingerprint, part link, unknown fields); outbox_get of {rec.key!r} differs in "
                    f"{_changes(rec, got)}"
                )
            stolen = await b.outbox_claim(
                t.a, "m1:1", owner=OWNER_B, incarnation=INC_2, now=T0 + 1, lease_ms=LEASE_MS, recover=True
            )
            assert stolen is None, (
                f"OUT-1: a record journaled in state sending is leased to its owner; another owner's claim returned {stolen!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-1")
    def test_out1_mark_sent_stores_the_message_id(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-1: right after the provider answers, ``outbox_mark_sent`` with the lease's
        token records the provider's message id and state ``sent`` — for an inline send
        and for a claimed enqueued one; a sent record is listed as sent and never
        due."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-inline"))
            await b.outbox_journal(t.a, outbound("k-queued", state="pending"))
            claim = await b.outbox_claim(
                t.a, "k-queued", owner=OWNER_A, incarnation=INC_1, now=T0, lease_ms=LEASE_MS, recover=False
            )
            assert claim is not None, "OUT-1: setting up: the claim of a due pending send must succeed"
            for key, token, message_id in (("k-inline", 1, "wamid.HBgL-1"), ("k-queued", claim[0].token, "wamid.HBgL-2")):
                ok = await b.outbox_mark_sent(t.a, key, token=token, message_id=message_id, now=T0 + 10, expires_at=T0 + 1000)
                assert ok is True, f"OUT-1: outbox_mark_sent with the lease's token must return True; got {ok!r}"
                rec = await b.outbox_get(t.a, key)
                assert rec is not None and rec.state == "sent", (
                    f"OUT-1: outbox_mark_sent records state sent; {key!r} is in state {getattr(rec, 'state', None)!r}"
                )
                assert rec.message_id == message_id, (
                    f"OUT-1: outbox_mark_sent stores the provider's message id {message_id!r}; {key!r} has "
                    f"{rec.message_id!r}"
                )
            listed = sorted(r.key for r in await b.outbox_list(t.a, state="sent"))
            assert listed == ["k-inline", "k-queued"], f"OUT-1: outbox_list(state='sent') must list both; got {listed!r}"
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"OUT-1: a sent record is never due; outbox_due lists {due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-2")
    def test_out2_a_sent_record_stays_sent(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-2: a send whose key is ``sent`` is answered from the outbox: journaling
        its key again returns the sent record (``created=False``); no claim, no fenced
        operation, no ``mark_dead``, ``split`` or ``retry`` changes it; it is never
        due."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k1"))
            assert await b.outbox_mark_sent(t.a, "k1", token=1, message_id="wamid.1", now=T0 + 1, expires_at=None) is True
            sent = await b.outbox_get(t.a, "k1")
            stored, created = await b.outbox_journal(t.a, outbound("k1", text="other content", owner=OWNER_B, now=T0 + 5))
            assert created is False and _j(stored) == _j(sent), (
                "OUT-2: journaling a key that is already sent returns the sent record and created=False; got "
                f"created={created!r}, record differing in {_changes(sent, stored)}"
            )
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("outbox_claim (expired, other owner)", lambda: b.outbox_claim(
                    t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=False
                )),
                ("outbox_claim (recover, same owner)", lambda: b.outbox_claim(
                    t.a, "k1", owner=OWNER_A, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
                )),
                ("outbox_mark_sent (again)", lambda: b.outbox_mark_sent(
                    t.a, "k1", token=1, message_id="wamid.2", now=T0 + 2, expires_at=None
                )),
                ("outbox_mark_failed", lambda: b.outbox_mark_failed(t.a, "k1", token=1, next_at=T0 + 2, error="e")),
                ("outbox_mark_unknown", lambda: b.outbox_mark_unknown(t.a, "k1", token=1, now=T0 + 2)),
                ("outbox_mark_dead (token)", lambda: b.outbox_mark_dead(t.a, "k1", token=1, now=T0 + 2, error="e")),
                ("outbox_mark_dead (token=None)", lambda: b.outbox_mark_dead(t.a, "k1", token=None, now=T0 + 2, error="e")),
                ("outbox_heartbeat", lambda: b.outbox_heartbeat(t.a, "k1", token=1, lease_until=FAR)),
                ("outbox_split (token=None)", lambda: b.outbox_split(
                    t.a, "k1", token=None, content={"type": "text", "text": "x"}
                )),
                ("outbox_retry", lambda: b.outbox_retry(t.a, "k1", now=T0 + 2)),
            ]
            for name, call in calls:
                result = await call()
                after = await b.outbox_get(t.a, "k1")
                assert result in (None, False) and _j(after) == _j(sent), (
                    f"OUT-2: a sent record stays sent: {name} must be refused and change nothing; it returned "
                    f"{result!r} and changed {_changes(sent, after)}"
                )
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"OUT-2: a sent record is never due; outbox_due lists {due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-2", "OUT-10")
    def test_out2_journal_of_an_existing_key_returns_the_stored_record(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-2, OUT-10: the outbox journal is create-if-absent by idempotency key:
        journaling a key that exists — pending, sending or failed — returns the stored
        record and ``created=False`` and changes nothing (a second enqueue of the same
        key does nothing)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("reminder:1", state="pending", text="first", next_at=T0 + 100))
            await b.outbox_journal(t.a, outbound("k-sending", text="first"))
            await b.outbox_journal(t.a, outbound("k-failed", text="first"))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 50, error="e") is True
            for key in ("reminder:1", "k-sending", "k-failed"):
                before = await b.outbox_get(t.a, key)
                for state in ("pending", "sending"):
                    again = outbound(key, state=state, chat_id="chat-2", text="second", owner=OWNER_B, now=T0 + 7)
                    stored, created = await b.outbox_journal(t.a, again)
                    assert created is False and _j(stored) == _j(before), (
                        f"OUT-2/OUT-10: outbox_journal of the existing key {key!r} ({getattr(before, 'state', None)}) "
                        f"must return the stored record and created=False; got created={created!r}, record differing in "
                        f"{_changes(before, stored)}"
                    )
                    after = await b.outbox_get(t.a, key)
                    assert _j(after) == _j(before), (
                        f"OUT-2/OUT-10: journaling an existing key changes nothing; {key!r} changed {_changes(before, after)}"
                    )
            count = len(await b.outbox_list(t.a))
            assert count == 3, f"OUT-2: one key is one record; outbox_list shows {count} records for 3 keys"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-10", "REPL-1")
    def test_out10_concurrent_journals_of_one_key_create_it_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-10, REPL-1: many tasks journaling one idempotency key at once create it
        exactly once; every other call gets the stored record and ``created=False``."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            records = [outbound("reminder:1", state="pending", text=f"copy {i}", seq=i) for i in range(n)]
            outcomes = await asyncio.gather(*(b.outbox_journal(t.a, r) for r in records))
            created = [i for i, (_, c) in enumerate(outcomes) if c]
            assert len(created) == 1, (
                f"OUT-10/REPL-1: {n} concurrent outbox_journal calls of one key must create it exactly once; "
                f"{len(created)} returned created=True"
            )
            stored = await b.outbox_get(t.a, "reminder:1")
            assert _j(stored) == _j(records[created[0]]), (
                f"OUT-10: the stored record must be the creator's; differs in {_changes(records[created[0]], stored)}"
            )
            wrong = [i for i, (r, _) in enumerate(outcomes) if _j(r) != _j(stored)]
            assert not wrong, f"OUT-10: every other concurrent journal must return the stored record; calls {wrong} did not"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-10")
    def test_out10_an_enqueued_send_is_due_and_claimable_at_next_at(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-10: an enqueued (``pending``) send is due at its ``next_at`` and not
        before; it is claimable from then on: the claim returns it ``sending`` with a
        larger token, one more attempt, and the previous state ``pending``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            rec = (await b.outbox_journal(t.a, outbound("reminder:1", state="pending", next_at=T0 + 1_000)))[0]
            early = await b.outbox_due(t.a, upto=T0 + 999, limit=10)
            on_time = await b.outbox_due(t.a, upto=T0 + 1_000, limit=10)
            assert early == [] and on_time == ["reminder:1"], (
                f"OUT-10: an enqueued send is due at its next_at (T0+1000), not before; due(T0+999) = {early!r}, "
                f"due(T0+1000) = {on_time!r}"
            )
            got = await b.outbox_claim(
                t.a, "reminder:1", owner=OWNER_A, incarnation=INC_1, now=T0 + 999, lease_ms=LEASE_MS, recover=False
            )
            assert got is None, f"OUT-10: an enqueued send is not claimable before its next_at; the claim returned {got!r}"
            got = await b.outbox_claim(
                t.a, "reminder:1", owner=OWNER_A, incarnation=INC_1, now=T0 + 1_000, lease_ms=LEASE_MS, recover=False
            )
            assert got is not None, "OUT-10: an enqueued send is claimable at its next_at; the claim returned None"
            new, previous = got
            assert (new.state, previous, new.owner) == ("sending", "pending", OWNER_A), (
                "OUT-10: the claim returns the record in state sending, leased to the claimer, and the previous "
                f"state 'pending'; got state={new.state!r}, previous={previous!r}, owner={new.owner!r}"
            )
            assert new.token > rec.token and new.attempts == rec.attempts + 1, (
                f"OUT-10/LEASE-2: the claim gives a larger token and one more attempt; token {rec.token} -> "
                f"{new.token}, attempts {rec.attempts} -> {new.attempts}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-7")
    def test_out7_a_failed_send_is_retried_at_next_at(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-7: ``outbox_mark_failed`` with the lease's token moves the send to
        ``failed`` with its retry time and error; it is due and claimable only from
        ``next_at`` on; the claim counts one more attempt and reports the previous
        state ``failed``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k1"))
            ok = await b.outbox_mark_failed(t.a, "k1", token=1, next_at=T0 + 2_000, error="timeout")
            assert ok is True, f"OUT-7: outbox_mark_failed with the lease's token must return True; got {ok!r}"
            rec = await b.outbox_get(t.a, "k1")
            assert rec is not None and (rec.state, rec.next_at, rec.error) == ("failed", T0 + 2_000, "timeout"), (
                f"OUT-7: outbox_mark_failed records state failed, next_at and the error; got {_j(rec)!r}"
            )
            early = await b.outbox_due(t.a, upto=T0 + 1_999, limit=10)
            on_time = await b.outbox_due(t.a, upto=T0 + 2_000, limit=10)
            assert early == [] and on_time == ["k1"], (
                f"OUT-7: a failed send is due at its next_at (T0+2000), not before; due(T0+1999) = {early!r}, "
                f"due(T0+2000) = {on_time!r}"
            )
            got = await b.outbox_claim(
                t.a, "k1", owner=OWNER_A, incarnation=INC_1, now=T0 + 1_999, lease_ms=LEASE_MS, recover=False
            )
            assert got is None, f"OUT-7: a failed send is not retried before its next_at; the claim returned {got!r}"
            got = await b.outbox_claim(
                t.a, "k1", owner=OWNER_A, incarnation=INC_1, now=T0 + 2_000, lease_ms=LEASE_MS, recover=False
            )
            assert got is not None and got[1] == "failed" and got[0].state == "sending", (
                f"OUT-7: a failed send is claimable at next_at, returning (sending record, 'failed'); got {got!r}"
            )
            assert got[0].attempts == 2 and got[0].token > 1, (
                "OUT-7: the retry counts a second attempt with a larger token; got attempts "
                f"{got[0].attempts}, token {got[0].token}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-7", "OUT-10", "OUT-14")
    def test_out7_due_sends_are_listed_earliest_first(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-7, OUT-10, OUT-14: ``outbox_due`` lists the keys of ``pending`` (at
        ``next_at``), ``failed`` (at ``next_at``) and ``sending`` (at ``lease_until``)
        records whose time is ``<= upto`` (inclusive), earliest first, up to ``limit``;
        never a ``sent``, ``dead`` or ``unknown`` one. Key order is the reverse of time
        order."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("a-sending"))  # due T0+60000
            await b.outbox_journal(t.a, outbound("b-failed"))
            assert await b.outbox_mark_failed(t.a, "b-failed", token=1, next_at=T0 + 20_000, error="e") is True
            await b.outbox_journal(t.a, outbound("c-pending", state="pending", next_at=T0 + 10_000))
            await b.outbox_journal(t.a, outbound("d-sent"))
            assert await b.outbox_mark_sent(t.a, "d-sent", token=1, message_id="x", now=T0, expires_at=None) is True
            await b.outbox_journal(t.a, outbound("e-dead"))
            assert await b.outbox_mark_dead(t.a, "e-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("f-unknown"))
            assert await b.outbox_mark_unknown(t.a, "f-unknown", token=1, now=T0) is True
            cases: list[tuple[float, int, list[str]]] = [
                (INF, 100, ["c-pending", "b-failed", "a-sending"]),
                (T0 + 9_999, 100, []),
                (T0 + 10_000, 100, ["c-pending"]),
                (T0 + 20_000, 100, ["c-pending", "b-failed"]),
                (T0 + 59_999, 100, ["c-pending", "b-failed"]),
                (T0 + 60_000, 100, ["c-pending", "b-failed", "a-sending"]),
                (INF, 2, ["c-pending", "b-failed"]),
                (INF, 1, ["c-pending"]),
            ]
            for upto, limit, expected in cases:
                got = await b.outbox_due(t.a, upto=upto, limit=limit)
                assert got == expected, (
                    "OUT-7: outbox_due lists the keys of pending/failed/sending records due (retry time or lease "
                    f"expiry) <= upto, earliest first, up to limit (never sent, dead or unknown); upto={_when(upto)}, "
                    f"limit={limit}: expected {expected!r}, got {got!r}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-8", "OUT-12", "OPS-2")
    def test_out8_mark_dead_moves_a_send_to_the_dlq(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-8, OUT-12: ``outbox_mark_dead`` moves a send to ``dead`` with its error:
        fenced with a token; with ``None`` from any state but ``sent`` (a later part
        dies with an earlier one). A dead send is listed as dead (OPS-2), never due and
        never claimed."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-sending"))
            ok = await b.outbox_mark_dead(t.a, "k-sending", token=1, now=T0 + 1, error="UnsupportedContentError")
            rec = await b.outbox_get(t.a, "k-sending")
            assert ok is True and rec is not None and rec.state == "dead" and rec.error == "UnsupportedContentError", (
                f"OUT-8: outbox_mark_dead with the lease's token moves the send to dead with its error; it returned "
                f"{ok!r}, record {_j(rec)!r}"
            )
            await b.outbox_journal(t.a, outbound("k-part", state="pending", previous_part="k-sending", part=2))
            await b.outbox_journal(t.a, outbound("k-failed"))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 5, error="e") is True
            await b.outbox_journal(t.a, outbound("k-unknown"))
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            for key in ("k-part", "k-failed", "k-unknown"):
                ok = await b.outbox_mark_dead(t.a, key, token=None, now=T0 + 2, error="earlier part is dead")
                rec = await b.outbox_get(t.a, key)
                assert ok is True and rec is not None and rec.state == "dead", (
                    f"OUT-8/OUT-12: outbox_mark_dead with token=None moves a send in any state but sent to dead; "
                    f"{key!r} returned {ok!r}, state {getattr(rec, 'state', None)!r}"
                )
            listed = sorted(r.key for r in await b.outbox_list(t.a, state="dead"))
            assert listed == ["k-failed", "k-part", "k-sending", "k-unknown"], (
                f"OPS-2: outbox_list(state='dead') must list the DLQ; got {listed!r}"
            )
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"OUT-8: a dead send is never due; outbox_due lists {due!r}"
            got = await b.outbox_claim(
                t.a, "k-sending", owner=OWNER_A, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
            )
            assert got is None, f"OUT-8: a dead send is never claimed; the claim returned {got!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-14")
    def test_out14_an_expired_send_is_claimed_as_ambiguous_and_marked_unknown(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-14: the claim of a send whose ``sending`` lease expired (its owner died
        during the provider call) reports the previous state ``sending`` — the
        ambiguity the caller resolves; so does a recovery claim (LEASE-4).
        ``outbox_mark_unknown`` with the lease's token then records ``unknown``: listed,
        never due, never claimed."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k1"))
            got = await b.outbox_claim(
                t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS, lease_ms=LEASE_MS, recover=False
            )
            assert got is not None and got[1] == "sending", (
                f"OUT-14: the claim of an expired sending lease must report the previous state 'sending'; got {got!r}"
            )
            await b.outbox_journal(t.a, outbound("k2"))
            rec2 = await b.outbox_claim(t.a, "k2", owner=OWNER_A, incarnation=INC_2, now=T0 + 1, lease_ms=LEASE_MS, recover=True)
            assert rec2 is not None and rec2[1] == "sending", (
                f"OUT-14/LEASE-4: a recovery claim of a send in flight must report the previous state 'sending'; got {rec2!r}"
            )
            ok = await b.outbox_mark_unknown(t.a, "k1", token=got[0].token, now=T0 + LEASE_MS + 1)
            rec = await b.outbox_get(t.a, "k1")
            assert ok is True and rec is not None and rec.state == "unknown", (
                f"OUT-14: outbox_mark_unknown with the lease's token records state unknown; it returned {ok!r}, "
                f"state {getattr(rec, 'state', None)!r}"
            )
            listed = [r.key for r in await b.outbox_list(t.a, state="unknown")]
            assert listed == ["k1"], f"OUT-14: outbox_list(state='unknown') must list it; got {listed!r}"
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert "k1" not in due, f"OUT-14: an unknown send is skipped: never due; outbox_due lists {due!r}"
            again = await b.outbox_claim(t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True)
            assert again is None, f"OUT-14: an unknown send is never claimed (never duplicated); the claim returned {again!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-12")
    def test_out12_parts_are_independent_records_linked_by_previous_part(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-12: parts ``key``, ``key#2``, ``key#3`` are independent records; the link
        is the stored ``previous_part``, never inferred from the key: a user's key
        ending in ``#2`` has none, and a part keeps its link when the earlier part is
        discarded."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            parts = [
                outbound("k", state="pending", text="one", part=1),
                outbound("k#2", state="pending", text="two", previous_part="k", part=2),
                outbound("k#3", state="pending", text="three", previous_part="k#2", part=3),
                outbound("user#2", state="pending", text="mine"),
            ]
            for rec in parts:
                _, created = await b.outbox_journal(t.a, rec)
                assert created is True, (
                    f"OUT-12: each part is its own record; journaling {rec.key!r} returned created={created!r}"
                )
            for rec in parts:
                got = await b.outbox_get(t.a, rec.key)
                assert got is not None and (
                    (got.previous_part, got.part, got.content) == (rec.previous_part, rec.part, rec.content)
                ), (
                    f"OUT-12: the part link is stored in the record; {rec.key!r}: expected previous_part="
                    f"{rec.previous_part!r}, part={rec.part}, got {_j(got)!r}"
                )
            assert await b.outbox_discard(t.a, "k") is True
            second = await b.outbox_get(t.a, "k#2")
            assert second is not None and second.previous_part == "k", (
                f"OUT-12: discarding the first part leaves the second with its link; got {_j(second)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-13")
    def test_out13_split_replaces_the_content_and_nothing_else(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-13: ``outbox_split`` replaces a record's content by its first part and
        changes nothing else: with ``token=None`` only for a ``pending``/``failed``
        record, with a token only for the ``sending`` lease of that token."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            first: dict[str, object] = {"type": "text", "text": "first part"}
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", text="x" * 5000))
            before = await b.outbox_get(t.a, "k-pending")
            assert before is not None
            ok = await b.outbox_split(t.a, "k-pending", token=None, content=first)
            after = await b.outbox_get(t.a, "k-pending")
            assert ok is True and after is not None and after.content == first, (
                f"OUT-13: outbox_split(token=None) of a pending record replaces its content; it returned {ok!r}, "
                f"content {getattr(after, 'content', None)!r}"
            )
            assert _j(after.copy(content=before.content)) == _j(before), (
                f"OUT-13: outbox_split changes the content only; it also changed {_changes(before.copy(content=first), after)}"
            )
            await b.outbox_journal(t.a, outbound("k-sending", text="y" * 5000))
            sending = await b.outbox_get(t.a, "k-sending")
            for token in (None, 0, 2):
                ok = await b.outbox_split(t.a, "k-sending", token=token, content=first)
                now = await b.outbox_get(t.a, "k-sending")
                assert ok is False and _j(now) == _j(sending), (
                    f"OUT-13: outbox_split of a sending record needs its lease's token (1); with token={token!r} it "
                    f"returned {ok!r} and changed {_changes(sending, now)}"
                )
            ok = await b.outbox_split(t.a, "k-sending", token=1, content=first)
            now = await b.outbox_get(t.a, "k-sending")
            assert ok is True and now is not None and now.content == first and now.state == "sending", (
                f"OUT-13: outbox_split with the lease's token replaces the content; it returned {ok!r}, got {_j(now)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # OPS — the operator API and retention
    # ==================================================================================
    @pytest.mark.spec("OPS-2")
    def test_ops2_inbox_list_filters_by_state_in_id_order(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``inbox_list`` lists the records ordered by id — all of them, or
        those of one state (``"dead"`` is the DLQ) — up to ``limit``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            for id in ("m5", "m4", "m3", "m2", "m1"):
                await b.inbox_journal(t.a, inbound(id))
            assert await b.inbox_retry_later(t.a, "m2", token=1, next_at=T0 + 1, error="e") is True
            assert await b.inbox_complete(t.a, "m3", token=1, now=T0, expires_at=None) is True
            assert await b.inbox_kill(t.a, "m1", token=1, now=T0, error="e") is True
            assert await b.inbox_kill(t.a, "m5", token=None, now=T0, error="e") is True
            cases: list[tuple[str | None, int, list[str]]] = [
                (None, 1000, ["m1", "m2", "m3", "m4", "m5"]),
                ("dead", 1000, ["m1", "m5"]),
                ("done", 1000, ["m3"]),
                ("pending", 1000, ["m2"]),
                ("leased", 1000, ["m4"]),
                (None, 2, ["m1", "m2"]),
                ("dead", 1, ["m1"]),
            ]
            for state, limit, expected in cases:
                got = [r.id for r in await b.inbox_list(t.a, state=state, limit=limit)]
                assert got == expected, (
                    f"OPS-2: inbox_list(state={state!r}, limit={limit}) lists the records of that state ordered by id; "
                    f"expected {expected!r}, got {got!r}"
                )
            states = {r.id: r.state for r in await b.inbox_list(t.a)}
            expected_states = {"m1": "dead", "m2": "pending", "m3": "done", "m4": "leased", "m5": "dead"}
            assert states == expected_states, (
                f"OPS-2: inbox_list shows each record's state; expected {expected_states!r}, got {states!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_outbox_list_filters_by_state(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``outbox_list`` lists the records — all of them, or those of one
        state (``"dead"`` is the DLQ) — up to ``limit``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            for key in ("k-sending", "k-failed", "k-sent", "k-dead", "k-dead-2", "k-unknown"):
                await b.outbox_journal(t.a, outbound(key))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 1, error="e") is True
            assert await b.outbox_mark_sent(t.a, "k-sent", token=1, message_id="x", now=T0, expires_at=None) is True
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            assert await b.outbox_mark_dead(t.a, "k-dead-2", token=None, now=T0, error="e") is True
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            expected: dict[str | None, list[str]] = {
                None: ["k-dead", "k-dead-2", "k-failed", "k-pending", "k-sending", "k-sent", "k-unknown"],
                "dead": ["k-dead", "k-dead-2"],
                "pending": ["k-pending"],
                "sending": ["k-sending"],
                "failed": ["k-failed"],
                "sent": ["k-sent"],
                "unknown": ["k-unknown"],
            }
            for state, keys in expected.items():
                got = sorted(r.key for r in await b.outbox_list(t.a, state=state))
                assert got == keys, f"OPS-2: outbox_list(state={state!r}) lists exactly {keys!r}; got {got!r}"
            limited = await b.outbox_list(t.a, limit=3)
            assert len(limited) == 3, f"OPS-2: outbox_list(limit=3) lists 3 of the 7 records; got {len(limited)}"
            limited = await b.outbox_list(t.a, state="dead", limit=1)
            assert len(limited) == 1 and limited[0].state == "dead", (
                f"OPS-2: outbox_list(state='dead', limit=1) lists one dead record; got {[_j(r) for r in limited]!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2", "INB-7")
    def test_ops2_replay_of_a_dead_inbound(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``inbox_replay`` makes a ``dead`` (or ``done``) record ``pending`` now
        with its attempts reset (INB-7) and returns it; it is then due and claimable at
        once. A leased record or an absent id gives None and changes nothing."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))
            assert await b.inbox_kill(t.a, "m1", token=1, now=T0 + 1, error="poison") is True
            replayed = await b.inbox_replay(t.a, "m1", now=T0 + 100)
            stored = await b.inbox_get(t.a, "m1")
            assert replayed is not None and _j(replayed) == _j(stored), (
                "OPS-2: inbox_replay of a dead record returns the stored record; returned "
                f"{_j(replayed)!r}, stored {_j(stored)!r}"
            )
            assert stored is not None and stored.state == "pending" and stored.attempts == 0, (
                f"OPS-2/INB-7: a replayed record is pending with its attempts reset; got {_j(stored)!r}"
            )
            dead = [r.id for r in await b.inbox_list(t.a, state="dead")]
            assert dead == [], f"OPS-2: a replayed record leaves the DLQ; inbox_list(state='dead') = {dead!r}"
            early = await b.inbox_due(t.a, upto=T0 + 99, limit=10)
            on_time = await b.inbox_due(t.a, upto=T0 + 100, limit=10)
            assert early == [] and on_time == ["m1"], (
                f"OPS-2: a replayed record is due now (T0+100); due(T0+99) = {early!r}, due(T0+100) = {on_time!r}"
            )
            claimed = await b.inbox_claim(
                t.a, "m1", owner=OWNER_A, incarnation=INC_1, now=T0 + 100, lease_ms=LEASE_MS, recover=False
            )
            assert claimed is not None and claimed.attempts == 1 and claimed.token > 1, (
                "OPS-2: a replayed record is claimable now, as a first charged execution with a larger token; "
                f"got {_j(claimed)!r}"
            )
            leased = await b.inbox_get(t.a, "m1")
            refused = await b.inbox_replay(t.a, "m1", now=T0 + 101)
            after = await b.inbox_get(t.a, "m1")
            assert refused is None and _j(after) == _j(leased), (
                f"OPS-2: inbox_replay of a leased record returns None and changes nothing; it returned {_j(refused)!r} "
                f"and changed {_changes(leased, after)}"
            )
            absent = await b.inbox_replay(t.a, "nope", now=T0 + 101)
            assert absent is None, f"OPS-2: inbox_replay of an absent id returns None; got {_j(absent)!r}"
            assert await b.inbox_complete(t.a, "m1", token=claimed.token, now=T0 + 102, expires_at=None) is True
            again = await b.inbox_replay(t.a, "m1", now=T0 + 103)
            assert again is not None and again.state == "pending", (
                f"OPS-2: inbox_replay of a done record makes it pending again; got {_j(again)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_retry_send_of_a_dead_failed_or_unknown_send(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-2: ``outbox_retry`` makes a ``dead``, ``failed`` or ``unknown`` send
        ``pending`` now with its attempts reset; it is due and claimable at once. A
        ``sent``, ``sending`` or ``pending`` send, or an absent key, gives False and
        changes nothing."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            for key in ("k-dead", "k-failed", "k-unknown", "k-sent", "k-sending"):
                await b.outbox_journal(t.a, outbound(key))
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", next_at=T0 + 500))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 10_000, error="e") is True
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            assert await b.outbox_mark_sent(t.a, "k-sent", token=1, message_id="x", now=T0, expires_at=None) is True
            for key in ("k-dead", "k-failed", "k-unknown"):
                ok = await b.outbox_retry(t.a, key, now=T0 + 100)
                rec = await b.outbox_get(t.a, key)
                assert ok is True and rec is not None and rec.state == "pending" and rec.attempts == 0, (
                    f"OPS-2: outbox_retry of a {key[2:]} send makes it pending now with attempts reset; it returned "
                    f"{ok!r}, record {_j(rec)!r}"
                )
            due = await b.outbox_due(t.a, upto=T0 + 100, limit=100)
            assert sorted(due) == ["k-dead", "k-failed", "k-unknown"], (
                f"OPS-2: retried sends are due now (T0+100); outbox_due lists {due!r}"
            )
            for key in ("k-dead", "k-failed", "k-unknown"):
                got = await b.outbox_claim(
                    t.a, key, owner=OWNER_A, incarnation=INC_1, now=T0 + 100, lease_ms=LEASE_MS, recover=False
                )
                assert got is not None and got[0].attempts == 1 and got[0].token > 1, (
                    f"OPS-2: a retried send is claimable now, as a first attempt with a larger token; {key!r}: {got!r}"
                )
            for key in ("k-sent", "k-sending", "k-pending", "absent"):
                before = await b.outbox_get(t.a, key)
                ok = await b.outbox_retry(t.a, key, now=T0 + 100)
                after = await b.outbox_get(t.a, key)
                assert ok is False and _j(after) == _j(before), (
                    f"OPS-2: outbox_retry applies to dead, failed or unknown sends only; on {key!r} it returned {ok!r} "
                    f"and changed {_changes(before, after)}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_discard_forgets_a_send(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``outbox_discard`` forgets a send entirely — gone from get, list and
        due — and returns True; a second discard returns False; the key can then be
        journaled anew."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-dead"))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            await b.outbox_journal(t.a, outbound("k-keep", state="pending"))
            for key in ("k-dead", "k-pending"):
                ok = await b.outbox_discard(t.a, key)
                assert ok is True, f"OPS-2: outbox_discard of an existing send returns True; {key!r} returned {ok!r}"
                gone = await b.outbox_get(t.a, key)
                assert gone is None, f"OPS-2: a discarded send is forgotten; outbox_get({key!r}) returned {_j(gone)!r}"
                again = await b.outbox_discard(t.a, key)
                assert again is False, f"OPS-2: a second outbox_discard returns False; {key!r} returned {again!r}"
            listed = [r.key for r in await b.outbox_list(t.a)]
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert listed == ["k-keep"] and due == ["k-keep"], (
                f"OPS-2: discarded sends are gone from list and due; outbox_list = {listed!r}, outbox_due = {due!r}"
            )
            _, created = await b.outbox_journal(t.a, outbound("k-dead", state="pending"))
            assert created is True, f"OPS-2: a discarded key can be journaled anew; created={created!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-3", "INB-4")
    def test_ops3_inbox_purge_removes_only_expired_done_records(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-3: ``inbox_purge`` deletes up to ``limit`` ``done`` records whose
        ``expires_at <= now`` and returns how many; nothing else — not a done record
        expiring later or kept (``None``), not a leased, pending, dead or replayed one.
        A redelivery is recognised only while its record exists (INB-4)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            expiries = {"d1": T0 + 100, "d2": T0 + 200, "d3": T0 + 300, "d4": None, "r1": T0 + 100}
            for id, expires in expiries.items():
                await b.inbox_journal(t.a, inbound(id))
                assert await b.inbox_complete(t.a, id, token=1, now=T0, expires_at=expires) is True
            assert await b.inbox_replay(t.a, "r1", now=T0 + 1) is not None  # pending again: not purgeable
            await b.inbox_journal(t.a, inbound("l1"))
            await b.inbox_journal(t.a, inbound("p1"))
            assert await b.inbox_retry_later(t.a, "p1", token=1, next_at=T0 + 50, error="e") is True
            await b.inbox_journal(t.a, inbound("x1"))
            assert await b.inbox_kill(t.a, "x1", token=1, now=T0, error="e") is True
            before = {r.id: _j(r) for r in await b.inbox_list(t.a)}
            first = await b.inbox_purge(t.a, now=T0 + 250, limit=1)
            assert first == 1, f"OPS-3: inbox_purge(limit=1) deletes one of the two expired done records; it returned {first!r}"
            rest = await b.inbox_purge(t.a, now=T0 + 250, limit=100)
            assert rest == 1, f"OPS-3: the second inbox_purge deletes the other expired done record; it returned {rest!r}"
            after = {r.id: _j(r) for r in await b.inbox_list(t.a)}
            kept = {k: v for k, v in before.items() if k not in ("d1", "d2")}
            assert after == kept, (
                "OPS-3: inbox_purge deletes only done records whose expires_at <= now (d1, d2 at T0+250), nothing "
                f"else; expected ids {sorted(kept)!r}, got {sorted(after)!r}"
                + ("" if sorted(after) != sorted(kept) else "; a kept record changed")
            )
            none_left = await b.inbox_purge(t.a, now=T0 + 250, limit=100)
            assert none_left == 0, f"OPS-3: nothing else is purgeable at T0+250; inbox_purge returned {none_left!r}"
            _, created = await b.inbox_journal(t.a, inbound("d1", now=T0 + 300))
            assert created is True, (
                f"OPS-3/INB-4: a redelivery is recognised only while its record exists; after the purge the id is new, "
                f"created={created!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-3", "OUT-2")
    def test_ops3_outbox_purge_removes_only_expired_sent_records(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-3: ``outbox_purge`` deletes up to ``limit`` ``sent`` records whose
        ``expires_at <= now`` and returns how many; nothing else — not a sent record
        expiring later or kept (``None``), not a pending, sending, failed, dead or
        unknown one."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            expiries = {"s1": T0 + 100, "s2": T0 + 200, "s3": T0 + 300, "s4": None}
            for key, expires in expiries.items():
                await b.outbox_journal(t.a, outbound(key))
                assert await b.outbox_mark_sent(t.a, key, token=1, message_id=f"id-{key}", now=T0, expires_at=expires) is True
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            for key in ("k-sending", "k-failed", "k-dead", "k-unknown"):
                await b.outbox_journal(t.a, outbound(key))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 5, error="e") is True
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            before = {r.key: _j(r) for r in await b.outbox_list(t.a)}
            first = await b.outbox_purge(t.a, now=T0 + 200, limit=1)
            assert first == 1, f"OPS-3: outbox_purge(limit=1) deletes one of the two expired sent records; it returned {first!r}"
            rest = await b.outbox_purge(t.a, now=T0 + 200, limit=100)
            assert rest == 1, f"OPS-3: the second outbox_purge deletes the other expired sent record; it returned {rest!r}"
            after = {r.key: _j(r) for r in await b.outbox_list(t.a)}
            kept = {k: v for k, v in before.items() if k not in ("s1", "s2")}
            assert after == kept, (
                "OPS-3: outbox_purge deletes only sent records whose expires_at <= now (s1, s2 at T0+200, inclusive), "
                f"nothing else; expected keys {sorted(kept)!r}, got {sorted(after)!r}"
                + ("" if sorted(after) != sorted(kept) else "; a kept record changed")
            )
            none_left = await b.outbox_purge(t.a, now=T0 + 200, limit=100)
            assert none_left == 0, f"OPS-3: nothing else is purgeable at T0+200; outbox_purge returned {none_left!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # SCOPE — several bots on one backend
    # ==================================================================================
    @pytest.mark.spec("SCOPE-1", "SCOPE-2", "INB-4")
    def test_scope2_inbox_scopes_never_see_each_other(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """SCOPE-1, SCOPE-2: the same id in two scopes is two independent inbox records
        (no cross-scope dedupe); get, list, due, claim, complete, kill, replay and
        purge in one scope never see or change the other's records (the second
        scope's name extends the first's)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            a_m1 = (await b.inbox_journal(t.a, inbound("m1", text="scope a")))[0]
            await b.inbox_journal(t.a, inbound("m2"))
            assert await b.inbox_complete(t.a, "m2", token=1, now=T0, expires_at=T0 + 10) is True
            await b.inbox_journal(t.a, inbound("m3"))
            assert await b.inbox_kill(t.a, "m3", token=1, now=T0, error="e") is True
            a_before = {r.id: _j(r) for r in await b.inbox_list(t.a)}

            got = await b.inbox_get(t.b, "m1")
            assert got is None, f"SCOPE-2: a record of one scope is invisible from another; inbox_get returned {_j(got)!r}"
            b_m1, created = await b.inbox_journal(t.b, inbound("m1", text="scope b", owner=OWNER_B, lease_ms=10_000))
            assert created is True and b_m1.event["text"] == "scope b", (
                "SCOPE-2/INB-4: a bot only deduplicates its own records: the same id in another scope is a new record; "
                f"got created={created!r}, record {_j(b_m1)!r}"
            )
            listed = [r.id for r in await b.inbox_list(t.b)]
            assert listed == ["m1"], f"SCOPE-2: inbox_list sees only its own scope; got {listed!r}"
            for state in ("done", "dead"):
                other = [r.id for r in await b.inbox_list(t.b, state=state)]
                assert other == [], f"SCOPE-2: inbox_list(state={state!r}) sees only its own scope; got {other!r}"
            due = await b.inbox_due(t.b, upto=INF, limit=100)
            assert due == ["m1"], f"SCOPE-2: inbox_due sees only its own scope; got {due!r}"
            claims = [
                ("inbox_claim of the other scope's record", await b.inbox_claim(
                    t.b, "m3", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
                )),
                ("inbox_replay of the other scope's dead record", await b.inbox_replay(t.b, "m3", now=T0)),
                ("inbox_kill of the other scope's record", await b.inbox_kill(t.b, "m2", token=None, now=T0, error="e") or None),
            ]
            for what, result in claims:
                assert result is None, (
                    f"SCOPE-2: {what} must find nothing; it returned {_j(result) if not isinstance(result, bool) else result!r}"
                )
            assert await b.inbox_complete(t.b, "m1", token=b_m1.token, now=T0, expires_at=T0 + 5) is True
            purged = await b.inbox_purge(t.b, now=FAR, limit=100)
            assert purged == 1, f"SCOPE-2: inbox_purge purges its own scope's expired record only; it returned {purged!r}"
            a_after = {r.id: _j(r) for r in await b.inbox_list(t.a)}
            assert a_after == a_before, (
                "SCOPE-2: operations in one scope never change another scope's records; scope a changed: "
                f"{sorted(a_before)!r} -> {sorted(a_after)!r}"
                + ("" if sorted(a_after) != sorted(a_before) else f"; m1 {_changes(a_m1, await b.inbox_get(t.a, 'm1'))}")
            )
            a_due = await b.inbox_due(t.a, upto=INF, limit=100)
            assert a_due == ["m1"], f"SCOPE-2: scope a's due records are its own; inbox_due lists {a_due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("SCOPE-2", "OUT-4")
    def test_scope2_outbox_scopes_never_see_each_other(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """SCOPE-2, OUT-4: explicit keys are per bot: the same key in two scopes is two
        independent sends; get, list, due, claim, mark_sent, retry, discard and purge
        in one scope never see or change the other's records."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("reminder:1", text="a"))
            assert await b.outbox_mark_sent(t.a, "reminder:1", token=1, message_id="a-1", now=T0, expires_at=T0 + 10) is True
            await b.outbox_journal(t.a, outbound("k-dead"))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            a_before = {r.key: _j(r) for r in await b.outbox_list(t.a)}

            stored, created = await b.outbox_journal(t.b, outbound("reminder:1", state="pending", text="b"))
            assert created is True and stored.content["text"] == "b" and stored.state == "pending", (
                "SCOPE-2/OUT-4: explicit keys are per bot: the same key in another scope is a new send; got "
                f"created={created!r}, record {_j(stored)!r}"
            )
            listed = [r.key for r in await b.outbox_list(t.b)]
            assert listed == ["reminder:1"], f"SCOPE-2: outbox_list sees only its own scope; got {listed!r}"
            sent = [r.key for r in await b.outbox_list(t.b, state="sent")]
            assert sent == [], f"SCOPE-2: outbox_list(state='sent') sees only its own scope; got {sent!r}"
            due = await b.outbox_due(t.b, upto=INF, limit=100)
            assert due == ["reminder:1"], f"SCOPE-2: outbox_due sees only its own scope; got {due!r}"
            results: list[tuple[str, Any]] = [
                ("outbox_get of the other scope's key", await b.outbox_get(t.b, "k-dead")),
                ("outbox_claim of the other scope's key", await b.outbox_claim(
                    t.b, "k-pending", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
                )),
                ("outbox_retry of the other scope's dead send", await b.outbox_retry(t.b, "k-dead", now=T0) or None),
                ("outbox_discard of the other scope's send", await b.outbox_discard(t.b, "k-pending") or None),
                ("outbox_mark_dead of the other scope's send",
                 await b.outbox_mark_dead(t.b, "k-pending", token=None, now=T0, error="e") or None),
            ]
            for what, result in results:
                assert result is None, f"SCOPE-2: {what} must find nothing; it returned {result!r}"
            claim = await b.outbox_claim(
                t.b, "reminder:1", owner=OWNER_B, incarnation=INC_2, now=T0, lease_ms=LEASE_MS, recover=False
            )
            assert claim is not None, "SCOPE-2: setting up: scope b's own pending send must be claimable"
            assert await b.outbox_mark_sent(
                t.b, "reminder:1", token=claim[0].token, message_id="b-1", now=T0, expires_at=T0 + 5
            ) is True
            purged = await b.outbox_purge(t.b, now=FAR, limit=100)
            assert purged == 1, f"SCOPE-2: outbox_purge purges its own scope's expired send only; it returned {purged!r}"
            a_after = {r.key: _j(r) for r in await b.outbox_list(t.a)}
            assert a_after == a_before, (
                "SCOPE-2: operations in one scope never change another scope's records; scope a changed: "
                f"{sorted(a_before)!r} -> {sorted(a_after)!r}"
            )
            b_after = await b.outbox_get(t.b, "reminder:1")
            assert b_after is None, f"SCOPE-2: scope b's purged send is gone; got {_j(b_after)!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # survival of a crash (survives_crash)
    # ==================================================================================
    @pytest.mark.spec("INB-3", "LEASE-2", "OPS-3", "BACK-7")
    def test_inb3_acknowledged_inbox_writes_survive_a_crash(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-3, LEASE-2, OPS-3 (``survives_crash``): every inbox write acknowledged
        before the process died is there after ``harness.reopen()`` — each record with
        its state and token, the due index (a leased record still due at its
        ``lease_until``, not before), the retention index (an expired done record is
        purged), fencing (a stale token is still refused, the next claim's token is
        larger) and dedupe (INB-4); then again after a second death. Skipped when the
        harness does not claim ``survives_crash``."""

        async def body(t: DurabilityTest) -> None:
            t.require("survives_crash")
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))  # leased until T0+60000
            await b.inbox_journal(t.a, inbound("m2"))
            assert await b.inbox_retry_later(t.a, "m2", token=1, next_at=T0 + 5_000, error="store down") is True
            await b.inbox_journal(t.a, inbound("m3"))
            assert await b.inbox_complete(t.a, "m3", token=1, now=T0, expires_at=T0 + 100) is True
            await b.inbox_journal(t.a, inbound("m4"))
            assert await b.inbox_kill(t.a, "m4", token=1, now=T0, error="poison") is True
            await b.inbox_journal(t.a, inbound("m5", lease_ms=1_000))
            taken = await b.inbox_claim(
                t.a, "m5", owner=OWNER_B, incarnation=INC_2, now=T0 + 1_000, lease_ms=LEASE_MS, recover=False
            )
            assert taken is not None and taken.token == 2
            await b.inbox_journal(t.a, inbound("m6"))
            assert await b.inbox_complete(t.a, "m6", token=1, now=T0, expires_at=None) is True
            await b.inbox_journal(t.b, inbound("m1", text="other scope"))
            before = {s: {r.id: _j(r) for r in await b.inbox_list(s)} for s in t.scopes.all}
            due_before = await b.inbox_due(t.a, upto=INF, limit=100)

            for death in (1, 2):
                b = await t.reopen()
                after = {s: {r.id: _j(r) for r in await b.inbox_list(s)} for s in t.scopes.all}
                for s in t.scopes.all:
                    missing = sorted(set(before[s]) - set(after[s]))
                    changed = sorted(k for k in before[s] if k in after[s] and after[s][k] != before[s][k])
                    assert not missing and not changed and after[s] == before[s], (
                        "INB-3: every inbox write acknowledged before a crash must be there after it "
                        f"(capabilities.survives_crash); after death #{death}, scope {s!r}: missing {missing!r}, "
                        f"changed {changed!r}, extra {sorted(set(after[s]) - set(before[s]))!r}"
                    )
                due = await b.inbox_due(t.a, upto=INF, limit=100)
                assert due == due_before, (
                    f"INB-3: the records left unfinished must still be due after a crash, in the same order; after death "
                    f"#{death}: expected {due_before!r}, got {due!r}"
                )
                if death == 1:
                    early = await b.inbox_due(t.a, upto=T0 + LEASE_MS - 1, limit=100)
                    at = await b.inbox_due(t.a, upto=T0 + LEASE_MS, limit=100)
                    assert "m1" not in early and "m1" in at, (
                        f"INB-3: a leased record is still due at its lease_until (T0+60000) after a crash, not before; "
                        f"due(T0+59999) = {early!r}, due(T0+60000) = {at!r}"
                    )
                    stale = await b.inbox_complete(t.a, "m5", token=1, now=T0 + 2_000, expires_at=None)
                    assert stale is False, (
                        f"LEASE-2: a stale token is still refused after a crash; inbox_complete returned {stale!r}"
                    )
                    purged = await b.inbox_purge(t.a, now=T0 + 100, limit=100)
                    assert purged == 1 and await b.inbox_get(t.a, "m3") is None, (
                        f"OPS-3: the retention of a done record survives a crash: purging at its expires_at deletes it; "
                        f"inbox_purge returned {purged!r}"
                    )
                    _, created = await b.inbox_journal(t.a, inbound("m1", text="redelivered"))
                    assert created is False, f"INB-4: dedupe survives a crash: journaling m1 again returned created={created!r}"
                    got = await b.inbox_claim(
                        t.a, "m5", owner=OWNER_A, incarnation=INC_1, now=T0 + 1_000 + LEASE_MS, lease_ms=LEASE_MS, recover=False
                    )
                    assert got is not None and got.token > 2, (
                        f"LEASE-2: fencing tokens keep growing across a crash: the next claim of m5 must get a token > 2; "
                        f"got {_j(got)!r}"
                    )
                    before = {s: {r.id: _j(r) for r in await b.inbox_list(s)} for s in t.scopes.all}
                    due_before = await b.inbox_due(t.a, upto=INF, limit=100)

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-2", "OUT-14", "LEASE-2", "OPS-3", "BACK-7")
    def test_out2_acknowledged_outbox_writes_survive_a_crash(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-2, OUT-14, LEASE-2, OPS-3 (``survives_crash``): every outbox write
        acknowledged before the process died is there after ``harness.reopen()`` — each
        send with its state, message id and token; the due index (a send in flight is
        due at its ``lease_until``, and claimed then as ambiguous: OUT-14); a sent key
        is still answered from the outbox (OUT-2); the retention index; fencing; then
        again after a second death. Skipped when the harness does not claim
        ``survives_crash``."""

        async def body(t: DurabilityTest) -> None:
            t.require("survives_crash")
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-sending"))  # lease until T0+60000
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", next_at=T0 + 1_000))
            await b.outbox_journal(t.a, outbound("k-failed"))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 2_000, error="timeout") is True
            await b.outbox_journal(t.a, outbound("k-sent"))
            assert await b.outbox_mark_sent(t.a, "k-sent", token=1, message_id="wamid.SENT", now=T0, expires_at=T0 + 100) is True
            await b.outbox_journal(t.a, outbound("k-kept"))
            assert await b.outbox_mark_sent(t.a, "k-kept", token=1, message_id="wamid.KEPT", now=T0, expires_at=None) is True
            await b.outbox_journal(t.a, outbound("k-dead"))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("k-unknown"))
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            await b.outbox_journal(t.b, outbound("k-sent", state="pending", text="other scope"))
            before = {s: {r.key: _j(r) for r in await b.outbox_list(s)} for s in t.scopes.all}
            due_before = await b.outbox_due(t.a, upto=INF, limit=100)

            for death in (1, 2):
                b = await t.reopen()
                after = {s: {r.key: _j(r) for r in await b.outbox_list(s)} for s in t.scopes.all}
                for s in t.scopes.all:
                    missing = sorted(set(before[s]) - set(after[s]))
                    changed = sorted(k for k in before[s] if k in after[s] and after[s][k] != before[s][k])
                    assert not missing and not changed and after[s] == before[s], (
                        "OUT-2: every outbox write acknowledged before a crash must be there after it "
                        f"(capabilities.survives_crash); after death #{death}, scope {s!r}: missing {missing!r}, "
                        f"changed {changed!r}, extra {sorted(set(after[s]) - set(before[s]))!r}"
                    )
                due = await b.outbox_due(t.a, upto=INF, limit=100)
                assert due == due_before, (
                    f"OUT-2: the sends left unfinished must still be due after a crash, in the same order; after death "
                    f"#{death}: expected {due_before!r}, got {due!r}"
                )
                if death == 1:
                    stored, created = await b.outbox_journal(t.a, outbound("k-sent", text="replayed"))
                    assert created is False and stored.state == "sent" and stored.message_id == "wamid.SENT", (
                        "OUT-2: a sent key is still answered from the outbox after a crash (the stored message id); got "
                        f"created={created!r}, record {_j(stored)!r}"
                    )
                    early = await b.outbox_due(t.a, upto=T0 + LEASE_MS - 1, limit=100)
                    assert "k-sending" not in early, (
                        f"OUT-14: a send in flight is not due before its lease_until after a crash; due(T0+59999) = {early!r}"
                    )
                    stolen = await b.outbox_claim(
                        t.a, "k-sending", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS - 1, lease_ms=LEASE_MS,
                        recover=False,
                    )
                    assert stolen is None, f"LEASE-2: an unexpired send lease survives a crash; a claim returned {stolen!r}"
                    got = await b.outbox_claim(
                        t.a, "k-sending", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS, lease_ms=LEASE_MS, recover=False
                    )
                    assert got is not None and got[1] == "sending" and got[0].token > 1, (
                        "OUT-14: after a crash, the send in flight is claimed at its lease_until as ambiguous "
                        f"(previous state 'sending') with a larger token; got {got!r}"
                    )
                    stale = await b.outbox_mark_sent(
                        t.a, "k-sending", token=1, message_id="late", now=T0 + LEASE_MS, expires_at=None
                    )
                    assert stale is False, (
                        f"LEASE-2: the dead owner's token is refused after a crash; outbox_mark_sent returned {stale!r}"
                    )
                    purged = await b.outbox_purge(t.a, now=T0 + 100, limit=100)
                    assert purged == 1 and await b.outbox_get(t.a, "k-sent") is None, (
                        f"OPS-3: the retention of a sent record survives a crash: purging at its expires_at deletes it; "
                        f"outbox_purge returned {purged!r}"
                    )
                    before = {s: {r.key: _j(r) for r in await b.outbox_list(s)} for s in t.scopes.all}
                    due_before = await b.outbox_due(t.a, upto=INF, limit=100)

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # several processes on one storage (multi_process)
    # ==================================================================================
    @pytest.mark.spec("REPL-1", "REPL-4", "LEASE-2", "INB-4")
    def test_repl4_two_processes_on_one_storage_claim_exclusively(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """REPL-1, REPL-4 (``multi_process``): two backends opened on the same storage
        (a second harness on the same ``workdir``, as another process would) see each
        other's records; a journal by one is a duplicate for the other (INB-4, OUT-2);
        concurrent claims from both have exactly one winner; the loser's stale token is
        refused by both (LEASE-2). Skipped when the harness does not claim
        ``multi_process``."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            t.require("multi_process")
            one = t.backend
            two = await t.another_process()
            await one.inbox_journal(t.a, inbound("m1"))
            seen = await two.inbox_get(t.a, "m1")
            assert seen is not None and seen.owner == OWNER_A, (
                f"REPL-4: a record journaled by one process is visible to another on the same storage; got {_j(seen)!r}"
            )
            _, created = await two.inbox_journal(t.a, inbound("m1", owner=OWNER_B))
            assert created is False, f"INB-4/REPL-4: a redelivery to another process is recognised; created={created!r}"
            results = await asyncio.gather(
                *(
                    (one if i % 2 == 0 else two).inbox_claim(
                        t.a, "m1", owner=f"owner-{i}", incarnation=f"inc-{i}", now=T0 + LEASE_MS, lease_ms=LEASE_MS, recover=False
                    )
                    for i in range(n)
                )
            )
            winners = [(i, r) for i, r in enumerate(results) if r is not None]
            assert winners, f"LEASE-2: an expired lease must be taken by one of {n} concurrent claimers; none got it"
            assert len(winners) == 1, (
                f"REPL-1: two processes never claim the same record: {n} concurrent claims from two backends on one "
                f"storage must have exactly one winner; {len(winners)} won"
            )
            winner, rec = winners[0]
            for name, backend in (("the first", one), ("the second", two)):
                got = await backend.inbox_get(t.a, "m1")
                assert got is not None and (got.owner, got.token) == (rec.owner, rec.token), (
                    f"REPL-1: {name} backend must see the winner's lease ({rec.owner}, token {rec.token}); got {_j(got)!r}"
                )
            loser = two if winner % 2 == 0 else one
            stale = await loser.inbox_complete(t.a, "m1", token=1, now=T0 + LEASE_MS + 1, expires_at=None)
            assert stale is False, f"LEASE-2/REPL-1: the old token is refused in another process too; it returned {stale!r}"
            holder = one if winner % 2 == 0 else two
            assert await holder.inbox_complete(t.a, "m1", token=rec.token, now=T0 + LEASE_MS + 2, expires_at=None) is True
            done = await loser.inbox_get(t.a, "m1")
            assert done is not None and done.state == "done", (
                f"REPL-4: the completion is visible to the other process; got {_j(done)!r}"
            )

            outcomes = await asyncio.gather(
                *((one if i % 2 == 0 else two).outbox_journal(t.a, outbound("k1", state="pending", seq=i)) for i in range(n))
            )
            created_count = sum(1 for _, c in outcomes if c)
            assert created_count == 1, (
                f"OUT-2/REPL-4: concurrent journals of one key from two processes create it exactly once; {created_count} did"
            )
            claim = await two.outbox_claim(t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=T0, lease_ms=LEASE_MS, recover=False)
            assert claim is not None
            assert await one.outbox_mark_sent(
                t.a, "k1", token=claim[0].token, message_id="wamid.X", now=T0, expires_at=None
            ) is True
            sent = await two.outbox_get(t.a, "k1")
            assert sent is not None and (sent.state, sent.message_id) == ("sent", "wamid.X"), (
                f"REPL-4: a send recorded by one process is answered from the outbox by the other; got {_j(sent)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    # ==================================================================================
    # end to end, through a Bot
    # ==================================================================================
    @pytest.mark.spec("INB-1", "INB-2", "OUT-1")
    def test_inb1_a_bot_journals_before_its_handler_and_settles_after(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-1, INB-2, OUT-1 (through a Bot on the backend): while the handler runs,
        the backend already holds the inbound record, leased to the bot's instance; the
        reply is in the outbox under ``<record id>:1`` before the handler goes on; after
        the handler the inbound record is ``done`` and the send ``sent`` with the
        channel's message id."""

        async def body(t: DurabilityTest) -> None:
            from botmesh.core.testing import MockProvider

            clock, channel = _clock(), MockProvider()
            bot = _bot(t, channel, clock, instance_id="e2e-1")
            assert bot.durability is not None
            scope = bot.durability.scope
            seen: dict[str, Any] = {}

            @bot.when("hi")
            async def hi(ctx: Any) -> None:
                seen["inbox"] = await t.backend.inbox_get(scope, ctx.record_id)
                result = await ctx.reply("hello")
                seen["key"] = result.key
                seen["outbox"] = await t.backend.outbox_get(scope, result.key)

            await bot.start()
            try:
                await channel.receive("chat-1", "hi", id="m1")
                rec = seen.get("inbox")
                assert rec is not None and rec.state == "leased" and rec.owner == "e2e-1", (
                    f"INB-1: the inbound event is journaled before any handler runs (leased to the bot's instance); "
                    f"inside the handler inbox_get returned {_j(rec)!r}"
                )
                out = seen.get("outbox")
                assert out is not None and out.key == "m1:1" and out.state == "sent", (
                    f"OUT-1: the reply is journaled under m1:1 and sent before the handler goes on; got {_j(out)!r}"
                )
                assert channel.sent and out.message_id == channel.sent[0].message_id, (
                    "OUT-1: the outbox stores the provider's message id "
                    f"{channel.sent[0].message_id if channel.sent else None!r}; "
                    f"got {out.message_id!r}"
                )
                done = await t.backend.inbox_get(scope, "m1")
                assert done is not None and done.state == "done", (
                    f"INB-2: the inbound record is done once the handler returned and its sends are recorded; got {_j(done)!r}"
                )
            finally:
                await bot.abandon()

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-3", "INB-4", "OUT-2", "LEASE-4", "TEST-3")
    def test_inb3_a_restarted_bot_reprocesses_and_answers_from_the_outbox(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-3, OUT-2, LEASE-4, INB-4 (through Bots on the backend, TEST-3): a bot dies
        after its reply was sent and before the inbound record was acknowledged; a new
        bot with the same ``instance_id`` on the same backend reprocesses the record at
        once, its reply is answered from the outbox (the channel gets it once), the
        record ends ``done``, and a redelivery is then recognised as a duplicate."""

        async def body(t: DurabilityTest) -> None:
            from botmesh.core.testing import MockProvider, SimulatedCrash

            from ..crash import crashable

            clock, channel = _clock(), MockProvider()
            runs: list[str] = []

            def setup(bot: Bot) -> None:
                @bot.when("hi")
                async def hi(ctx: Any) -> None:
                    runs.append(ctx.record_id)
                    await ctx.reply("hello")

            dying = crashable(t.backend)
            first = _bot(t, channel, clock, instance_id="e2e-1", backend=dying)
            setup(first)
            await first.start()
            dying.crash_before("inbox.complete")
            try:
                with contextlib.suppress(SimulatedCrash):
                    await channel.receive("chat-1", "hi", id="m1")
            finally:
                await first.abandon()
            assert dying.crashed and channel.texts() == ["hello"], "INB-3: setting up: the first bot must die after its reply"
            second = _bot(t, channel, clock, instance_id="e2e-1")
            assert second.durability is not None
            setup(second)
            await second.start()
            try:
                await clock.advance(1)  # far below the lease: recovery is immediate (LEASE-4)
                scope = second.durability.scope
                rec = await t.backend.inbox_get(scope, "m1")
                assert runs == ["m1", "m1"] and rec is not None and rec.state == "done", (
                    "INB-3/LEASE-4: after a restart with the same instance_id the unfinished record is reprocessed at "
                    f"once and ends done; handler runs {runs!r}, record {_j(rec)!r}"
                )
                assert channel.texts() == ["hello"], (
                    "OUT-2: the reprocessed reply is answered from the outbox, not sent again; the channel got "
                    f"{channel.texts()!r}"
                )
                await channel.receive("chat-1", "hi", id="m1")
                metrics = second.durability.metrics()
                assert runs == ["m1", "m1"] and metrics["inbound_duplicates"] == 1, (
                    f"INB-4: a redelivery whose record exists is recognised and not processed; runs {runs!r}, "
                    f"inbound_duplicates {metrics['inbound_duplicates']}"
                )
            finally:
                await second.abandon()

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_an_operator_replays_a_dead_inbound_through_the_bot(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-2 (through a Bot on the backend): an inbound record in the DLQ is listed
        by ``bot.durability.inbox.list(state="dead")``; ``replay_inbound(id)`` runs
        its handler again from the journaled event; the record ends ``done`` and leaves
        the DLQ."""

        async def body(t: DurabilityTest) -> None:
            from botmesh.core.testing import MockProvider

            clock, channel = _clock(), MockProvider()
            bot = _bot(t, channel, clock, instance_id="e2e-1")
            d = bot.durability
            assert d is not None
            runs: list[str] = []

            @bot.when("hi")
            async def hi(ctx: Any) -> None:
                runs.append(ctx.text)
                await ctx.reply(f"replayed: {ctx.text}")

            await t.backend.inbox_journal(d.scope, inbound("m1", text="hi", owner="dead-process"))
            assert await t.backend.inbox_kill(d.scope, "m1", token=None, now=T0, error="poison") is True
            await bot.start()
            try:
                dead = [r.id for r in await d.inbox.list(state="dead")]
                assert dead == ["m1"], f"OPS-2: inbox.list(state='dead') lists the DLQ; got {dead!r}"
                ok = await d.replay_inbound("m1")
                assert ok is True and runs == ["hi"] and channel.texts() == ["replayed: hi"], (
                    f"OPS-2: replay_inbound runs the handler again from the journaled event; it returned {ok!r}, "
                    f"runs {runs!r}, sent {channel.texts()!r}"
                )
                rec = await t.backend.inbox_get(d.scope, "m1")
                dead = [r.id for r in await d.inbox.list(state="dead")]
                assert rec is not None and rec.state == "done" and dead == [], (
                    f"OPS-2: the replayed record ends done and leaves the DLQ; record {_j(rec)!r}, DLQ {dead!r}"
                )
            finally:
                await bot.abandon()

        self.run_backend(botmesh_harness_factory, tmp_path, body)



# --------------------------------------------------------------------------------------
# helpers for the end-to-end tests
# --------------------------------------------------------------------------------------


def _clock() -> Any:
    from botmesh.core.clock import VirtualClock

    return VirtualClock(T0)


def _bot(t: DurabilityTest, channel: Any, clock: Any, *, instance_id: str, backend: DurabilityBackend | None = None) -> Bot:
    """A bot on the test's backend (or a wrapper of it) and store, in a scope of its own
    (its bot id carries the test's random tag)."""
    from botmesh.core import Bot

    tag = t.scopes.a.split("/")[1]
    bot = Bot(
        channel, t.store, {"backend": backend or t.backend, "instance_id": instance_id},
        bot_id=f"conformance-{tag}", clock=clock, rng=random.Random(0),
    )
    if bot.durability is not None and bot.durability.scope not in t.bot_scopes:
        t.bot_scopes.append(bot.durability.scope)
    return bot


async def _guarded(call: Awaitable[None], ids: tuple[str, ...]) -> None:
    """Await a test's coroutine, turning an error the backend raised where the contract
    says the call succeeds into an ``AssertionError`` starting with the test's first
    spec id (the original stays chained, with its traceback)."""
    try:
        await call
    except (AssertionError, _Skip):
        raise
    except Exception as exc:
        raise AssertionError(
            f"{ids[0]}: every call of this test is valid and must succeed on a started backend ({', '.join(ids)}); "
            f"the backend raised {type(exc).__name__}: {exc}"
        ) from exc
