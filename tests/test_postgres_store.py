"""Tests of ``botmesh.postgres_store`` (``PostgresKv``, ``PostgresDurability``) and of
``botmesh_testkit.harness_postgres.PostgresHarness``, against a real PostgreSQL server.

Spec ids: BACK-2 (table ``{table_prefix}durable`` created idempotently at start, also by
several processes at once; own pool created at start and closed at stop, an injected pool
left to its owner; a connection dropped while idle reported to ``logger.error`` and
replaced), BACK-7 (the shipped ``DurableKv`` conformance suite), LEASE-3 (per-boot
``instance_id`` suffix on a shared backend), REPL-1/REPL-4 (processes sharing the server:
exactly one CAS winner, exclusive claims), SCOPE-2, GUAR-2/GUAR-3 (restarts through the
harness), CONF-1 (bad options rejected naming the option).

The server: ``BOTMESH_POSTGRES_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
Every test works in a table of its own (a fresh random ``table_prefix``) and drops it at
the end. When the server cannot be reached (or psycopg is not installed) the tests
**fail** — CI must run them for real — unless ``BOTMESH_ALLOW_SKIP_SERVICES=1`` is set,
which turns that into a skip.

``async def`` tests are run by ``tests/conftest.py`` (a fresh event loop per test).
Multi-process tests start real interpreters that meet at a barrier on their stdin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ALLOW_SKIP = os.environ.get("BOTMESH_ALLOW_SKIP_SERVICES") == "1"

try:
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
    from psycopg_pool import AsyncConnectionPool
except ImportError as exc:  # pragma: no cover - depends on the installation
    if ALLOW_SKIP:
        pytest.skip(f"psycopg / psycopg-pool not installed: {exc}", allow_module_level=True)
    raise ImportError(
        f"tests/test_postgres_store.py needs psycopg and psycopg-pool (pip install -e '.[postgres]'): {exc}; "
        "set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead"
    ) from exc

from botmesh.core import Bot, MemoryStore
from botmesh.core.errors import BackendUnavailableError, ConfigError, VersionConflict
from botmesh.core.records import InboxRecord
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import Capabilities, Versioned
from botmesh.core.testing import MockProvider
from botmesh.postgres_store import PostgresDurability, PostgresKv
from botmesh_testkit.conformance.durability import HarnessFactory, MultiProcessTests
from botmesh_testkit.conformance.kv import DurableKvConformance, KvFactory
from botmesh_testkit.backends.postgres import PostgresHarness, release_connections_ahead, table_prefix_for
from botmesh_testkit.crash import World

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
URL = os.environ.get("BOTMESH_POSTGRES_URL", DEFAULT_URL)
INF = float("inf")
WORKER_TIMEOUT_S = 120
ALL_CAPABILITIES = Capabilities(survives_crash=True, multi_process=True, multi_host=True, shared=True)


# ----------------------------------------------------------------------------------------
# helpers and fixtures
# ----------------------------------------------------------------------------------------


def _safe_url(url: str) -> str:
    """The URL's parameters without the password, for messages."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return "<unparsable connection string>"
    params.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()))


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The server's URL, once checked to answer. Unreachable: the test fails (errors),
    or is skipped under ``BOTMESH_ALLOW_SKIP_SERVICES=1``."""
    try:
        with psycopg.connect(URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        message = f"PostgreSQL not reachable at {_safe_url(URL)} (BOTMESH_POSTGRES_URL): {exc}"
        if ALLOW_SKIP:
            pytest.skip(message)
        pytest.fail(message + " -- set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip these tests instead", pytrace=False)
    return URL


def _drop(url: str, prefix: str, schema: str | None = None) -> None:
    table = f"{prefix}durable"
    name = sql.Identifier(table) if schema is None else sql.Identifier(schema, table)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(name))


@pytest.fixture
def prefix(pg_url: str) -> Iterator[str]:
    """A fresh ``table_prefix``; its table is dropped after the test."""
    value = f"t_{uuid.uuid4().hex[:8]}_"
    yield value
    _drop(pg_url, value)


def tagged(url: str) -> tuple[str, str]:
    """``url`` with a unique ``application_name``, and that name: the test can then find
    (and kill) exactly the server backends of the pool it built."""
    app = f"bm-test-{uuid.uuid4().hex[:10]}"
    return make_conninfo(url, application_name=app), app


async def backends_of(url: str, app: str) -> list[int]:
    """Pids of the server backends whose ``application_name`` is ``app``."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        cursor = await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s ORDER BY pid", (app,)
        )
        return [row[0] for row in await cursor.fetchall()]


async def terminate(url: str, app: str) -> list[int]:
    """``pg_terminate_backend`` every backend of ``app`` from an admin connection, and
    wait until the server has let them all go."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        # First the pids, then the kill: in one WHERE clause the server may well call
        # pg_terminate_backend before it filters on the name.
        cursor = await admin.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,))
        pids = [row[0] for row in await cursor.fetchall()]
        assert pids, f"no server backend with application_name {app!r}"
        await admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cursor = await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,))
            row = await cursor.fetchone()
            if row is not None and row[0] == 0:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"terminated backends {pids} still alive after 10 s")
    return pids


async def wait_for_backends(url: str, app: str, count: int, timeout: float = 10.0) -> list[int]:
    """Wait until exactly ``count`` backends of ``app`` exist; return their pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = await backends_of(url, app)
        if len(pids) == count or time.monotonic() > deadline:
            return pids
        await asyncio.sleep(0.02)


async def table_exists(url: str, name: str) -> bool:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        cursor = await admin.execute("SELECT to_regclass(%s) IS NOT NULL", (sql.Identifier(name).as_string(admin),))
        row = await cursor.fetchone()
        return bool(row and row[0])


