"""``PostgresKv``: the :class:`~botmesh.core.spi.DurableKv` of the PostgreSQL backend, over
table ``{table_prefix}durable`` (BACK-2), with psycopg 3 (async) and psycopg-pool.

Table
-----
::

    scope    text COLLATE "C" NOT NULL    -- the bot's scope (SCOPE-1): part of the key
    space    text COLLATE "C" NOT NULL    -- "inbox", "outbox", ...
    key      text COLLATE "C" NOT NULL
    value    json NOT NULL                -- json.dumps text, kept verbatim
    version  bigint NOT NULL
    due      double precision             -- NULL: no entry in the "due" index
    expires  double precision             -- NULL: no entry in the "expires" index
    PRIMARY KEY (scope, space, key)

plus ``{table}_due`` on ``(scope, space, due, key)`` and ``{table}_expires`` on
``(scope, space, expires, key)``, both partial (``WHERE ... IS NOT NULL``: ``done`` and
``sent`` records have no ``due`` entry, so the index holds only what a sweep looks for).

* ``COLLATE "C"`` compares the UTF-8 bytes, which sorts like code points: ``scan`` and
  the ``key`` tie-break of ``range`` follow the contract's code-point order whatever the
  database's default collation is. The database must use the UTF8 encoding (the default)
  for keys outside ASCII.
* ``value`` is ``json`` (not ``jsonb``): the text produced by ``json.dumps`` (ASCII only,
  compact) is stored and returned byte for byte, so big integers, floats such as
  ``1e-07`` and ``0.30000000000000004``, key order and escaped ``U+0000`` (which ``jsonb``
  refuses) round-trip exactly; the server still checks that it is JSON.

Creation (BACK-2)
-----------------
At :meth:`PostgresKv.open` the table's schema is resolved once: the ``schema`` option,
or else ``current_schema()`` of the connection — the first existing schema of its
``search_path``, where an unqualified ``CREATE TABLE`` would put the table. So a
``search_path`` given in the connection string (``options=-c search_path=...``) or set
on the pool's connections applies, and every statement then names the table qualified,
so a later change of ``search_path`` cannot send a query to another table.

When the table or one of its indexes is missing, they are created in one transaction
that first takes ``pg_advisory_xact_lock`` on a key derived from the qualified table name:
``CREATE TABLE IF NOT EXISTS`` alone is not safe against concurrent creation in
PostgreSQL (two sessions can both pass the existence check and one then fails on a
unique violation of ``pg_type``). Several processes (or tasks) starting at once on a
fresh prefix therefore serialise on the lock; the later ones find everything created. A
unique-violation / duplicate-object error (a creator that does not take the lock) is
retried, at most twice. When everything exists nothing is locked and no DDL runs (a
``CREATE INDEX IF NOT EXISTS`` on an existing index would still take a lock that blocks
writers).

Atomicity (REPL-1, REPL-4)
--------------------------
Every ``put`` and ``delete`` is a single statement, atomic in the server under any number
of clients on any number of hosts:

* create (``expected_version=0``): ``INSERT ... ON CONFLICT (scope, space, key) DO
  NOTHING`` — of concurrent creators exactly one inserts;
* replace: ``UPDATE ... SET version = version + 1 ... WHERE ... AND version = %s`` — the
  row lock and READ COMMITTED's re-check of the ``WHERE`` on the newest row version let
  exactly one of concurrent writers with the same ``expected_version`` through;
* delete: ``DELETE ... WHERE ... AND version = %s``.

Each of them is the data-modifying part of ONE statement (one round trip, issue 16),
``WITH w AS (<insert/update/delete> RETURNING version) SELECT ... FROM w UNION ALL
SELECT version, value FROM <table> WHERE <the key> AND NOT EXISTS (SELECT FROM w)``: it
returns the new version when it wrote, and otherwise the record as the statement's
snapshot saw it, which :class:`~botmesh.core.errors.VersionConflict` carries as ``found``
and ``current`` so that the caller need not read it again. That snapshot is taken when
the statement starts; a conflict it cannot explain — it shows the expected version (a
concurrent writer committed after it, and READ COMMITTED's re-check of the newest row
version failed), or no row for a failed create (a concurrent insert) — is the one case
where a second statement reads the record. Connections are
expected in READ COMMITTED (PostgreSQL's default); a stricter isolation level makes some
concurrent writes fail with a serialization error, raised as ``BackendUnavailableError``.

No write is ever retried here: a write that raised may have landed (a connection lost
after the statement was sent), and :class:`~botmesh.core.kv_durability.KvDurability` reads the
record back by key to find out. Reads are not retried either.

Connections and dropped connections (BACK-2)
--------------------------------------------
With ``connection_string`` the kv creates its own :class:`psycopg_pool.AsyncConnectionPool`
(``min_size``/``max_size``, autocommit connections) at :meth:`open` and closes it at
:meth:`close`. An injected ``pool`` belongs to the caller: it must be open before
:meth:`open`, and :meth:`close` leaves it open. Its connections may be in autocommit or
not (a non-autocommit connection gets a ``COMMIT`` after each call).

A connection the server dropped while it sat idle in the pool (server restart, failover,
``pg_terminate_backend``) is detected when it is taken for the next query, for own and
injected pools alike: an idle connection's socket has nothing to read unless the server
sent something — the ``FATAL`` of a terminated backend, or the end of the stream — so a
zero-timeout ``poll`` decides; only when something is there does a real round trip
(psycopg-pool's ``check_connection``) decide whether the connection still works. A dead
one is reported with ``logger.error``, closed (the pool replaces it) and the next one is
taken, so the query that follows runs on a working connection. The usual case costs no
round trip. A connection lost in the middle of a call (or silently, without the server
saying so) makes that call raise ``BackendUnavailableError``; it is reported with
``logger.error`` too, and the pool replaces it.

Unanswered calls
----------------
A server that stops answering without closing the connection (a network partition, a
frozen server, a blackholing proxy) would leave a call waiting for as long as the
kernel keeps the TCP connection — hours with default keepalive settings. So each call
(statement and, on a non-autocommit connection, its ``COMMIT``) gets ``query_timeout``
seconds (default 30; ``None``: no limit): when no answer has come by then the socket of
its connection is shut down, which wakes the waiting call at once with a lost-connection
error; the call raises ``BackendUnavailableError`` saying so, the event is reported with
``logger.error`` and the pool replaces the connection. A cut write may or may not have
landed — exactly the "outcome unknown" case :class:`~botmesh.core.kv_durability.KvDurability`
resolves by reading the record back by key. The cut is client-side only: a statement the
server is still running (or has not received yet) goes on there until it notices the
closed connection. The limit is per call, so it must exceed the slowest legitimate call:
single-row statements, and at :meth:`PostgresKv.open` the creation of the table, which
may wait on the advisory lock for other processes creating it.

Errors: arguments outside the contract are refused before any statement, as by every
built-in kv (:mod:`botmesh.core.inputs`); every psycopg / psycopg-pool error is raised as
:class:`~botmesh.core.errors.BackendUnavailableError` naming the table, the original chained. Calls before :meth:`open` and after
:meth:`close` raise ``BackendUnavailableError``.

Simulated death (tests): :meth:`PostgresKv.abandon` drops the kv as a dead process would:
the sockets of its own pool's connections are closed at once, synchronously (libpq's
``PQfinish``; the kv keeps a weak set of the connections its pool opened) — no
transaction is open between calls and nothing is buffered client-side, so nothing else
happens, exactly as when the server sees a process die. It needs no running event loop,
so it works even after the loop that opened the pool has been closed (a test harness
closing up on a fresh loop). When that loop is still usable the pool itself (its worker tasks) is
also closed in the background, and the next :meth:`open` of any ``PostgresKv`` on the
same loop waits for that, so no test leaks server connections or tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import weakref
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from ..core.errors import BackendUnavailableError, VersionConflict
from ..core.inputs import check_delete, check_put, check_range, check_record, check_scan, value_text
from ..core.spi import Capabilities, DurableKv, IndexName, Versioned, check_index
from ._config import (
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    DEFAULT_QUERY_TIMEOUT_S,
    DEFAULT_TABLE_PREFIX,
    DEFAULT_TIMEOUT_S,
    check_connection_class,
    check_logger,
    check_pool_sizes,
    check_query_timeout,
    check_schema,
    check_source,
    check_table_prefix,
    check_timeout,
)
from ._death import ABANDONED, close_pool_quietly, drop_connections, finish_abandoned, hand_over_idle
from ._settings import show_settings
from ._statements import Statements as _Statements
from ._statements import statements_for

__all__ = ["PostgresKv"]

T = TypeVar("T")
Conn = psycopg.AsyncConnection[Any]
Pool = AsyncConnectionPool[Any]

_NEW, _OPEN, _CLOSED = "new", "open", "closed"

_LOCK_CLASS = 0x626D
"""First key of the two-key advisory lock taken while creating a table ("bm"); the
second is derived from the qualified table name."""

_CREATION_ATTEMPTS = 3

_CONCURRENT_DDL_ERRORS: tuple[type[psycopg.Error], ...] = (
    pg_errors.UniqueViolation,
    pg_errors.DuplicateTable,
    pg_errors.DuplicateObject,
    pg_errors.DuplicateSchema,
)
"""What a concurrent creator that does not take the advisory lock can make DDL fail with."""

_DRIVER_ERRORS: tuple[type[BaseException], ...] = (psycopg.Error, UnicodeError)
"""Errors translated to ``BackendUnavailableError`` (psycopg-pool's derive from
``psycopg.OperationalError``)."""

def _lock_key(name: str) -> int:
    """A signed 32-bit advisory-lock key for ``name``."""
    key = zlib.crc32(name.encode("utf-8"))
    return key - (1 << 32) if key >= (1 << 31) else key


def _limit_sql(limit: Any) -> bool:
    """Whether ``limit`` can go to SQL's ``LIMIT`` (a non-negative ``int``); any other value
    is applied in Python exactly as ``MemoryKv``'s ``[:limit]`` slice."""
    return isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0


