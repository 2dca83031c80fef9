#!/usr/bin/env python3
"""Durable message throughput of the shared backends (PostgreSQL, Redis) with 1 and 8
concurrent chats, beside the raw rate of the same server measured in the same run.

What one "message" is: one inbound event fed with ``await provider.receive(chat, "hi",
id=unique)`` (``botmesh.core.testing.MockProvider``, real clock) to a bot whose only
handler does ``await ctx.reply("ok")``: one inbound journal entry and one outbox send.
With **C concurrent chats**, C asyncio tasks each feed the messages of their own chat
(``chat-0`` .. ``chat-<C-1>``), one at a time, to the same bot, all at once; the bot
serialises messages of one chat and runs different chats concurrently. msg/s = all timed
messages / the wall time from the start of the C tasks until the last one is done.
Every task first feeds ``WARMUP`` untimed messages (all chats at once, so a connection
pool has grown before the timing starts). Each repetition is a fresh bot on a fresh
backend under a fresh table prefix / key prefix; the store is a ``MemoryStore`` (as in
the service harnesses), so only the journals reach the server.

Rows:

* ``memory``           - ``durability={}`` (MemoryDurability): what the bot's code costs
  with no server (a CPU reference; no raw rate);
* ``postgres``         - ``PostgresDurability(connection_string=url, table_prefix=fresh)``
  with its own pool (default sizes: 1 to 10 connections);
* ``redis (AOF always)``   - ``RedisDurability(url=url, prefix=fresh)`` on a server with
  ``appendonly yes``, ``appendfsync always`` (what ``survives_crash`` needs);
* ``redis, unpiped``       - the ``redis`` row's server with ``RedisDurability(...,
  auto_pipeline=False)``: one connection and one round trip per kv call, as before
  issue 16 (measured right after the ``redis`` row);
* ``redis (AOF everysec)`` - the same on a second private server with ``appendfsync
  everysec`` (acknowledged writes of the last second may be lost when the server
  crashes), only with private servers.

Raw server rates, measured in the same run on the same server, interleaved with the bot
runs (per repetition and per concurrency: raw op, kv put, bot), with K connections for
the row of K concurrent chats: K tasks at once, each on its own connection, each doing 10
untimed ops and then ops one after the other until ``--raw-seconds`` (0.6 s) have
passed; rate = timed ops / wall time until the last task is done:

* PostgreSQL (a): single-row commits/s - ``INSERT INTO <prefix>raw (v) VALUES (%s)``
  of a ~300-byte text, autocommit, psycopg 3 ``AsyncConnection`` (the driver the backend
  uses), one connection per task;
* Redis (a): ``EVALSHA`` of the backend's own compare-and-set script
  (``botmesh.redis_store._lua.PUT``: create a record with a ~300-byte value and its
  ``due`` index entry), redis-py asyncio, one connection per task;
* both (b): ``put(..., expected_version=0, due=...)`` of the backend's own kv
  (``PostgresKv`` / ``RedisKv``, a fresh key each time) called directly in a loop: the
  server op plus the kv's Python (encoding, pool, error mapping).

Writes per message: a separate short run per backend and concurrency, the backend
wrapped in ``botmesh_testkit.crash.crashable``: ``len(history)`` minus ``provider.send``
and the sweep's ``inbox.purge``/``outbox.purge`` calls (once per sweep pass, not per
message; counted apart), divided by the messages. The same run counts the kv calls that
reached the server (``get``/``put``/``delete``/``range``/``scan``, and CAS conflicts) per
message: kv puts + deletes are the server commits one message costs. In that run the
backend reaches its server through ``botmesh_testkit.servers.roundtrips.CountingProxy``,
which counts on the wire the **server round trips per message** (requests sent while
none was outstanding on the connection; psycopg's one-off server-side prepares left
out): what the message really costs in network turns, reads included (issue 16).

Client CPU: the CPU time of this process (``time.process_time()``: the bot, the kv and
the driver; the servers are other processes) during each timed part, divided by its wall
time. Near 100%, the client's single Python thread is the bottleneck, not the server.

Servers: by default private throw-away servers from ``botmesh_testkit.services``
(``PrivatePostgres()``: ``fsync=on``; ``PrivateRedis()``: AOF ``always``, plus
``PrivateRedis(appendfsync="everysec")``), started and deleted by this script; or the
servers given by ``--postgres-url`` / ``--redis-url``. Nothing is written outside fresh
names ``bmbench_<random>_<n>_*`` (tables) / ``bmbench_<random>_<n>:*`` (keys), and they
are dropped after each run and again at the end.

Usage::

    python benchmarks/shared_backends.py [--messages N] [--json PATH]

Needs botmesh with its extras (``pip install -e '.[dev]'``: psycopg, psycopg-pool,
redis-py), and ``postgres``/``initdb`` and ``redis-server`` binaries for private servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import platform
import secrets
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from botmesh.core import Bot, MemoryStore
from botmesh.core.errors import VersionConflict
from botmesh.core.testing import MockProvider
from botmesh_testkit.crash import PROVIDER_SEND, crashable
from botmesh_testkit.servers.roundtrips import CountingProxy, RoundTripCounts

import _against

PURGE_OPS = ("inbox.purge", "outbox.purge")
KV_OPS = ("get", "put", "delete", "range", "scan")
WARMUP = 10  # untimed messages per chat before the timed ones (all chats at once)
RAW_VALUE = "v" * 300  # payload of a raw PostgreSQL row
RAW_RECORD = {"text": "x" * 280, "n": 1}  # value of a raw kv/EVALSHA record (~300 bytes of JSON)
DUE = 4_102_444_800_000.0  # a due score in ms (year 2100): every raw record has an index entry


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def rates(runs: list[tuple[int, float]]) -> tuple[float, float, list[float]]:
    per = [n / s for n, s in runs]
    return max(per), statistics.median(per), per


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align, strict=True)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def cpu_probe() -> float:
    """Milliseconds of CPU time for a fixed pure-Python loop (2 million additions), best
    of 3: how fast this machine runs Python right now, to compare runs taken at different
    moments on a shared VM."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        x = 0
        for i in range(2_000_000):
            x += i
        best = min(best, time.process_time() - t0)
    return best * 1e3


