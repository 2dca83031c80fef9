"""The PostgreSQL backend harness: :class:`PostgresHarness` opens
:class:`~botmesh.postgres_store.PostgresDurability` on a server given by URL, "kills the
process" holding it and opens it again (TEST-3).

Storage: one table per workdir. The ``table_prefix`` is derived deterministically from
the absolute workdir path (``"bm_" + sha1(path)[:10] + "_"``), so the same workdir means
the same storage (a restarted incarnation, or another harness on the same workdir, finds
the records) and two workdirs never share a table. The table lives where the URL's
connections put it: its ``search_path`` (``options=-c search_path=...``) decides the
schema, so a provisioning step may give each test run its own schema on top.

The death of a process is simulated by :meth:`PostgresDurability.abandon
<botmesh.postgres_store.PostgresDurability.abandon>`: the old incarnation's pool loses its
connections at once (sockets closed, nothing sent, no clean shutdown of anything) — what
the server sees when a process dies; whatever was committed stays. The bot's store is a
:class:`~botmesh.core.store.MemoryStore` kept across restarts (it stands for a persistent
store), as for the other service harnesses.

The backend handed out is not started: the bot starts it (``bot.start()``), which creates
the table when missing. :meth:`PostgresHarness.close` drops the table and releases every
incarnation's connections; it may run on another event loop than the test's (a pytest
fixture finalizer with ``asyncio.run``).

Reused tables (:meth:`PostgresHarness.reuse_storage`, asked by the crash matrix): a
harness takes, at its first open, a table that an earlier harness of this process emptied
(``DELETE FROM``) at its close instead of dropping it, and empties and pools its own
table in turn; creating a table and its two indexes and dropping it cost a few times what
a crash cell's own statements do. An emptied table is what a new one is to the backend:
no row, the same columns and indexes, and nothing else (no sequence) keeps state. The
emptying runs on one plain connection per server URL kept by the process, which commits
asynchronously as the matrix's incarnations do (below): the next harness's sessions see
the table empty at once; the pooled tables are dropped at the interpreter's exit
(:func:`release_pooled_tables`).

Idle sessions handed on (the crash matrix's harnesses, with the reused tables): a new
session costs the server a backend process (forked, authenticated, its catalog caches
cold), more than a cell's statements cost, and a cell made two. At a death, the sessions
lying idle in the dying incarnation's pool — returned to it, no call of the kv using
them, no transaction open — are not closed but kept (up to four per connection string;
``PostgresKv.abandon(keep_idle=...)``), and the process's next connects take them (the
restart, then the next cell's first incarnation), each in a new psycopg connection object
and reset with ``DISCARD ALL`` first: what a session pooler (PgBouncer with its server
reset query, for one) gives a restarted process. What the next incarnation can find on
such a session is what a new one shows: no transaction of the dead incarnation (a
session in use at the death is closed as before, and the server rolls its transaction
back), none of its settings, prepared statements, temporary tables or session locks; the
connection string's options (``synchronous_commit=off``, below) are the session's own.
The server does not see those sessions end, and their process ids live on: nothing in
this backend rests on either (it never asks for a session's identity); the harnesses
judged on deaths as they are (the conformance suite, the kill and power-cut loops) hand
nothing on. Measured: PostgreSQL crash cells 1.32x faster (issue 16,
``benchmarks/README.md``).

A connection opened ahead (also for the crash matrix): whenever an incarnation's pool
connects and no idle session is kept (the process's first cell, a death with every
session in use), the process opens one more connection beside it, which nobody uses yet;
the next such connect takes it and opens the next one ahead in turn. It is a fresh
session that nothing ran a statement on — what a restarted process gets from its own
connect. :meth:`PostgresHarness.close` waits until the one being opened is connected (a
cell's event loop ends after it; the connection is not bound to a loop);
:func:`release_connections_ahead` closes what is left, the kept idle sessions too (at
exit).

Asynchronous commits (the crash matrix's harnesses too): their incarnations' sessions run
with ``synchronous_commit=off`` (an ``-c`` option of the connection string). A commit is
then acknowledged before its WAL record is flushed to disk, and it is visible to every
session from that moment, exactly as with a synchronous commit: only a crash of the
*server* could lose it, and the crash matrix kills the bot's process, never the server —
what an incarnation sees after a death is the same. The flush was most of what a write
cost (a disk flush per statement). The claims a session's settings make about power cuts
(``durability_settings()``) are judged on harnesses of their own (the conformance suite,
the power-cut loops), which keep the server's settings.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import MemoryStore, Store

from .base import BackendHarness, KillSpec, PostgresSpec

DEFAULT_PORT = 5432

__all__ = ["PostgresHarness", "release_connections_ahead", "release_pooled_tables", "table_prefix_for"]

_POOLED: dict[str, list[tuple[str, str | None]]] = {}
"""Per server URL: ``(table_prefix, schema)`` of the emptied tables ready for reuse."""

_JANITORS: dict[str, Any] = {}
"""Per server URL: the plain (synchronous, autocommit) connection that empties tables."""


def _janitor(url: str) -> Any:
    import psycopg

    conn = _JANITORS.get(url)
    if conn is None or conn.closed:
        if not _JANITORS:
            atexit.register(release_pooled_tables)
        conn = _JANITORS[url] = psycopg.connect(_asynchronous_commits(url), autocommit=True)
    return conn


def _table(prefix: str, schema: str | None) -> Any:
    from psycopg import sql

    table = f"{prefix}durable"
    return sql.Identifier(table) if schema is None else sql.Identifier(schema, table)


def release_pooled_tables() -> None:
    """Drop every pooled table and close the emptying connections (at exit; a server or
    database already gone is not an error)."""
    from psycopg import sql

    for url, pooled in list(_POOLED.items()):
        conn = _JANITORS.get(url)
        while pooled:
            prefix, schema = pooled.pop()
            try:
                if conn is not None and not conn.closed:
                    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_table(prefix, schema)))
            except Exception:  # the database was dropped (WITH FORCE) or the server stopped first
                break
    for conn in _JANITORS.values():
        try:
            conn.close()
        except Exception:
            pass
    _JANITORS.clear()


def table_prefix_for(workdir: str) -> str:
    """The ``table_prefix`` of ``workdir``: ``"bm_" + sha1(absolute path)[:10] + "_"``."""
    digest = hashlib.sha1(os.path.abspath(workdir).encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"bm_{digest[:10]}_"


class PostgresHarness(BackendHarness):
    """``PostgresDurability`` on the server at ``url``, one table per workdir.

    Each incarnation gets its own small pool (``min_size`` 1, ``max_size`` 4 by default).
    ``reopen()`` abandons the previous incarnation's backend (its connections dropped, no
    clean shutdown) and returns a new one on the same table; the store is kept.
    """

    name = "postgres"

    def __init__(self, workdir: str | None = None, *, url: str, min_size: int = 1, max_size: int = 4) -> None:
        super().__init__(workdir)
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self.table_prefix = table_prefix_for(self.workdir)
        self.backend: Any = None
        self.backends: list[Any] = []
        self.store: Store = MemoryStore()
        self._reuse = False
        self._connection_class: Any = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(survives_crash=True, multi_process=True, multi_host=True, shared=True)

    def _make(self) -> Any:
        from botmesh.postgres_store import PostgresDurability

        backend = PostgresDurability(
            connection_string=self._conninfo(),
            table_prefix=self.table_prefix,
            min_size=self.min_size,
            max_size=self.max_size,
            connection_class=self._connection_class,
        )
        self.backends.append(backend)
        self.backend = backend
        return backend

    def _conninfo(self) -> str:
        """The connection string of the incarnations' pools (with reused tables:
        asynchronous commits, module docstring) — also what their idle sessions are kept
        under."""
        return _asynchronous_commits(self.url) if self._reuse else self.url

    def server_address(self) -> tuple[str, int] | None:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORT

    def via(self, host: str, port: int) -> PostgresHarness:
        twin = PostgresHarness(self.workdir, url=_with_address(self.url, host, port))
        twin.table_prefix = self.table_prefix
        return twin

    def kill_spec(self) -> KillSpec | None:
        return PostgresSpec(self.url, self.table_prefix)

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        """New, unopened :class:`~botmesh.postgres_store.PostgresKv` instances on this
        harness's table (for the ``DurableKv`` conformance suite); :meth:`close` drops the
        table they used too. Each kv has a pool of its own: close it (or ``abandon()``
        it) on the loop that opened it."""
        from botmesh.postgres_store import PostgresKv

        return lambda: PostgresKv(
            connection_string=self.url,
            table_prefix=self.table_prefix,
            min_size=self.min_size,
            max_size=self.max_size,
        )

    def reuse_storage(self) -> bool:
        """A table emptied by an earlier harness of this process, given back emptied at
        close (module docstring)."""
        self._reuse = True
        self._connection_class = _ahead_connection_class()
        return True

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.store = MemoryStore()
        pooled = _POOLED.get(self.url)
        if self._reuse and not self.backends and pooled:
            self.table_prefix = pooled.pop()[0]  # found through the same URL's search_path
        backend: DurabilityBackend = self._make()
        return backend, self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        if self.backend is not None:
            await self._abandon(self.backend)
        backend: DurabilityBackend = self._make()
        return backend, self.store

    async def close(self) -> None:
        """Drop every incarnation's connections and the table (with reused tables: the
        last incarnation's idle sessions and the connection opened ahead stay for the next
        harness, connected: module docstring)."""
        await _settle_ahead()
        schema = next((b.kv.schema for b in self.backends if b.kv.schema is not None), None)
        for backend in self.backends:
            await self._abandon(backend)
        started = bool(self.backends)
        self.backends.clear()
        self.backend = None
        if self._reuse and started:
            from psycopg import sql

            try:
                _janitor(self.url).execute(sql.SQL("DELETE FROM {}").format(_table(self.table_prefix, schema)))
            except Exception:  # never created (the backend did not start), or the connection broke
                _JANITORS.pop(self.url, None)
            else:
                _POOLED.setdefault(self.url, []).append((self.table_prefix, schema))
                return
        await self.drop_table(schema)

    async def drop_table(self, schema: str | None = None) -> None:
        """``DROP TABLE IF EXISTS`` the harness's table (in ``schema``, else where the URL's
        ``search_path`` finds it), on a connection of its own."""
        import psycopg
        from psycopg import sql

        table = f"{self.table_prefix}durable"
        name = sql.Identifier(table) if schema is None else sql.Identifier(schema, table)
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(name))

    async def _abandon(self, backend: Any) -> None:
        """The simulated death: connections dropped now — with reused tables, the idle
        ones handed to the next incarnation instead (module docstring); the pool's tasks
        stopped too when they belong to the running loop."""
        keep = functools.partial(_keep_idle, self._conninfo()) if self._reuse else None
        task = backend.abandon() if keep is None else backend.abandon(keep_idle=keep)
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            await task


@functools.cache
def _asynchronous_commits(url: str) -> str:
    """``url`` with ``-c synchronous_commit=off`` added to its ``options`` (module
    docstring): a ``key=value`` connection string. Parsed once per URL: every
    incarnation's opening asks."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    options = str(conninfo_to_dict(url).get("options") or "")
    return make_conninfo(url, options=f"{options} -c synchronous_commit=off".strip())