class Captured(logging.Handler):
    """Keeps the records of one logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self, containing: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno == logging.ERROR and containing in r.getMessage()]


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, Captured]]:
    """A logger of its own (passed as ``logger=``) and what it received."""
    logger = logging.getLogger(f"botmesh.postgres.test.{uuid.uuid4().hex[:8]}")
    handler = Captured()
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


async def own_pool(url: str, **kwargs: Any) -> AsyncConnectionPool[Any]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(url, open=False, **kwargs)
    await pool.open(wait=True, timeout=10)
    return pool


# ----------------------------------------------------------------------------------------
# the shipped conformance suite (BACK-7)
# ----------------------------------------------------------------------------------------


class TestPostgresKvConformance(DurableKvConformance):
    """The whole DurableKv conformance suite: each test in a fresh table, every kv with a
    pool of its own (``connection_string``)."""

    @pytest.fixture
    def kv_factory(self, pg_url: str, prefix: str) -> KvFactory:
        return lambda: PostgresKv(connection_string=pg_url, table_prefix=prefix, max_size=4)


class TestPostgresMultiProcess(MultiProcessTests):
    """The durability suite's several-processes tests (REPL-1, REPL-4): real processes,
    each with a PostgresDurability of its own on the test's table, journal and claim the
    same records at once (the kv suite above has its CAS test across processes)."""

    @pytest.fixture
    def botmesh_harness_factory(self, pg_url: str) -> HarnessFactory:
        return lambda workdir: PostgresHarness(workdir, url=pg_url)


# ----------------------------------------------------------------------------------------
# the table (BACK-2)
# ----------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-2")
async def test_start_creates_the_table_and_both_indexes(pg_url: str, prefix: str) -> None:
    """BACK-2: ``start()`` creates ``{table_prefix}durable`` — scope part of the primary
    key, keys in code-point (``"C"``) order — with the two ordered indexes on
    ``(scope, space, due, key)`` and ``(scope, space, expires, key)``."""
    table = f"{prefix}durable"
    assert not await table_exists(pg_url, table)
    durability = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=2)
    assert durability.table == table and durability.name == "postgres"
    await durability.start()
    await durability.stop()
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
        cursor = await admin.execute(
            "SELECT column_name, data_type, is_nullable, collation_name FROM information_schema.columns"
            " WHERE table_name = %s AND table_schema = current_schema() ORDER BY ordinal_position",
            (table,),
        )
        columns = await cursor.fetchall()
        cursor = await admin.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = to_regclass(%s) AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
            (sql.Identifier(table).as_string(admin),),
        )
        primary_key = [row[0] for row in await cursor.fetchall()]
        cursor = await admin.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND schemaname = current_schema()"
            " AND indexname <> %s ORDER BY indexname",
            (table, f"{table}_pkey"),
        )
        indexes = await cursor.fetchall()
    assert columns == [
        ("scope", "text", "NO", "C"),
        ("space", "text", "NO", "C"),
        ("key", "text", "NO", "C"),
        ("value", "json", "NO", None),
        ("version", "bigint", "NO", None),
        ("due", "double precision", "YES", None),
        ("expires", "double precision", "YES", None),
    ]
    assert primary_key == ["scope", "space", "key"]
    assert [name for name, _ in indexes] == [f"{table}_due", f"{table}_expires"]
    for (_, definition), column in zip(indexes, ("due", "expires"), strict=True):
        assert f"(scope, space, {column}, key)" in definition, definition


@pytest.mark.spec("BACK-2")
async def test_start_is_idempotent_and_keeps_the_data(pg_url: str, prefix: str) -> None:
    """BACK-2: starting again — the same backend after ``stop()``, a second backend on the
    same table, ``start()`` twice — changes nothing and keeps every record."""
    first = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=2)
    await first.start()
    await first.start()
    await first.kv.put("s", "inbox", "k", {"n": 1}, expected_version=0, due=1.0)
    await first.stop()
    await first.start()
    second = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=2)
    await second.start()
    assert await second.kv.get("s", "inbox", "k") == Versioned({"n": 1}, 1)
    assert await first.kv.put("s", "inbox", "k", {"n": 2}, expected_version=1) == 2
    assert await second.kv.range("s", "inbox", "due", upto=INF, limit=10) == []
    await first.stop()
    await second.stop()


@pytest.mark.spec("BACK-2")
async def test_several_backends_starting_at_once_all_succeed(pg_url: str, prefix: str) -> None:
    """BACK-2: 8 backends (each with its own pool) starting at the same moment on a fresh
    ``table_prefix`` all succeed, with one table between them (creation is serialised by
    an advisory lock: ``CREATE TABLE IF NOT EXISTS`` alone is not safe against concurrent
    creation)."""
    backends = [PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=1) for _ in range(8)]
    results = await asyncio.gather(*(b.start() for b in backends), return_exceptions=True)
    try:
        assert [r for r in results if r is not None] == []
        await asyncio.gather(*(b.kv.put("s", "inbox", f"k{i}", {"i": i}, expected_version=0) for i, b in enumerate(backends)))
        listed = await backends[0].kv.scan("s", "inbox", limit=100)
        assert [(k, v.value) for k, v in listed] == [(f"k{i}", {"i": i}) for i in range(8)]
    finally:
        await asyncio.gather(*(b.stop() for b in backends))


@pytest.mark.spec("BACK-2", "REPL-4")
def test_several_processes_starting_at_once_all_succeed(pg_url: str, prefix: str, procs: list[subprocess.Popen[str]]) -> None:
    """BACK-2, REPL-4: 3 processes released together by a barrier start a backend on the
    same fresh ``table_prefix``: all succeed and all their writes are in the one table."""
    workers = 3
    results = run_workers(procs, "start", pg_url, prefix, workers, 0)
    assert results == [(0, {"started": me}) for me in range(workers)]

    async def check() -> None:
        kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, max_size=1)
        await kv.open()
        listed = await kv.scan("start", "s", limit=100)
        await kv.close()
        assert [(k, v) for k, v in listed] == [(f"p{me}", Versioned({"me": me}, 1)) for me in range(workers)]

    asyncio.run(check())


@pytest.mark.spec("BACK-2")
async def test_schema_from_search_path_in_the_connection_string(pg_url: str, prefix: str) -> None:
    """BACK-2: without ``schema`` the table goes where the connection's ``search_path``
    puts it (``options=-c search_path=...`` in the URL): a test run can get a schema of
    its own."""
    schema = f"s_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
        await admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        url = make_conninfo(pg_url, options=f"-c search_path={schema}")
        durability = PostgresDurability(connection_string=url, table_prefix=prefix, max_size=1)
        await durability.start()
        assert durability.kv.schema == schema
        await durability.kv.put("s", "inbox", "k", {}, expected_version=0)
        await durability.stop()
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            cursor = await admin.execute(
                sql.SQL("SELECT key FROM {}").format(sql.Identifier(schema, f"{prefix}durable"))
            )
            assert await cursor.fetchall() == [("k",)]
        assert not await table_exists(pg_url, f"{prefix}durable")  # not in the default schema
    finally:
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            await admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.spec("BACK-2")
async def test_schema_option_creates_the_schema_when_missing(pg_url: str, prefix: str) -> None:
    """BACK-2: ``schema=...`` places the table in that schema, created when missing (also
    by two backends starting at once)."""
    schema = f"s_{uuid.uuid4().hex[:8]}"
    backends = [PostgresDurability(connection_string=pg_url, table_prefix=prefix, schema=schema, max_size=1) for _ in range(3)]
    try:
        await asyncio.gather(*(b.start() for b in backends))
        assert {b.kv.schema for b in backends} == {schema}
        await backends[0].kv.put("s", "inbox", "k", {"n": 1}, expected_version=0)
        assert await backends[2].kv.get("s", "inbox", "k") == Versioned({"n": 1}, 1)
        await asyncio.gather(*(b.stop() for b in backends))
    finally:
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            await admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.spec("BACK-2")
async def test_a_mixed_case_prefix_is_quoted_not_folded(pg_url: str) -> None:
    """BACK-2: ``table_prefix`` reaches SQL only as a quoted identifier: ``"Ab_"`` makes
    the table ``Ab_durable``, case kept."""
    prefix = f"Ab_{uuid.uuid4().hex[:6]}_"
    try:
        durability = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=1)
        await durability.start()
        await durability.stop()
        assert await table_exists(pg_url, f"{prefix}durable")
        assert not await table_exists(pg_url, f"{prefix.lower()}durable")
    finally:
        _drop(pg_url, prefix)


# ----------------------------------------------------------------------------------------
# pools (BACK-2)
# ----------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-2")
async def test_own_pool_is_created_at_start_and_closed_at_stop(pg_url: str, prefix: str) -> None:
    """BACK-2: with ``connection_string`` the backend creates its pool at ``start()`` and
    closes it at ``stop()``: its server connections are gone, later calls raise
    ``BackendUnavailableError``; a new ``start()`` makes a new pool."""
    url, app = tagged(pg_url)
    durability = PostgresDurability(connection_string=url, table_prefix=prefix, min_size=2, max_size=2)
    assert durability.owns_pool and durability.kv.pool is None
    await durability.start()
    pool = durability.kv.pool
    assert pool is not None and not pool.closed
    await durability.kv.put("s", "inbox", "k", {}, expected_version=0)
    assert len(await wait_for_backends(pg_url, app, 2)) == 2
    await durability.stop()
    assert pool.closed and durability.kv.pool is None
    assert await wait_for_backends(pg_url, app, 0) == []
    with pytest.raises(BackendUnavailableError):
        await durability.kv.get("s", "inbox", "k")
    with pytest.raises(BackendUnavailableError):
        await durability.inbox_get("s", "k")
    await durability.start()
    assert durability.kv.pool is not None and durability.kv.pool is not pool
    assert await durability.kv.get("s", "inbox", "k") == Versioned({}, 1)
    await durability.stop()


@pytest.mark.spec("BACK-2")
@pytest.mark.parametrize("autocommit", [True, False])
async def test_injected_pool_belongs_to_the_caller(pg_url: str, prefix: str, autocommit: bool) -> None:
    """BACK-2: an injected pool is used as it is — autocommit connections or not — and
    left open at ``stop()``: it still serves its owner, and the backend can start on it
    again. The caller closes it."""
    pool = await own_pool(pg_url, min_size=1, max_size=2, kwargs={"autocommit": autocommit})
    try:
        durability = PostgresDurability(pool=pool, table_prefix=prefix)
        assert not durability.owns_pool
        await durability.start()
        assert durability.kv.pool is pool
        assert await durability.kv.put("s", "inbox", "k", {"n": 1}, expected_version=0, due=5.0) == 1
        with pytest.raises(VersionConflict):
            await durability.kv.put("s", "inbox", "k", {"n": 9}, expected_version=0)
        assert await durability.kv.put("s", "inbox", "k", {"n": 2}, expected_version=1, due=6.0) == 2
        await durability.stop()
        assert not pool.closed
        async with pool.connection() as conn:  # committed, visible to the owner
            cursor = await conn.execute(
                sql.SQL("SELECT version, due FROM {} WHERE key = 'k'").format(sql.Identifier(f"{prefix}durable"))
            )
            assert await cursor.fetchall() == [(2, 6.0)]
        with pytest.raises(BackendUnavailableError):
            await durability.kv.get("s", "inbox", "k")
        await durability.start()
        assert await durability.kv.get("s", "inbox", "k") == Versioned({"n": 2}, 2)
        await durability.stop()
        assert not pool.closed
    finally:
        await pool.close()


@pytest.mark.spec("BACK-2")
async def test_injected_pool_that_is_not_open_is_refused_at_start(pg_url: str, prefix: str) -> None:
    """BACK-2: the backend never opens a pool it does not own: starting on a closed one
    raises ``BackendUnavailableError`` saying so."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(pg_url, open=False, min_size=1, max_size=1)
    durability = PostgresDurability(pool=pool, table_prefix=prefix)
    with pytest.raises(BackendUnavailableError, match="not open"):
        await durability.start()
    assert pool.closed


