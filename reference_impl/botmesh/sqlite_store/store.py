"""``SQLiteStore``: a persistent :class:`~botmesh.core.store.Store` in one SQLite file,
whose :meth:`SQLiteStore.durability` keeps the journals in table ``durable`` of the same
file (BACK-1).

Like :class:`~botmesh.sqlite_store.SQLiteKv`, the store runs its :mod:`sqlite3` calls
synchronously inside its coroutines (short local transactions; deterministic under the
virtual clock) and awaits ``asyncio.sleep(0)`` where
:class:`~botmesh.core.store.MemoryStore` does. Its writes (``set``, ``delete``,
``append_message``) made at the same moment by different tasks share one transaction and
one ``COMMIT`` (group commit, :mod:`botmesh.core.group_commit`); each returns once that
commit did, and a failed commit fails them all.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sqlite3
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ..core.errors import BackendUnavailableError
from ..core.group_commit import GroupCommit
from ..core.store import Store
from ._db import DEFAULT_BUSY_TIMEOUT_MS, check_busy_timeout, check_file, connect, rollback_quietly, unavailable
from .kv import SQLiteKv

if TYPE_CHECKING:
    from .durability import SQLiteDurability

_BYTES_TAG = "$bytes"


def _entry_default(value: Any) -> Any:
    """How the message log's encoder writes what JSON has no form for: ``bytes``
    (``bytearray``, ``memoryview``) as ``{"$bytes": base64}`` (the journal's convention,
    OUT-15); anything else is the ``TypeError`` ``json.dumps`` raises. The encoder calls it
    only for such values, so an entry without bytes is encoded without a walk of its own
    in Python (issue 16: it used to be copied whole first)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_ENTRY_ENCODER = json.JSONEncoder(default=_entry_default)
"""The text a message-log entry is stored as: ``json.dumps``'s with bytes as above."""


