"""The event journals: :class:`FileEventJournal` (one process) and
:class:`SharedFileEventJournal` (several processes of one host), both
:class:`~botmesh.events.records.LeasedEventJournal`.

Storage
=======

Both keep their records in one file in the format of the file durability backend
(:mod:`botmesh.core.file_format`, snapshot version 2, log version 3: checksummed lines, a snapshot with a record
count and a file checksum, an optional append log ``<path>.log``) through
:class:`botmesh.core.file_kv.FileKv`: every guarantee of that backend holds here —
BACK-4, BACK-5 (a damaged snapshot or a damaged complete log line is refused at open with
``JournalCorruptError`` naming the file, line and byte; a torn **last** line is trimmed),
BACK-6 (``fsync``, default True). Events are the records of scope ``""`` (a scope no
durability-backend caller can use), space ``"events"``, keyed by id; a bot's outbox,
when the journal is its durability backend, sits beside them as a sidecar in the same
file and the same atomic snapshot (EVENTS-2, :mod:`botmesh.events.durability`).

Writes and group commit
=======================

Every operation is a function of the current records that returns its result and the
records it changes. Operations called concurrently (tasks of one event loop) are queued
and applied together, in call order, by one flush: **one** snapshot rewrite — or one log
append of one line (a commit) holding every change — commits all of them, and only then do their calls
return. A flush that cannot write fails every operation in it with
``BackendUnavailableError`` (their outcome is then unknown, as for every backend) and
leaves memory unchanged. Lease heartbeats are writes like any other: we chose not to defer
them to the next change, because another process of a shared journal must see the
extended lease or it would take a live holder's record (REPL-3).

Without the append log each flush rewrites the snapshot atomically (a temporary file,
fsync, rename, directory fsync); with it, each flush appends its lines and the log is
folded into the snapshot every ``compact_every`` entries (1000) or ``compact_bytes`` (4 MiB)
— the snapshot records the last entry it holds (``log_seq``), so a crash between the new
snapshot and the log's truncation is harmless (EVENTS-5).

Locking
=======

``FileEventJournal.open(path, lock=True)`` (the default; EVENTS-3) takes the pid lock
file ``<path>.lock`` of the file backend: a second live process is refused, and so is a
second ``open()`` of the same file in this process until the first is closed
(``JournalLockedError``). ``lock=False`` takes no lock at all; such a journal is refused
by :func:`~botmesh.events.durability.events_durability`.

``SharedFileEventJournal`` (EVENTS-4) serialises the flushes of every process with an
exclusive ``flock(2)`` on ``<path>.mutex``, and reloads the files at the start of a flush
when another process wrote since (the mutex file carries a generation number that every
writer increments before it writes). A kernel lock is released by the kernel the moment
its holder dies (SIGKILL included): a dead process's mutex is free at once, with no
stale-lock detection and so no race between processes breaking it — two holders at once
cannot happen. The price: a holder that is alive but stuck (SIGSTOP, a debugger) keeps
it; the others wait, and an operation that waited ``stale_lock_ms`` (30 s) fails with
``BackendUnavailableError`` naming the mutex and the holder's pid. Nothing is ever broken
or killed, so ``heartbeat_ms`` has nothing to refresh: it is accepted (and checked) for
compatibility and unused. This is the choice the issue offered ("a kernel lock that dies
with its process"); tests/test_events_shared.py shows both halves.

A shared journal holds a shared ``flock`` on ``<path>.lock`` while open, so a
``FileEventJournal(lock=True)`` cannot open the file meanwhile; and every flush checks
that no live process holds ``<path>.lock`` exclusively (a ``FileEventJournal`` that got
there first, or in between): its operations are then refused with ``JournalLockedError``
rather than writing under an exclusive owner.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from botmesh.core.errors import BackendUnavailableError, ConfigError
from botmesh.core.file_format import Entry, Records, encode_value, is_int
from botmesh.core.fileio import FileIO
from botmesh.core.spi import check_json_object

from ._file import Change, JournalFile
from .records import (
    ANY_CHANNEL,
    BOT_CHANNEL,
    BOT_EVENT_TYPES,
    STATES,
    EventJournalError,
    EventRecord,
    Lease,
    LeasedEventJournal,
    check_lease_ms,
)

__all__ = ["EVENTS_SCOPE", "EVENTS_SPACE", "FileEventJournal", "Txn"]

EVENTS_SCOPE = ""
"""The scope of the event records in the file (no kv caller can use an empty scope)."""
EVENTS_SPACE = "events"
"""Their space."""

T = TypeVar("T")
Op = Callable[["Txn"], Any]


def wall_ms() -> float:
    """Milliseconds since the epoch (the default ``now``)."""
    return time.time() * 1000.0


class Txn:
    """The records as a batch sees them: the committed ones plus the changes of the
    operations applied before in the same batch. Operations read and write through it;
    :attr:`changes` is what the flush writes, in order."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.overlay: dict[tuple[str, str, str], Entry | None] = {}
        self.changes: list[Change] = []

    def get(self, scope: str, space: str, key: str) -> Entry | None:
        k = (scope, space, key)
        if k in self.overlay:
            return self.overlay[k]
        return self.records.get((scope, space), {}).get(key)

    def put(self, scope: str, space: str, key: str, value: dict[str, Any], version: int,
            due: float | None = None, expires: float | None = None) -> None:
        entry: Entry = (value, version, due, expires)
        self.overlay[(scope, space, key)] = entry
        self.changes.append((scope, space, key, entry, version))

    def delete(self, scope: str, space: str, key: str) -> None:
        current = self.get(scope, space, key)
        if current is None:
            return
        self.overlay[(scope, space, key)] = None
        self.changes.append((scope, space, key, None, current[1]))

    def items(self, scope: str, space: str) -> builtins.list[tuple[str, Entry]]:
        """Every ``(key, entry)`` of ``(scope, space)``, unordered."""
        merged = dict(self.records.get((scope, space), {}))
        for (s, sp, key), entry in self.overlay.items():
            if s == scope and sp == space:
                if entry is None:
                    merged.pop(key, None)
                else:
                    merged[key] = entry
        return list(merged.items())

    def mark(self) -> tuple[int, dict[tuple[str, str, str], Entry | None]]:
        return len(self.changes), dict(self.overlay)

    def rollback(self, mark: tuple[int, dict[tuple[str, str, str], Entry | None]]) -> None:
        del self.changes[mark[0]:]
        self.overlay = mark[1]

    # -- event records ---------------------------------------------------------------
    def event(self, id: str) -> tuple[EventRecord, Entry] | None:
        """The event ``id`` and its stored entry: an app's record, or the view of a bot's
        inbox record (:func:`bot_event`)."""
        where = parse_bot_id(id)
        if where is not None:
            entry = self.get(where[0], INBOX, where[1])
            return None if entry is None else (bot_event(where[0], where[1], entry), entry)
        entry = self.get(EVENTS_SCOPE, EVENTS_SPACE, id)
        return None if entry is None else (EventRecord.from_json(copy.deepcopy(entry[0])), entry)

    def events(self) -> builtins.list[tuple[EventRecord, Entry]]:
        """Every event, the bot's inbox records included, in creation order."""
        found = [(EventRecord.from_json(copy.deepcopy(e[0])), e) for _, e in self.items(EVENTS_SCOPE, EVENTS_SPACE)]
        spaces = {s for s in self.records if s[0] != EVENTS_SCOPE and s[1] == INBOX}
        spaces.update((s, sp) for (s, sp, _) in self.overlay if s != EVENTS_SCOPE and sp == INBOX)
        for scope, _ in spaces:
            found.extend((bot_event(scope, key, e), e) for key, e in self.items(scope, INBOX))
        found.sort(key=lambda pair: (pair[0].created_at, pair[0].id))
        return found

    def save_event(self, rec: EventRecord, previous: Entry | None) -> None:
        """Store an app's record (version one more than ``previous``'s)."""
        version = 1 if previous is None else previous[1] + 1
        self.put(EVENTS_SCOPE, EVENTS_SPACE, rec.id, rec.to_json(), version)


