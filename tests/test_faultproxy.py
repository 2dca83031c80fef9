"""Tests of ``botmesh_testkit.faultproxy``: the TCP fault proxy between a client and a
real server (the shared Redis and PostgreSQL of the test machine, or
``BOTMESH_REDIS_URL`` / ``BOTMESH_POSTGRES_URL``).

Spec ids: BACK-2 / BACK-3 (the PostgreSQL and Redis backends these faults are for),
OUT-14 (outcome unknown: the write lands on the server, the client sees an error).

Clients run with their automatic retries off (redis-py ``Retry(NoBackoff(), 0)``), so
every fault reaches the test. Timing assertions are lower bounds only (a delay the proxy
adds cannot be undercut), never upper bounds.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import psycopg
import pytest
import redis
import redis.asyncio as aredis
from psycopg import sql
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from botmesh_testkit.servers.faultproxy import FaultProxy, ThreadedFaultProxy

REDIS_URL = os.environ.get("BOTMESH_REDIS_URL") or "redis://127.0.0.1:6379/0"
POSTGRES_URL = os.environ.get("BOTMESH_POSTGRES_URL") or "postgresql://postgres@127.0.0.1:5432/test"


def _target(url: str, default_port: int) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _redis_client(url: str, *, socket_timeout: float = 5.0) -> aredis.Redis:
    """An asyncio client on one connection that never retries."""
    return aredis.Redis.from_url(
        url,
        single_connection_client=True,
        retry=AsyncRetry(NoBackoff(), 0),
        retry_on_error=[],
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
    )


def _direct_redis() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, socket_timeout=5)


@asynccontextmanager
async def _redis_proxy() -> AsyncIterator[FaultProxy]:
    async with FaultProxy(*_target(REDIS_URL, 6379)) as proxy:
        yield proxy


@asynccontextmanager
async def _pg_proxy() -> AsyncIterator[FaultProxy]:
    async with FaultProxy(*_target(POSTGRES_URL, 5432)) as proxy:
        yield proxy


@pytest.fixture
def redis_key() -> Iterator[str]:
    """A fresh key on the shared Redis, deleted afterwards."""
    key = f"bm_faultproxy_test:{secrets.token_hex(6)}"
    yield key
    with _direct_redis() as client:
        client.delete(key)


@pytest.fixture
def pg_table() -> Iterator[str]:
    """A fresh table ``(k text primary key, v text)`` on the shared PostgreSQL."""
    name = f"bm_faultproxy_{secrets.token_hex(6)}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (k text PRIMARY KEY, v text)").format(sql.Identifier(name)))
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def test_url_for_rewrites_host_and_port_only() -> None:
    proxy = FaultProxy("db.example", 5432, listen_port=0)
    proxy.port = 40001
    assert proxy.url_for("postgresql://u:p%40ss@db.example:5432/app?sslmode=disable") == (
        "postgresql://u:p%40ss@127.0.0.1:40001/app?sslmode=disable"
    )
    assert proxy.url_for("redis://cache:6379/2") == "redis://127.0.0.1:40001/2"
    assert FaultProxy("h", 1, listen_host="::1").url_for("redis://h:1/0").startswith("redis://[::1]:")


@pytest.mark.spec("BACK-2", "BACK-3")
async def test_pass_through_both_servers(redis_key: str) -> None:
    async with _redis_proxy() as rproxy, _pg_proxy() as pproxy:
        client = _redis_client(rproxy.url_for(REDIS_URL))
        try:
            await client.set(redis_key, b"v" * 200_000)
            assert await client.get(redis_key) == b"v" * 200_000
        finally:
            await client.aclose()
        conn = await psycopg.AsyncConnection.connect(pproxy.url_for(POSTGRES_URL), autocommit=True)
        try:
            cur = await conn.execute("SELECT 1 + 1, repeat('x', 100000)")
            assert await cur.fetchone() == (2, "x" * 100_000)
        finally:
            await conn.close()
        for proxy in (rproxy, pproxy):
            assert proxy.stats.connections_accepted >= 1
            assert proxy.stats.bytes_client_to_server > 0 and proxy.stats.bytes_server_to_client > 0
            assert proxy.stats.faults_fired == {}
        assert rproxy.stats.bytes_client_to_server >= 200_000
        assert rproxy.stats.bytes_server_to_client >= 200_000


@pytest.mark.spec("BACK-3")
async def test_latency_is_added_to_each_direction() -> None:
    async with _redis_proxy() as proxy:
        client = _redis_client(proxy.url_for(REDIS_URL))
        try:
            await client.ping()  # connect outside the measurement
            started = time.perf_counter()
            assert await client.ping() is True
            baseline = time.perf_counter() - started
            proxy.latency(200)
            started = time.perf_counter()
            assert await client.ping() is True  # request delayed 200 ms, reply delayed 200 ms
            delayed = time.perf_counter() - started
            proxy.latency(0)
            print(f"PING through the proxy: {baseline * 1000:.1f} ms, with latency(200): {delayed * 1000:.1f} ms")
            assert delayed >= 0.4 - 0.005  # a lower bound: the proxy cannot forward earlier
            assert proxy.stats.faults_fired["latency"] >= 2
        finally:
            await client.aclose()


@pytest.mark.spec("BACK-2", "BACK-3")
async def test_reset_makes_the_next_command_fail() -> None:
    async with _redis_proxy() as rproxy, _pg_proxy() as pproxy:
        client = _redis_client(rproxy.url_for(REDIS_URL))
        conn = await psycopg.AsyncConnection.connect(pproxy.url_for(POSTGRES_URL), autocommit=True)
        try:
            assert await client.ping() is True
            await conn.execute("SELECT 1")
            assert rproxy.reset() == 1
            assert pproxy.reset() == 1
            with pytest.raises(redis.ConnectionError):
                await client.ping()
            with pytest.raises(psycopg.OperationalError):
                await conn.execute("SELECT 1")
            assert rproxy.stats.faults_fired == {"reset": 1}
            assert rproxy.stats.connections_active == 0
        finally:
            await client.aclose()
            await conn.close()
        # New connections go through again.
        fresh = _redis_client(rproxy.url_for(REDIS_URL))
        try:
            assert await fresh.ping() is True
        finally:
            await fresh.aclose()


@pytest.mark.spec("BACK-3")
async def test_refuse_resets_new_connections() -> None:
    async with _redis_proxy() as proxy:
        proxy.refuse(True)
        client = _redis_client(proxy.url_for(REDIS_URL))
        try:
            with pytest.raises(redis.ConnectionError):
                await client.ping()
        finally:
            await client.aclose()
        assert proxy.stats.faults_fired.get("refuse", 0) >= 1
        proxy.refuse(False)
        client = _redis_client(proxy.url_for(REDIS_URL))
        try:
            assert await client.ping() is True
        finally:
            await client.aclose()


@pytest.mark.spec("BACK-2", "BACK-3")
async def test_blackhole_makes_commands_time_out() -> None:
    async with _redis_proxy() as rproxy, _pg_proxy() as pproxy:
        client = _redis_client(rproxy.url_for(REDIS_URL), socket_timeout=0.3)
        try:
            assert await client.ping() is True
            rproxy.blackhole(True)
            with pytest.raises(redis.TimeoutError):
                await client.ping()
        finally:
            await client.aclose()
        # A new PostgreSQL connection cannot even complete its startup.
        pproxy.blackhole(True)
        with pytest.raises(psycopg.OperationalError):
            await psycopg.AsyncConnection.connect(pproxy.url_for(POSTGRES_URL), connect_timeout=2)
        assert rproxy.stats.faults_fired["blackhole"] >= 1
        assert pproxy.stats.faults_fired["blackhole"] >= 1
        rproxy.blackhole(False)
        pproxy.blackhole(False)
        client = _redis_client(rproxy.url_for(REDIS_URL))
        try:
            assert await client.ping() is True
        finally:
            await client.aclose()


@pytest.mark.spec("BACK-3")
async def test_blackhole_drop_discards_bytes() -> None:
    async with _redis_proxy() as proxy:
        client = _redis_client(proxy.url_for(REDIS_URL), socket_timeout=0.3)
        try:
            assert await client.ping() is True
            proxy.blackhole(True, drop=True)
            with pytest.raises(redis.TimeoutError):
                await client.ping()
            assert proxy.stats.bytes_withheld > 0
        finally:
            await client.aclose()
            proxy.clear()


@pytest.mark.spec("BACK-2", "BACK-3")
async def test_a_reply_cut_in_the_middle_is_an_error_not_a_short_value(redis_key: str) -> None:
    value = os.urandom(1 << 20)
    with _direct_redis() as direct:
        direct.set(redis_key, value)
    async with _redis_proxy() as rproxy, _pg_proxy() as pproxy:
        client = _redis_client(rproxy.url_for(REDIS_URL))
        try:
            assert await client.ping() is True
            rproxy.cut_reply_after(1000)
            with pytest.raises(redis.ConnectionError):
                await client.get(redis_key)
        finally:
            await client.aclose()
        assert rproxy.stats.faults_fired == {"cut_reply": 1}
        assert rproxy.stats.bytes_withheld > 0
        client = _redis_client(rproxy.url_for(REDIS_URL))  # one shot: the next reply is whole
        try:
            assert await client.get(redis_key) == value
        finally:
            await client.aclose()

        conn = await psycopg.AsyncConnection.connect(pproxy.url_for(POSTGRES_URL), autocommit=True)
        try:
            pproxy.cut_reply_after(5000)
            with pytest.raises(psycopg.OperationalError):
                await conn.execute("SELECT repeat('x', 1000000)")
        finally:
            await conn.close()
        assert pproxy.stats.faults_fired == {"cut_reply": 1}


@pytest.mark.spec("OUT-14", "BACK-3")
async def test_outcome_unknown_redis_set_lands_but_the_client_errs(redis_key: str) -> None:
    async with _redis_proxy() as proxy:
        client = _redis_client(proxy.url_for(REDIS_URL))
        try:
            assert await client.ping() is True
            proxy.cut_after_request(b"SET")
            with pytest.raises(redis.ConnectionError):
                await client.set(redis_key, "landed")
        finally:
            await client.aclose()
        assert proxy.stats.faults_fired == {"cut_after_request": 1}
    with _direct_redis() as direct:
        assert direct.get(redis_key) == b"landed"


@pytest.mark.spec("OUT-14", "BACK-2")
async def test_outcome_unknown_postgres_insert_lands_but_the_client_errs(pg_table: str) -> None:
    insert = sql.SQL("INSERT INTO {} (k, v) VALUES ('k1', 'landed')").format(sql.Identifier(pg_table))
    async with _pg_proxy() as proxy:
        conn = await psycopg.AsyncConnection.connect(proxy.url_for(POSTGRES_URL), autocommit=True)
        try:
            proxy.cut_after_request(b"INSERT")
            with pytest.raises(psycopg.OperationalError):
                await conn.execute(insert)
        finally:
            await conn.close()
        assert proxy.stats.faults_fired == {"cut_after_request": 1}
    with psycopg.connect(POSTGRES_URL) as direct:
        rows = direct.execute(sql.SQL("SELECT k, v FROM {}").format(sql.Identifier(pg_table))).fetchall()
    assert rows == [("k1", "landed")]


@pytest.mark.spec("OUT-14", "BACK-3")
def test_threaded_proxy_serves_blocking_clients(redis_key: str) -> None:
    with ThreadedFaultProxy(*_target(REDIS_URL, 6379)) as proxy:
        client = redis.Redis.from_url(
            proxy.url_for(REDIS_URL), single_connection_client=True, retry=Retry(NoBackoff(), 0),
            retry_on_error=[], socket_timeout=5,
        )
        try:
            assert client.ping() is True
            proxy.cut_after_request(b"SET")
            with pytest.raises(redis.ConnectionError):
                client.set(redis_key, "landed")
        finally:
            client.close()
        stats = proxy.stats
        assert stats.faults_fired == {"cut_after_request": 1}
        assert stats.connections_accepted == 1
    with _direct_redis() as direct:
        assert direct.get(redis_key) == b"landed"