@pytest.mark.spec("BACK-7")
async def test_calls_before_start_raise_backend_unavailable(pg_url: str, prefix: str) -> None:
    """BACK-7: calls before ``open()``/``start()`` raise ``BackendUnavailableError``."""
    kv = PostgresKv(connection_string=pg_url, table_prefix=prefix)
    for call in (
        lambda: kv.get("s", "inbox", "k"),
        lambda: kv.put("s", "inbox", "k", {}, expected_version=0),
        lambda: kv.delete("s", "inbox", "k", expected_version=1),
        lambda: kv.range("s", "inbox", "due", upto=INF, limit=1),
        lambda: kv.scan("s", "inbox"),
    ):
        with pytest.raises(BackendUnavailableError, match="not open"):
            await call()
    await kv.close()  # closing a kv never opened is harmless


@pytest.mark.spec("BACK-2", "BACK-7")
async def test_unreachable_server_raises_backend_unavailable_at_start(prefix: str) -> None:
    """BACK-7: a server that cannot be reached is ``BackendUnavailableError`` (never the
    driver's error) after ``timeout``; the backend's own pool is closed again."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://postgres@127.0.0.1:{port}/test?connect_timeout=1"
    durability = PostgresDurability(connection_string=url, table_prefix=prefix, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError) as info:
        await durability.start()
    assert time.monotonic() - started < 10
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert durability.kv.pool is None
    with pytest.raises(BackendUnavailableError):
        await durability.kv.get("s", "inbox", "k")


# ----------------------------------------------------------------------------------------
# dropped connections (BACK-2)
# ----------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-2")
@pytest.mark.parametrize("pool_kind", ["own", "injected"])
async def test_idle_connection_dropped_by_the_server_is_logged_and_replaced(
    pg_url: str, prefix: str, captured: tuple[logging.Logger, Captured], pool_kind: str
) -> None:
    """BACK-2: the server drops the pool's idle connections (``pg_terminate_backend``
    from an admin connection, as a restart or failover would): the next operations
    succeed, each dropped connection is reported to ``logger.error``, and new server
    connections replace them."""
    logger, log = captured
    url, app = tagged(pg_url)
    pool: AsyncConnectionPool[Any] | None = None
    if pool_kind == "own":
        durability = PostgresDurability(connection_string=url, table_prefix=prefix, logger=logger, min_size=2, max_size=2)
    else:
        pool = await own_pool(url, min_size=2, max_size=2, kwargs={"autocommit": True})
        durability = PostgresDurability(pool=pool, table_prefix=prefix, logger=logger)
    try:
        await durability.start()
        await durability.inbox_journal("scope", InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0))
        before = await wait_for_backends(pg_url, app, 2)
        assert len(before) == 2
        killed = await terminate(pg_url, app)
        assert sorted(killed) == before
        assert log.errors("dropped") == []

        claimed = await durability.inbox_claim("scope", "m1", owner="o", incarnation="i", now=1.0, lease_ms=1000.0, recover=False)
        assert claimed is not None and claimed.state == "leased" and claimed.token == 1
        assert (await durability.inbox_get("scope", "m1")) == claimed
        dropped = log.errors("dropped by the server while idle")
        assert 1 <= len(dropped) <= 2, [r.getMessage() for r in log.records]
        assert all(r.name == logger.name for r in dropped)
        assert "terminating connection due to administrator command" in dropped[0].getMessage()
        after = await wait_for_backends(pg_url, app, 2)
        assert after and not set(after) & set(killed)

        # Once every dead connection is gone, the next call reports nothing more.
        await asyncio.gather(*(durability.kv.get("scope", "inbox", "m1") for _ in range(4)))
        assert len(log.errors("dropped by the server while idle")) == 2
    finally:
        await durability.stop()
        if pool is not None:
            assert not pool.closed
            await pool.close()


@pytest.mark.spec("BACK-2")
async def test_default_logger_is_botmesh_postgres(pg_url: str, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """BACK-2: without ``logger`` the report goes to ``logging.getLogger("botmesh.postgres")``."""
    url, app = tagged(pg_url)
    durability = PostgresDurability(connection_string=url, table_prefix=prefix, min_size=1, max_size=1)
    assert durability.kv.logger is logging.getLogger("botmesh.postgres")
    await durability.start()
    try:
        await wait_for_backends(pg_url, app, 1)
        await terminate(pg_url, app)
        with caplog.at_level(logging.ERROR, logger="botmesh.postgres"):
            assert await durability.kv.get("s", "inbox", "k") is None
        assert [r.name for r in caplog.records if "dropped by the server while idle" in r.getMessage()] == ["botmesh.postgres"]
    finally:
        await durability.stop()


@pytest.mark.spec("BACK-2", "BACK-7")
async def test_connection_lost_during_a_write_raises_backend_unavailable_and_the_next_call_works(
    pg_url: str, prefix: str, captured: tuple[logging.Logger, Captured]
) -> None:
    """BACK-7: a connection lost in the middle of a write raises
    ``BackendUnavailableError`` (the psycopg error chained), is reported, and is not
    retried; the pool replaces the connection and the next calls work (BACK-2)."""
    logger, log = captured
    url, app = tagged(pg_url)
    kv = PostgresKv(connection_string=url, table_prefix=prefix, logger=logger, min_size=1, max_size=2)
    await kv.open()
    await kv.put("s", "inbox", "k", {"n": 1}, expected_version=0)
    async with await psycopg.AsyncConnection.connect(pg_url) as admin:  # holds the row lock
        await admin.execute(
            sql.SQL("SELECT 1 FROM {} WHERE key = 'k' FOR UPDATE").format(sql.Identifier(f"{prefix}durable"))
        )
        write = asyncio.ensure_future(kv.put("s", "inbox", "k", {"n": 2}, expected_version=1))
        deadline = time.monotonic() + 10
        waiting: list[Any] = []
        while not waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            cursor = await admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'", (app,)
            )
            waiting = await cursor.fetchall()
        assert waiting, "the write never blocked on the row lock"
        await admin.execute("SELECT pg_terminate_backend(%s)", (waiting[0][0],))
        with pytest.raises(BackendUnavailableError) as info:
            await write
        await admin.rollback()
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    assert "put failed" in str(info.value)
    assert log.errors("lost during put")
    assert await kv.get("s", "inbox", "k") == Versioned({"n": 1}, 1)  # not applied, not retried
    assert await kv.put("s", "inbox", "k", {"n": 3}, expected_version=1) == 2
    await kv.close()


@pytest.mark.spec("BACK-2")
async def test_abandon_drops_the_connections_like_a_dead_process(pg_url: str, prefix: str) -> None:
    """TEST-3 support: ``abandon()`` drops the backend's own server connections at once;
    the abandoned backend refuses calls; a new one on the same table sees every write."""
    url, app = tagged(pg_url)
    durability = PostgresDurability(connection_string=url, table_prefix=prefix, min_size=2, max_size=2)
    await durability.start()
    await durability.kv.put("s", "outbox", "k", {"n": 1}, expected_version=0, expires=3.0)
    assert len(await wait_for_backends(pg_url, app, 2)) == 2
    task = durability.abandon()
    assert await wait_for_backends(pg_url, app, 0) == []
    assert task is not None
    await task
    with pytest.raises(BackendUnavailableError):
        await durability.kv.get("s", "outbox", "k")
    again = PostgresDurability(connection_string=url, table_prefix=prefix, max_size=1)
    await again.start()
    assert await again.kv.range("s", "outbox", "expires", upto=INF, limit=5) == [(3.0, "k")]
    await again.stop()


# ----------------------------------------------------------------------------------------
# values, capabilities, options
# ----------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-7")
async def test_numbers_keep_their_json_type_and_the_value_is_json_in_the_table(pg_url: str, prefix: str) -> None:
    """BACK-7: values come back exactly — an int stays an int, a float a float (``1.0``
    is not ``1``), big integers and tiny floats unchanged, ``U+0000`` kept (``jsonb``
    would refuse it: the column is ``json``) — and the column holds JSON an operator can
    query."""
    value = {"i": 1, "f": 1.0, "big": 2**70, "neg": -0.0, "tiny": 5e-324, "third": 0.1 + 0.2}
    nul = {"nul": "a\x00b", "\x00": 0}
    kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, max_size=1)
    await kv.open()
    await kv.put("s", "inbox", "k", value, expected_version=0)
    await kv.put("s", "inbox", "nul", nul, expected_version=0)
    got = await kv.get("s", "inbox", "k")
    assert got is not None and got.value == value
    assert {k: type(v) for k, v in got.value.items()} == {k: type(v) for k, v in value.items()}
    assert str(got.value["neg"]) == "-0.0"
    assert await kv.get("s", "inbox", "nul") == Versioned(nul, 1)
    await kv.close()
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
        cursor = await admin.execute(
            sql.SQL("SELECT value->>'i', value->>'big' FROM {} WHERE key = 'k'").format(
                sql.Identifier(f"{prefix}durable")
            )
        )
        assert await cursor.fetchall() == [("1", str(2**70))]


@pytest.mark.spec("BACK-7")
async def test_non_json_values_are_refused_like_memory_kv(pg_url: str, prefix: str) -> None:
    """BACK-7: a value that is not a JSON object raises what ``MemoryKv`` raises and
    stores nothing."""
    kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, max_size=1)
    await kv.open()
    with pytest.raises(TypeError):
        await kv.put("s", "inbox", "k", [1, 2], expected_version=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await kv.put("s", "inbox", "k", {"x": object()}, expected_version=0)
    with pytest.raises(ValueError):
        await kv.put("s", "inbox", "k", {"x": float("nan")}, expected_version=0)
    assert await kv.get("s", "inbox", "k") is None
    await kv.close()


@pytest.mark.spec("BACK-2", "REPL-4", "LEASE-3")
def test_capabilities_claim_a_shared_crash_safe_multi_host_backend(pg_url: str) -> None:
    """REPL-4, LEASE-3: the backend claims survives_crash, multi_process, multi_host and
    shared."""
    assert PostgresKv.capabilities == ALL_CAPABILITIES
    durability = PostgresDurability(connection_string=pg_url)
    assert durability.capabilities == ALL_CAPABILITIES
    assert isinstance(durability, KvDurability) and durability.own_kv
    assert durability.kv.table_prefix == "botmesh_" and durability.table == "botmesh_durable"


@pytest.mark.spec("GUAR-1", "BACK-2")
async def test_durability_settings_are_read_from_the_kvs_own_sessions(pg_url: str, prefix: str) -> None:
    """``SHOW fsync``, ``synchronous_commit``, ``full_page_writes`` on a connection of
    the kv's pool: what the server says, and a ``synchronous_commit`` set for the session
    by the connection string's ``options`` is what the kv reports; not open:
    unavailable."""
    with psycopg.connect(pg_url) as conn:
        server = {name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                  for name in ("fsync", "synchronous_commit", "full_page_writes")}
    kv = PostgresKv(connection_string=pg_url, table_prefix=prefix)
    with pytest.raises(BackendUnavailableError, match="not open"):
        await kv.durability_settings()
    backend = PostgresDurability(connection_string=pg_url, table_prefix=prefix)
    await backend.start()
    try:
        assert await backend.durability_settings() == {"kind": "postgres", **server}
    finally:
        await backend.stop()
    off = make_conninfo(pg_url, options="-c synchronous_commit=off")
    kv = PostgresKv(connection_string=off, table_prefix=prefix)
    await kv.open()
    try:
        assert (await kv.durability_settings())["synchronous_commit"] == "off"
    finally:
        await kv.close()


@pytest.mark.spec("LEASE-3")
def test_default_instance_id_gets_a_per_boot_suffix(pg_url: str) -> None:
    """LEASE-3: on PostgreSQL (a shared backend) the default ``instance_id`` is
    ``<hostname>/<bot_id>/<connection_id>/<per-boot suffix>``: two processes of one host
    never share it; an explicit ``instance_id`` is kept as given."""
    def bot(**options: Any) -> Bot:
        backend = PostgresDurability(connection_string=pg_url)
        return Bot(MockProvider(), MemoryStore(), {"backend": backend, **options}, bot_id="b", connection_id="c")

    a, b = bot(), bot()
    assert a.durability is not None and b.durability is not None
    pattern = re.escape(f"{socket.gethostname()}/b/c/") + r"[0-9a-f]{8}"
    assert re.fullmatch(pattern, a.durability.instance_id), a.durability.instance_id
    assert re.fullmatch(pattern, b.durability.instance_id), b.durability.instance_id
    assert a.durability.instance_id != b.durability.instance_id
    explicit = bot(instance_id="bot-1")
    assert explicit.durability is not None and explicit.durability.instance_id == "bot-1"


BAD_PREFIXES: list[Any] = [
    "x; drop table",
    "",
    "1abc",
    "a" * 42,
    "abc\n",
    'a"b',
    "with space",
    "é_",
    "a-b",
    None,
    42,
    b"botmesh_",
]


@pytest.mark.spec("BACK-2", "CONF-1")
@pytest.mark.parametrize("bad", BAD_PREFIXES, ids=repr)
def test_bad_table_prefix_is_a_config_error_naming_it(pg_url: str, bad: Any) -> None:
    """BACK-2: ``table_prefix`` must be an identifier (ASCII letters, digits, ``_``, not
    starting with a digit, at most 41 characters): anything else raises ``ConfigError``
    naming ``table_prefix`` and the value, before any connection is made."""
    for build in (PostgresDurability, PostgresKv):
        with pytest.raises(ConfigError) as info:
            build(connection_string=pg_url, table_prefix=bad)
        assert info.value.option == "table_prefix"  # type: ignore[attr-defined]
        assert info.value.value == bad  # type: ignore[attr-defined]
        assert "table_prefix" in str(info.value) and repr(bad) in str(info.value)


@pytest.mark.spec("BACK-2")
@pytest.mark.parametrize("good", ["a", "_", "A_b9_", "a" * 41, "botmesh_"])
def test_good_table_prefixes_are_accepted(pg_url: str, good: str) -> None:
    assert PostgresDurability(connection_string=pg_url, table_prefix=good).table == f"{good}durable"


@pytest.mark.spec("BACK-2", "CONF-1")
def test_bad_sources_and_options_are_config_errors_naming_the_option(pg_url: str) -> None:
    """BACK-2: exactly one of ``pool`` and ``connection_string``; a pool must be an
    ``AsyncConnectionPool``; the connection string must parse (its text, which may hold
    a password, is never copied into the error); other options are checked too."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(pg_url, open=False)
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, "connection_string"),
        ({"pool": pool, "connection_string": pg_url}, "pool"),
        ({"pool": "postgresql://x"}, "pool"),
        ({"pool": object()}, "pool"),
        ({"connection_string": ""}, "connection_string"),
        ({"connection_string": 5}, "connection_string"),
        ({"connection_string": "password=s3cret host"}, "connection_string"),
        ({"connection_string": pg_url, "schema": "a;b"}, "schema"),
        ({"connection_string": pg_url, "schema": ""}, "schema"),
        ({"connection_string": pg_url, "logger": "botmesh"}, "logger"),
        ({"connection_string": pg_url, "min_size": -1}, "min_size"),
        ({"connection_string": pg_url, "max_size": 0}, "max_size"),
        ({"connection_string": pg_url, "min_size": 3, "max_size": 2}, "max_size"),
        ({"connection_string": pg_url, "timeout": 0}, "timeout"),
        ({"connection_string": pg_url, "timeout": float("inf")}, "timeout"),
        ({"connection_string": pg_url, "query_timeout": 0}, "query_timeout"),
        ({"connection_string": pg_url, "query_timeout": -1.5}, "query_timeout"),
        ({"connection_string": pg_url, "query_timeout": float("nan")}, "query_timeout"),
        ({"connection_string": pg_url, "query_timeout": True}, "query_timeout"),
        ({"connection_string": pg_url, "query_timeout": "30"}, "query_timeout"),
        ({"connection_string": pg_url, "connection_class": psycopg.Connection}, "connection_class"),
        ({"connection_string": pg_url, "connection_class": "psycopg.AsyncConnection"}, "connection_class"),
        ({"pool": pool, "connection_class": psycopg.AsyncConnection}, "connection_class"),
    ]
    for kwargs, option in cases:
        with pytest.raises(ConfigError) as info:
            PostgresDurability(**kwargs)
        assert info.value.option == option, (kwargs, info.value)  # type: ignore[attr-defined]
        assert "s3cret" not in str(info.value) and "s3cret" not in repr(info.value.details)


