"""A ``botmesh.events`` journal as a bot's durability backend (EVENTS-1, EVENTS-2, EVENTS-6).

:func:`events_durability` wraps a :class:`~botmesh.events.FileEventJournal` (opened with
``lock=True``) or a :class:`~botmesh.events.SharedFileEventJournal` in
:class:`~botmesh.core.kv_durability.KvDurability` through :class:`EventJournalKv`, a
:class:`~botmesh.core.spi.DurableKv` whose every call is one atomic operation of the
journal (queued with the calls made at the same time and written by one flush):

* the bot's inbox records are stored in the journal's file as the file backend stores
  them, and the journal shows them as :class:`~botmesh.events.EventRecord` of channel
  ``"botwa:durable"``, ``event_type`` ``"botwa.inbound.message"`` or
  ``"botwa.inbound.interaction"`` (``list()``, ``get()``); ``replay(id)`` on one puts it
  back as ``replay_inbound`` does, and the bot's sweep picks it up. An app's claim never
  takes them (EVENTS-1);
* the outbox is the core's, a sidecar in the same file and the same atomic snapshot
  (EVENTS-2) — or, with ``outbox=kv``, a ``DurableKv`` of a database backend (EVENTS-6).

Cost: each inbound message and each send costs a few journal writes (a journal, a claim,
a completion); writes made at the same time share one rewrite (``journal.writes``
counts them; ``benchmarks/events_journal.py`` measures it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from botmesh.core.errors import BackendUnavailableError, ConfigError, VersionConflict
from botmesh.core.file_format import Entry, encode_value
from botmesh.core.inputs import check_delete, check_put, check_range, check_record, check_scan
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import Capabilities, DurableKv, IndexName, Versioned, check_index, check_json_object, index_entries

from .journal import FileEventJournal, Txn, _Journal
from .shared import SharedFileEventJournal

__all__ = ["EventJournalKv", "EventsDurability", "events_durability"]


class EventJournalKv(DurableKv):
    """The :class:`DurableKv` of :func:`events_durability` over an open journal (or, made
    by :meth:`on_file`, over a journal it opens and closes itself). Non-inbox spaces go
    to ``outbox`` when given. Its capabilities: ``survives_crash`` with the journal's
    ``fsync``; ``multi_process`` for a shared journal (and, with ``outbox``, only what
    both claim)."""

    def __init__(self, journal: _Journal | None, *, outbox: DurableKv | None = None,
                 open_args: dict[str, Any] | None = None) -> None:
        self.journal = journal
        self.outbox = outbox
        self._open_args = open_args
        self._closed = False
        shared = journal.multi_process if journal is not None else bool(open_args and open_args.get("shared"))
        fsync = journal.fsync if journal is not None else bool(open_args is None or open_args.get("fsync", True))
        caps = Capabilities(survives_crash=fsync, multi_process=shared)
        if outbox is not None:
            other = outbox.capabilities
            caps = Capabilities(survives_crash=caps.survives_crash and other.survives_crash,
                                multi_process=caps.multi_process and other.multi_process)
        self.capabilities = caps

    @classmethod
    def on_file(cls, path: str, *, shared: bool = False, append_log: bool = False, fsync: bool = True) -> EventJournalKv:
        """A kv that opens its own journal at ``path`` at :meth:`open` (a
        ``FileEventJournal(lock=True)``, or a ``SharedFileEventJournal``) and closes it
        at :meth:`close` (the testkit's ``kv_factory``)."""
        return cls(None, open_args={"path": path, "shared": shared, "append_log": append_log, "fsync": fsync})

    async def open(self) -> None:
        if self._open_args is not None and (self.journal is None or not self.journal.is_open):
            a = self._open_args
            if a["shared"]:
                self.journal = await SharedFileEventJournal.open(a["path"], append_log=a["append_log"], fsync=a["fsync"])
            else:
                self.journal = await FileEventJournal.open(a["path"], lock=True, append_log=a["append_log"],
                                                           fsync=a["fsync"])
        if self.outbox is not None:
            await self.outbox.open()
        self._closed = False

    async def close(self) -> None:
        """Later calls raise ``BackendUnavailableError``. Closes the journal only when it
        opened it (:meth:`on_file`); a given journal or ``outbox`` kv is the caller's."""
        self._closed = True
        if self._open_args is not None and self.journal is not None:
            await self.journal.close()

    def abandon(self) -> None:
        """TEST ONLY: drop the journal it opened as a dead process would (its
        ``abandon``); later calls raise ``BackendUnavailableError``."""
        self._closed = True
        if self._open_args is not None and self.journal is not None:
            self.journal.abandon()

    async def durability_settings(self) -> dict[str, str]:
        j = self._journal()
        return {"kind": "file", "fsync": str(j.fsync), "append_log": str(j.append_log)}

    def _journal(self) -> _Journal:
        if self._closed or self.journal is None:
            raise BackendUnavailableError("the event journal kv is closed")
        return self.journal

    def _side(self, space: str) -> DurableKv | None:
        return self.outbox if self.outbox is not None and space != "inbox" else None

    # -- DurableKv ------------------------------------------------------------------------
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        check_record(scope, space, key)
        side = self._side(space)
        if side is not None:
            return await side.get(scope, space, key)

        def op(txn: Txn) -> Versioned | None:
            entry = txn.get(scope, space, key)
            return None if entry is None else Versioned(copy.deepcopy(entry[0]), entry[1])

        result: Versioned | None = await self._journal().run(op, write=False)
        return result

    async def put(self, scope: str, space: str, key: str, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        due_score, expires_score = check_put(scope, space, key, expected_version, due, expires)
        side = self._side(space)
        if side is not None:
            return await side.put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)
        stored = check_json_object(value)
        encode_value(stored, f"{scope}/{space}/{key}")  # too deep: ValueError now, not in the flush

        def op(txn: Txn) -> int:
            current = txn.get(scope, space, key)
            found = 0 if current is None else current[1]
            if found != expected_version:
                raise VersionConflict.at(space, key, expected_version, found)
            txn.put(scope, space, key, stored, expected_version + 1, due_score, expires_score)
            return expected_version + 1

        result: int = await self._journal().run(op)
        return result

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        check_delete(scope, space, key, expected_version)
        side = self._side(space)
        if side is not None:
            await side.delete(scope, space, key, expected_version=expected_version)
            return

        def op(txn: Txn) -> None:
            current = txn.get(scope, space, key)
            found = 0 if current is None else current[1]
            if current is None or found != expected_version:
                raise VersionConflict.at(space, key, expected_version, found)
            txn.delete(scope, space, key)

        await self._journal().run(op)

    async def range(self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
                    ) -> list[tuple[float, str]]:
        upto = check_range(scope, space, upto)
        pos = 2 if check_index(index) == "due" else 3
        side = self._side(space)
        if side is not None:
            return await side.range(scope, space, index, upto=upto, limit=limit)

        result: list[tuple[float, str]] = await self._journal().run(
            lambda txn: index_entries(txn.items(scope, space), pos, upto, limit), write=False)
        return result

    async def ranges(self, scope: str, reads: Sequence[tuple[str, IndexName]], *, upto: float, limit: int
                     ) -> list[list[tuple[float, str]]]:
        """Several range reads in one read of the journal (one catch-up with the other
        processes' events on a shared one); reads of an ``outbox`` kept elsewhere go to
        it, read by read."""
        plan: list[tuple[str, int, float]] = []  # (space, the index's position in an entry, upto)
        for space, index in reads:
            upper = check_range(scope, space, upto)
            plan.append((space, 2 if check_index(index) == "due" else 3, upper))
        if any(self._side(space) is not None for space, _, _ in plan):
            return await super().ranges(scope, reads, upto=upto, limit=limit)

        result: list[list[tuple[float, str]]] = await self._journal().run(
            lambda txn: [index_entries(txn.items(scope, space), pos, upper, limit) for space, pos, upper in plan],
            write=False)
        return result

    async def scan(self, scope: str, space: str, *, after: str | None = None, limit: int = 100
                   ) -> list[tuple[str, Versioned]]:
        after = check_scan(scope, space, after)
        side = self._side(space)
        if side is not None:
            return await side.scan(scope, space, after=after, limit=limit)

        def op(txn: Txn) -> list[tuple[str, Versioned]]:
            items: list[tuple[str, Entry]] = sorted((k, e) for k, e in txn.items(scope, space) if after is None or k > after)
            return [(k, Versioned(copy.deepcopy(e[0]), e[1])) for k, e in items[:limit]]

        result: list[tuple[str, Versioned]] = await self._journal().run(op, write=False)
        return result


class EventsDurability(KvDurability):
    """The durability backend :func:`events_durability` returns. ``start()``/``stop()``
    neither open nor close the journal (it is the app's); ``close()`` closes it."""

    def __init__(self, kv: EventJournalKv) -> None:
        super().__init__(kv, own_kv=True, name="events")
        self.events_kv = kv

    @property
    def journal(self) -> _Journal:
        assert self.events_kv.journal is not None
        return self.events_kv.journal

    async def start(self) -> None:
        await self.events_kv.open()

    async def stop(self) -> None:
        return None

    async def close(self) -> None:
        """Close the journal (an ``outbox`` kv stays the caller's)."""
        await self.journal.close()

    def abandon(self) -> None:
        """TEST ONLY: simulate the death of this process (the journal's ``abandon``)."""
        self.journal.abandon()


def events_durability(*, journal: Any, outbox: DurableKv | None = None) -> EventsDurability:
    """The durability backend over an open event journal (EVENTS-1, EVENTS-2, EVENTS-6):
    a :class:`FileEventJournal` opened with ``lock=True`` (EVENTS-3), or a
    :class:`SharedFileEventJournal`. ``outbox``: a ``DurableKv`` (PostgreSQL, Redis) to
    keep the outbox in instead of the journal's file; it is opened at ``start()`` and
    stays the caller's to close. Anything else raises ``ConfigError`` naming the
    argument."""
    if not isinstance(journal, (FileEventJournal, SharedFileEventJournal)):
        raise ConfigError(f"journal must be a FileEventJournal or a SharedFileEventJournal, got {type(journal).__name__}",
                          option="journal")
    if isinstance(journal, FileEventJournal) and not journal.lock:
        raise ConfigError(f"journal: {journal.path} was opened with lock=False; a FileEventJournal used as a "
                          "durability backend must be opened with lock=True (EVENTS-3)", option="journal")
    if not journal.is_open:
        raise ConfigError(f"journal: {journal.path} is closed", option="journal")
    if outbox is not None and not isinstance(outbox, DurableKv):
        raise ConfigError(f"outbox must be a DurableKv (or None), got {type(outbox).__name__}", option="outbox")
    return EventsDurability(EventJournalKv(journal, outbox=outbox))