def _decode_entry(value: Any) -> Any:
    """Inverse of the encoding above: ``{"$bytes": base64}`` back to ``bytes``."""
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get(_BYTES_TAG), str):
            try:
                return base64.b64decode(value[_BYTES_TAG], validate=True)
            except ValueError:
                return value
        return {k: _decode_entry(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_entry(v) for v in value]
    return value


class SQLiteStore(Store):
    """A :class:`~botmesh.core.store.Store` kept in an SQLite file.

    * ``get``/``set``/``delete``: JSON values in table ``kv`` keyed by
      ``(namespace, key)``; ``set`` of a value ``json.dumps`` rejects raises
      ``BackendUnavailableError`` like ``MemoryStore``.
    * ``append_message``/``messages``: the message log in table ``messages``, in append
      order. Entries are stored as JSON; ``bytes`` inside an entry are stored as
      ``{"$bytes": base64}`` and come back as ``bytes`` (so a one-key dict of that exact
      shape is read back as bytes).
    * :meth:`durability`: the durability backend on the same file (BACK-1), table
      ``durable``, through its own connection. Store and journals never touch each
      other's tables (BACK-3).

    Opening the file creates every table of both (one schema, idempotent, safe when
    several processes open the file at once). WAL journal, ``busy_timeout`` of
    ``busy_timeout_ms`` and ``synchronous=FULL``: every acknowledged write survives a
    crash of the process and a power cut.

    The connection opens on :meth:`open` or lazily on the first call; :meth:`close`
    releases it (idempotent) and a later call opens it again. ``file`` must be a ``str``
    or ``os.PathLike`` naming a file (not a directory, not ``":memory:"``); otherwise
    :class:`~botmesh.core.errors.ConfigError` with ``option="file"`` is raised. Driver
    errors are raised as ``BackendUnavailableError`` naming the file.
    """

    def __init__(self, file: str | os.PathLike[str], *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> None:
        self._file = check_file(file)
        self._busy_timeout_ms = check_busy_timeout(busy_timeout_ms)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._group: GroupCommit[tuple[str, tuple[Any, ...], str], None] = GroupCommit(self._commit)

    @property
    def file(self) -> str:
        """The path of the SQLite file."""
        return self._file

    @property
    def busy_timeout_ms(self) -> int:
        """How long a call waits for another connection's write lock."""
        return self._busy_timeout_ms

    def __repr__(self) -> str:
        return f"SQLiteStore({self._file!r})"

    # -- lifecycle -----------------------------------------------------------------

    async def open(self) -> None:
        """Open the connection and create the schema (store tables and ``durable``)
        when needed. Idempotent."""
        with self._lock:
            self._connection()

    async def close(self) -> None:
        """Close the connection. Idempotent; a later call reopens it."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error as exc:
                    raise unavailable(self._file, exc, "close") from exc

    def _connection(self) -> sqlite3.Connection:
        """The open connection (opening it lazily); the caller holds ``self._lock``."""
        if self._conn is None:
            self._conn = connect(self._file, self._busy_timeout_ms)
        return self._conn

    def durability(self, **opts: Any) -> SQLiteDurability:
        """The durability backend of this store (BACK-1): a
        :class:`~botmesh.sqlite_store.SQLiteDurability` over a new
        :class:`~botmesh.sqlite_store.SQLiteKv` on the same file with its own connection,
        named ``"sqlite"``. ``opts`` go to its constructor (``busy_timeout_ms`` defaults
        to the store's and goes to the kv). Each call returns a new backend; its
        ``start()``/``stop()`` open and close its own connection, never the store's."""
        from .durability import SQLiteDurability

        busy_timeout_ms = opts.pop("busy_timeout_ms", self._busy_timeout_ms)
        opts.setdefault("name", "sqlite")
        return SQLiteDurability(SQLiteKv(self._file, busy_timeout_ms=busy_timeout_ms), **opts)

    # -- values --------------------------------------------------------------------

    async def get(self, namespace: str, key: str) -> Any | None:
        """The JSON value under ``(namespace, key)``, or ``None``."""
        with self._lock:
            conn = self._connection()
            try:
                row = conn.execute("SELECT value FROM kv WHERE namespace = ? AND key = ?", (namespace, key)).fetchone()
            except sqlite3.Error as exc:
                raise unavailable(self._file, exc, "get") from exc
        await asyncio.sleep(0)
        return None if row is None else json.loads(row[0])

    async def set(self, namespace: str, key: str, value: Any) -> None:
        """Store ``value`` (JSON) under ``(namespace, key)``, replacing any previous one."""
        try:
            text = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise BackendUnavailableError(f"store value for {namespace}/{key} is not JSON: {exc}") from exc
        await self._write(
            ("kv", namespace, key),
            "INSERT INTO kv (namespace, key, value) VALUES (?, ?, ?)"
            " ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value",
            (namespace, key, text),
            "set",
        )

    async def delete(self, namespace: str, key: str) -> None:
        """Remove the value under ``(namespace, key)``; nothing happens when absent."""
        await self._write(("kv", namespace, key), "DELETE FROM kv WHERE namespace = ? AND key = ?",
                          (namespace, key), "delete")

    # -- message log ---------------------------------------------------------------

    async def append_message(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` to the message log."""
        try:
            text = _ENTRY_ENCODER.encode(entry)
        except (TypeError, ValueError) as exc:
            raise BackendUnavailableError(f"message log entry is not JSON: {exc}") from exc
        chat_id = entry.get("chat_id") if isinstance(entry, dict) else None
        await self._write(
            object(),  # entries never wait for each other; a group keeps their order
            "INSERT INTO messages (chat_id, entry) VALUES (?, ?)",
            (chat_id if isinstance(chat_id, str) else None, text),
            "append_message",
        )

    async def _write(self, key: Hashable, sql: str, params: tuple[Any, ...], doing: str) -> None:
        """One write statement, run in a transaction shared with the store writes of other
        tasks made at the same moment (group commit, :mod:`botmesh.core.group_commit`):
        it returns once that transaction's ``COMMIT`` did."""
        with self._lock:
            self._connection()  # opened lazily, before anything is queued
        await self._group.submit(key, lambda: (sql, params, doing))

    def _commit(self, items: list[tuple[str, tuple[Any, ...], str]]) -> list[None]:
        """The statements of a group in one ``BEGIN IMMEDIATE`` transaction; a driver
        error rolls it back and fails every write of the group. A group of one statement
        runs it alone, as its own transaction (autocommit: one statement instead of
        three, as :meth:`SQLiteKv._commit <botmesh.sqlite_store.kv.SQLiteKv._commit>`)."""
        with self._lock:
            conn = self._connection()
            try:
                if len(items) == 1:
                    sql, params, _doing = items[0]
                    conn.execute(sql, params)
                    return [None]
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for sql, params, _doing in items:
                        conn.execute(sql, params)
                    conn.execute("COMMIT")
                except BaseException:
                    rollback_quietly(conn)
                    raise
            except sqlite3.Error as exc:
                doing = items[0][2] if len(items) == 1 else f"a group commit of {len(items)} writes"
                raise unavailable(self._file, exc, doing) from exc
        return [None] * len(items)

    async def messages(self, chat_id: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        """The log, oldest first, optionally only the entries of ``chat_id``; with
        ``limit`` the newest ``limit`` entries (still oldest first), all when ``limit`` is
        0 — as ``MemoryStore``."""
        with self._lock:
            conn = self._connection()
            try:
                if chat_id is None or isinstance(chat_id, str):
                    where, params = ("", ()) if chat_id is None else (" WHERE chat_id = ?", (chat_id,))
                    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                        rows = conn.execute(
                            f"SELECT entry FROM messages{where} ORDER BY id DESC LIMIT ?", (*params, limit)
                        ).fetchall()
                        rows.reverse()
                        return [_decode_entry(json.loads(row[0])) for row in rows]
                    rows = conn.execute(f"SELECT entry FROM messages{where} ORDER BY id", params).fetchall()
                    result = [_decode_entry(json.loads(row[0])) for row in rows]
                else:  # a non-str chat_id: compare in Python like MemoryStore does
                    rows = conn.execute("SELECT entry FROM messages ORDER BY id").fetchall()
                    result = [
                        entry
                        for entry in (_decode_entry(json.loads(row[0])) for row in rows)
                        if entry.get("chat_id") == chat_id
                    ]
            except sqlite3.Error as exc:
                raise unavailable(self._file, exc, "messages") from exc
        return result[-limit:] if limit else result