def count_kv_calls(kv: Any) -> Counter[str]:
    """Count the calls of ``kv``'s DurableKv methods (and the CAS conflicts) from now on,
    by wrapping them on the instance (``KvDurability`` calls ``self.kv.put`` ...)."""
    counts: Counter[str] = Counter()
    for name in KV_OPS:
        original = getattr(kv, name)

        async def wrapper(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            counts[__name] += 1
            try:
                return await __original(*args, **kwargs)
            except VersionConflict:
                counts[f"{__name} conflict"] += 1
                raise

        setattr(kv, name, wrapper)
    return counts


# --------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------


class Server:
    """A server under test: makes backends under fresh prefixes, measures its raw rate,
    and drops everything it created."""

    key = ""
    label = ""
    raw_label = ""

    def __init__(self, url: str, origin: str) -> None:
        self.url = url
        self.origin = origin  # "private ..." or "given URL"
        self.token = secrets.token_hex(3)
        self.used: list[str] = []
        self.info: dict[str, Any] = {}

    def fresh_prefix(self) -> str:
        raise NotImplementedError

    def backend(self, prefix: str, url: str | None = None) -> Any:
        """A fresh backend under ``prefix`` (through ``url`` when given: the counting proxy)."""
        raise NotImplementedError

    async def describe(self) -> None:
        raise NotImplementedError

    async def raw(self, prefix: str, conns: int, seconds: float) -> tuple[int, float, float]:
        raise NotImplementedError

    async def kv_puts(self, prefix: str, conns: int, seconds: float) -> tuple[int, float, float]:
        raise NotImplementedError

    async def drop(self, prefix: str) -> None:
        raise NotImplementedError

    async def drop_all(self) -> None:
        for prefix in list(self.used):
            with contextlib.suppress(Exception):
                await self.drop(prefix)


async def _timed_loops(
    op: Callable[[int, int], Awaitable[None]], conns: int, seconds: float
) -> tuple[int, float, float]:
    """Run ``conns`` tasks at once, task ``i`` calling ``await op(i, j)`` for j = 0, 1, ...
    ten untimed times, then until ``seconds`` have passed; returns (timed ops, wall time
    from the start of the timed part until the last task is done, CPU time of this
    process meanwhile)."""

    async def warm(i: int) -> None:
        for j in range(10):
            await op(i, j)

    await asyncio.gather(*(warm(i) for i in range(conns)))
    done = [0] * conns
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def loop(i: int) -> None:
        j = 10
        while time.perf_counter() < deadline:
            await op(i, j)
            j += 1
        done[i] = j - 10

    await asyncio.gather(*(loop(i) for i in range(conns)))
    return sum(done), time.perf_counter() - t0, time.process_time() - cpu0


class PostgresServer(Server):
    key = "postgres"
    raw_label = "(a) INSERT commit"

    def __init__(self, url: str, origin: str) -> None:
        super().__init__(url, origin)
        self.label = "postgres"

    def fresh_prefix(self) -> str:
        prefix = f"bmbench_{self.token}_{len(self.used)}_"
        self.used.append(prefix)
        return prefix

    def backend(self, prefix: str, url: str | None = None) -> Any:
        from botmesh.postgres_store import PostgresDurability

        return PostgresDurability(connection_string=url or self.url, table_prefix=prefix)

    async def _admin(self) -> Any:
        import psycopg

        return await psycopg.AsyncConnection.connect(self.url, autocommit=True, connect_timeout=10)

    async def describe(self) -> None:
        conn = await self._admin()
        try:
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method", "commit_delay",
                         "shared_buffers", "max_connections"):
                cur = await conn.execute(f"SHOW {name}")
                row = await cur.fetchone()
                self.info[name] = None if row is None else row[0]
            cur = await conn.execute("SELECT current_schema()")
            row = await cur.fetchone()
            self.info["schema"] = None if row is None else row[0]
        finally:
            await conn.close()

    def settings_text(self) -> str:
        i = self.info
        return (f"PostgreSQL {i.get('server_version')} ({self.origin}): fsync={i.get('fsync')}, "
                f"synchronous_commit={i.get('synchronous_commit')}, wal_sync_method={i.get('wal_sync_method')}, "
                f"commit_delay={i.get('commit_delay')}, shared_buffers={i.get('shared_buffers')}, "
                f"schema {i.get('schema')}")

    async def raw(self, prefix: str, conns: int, seconds: float) -> tuple[int, float, float]:
        import psycopg
        from psycopg import sql

        table_id = sql.Identifier(f"{prefix}raw")
        admin = await self._admin()
        try:
            await admin.execute(sql.SQL("CREATE TABLE {} (id bigserial PRIMARY KEY, v text NOT NULL)").format(table_id))
            connections = [await psycopg.AsyncConnection.connect(self.url, autocommit=True, connect_timeout=10)
                           for _ in range(conns)]
            try:
                insert = sql.SQL("INSERT INTO {} (v) VALUES (%s)").format(table_id)

                async def op(i: int, j: int) -> None:
                    await connections[i].execute(insert, (RAW_VALUE,))  # autocommit: one commit each

                result = await _timed_loops(op, conns, seconds)
            finally:
                for conn in connections:
                    await conn.close()
            await admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table_id))
        finally:
            await admin.close()
        return result

    async def kv_puts(self, prefix: str, conns: int, seconds: float) -> tuple[int, float, float]:
        from botmesh.postgres_store import PostgresKv

        kv = PostgresKv(connection_string=self.url, table_prefix=prefix)
        await kv.open()
        try:
            async def op(i: int, j: int) -> None:
                await kv.put(f"raw-{i}", "raw", f"k{j}", RAW_RECORD, expected_version=0, due=DUE)

            result = await _timed_loops(op, conns, seconds)  # its warm-up lets the pool grow
        finally:
            await kv.close()
        await self.drop(prefix)
        return result

    async def drop(self, prefix: str) -> None:
        from psycopg import sql

        admin = await self._admin()
        try:
            for suffix in ("durable", "raw"):
                await admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(f"{prefix}{suffix}")))
        finally:
            await admin.close()


