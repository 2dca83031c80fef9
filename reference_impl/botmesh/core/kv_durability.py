"""``KvDurability``: a complete durability backend over any
:class:`~botmesh.core.spi.DurableKv` (BACK-7).

The contract it relies on is :mod:`botmesh.core.spi`; the in-memory kv and backend are
in :mod:`botmesh.core.memory`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .backend import DurabilityBackend
from .errors import BackendUnavailableError, DurabilityError, KvContractError, VersionConflict
from .records import InboxRecord, OutboxRecord
from .spi import DurableKv, Versioned, check_json_object
from .spi_types import IndexName

RecordT = TypeVar("RecordT", InboxRecord, OutboxRecord)

__all__ = ["KvDurability"]

INBOX = "inbox"
OUTBOX = "outbox"
_MAX_CAS_ROUNDS = 64
_MAX_KNOWN = 1024  # known versions kept at most (the oldest go first)
_SCAN_PAGE = 200  # records asked of one scan call when listing a journal
_LEASED = frozenset({"leased", "sending"})
_DUE_READS: tuple[tuple[str, IndexName], ...] = ((INBOX, "due"), (OUTBOX, "due"))
"""The reads of :meth:`KvDurability.due`: both journals' due indexes."""


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

    Every operation is a compare-and-set of one record on the version it was computed
    from, repeated from a fresh read when another writer got there first; so claims are
    exclusive and fencing holds across every process (and host) the kv itself serves.
    When a write fails with ``BackendUnavailableError`` its outcome is unknown: the record
    is read back once, and the write counts as done only when the stored value is exactly
    the one written.

    **Known versions.** The record is read before the write unless this instance wrote it
    last itself and it still holds a lease (``leased``/``sending``): then the version and
    value of that write are used (at most 1,024 such records are kept, the oldest dropped
    first; all are dropped by ``start()``/``stop()``). A known version another writer has
    overtaken fails its CAS like a stale read would, and the write is computed again from
    a fresh read; a transition that declines (a token that no longer matches, say) is
    answered from a fresh read only. So the per-message path (a journal write, a
    transition of the same record) costs no read. The one case a version cannot tell is
    a record deleted and created again up to the same version between two writes of
    ours (only after an operator's ``outbox_discard`` or the retention purge of a record
    taken over from us); the fencing token cannot tell it either.

    ``own_kv``: ``start()``/``stop()`` open and close the kv (True), or the kv belongs to
    whoever opened it (``FileDurability.open`` keeps it open across bots until
    ``close()``).
    """

    def __init__(self, kv: DurableKv, *, own_kv: bool = True, name: str | None = None) -> None:
        self.kv = kv
        self.own_kv = own_kv
        self.name = name or type(kv).__name__
        self.capabilities = kv.capabilities
        # (scope, space, key) -> (version, a private copy of the record's value) that this
        # instance's own last CAS wrote, for records that hold a lease (see _know)
        self._known: dict[tuple[str, str, str], tuple[int, dict[str, Any]]] = {}
        # A kv's way to take a written value without copying it (OwnedValuesKv.put_owned,
        # set by MemoryDurability and FileDurability), or None: then records are written with kv.put, as
        # to_json() gives them, and the known copy is made apart. When set, each record
        # is written as its private_json(), a checked copy nobody else holds, which the kv
        # keeps and the known versions share with it — both only read it, and a record
        # built from a known value (a transition's) is handed out only after the CAS that
        # replaced it in the kv (issue 16: one copy per write instead of two).
        self._put_owned: Callable[..., Awaitable[int]] | None = None

    async def start(self) -> None:
        self._known.clear()
        if self.own_kv:
            await self.kv.open()

    async def stop(self) -> None:
        self._known.clear()
        if self.own_kv:
            await self.kv.close()

    async def durability_settings(self) -> dict[str, str] | None:
        """The kv's (:meth:`DurableKv.durability_settings`)."""
        return await self.kv.durability_settings()

    @staticmethod
    def _indexes(record: InboxRecord | OutboxRecord) -> tuple[float | None, float | None]:
        """The ``due`` and ``expires`` index entries of ``record``."""
        if isinstance(record, InboxRecord):
            return _inbox_indexes(record)
        return _outbox_indexes(record)

    # -- known versions ------------------------------------------------------------------
    def _know(self, scope: str, space: str, key: str, version: int, record: InboxRecord | OutboxRecord,
              value: dict[str, Any]) -> None:
        """Keep ``value`` (``record`` as written, its ``to_json()``) as the value of
        ``key`` at ``version`` after our own CAS wrote it — only while it holds a lease
        (``leased``/``sending``: the records whose next write is ours and near) — so the
        next transition needs no read. Kept as a copy of its own
        (:meth:`~botmesh.core.records._Record.json_copy`), so nothing the caller does to
        its records can change it — or, when the kv took ``value`` itself
        (``_put_owned``), as that value, already private; a transition takes it (it is
        never handed out while known)."""
        state = record.state
        k = (scope, space, key)
        self._known.pop(k, None)  # re-inserted last: the oldest entry is evicted first
        if state not in _LEASED:
            return
        if len(self._known) >= _MAX_KNOWN:
            del self._known[next(iter(self._known))]
        self._known[k] = (version, value if self._put_owned is not None else type(record).json_copy(value))

    def _seen(self, scope: str, space: str, key: str, found: Versioned,
              cls: type[InboxRecord] | type[OutboxRecord]) -> None:
        """Keep ``found`` — what a read just gave for ``key``, whatever its state — as
        the known version of ``key``, as a copy of its own
        (:meth:`~botmesh.core.records._Record.json_copy`: the caller gets records decoded
        from ``found.value`` and may change them). The transition that usually follows
        such a read — the sweep's claim of a due send it has just read, the claim or
        the answer of a record a journal write found already there — then writes
        without reading it again (issue 16: one round trip less on a server). It is a
        hint like every known version (:meth:`_transition`): a write from it that
        another writer overtook fails its CAS and is done again from a fresh read, and a
        decline on it is asked of the store again."""
        # (the insertion of _know, written out in both: _know runs at every write, and a
        # shared helper measured 1.7 % more instructions per message in engine_cost.py)
        k = (scope, space, key)
        self._known.pop(k, None)  # re-inserted last: the oldest entry is evicted first
        if len(self._known) >= _MAX_KNOWN:
            del self._known[next(iter(self._known))]
        self._known[k] = (found.version, cls.json_copy(found.value))

    def _forget(self, scope: str, space: str, key: str) -> None:
        self._known.pop((scope, space, key), None)

    # -- generic record transitions -----------------------------------------------------
    def _cas(self, scope: str, space: str, key: str, value: dict[str, Any], expected: int, due: float | None,
             expires: float | None) -> Awaitable[int]:
        """The kv's CAS of ``value`` at ``expected`` — ``_put_owned`` when set, else
        ``kv.put`` — as the awaitable the caller awaits (a plain function: no coroutine
        of its own per write, issue 16)."""
        return (self._put_owned or self.kv.put)(scope, space, key, value, expected_version=expected, due=due,
                                                expires=expires)

    async def _landed(self, scope: str, space: str, key: str, value: dict[str, Any], expected: int) -> bool:
        """After a CAS of ``value`` at ``expected`` raised ``BackendUnavailableError`` (its
        outcome unknown: it may have landed): whether it landed, read back by key."""
        self._forget(scope, space, key)
        after = await self.kv.get(scope, space, key)
        return after is not None and after.version == expected + 1 and after.value == check_json_object(value)

    async def _transition(
        self, scope: str, space: str, key: str, cls: type[RecordT], change: Callable[[RecordT], RecordT | None]
    ) -> RecordT | None:
        """Apply ``change`` to the current record with CAS; None when absent or when
        ``change`` declines (returns None).

        The current record is the one this instance wrote or read last when it still
        knows it (:meth:`_know`, :meth:`_seen`), else it is read. A write from a known
        version that another writer overtook fails its CAS (``VersionConflict``) and the
        round is done again from a fresh read; a decline is only ever answered from a
        fresh read. ``change`` must not keep the record it is given nor change its
        containers, only return a changed copy (``copy``). With ``_put_owned`` the record
        returned may share containers with what the kv keeps: a caller that hands it out
        gives :meth:`_handed_out` of it."""
        # (self._indexes, without its call per transition)
        indexes: Callable[[Any], tuple[float | None, float | None]] = (
            _inbox_indexes if cls is InboxRecord else _outbox_indexes)
        k = (scope, space, key)
        for _ in range(_MAX_CAS_ROUNDS):
            known = self._known.pop(k, None)
            if known is not None:
                version, value = known
            else:
                current = await self.kv.get(scope, space, key)
                if current is None:
                    return None
                version, value = current.version, current.value
            record = cls.from_json(value)
            new = change(record)
            if new is None:
                if known is not None:
                    continue  # declined on what this instance knew: decide on a fresh read
                return None
            # (with _put_owned: the containers new took over from record unchanged are
            # this instance's alone — a known value or a read's copy — and are handed to
            # the kv as they are; _handed_out copies a record that leaves the backend)
            value = new.to_json() if self._put_owned is None else new.private_json(record)
            due, expires = indexes(new)
            try:
                await self._cas(scope, space, key, value, version, due, expires)
            except VersionConflict:
                self._forget(scope, space, key)
                continue
            except BackendUnavailableError:
                if not await self._landed(scope, space, key, value, version):
                    raise
            self._know(scope, space, key, version + 1, new, value)
            return new
        raise DurabilityError(f"{space}/{key}: gave up after {_MAX_CAS_ROUNDS} conflicting writes")

    def _handed_out(self, record: RecordT | None) -> RecordT | None:
        """``record`` (a transition's) as a public method returns it: with ``_put_owned``,
        a copy whose containers are its own (the kv may keep the transition's); else
        ``record`` itself, which shares nothing with the kv."""
        if record is None or self._put_owned is None:
            return record
        return type(record).from_json(record.private_json())

    # (plain functions handing back the coroutine of _transition: one coroutine less per
    # transition, twice per message)
    def _in_tx(
        self, scope: str, id: str, change: Callable[[InboxRecord], InboxRecord | None]
    ) -> Coroutine[Any, Any, InboxRecord | None]:
        return self._transition(scope, INBOX, id, InboxRecord, change)

    def _out_tx(
        self, scope: str, key: str, change: Callable[[OutboxRecord], OutboxRecord | None]
    ) -> Coroutine[Any, Any, OutboxRecord | None]:
        return self._transition(scope, OUTBOX, key, OutboxRecord, change)

    async def _scan_records(self, scope: str, space: str, cls: type[RecordT], state: str | None, limit: int) -> list[RecordT]:
        result: list[RecordT] = []
        after: str | None = None
        while len(result) < limit:
            page = await self.kv.scan(scope, space, after=after, limit=_SCAN_PAGE)
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
            if len(page) < _SCAN_PAGE:
                break  # scan returns min(limit, the records after): a short page is the last (BACK-7)
            after = page[-1][0]
        return result[:limit]

    async def _journal_record(
        self, scope: str, space: str, key: str, record: RecordT, indexes: tuple[float | None, float | None]
    ) -> tuple[RecordT, bool]:
        """Create unless the key exists; then return the stored record (INB-4, OUT-2): the
        one the failed create's ``VersionConflict`` carries when the kv reports it
        (``current``), else read."""
        due, expires = indexes
        for _ in range(2):  # a second round only when the record vanished in between
            value = record.to_json() if self._put_owned is None else record.private_json()
            try:
                await self._cas(scope, space, key, value, 0, due, expires)
            except BackendUnavailableError:
                if not await self._landed(scope, space, key, value, 0):
                    raise
            except VersionConflict as conflict:
                # the record found by the failed create itself when the kv reports it: no read
                found = conflict.current if conflict.current is not None else await self.kv.get(scope, space, key)
                if found is not None:
                    self._seen(scope, space, key, found, type(record))
                    return type(record).from_json(found.value), False
                self._forget(scope, space, key)
                continue
            self._know(scope, space, key, 1, record, value)
            return record, True
        raise DurabilityError(f"{space}/{key}: created and deleted concurrently twice")

    async def _purge(self, scope: str, space: str, now: float, limit: int) -> int:
        """Delete the records the ``expires`` index lists up to ``now``. Each is read
        first and deleted at the version read, and only when that version still expires
        by ``now``: the index was read before, and a record changed in between — a
        ``done`` record replayed (``replay_inbound``: ``pending``, no expiry) by another
        process or task — is no longer the record the index listed; deleting it would
        lose the replay (OPS-3 purges ``done``/``sent`` records only)."""
        purged = 0
        for _, key in await self.kv.range(scope, space, "expires", upto=now, limit=limit):
            current = await self.kv.get(scope, space, key)
            if current is None:
                continue
            expires = self._indexes((InboxRecord if space == INBOX else OutboxRecord).from_json(current.value))[1]
            if expires is None or expires > now:
                continue  # changed since the index was read: not expired any more
            self._forget(scope, space, key)
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

        return self._handed_out(await self._in_tx(scope, id, change))

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

        return self._handed_out(await self._in_tx(scope, id, change))

    async def inbox_purge(self, scope: str, *, now: float, limit: int) -> int:
        return await self._purge(scope, INBOX, now, limit)

    async def inbox_get(self, scope: str, id: str) -> InboxRecord | None:
        found = await self.kv.get(scope, INBOX, id)
        if found is None:
            return None
        self._seen(scope, INBOX, id, found, InboxRecord)
        return InboxRecord.from_json(found.value)

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

        new = self._handed_out(await self._out_tx(scope, key, change))
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
            self._forget(scope, OUTBOX, key)
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
        if found is None:
            return None
        self._seen(scope, OUTBOX, key, found, OutboxRecord)
        return OutboxRecord.from_json(found.value)

    async def outbox_list(self, scope: str, *, state: str | None = None, limit: int = 1000) -> list[OutboxRecord]:
        return await self._scan_records(scope, OUTBOX, OutboxRecord, state, limit)

    async def outbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return [key for _, key in await self.kv.range(scope, OUTBOX, "due", upto=upto, limit=limit)]

    async def due(self, scope: str, *, upto: float, limit: int) -> tuple[list[str], list[str]]:
        """Both journals' due indexes in one :meth:`~botmesh.core.spi.DurableKv.ranges`
        call (one server round trip per sweep pass on PostgreSQL and Redis). When
        ``inbox_due`` or ``outbox_due`` is not this class's own — a subclass or an
        instance attribute replaced it — those are called instead, so that what they
        answer is what the sweep sees."""
        if (getattr(self.inbox_due, "__func__", None) is not KvDurability.inbox_due
                or getattr(self.outbox_due, "__func__", None) is not KvDurability.outbox_due):
            return await super().due(scope, upto=upto, limit=limit)
        inbox, outbox = await self.kv.ranges(scope, _DUE_READS, upto=upto, limit=limit)
        return [key for _, key in inbox], [key for _, key in outbox]