INBOX = "inbox"
"""The space of a bot's inbound records (:class:`~botmesh.core.kv_durability.KvDurability`)."""

BOT_ID_PREFIX = "botwa:"
"""Ids of a bot's records: ``botwa:<len(scope)>:<scope>:<key>`` (app ids may not start so)."""


def bot_id(scope: str, key: str) -> str:
    """The event id of a bot's inbound record ``key`` in ``scope``."""
    return f"{BOT_ID_PREFIX}{len(scope)}:{scope}:{key}"


def parse_bot_id(id: str) -> tuple[str, str] | None:
    """``(scope, key)`` of a :func:`bot_id`, or None."""
    if not id.startswith(BOT_ID_PREFIX):
        return None
    length, sep, rest = id[len(BOT_ID_PREFIX):].partition(":")
    if not sep or not length.isdigit() or len(rest) < int(length) + 2 or rest[int(length)] != ":":
        return None
    scope, key = rest[: int(length)], rest[int(length) + 1:]
    return (scope, key) if scope and key else None


def _num(value: Any, default: float | None) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else default


def bot_event(scope: str, key: str, entry: Entry) -> EventRecord:
    """A bot's inbox record (stored as the durability backend stores it) seen as an
    :class:`EventRecord` of channel :data:`BOT_CHANNEL` (EVENTS-1): the payload is the
    inbox record; state, attempts and lease are read from it; a record put back by a
    replay and not yet claimed is in state ``replay``."""
    value = copy.deepcopy(entry[0])
    state = value.get("state")
    if state not in ("pending", "leased", "done", "dead"):
        state = "pending"
    if state == "pending" and value.get("replayed") is True and value.get("attempts") == 0:
        state = "replay"
    raw_token, raw_attempts = value.get("token"), value.get("attempts")
    token = raw_token if is_int(raw_token) else 0
    attempts = raw_attempts if is_int(raw_attempts) else 0
    owner = value.get("owner")
    until = _num(value.get("lease_until"), None)
    lease = Lease(owner, token, until) if state == "leased" and isinstance(owner, str) and until is not None else None
    created = _num(value.get("created_at"), 0.0) or 0.0
    return EventRecord(
        id=bot_id(scope, key), channel=BOT_CHANNEL,
        event_type=BOT_EVENT_TYPES[1] if value.get("kind") == "interaction" else BOT_EVENT_TYPES[0],
        payload=value, state=state, attempts=attempts,
        token=token, lease=lease, created_at=created, updated_at=_num(value.get("updated_at"), created) or created,
        available_at=_num(value.get("next_at"), None) if state in ("pending", "replay") else None,
        error=value.get("error") if isinstance(value.get("error"), str) else None,
        meta={"scope": scope, "key": key, "version": entry[1]},
    )