_AHEAD: dict[tuple[Any, ...], asyncio.Task[Any]] = {}
"""Per connection string and connect arguments: the connection opened ahead for the next
incarnation's first connect (module docstring)."""


_IDLE: dict[str, list[Any]] = {}
"""Per connection string: the server sessions (libpq connections) that dead incarnations
left idle, for the next incarnations' connects (module docstring)."""

_IDLE_MAX = 4
"""At most this many idle sessions kept per connection string (an incarnation's pool
holds up to ``max_size``, 4 by default); a dying incarnation's others die with it."""

_IDLE_KWARGS = frozenset({"autocommit", "connect_timeout"})
"""The connect arguments a session handed over can honour (the kv's pool passes these,
with ``autocommit=True``; a connect asking for anything else opens a session as ever)."""


def _keep_idle(conninfo: str, conn: Any) -> bool:
    """``PostgresKv.abandon``'s ``keep_idle`` for a matrix harness: keep the server session
    of ``conn``, idle in a dying incarnation's pool (made with ``conninfo``), for the next
    incarnation."""
    stash = _IDLE.setdefault(conninfo, [])
    if len(stash) >= _IDLE_MAX:
        return False
    _register_release()
    stash.append(conn.pgconn)
    return True


async def _reuse_idle(cls: type[Any], conninfo: str, kwargs: dict[str, Any]) -> Any:
    """A connection of class ``cls`` on a session a dead incarnation left idle, reset with
    ``DISCARD ALL`` (module docstring); None when no kept session still works."""
    stash = _IDLE.get(conninfo)
    if not stash or not _IDLE_KWARGS.issuperset(kwargs) or kwargs.get("autocommit") is not True:
        return None
    import psycopg

    from botmesh.postgres_store._death import session_idle

    while stash:
        pgconn = stash.pop()
        if not session_idle(pgconn):
            pgconn.finish()
            continue
        conn = cls(pgconn)  # a new connection object: nothing of the dead one's client side
        try:
            await conn.set_autocommit(True)  # (no round trip: the session is idle)
            await conn.execute("DISCARD ALL")
        except psycopg.Error:  # the server ended the session meanwhile
            pgconn.finish()
            continue
        return conn
    return None