# ----------------------------------------------------------------------------------------
# a bot end to end
# ----------------------------------------------------------------------------------------


def greet(bot: Bot) -> None:
    @bot.when("hi")
    async def hi(ctx: Any) -> None:
        await ctx.reply("hello!")


@pytest.mark.spec("BACK-2", "INB-4", "OUT-2")
async def test_a_bot_on_postgres_processes_a_message_and_a_restarted_bot_sees_it_done(pg_url: str, prefix: str) -> None:
    """A bot with ``durability={"backend": PostgresDurability(...)}`` processes a message
    once (a redelivery is a duplicate); after ``stop()``, a new bot process — a new
    backend on the same table, the same ``instance_id`` — finds the inbox record done and
    the reply sent, and does not process the redelivery again."""
    provider = MockProvider()
    bot = Bot(provider, MemoryStore(), {"backend": PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=2),
                                        "instance_id": "bot-1"})
    greet(bot)
    await bot.start()
    await provider.receive("chat-1", "hi", id="wamid.1")
    await provider.receive("chat-1", "hi", id="wamid.1")
    assert provider.texts() == ["hello!"]
    assert bot.durability is not None and bot.durability.metrics()["inbound_duplicates"] == 1
    await bot.stop()

    provider2 = MockProvider()
    backend2 = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=2)
    restarted = Bot(provider2, MemoryStore(), {"backend": backend2, "instance_id": "bot-1"})
    greet(restarted)
    await restarted.start()
    try:
        assert restarted.durability is not None
        assert [(r.id, r.state) for r in await restarted.durability.inbox.list()] == [("wamid.1", "done")]
        assert [(r.key, r.state) for r in await restarted.durability.outbox.list()] == [("wamid.1:1", "sent")]
        await provider2.receive("chat-1", "hi", id="wamid.1")
        assert provider2.texts() == []
        assert restarted.durability.metrics()["inbound_duplicates"] == 1
        await provider2.receive("chat-1", "hi", id="wamid.2")
        assert provider2.texts() == ["hello!"]
    finally:
        await restarted.stop()


