"""The one place this package talks to :mod:`sqlite3`: validating the ``file`` option,
opening a connection with the durability pragmas, creating the schema, and translating
driver errors.

The schema (store tables and the journals table ``durable`` of BACK-1) is created as one
unit, in one ``BEGIN IMMEDIATE`` transaction of ``CREATE ... IF NOT EXISTS`` statements,
by whichever connection opens the file first — the store's or the durability's. It is
idempotent, and several processes opening the same file at once serialise on SQLite's
write lock (waiting up to ``busy_timeout_ms``) instead of failing.

Schema version 2 (``PRAGMA user_version``) adds the row checksum ``crc`` to ``durable``;
a version-1 file is migrated in that same transaction (the column added and filled), a
newer version is refused naming it. In that transaction too, before anything is written,
the checks of :mod:`._integrity` run: the write-ahead log's frames, and for the
journals' connection the integrity of table ``durable``. A damaged file is refused with
:class:`~botmesh.core.errors.JournalCorruptError` naming it, as is every ``SQLITE_CORRUPT``
or ``SQLITE_NOTADB`` the driver reports later (:func:`unavailable`).
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any

from ..core.errors import BackendUnavailableError, ConfigError, DurabilityError, JournalCorruptError
from ..core.fileio import place_problem
from ._integrity import check_wal, row_crc

DEFAULT_BUSY_TIMEOUT_MS = 5000
"""How long a connection waits for another connection's write lock before failing."""

SCHEMA_VERSION = 2
"""Stored in ``PRAGMA user_version`` when the schema is first created (1: without the
row checksum ``crc``, migrated at open)."""

SCHEMA: tuple[str, ...] = (
    # The store (botmesh.core.store.Store): JSON values by (namespace, key) ...
    """CREATE TABLE IF NOT EXISTS kv (
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (namespace, key)
    ) WITHOUT ROWID""",
    # ... and the message log, in insertion order (``id``).
    """CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        chat_id TEXT,
        entry TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS messages_chat_id ON messages (chat_id, id)",
    # The durability journals (BACK-1): the DurableKv records of every scope and space.
    """CREATE TABLE IF NOT EXISTS durable (
        scope TEXT NOT NULL,
        space TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        version INTEGER NOT NULL,
        due REAL,
        expires REAL,
        crc INTEGER,
        PRIMARY KEY (scope, space, key)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS durable_due ON durable (scope, space, due, key)",
    "CREATE INDEX IF NOT EXISTS durable_expires ON durable (scope, space, expires, key)",
)
"""Every table and index of a botmesh SQLite file, created together (BACK-1)."""

SCHEMA_NAMES: frozenset[str] = frozenset(
    statement.split(" IF NOT EXISTS ", 1)[1].split(None, 1)[0] for statement in SCHEMA
)
"""The names of :data:`SCHEMA`'s tables and indexes: a file that has them all has the
schema (``CREATE ... IF NOT EXISTS`` would leave it as it is), and an open skips the
statements (issue 16: they were 6 of a connection's 15 statements at open)."""

STORE_TABLES: tuple[str, ...] = ("kv", "messages")
"""Tables the store uses; the durability never touches them (BACK-3)."""

DURABILITY_TABLES: tuple[str, ...] = ("durable",)
"""Tables the durability uses; the store never touches them (BACK-3)."""


def check_file(file: Any) -> str:
    """Validate the ``file`` option and return it as a ``str`` path.

    Raises :class:`ConfigError` with ``option="file"`` when ``file`` is not a ``str`` or
    ``os.PathLike``, is empty or ``":memory:"`` (not a file several connections can
    share), holds a NUL byte, is a directory (or its ``-wal``/``-shm``/``-journal`` is),
    lives in a directory that does not exist or where this process cannot create files
    (SQLite creates the ``-wal`` and ``-shm`` files there), or exists and is not readable
    and writable (:func:`botmesh.core.fileio.place_problem`).
    """
    if not isinstance(file, (str, os.PathLike)):
        raise ConfigError(
            f"option 'file' must be a str or os.PathLike path of an SQLite file, got {type(file).__name__}",
            option="file",
            value=file,
        )
    try:
        path = os.fsdecode(os.fspath(file))
    except (TypeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"option 'file' is not a usable path: {exc}", option="file", value=file) from exc
    if path in ("", ":memory:") or path.startswith("file::memory:"):
        raise ConfigError(
            f"option 'file' must name a file on disk, got {path!r} (an in-memory database is "
            "neither durable nor shared between the store and its durability)",
            option="file",
            value=file,
        )
    if "\x00" in path:
        raise ConfigError(f"option 'file' must not contain a NUL byte, got {path!r}", option="file", value=file)
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"option 'file' cannot be encoded as a file name ({exc.reason}): {path!r}", option="file", value=file
        ) from None
    if os.path.isdir(path):
        raise ConfigError(f"option 'file' names a directory, not an SQLite file: {path!r}", option="file", value=file)
    problem = place_problem(path, ("-wal", "-shm", "-journal"))
    if problem is not None:
        raise ConfigError(f"option 'file': {problem}", option="file", value=file)
    return path


def check_busy_timeout(busy_timeout_ms: Any) -> int:
    """Validate the ``busy_timeout_ms`` option (a non-negative ``int``)."""
    if isinstance(busy_timeout_ms, bool) or not isinstance(busy_timeout_ms, int) or busy_timeout_ms < 0:
        raise ConfigError(
            f"option 'busy_timeout_ms' must be a non-negative int (milliseconds), got {busy_timeout_ms!r}",
            option="busy_timeout_ms",
            value=busy_timeout_ms,
        )
    return busy_timeout_ms


