"""``SQLiteKv``: the :class:`~botmesh.core.spi.DurableKv` of the SQLite backend, over
table ``durable`` of the store's file (BACK-1).

Synchronous I/O on purpose
--------------------------
Every method runs its :mod:`sqlite3` calls synchronously inside the coroutine, on the
event loop's thread — no worker threads, no ``run_in_executor``. They are short local
transactions on one file, and the engine is tested in virtual time
(:class:`botmesh.core.clock.VirtualClock`): synchronous I/O finishes before the coroutine
yields, so a virtual-time run is deterministic and time never runs ahead of a query.
Like :class:`~botmesh.core.memory.MemoryKv`, each method then awaits ``asyncio.sleep(0)`` once
(after its work, before it returns or raises ``VersionConflict``), so it is a real
suspension point and interleaves with other tasks exactly as the reference does. While
another *process* holds the write lock, a call blocks the loop for up to
``busy_timeout_ms`` — the price of this choice, acceptable for the local, short
transactions of this backend.

Atomicity across processes, group commit
----------------------------------------
Writes run in ``BEGIN IMMEDIATE`` transactions: each takes SQLite's write lock first, then
runs the conditional ``INSERT`` (``expected_version=0``; a primary-key violation is a
conflict) or ``UPDATE``/``DELETE ... WHERE version = ?`` (no row changed is a conflict), so
several processes sharing the file get exactly one winner per CAS (REPL-4: processes of
one host). A write alone (no other write of this process to share its commit) first runs
that one statement as its own transaction — the connection is in autocommit mode, and a
writing statement takes the write lock when it starts, waiting as ``BEGIN IMMEDIATE``
does — and only when it changed nothing is it decided in a transaction as above (issue
16: one statement per write instead of three). Reads are single statements on a WAL
snapshot.

Writes made at the same moment by different tasks of this process (different chats)
share one transaction and one ``COMMIT`` — one sync of the WAL
(:mod:`botmesh.core.group_commit`). Each write is still its own compare-and-set (a lost
one changes nothing and is that caller's ``VersionConflict``), two writes of one key
never share a transaction (the second waits for the first to settle), and each caller
returns only after the ``COMMIT``; a failed ``COMMIT`` (or any driver error in the
transaction) rolls it back and fails every write of the group.

Durability: WAL with ``synchronous=FULL`` — a write that returned survives a process
crash and a power cut.

Damage: every row carries a checksum written with it and checked on every read, the
table's integrity and the write-ahead log are checked at open
(:mod:`botmesh.sqlite_store._integrity`); a damaged file raises
:class:`~botmesh.core.errors.JournalCorruptError` naming it, never altered records.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..core.errors import BackendUnavailableError, VersionConflict
from ..core.group_commit import GroupCommit
from ..core.inputs import check_delete, check_put, check_range, check_record, check_scan
from ..core.spi import Capabilities, DurableKv, IndexName, Versioned, check_index, encode_json_object
from ._db import DEFAULT_BUSY_TIMEOUT_MS, check_busy_timeout, check_file, connect, rollback_quietly, unavailable
from ._integrity import check_row, row_crc

_ROW = "scope, space, key, value, version, due, expires, crc"
"""The columns :func:`~._integrity.check_row` checks, in its order."""
_RANGE_SQL = {
    column: f"SELECT {column}, {_ROW} FROM durable WHERE scope = ? AND space = ? AND {column} IS NOT NULL"
            f" AND {column} <= ? ORDER BY {column}, key"
    for column in ("due", "expires")
}
"""A range read of each index (its rows whole: each is checked against its checksum)."""
_VALUE_ENCODER = json.JSONEncoder(allow_nan=False)
"""``json.dumps(value, allow_nan=False)``'s encoder, built once (json.dumps with an option
builds one per call): the text a value is stored as, through
:func:`~botmesh.core.spi.encode_json_object` — the text and the errors
``_VALUE_ENCODER.encode(check_json_object(value))`` gives, without the deep copy, which a
kv that stores text has no use for (issue 16; a value JSON changes on the way, an ``int``
key or a tuple, reads back the same either way)."""


_NEW, _OPEN, _CLOSED = "new", "open", "closed"


class _Write(NamedTuple):
    """One compare-and-set of a group: ``text`` is the JSON value of a put, ``None`` for a
    delete."""

    scope: str
    space: str
    key: str
    text: str | None
    expected_version: int
    due: float | None
    expires: float | None

_SYNCHRONOUS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
"""``PRAGMA synchronous`` answers a number; its names, as SQLite documents them."""


class SQLiteKv(DurableKv):
    """A :class:`~botmesh.core.spi.DurableKv` stored in table ``durable`` of an SQLite
    file, with its own connection.

    ``file`` — the SQLite file (created when absent, with the whole schema of
    :class:`~botmesh.sqlite_store.SQLiteStore`); a bad value raises
    :class:`~botmesh.core.errors.ConfigError` naming the option ``file``.
    ``busy_timeout_ms`` — how long a call waits for another connection's write lock.

    The connection opens on :meth:`open` or lazily on the first call (as
    :class:`~botmesh.core.memory.MemoryKv` accepts calls before ``open``). After
    :meth:`close` every call raises :class:`~botmesh.core.errors.BackendUnavailableError`
    until :meth:`open` is called again. Every :mod:`sqlite3` error is raised as
    ``BackendUnavailableError`` naming the file.

    :meth:`durability_settings` reads ``PRAGMA synchronous`` and ``journal_mode`` of
    this connection. :meth:`_connect` builds it: a subclass may override it to adjust
    the connection (the testkit's tests do, to break durability on purpose and see the
    claims check refuse it).
    """

    capabilities = Capabilities(survives_crash=True, multi_process=True, multi_host=False, shared=False)

    def __init__(self, file: str | os.PathLike[str], *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> None:
        self._file = check_file(file)
        self._busy_timeout_ms = check_busy_timeout(busy_timeout_ms)
        self._conn: sqlite3.Connection | None = None
        self._state = _NEW
        self._lock = threading.Lock()
        self._group: GroupCommit[_Write, int] = GroupCommit(self._commit)

    @property
    def file(self) -> str:
        """The path of the SQLite file."""
        return self._file

    @property
    def busy_timeout_ms(self) -> int:
        """How long a call waits for another connection's write lock."""
        return self._busy_timeout_ms

    def __repr__(self) -> str:
        return f"SQLiteKv({self._file!r}, state={self._state})"

    # -- lifecycle -----------------------------------------------------------------

    async def open(self) -> None:
        """Open the connection and create the schema if needed. Idempotent; reopens a
        closed kv."""
        with self._lock:
            self._open_locked()

    async def close(self) -> None:
        """Close the connection. Idempotent. Later calls raise
        ``BackendUnavailableError`` until :meth:`open`."""
        with self._lock:
            conn, self._conn, self._state = self._conn, None, _CLOSED
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error as exc:
                    raise unavailable(self._file, exc, "close") from exc

    def _connect(self) -> sqlite3.Connection:
        """A new connection to the file with the durability pragmas and the schema
        (:func:`botmesh.sqlite_store._db.connect`); called with ``self._lock`` held."""
        return connect(self._file, self._busy_timeout_ms, journals=True)

    def _open_locked(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self._connect()
        self._state = _OPEN
        return self._conn

    def _connection(self) -> sqlite3.Connection:
        """The open connection (opening it lazily); the caller holds ``self._lock``."""
        if self._state == _CLOSED:
            raise BackendUnavailableError(f"SQLiteKv {self._file!r} is closed", file=self._file)
        return self._open_locked()

    async def durability_settings(self) -> dict[str, str]:
        """``{"kind": "sqlite", "synchronous": ..., "journal_mode": ...}`` read from the
        kv's own connection (opening it lazily): ``PRAGMA synchronous`` as its name
        (``OFF``, ``NORMAL``, ``FULL``, ``EXTRA``) and ``PRAGMA journal_mode`` (``wal``
        as shipped). Raises ``BackendUnavailableError`` after :meth:`close`."""
        with self._lock:
            conn = self._connection()
            try:
                level = conn.execute("PRAGMA synchronous").fetchone()[0]
                mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            except sqlite3.Error as exc:
                raise unavailable(self._file, exc, "reading the durability pragmas") from exc
        return {"kind": "sqlite", "synchronous": _SYNCHRONOUS.get(int(level), str(level)), "journal_mode": str(mode)}

    # -- DurableKv -----------------------------------------------------------------

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """The record at ``(scope, space, key)`` with its version, or ``None``."""
        check_record(scope, space, key)
        with self._lock:
            conn = self._connection()
            try:
                row = conn.execute(
                    f"SELECT {_ROW} FROM durable WHERE scope = ? AND space = ? AND key = ?",
                    (scope, space, key),
                ).fetchone()
            except sqlite3.Error as exc:
                raise unavailable(self._file, exc, "get") from exc
        if row is not None:
            check_row(self._file, row)
        result = None if row is None else Versioned(json.loads(row[3]), row[4])
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
        """Compare-and-set (see :meth:`DurableKv.put`): an ``INSERT`` for
        ``expected_version=0``, an ``UPDATE ... WHERE version = ?`` otherwise, in a
        ``BEGIN IMMEDIATE`` transaction shared with the writes of other tasks made at the
        same moment (group commit: one ``COMMIT`` for all; see the module docstring)."""
        due, expires = check_put(scope, space, key, expected_version, due, expires)
        text = encode_json_object(value, _VALUE_ENCODER)
        item = _Write(scope, space, key, text, expected_version, due, expires)
        return await self._write(item)

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """Remove the record at version ``expected_version`` (``DELETE ... WHERE version
        = ?`` in a ``BEGIN IMMEDIATE`` transaction, shared with concurrent writes: group
        commit); ``VersionConflict`` when absent or at another version."""
        check_delete(scope, space, key, expected_version)
        await self._write(_Write(scope, space, key, None, expected_version, None, None))

    async def _write(self, item: _Write) -> int:
        with self._lock:
            self._connection()  # closed: BackendUnavailableError now, nothing queued
        try:
            return await self._group.submit((item.scope, item.space, item.key), lambda: item)
        except VersionConflict:
            await asyncio.sleep(0)
            raise

    def _commit(self, items: list[_Write]) -> list[int | VersionConflict]:
        """One ``BEGIN IMMEDIATE`` transaction for a group of writes, each its own
        compare-and-set (an ``INSERT`` for version 0, else ``UPDATE``/``DELETE ... WHERE
        version = ?``; nothing changed is that write's ``VersionConflict``), then one
        ``COMMIT`` — or ``ROLLBACK`` when every write lost. A driver error fails the
        whole group (rolled back) as ``BackendUnavailableError``.

        A group of one write first runs its statement alone, as its own transaction
        (the connection is in autocommit mode: SQLite takes the write lock when the
        statement starts, with the busy timeout, and syncs the WAL when it ends): one
        statement instead of three, the operation the medium's raw rate is measured
        with (issue 16). When it changed nothing — a lost compare-and-set, or an
        ``INSERT`` refused — the transaction below runs it again and tells what it
        found (the version read in the same transaction as the failed write)."""
        if len(items) == 1:
            item = items[0]
            with self._lock:
                conn = self._connection()
                try:
                    try:
                        applied = self._run(conn, item)
                    except sqlite3.IntegrityError:
                        applied = False  # a duplicate key, or another error: the transaction tells
                except sqlite3.Error as exc:
                    raise unavailable(self._file, exc, "put" if item.text is not None else "delete") from exc
            if applied:
                return [item.expected_version + (0 if item.text is None else 1)]
        results: list[int | VersionConflict] = []
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for item in items:
                        found = self._apply(conn, item)
                        results.append(item.expected_version + (0 if item.text is None else 1) if found is None
                                       else VersionConflict.at(item.space, item.key, item.expected_version, found))
                    won = any(not isinstance(r, VersionConflict) for r in results)
                    conn.execute("COMMIT" if won else "ROLLBACK")
                except BaseException:
                    rollback_quietly(conn)
                    raise
            except sqlite3.Error as exc:
                doing = ("put" if items[0].text is not None else "delete") if len(items) == 1 else (
                    f"a group commit of {len(items)} writes")
                raise unavailable(self._file, exc, doing) from exc
        return results

    def _apply(self, conn: sqlite3.Connection, item: _Write) -> int | None:
        """Run one write's statement; ``None`` when it applied, else the version found."""
        try:
            if self._run(conn, item):
                return None
        except sqlite3.IntegrityError:
            if item.text is None or item.expected_version != 0:
                raise
            found = self._version_of(conn, item.scope, item.space, item.key)
            if found == 0:  # not a duplicate key: a genuine driver error
                raise
            return found
        return self._version_of(conn, item.scope, item.space, item.key)

    @staticmethod
    def _run(conn: sqlite3.Connection, item: _Write) -> bool:
        """Run one write's statement (``INSERT`` for version 0, else ``UPDATE``/``DELETE
        ... WHERE version = ?``); whether it changed a row. An ``INSERT`` of a key that
        exists raises ``sqlite3.IntegrityError``."""
        scope, space, key, expected = item.scope, item.space, item.key, item.expected_version
        if item.text is None:
            return bool(conn.execute(
                "DELETE FROM durable WHERE scope = ? AND space = ? AND key = ? AND version = ?",
                (scope, space, key, expected),
            ).rowcount)
        if expected == 0:
            conn.execute(
                "INSERT INTO durable (scope, space, key, value, version, due, expires, crc)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (scope, space, key, item.text, 1, item.due, item.expires,
                 row_crc(scope, space, key, item.text, 1, item.due, item.expires)),
            )
            return True
        crc = row_crc(scope, space, key, item.text, expected + 1, item.due, item.expires)
        return bool(conn.execute(
            "UPDATE durable SET value = ?, version = ?, due = ?, expires = ?, crc = ?"
            " WHERE scope = ? AND space = ? AND key = ? AND version = ?",
            (item.text, expected + 1, item.due, item.expires, crc, scope, space, key, expected),
        ).rowcount)

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """Up to ``limit`` entries ``(score, key)`` of ``index`` with ``score <= upto``,
        ascending by ``(score, key)``."""
        return (await self.ranges(scope, ((space, index),), upto=upto, limit=limit))[0]

    async def ranges(
        self, scope: str, reads: Sequence[tuple[str, IndexName]], *, upto: float, limit: int
    ) -> list[list[tuple[float, str]]]:
        """Several range reads under one hold of the kv's lock, one turn of the loop
        for all of them (each its own ``SELECT``: they need not share a snapshot)."""
        plan = []
        for space, index in reads:
            upper = check_range(scope, space, upto)
            plan.append((_RANGE_SQL[check_index(index)], (scope, space, upper)))  # ValueError for an unknown name
        with self._lock:
            conn = self._connection()
            try:
                found = [self._limited(conn, sql, params, limit) for sql, params in plan]
            except sqlite3.Error as exc:
                raise unavailable(self._file, exc, "range") from exc
        for rows in found:
            for row in rows:
                check_row(self._file, row[1:])
        await asyncio.sleep(0)
        return [[(float(row[0]), row[3]) for row in rows] for rows in found]

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """Up to ``limit`` records with key ``> after`` (all when ``after`` is None),
        ascending by key (code-point order: SQLite's binary collation compares UTF-8
        bytes, which sorts like code points)."""
        after = check_scan(scope, space, after)
        if after is None:
            sql = f"SELECT {_ROW} FROM durable WHERE scope = ? AND space = ? ORDER BY key"
            params: tuple[Any, ...] = (scope, space)
        else:
            sql = f"SELECT {_ROW} FROM durable WHERE scope = ? AND space = ? AND key > ? ORDER BY key"
            params = (scope, space, after)
        with self._lock:
            conn = self._connection()
            try:
                rows = self._limited(conn, sql, params, limit)
            except sqlite3.Error as exc:
                raise unavailable(self._file, exc, "scan") from exc
        for row in rows:
            check_row(self._file, row)
        result = [(row[2], Versioned(json.loads(row[3]), row[4])) for row in rows]
        await asyncio.sleep(0)
        return result

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _version_of(conn: sqlite3.Connection, scope: str, space: str, key: str) -> int:
        row = conn.execute(
            "SELECT version FROM durable WHERE scope = ? AND space = ? AND key = ?", (scope, space, key)
        ).fetchone()
        return 0 if row is None else int(row[0])

    @staticmethod
    def _limited(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...], limit: int) -> list[Any]:
        """Rows of ``sql`` cut to ``limit`` exactly as MemoryKv's ``[:limit]`` slice does
        (``LIMIT`` in SQL for the usual non-negative ``int``)."""
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
            return conn.execute(sql + " LIMIT ?", (*params, limit)).fetchall()
        return conn.execute(sql, params).fetchall()[:limit]