def two_replies(bot: Bot) -> None:
    @bot.when("hi")
    async def hi(ctx: Any) -> None:
        await ctx.reply(f"one:{ctx.text}")
        await ctx.reply(f"two:{ctx.text}")


@pytest.mark.spec("GUAR-2", "INB-3", "LEASE-4")
async def test_world_death_after_journaling_is_reprocessed_on_postgres(pg_url: str, tmp_path: Path) -> None:
    """GUAR-2 through the harness (virtual time, real server): the bot dies right after
    journaling the inbound event; the restarted incarnation (same ``instance_id``)
    reprocesses it at once and each reply is sent once."""
    harness = PostgresHarness(str(tmp_path), url=pg_url)
    world = World(harness, setup=two_replies, instance_id="i1")
    try:
        await world.start(crash=True)
        assert world.crashable is not None
        world.crashable.crash_after("inbox.journal")
        await world.receive("c1", "hi", id="m1")
        assert world.crashed and world.channel.texts() == []
        bot = await world.restart()
        await world.clock.advance(1)
        await world.drain()
        assert world.channel.texts() == ["one:hi", "two:hi"]
        assert bot.durability is not None
        assert [r.state for r in await bot.durability.inbox.list()] == ["done"]
    finally:
        await world.close()
    assert not await table_exists(pg_url, f"{harness.table_prefix}durable")


