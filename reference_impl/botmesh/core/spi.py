"""The service-provider interface for durability backends (BACK-7).

A third party writes a backend by implementing :class:`DurableKv` — a small
compare-and-set key-value store with two ordered indexes — and wrapping it in
:class:`KvDurability`, which turns it into a complete durability backend (inbox and
outbox journals, leases with fencing tokens, retention). The docstrings of
:class:`DurableKv` are the contract; ``botmesh_testkit``'s conformance suite checks every
sentence of it against :class:`MemoryKv`, the reference the other backends are compared
with step by step.

Data model
----------
Records live at ``(scope, space, key)``:

* ``scope`` — the bot's namespace (SCOPE-1). Two scopes never see each other's records,
  index entries or versions (SCOPE-2).
* ``space`` — ``"inbox"`` or ``"outbox"`` (a backend must accept any short
  identifier-like string).
* ``key`` — a non-empty string up to 512 characters.

A record's value is a JSON object (a ``dict`` whose contents ``json.dumps`` accepts);
the backend stores and returns it unchanged (a copy: mutating a returned value never
changes what is stored). Each record has a **version**, an integer that is 1 when the
record is created and grows by exactly 1 with every successful ``put``.

Each record may have an entry in each of two **ordered indexes**, ``"due"`` and
``"expires"``, with a float score (milliseconds since the epoch). ``put`` sets both
(``None`` removes the entry); ``delete`` removes both. ``range`` lists entries whose
score is ``<= upto`` in ascending ``(score, key)`` order.
"""

from __future__ import annotations

import asyncio
import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from .backend import DurabilityBackend
from .errors import BackendUnavailableError, DurabilityError, VersionConflict
from .records import InboxRecord, OutboxRecord
from .spi_types import INDEXES, Capabilities, IndexName, Versioned, check_index

RecordT = TypeVar("RecordT", InboxRecord, OutboxRecord)

__all__ = [
    "INDEXES",
    "Capabilities",
    "DurableKv",
    "IndexName",
    "KvDurability",
    "MemoryDurability",
    "MemoryKv",
    "Versioned",
    "check_index",
    "check_json_object",
]


class DurableKv(ABC):
    """Compare-and-set key-value storage with two ordered indexes, scoped.

    Contract (every method):

    * It is a coroutine; it may be called concurrently from many tasks. Each ``put`` and
      ``delete`` is atomic: concurrent CAS calls on one key with the same
      ``expected_version`` have exactly one winner; the others raise
      :class:`~botmesh.core.errors.VersionConflict`.
    * A write that returned is durable to the degree ``capabilities.survives_crash``
      claims.
    * Errors of the underlying driver are raised as
      :class:`~botmesh.core.errors.BackendUnavailableError` (never the driver's type). A
      write that raised ``BackendUnavailableError`` may or may not have been applied; the
      caller re-reads by key (that is why all writes are CAS: replaying one is harmless).
    * Calls after :meth:`close` raise ``BackendUnavailableError`` (until :meth:`open`
      again). Before the first :meth:`open` a kv may either raise it or open lazily
      (``MemoryKv`` and ``SQLiteKv`` open lazily, ``PostgresKv`` raises); callers open
      first — :class:`KvDurability` does at ``start()`` — so nothing depends on which.
      The conformance suite checks the part after ``close()``.
    """

    capabilities: Capabilities = Capabilities()

    async def open(self) -> None:
        """Acquire resources (files, pools). Idempotent."""

    async def close(self) -> None:
        """Release resources. Idempotent. Later calls raise ``BackendUnavailableError``."""

    @abstractmethod
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """The record at ``(scope, space, key)`` with its version, or ``None``."""

    @abstractmethod
    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        """Compare-and-set. ``expected_version=0`` creates the record and fails when it
        exists; ``expected_version=n > 0`` replaces version ``n`` and fails when the
        current version is another or the record is absent. On success the index entries
        become exactly ``due`` / ``expires`` (``None``: no entry) and the new version
        (``expected_version + 1``) is returned. On failure nothing changes and
        ``VersionConflict`` is raised."""

    @abstractmethod
    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """Remove the record at version ``expected_version`` and its index entries.
        Raises ``VersionConflict`` when absent or at another version."""

    @abstractmethod
    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """Up to ``limit`` entries ``(score, key)`` of ``index`` with ``score <= upto``,
        ascending by ``(score, key)``. ``upto`` may be ``float('inf')``. An ``index`` other
        than ``"due"`` and ``"expires"`` raises ``ValueError``."""

    @abstractmethod
    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """Up to ``limit`` records with key ``> after`` (all when ``after`` is None),
        ascending by key (code-point order)."""