class RedisServer(Server):
    raw_label = "(a) EVALSHA put script"

    def __init__(self, url: str, origin: str, key: str, *, auto_pipeline: bool = True) -> None:
        super().__init__(url, origin)
        self.key = key
        self.auto_pipeline = auto_pipeline
        # only said when off: a botmesh older than issue 16 has no such option (--against runs)
        self.options: dict[str, Any] = {} if auto_pipeline else {"auto_pipeline": False}

    def fresh_prefix(self) -> str:
        prefix = f"bmbench_{self.token}_{len(self.used)}"
        self.used.append(prefix)
        return prefix

    def backend(self, prefix: str, url: str | None = None) -> Any:
        from botmesh.redis_store import RedisDurability

        return RedisDurability(url=url or self.url, prefix=prefix, **self.options)

    def _client(self) -> Any:
        import redis.asyncio

        return redis.asyncio.Redis.from_url(self.url, socket_timeout=30)

    async def describe(self) -> None:
        client = self._client()
        try:
            info = await client.info("server")
            self.info["redis_version"] = info.get("redis_version")
            try:
                config = await client.config_get("append*")
                self.info["appendonly"] = config.get("appendonly")
                self.info["appendfsync"] = config.get("appendfsync")
            except Exception as exc:  # CONFIG may be disabled on a given server
                self.info["appendfsync"] = f"? ({one_line(exc, 60)})"
        finally:
            await client.aclose()
        aof = self.info.get("appendfsync") if self.info.get("appendonly") in ("yes", None) else "off"
        self.label = f"redis (AOF {aof})" if self.info.get("appendonly") != "no" else "redis (no AOF)"
        if not self.auto_pipeline:
            self.label += ", unpiped"

    def settings_text(self) -> str:
        i = self.info
        return (f"Redis {i.get('redis_version')} ({self.origin}): appendonly={i.get('appendonly')}, "
                f"appendfsync={i.get('appendfsync')}")

    async def raw(self, prefix: str, conns: int, seconds: float) -> tuple[int, float, float]:
        from botmesh.redis_store import scope_keys
        from botmesh.redis_store._lua import PUT as _PUT_LUA

        client = self._client()
        value = json.dumps(RAW_RECORD, separators=(",", ":"))
        try:
            sha = await client.script_load(_PUT_LUA)

            keys = []
            for i in range(conns):
                k = scope_keys(prefix, f"raw-{i}", "raw")
                keys.append([k["records"], k["due"], k["expires"], k["keys"]])

            async def op(i: int, j: int) -> None:
                ok, _ = await client.evalsha(sha, 4, *keys[i], f"k{j}", "0", value, repr(DUE), "")
                if not ok:
                    raise RuntimeError("raw EVALSHA: unexpected version conflict")

            result = await _timed_loops(op, conns, seconds)  # its warm-up opens one connection per task
        finally:
            await client.aclose()
        await self.drop(prefix)
        return result

    async def kv_puts(self, prefix: str, conns: int, seconds: float) -> tuple[int, float, float]:
        from botmesh.redis_store import RedisKv

        kv = RedisKv(url=self.url, prefix=prefix, **self.options)
        await kv.open()
        try:
            async def op(i: int, j: int) -> None:
                await kv.put(f"raw-{i}", "raw", f"k{j}", RAW_RECORD, expected_version=0, due=DUE)

            result = await _timed_loops(op, conns, seconds)
        finally:
            await kv.close()
        await self.drop(prefix)
        return result

    async def drop(self, prefix: str) -> None:
        escaped = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in prefix)
        client = self._client()
        try:
            keys = [k async for k in client.scan_iter(match=f"{escaped}:*", count=1000)]
            for start in range(0, len(keys), 500):
                await client.delete(*keys[start:start + 500])
        finally:
            await client.aclose()