@pytest.mark.spec("GUAR-3", "OUT-14")
async def test_world_death_between_send_and_mark_sent_is_ambiguous_on_postgres(pg_url: str, tmp_path: Path) -> None:
    """GUAR-3 through the harness: the channel got the reply, the outbox never knew; after
    the restart the send is reported ambiguous (OUT-14 default ``skip``), not sent twice."""
    world = World(PostgresHarness(str(tmp_path), url=pg_url), setup=greet, instance_id="i1")
    try:
        await world.start(crash=True)
        assert world.crashable is not None
        world.crashable.crash_before("outbox.mark_sent")
        await world.receive("chat-1", "hi", id="m1")
        await world.restart()
        await world.drain()
        assert world.named("durability:ambiguous") == [{"key": "m1:1", "chat_id": "chat-1"}]
        assert world.channel.texts() == ["hello!"]
    finally:
        await world.close()


# ----------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------


def test_harness_storage_is_derived_from_the_workdir(pg_url: str, tmp_path: Path) -> None:
    """The same workdir means the same table; another workdir another one; the prefix is
    a valid ``table_prefix``; the harness claims every capability of the backend."""
    a = PostgresHarness(str(tmp_path / "a"), url=pg_url)
    again = PostgresHarness(str(tmp_path / "a"), url=pg_url)
    assert a.table_prefix == again.table_prefix == table_prefix_for(str(tmp_path / "a"))
    assert a.table_prefix != PostgresHarness(str(tmp_path / "b"), url=pg_url).table_prefix
    assert re.fullmatch(r"bm_[0-9a-f]{10}_", a.table_prefix)
    assert a.capabilities == ALL_CAPABILITIES and a.name == "postgres"


@pytest.mark.spec("BACK-2")
async def test_harness_reopen_drops_the_old_connections_and_keeps_the_records(pg_url: str, tmp_path: Path) -> None:
    """``reopen()`` is a process death: the old incarnation's connections are dropped
    without any clean shutdown, the old backend refuses calls, and the new one on the
    same table finds every committed record; the store is kept. ``close()`` drops the
    table."""
    url, app = tagged(pg_url)
    harness = PostgresHarness(str(tmp_path), url=url)
    backend, store = await harness.open()
    await backend.start()
    await backend.inbox_journal("s", InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0))
    await store.set("ns", "k", 1)
    assert await backends_of(pg_url, app)
    again, store2 = await harness.reopen()
    assert again is not backend and store2 is store
    assert await wait_for_backends(pg_url, app, 0) == []
    with pytest.raises(BackendUnavailableError):
        await backend.inbox_get("s", "m1")
    await again.start()
    found = await again.inbox_get("s", "m1")
    assert found is not None and found.state == "pending"
    await harness.close()
    assert await wait_for_backends(pg_url, app, 0) == []
    assert not await table_exists(pg_url, f"{harness.table_prefix}durable")


async def test_harness_kv_factory_gives_kvs_on_its_table(pg_url: str, tmp_path: Path) -> None:
    """``kv_factory()`` (for the DurableKv conformance suite): new, unopened kvs on the
    harness's table; ``close()`` drops it."""
    harness = PostgresHarness(str(tmp_path), url=pg_url)
    factory = harness.kv_factory()
    assert factory is not None
    first, second = factory(), factory()
    assert isinstance(first, PostgresKv) and first is not second and first.table == f"{harness.table_prefix}durable"
    await first.open()
    await first.put("s", "inbox", "k", {"n": 1}, expected_version=0)
    first.abandon()
    await second.open()
    assert await second.get("s", "inbox", "k") == Versioned({"n": 1}, 1)
    await second.close()
    await harness.close()
    assert not await table_exists(pg_url, first.table)


@pytest.mark.spec("BACK-2")
async def test_the_own_pool_connects_with_the_connection_class_given(pg_url: str, prefix: str) -> None:
    """``connection_class``: the kv's own pool makes its connections with it (and they
    work as any other)."""
    made: list[psycopg.AsyncConnection[Any]] = []

    class Counted(psycopg.AsyncConnection[Any]):
        @classmethod
        async def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:  # type: ignore[override]
            conn = await super().connect(conninfo, **kwargs)
            made.append(conn)
            return conn

    kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, connection_class=Counted)
    await kv.open()
    try:
        await kv.put("s", "inbox", "k", {"n": 1}, expected_version=0)
        assert await kv.get("s", "inbox", "k") == Versioned({"n": 1}, 1)
        assert made and all(type(conn) is Counted for conn in made)
    finally:
        await kv.close()


def janitor(url: str) -> int:
    """The server pid of the connection that empties the reused tables of ``url``."""
    from botmesh_testkit.backends import postgres as harnesses

    return int(harnesses._JANITORS[url].info.backend_pid)


async def session_of(backend: Any) -> int:
    """The server pid of the connection an open backend's pool hands out."""
    async with backend.kv.pool.connection() as conn:
        return int(conn.info.backend_pid)


@pytest.mark.spec("TEST-3", "TEST-4")
async def test_matrix_harnesses_hand_idle_sessions_on_and_open_one_ahead(pg_url: str, tmp_path: Path) -> None:
    """With ``reuse_storage()`` (the crash matrix): when an incarnation's pool makes a new
    connection, one more session is opened beside it, ahead. At a death, the sessions
    lying idle in the dying incarnation's pool are handed to the next incarnation — the
    restart, then the next harness's first — instead of being closed; the one ahead
    waits for a connect that finds none. The restarted one finds what was committed.
    ``release_connections_ahead()`` ends what is left."""
    url, app = tagged(pg_url)
    harness = PostgresHarness(str(tmp_path / "a"), url=url)
    assert harness.reuse_storage() is True
    backend, _ = await harness.open()
    await backend.start()
    await backend.inbox_journal("s", InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0))
    first = await wait_for_backends(pg_url, app, 2)
    own = await session_of(backend)
    assert len(first) == 2 and own in first
    again, _ = await harness.reopen()
    await again.start()
    found = await again.inbox_get("s", "m1")
    assert found is not None and found.state == "pending"
    assert await session_of(again) == own  # the dead incarnation's idle session, handed on
    assert sorted(await wait_for_backends(pg_url, app, 2)) == sorted(first)  # nothing new opened
    await harness.close()
    left = await wait_for_backends(pg_url, app, 3)
    assert sorted(left) == sorted([*first, janitor(url)])
    following = PostgresHarness(str(tmp_path / "b"), url=url)
    following.reuse_storage()
    backend, _ = await following.open()
    await backend.start()
    assert await session_of(backend) == own
    await following.close()
    release_connections_ahead()
    assert await wait_for_backends(pg_url, app, 1) == [janitor(url)]  # the process's emptying connection


async def started_matrix_harness(url: str, workdir: Path) -> tuple[PostgresHarness, Any]:
    """A harness asked ``reuse_storage()`` (as the crash matrix asks it) and its first
    incarnation, started."""
    harness = PostgresHarness(str(workdir), url=url)
    harness.reuse_storage()
    backend, _ = await harness.open()
    await backend.start()
    return harness, backend


