"""``KvDurability``: a complete durability backend over any
:class:`~botmesh.core.spi.DurableKv` (BACK-7).

The contract it relies on is :mod:`botmesh.core.spi`; the in-memory kv and backend are
in :mod:`botmesh.core.memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .backend import DurabilityBackend
from .errors import BackendUnavailableError, DurabilityError, KvContractError, VersionConflict
from .records import InboxRecord, OutboxRecord
from .spi import DurableKv, check_json_object

RecordT = TypeVar("RecordT", InboxRecord, OutboxRecord)

__all__ = ["KvDurability"]

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

    async def durability_settings(self) -> dict[str, str] | None:
        """The kv's (:meth:`DurableKv.durability_settings`)."""
        return await self.kv.durability_settings()

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
            if after is not None and page[0][0] <= after:
                # an inclusive (or unordered) scan would page over the same keys forever
                raise KvContractError(
                    f"{type(self.kv).__name__}.scan(scope={scope!r}, space={space!r}, after={after!r}) returned key "
                    f"{page[0][0]!r}, which is not after {after!r}: scan(after=k) must list only keys greater than k, "
                    "in code-point order (BACK-7); a scan that does not advance makes paging loop forever",
                    method="scan", key=page[0][0], after=after)
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