def _cut(conn: Conn, cut: list[bool]) -> None:
    """Shut down the socket of ``conn`` (both directions; the descriptor stays libpq's):
    a call waiting on it wakes at once with a lost-connection error instead of waiting
    for an answer that may never come (``query_timeout``)."""
    cut.append(True)
    with contextlib.suppress(Exception):
        sock = socket.socket(fileno=conn.pgconn.socket)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()


def _input_pending(conn: Conn) -> bool:
    """True when the socket of an idle connection has something to read (or is closed):
    the server spoke — or hung up — since the last reply was read."""
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        return True
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


class PostgresKv(DurableKv):
    """A :class:`~botmesh.core.spi.DurableKv` in table ``{table_prefix}durable`` of a
    PostgreSQL database (see the module docstring for the design).

    Exactly one of:

    * ``pool`` — an open :class:`psycopg_pool.AsyncConnectionPool` owned by the caller
      (never opened nor closed here);
    * ``connection_string`` — a ``postgresql://`` URL or libpq ``key=value`` string; the
      kv creates its own pool (``min_size``, ``max_size``) at :meth:`open` and closes it at
      :meth:`close`.

    ``table_prefix`` — 1 to 41 ASCII letters, digits or ``_``, not starting with a digit
    (default ``"botmesh_"``). ``schema`` — the schema of the table (created when missing),
    or None for the connection's ``search_path``. ``logger`` — where dropped connections
    are reported (default ``logging.getLogger("botmesh.postgres")``). ``timeout`` —
    seconds to wait for a connection from the pool. ``query_timeout`` — seconds a call
    waits for the server's answer before its connection is cut and the call fails (None:
    no limit; see "Unanswered calls" in the module docstring). ``connection_class`` — the
    :class:`psycopg.AsyncConnection` subclass the kv's own pool connects with (None:
    psycopg-pool's default; not with ``pool``). A bad option raises
    :class:`~botmesh.core.errors.ConfigError` naming it.
    """

    capabilities = Capabilities(survives_crash=True, multi_process=True, multi_host=True, shared=True)

    def __init__(
        self,
        *,
        pool: Pool | None = None,
        connection_string: str | None = None,
        table_prefix: str = DEFAULT_TABLE_PREFIX,
        schema: str | None = None,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
        min_size: int = DEFAULT_MIN_SIZE,
        max_size: int = DEFAULT_MAX_SIZE,
        timeout: float = DEFAULT_TIMEOUT_S,
        query_timeout: float | None = DEFAULT_QUERY_TIMEOUT_S,
        connection_class: type[Conn] | None = None,
    ) -> None:
        check_source(pool, connection_string)
        self._table_prefix = check_table_prefix(table_prefix)
        self._schema_option = check_schema(schema)
        self._logger = check_logger(logger)
        self._min_size, self._max_size = check_pool_sizes(min_size, max_size)
        self._timeout = check_timeout(timeout)
        self._query_timeout = check_query_timeout(query_timeout)
        self._connection_class: type[Conn] | None = check_connection_class(connection_class, pool)
        self._injected_pool = pool
        self._conninfo = connection_string
        self._table = f"{self._table_prefix}durable"
        self._schema: str | None = self._schema_option
        self._pool: Pool | None = None
        self._connections: weakref.WeakSet[Conn] = weakref.WeakSet()
        self._sql: _Statements | None = None
        self._state = _NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open_lock: asyncio.Lock | None = None

    # -- description ---------------------------------------------------------------

    @property
    def table_prefix(self) -> str:
        """The validated ``table_prefix``."""
        return self._table_prefix

    @property
    def table(self) -> str:
        """The table's name, unqualified: ``{table_prefix}durable``."""
        return self._table

    @property
    def schema(self) -> str | None:
        """The table's schema: the ``schema`` option, or — once opened — the
        ``current_schema()`` it was resolved to; None before that."""
        return self._schema

    @property
    def owns_pool(self) -> bool:
        """True when the kv creates (and closes) its pool (``connection_string``)."""
        return self._injected_pool is None

    @property
    def pool(self) -> Pool | None:
        """The pool in use while open (the injected one, or the kv's own); None otherwise."""
        return self._pool

    @property
    def logger(self) -> logging.Logger | logging.LoggerAdapter[Any]:
        """Where dropped connections are reported."""
        return self._logger

    def _label(self) -> str:
        return self._table if self._schema is None else f"{self._schema}.{self._table}"

    def __repr__(self) -> str:
        source = "own pool" if self.owns_pool else "injected pool"
        return f"PostgresKv(table={self._label()!r}, {source}, state={self._state})"

    # -- lifecycle -----------------------------------------------------------------

    async def open(self) -> None:
        """Take the pool (creating and opening the kv's own one), resolve the schema and
        create the table and its indexes when missing (BACK-2). Idempotent; reopens a
        closed kv (with a new own pool). Raises ``BackendUnavailableError`` when the
        server cannot be reached within ``timeout`` or an injected pool is not open; an
        own pool is then closed again."""
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._state == _OPEN:
                return
            await finish_abandoned()
            if self._injected_pool is not None:
                pool = self._injected_pool
                if pool.closed:
                    raise BackendUnavailableError(
                        f"PostgreSQL {self._label()}: the injected pool {pool.name!r} is not open "
                        "(it belongs to the caller: `await pool.open()` before starting the backend)",
                        table=self._label(),
                    )
            else:
                assert self._conninfo is not None
                connections: weakref.WeakSet[Conn] = weakref.WeakSet()

                async def track(conn: Conn) -> None:
                    connections.add(conn)

                self._connections = connections
                own: dict[str, Any] = {} if self._connection_class is None else {"connection_class": self._connection_class}
                pool = AsyncConnectionPool(
                    self._conninfo,
                    min_size=self._min_size,
                    max_size=self._max_size,
                    open=False,
                    kwargs={"autocommit": True},
                    name=f"botmesh:{self._table}",
                    timeout=self._timeout,
                    configure=track,
                    **own,
                )
                try:
                    # its first connection ready before the first call: asked while it was
                    # still connecting, the pool grew by a second one for that call
                    await pool.open(wait=True, timeout=self._timeout)
                except _DRIVER_ERRORS as exc:
                    raise self._unavailable("open", exc) from exc
            try:
                statements = await self._run_on(pool, "open (create the table)", self._prepare)
            except BaseException:
                if self._injected_pool is None:
                    await close_pool_quietly(pool)
                raise
            self._pool, self._sql, self._state = pool, statements, _OPEN
            self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        """Stop using the pool; the kv's own pool is closed, an injected one is left
        open. Idempotent. Later calls raise ``BackendUnavailableError`` until
        :meth:`open`."""
        pool, self._pool, self._sql, self._state = self._pool, None, None, _CLOSED
        if pool is not None and self._injected_pool is None:
            try:
                await pool.close()
            except Exception as exc:  # noqa: BLE001 - a pool that fails to close is unavailable
                raise self._unavailable("close", exc) from exc

    def abandon(self, *, keep_idle: Callable[[Conn], bool] | None = None) -> asyncio.Task[None] | None:
        """TEST ONLY: behave as if this process had died now. Later calls raise
        ``BackendUnavailableError``; the connections of the kv's own pool are closed at
        once (sockets dropped, nothing sent); nothing else happens, since every
        acknowledged write is committed already. When the event loop that opened the pool
        is still usable, the pool's tasks are stopped in the background: the returned task
        (the next :meth:`open` of a ``PostgresKv`` on that loop also waits for it).
        An injected pool is left to its owner.

        ``keep_idle``: first offered each connection lying idle in the own pool (no call
        using it, no transaction open); one it returns True for is taken out of the pool
        and left open for the caller, who owns it from then on — the crash matrix's
        harness hands such sessions to the next incarnation, as a session pooler would
        (``botmesh_testkit.backends.postgres``). Connections in use are dropped as ever."""
        pool, self._pool, self._sql, self._state = self._pool, None, None, _CLOSED
        if pool is None or self._injected_pool is not None:
            return None
        if keep_idle is not None:
            hand_over_idle(pool, self._connections, keep_idle)
        drop_connections(self._connections)
        loop = self._loop
        if loop is None or loop.is_closed():
            return None
        task = loop.create_task(close_pool_quietly(pool))
        ABANDONED.add(task)
        task.add_done_callback(ABANDONED.discard)
        return task

    async def durability_settings(self) -> dict[str, str]:
        """``{"kind": "postgres", "fsync": ..., "synchronous_commit": ...,
        "full_page_writes": ...}``: ``SHOW`` of each on a connection of the kv's pool, so
        what a session of this kv really runs with (:mod:`._settings`). Raises
        ``BackendUnavailableError`` when the kv is not open or the server cannot be
        reached."""
        self._statements("durability settings")
        return {"kind": "postgres", **await self._run("durability settings", show_settings)}

    # -- DurableKv -----------------------------------------------------------------

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """The record at ``(scope, space, key)`` with its version, or ``None``."""
        check_record(scope, space, key)
        s = self._statements("get")

        async def work(conn: Conn) -> Any:
            cursor = await conn.execute(s.get, (scope, space, key))
            return await cursor.fetchone()

        row = await self._run("get", work)
        return None if row is None else Versioned(json.loads(row[0]), int(row[1]))

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
        """Compare-and-set in one statement: ``INSERT ... ON CONFLICT DO NOTHING`` for
        ``expected_version=0``, ``UPDATE ... WHERE version = %s`` otherwise."""
        due_score, expires_score = check_put(scope, space, key, expected_version, due, expires)
        text = value_text(value)
        s = self._statements("put")

        async def work(conn: Conn) -> tuple[int, Versioned | None] | None:
            if expected_version == 0:
                cursor = await conn.execute(
                    s.insert, (scope, space, key, text, due_score, expires_score, scope, space, key)
                )
            else:
                cursor = await conn.execute(
                    s.update, (text, due_score, expires_score, scope, space, key, expected_version, scope, space, key)
                )
            return await self._conflict(conn, s, await cursor.fetchone(), scope, space, key, expected_version)

        conflict = await self._run("put", work)
        if conflict is not None:
            raise VersionConflict.at(space, key, expected_version, *conflict)
        return expected_version + 1

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """Remove the record at version ``expected_version`` (``DELETE ... WHERE version =
        %s``, one statement); ``VersionConflict`` when absent or at another version."""
        check_delete(scope, space, key, expected_version)
        s = self._statements("delete")

        async def work(conn: Conn) -> tuple[int, Versioned | None] | None:
            cursor = await conn.execute(s.delete, (scope, space, key, expected_version, scope, space, key))
            return await self._conflict(conn, s, await cursor.fetchone(), scope, space, key, expected_version)

        conflict = await self._run("delete", work)
        if conflict is not None:
            raise VersionConflict.at(space, key, expected_version, *conflict)

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """Up to ``limit`` entries ``(score, key)`` of ``index`` with ``score <= upto``,
        ascending by ``(score, key)``; ``ValueError`` for an unknown index name."""
        upper = check_range(scope, space, upto)
        column = check_index(index)
        s = self._statements("range")
        limited = _limit_sql(limit)
        params: tuple[Any, ...] = (scope, space, upper, *((limit,) if limited else ()))

        async def work(conn: Conn) -> list[Any]:
            cursor = await conn.execute(s.range[column, limited], params)
            return await cursor.fetchall()

        rows = await self._run("range", work)
        if not limited:
            rows = rows[:limit]
        return [(float(score), key) for score, key in rows]

    async def ranges(
        self, scope: str, reads: Sequence[tuple[str, IndexName]], *, upto: float, limit: int
    ) -> list[list[tuple[float, str]]]:
        """Two range reads (the sweep's) in one statement, one round trip: each read a
        limited ``SELECT`` of its own, tagged, ``UNION ALL``. Any other number of reads,
        or a ``limit`` SQL's ``LIMIT`` cannot take, is read with :meth:`range` in turn."""
        if len(reads) != 2 or not _limit_sql(limit):
            return await super().ranges(scope, reads, upto=upto, limit=limit)
        (space1, index1), (space2, index2) = reads
        upper, _ = check_range(scope, space1, upto), check_range(scope, space2, upto)
        statement = self._statements("range").ranges[check_index(index1), check_index(index2)]
        params = (scope, space1, upper, limit, scope, space2, upper, limit)

        async def work(conn: Conn) -> list[Any]:
            return await (await conn.execute(statement, params)).fetchall()

        out: list[list[tuple[float, str]]] = [[], []]
        for read, score, key in await self._run("range", work):
            out[read].append((float(score), key))
        return out

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """Up to ``limit`` records with key ``> after`` (all when ``after`` is None),
        ascending by key in code-point order (``COLLATE "C"``)."""
        after = check_scan(scope, space, after)
        s = self._statements("scan")
        limited = _limit_sql(limit)
        params: tuple[Any, ...] = (scope, space, *(() if after is None else (after,)), *((limit,) if limited else ()))

        async def work(conn: Conn) -> list[Any]:
            cursor = await conn.execute(s.scan[after is not None, limited], params)
            return await cursor.fetchall()

        rows = await self._run("scan", work)
        if not limited:
            rows = rows[:limit]
        return [(key, Versioned(json.loads(text), int(version))) for key, text, version in rows]

    # -- connections ---------------------------------------------------------------

    def _statements(self, doing: str) -> _Statements:
        """The statements of an open kv; ``BackendUnavailableError`` otherwise."""
        if self._state != _OPEN or self._sql is None:
            state = "not open yet (start the backend first)" if self._state == _NEW else "closed"
            raise BackendUnavailableError(f"PostgreSQL {self._label()}: {doing}: the kv is {state}", table=self._label())
        return self._sql

    async def _run(self, doing: str, work: Callable[[Conn], Awaitable[T]]) -> T:
        pool = self._pool
        if pool is None:
            raise BackendUnavailableError(f"PostgreSQL {self._label()}: {doing}: the kv is closed", table=self._label())
        return await self._run_on(pool, doing, work)

    async def _run_on(self, pool: Pool, doing: str, work: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``work`` on a working connection of ``pool`` (committing after it on a
        non-autocommit connection) and give the connection back; driver errors become
        ``BackendUnavailableError``."""
        conn = await self._acquire(pool, doing)
        cut: list[bool] = []
        timer = (
            None
            if self._query_timeout is None
            else asyncio.get_running_loop().call_later(self._query_timeout, _cut, conn, cut)
        )
        try:
            result = await work(conn)
            if not conn.autocommit:
                await conn.commit()
            return result
        except _DRIVER_ERRORS as exc:
            if cut:
                self._logger.error(
                    "PostgreSQL %s: no answer from the server within query_timeout=%ss during %s; the connection "
                    "was cut (the pool replaces it) and the outcome of the call is unknown",
                    self._label(), self._query_timeout, doing,
                )
                raise BackendUnavailableError(
                    f"PostgreSQL {self._label()}: {doing} failed: no answer from the server within "
                    f"query_timeout={self._query_timeout}s (the connection was cut; a write may or may not "
                    "have landed)",
                    table=self._label(),
                ) from exc
            if conn.broken:
                self._logger.error(
                    "PostgreSQL %s: the connection was lost during %s (%s: %s); the pool replaces it",
                    self._label(), doing, type(exc).__name__, exc,
                )
            raise self._unavailable(doing, exc) from exc
        finally:
            if timer is not None:
                timer.cancel()
            if cut:  # its socket is shut down (even when the answer came as the timer fired)
                with contextlib.suppress(Exception):
                    await conn.close()
            await self._release(pool, conn)

    async def _acquire(self, pool: Pool, doing: str) -> Conn:
        """A connection of ``pool`` that still works: connections the server dropped while
        idle are reported, closed (the pool replaces them) and skipped."""
        for _ in range(2 * pool.max_size + 1):
            try:
                conn: Conn = await pool.getconn(timeout=self._timeout)
            except _DRIVER_ERRORS as exc:
                raise self._unavailable(doing, exc) from exc
            try:
                usable = await self._usable(conn)
            except BaseException:
                await self._release(pool, conn)
                raise
            if usable:
                return conn
            await self._release(pool, conn)
        raise BackendUnavailableError(
            f"PostgreSQL {self._label()}: {doing} failed: every connection the pool gave was dropped by the server",
            table=self._label(),
        )

    async def _usable(self, conn: Conn) -> bool:
        """Whether a connection just taken from the pool works (see the module docstring).
        A dead one is reported with ``logger.error`` and closed."""
        if conn.closed or conn.broken:
            problem = "the connection is closed"
        elif not _input_pending(conn):
            return True
        else:
            try:
                await AsyncConnectionPool.check_connection(conn)
                return True
            except psycopg.Error as exc:
                problem = f"{type(exc).__name__}: {str(exc).strip()}"
        self._logger.error(
            "PostgreSQL %s: a pooled connection was dropped by the server while idle (%s); "
            "it is discarded and replaced",
            self._label(), problem,
        )
        with contextlib.suppress(Exception):
            await conn.close()
        return False

    async def _release(self, pool: Pool, conn: Conn) -> None:
        """Give ``conn`` back to ``pool`` (rolled back first when a transaction is left
        open); a broken or closed connection is discarded and replaced by the pool."""
        if conn.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
            with contextlib.suppress(Exception):
                await conn.rollback()
        try:
            await pool.putconn(conn)
        except Exception:  # noqa: BLE001 - the pool cannot take it back: drop it
            with contextlib.suppress(Exception):
                await conn.close()

    def _unavailable(self, doing: str, exc: BaseException) -> BackendUnavailableError:
        """The ``BackendUnavailableError`` that replaces a driver error, naming the table."""
        message = str(exc).strip() or type(exc).__name__
        error = BackendUnavailableError(
            f"PostgreSQL {self._label()}: {doing} failed: {type(exc).__name__}: {message}",
            table=self._label(),
            sqlstate=getattr(exc, "sqlstate", None),
        )
        error.__cause__ = exc
        return error

    # -- schema --------------------------------------------------------------------

    async def _prepare(self, conn: Conn) -> _Statements:
        """Resolve the schema, create what is missing (BACK-2), compose the statements.
        One statement resolves the schema (the option, else ``current_schema()``) and
        looks up the schema, the table and its two indexes in it: one round trip when
        everything exists."""
        cursor = await conn.execute(
            "SELECT s, to_regnamespace(quote_ident(s)) IS NOT NULL,"
            " to_regclass(format('%%I.%%I', s, %s::text)) IS NOT NULL,"
            " to_regclass(format('%%I.%%I', s, %s::text)) IS NOT NULL,"
            " to_regclass(format('%%I.%%I', s, %s::text)) IS NOT NULL"
            " FROM (SELECT coalesce(%s::text, current_schema()) AS s) AS resolved",
            (self._table, f"{self._table}_due", f"{self._table}_expires", self._schema_option),
        )
        found = await cursor.fetchone()
        schema = None if found is None else found[0]
        if schema is None:
            raise BackendUnavailableError(
                f"PostgreSQL {self._table}: no schema to keep the table in: the connection's search_path "
                "names no existing schema (set search_path, or give the `schema` option)",
                table=self._table,
            )
        self._schema = schema
        assert found is not None
        if not all(found[1:]):
            await self._create(conn, schema, create_schema=not found[1])
        return statements_for(schema, self._table, conn)

    async def _create(self, conn: Conn, schema: str, *, create_schema: bool) -> None:
        """Create the schema (only when the ``schema`` option names a missing one), the
        table and its indexes, under an advisory lock (see the module docstring)."""
        table = sql.Identifier(schema, self._table)
        ddl: list[sql.Composed] = []
        if create_schema:
            ddl.append(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        ddl.append(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {table} ("
                ' scope text COLLATE "C" NOT NULL,'
                ' space text COLLATE "C" NOT NULL,'
                ' key text COLLATE "C" NOT NULL,'
                " value json NOT NULL,"
                " version bigint NOT NULL,"
                " due double precision,"
                " expires double precision,"
                " PRIMARY KEY (scope, space, key))"
            ).format(table=table)
        )
        for column in ("due", "expires"):
            ddl.append(
                sql.SQL(
                    "CREATE INDEX IF NOT EXISTS {index} ON {table} (scope, space, {column}, key)"
                    " WHERE {column} IS NOT NULL"
                ).format(
                    index=sql.Identifier(f"{self._table}_{column}"), table=table, column=sql.Identifier(column)
                )
            )
        for attempt in range(_CREATION_ATTEMPTS):
            try:
                async with conn.transaction():
                    await conn.execute(
                        "SELECT pg_advisory_xact_lock(%s::int4, %s::int4)",
                        (_LOCK_CLASS, _lock_key(f"{schema}.{self._table}")),
                    )
                    for statement in ddl:
                        await conn.execute(statement)
                return
            except _CONCURRENT_DDL_ERRORS:
                if attempt == _CREATION_ATTEMPTS - 1:
                    raise

    @staticmethod
    async def _conflict(
        conn: Conn, s: _Statements, row: Any, scope: str, space: str, key: str, expected: int
    ) -> tuple[int, Versioned | None] | None:
        """What a write statement's row says: ``None`` when it wrote, else ``(found,
        current)`` for :class:`VersionConflict`. The record comes from the statement's
        snapshot; only when that snapshot cannot explain the conflict — it shows the
        expected version (a concurrent writer committed after the snapshot was taken and
        the row re-check of READ COMMITTED failed), or no row for a failed create (a
        concurrent insert) — is the record read again, in a second statement."""
        if row is not None and row[1] is None:
            return None
        if row is None and expected != 0:
            return 0, None
        if row is not None and int(row[0]) != expected:
            return int(row[0]), Versioned(json.loads(row[1]), int(row[0]))
        cursor = await conn.execute(s.get, (scope, space, key))
        again = await cursor.fetchone()
        return (0, None) if again is None else (int(again[1]), Versioned(json.loads(again[0]), int(again[1])))