async def _connect_ahead(cls: type[Any], plain: Callable[..., Any], conninfo: str, kwargs: dict[str, Any]) -> Any:
    """A new connection for an incarnation's pool: a session a dead incarnation left idle
    when there is one, else the one opened ahead the same way when there is one that
    works, else a new one (``plain``); in the last two cases the next one is opened ahead
    now."""
    conn = await _reuse_idle(cls, conninfo, kwargs)
    if conn is not None:
        return conn
    try:
        key: tuple[Any, ...] = (conninfo, frozenset(kwargs.items()))
    except TypeError:  # an unhashable argument: nothing ahead
        return await plain(conninfo, **kwargs)
    loop = asyncio.get_running_loop()
    ahead = _AHEAD.pop(key, None)
    _register_release()
    _AHEAD[key] = loop.create_task(plain(conninfo, **kwargs))
    if ahead is not None:
        conn = await _take(ahead, loop)
        if conn is not None:
            return conn
    return await plain(conninfo, **kwargs)


async def _take(ahead: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> Any:
    """The connection of ``ahead`` when it connected and still works, else None."""
    if not ahead.done():
        if ahead.get_loop() is not loop:
            ahead.cancel()  # its loop ended before it connected (settled at close: not in the matrix)
            return None
        await asyncio.wait({ahead})
    if ahead.cancelled() or ahead.exception() is not None:
        return None
    conn = ahead.result()
    if conn.closed or conn.broken:
        return None
    return conn


async def _settle_ahead() -> None:
    """Wait until the connections being opened ahead on this event loop are connected,
    so that none is left half-open when the loop ends (a crash cell runs on a loop of its
    own): the next harness takes them connected."""
    loop = asyncio.get_running_loop()
    pending = {t for t in _AHEAD.values() if not t.done() and t.get_loop() is loop}
    if pending:
        await asyncio.wait(pending)


def release_connections_ahead() -> None:
    """Close the connections opened ahead that no incarnation took and the idle sessions
    kept from dead incarnations (at exit, and for tests); a pending one is cancelled."""
    for stash in _IDLE.values():
        while stash:
            with contextlib.suppress(Exception):
                stash.pop().finish()
    for task in list(_AHEAD.values()):
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            with contextlib.suppress(Exception):
                task.result().pgconn.finish()
    _AHEAD.clear()


_RELEASE_REGISTERED: list[bool] = []


def _register_release() -> None:
    if not _RELEASE_REGISTERED:
        _RELEASE_REGISTERED.append(True)
        atexit.register(release_connections_ahead)


@functools.cache
def _ahead_connection_class() -> type[Any]:
    """The connection class of the matrix's pools: each connect goes through
    :func:`_connect_ahead`."""
    import psycopg

    class AheadConnection(psycopg.AsyncConnection[Any]):
        @classmethod
        async def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
            return await _connect_ahead(cls, super().connect, conninfo, kwargs)

    return AheadConnection


def provisioned(workdir: str | None = None) -> PostgresHarness:
    """The harness of the built-in backend name ``postgres``: a table per workdir on the
    server of ``$BOTMESH_POSTGRES_URL``, which the pytest plugin sets to a database of its
    own on the server it provisioned (``--botmesh-postgres-url``, the environment, or a
    private server; :mod:`botmesh_testkit.servers`)."""
    from ..servers import POSTGRES_URL_ENV

    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        raise RuntimeError(f"backend 'postgres' needs a server: set {POSTGRES_URL_ENV}, or run it through pytest "
                           "(the plugin provisions one: --botmesh-postgres-url, else a private server)")
    return PostgresHarness(workdir, url=url)


def _with_address(url: str, host: str, port: int) -> str:
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth + '@' if auth else ''}{host}:{port}"))