@pytest.mark.spec("TEST-3", "TEST-4")
async def test_a_session_handed_on_keeps_nothing_of_the_dead_incarnation(pg_url: str, tmp_path: Path) -> None:
    """A session handed to the next incarnation is reset with ``DISCARD ALL`` first, as a
    session pooler resets one it gives out: the settings, prepared statements, temporary
    tables and session advisory locks the dead incarnation left on it are gone; the
    connection string's own options stay (``synchronous_commit=off``)."""
    harness, backend = await started_matrix_harness(tagged(pg_url)[0], tmp_path)
    try:
        async with backend.kv.pool.connection() as conn:
            own = int(conn.info.backend_pid)
            await conn.execute("SET work_mem = '7777kB'")
            await conn.execute("PREPARE bm_left AS SELECT 1")
            await conn.execute("CREATE TEMP TABLE bm_left_behind (x int)")
            await conn.execute("SELECT pg_advisory_lock(4242001)")
        again, _ = await harness.reopen()
        await again.start()
        async with again.kv.pool.connection() as conn:
            assert int(conn.info.backend_pid) == own
            cur = await conn.execute(
                "SELECT current_setting('work_mem'), current_setting('synchronous_commit'),"
                " (SELECT count(*) FROM pg_prepared_statements WHERE name = 'bm_left'),"
                " to_regclass('pg_temp.bm_left_behind') IS NULL,"
                " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())"
            )
            work_mem, synchronous_commit, prepared, temp_gone, locks = await cur.fetchone()  # type: ignore[misc]
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as fresh:
            cur = await fresh.execute("SELECT current_setting('work_mem'), pg_try_advisory_lock(4242001)")
            default_work_mem, free = await cur.fetchone()  # type: ignore[misc]
            await fresh.execute("SELECT pg_advisory_unlock_all()")
        assert work_mem == default_work_mem != "7777kB"
        assert synchronous_commit == "off"
        assert (prepared, temp_gone, locks, free) == (0, True, 0, True)
    finally:
        await harness.close()
        release_connections_ahead()


@pytest.mark.spec("TEST-3", "TEST-4")
async def test_a_session_in_use_at_the_death_dies_with_it(pg_url: str, tmp_path: Path) -> None:
    """A connection checked out of the dying incarnation's pool (a call in flight, here a
    transaction left open) is never handed on: its session ends, the server rolls its
    transaction back, and the restart takes the session opened ahead instead."""
    url, app = tagged(pg_url)
    harness, backend = await started_matrix_harness(url, tmp_path)
    try:
        conn = await backend.kv.pool.getconn()
        busy = int(conn.info.backend_pid)
        await conn.execute("BEGIN")
        await conn.execute("CREATE TABLE bm_never_committed (x int)")
        before = await wait_for_backends(pg_url, app, 2)  # the busy one and the one opened ahead
        again, _ = await harness.reopen()
        await again.start()
        restarted = await session_of(again)
        assert restarted != busy and restarted in before  # no idle session kept: the one ahead
        for _ in range(500):  # the server notices the closed socket on its own time
            if busy not in await backends_of(pg_url, app):
                break
            await asyncio.sleep(0.02)
        assert busy not in await backends_of(pg_url, app)
        assert not await table_exists(pg_url, "bm_never_committed")
    finally:
        await harness.close()
        release_connections_ahead()


@pytest.mark.spec("TEST-3")
async def test_a_plain_harness_hands_no_session_on(pg_url: str, tmp_path: Path) -> None:
    """Without ``reuse_storage()`` (the conformance suite, the kill and power-cut loops) a
    death ends every session of the dead incarnation; the restart connects anew."""
    url, app = tagged(pg_url)
    harness = PostgresHarness(str(tmp_path), url=url)
    backend, _ = await harness.open()
    await backend.start()
    try:
        own = await session_of(backend)
        again, _ = await harness.reopen()
        await again.start()
        assert await session_of(again) != own
        assert own not in await wait_for_backends(pg_url, app, 1)
    finally:
        await harness.close()


@pytest.mark.spec("BACK-2")
async def test_abandon_offers_only_idle_connections_to_keep_idle(pg_url: str, prefix: str) -> None:
    """``PostgresKv.abandon(keep_idle=...)``: each connection idle in the own pool is
    offered; one taken stays open after the pool is closed (it belongs to the caller),
    one refused and one checked out die with the kv."""
    kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, min_size=3, max_size=3)
    await kv.open()
    await kv.pool.wait()
    held = await kv.pool.getconn()
    offered: list[Any] = []

    def keep(conn: Any) -> bool:
        offered.append(conn)
        return len(offered) == 1

    task = kv.abandon(keep_idle=keep)
    assert task is not None
    await task
    try:
        assert len(offered) == 2 and held not in offered
        kept, refused = offered
        assert held.closed and refused.closed and not kept.closed
        cur = await kept.execute("SELECT 1")
        assert await cur.fetchone() == (1,)
    finally:
        await offered[0].close()


@pytest.mark.spec("TEST-3", "TEST-4")
async def test_a_matrix_harness_commits_asynchronously_and_a_plain_one_does_not(pg_url: str, tmp_path: Path) -> None:
    """With ``reuse_storage()`` (the crash matrix) every incarnation's sessions, and the
    connection emptying the reused tables, run with ``synchronous_commit=off``, and the
    restarted one finds what the dead one committed;
    a harness without it keeps the server's setting (what the claims are judged on)."""
    harness = PostgresHarness(str(tmp_path / "matrix"), url=pg_url)
    harness.reuse_storage()
    backend, _ = await harness.open()
    await backend.start()
    await backend.inbox_journal("s", InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0))
    assert (await backend.durability_settings())["synchronous_commit"] == "off"
    again, _ = await harness.reopen()
    await again.start()
    found = await again.inbox_get("s", "m1")
    assert found is not None and found.state == "pending"
    assert (await again.durability_settings())["synchronous_commit"] == "off"
    await harness.close()
    from botmesh_testkit.backends import postgres as harnesses

    emptying = harnesses._JANITORS[pg_url].execute("SHOW synchronous_commit").fetchone()
    assert emptying is not None and emptying[0] == "off"  # the emptying connection's too
    with psycopg.connect(pg_url) as conn:
        server = str(conn.execute("SHOW synchronous_commit").fetchone()[0])  # type: ignore[index]
    plain = PostgresHarness(str(tmp_path / "plain"), url=pg_url)
    backend, _ = await plain.open()
    await backend.start()
    try:
        assert (await backend.durability_settings())["synchronous_commit"] == server
    finally:
        await plain.close()


def test_harness_close_on_another_event_loop(pg_url: str, tmp_path: Path) -> None:
    """A pytest fixture finalizer closes the harness with its own ``asyncio.run``, after
    the test's loop is gone: the connections are still dropped and the table too."""
    url, app = tagged(pg_url)
    harness = PostgresHarness(str(tmp_path), url=url)

    async def use() -> None:
        backend, _ = await harness.open()
        await backend.start()
        await backend.inbox_journal("s", InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0))

    asyncio.run(use())
    asyncio.run(harness.close())

    async def check() -> None:
        assert await wait_for_backends(pg_url, app, 0) == []
        assert not await table_exists(pg_url, f"{harness.table_prefix}durable")

    asyncio.run(check())


# ----------------------------------------------------------------------------------------
# several processes (REPL-1, REPL-4) and a killed process (survives a crash)
# ----------------------------------------------------------------------------------------