# --------------------------------------------------------------------------------------
# bot runs
# --------------------------------------------------------------------------------------


@dataclass
class BotRun:
    seconds: float
    messages: int
    cpu: float  # CPU time of this process (bot, drivers) during the timed part
    pool_size: int | None = None
    history: list[str] | None = None
    kv_calls: dict[str, int] | None = None
    round_trips: RoundTripCounts | None = None


async def run_bot(
    backend: Any, chats: int, per_chat: int, *, count: bool, tag: str, proxy: CountingProxy | None = None
) -> BotRun:
    """Start a bot on ``backend`` (None: ``durability={}``), feed ``WARMUP`` then
    ``per_chat`` timed messages to each of ``chats`` chats concurrently, stop it."""
    kv_counts = count_kv_calls(backend.kv) if count and backend is not None else None
    wrapped = crashable(backend) if count and backend is not None else backend
    provider = MockProvider()
    bot = Bot(provider, store=MemoryStore(), durability={} if wrapped is None else {"backend": wrapped})
    errors: list[Any] = []
    bot.on("error", errors.append)

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    chat_ids = [f"chat-{c}" for c in range(chats)]

    async def feed(chat: str, n: int, kind: str) -> None:
        for i in range(n):
            await provider.receive(chat, "hi", id=f"{tag}{kind}-{chat}-{i}")

    await bot.start()
    try:
        await asyncio.gather(*(feed(c, WARMUP, "warm") for c in chat_ids))
        history_start = len(wrapped.history) if count and wrapped is not None else 0
        kv_start = Counter(kv_counts) if kv_counts is not None else None
        if proxy is not None:
            proxy.reset_counts()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(feed(c, per_chat, "msg") for c in chat_ids))
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        round_trips = None if proxy is None else proxy.counts.snapshot()
        total = chats * (WARMUP + per_chat)
        if errors:
            raise RuntimeError(f"the bot reported errors: {errors[:3]!r}")
        if len(provider.sent) != total:
            raise RuntimeError(f"{len(provider.sent)} replies for {total} messages")
        pool_size = None
        pool = getattr(getattr(backend, "kv", None), "_pool", None)  # PostgresKv's pool
        if pool is not None and hasattr(pool, "get_stats"):
            pool_size = pool.get_stats().get("pool_size")
        history = None
        if count and wrapped is not None:
            history = [op for op in wrapped.history[history_start:] if op != PROVIDER_SEND]
        kv_calls = None
        if kv_counts is not None and kv_start is not None:
            kv_calls = dict(kv_counts - kv_start)
    finally:
        await bot.stop()
    return BotRun(seconds, chats * per_chat, cpu, pool_size, history, kv_calls, round_trips)


# --------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    label: str
    server: Server | None
    skipped: str | None = None
    bot: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # chats -> runs
    raw: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # conns -> runs
    kv: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    pool: dict[int, list[int | None]] = field(default_factory=dict)
    cpu: dict[str, dict[int, list[float]]] = field(default_factory=lambda: {"bot": {}, "raw": {}, "kv": {}})
    counts: dict[int, dict[str, Any]] = field(default_factory=dict)