def check_json_object(value: Any) -> dict[str, Any]:
    """Deep-copy ``value`` through JSON, raising ``TypeError`` when it is not a JSON
    object. Backends use it so that what they store is what they return."""
    if not isinstance(value, dict):
        raise TypeError(f"a DurableKv value must be a dict, got {type(value).__name__}")
    result: dict[str, Any] = json.loads(json.dumps(value, allow_nan=False))
    return result


class MemoryKv(DurableKv):
    """The in-memory reference :class:`DurableKv`: the oracle the conformance suite
    compares other backends against. Nothing survives the process."""

    capabilities = Capabilities()

    def __init__(self) -> None:
        # (scope, space) -> key -> (value, version, due, expires)
        self._data: dict[tuple[str, str], dict[str, tuple[dict[str, Any], int, float | None, float | None]]] = {}
        self._closed = False

    async def open(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True

    def _check(self) -> None:
        if self._closed:
            raise BackendUnavailableError("MemoryKv is closed")

    def _space(self, scope: str, space: str) -> dict[str, tuple[dict[str, Any], int, float | None, float | None]]:
        return self._data.setdefault((scope, space), {})

    # Each method completes without awaiting anything in between its read and its write,
    # so it is atomic with respect to other tasks; the final sleep(0) keeps it a real
    # suspension point like any I/O-backed implementation.
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        self._check()
        entry = self._space(scope, space).get(key)
        result = None if entry is None else Versioned(copy.deepcopy(entry[0]), entry[1])
        await asyncio.sleep(0)
        return result

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        self._check()
        stored = check_json_object(value)
        records = self._space(scope, space)
        current = records.get(key)
        current_version = 0 if current is None else current[1]
        if current_version != expected_version:
            await asyncio.sleep(0)
            raise VersionConflict.at(space, key, expected_version, current_version)
        records[key] = (stored, expected_version + 1, due, expires)
        await asyncio.sleep(0)
        return expected_version + 1

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        self._check()
        records = self._space(scope, space)
        current = records.get(key)
        current_version = 0 if current is None else current[1]
        if current is None or current_version != expected_version:
            await asyncio.sleep(0)
            raise VersionConflict.at(space, key, expected_version, current_version)
        del records[key]
        await asyncio.sleep(0)

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        self._check()
        pos = 2 if check_index(index) == "due" else 3
        entries = sorted(
            (entry[pos], key)
            for key, entry in self._space(scope, space).items()
            if entry[pos] is not None and entry[pos] <= upto  # type: ignore[operator]
        )
        await asyncio.sleep(0)
        return [(float(score), key) for score, key in entries[:limit]]  # type: ignore[arg-type]

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        self._check()
        records = self._space(scope, space)
        keys = sorted(k for k in records if after is None or k > after)[:limit]
        result = [(k, Versioned(copy.deepcopy(records[k][0]), records[k][1])) for k in keys]
        await asyncio.sleep(0)
        return result


# --------------------------------------------------------------------------------------
# KvDurability: a complete durability backend over any DurableKv
# --------------------------------------------------------------------------------------

INBOX = "inbox"
OUTBOX = "outbox"
_MAX_CAS_ROUNDS = 64


def _inbox_indexes(rec: InboxRecord) -> tuple[float | None, float | None]:
    if rec.state == "leased":
        return rec.lease_until, None
    if rec.state == "pending":
        return (rec.next_at if rec.next_at is not None else rec.updated_at), None
    if rec.state == "done":
        return None, rec.extra.get("expires_at")
    return None, None


def _outbox_indexes(rec: OutboxRecord) -> tuple[float | None, float | None]:
    if rec.state == "sending":
        return rec.lease_until, None
    if rec.state in ("pending", "failed"):
        return (rec.next_at if rec.next_at is not None else rec.created_at), None
    if rec.state == "sent":
        return None, rec.extra.get("expires_at")
    return None, None


class KvDurability(DurabilityBackend):
    """Turns any :class:`DurableKv` into a complete durability backend (BACK-7).

    Every operation is a read followed by a compare-and-set of one record, repeated when
    another writer got there first; so claims are exclusive and fencing holds across
    every process (and host) the kv itself serves. When a write fails with
    ``BackendUnavailableError`` its outcome is unknown: the record is read back once, and
    the write counts as done only when the stored value is exactly the one written.

    ``own_kv``: ``start()``/``stop()`` open and close the kv (True), or the kv belongs to
    whoever opened it (``FileDurability.open`` keeps it open across bots until
    ``close()``).
    """

    def __init__(self, kv: DurableKv, *, own_kv: bool = True, name: str | None = None) -> None:
        self.kv = kv
        self.own_kv = own_kv
        self.name = name or type(kv).__name__
        self.capabilities = kv.capabilities

    async def start(self) -> None:
        if self.own_kv:
            await self.kv.open()

    async def stop(self) -> None:
        if self.own_kv:
            await self.kv.close()

    # -- generic record transitions -----------------------------------------------------
    async def _put(
        self, scope: str, space: str, key: str, value: dict[str, Any], expected: int, due: float | None, expires: float | None
    ) -> None:
        try:
            await self.kv.put(scope, space, key, value, expected_version=expected, due=due, expires=expires)
        except BackendUnavailableError:
            # Outcome unknown: the write may have landed. Read it back by key.
            after = await self.kv.get(scope, space, key)
            if after is not None and after.version == expected + 1 and after.value == check_json_object(value):
                return
            raise

    async def _create(
        self, scope: str, space: str, key: str, value: dict[str, Any], due: float | None, expires: float | None
    ) -> bool:
        try:
            await self._put(scope, space, key, value, 0, due, expires)
            return True
        except VersionConflict:
            return False

    async def _transition(
        self,
        scope: str,
        space: str,
        key: str,
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
        indexes: Callable[[dict[str, Any]], tuple[float | None, float | None]],
    ) -> dict[str, Any] | None:
        """Apply ``change`` to the current value with CAS; None when absent or when
        ``change`` declines (returns None)."""
        for _ in range(_MAX_CAS_ROUNDS):
            current = await self.kv.get(scope, space, key)
            if current is None:
                return None
            new = change(current.value)
            if new is None:
                return None
            due, expires = indexes(new)
            try:
                await self._put(scope, space, key, new, current.version, due, expires)
            except VersionConflict:
                continue
            return new
        raise DurabilityError(f"{space}/{key}: gave up after {_MAX_CAS_ROUNDS} conflicting writes")

    def _in(self, change: Callable[[InboxRecord], InboxRecord | None]) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
        def apply(value: dict[str, Any]) -> dict[str, Any] | None:
            new = change(InboxRecord.from_json(value))
            return None if new is None else new.to_json()

        return apply

    def _out(self, change: Callable[[OutboxRecord], OutboxRecord | None]) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
        def apply(value: dict[str, Any]) -> dict[str, Any] | None:
            new = change(OutboxRecord.from_json(value))
            return None if new is None else new.to_json()

        return apply

    @staticmethod
    def _in_idx(value: dict[str, Any]) -> tuple[float | None, float | None]:
        return _inbox_indexes(InboxRecord.from_json(value))

    @staticmethod
    def _out_idx(value: dict[str, Any]) -> tuple[float | None, float | None]:
        return _outbox_indexes(OutboxRecord.from_json(value))

    async def _in_tx(self, scope: str, id: str, change: Callable[[InboxRecord], InboxRecord | None]) -> InboxRecord | None:
        new = await self._transition(scope, INBOX, id, self._in(change), self._in_idx)
        return None if new is None else InboxRecord.from_json(new)

    async def _out_tx(self, scope: str, key: str, change: Callable[[OutboxRecord], OutboxRecord | None]) -> OutboxRecord | None:
        new = await self._transition(scope, OUTBOX, key, self._out(change), self._out_idx)
        return None if new is None else OutboxRecord.from_json(new)

    async def _scan_records(self, scope: str, space: str, cls: type[RecordT], state: str | None, limit: int) -> list[RecordT]:
        result: list[RecordT] = []
        after: str | None = None
        while len(result) < limit:
            page = await self.kv.scan(scope, space, after=after, limit=200)
            if not page:
                break
            for _, found in page:
                rec = cls.from_json(found.value)
                if state is None or rec.state == state:
                    result.append(rec)
            after = page[-1][0]
        return result[:limit]

    async def _journal_record(
        self, scope: str, space: str, key: str, record: RecordT, indexes: tuple[float | None, float | None]
    ) -> tuple[RecordT, bool]:
        """Create unless the key exists; then return the stored record (INB-4, OUT-2)."""
        value = record.to_json()
        for _ in range(2):  # a second round only when the record vanished in between
            if await self._create(scope, space, key, value, *indexes):
                return record, True
            found = await self.kv.get(scope, space, key)
            if found is not None:
                return type(record).from_json(found.value), False
        raise DurabilityError(f"{space}/{key}: created and deleted concurrently twice")

    async def _purge(self, scope: str, space: str, now: float, limit: int) -> int:
        purged = 0
        for _, key in await self.kv.range(scope, space, "expires", upto=now, limit=limit):
            current = await self.kv.get(scope, space, key)
            if current is None:
                continue
            try:
                await self.kv.delete(scope, space, key, expected_version=current.version)
                purged += 1
            except VersionConflict:
                continue
        return purged

    # -- inbox ------------------------------------------------------------------------
    async def inbox_journal(self, scope: str, record: InboxRecord) -> tuple[InboxRecord, bool]:
        return await self._journal_record(scope, INBOX, record.id, record, _inbox_indexes(record))

    async def inbox_claim(
        self, scope: str, id: str, *, owner: str, incarnation: str, now: float, lease_ms: float, recover: bool
    ) -> InboxRecord | None:
        def change(r: InboxRecord) -> InboxRecord | None:
            claimable = (
                (r.state == "pending" and (r.next_at is None or r.next_at <= now))
                or (r.state == "leased" and r.lease_until is not None and r.lease_until <= now)
                or (recover and r.state == "leased" and r.owner == owner and r.incarnation != incarnation)
            )
            if not claimable:
                return None
            return r.copy(
                state="leased", owner=owner, incarnation=incarnation, token=r.token + 1, attempts=r.attempts + 1,
                lease_until=now + lease_ms, claimed_at=now, next_at=None, updated_at=now,
            )

        return await self._in_tx(scope, id, change)

    async def inbox_heartbeat(self, scope: str, id: str, *, token: int, lease_until: float) -> bool:
        def change(r: InboxRecord) -> InboxRecord | None:
            if r.state != "leased" or r.token != token:
                return None
            return r.copy(lease_until=max(lease_until, r.lease_until or 0.0))

        return await self._in_tx(scope, id, change) is not None

    async def inbox_complete(self, scope: str, id: str, *, token: int, now: float, expires_at: float | None) -> bool:
        def change(r: InboxRecord) -> InboxRecord | None:
            if r.state != "leased" or r.token != token:
                return None
            new = r.copy(state="done", lease_until=None, finished_at=now, updated_at=now, error=None)
            new.extra = {**r.extra, "expires_at": expires_at}
            return new

        return await self._in_tx(scope, id, change) is not None

    async def inbox_retry_later(self, scope: str, id: str, *, token: int, next_at: float, error: str) -> bool:
        def change(r: InboxRecord) -> InboxRecord | None:
            if r.state != "leased" or r.token != token:
                return None
            return r.copy(state="pending", lease_until=None, next_at=next_at, error=error)

        return await self._in_tx(scope, id, change) is not None

    async def inbox_kill(self, scope: str, id: str, *, token: int | None, now: float, error: str) -> bool:
        def change(r: InboxRecord) -> InboxRecord | None:
            if token is not None and (r.state != "leased" or r.token != token):
                return None
            if token is None and r.state in ("done", "dead"):
                return None
            return r.copy(state="dead", lease_until=None, next_at=None, finished_at=now, updated_at=now, error=error)

        return await self._in_tx(scope, id, change) is not None

    async def inbox_replay(self, scope: str, id: str, *, now: float) -> InboxRecord | None:
        def change(r: InboxRecord) -> InboxRecord | None:
            if r.state == "leased":
                return None
            new = r.copy(state="pending", attempts=0, next_at=now, lease_until=None, updated_at=now, error=None)
            new.extra = {k: v for k, v in r.extra.items() if k != "expires_at"}
            new.extra["replayed"] = True
            return new

        return await self._in_tx(scope, id, change)

    async def inbox_purge(self, scope: str, *, now: float, limit: int) -> int:
        return await self._purge(scope, INBOX, now, limit)

    async def inbox_get(self, scope: str, id: str) -> InboxRecord | None:
        found = await self.kv.get(scope, INBOX, id)
        return None if found is None else InboxRecord.from_json(found.value)

    async def inbox_list(self, scope: str, *, state: str | None = None, limit: int = 1000) -> list[InboxRecord]:
        return await self._scan_records(scope, INBOX, InboxRecord, state, limit)

    async def inbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return [key for _, key in await self.kv.range(scope, INBOX, "due", upto=upto, limit=limit)]

    # -- outbox -----------------------------------------------------------------------
    async def outbox_journal(self, scope: str, record: OutboxRecord) -> tuple[OutboxRecord, bool]:
        return await self._journal_record(scope, OUTBOX, record.key, record, _outbox_indexes(record))

    async def outbox_claim(
        self, scope: str, key: str, *, owner: str, incarnation: str, now: float, lease_ms: float, recover: bool
    ) -> tuple[OutboxRecord, str] | None:
        previous: list[str] = []

        def change(r: OutboxRecord) -> OutboxRecord | None:
            claimable = (
                (r.state in ("pending", "failed") and (r.next_at is None or r.next_at <= now))
                or (r.state == "sending" and r.lease_until is not None and r.lease_until <= now)
                or (recover and r.state == "sending" and r.owner == owner and r.incarnation != incarnation)
            )
            if not claimable:
                return None
            previous[:] = [r.state]
            return r.copy(
                state="sending", owner=owner, incarnation=incarnation, token=r.token + 1, attempts=r.attempts + 1,
                lease_until=now + lease_ms, claimed_at=now, next_at=None, updated_at=now,
            )

        new = await self._out_tx(scope, key, change)
        return None if new is None else (new, previous[0])

    async def outbox_heartbeat(self, scope: str, key: str, *, token: int, lease_until: float) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if r.state != "sending" or r.token != token:
                return None
            return r.copy(lease_until=max(lease_until, r.lease_until or 0.0))

        return await self._out_tx(scope, key, change) is not None

    async def outbox_mark_sent(
        self, scope: str, key: str, *, token: int, message_id: str, now: float, expires_at: float | None
    ) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if r.state != "sending" or r.token != token:
                return None
            new = r.copy(state="sent", message_id=message_id, lease_until=None, sent_at=now, updated_at=now, error=None)
            new.extra = {**r.extra, "expires_at": expires_at}
            return new

        return await self._out_tx(scope, key, change) is not None

    async def outbox_mark_failed(self, scope: str, key: str, *, token: int, next_at: float, error: str) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if r.state != "sending" or r.token != token:
                return None
            return r.copy(state="failed", lease_until=None, next_at=next_at, error=error)

        return await self._out_tx(scope, key, change) is not None

    async def outbox_mark_dead(self, scope: str, key: str, *, token: int | None, now: float, error: str) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if token is not None and (r.state != "sending" or r.token != token):
                return None
            if token is None and r.state in ("sent", "dead"):
                return None
            return r.copy(state="dead", lease_until=None, next_at=None, updated_at=now, error=error)

        return await self._out_tx(scope, key, change) is not None

    async def outbox_mark_unknown(self, scope: str, key: str, *, token: int, now: float) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if r.state != "sending" or r.token != token:
                return None
            return r.copy(state="unknown", lease_until=None, updated_at=now, error="ambiguous: the process died during the send")

        return await self._out_tx(scope, key, change) is not None

    async def outbox_split(self, scope: str, key: str, *, token: int | None, content: dict[str, object]) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if token is not None and (r.state != "sending" or r.token != token):
                return None
            if token is None and r.state not in ("pending", "failed"):
                return None
            return r.copy(content=dict(content))

        return await self._out_tx(scope, key, change) is not None

    async def outbox_retry(self, scope: str, key: str, *, now: float) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            if r.state not in ("dead", "failed", "unknown"):
                return None
            return r.copy(state="pending", attempts=0, next_at=now, lease_until=None, updated_at=now, error=None)

        return await self._out_tx(scope, key, change) is not None

    async def outbox_discard(self, scope: str, key: str) -> bool:
        for _ in range(_MAX_CAS_ROUNDS):
            current = await self.kv.get(scope, OUTBOX, key)
            if current is None:
                return False
            try:
                await self.kv.delete(scope, OUTBOX, key, expected_version=current.version)
                return True
            except VersionConflict:
                continue
        raise DurabilityError(f"outbox/{key}: gave up after {_MAX_CAS_ROUNDS} conflicting writes")

    async def outbox_purge(self, scope: str, *, now: float, limit: int) -> int:
        return await self._purge(scope, OUTBOX, now, limit)

    async def outbox_get(self, scope: str, key: str) -> OutboxRecord | None:
        found = await self.kv.get(scope, OUTBOX, key)
        return None if found is None else OutboxRecord.from_json(found.value)

    async def outbox_list(self, scope: str, *, state: str | None = None, limit: int = 1000) -> list[OutboxRecord]:
        return await self._scan_records(scope, OUTBOX, OutboxRecord, state, limit)

    async def outbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return [key for _, key in await self.kv.range(scope, OUTBOX, "due", upto=upto, limit=limit)]


class MemoryDurability(KvDurability):
    """The in-memory backend (what ``durability={}`` means, ENABLE-2): retries, backoff
    and the DLQ, nothing survives the process."""

    def __init__(self) -> None:
        super().__init__(MemoryKv(), own_kv=False, name="memory")