_DAMAGE_CODES = (11, 26)
"""``SQLITE_CORRUPT`` and ``SQLITE_NOTADB``: the file is damaged, not unreachable."""


def unavailable(file: str, exc: BaseException, doing: str) -> DurabilityError:
    """The error that replaces a driver error, naming the file:
    :class:`JournalCorruptError` when the driver found the file damaged
    (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``), else :class:`BackendUnavailableError`."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and (code & 0xFF) in _DAMAGE_CODES:
        damaged = JournalCorruptError(f"SQLite {file!r}: {doing} failed, the file is damaged: {exc} (restore it "
                                      "from a backup)", file=file)
        damaged.__cause__ = exc
        return damaged
    error = BackendUnavailableError(f"SQLite {file!r}: {doing} failed: {exc}", file=file)
    error.__cause__ = exc
    return error


def rollback_quietly(conn: sqlite3.Connection) -> None:
    """Roll back an open transaction, ignoring errors (used while another error is
    already on its way up)."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass


def _is_busy(exc: sqlite3.Error) -> bool:
    """True for SQLITE_BUSY / SQLITE_LOCKED ("database is locked")."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def _migrate(conn: sqlite3.Connection, file: str) -> None:
    """Bring the schema to :data:`SCHEMA_VERSION` (in the caller's transaction)."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        raise JournalCorruptError(f"SQLite {file!r}: schema version {version} is newer than this release knows "
                                  f"({SCHEMA_VERSION}); open it with the release that wrote it",
                                  code="JOURNAL_VERSION_UNSUPPORTED", file=file, version=version)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(durable)")}
    if "crc" not in columns:  # version 1: the row checksum added and filled
        conn.execute("ALTER TABLE durable ADD COLUMN crc INTEGER")
        conn.execute("UPDATE durable SET crc = botmesh_row_crc(scope, space, key, value, version, due, expires)")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _check_journals(conn: sqlite3.Connection, file: str) -> None:
    """``PRAGMA integrity_check(durable)``: the journals' b-trees and indexes."""
    found = [str(row[0]) for row in conn.execute("PRAGMA integrity_check(durable)").fetchmany(5)]
    if found != ["ok"]:
        raise JournalCorruptError(f"SQLite {file!r}: the journals' table is damaged: {'; '.join(found)} (restore "
                                  "the file from a backup)", code="INTEGRITY_CHECK", file=file, problems=found)


def _setup(conn: sqlite3.Connection, busy_timeout_ms: int, file: str = "", journals: bool = False) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    if str(mode).lower() != "wal":
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL journal mode (got {mode!r})")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA fullfsync = ON")
    conn.create_function("botmesh_row_crc", 7, row_crc, deterministic=True)
    conn.execute("BEGIN IMMEDIATE")
    try:
        # under the write lock: no other process appends to or resets the log meanwhile; the page
        # size from the connection, never by opening the file (that would drop this process's locks)
        check_wal(file, int(conn.execute("PRAGMA page_size").fetchone()[0]))
        names = {str(row[0]) for row in conn.execute("SELECT name FROM sqlite_master")}
        fresh = not names
        if not SCHEMA_NAMES <= names:  # a new file, or one missing a table or an index
            for statement in SCHEMA:
                conn.execute(statement)
        if fresh:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        else:
            _migrate(conn, file)
        if journals:
            _check_journals(conn, file)
        conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise


def connect(file: str, busy_timeout_ms: int, *, journals: bool = False) -> sqlite3.Connection:
    """Open ``file`` (created when absent) with WAL, ``busy_timeout`` and
    ``synchronous=FULL``, and create the schema. Raises
    :class:`BackendUnavailableError` naming the file on any driver error.

    Durability: in WAL mode with ``synchronous=FULL`` SQLite syncs the write-ahead log
    to disk at every commit, so every acknowledged (committed) write survives a crash of
    the process *and* a power cut. ``fullfsync`` makes that hold on macOS too (a no-op
    elsewhere).

    Concurrent first opens: switching a new file to WAL needs an exclusive lock, and
    SQLite answers "database is locked" at once, without its busy handler, when another
    process holds the file at that moment. Such a failure of the open sequence is
    retried (short, growing pauses) until ``busy_timeout_ms`` has passed. This is the only
    place the package waits by itself; it happens at open, not on every call.

    The connection is in autocommit mode (``isolation_level=None``): callers open
    transactions themselves with ``BEGIN IMMEDIATE``. ``check_same_thread`` is off;
    callers serialise use of a connection with their own lock.

    ``journals``: the journals' connection (``SQLiteKv``), which also checks table
    ``durable`` at open (:mod:`._integrity`). A damaged file raises
    :class:`JournalCorruptError` naming it.
    """
    try:
        conn = sqlite3.connect(
            file, timeout=busy_timeout_ms / 1000.0, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise unavailable(file, exc, "open") from exc
    deadline = time.monotonic() + busy_timeout_ms / 1000.0
    pause = 0.001
    try:
        while True:
            try:
                _setup(conn, busy_timeout_ms, file, journals)
                return conn
            except sqlite3.Error as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
    except sqlite3.Error as exc:
        conn.close()
        raise unavailable(file, exc, "open") from exc
    except BaseException:
        conn.close()
        raise
