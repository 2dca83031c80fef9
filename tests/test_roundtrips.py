"""Server round trips of the PostgreSQL and Redis backends (issue 16), counted on the wire
by :class:`botmesh_testkit.servers.roundtrips.CountingProxy` — real commands sent to the
real shared servers, no timing.

Spec ids: CONF-1 (a bad option named), BACK-2 (PostgresKv), BACK-3 (RedisKv), BACK-7 (the DurableKv contract: every
write a compare-and-set; ``VersionConflict.current``), REPL-1 (concurrent CAS on one key:
exactly one winner).

What is pinned:

* the proxy counts what it should (sequential commands vs a pipeline), so the counts
  below can be trusted;
* every ``put`` / ``delete`` of ``PostgresKv`` and ``RedisKv`` is ONE round trip, also
  when it conflicts, and the conflict carries the record found (``current``) — a read
  creeping back before (or after) a CAS with a known version makes these fail;
* a message through a bot costs exactly one round trip per kv call (the stores add
  none of their own), and at most 4 (one per journal write: the engine writes with the
  versions it knows, and the reply of an inbound journaled just now is journaled
  without a lookup of its key);
* a pass of the engine's sweep that finds nothing due is ONE round trip (both journals'
  due indexes read together);
* Redis auto-pipelining: calls made while a round trip is in flight share the next one
  (each with its own result), a batch cut by a lost connection fails each of its calls
  with ``BackendUnavailableError``, a ``NOSCRIPT`` batch is resent once after the
  script is loaded again, ``auto_pipeline`` must be a bool (CONF-1).

Servers: ``BOTMESH_POSTGRES_URL`` / ``BOTMESH_REDIS_URL`` (defaults: the local ones); when
one does not answer the tests fail, or are skipped with ``BOTMESH_ALLOW_SKIP_SERVICES=1``.
Every test works in a fresh table prefix / key prefix and removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
import redis.asyncio as aredis
from botmesh.core import Bot, MemoryStore
from botmesh.core.errors import VersionConflict
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import DurableKv
from botmesh.core.testing import MockProvider
from botmesh.postgres_store import PostgresDurability, PostgresKv
from botmesh.redis_store import RedisDurability, RedisKv
from psycopg import sql

from botmesh_testkit.servers.roundtrips import CountingProxy

PG_URL = os.environ.get("BOTMESH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0")
KV_OPS = ("get", "put", "delete", "range", "scan")
ALLOW_SKIP = os.environ.get("BOTMESH_ALLOW_SKIP_SERVICES") == "1"
spec = pytest.mark.spec


@pytest.fixture(autouse=True, scope="module")
def _servers_answer() -> None:
    """Both servers must answer: otherwise every test here fails (CI must run them), or is
    skipped with ``BOTMESH_ALLOW_SKIP_SERVICES=1``."""
    import redis as sync_redis

    problems = []
    try:
        with psycopg.connect(PG_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        problems.append(f"PostgreSQL (BOTMESH_POSTGRES_URL): {exc}")
    client = sync_redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except sync_redis.RedisError as exc:
        problems.append(f"Redis at {REDIS_URL} (BOTMESH_REDIS_URL): {exc}")
    finally:
        client.close()
    if problems:
        if ALLOW_SKIP:
            pytest.skip("; ".join(problems) + " (BOTMESH_ALLOW_SKIP_SERVICES=1)")
        pytest.fail("; ".join(problems) + " -- set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead", pytrace=False)


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


async def _drop_table(prefix: str) -> None:
    async with await psycopg.AsyncConnection.connect(PG_URL, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(f"{prefix}durable")))


async def _drop_keys(prefix: str) -> None:
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def counted_kv(backend: str) -> AsyncIterator[tuple[DurableKv, CountingProxy]]:
    """A kv of the backend under test, all its traffic through a fresh counting proxy
    (PostgreSQL: a pool of exactly one connection, so prepared statements are per that
    connection)."""
    if backend == "postgres":
        proxy = CountingProxy(*_host_port(PG_URL, 5432), protocol="postgres")
        await proxy.start()
        prefix = f"rt_{uuid.uuid4().hex[:8]}_"
        kv: DurableKv = PostgresKv(connection_string=proxy.url_for(PG_URL), table_prefix=prefix, min_size=1, max_size=1)
    else:
        proxy = CountingProxy(*_host_port(REDIS_URL, 6379), protocol="redis")
        await proxy.start()
        prefix = f"rt{uuid.uuid4().hex[:8]}"
        kv = RedisKv(url=proxy.url_for(REDIS_URL), prefix=prefix)
    await kv.open()
    try:
        yield kv, proxy
    finally:
        await kv.close()
        await proxy.stop()
        await (_drop_table(prefix) if backend == "postgres" else _drop_keys(prefix))


async def _warm(kv: DurableKv, scope: str) -> None:
    """Use every write statement / script (and the conflict paths) 6 times on a scratch
    key: psycopg prepares a statement on its 5th use (a round trip of its own, counted as
    ``prepare_only``), redis-py loads a script on first use."""
    for i in range(6):
        key = f"warm-{i}"
        await kv.put(scope, "inbox", key, {"i": i}, expected_version=0)
        await kv.put(scope, "inbox", key, {"i": i}, expected_version=1)
        for expected in (0, 1):
            with pytest.raises(VersionConflict):
                await kv.put(scope, "inbox", key, {"i": i}, expected_version=expected)
        with pytest.raises(VersionConflict):
            await kv.delete(scope, "inbox", key, expected_version=1)
        await kv.delete(scope, "inbox", key, expected_version=2)
        with pytest.raises(VersionConflict):
            await kv.delete(scope, "inbox", key, expected_version=2)
        await kv.get(scope, "inbox", key)


# --------------------------------------------------------------------------------------
# the measure itself
# --------------------------------------------------------------------------------------


@spec("BACK-3")
async def test_the_proxy_counts_redis_round_trips_and_commands() -> None:
    """Three GETs each awaited are three round trips; the same three in one pipeline are
    one round trip and three commands."""
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with CountingProxy(*_host_port(REDIS_URL, 6379), protocol="redis") as proxy:
        client = aredis.Redis.from_url(proxy.url_for(REDIS_URL))
        try:
            await client.ping()
            proxy.reset_counts()
            for i in range(3):
                await client.get(f"{prefix}:{i}")
            sequential = proxy.reset_counts()
            async with client.pipeline(transaction=False) as pipe:
                for i in range(3):
                    pipe.get(f"{prefix}:{i}")
                await pipe.execute()
            piped = proxy.reset_counts()
        finally:
            await client.aclose()
    assert (sequential.round_trips, sequential.requests, sequential.commands) == (3, 3, Counter({"GET": 3}))
    assert (piped.round_trips, piped.requests, piped.commands) == (1, 3, Counter({"GET": 3}))
    assert proxy.unparsable == 0


@spec("BACK-2")
async def test_the_proxy_counts_postgres_round_trips_and_prepares() -> None:
    """Two statements are two round trips; two in psycopg's pipeline mode are one; the
    5th use of a statement adds a prepare-only round trip."""
    async with CountingProxy(*_host_port(PG_URL, 5432), protocol="postgres") as proxy:
        conn = await psycopg.AsyncConnection.connect(proxy.url_for(PG_URL), autocommit=True)
        try:
            proxy.reset_counts()
            await conn.execute("SELECT %s::int", (1,))
            await conn.execute("SELECT %s::text", ("a",))
            two = proxy.reset_counts()
            async with conn.pipeline():
                await conn.execute("SELECT %s::int", (1,))
                await conn.execute("SELECT %s::text", ("a",))
            piped = proxy.reset_counts()
        finally:
            await conn.close()
    assert (two.round_trips, two.commands["Execute"], two.prepare_only) == (2, 2, 0)
    assert (piped.round_trips, piped.commands["Execute"]) == (1, 2)
    async with CountingProxy(*_host_port(PG_URL, 5432), protocol="postgres") as proxy:
        conn = await psycopg.AsyncConnection.connect(proxy.url_for(PG_URL), autocommit=True)
        try:
            proxy.reset_counts()
            for i in range(6):
                await conn.execute("SELECT %s::int", (i,))
            six = proxy.reset_counts()
        finally:
            await conn.close()
    # six uses of one statement prepare it once (psycopg's prepare_threshold 5)
    assert (six.round_trips, six.prepare_only, six.executing, six.commands["Execute"]) == (7, 1, 6, 6)


# --------------------------------------------------------------------------------------
# the kvs: one round trip per CAS, conflicts included
# --------------------------------------------------------------------------------------


@spec("BACK-2", "BACK-3", "BACK-7")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_every_cas_is_one_round_trip_and_nothing_is_read_around_it(backend: str) -> None:
    """put (create, replace) and delete with a known version: exactly one round trip
    each, which runs the write itself (PostgreSQL: one statement executed; Redis: one
    EVALSHA and no HGET). A read added before or after the CAS doubles the count."""
    async with counted_kv(backend) as (kv, proxy):
        await _check_one_round_trip_per_write(kv, proxy)


async def _check_one_round_trip_per_write(kv: DurableKv, proxy: CountingProxy) -> None:
    scope = f"s-{uuid.uuid4().hex[:6]}"
    await _warm(kv, scope)
    writes: list[tuple[str, Callable[[], Any]]] = [
        ("create", lambda: kv.put(scope, "inbox", "k", {"n": 1}, expected_version=0, due=5.0)),
        ("replace", lambda: kv.put(scope, "inbox", "k", {"n": 2}, expected_version=1, expires=9.0)),
        ("replace again", lambda: kv.put(scope, "inbox", "k", {"n": 3}, expected_version=2)),
        ("delete", lambda: kv.delete(scope, "inbox", "k", expected_version=3)),
    ]
    for what, write in writes:
        proxy.reset_counts()
        await write()
        counted = proxy.reset_counts()
        assert counted.round_trips == 1, f"{what}: {counted.round_trips} round trips, expected 1 ({counted})"
        if isinstance(kv, RedisKv):
            assert counted.commands == Counter({"EVALSHA": 1}), f"{what}: {counted.commands}"
        else:
            assert counted.commands["Execute"] == 1 and counted.prepare_only == 0, f"{what}: {counted}"
    assert await kv.get(scope, "inbox", "k") is None


@spec("BACK-2", "BACK-3", "BACK-7")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_a_conflict_is_one_round_trip_and_carries_the_record_found(backend: str) -> None:
    """A CAS that loses costs one round trip too, and its VersionConflict has ``found``
    and ``current`` equal to what ``get`` then returns (``current`` None when absent)."""
    async with counted_kv(backend) as (kv, proxy):
        await _check_conflicts(kv, proxy)


async def _check_conflicts(kv: DurableKv, proxy: CountingProxy) -> None:
    scope = f"s-{uuid.uuid4().hex[:6]}"
    await _warm(kv, scope)
    await kv.put(scope, "outbox", "k", {"n": 1, "big": 2**70, "f": 1e-07}, expected_version=0)
    await kv.put(scope, "outbox", "k", {"n": 2, "big": 2**70, "f": 1e-07}, expected_version=1)
    stored = await kv.get(scope, "outbox", "k")
    assert stored is not None and stored.version == 2
    attempts: list[tuple[str, Callable[[], Any], int]] = [
        ("create over an existing record", lambda: kv.put(scope, "outbox", "k", {"x": 1}, expected_version=0), 2),
        ("replace at an old version", lambda: kv.put(scope, "outbox", "k", {"x": 1}, expected_version=1), 2),
        ("replace at a future version", lambda: kv.put(scope, "outbox", "k", {"x": 1}, expected_version=7), 2),
        ("delete at an old version", lambda: kv.delete(scope, "outbox", "k", expected_version=1), 2),
        ("replace an absent record", lambda: kv.put(scope, "outbox", "nope", {"x": 1}, expected_version=3), 0),
        ("delete an absent record", lambda: kv.delete(scope, "outbox", "nope", expected_version=1), 0),
    ]
    for what, attempt, found in attempts:
        proxy.reset_counts()
        with pytest.raises(VersionConflict) as caught:
            await attempt()
        counted = proxy.reset_counts()
        assert counted.round_trips == 1, f"{what}: {counted.round_trips} round trips, expected 1 ({counted})"
        conflict = caught.value
        assert conflict.found == found, what
        if found:
            assert conflict.current == stored, f"{what}: current {conflict.current!r}, stored {stored!r}"
        else:
            assert conflict.current is None, what
    assert await kv.get(scope, "outbox", "k") == stored  # nothing changed
    with pytest.raises(VersionConflict) as caught:
        await kv.put(scope, "outbox", "k", {"x": 1}, expected_version=1)
    assert caught.value.current is not None
    caught.value.current.value["n"] = "mutated"  # the caller's own copy
    assert await kv.get(scope, "outbox", "k") == stored


@spec("REPL-1", "BACK-2", "BACK-3", "BACK-7")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_concurrent_cas_on_one_key_one_winner_and_each_loser_sees_it(backend: str) -> None:
    """12 writers at once on 12 connections, same expected version, for a create and
    then for a replace: exactly one wins, and every loser's conflict reports the
    winner's record (version and value) — also when the loser's statement snapshot was
    taken before the winner committed (PostgreSQL then reads again)."""
    n = 12
    if backend == "postgres":
        prefix = f"rt_{uuid.uuid4().hex[:8]}_"
        kvs: list[DurableKv] = [PostgresKv(connection_string=PG_URL, table_prefix=prefix, min_size=1, max_size=1)
                                for _ in range(n)]
    else:
        prefix = f"rt{uuid.uuid4().hex[:8]}"
        kvs = [RedisKv(url=REDIS_URL, prefix=prefix) for _ in range(n)]
    for kv in kvs:
        await kv.open()
    try:
        for round_ in range(5):
            key = f"k{round_}"
            for expected in (0, 1):
                async def write(i: int, expected: int = expected, key: str = key) -> VersionConflict | None:
                    try:
                        await kvs[i].put("s", "inbox", key, {"writer": i, "expected": expected}, expected_version=expected)
                    except VersionConflict as exc:
                        return exc
                    return None

                outcomes = await asyncio.gather(*(write(i) for i in range(n)))
                winners = [i for i, o in enumerate(outcomes) if o is None]
                assert len(winners) == 1, f"round {round_}, expected {expected}: winners {winners}"
                stored = await kvs[0].get("s", "inbox", key)
                assert stored is not None and stored.value == {"writer": winners[0], "expected": expected}
                for i, outcome in enumerate(outcomes):
                    if outcome is not None:
                        assert outcome.found == expected + 1, f"loser {i}: {outcome}"
                        assert outcome.current == stored, f"loser {i}: current {outcome.current!r}, stored {stored!r}"
    finally:
        for kv in kvs:
            await kv.close()
        await (_drop_table(prefix) if backend == "postgres" else _drop_keys(prefix))


# --------------------------------------------------------------------------------------
# a message through a bot
# --------------------------------------------------------------------------------------


def _count_kv_calls(kv: DurableKv) -> Counter[str]:
    counts: Counter[str] = Counter()
    for name in KV_OPS:
        original = getattr(kv, name)

        async def wrapper(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            counts[__name] += 1
            return await __original(*args, **kwargs)

        setattr(kv, name, wrapper)
    return counts


@contextlib.asynccontextmanager
async def counted_bot(backend: str, pool_size: int) -> AsyncIterator[tuple[Bot, MockProvider, KvDurability, CountingProxy]]:
    """A started bot replying ``ok`` to every message, its durability on ``backend``
    through a fresh counting proxy (PostgreSQL: a pool of ``pool_size`` connections), its
    sweep's background pass run once at start and not again for an hour; stopped, and
    its table / keys removed, at the end."""
    if backend == "postgres":
        proxy = CountingProxy(*_host_port(PG_URL, 5432), protocol="postgres")
        await proxy.start()
        prefix = f"rt_{uuid.uuid4().hex[:8]}_"
        durability: KvDurability = PostgresDurability(
            connection_string=proxy.url_for(PG_URL), table_prefix=prefix, min_size=pool_size, max_size=pool_size
        )
    else:
        proxy = CountingProxy(*_host_port(REDIS_URL, 6379), protocol="redis")
        await proxy.start()
        prefix = f"rt{uuid.uuid4().hex[:8]}"
        durability = RedisDurability(url=proxy.url_for(REDIS_URL), prefix=prefix)
    provider = MockProvider()
    # the sweep's first pass runs at start (in the warm-up), the next one an hour later:
    # a pass inside the counted window added its calls (4.1 per message, on a loaded machine)
    bot = Bot(provider, store=MemoryStore(), durability={"backend": durability, "poll_ms": 3_600_000})
    errors: list[Any] = []
    bot.on("error", errors.append)

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    await bot.start()
    try:
        yield bot, provider, durability, proxy
    finally:
        await bot.stop()
        await proxy.stop()
        await (_drop_table(prefix) if backend == "postgres" else _drop_keys(prefix))
    assert not errors, errors


async def _per_message(backend: str, messages: int = 20) -> tuple[float, float, Counter[str]]:
    """Round trips that ran something per message, kv calls per message and the kv calls,
    for a bot replying once per message (one chat) on ``backend`` through a proxy."""
    async with counted_bot(backend, 2) as (_, provider, durability, proxy):
        for i in range(10):  # warm-up: connections open, statements prepared, scripts loaded
            await provider.receive("chat", "hi", id=f"warm-{i}")
        calls = _count_kv_calls(durability.kv)
        proxy.reset_counts()
        for i in range(messages):
            await provider.receive("chat", "hi", id=f"msg-{i}")
        counted = proxy.reset_counts()
        kv_calls = Counter(calls)
    assert len(provider.sent) == 10 + messages
    loads = counted.commands["SCRIPT"]  # redis-py: NOSCRIPT, then SCRIPT LOAD and EVALSHA again
    return (counted.executing - 2 * loads) / messages, sum(kv_calls.values()) / messages, kv_calls


@spec("BACK-2", "BACK-3", "BACK-7")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_a_message_costs_one_round_trip_per_kv_call(backend: str) -> None:
    """Through a bot, the stores add no round trip of their own: round trips per
    message (those that ran something) = kv calls per message, writes and reads alike."""
    round_trips, kv_calls, calls = await _per_message(backend)
    assert round_trips == kv_calls, f"{backend}: {round_trips} round trips per message, {kv_calls} kv calls ({calls})"
    assert calls["put"] >= 4 * 20  # 4 journal writes per message: the count is not vacuous


@spec("BACK-2", "BACK-3", "BACK-7")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_a_message_costs_at_most_four_round_trips(backend: str) -> None:
    """Issue 16's target: at most 4 round trips per message on PostgreSQL and Redis, one
    per journal write (no read before a CAS whose version the engine knows)."""
    round_trips, _, calls = await _per_message(backend)
    assert round_trips <= 4, f"{backend}: {round_trips} round trips per message ({calls})"


@spec("BACK-2", "BACK-3", "INB-3", "OUT-7")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_an_idle_sweep_pass_is_one_round_trip(backend: str) -> None:
    """A pass of the engine's sweep that finds nothing due reads both journals' due
    indexes in ONE round trip (``DurableKv.ranges``: one statement on PostgreSQL, one
    script on Redis): an idle bot asks its server once per ``poll_ms``, not twice."""
    async with counted_bot(backend, 1) as (bot, provider, _, proxy):
        await provider.receive("chat", "hi", id="m1")  # settled records in both journals: nothing due
        runtime = bot.durability
        assert runtime is not None
        for _ in range(6):  # warm-up: the statement prepared (5th use), the script loaded
            await runtime.sweep()
        proxy.reset_counts()
        for _ in range(10):
            await runtime.sweep()
        counted = proxy.reset_counts()
    assert counted.round_trips == 10, f"{backend}: 10 idle passes took {counted.round_trips} round trips ({counted})"
    if backend == "redis":
        assert counted.commands == Counter({"EVALSHA": 10}), counted.commands
    else:
        assert counted.commands["Execute"] == 10 and counted.prepare_only == 0, counted


# --------------------------------------------------------------------------------------
# Redis: independent writes of concurrent callers share round trips (auto-pipelining)
# --------------------------------------------------------------------------------------


@spec("BACK-3", "REPL-1")
@pytest.mark.parametrize("auto_pipeline", [True, False])
async def test_concurrent_redis_calls_share_one_round_trip(auto_pipeline: bool) -> None:
    """8 puts on 8 keys (8 chats) issued at once by one RedisKv: the first goes out
    alone, the 7 issued while it is in flight as ONE pipeline — 2 round trips, 8
    EVALSHA, each with its own result (here: 7 writes and, on the key written before, a
    conflict with its record). With ``auto_pipeline=False`` they take a connection and a
    round trip each. One caller alone takes one round trip, no pipeline."""
    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with CountingProxy(*_host_port(REDIS_URL, 6379), protocol="redis") as proxy:
        kv = RedisKv(url=proxy.url_for(REDIS_URL), prefix=prefix, auto_pipeline=auto_pipeline)
        await kv.open()
        try:
            await kv.put("s", "inbox", "k3", {"before": True}, expected_version=0)
            # without pipelining: 8 connections opened here, so none is opened while counting
            await asyncio.gather(*(kv.get("s", "inbox", f"warm{j}") for j in range(8)))
            proxy.reset_counts()
            outcomes = await asyncio.gather(
                *(kv.put("s", "inbox", f"k{i}", {"chat": i}, expected_version=0) for i in range(8)),
                return_exceptions=True,
            )
            together = proxy.reset_counts()
            await kv.put("s", "inbox", "alone", {"n": 1}, expected_version=0)
            alone = proxy.reset_counts()
            stored = [await kv.get("s", "inbox", f"k{i}") for i in range(8)]
        finally:
            await kv.close()
            await _drop_keys(prefix)
    conflict = outcomes[3]
    assert isinstance(conflict, VersionConflict) and conflict.current is not None
    assert conflict.current.value == {"before": True}
    assert [o for i, o in enumerate(outcomes) if i != 3] == [1] * 7
    assert [s.value if s else None for s in stored] == [{"before": True} if i == 3 else {"chat": i} for i in range(8)]
    assert together.commands == Counter({"EVALSHA": 8})
    assert together.round_trips == (2 if auto_pipeline else 8), together
    assert (alone.round_trips, alone.commands) == (1, Counter({"EVALSHA": 1}))


@spec("BACK-3")
async def test_a_pipelined_batch_whose_reply_is_cut_fails_every_call_with_backend_unavailable() -> None:
    """The connection dropping before a batch's reply fails each of its calls with
    BackendUnavailableError — outcome unknown, as for one command: here they all landed,
    which a read by key shows (KvDurability's way to resolve it); the next calls work.
    (Of 4 puts at once, the first goes alone and is answered; the other 3 are the batch,
    cut after the server ran it.)"""
    from botmesh.core.errors import BackendUnavailableError

    prefix = f"rt{uuid.uuid4().hex[:8]}"
    async with CountingProxy(*_host_port(REDIS_URL, 6379), protocol="redis") as proxy:
        kv = RedisKv(url=proxy.url_for(REDIS_URL), prefix=prefix)
        await kv.open()
        try:
            await kv.get("s", "inbox", "warm")
            proxy.reset_counts()
            proxy.cut_after_request(b"k2")  # the batch reaches the server; its reply never comes back
            outcomes = await asyncio.gather(
                *(kv.put("s", "inbox", f"k{i}", {"i": i}, expected_version=0) for i in range(4)),
                return_exceptions=True,
            )
            cut = proxy.reset_counts()
            landed = [await kv.get("s", "inbox", f"k{i}") for i in range(4)]
            after = await kv.put("s", "inbox", "after", {"ok": True}, expected_version=0)
        finally:
            await kv.close()
            await _drop_keys(prefix)
    assert outcomes[0] == 1, outcomes
    assert all(isinstance(o, BackendUnavailableError) for o in outcomes[1:]), outcomes
    assert (cut.round_trips, cut.commands) == (2, Counter({"EVALSHA": 4})), cut
    assert [v.value if v else None for v in landed] == [{"i": i} for i in range(4)]
    assert after == 1


@spec("BACK-3")
async def test_a_pipelined_batch_reloads_scripts_the_server_lost() -> None:
    """After the server lost its script cache (a restart; here SCRIPT FLUSH on a private
    server), a command answered NOSCRIPT did not run: the script is loaded again and the
    command sent once more — each write lands exactly once. Both for a batch (6 puts
    queued behind a lone get) and for a lone put."""
    from botmesh_testkit.servers import PrivateRedis, find_redis_server

    if find_redis_server() is None:
        if ALLOW_SKIP:
            pytest.skip("redis-server not found (BOTMESH_ALLOW_SKIP_SERVICES=1)")
        pytest.fail("redis-server not found: this test needs a private server", pytrace=False)
    with PrivateRedis() as server:
        kv = RedisKv(url=server.url, prefix="rt")
        await kv.open()
        admin = aredis.Redis.from_url(server.url)
        try:
            await kv.put("s", "inbox", "k0", {"n": 0}, expected_version=0)
            await admin.script_flush()
            results = await asyncio.gather(
                kv.get("s", "inbox", "k0"),  # in flight alone: the puts queue behind it, one batch
                *(kv.put("s", "inbox", "k0", {"n": i}, expected_version=1) for i in range(1, 4)),
                *(kv.put("s", "inbox", f"k{i}", {"n": i}, expected_version=0) for i in range(1, 4)),
                return_exceptions=True,
            )
            outcomes = results[1:]
            k0 = await kv.get("s", "inbox", "k0")
            await admin.script_flush()
            alone = await kv.put("s", "inbox", "k9", {"n": 9}, expected_version=0)
        finally:
            await admin.aclose()
            await kv.close()
    assert sum(o == 2 for o in outcomes[:3]) == 1, outcomes  # one CAS winner on k0, not a replay
    assert all(isinstance(o, VersionConflict) for o in outcomes[:3] if o != 2), outcomes
    assert outcomes[3:] == [1, 1, 1], outcomes
    assert k0 is not None and k0.version == 2
    assert alone == 1


@spec("CONF-1", "BACK-3")
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_auto_pipeline_must_be_a_bool(bad: Any) -> None:
    """CONF-1: ``auto_pipeline`` other than True/False is refused naming the option."""
    from botmesh.core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        RedisDurability(url=REDIS_URL, prefix="rtconf", auto_pipeline=bad)
    assert caught.value.option == "auto_pipeline" and "auto_pipeline" in str(caught.value)