WORKER = r"""
import asyncio, json, os, sys
from botmesh.core.errors import VersionConflict
from botmesh.core.records import InboxRecord
from botmesh.postgres_store import PostgresDurability, PostgresKv


def barrier():
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go")


async def start(url, prefix, me, _):
    durability = PostgresDurability(connection_string=url, table_prefix=prefix, max_size=1)
    barrier()
    await durability.start()
    await durability.kv.put("start", "s", f"p{me}", {"me": me}, expected_version=0)
    await durability.stop()
    return {"started": me}


async def race(url, prefix, me, rounds):
    # Every round starts at a barrier: all processes replace the shared key "k" at
    # version r (round 0 creates it) and create the fresh key c{r}; at the end all delete
    # "k" at version `rounds`.
    kv = PostgresKv(connection_string=url, table_prefix=prefix, max_size=1)
    await kv.open()
    wins = {"create": [], "replace": [], "delete": []}
    for r in range(rounds + 1):
        barrier()
        try:
            await kv.put("race", "s", f"c{r}", {"by": me}, expected_version=0, due=float(r))
            wins["create"].append(r)
        except VersionConflict:
            pass
        try:
            if r == 0:
                await kv.put("race", "s", "k", {"by": me}, expected_version=0)
            elif r < rounds:
                await kv.put("race", "s", "k", {"by": me, "round": r}, expected_version=r)
            else:
                await kv.delete("race", "s", "k", expected_version=r)
            wins["delete" if r == rounds else "replace"].append(r)
        except VersionConflict:
            pass
    await kv.close()
    return wins


async def claim(url, prefix, me, count):
    durability = PostgresDurability(connection_string=url, table_prefix=prefix, max_size=1)
    await durability.start()
    barrier()
    won = []
    for i in range(count):
        rec = await durability.inbox_claim(
            "claims", f"m{i}", owner=f"p{me}", incarnation="boot", now=1000.0, lease_ms=60000.0, recover=False
        )
        if rec is not None:
            won.append(i)
    await durability.stop()
    return won


async def crash(url, prefix, me, count):
    kv = PostgresKv(connection_string=url, table_prefix=prefix, max_size=1)
    await kv.open()
    for i in range(count):
        await kv.put("crash", "s", f"k{i:03d}", {"i": i}, expected_version=0, due=float(i))
    print("result " + json.dumps({"acknowledged": count}), flush=True)
    os._exit(3)  # die at once: no close, no pool shutdown, no atexit


MODES = {"start": start, "race": race, "claim": claim, "crash": crash}
mode, url, prefix, me, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
print("result " + json.dumps(asyncio.run(MODES[mode](url, prefix, me, n))), flush=True)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Worker processes of a test; any still running at teardown is killed by its handle."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


def run_workers(
    procs: list[subprocess.Popen[str]], mode: str, url: str, prefix: str, count: int, n: int, *, barriers: int = 1
) -> list[tuple[int, Any]]:
    """Start ``count`` interpreters running ``WORKER`` in ``mode``; at each of ``barriers``
    barriers every worker says "ready" and all get "go" together. Returns each worker's
    ``(exit code, result)``."""
    for me in range(count):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, mode, url, prefix, str(me), str(n)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    for passage in range(barriers):
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                _, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
                pytest.fail(f"worker failed before barrier {passage}: {line!r}\n{err}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
    results: list[tuple[int, Any]] = []
    for proc in procs:
        out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
        lines = [line for line in out.splitlines() if line.startswith("result ")]
        assert lines, f"worker printed no result (exit {proc.returncode}):\n{out}\n{err}"
        results.append((proc.returncode, json.loads(lines[-1][len("result "):])))
    return results


@pytest.mark.spec("REPL-4", "REPL-1", "BACK-7")
def test_processes_racing_cas_have_exactly_one_winner_per_round(
    pg_url: str, prefix: str, procs: list[subprocess.Popen[str]]
) -> None:
    """REPL-4: 3 processes x 20 rounds, released together at every round, race the same
    CAS writes: exactly one winner per round for the create of a fresh key, for the
    replace of the shared key and for the final delete; the stored values are the
    winners'."""
    workers, rounds = 3, 20
    results = run_workers(procs, "race", pg_url, prefix, workers, rounds, barriers=rounds + 1)
    assert [code for code, _ in results] == [0] * workers
    wins = [result for _, result in results]

    def winners(kind: str, r: int) -> list[int]:
        return [me for me, w in enumerate(wins) if r in w[kind]]

    for r in range(rounds + 1):
        assert len(winners("create", r)) == 1, (r, wins)
    for r in range(rounds):
        assert len(winners("replace", r)) == 1, (r, wins)
    assert len(winners("delete", rounds)) == 1, wins

    async def check() -> None:
        kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, max_size=1)
        await kv.open()
        assert await kv.get("race", "s", "k") is None
        for r in range(rounds + 1):
            assert await kv.get("race", "s", f"c{r}") == Versioned({"by": winners("create", r)[0]}, 1)
        assert await kv.range("race", "s", "due", upto=INF, limit=100) == [(float(r), f"c{r}") for r in range(rounds + 1)]
        await kv.close()

    asyncio.run(check())


@pytest.mark.spec("REPL-1", "REPL-4")
def test_processes_claiming_the_same_records_never_share_one(
    pg_url: str, prefix: str, procs: list[subprocess.Popen[str]]
) -> None:
    """REPL-1 over PostgreSQL (REPL-4): 3 processes claim the same 30 pending inbox
    records at once; each record is leased to exactly one of them, token 1."""
    workers, count = 3, 30

    async def setup() -> None:
        durability = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=1)
        await durability.start()
        for i in range(count):
            await durability.inbox_journal("claims", InboxRecord(id=f"m{i}", chat_id="c", state="pending", next_at=0.0))
        await durability.stop()

    asyncio.run(setup())
    results = run_workers(procs, "claim", pg_url, prefix, workers, count)
    assert [code for code, _ in results] == [0] * workers
    owners = {i: [me for me, (_, won) in enumerate(results) if i in won] for i in range(count)}
    assert all(len(claimers) == 1 for claimers in owners.values()), owners

    async def check() -> None:
        durability = PostgresDurability(connection_string=pg_url, table_prefix=prefix, max_size=1)
        await durability.start()
        for i, [me] in owners.items():
            rec = await durability.inbox_get("claims", f"m{i}")
            assert rec is not None
            assert (rec.state, rec.owner, rec.token, rec.attempts) == ("leased", f"p{me}", 1, 1)
        await durability.stop()

    asyncio.run(check())


@pytest.mark.spec("BACK-2", "BACK-7")
def test_acknowledged_writes_survive_a_killed_process(pg_url: str, prefix: str, procs: list[subprocess.Popen[str]]) -> None:
    """BACK table, "survives a crash": a process that dies (``os._exit``: no close, no
    pool shutdown) right after its writes returned leaves every one of them readable."""
    count = 25
    [(code, result)] = run_workers(procs, "crash", pg_url, prefix, 1, count, barriers=0)
    assert code == 3 and result == {"acknowledged": count}

    async def check() -> None:
        kv = PostgresKv(connection_string=pg_url, table_prefix=prefix, max_size=1)
        await kv.open()
        assert [(k, v.value, v.version) for k, v in await kv.scan("crash", "s", limit=1000)] == [
            (f"k{i:03d}", {"i": i}, 1) for i in range(count)
        ]
        assert await kv.range("crash", "s", "due", upto=INF, limit=1000) == [(float(i), f"k{i:03d}") for i in range(count)]
        await kv.close()

    asyncio.run(check())