def summarize_counts(run: BotRun) -> dict[str, Any]:
    assert run.history is not None
    per_op = Counter(run.history)
    purges = sum(per_op.pop(op, 0) for op in PURGE_OPS)
    journal = sum(per_op.values())
    kv = run.kv_calls or {}
    n = run.messages
    return {
        "messages": n,
        "history": len(run.history),
        "journal_writes": journal,
        "purge_calls": purges,
        "writes_per_msg": journal / n,
        "per_op": {op: k / n for op, k in sorted(per_op.items())},
        "kv_calls": kv,
        "kv_writes_per_msg": (kv.get("put", 0) + kv.get("delete", 0)) / n,
        "kv_reads_per_msg": (kv.get("get", 0) + kv.get("range", 0) + kv.get("scan", 0)) / n,
        "kv_per_op_per_msg": {op: kv.get(op, 0) / n for op in KV_OPS},
        "kv_conflicts": sum(v for k, v in kv.items() if k.endswith("conflict")),
        "round_trips_per_msg": None if run.round_trips is None else run.round_trips.executing / n,
        "prepare_only_round_trips": None if run.round_trips is None else run.round_trips.prepare_only,
        "server_commands": None if run.round_trips is None else dict(run.round_trips.commands),
    }


async def start_servers(args: argparse.Namespace, wanted: list[str], closers: list[Any],
                        rows: list[Row], out: Any) -> None:
    from botmesh_testkit import servers as services

    if "postgres" in wanted:
        row = Row("postgres", "postgres", None)
        rows.append(row)
        try:
            import botmesh.postgres_store  # noqa: F401

            if args.postgres_url:
                server: Server = PostgresServer(args.postgres_url, "given URL")
            else:
                pg = services.PrivatePostgres()
                closers.append(pg.close)
                await asyncio.to_thread(pg.start)
                server = PostgresServer(pg.url, "private, botmesh_testkit.servers.PrivatePostgres")
            await server.describe()
            row.server, row.label = server, server.label
        except Exception as exc:
            row.skipped = one_line(exc)
    redis_variants = []
    if "redis" in wanted:
        redis_variants.append(("redis", "always"))
    if "redis-everysec" in wanted:
        redis_variants.append(("redis-everysec", "everysec"))
    for key, fsync in redis_variants:
        row = Row(key, f"redis (AOF {fsync})", None)
        rows.append(row)
        try:
            import botmesh.redis_store  # noqa: F401

            if args.redis_url:
                if key == "redis-everysec":
                    row.skipped = "only with a private server (a given server's configuration is not changed)"
                    continue
                server = RedisServer(args.redis_url, "given URL", key)
            else:
                rs = services.PrivateRedis(appendfsync=fsync)
                closers.append(rs.close)
                await asyncio.to_thread(rs.start)
                server = RedisServer(rs.url, f"private, botmesh_testkit.servers.PrivateRedis(appendfsync={fsync!r})",
                                     key)
            await server.describe()
            row.server, row.label = server, server.label
        except Exception as exc:
            row.skipped = one_line(exc)
        if key == "redis" and "redis-unpiped" in wanted:
            unpiped = Row("redis-unpiped", "redis, unpiped", None)
            rows.append(unpiped)
            if row.server is None:
                unpiped.skipped = "needs the redis row's server"
                continue
            unpiped.server = RedisServer(row.server.url, row.server.origin, "redis-unpiped", auto_pipeline=False)
            await unpiped.server.describe()
            unpiped.label = unpiped.server.label
    if "redis-unpiped" in wanted and "redis" not in wanted:
        rows.append(Row("redis-unpiped", "redis, unpiped", None, skipped="needs the redis row (--only redis redis-unpiped)"))
    for row in rows:
        if row.skipped:
            print(f"  {row.key:<15} skipped: {row.skipped}", file=out)
        elif row.server is not None:
            print(f"  server {row.key:<15} {row.server.settings_text()}", file=out)
    out.flush()