def _check_text(value: Any, name: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str{' or None' if optional else ''}, got {value!r}")
    return value


def _check_now(now: Any) -> float:
    if now is None:
        return wall_ms()
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number of milliseconds, got {now!r}")
    return float(now)


def _check_token(token: Any) -> int:
    if not is_int(token) or token < 0:
        raise ValueError(f"token must be an int from 0, got {token!r}")
    return token


def _check_options(append_log: Any, compact_every: Any, compact_bytes: Any, fsync: Any) -> None:
    if not isinstance(append_log, bool):
        raise ConfigError(f"append_log must be True or False, got {append_log!r}", option="append_log")
    if not isinstance(fsync, bool):
        raise ConfigError(f"fsync must be True or False, got {fsync!r}", option="fsync")
    for option, given in (("compact_every", compact_every), ("compact_bytes", compact_bytes)):
        if not is_int(given) or given <= 0:
            raise ConfigError(f"{option} must be a positive int, got {given!r}", option=option)


def _raw_claimable(value: dict[str, Any], now: float) -> bool:
    """:meth:`EventRecord.claimable` on a stored record, without decoding it."""
    state, available = value.get("state"), value.get("available_at")
    if state in ("pending", "replay"):
        return available is None or available <= now
    if state == "failed":
        return available is not None and available <= now
    if state == "leased":
        lease = value.get("lease")
        return lease is None or lease.get("expires_at", 0.0) <= now
    return False


def replayed_inbox_value(value: dict[str, Any], now: float) -> dict[str, Any] | None:
    """A bot's inbox record put back to be processed (what ``replay_inbound`` does):
    ``None`` while it is leased."""
    if value.get("state") == "leased":
        return None
    new = {k: v for k, v in value.items() if k != "expires_at"}
    new.update(state="pending", attempts=0, next_at=now, lease_until=None, updated_at=now, error=None, replayed=True)
    return new


class _Journal(LeasedEventJournal):
    """What both journals share: the operations, the batching, close()."""

    def __init__(self, file: JournalFile) -> None:
        self._file = file
        self._queue: builtins.list[tuple[Op, asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._closing = False
        self.fsync = file.fsync
        self.append_log = file.append_log

    # -- properties -----------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._file.path

    @property
    def writes(self) -> int:
        """Flushes written since open (snapshot rewrites, or log appends): the
        benchmark's rewrites per message."""
        return self._file.writes

    @property
    def is_open(self) -> bool:
        return self._file.is_open and not self._closing

    @property
    def file(self) -> JournalFile:
        """The storage engine (:mod:`botmesh.events._file`)."""
        return self._file

    # -- running operations ----------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closing or not self._file.is_open:
            raise BackendUnavailableError(f"{self.path}: the event journal is closed", file=self.path)

    async def run(self, op: Op, *, write: bool = True) -> Any:
        """Apply ``op`` atomically (with the operations called concurrently, in one
        flush) and return its result or raise its exception. Used by
        :mod:`botmesh.events.durability` too."""
        self._refuse_if_closed()
        if not write and not self.multi_process:
            # One process: committed memory is the truth; nothing to lock or reload.
            self._file.check_usable()
            result = op(Txn(self._file.records))
            await asyncio.sleep(0)
            return result
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((op, fut))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush_loop())
        return await fut

    async def _flush_loop(self) -> None:
        try:
            await asyncio.sleep(0)  # let operations called at the same time join this flush
            while self._queue:
                batch, self._queue = self._queue, []
                await self._flush(batch)
        finally:
            self._flusher = None
            pending, self._queue = self._queue, []
            for _, fut in pending:  # only when the loop itself was cancelled
                if not fut.done():
                    fut.set_exception(BackendUnavailableError(f"{self.path}: the journal's flush was cancelled",
                                                              file=self.path))

    async def _flush(self, batch: builtins.list[tuple[Op, asyncio.Future[Any]]]) -> None:
        try:
            await self._acquire()
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else BackendUnavailableError(
                f"{self.path}: interrupted while waiting for the journal's mutex", file=self.path)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        outcomes: builtins.list[tuple[asyncio.Future[Any], bool, Any]] = []
        try:
            self._file.check_usable()
            self._before_batch()
            txn = Txn(self._file.records)
            for op, fut in batch:
                mark = txn.mark()
                try:
                    outcomes.append((fut, True, op(txn)))
                except Exception as exc:
                    txn.rollback(mark)
                    outcomes.append((fut, False, exc))
            if txn.changes:
                self._before_write()
                self._file.commit(txn.changes)
                self._after_write()
        except Exception as exc:
            problem: Exception = exc
            if isinstance(exc, OSError):  # the mutex file's own I/O: a driver error like any other
                problem = BackendUnavailableError(f"{self.path}: {exc}", file=self.path)
                problem.__cause__ = exc
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(problem)
            return
        finally:
            self._release()
        for fut, ok, value in outcomes:
            if fut.done():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    # hooks of the shared journal
    async def _acquire(self) -> None:
        return None

    def _release(self) -> None:
        return None

    def _before_batch(self) -> None:
        return None

    def _before_write(self) -> None:
        return None

    def _after_write(self) -> None:
        return None

    # -- the API ------------------------------------------------------------------------
    async def append(self, event_type: str, payload: Any = None, *, channel: str | None = None, id: str | None = None,
                     available_at: float | None = None, now: float | None = None) -> EventRecord:
        _check_text(event_type, "event_type")
        _check_text(channel, "channel", optional=True)
        _check_text(id, "id", optional=True)
        if channel == BOT_CHANNEL:
            raise EventJournalError(f"channel {BOT_CHANNEL!r} holds the bot's own records (events_durability); "
                                    "an app appends to another channel", channel=channel)
        if id is not None and id.startswith(BOT_ID_PREFIX):
            raise EventJournalError(f"ids starting with {BOT_ID_PREFIX!r} name the bot's records; got {id!r}", id=id)
        at = _check_now(now)
        when = None if available_at is None else _check_now(available_at)
        stored = check_json_object({"payload": payload})["payload"]
        rec = EventRecord(id=id or uuid.uuid4().hex, channel=channel, event_type=event_type, payload=stored,
                          created_at=at, updated_at=at, available_at=when)
        # Too deep for the file format: ValueError now, not for the whole flush later.
        encode_value(rec.to_json(), f"event {rec.id}")

        def op(txn: Txn) -> EventRecord:
            if txn.event(rec.id) is not None:
                raise EventJournalError(f"{self.path}: an event with id {rec.id!r} exists already", id=rec.id)
            txn.save_event(rec, None)
            return copy.deepcopy(rec)

        result: EventRecord = await self.run(op)
        return result

    async def get(self, id: str) -> EventRecord | None:
        _check_text(id, "id")

        def op(txn: Txn) -> EventRecord | None:
            found = txn.event(id)
            return None if found is None else found[0]

        result: EventRecord | None = await self.run(op, write=False)
        return result

    async def list(self, *, channel: Any = ANY_CHANNEL, state: str | Sequence[str] | None = None,
                   event_type: str | None = None, limit: int = 1000) -> builtins.list[EventRecord]:
        if channel is not ANY_CHANNEL:
            _check_text(channel, "channel", optional=True)
        states = (state,) if isinstance(state, str) else (None if state is None else tuple(state))
        for s in states or ():
            if s not in STATES:
                raise ValueError(f"state must be one of {', '.join(STATES)}, got {s!r}")
        if not is_int(limit) or limit < 0:
            raise ValueError(f"limit must be an int from 0, got {limit!r}")

        def op(txn: Txn) -> builtins.list[EventRecord]:
            out = [rec for rec, _ in txn.events()
                   if (channel is ANY_CHANNEL or rec.channel == channel)
                   and (states is None or rec.state in states)
                   and (event_type is None or rec.event_type == event_type)]
            return out[:limit]

        result: builtins.list[EventRecord] = await self.run(op, write=False)
        return result

    async def replay(self, id: str, *, now: float | None = None) -> EventRecord | None:
        _check_text(id, "id")
        at = _check_now(now)

        def op(txn: Txn) -> EventRecord | None:
            found = txn.event(id)
            if found is None:
                return None
            rec, entry = found
            if rec.state == "leased":
                return None
            if rec.channel == BOT_CHANNEL:
                # The bot's inbox record itself is put back (as replay_inbound does), so
                # that its sweep picks it up (EVENTS-1).
                scope, key = rec.meta["scope"], rec.meta["key"]
                value = replayed_inbox_value(entry[0], at)
                if value is None:
                    return None
                txn.put(scope, INBOX, key, value, entry[1] + 1, at, None)
                return bot_event(scope, key, (value, entry[1] + 1, at, None))
            rec.state, rec.attempts, rec.lease, rec.available_at, rec.error, rec.updated_at = "replay", 0, None, None, None, at
            txn.save_event(rec, entry)
            return rec

        result: EventRecord | None = await self.run(op)
        return result

    async def claim(self, owner: str, lease_ms: float, *, channel: str | None = None,
                    now: float | None = None) -> EventRecord | None:
        _check_text(owner, "owner")
        _check_text(channel, "channel", optional=True)
        lease = check_lease_ms(lease_ms)
        if channel == BOT_CHANNEL:
            raise EventJournalError(f"records of channel {BOT_CHANNEL!r} are claimed by the bot (events_durability), "
                                    "never by an app", channel=channel)
        at = _check_now(now)

        def op(txn: Txn) -> EventRecord | None:
            # channel None takes only records without a channel (EVENTS-1); the bot's
            # records (channel BOT_CHANNEL, never asked for here) are not even looked at.
            # Filtered on the stored JSON first: only the oldest claimable is decoded.
            oldest = min(
                ((value.get("created_at", 0.0), key, entry) for key, entry in txn.items(EVENTS_SCOPE, EVENTS_SPACE)
                 if (value := entry[0]).get("channel") == channel and _raw_claimable(value, at)),
                key=lambda c: (c[0], c[1]), default=None)
            for _, _, entry in [] if oldest is None else [oldest]:
                rec = EventRecord.from_json(copy.deepcopy(entry[0]))
                if rec.claimable(at):
                    rec.token += 1
                    rec.attempts += 1
                    rec.state = "leased"
                    rec.lease = Lease(owner, rec.token, at + lease)
                    rec.available_at = None
                    rec.updated_at = at
                    txn.save_event(rec, entry)
                    return rec
            return None

        result: EventRecord | None = await self.run(op)
        return result

    def _leased_op(self, id: str, token: int, change: Callable[[EventRecord], None]) -> Op:
        def op(txn: Txn) -> bool:
            found = txn.event(id)
            if found is None:
                return False
            rec, entry = found
            if rec.channel == BOT_CHANNEL:
                raise EventJournalError(f"{id!r} is a record of the bot (channel {BOT_CHANNEL!r}); its lease is the bot's",
                                        id=id)
            if rec.state != "leased" or rec.lease is None or rec.lease.token != token:
                return False
            change(rec)
            txn.save_event(rec, entry)
            return True

        return op

    async def heartbeat(self, id: str, token: int, lease_ms: float, *, now: float | None = None) -> bool:
        _check_text(id, "id")
        _check_token(token)
        lease = check_lease_ms(lease_ms)
        at = _check_now(now)

        def change(rec: EventRecord) -> None:
            assert rec.lease is not None
            rec.lease = Lease(rec.lease.owner, rec.lease.token, max(rec.lease.expires_at, at + lease))

        result: bool = await self.run(self._leased_op(id, token, change))
        return result

    async def complete(self, id: str, token: int, *, now: float | None = None) -> bool:
        _check_text(id, "id")
        _check_token(token)
        at = _check_now(now)

        def change(rec: EventRecord) -> None:
            rec.state, rec.lease, rec.error, rec.updated_at = "done", None, None, at

        result: bool = await self.run(self._leased_op(id, token, change))
        return result

    async def fail(self, id: str, token: int, error: str, *, retry_at: float | None = None, dead: bool = False,
                   now: float | None = None) -> bool:
        _check_text(id, "id")
        _check_token(token)
        if not isinstance(error, str):
            raise ValueError(f"error must be a str, got {error!r}")
        at = _check_now(now)
        retry = None if retry_at is None else _check_now(retry_at)

        def change(rec: EventRecord) -> None:
            rec.state = "dead" if dead else "failed"
            rec.lease, rec.error, rec.updated_at = None, error, at
            rec.available_at = None if dead else retry

        result: bool = await self.run(self._leased_op(id, token, change))
        return result

    async def release(self, id: str, token: int, *, now: float | None = None) -> bool:
        _check_text(id, "id")
        _check_token(token)
        at = _check_now(now)

        def change(rec: EventRecord) -> None:
            rec.state, rec.lease, rec.available_at, rec.updated_at = "pending", None, None, at

        result: bool = await self.run(self._leased_op(id, token, change))
        return result

    # -- lifecycle ----------------------------------------------------------------------
    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        flusher = self._flusher
        if flusher is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(flusher)
        await self._file.close()
        self._close_extra()

    def _close_extra(self) -> None:
        return None

    def abandon(self) -> None:
        """TEST ONLY: behave as if this process had died now (nothing more is written;
        locks are dropped as the kernel drops a dead process's)."""
        self._closing = True
        self._file.abandon()
        self._close_extra()

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class FileEventJournal(_Journal):
    """An event journal in one file for one process (module docstring). Open it with
    :meth:`open`."""

    @classmethod
    async def open(cls, path: str | os.PathLike[str], *, lock: bool = True, fsync: bool = True,
                   append_log: bool = False, compact_every: int = 1000, compact_bytes: int = 4 * 1024 * 1024,
                   io: FileIO | None = None) -> FileEventJournal:
        """Open (creating) the journal at ``path``. ``lock`` (default True, required by
        ``events_durability``, EVENTS-3): the pid lock ``<path>.lock`` refuses a second
        live process and a second open in this process with ``JournalLockedError``.
        ``fsync`` (True): each write forced to disk (BACK-6). ``append_log``: writes
        append to ``<path>.log``, compacted every ``compact_every`` entries or
        ``compact_bytes`` bytes. ``io``: the OS layer (fault injection). Bad options:
        ``ConfigError`` naming the option; damage: ``JournalCorruptError``."""
        if not isinstance(lock, bool):
            raise ConfigError(f"lock must be True or False, got {lock!r}", option="lock")
        _check_options(append_log, compact_every, compact_bytes, fsync)
        file = JournalFile(path, lock=lock, shared=False, append_log=append_log, compact_every=compact_every,
                           compact_bytes=compact_bytes, fsync=fsync, io=io)
        await file.open()
        journal = cls(file)
        journal.lock = lock
        return journal

    lock: bool = True
    """Whether the pid lock is held (``open(lock=...)``)."""