async def measure(row: Row, args: argparse.Namespace, out: Any) -> None:
    server = row.server
    for rep in range(args.repeat):
        for chats in args.chats:
            per_chat = max(1, args.messages // chats)
            if server is not None:
                for part, measure_op in (("raw", server.raw), ("kv", server.kv_puts)):
                    n, secs, cpu = await measure_op(server.fresh_prefix(), chats, args.raw_seconds)
                    getattr(row, part).setdefault(chats, []).append((n, secs))
                    row.cpu[part].setdefault(chats, []).append(cpu / secs)
                prefix = server.fresh_prefix()
                try:
                    res = await run_bot(server.backend(prefix), chats, per_chat, count=False, tag=f"r{rep}-")
                finally:
                    await server.drop(prefix)
            else:
                res = await run_bot(None, chats, per_chat, count=False, tag=f"r{rep}-")
            row.bot.setdefault(chats, []).append((res.messages, res.seconds))
            row.cpu["bot"].setdefault(chats, []).append(res.cpu / res.seconds)
            row.pool.setdefault(chats, []).append(res.pool_size)
    for chats in args.chats:
        per_chat = max(1, args.count_messages // chats)
        if server is not None:
            prefix = server.fresh_prefix()
            target = urlsplit(server.url)
            proxy = CountingProxy(target.hostname or "127.0.0.1", target.port or (5432 if server.key == "postgres" else 6379),
                                  protocol="postgres" if server.key == "postgres" else "redis")
            await proxy.start()
            try:
                res = await run_bot(server.backend(prefix, proxy.url_for(server.url)), chats, per_chat, count=True,
                                    tag="count-", proxy=proxy)
            finally:
                await proxy.stop()
                await server.drop(prefix)
        else:
            from botmesh.core import MemoryDurability

            res = await run_bot(MemoryDurability(), chats, per_chat, count=True, tag="count-")
        row.counts[chats] = summarize_counts(res)
    parts = []
    for chats in args.chats:
        best = rates(row.bot[chats])[0]
        text = f"{chats} chat{'s' if chats > 1 else ''} {fmt_rate(best)} msg/s"
        if row.raw:
            text += f" (raw {fmt_rate(rates(row.raw[chats])[0])}/s)"
        parts.append(text)
    print(f"  ran {row.label:<22} best: {', '.join(parts)}", file=out)
    out.flush()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = sys.stdout
    now = _dt.datetime.now().astimezone()
    versions = {}
    for mod in ("psycopg", "psycopg_pool", "redis"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    machine = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "drivers": versions,
        "load_start": loadavg(),
        "cpu_probe_ms": cpu_probe(),
    }
    print("botmesh shared backends: durable throughput with concurrent chats", file=out)
    print("=================================================================", file=out)
    print("One message = one inbound event (provider.receive, real clock) + one reply (handler: await", file=out)
    print("ctx.reply('ok')); C chats = C tasks feeding their own chat at once to one bot. Raw server rates", file=out)
    print("measured in the same run on the same server, with as many connections as chats.", file=out)
    print(f"date:     {now.isoformat(timespec='seconds')}", file=out)
    print(f"machine:  {machine['platform']}, {machine['cpu_count']} CPUs, {machine['python']}, "
          f"psycopg {versions['psycopg']}, psycopg-pool {versions['psycopg_pool']}, redis-py {versions['redis']}",
          file=out)
    print(f"load:     {machine['load_start']} (1, 5, 15 min) at the start; CPU probe "
          f"{machine['cpu_probe_ms']:.0f} ms (2M-iteration Python loop, best of 3; lower is faster)", file=out)
    chats_text = " and ".join(str(c) for c in args.chats)
    print(f"method:   best of {args.repeat} repetitions (median also shown); {chats_text} concurrent chats; "
          f"{args.messages} timed messages per repetition in all (split evenly over the chats) after "
          f"{WARMUP} untimed warm-up messages per chat; fresh bot and table/key prefix per repetition; "
          f"raw rates: {args.raw_seconds} s of ops per repetition on as many connections as chats, after 10 "
          f"warm-up ops each; writes/msg from a crashable run of {args.count_messages} messages per concurrency",
          file=out)
    print(file=out)
    out.flush()

    results: dict[str, Any] = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine,
        "method": f"best of {args.repeat}",
        "params": {"messages": args.messages, "chats": args.chats, "repeat": args.repeat, "warmup_per_chat": WARMUP,
                   "raw_seconds": args.raw_seconds, "count_messages": args.count_messages},
        "servers": {},
        "rows": {},
    }
    started = time.perf_counter()
    closers: list[Any] = []
    rows: list[Row] = []
    wanted = args.only or ["memory", "postgres", "redis", "redis-unpiped", "redis-everysec"]
    try:
        if "memory" in wanted:
            rows.append(Row("memory", "memory (no server)", None))
        await start_servers(args, wanted, closers, rows, out)
        for row in rows:
            if row.skipped:
                continue
            try:
                await measure(row, args, out)
            except Exception as exc:
                row.skipped = f"failed: {one_line(exc)}"
                print(f"  {row.key:<15} {row.skipped}", file=out)
            finally:
                if row.server is not None:
                    await row.server.drop_all()
    finally:
        for row in rows:
            if row.server is not None:
                with contextlib.suppress(Exception):
                    await row.server.drop_all()
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(close)
    total = time.perf_counter() - started
    machine["load_end"] = loadavg()

    # -- report -----------------------------------------------------------------------
    lines: list[list[str]] = []
    raw_lines: list[list[str]] = []
    count_lines: list[list[str]] = []
    for row in rows:
        if row.server is not None:
            results["servers"][row.key] = {"url_origin": row.server.origin, **row.server.info}
        if row.skipped or not row.bot:
            results["rows"][row.key] = {"label": row.label, "skipped": row.skipped}
            continue
        entry: dict[str, Any] = {"label": row.label, "by_chats": {}}
        one = rates(row.bot[args.chats[0]])[0]
        for chats in args.chats:
            best, med, per = rates(row.bot[chats])
            c = row.counts.get(chats)
            r: dict[str, Any] = {"messages": row.bot[chats][0][0], "best": best, "median": med, "all": per,
                                 "us_per_msg": 1e6 / best, "scaling_vs_first": best / one,
                                 "pool_size": row.pool.get(chats), "counts": c,
                                 "client_cpu_share_median": statistics.median(row.cpu["bot"][chats])}
            if row.raw:
                rb, rm, rp = rates(row.raw[chats])
                kb, km, kp = rates(row.kv[chats])
                r.update(raw={"label": row.server.raw_label if row.server else "", "ops": [n for n, _ in row.raw[chats]],
                              "best": rb, "median": rm, "all": rp},
                         kv_put={"ops": [n for n, _ in row.kv[chats]], "best": kb, "median": km, "all": kp})
                r["raw"]["client_cpu_share_median"] = statistics.median(row.cpu["raw"][chats])
                r["kv_put"]["client_cpu_share_median"] = statistics.median(row.cpu["kv"][chats])
                r["ratio"] = best / rb
                if c:
                    r["server_writes_per_msg"] = c["kv_writes_per_msg"]
                    r["medium_share"] = r["ratio"] * c["kv_writes_per_msg"]
                    r["kv_share"] = best * c["kv_writes_per_msg"] / kb
                raw_lines.append([row.label, str(chats), r["raw"]["label"], fmt_rate(rb), fmt_rate(rm),
                                  fmt_rate(kb), fmt_rate(km), f"{rb / rates(row.raw[args.chats[0]])[0]:.2f}x",
                                  f"{r['raw']['client_cpu_share_median']:.0%} / "
                                  f"{r['kv_put']['client_cpu_share_median']:.0%}",
                                  f"{sum(r['raw']['ops'])} / {sum(r['kv_put']['ops'])}"])
            entry["by_chats"][str(chats)] = r
            lines.append([
                row.label if chats == args.chats[0] else "",
                str(chats),
                fmt_rate(best),
                fmt_rate(med),
                f"{1e6 / best:,.0f}",
                f"{best / one:.2f}x",
                f"{r['client_cpu_share_median']:.0%}",
                f"{c['writes_per_msg']:.2f}" if c else "-",
                fmt_rate(r["raw"]["best"]) if "raw" in r else "-",
                f"{r['ratio']:.3f}" if "ratio" in r else "-",
                f"{r['server_writes_per_msg']:.1f}" if "server_writes_per_msg" in r else "-",
                f"{r['medium_share']:.0%}" if "medium_share" in r else "-",
                fmt_rate(r["kv_put"]["best"]) if "kv_put" in r else "-",
                f"{r['kv_share']:.0%}" if "kv_share" in r else "-",
            ])
            if c:
                per_op = ", ".join(f"{op} {v:.2f}" for op, v in c["per_op"].items())
                kvs = c["kv_per_op_per_msg"]
                count_lines.append([
                    row.label if chats == args.chats[0] else "", str(chats), str(c["messages"]),
                    f"{c['writes_per_msg']:.2f}", str(c["purge_calls"]),
                    f"{kvs['put']:.2f} / {kvs['delete']:.2f}",
                    f"{kvs['get']:.2f} / {kvs['range']:.2f} / {kvs['scan']:.2f}",
                    str(c["kv_conflicts"]),
                    "-" if c["round_trips_per_msg"] is None else f"{c['round_trips_per_msg']:.2f}",
                    per_op,
                ])
        results["rows"][row.key] = entry

    print(file=out)
    print("Throughput (msg/s = messages per second in all chats, one inbound + one reply each)", file=out)
    if lines:
        print(table(["backend", "chats", "msg/s best", "median", "us/msg", "vs 1 chat", "client CPU", "writes/msg",
                     "raw ops/s", "ratio", "ops/msg", "medium share", "kv put/s", "kv share"], lines,
                    "lrrrrrrrrrrrrr"), file=out)
    for row in rows:
        if row.skipped:
            print(f"{row.key}: skipped: {row.skipped}", file=out)
    print(file=out)
    if raw_lines:
        print(f"Raw server rates (best of {args.repeat}; median), as many connections/tasks as chats", file=out)
        print(table(["server", "conns", "raw op", "ops/s best", "median", "kv put/s best", "median",
                     "raw vs 1 conn", "client CPU (raw / kv)", "timed ops in all (raw / kv)"], raw_lines,
                    "lrlrrrrrrl"), file=out)
        print(file=out)
    if count_lines:
        print(f"Writes per message (crashable history, {args.count_messages} messages per concurrency after "
              f"{WARMUP} warm-up per chat; sweep purges apart) and kv calls per message", file=out)
        print(table(["backend", "chats", "msgs", "journal writes/msg", "purge calls", "kv put / delete",
                     "kv get / range / scan", "CAS conflicts", "round trips/msg", "journal per op (per msg)"],
                    count_lines, "lrrrrrrrrl"), file=out)
        print("round trips/msg: requests the kv sent while none was outstanding on its connection, counted on the",
              file=out)
        print("wire by botmesh_testkit.servers.roundtrips.CountingProxy (psycopg's one-off server-side prepares left",
              file=out)
        print("out); a pipeline of N commands is one round trip.", file=out)
        print(file=out)
    pools = {row.label: row.pool for row in rows if row.key == "postgres" and row.pool}
    for label, by in pools.items():
        text = ", ".join(f"{c} chats: {sorted({p for p in v if p is not None})}" for c, v in by.items())
        print(f"Note: {label} pool size after the timed run (connections): {text}", file=out)
    print("Columns: vs 1 chat = msg/s / msg/s with 1 chat. client CPU = CPU time of this process (the bot and",
          file=out)
    print("the drivers; the servers are other processes) / wall time of the timed part, median: near 100% the",
          file=out)
    print("client's one Python thread is the bottleneck. writes/msg = journal writes per message (crashable).",
          file=out)
    print("raw ops/s = best raw server rate with as many connections as chats ((a) in the raw table). ratio =",
          file=out)
    print("msg/s / raw ops/s. ops/msg = server writes one message needs (kv put + delete calls per message).", file=out)
    print("medium share = ratio x ops/msg = fraction of the wall time the raw server ops alone would take;", file=out)
    print("near 100% the server is the bottleneck, far below it the time goes to the client code. kv share =", file=out)
    print("the same with the kv's own put rate ((b), the server op + the kv's Python) instead of the raw op.", file=out)
    print(f"Total time {total:.1f} s; load average at the end {machine['load_end']}.", file=out)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=240,
                   help="timed messages per repetition in all, split evenly over the chats (default 240)")
    p.add_argument("--chats", type=int, nargs="+", default=[1, 8],
                   help="concurrencies to measure; the first is the reference of 'vs 1 chat' (default 1 8)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; the best is reported (default 3)")
    p.add_argument("--raw-seconds", type=float, default=0.6,
                   help="duration of each timed raw measurement (raw op, kv put) per repetition (default 0.6)")
    p.add_argument("--count-messages", type=int, default=96,
                   help="messages of the crashable run counting writes, per concurrency (default 96)")
    p.add_argument("--postgres-url", metavar="URL",
                   help="use this PostgreSQL server (tables bmbench_<random>_* in its default schema, dropped "
                        "after) instead of a private one")
    p.add_argument("--redis-url", metavar="URL",
                   help="use this Redis server (keys bmbench_<random>_*:*, deleted after) instead of private ones; "
                        "the 'redis-everysec' row is then skipped")
    p.add_argument("--only", nargs="*", choices=["memory", "postgres", "redis", "redis-unpiped", "redis-everysec"],
                   help="run only these rows")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    _against.add_options(p)
    args = p.parse_args(argv)
    if args.raw_seconds <= 0:
        p.error("--raw-seconds must be > 0")
    for name in ("messages", "repeat", "count_messages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(c < 1 for c in args.chats):
        p.error("--chats must be >= 1")
    return args


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: per row and chats msg/s, x first, round trips/msg, shares."""
    out: dict[str, Any] = {}
    for key, entry in results["rows"].items():
        if "skipped" in entry:
            out[f"{key}: msg/s"] = f"skipped: {str(entry['skipped'])[:60]}"
            continue
        for chats, r in entry["by_chats"].items():
            name = f"{key}, {chats} chat{'s' if chats != '1' else ''}"
            out[f"{name}: msg/s best"] = r["best"]
            if r.get("scaling_vs_first") is not None and r["scaling_vs_first"] != 1.0:
                out[f"{name}: x first concurrency"] = r["scaling_vs_first"]
            c = r.get("counts") or {}
            if c.get("round_trips_per_msg") is not None:
                out[f"{name}: round trips/msg"] = c["round_trips_per_msg"]
            if "medium_share" in r:
                out[f"{name}: % of the raw server"] = 100 * r["medium_share"]
            if "raw" in r:
                out[f"{name}: raw ops/s best"] = r["raw"]["best"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    results = asyncio.run(main_async(args))
    _against.emit(args, figures(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
