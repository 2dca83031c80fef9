"""Server faults (issue 4, "Server faults"): a running bot on the PostgreSQL and Redis
backends while the *server* misbehaves — killed with SIGKILL and restarted, or reached
through :class:`botmesh_testkit.faultproxy.FaultProxy` (latency, connection reset,
blackhole, "outcome unknown").

Every test uses private servers of its module (:class:`PrivatePostgres`,
:class:`PrivateRedis` with AOF ``appendfsync always``), never the shared ones on
:5432 / :6379. A test works in a table / key prefix of its own.

The channel side is played by :class:`Channel`: it feeds inbound messages to the bot
through :class:`~botmesh.core.testing.MockProvider` and counts a message as
*acknowledged* only when ``provider.deliver`` returned True — False when the bot could not
journal it (checked against its ``error`` event with ``stage="inbox.journal"``, INB-8),
where a webhook answers with an error status — and the channel redelivers every
message it has no acknowledgement for, until all are acknowledged.

What every run checks (``_verify``), after draining (every inbound record ``done``, every
outbox record ``sent`` or ``unknown``, polled with a deadline):

* no acknowledged inbound is lost: each has a record in state ``done`` (INB-2, INB-3);
* each reply (key ``<inbound id>:<n>``) reached the channel exactly once, except keys
  reported by ``durability:ambiguous`` (OUT-14, GUAR-3): with ``on_ambiguous="skip"`` such
  a key is never duplicated (it may be missing, its record ``unknown``), with
  ``"resend"`` it is never missing (it may be duplicated);
* nothing the bot never meant to send reached the channel, nothing went to the DLQ.

Counts (fed, acknowledged, delivered, duplicates, ambiguous, lost, backend errors
logged) and the time taken are printed (``pytest -s``) and put in assertion messages.

Tests: ``test_kill9_postgres_mid_run`` / ``test_kill9_redis_mid_run`` (three cases each:
one reply with ``on_ambiguous="skip"``, two replies with ``"resend"``, two replies with
``"skip"`` and the bot process restarted too); through the proxy
``test_proxy_latency_exactly_once``, ``test_proxy_connection_reset_mid_run``,
``test_proxy_blackhole_then_heal``, ``test_proxy_outcome_unknown_never_double_sends``
(each for both backends); and ``test_reply_failing_on_the_backend_is_not_lost``: a send
that fails on the backend before it is journaled leaves the inbound record to be
retried (INB-2), not completed — an engine bug these tests found, now fixed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest

from botmesh.core import Bot
from botmesh.core.backend import DurabilityBackend
from botmesh.core.clock import RealClock
from botmesh.core.errors import BackendUnavailableError
from botmesh.core.store import MemoryStore
from botmesh.core.testing import MockProvider
from botmesh_testkit.servers.faultproxy import FaultProxy
from botmesh_testkit.servers import (
    PrivatePostgres,
    PrivateRedis,
    ServerStartError,
    find_postgres_bindir,
    find_redis_server,
    skips_allowed,
)

KILL_SPEC = ("GUAR-1", "GUAR-2", "GUAR-3", "GUAR-4", "OUT-14", "INB-2", "INB-3", "INB-4", "INB-8")

# Short real-time timings: leases expire and retries happen within the test's budget.
LEASE_MS = 400
POLL_MS = 50
PG_POOL_TIMEOUT_S = 1.0  # how long a call waits for a connection while the server is down
PG_QUERY_TIMEOUT_S = 1.0  # how long a call waits for an answer (query_timeout; blackhole test)
REDIS_SOCKET_TIMEOUT_S = 0.5  # Redis client timeout (blackhole test), via the URL query


# ----------------------------------------------------------------------------------------
# servers (one of each per module) and backends
# ----------------------------------------------------------------------------------------


def _missing(what: str) -> None:
    message = f"{what}: the server-fault tests need it (set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead)"
    if skips_allowed():
        pytest.skip(message)
    pytest.fail(message)


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this module (started, killed and restarted by its tests)."""
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError as exc:
        _missing(f"psycopg / psycopg-pool ({exc})")
    if find_postgres_bindir() is None:
        _missing("PostgreSQL binaries (postgres, initdb)")
    try:
        server = PrivatePostgres(workdir=None)
    except ServerStartError as exc:
        _missing(str(exc))
    with server:
        yield server


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    """A Redis server of this module, AOF with ``appendfsync always``."""
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        _missing(f"redis-py ({exc})")
    if find_redis_server() is None:
        _missing("redis-server")
    server = PrivateRedis(workdir=None, appendonly=True, appendfsync="always")
    with server:
        yield server


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def errors(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= logging.ERROR]


def _capture_logger(name: str) -> tuple[logging.Logger, _Captured]:
    """A logger of the test's own (not propagated: the run stays readable) and what it got."""
    logger = logging.getLogger(f"botmesh.test_server_faults.{name}")
    logger.handlers.clear()
    captured = _Captured()
    logger.addHandler(captured)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return logger, captured


def _with_query(url: str, **params: Any) -> str:
    sep = "&" if urlsplit(url).query else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in params.items())


@dataclass
class Target:
    """Which backend a test runs on, and how to build one for a server URL."""

    kind: str  # "postgres" | "redis"
    url: str  # the server (or the proxy in front of it)
    logger: logging.Logger
    captured: _Captured
    namespace: str = field(default_factory=lambda: f"sf{secrets.token_hex(4)}")
    pool_max: int = 4

    def make(self) -> DurabilityBackend:
        if self.kind == "postgres":
            from botmesh.postgres_store import PostgresDurability

            return PostgresDurability(
                connection_string=self.url, table_prefix=f"{self.namespace}_", logger=self.logger,
                timeout=PG_POOL_TIMEOUT_S, query_timeout=PG_QUERY_TIMEOUT_S, min_size=1, max_size=self.pool_max,
            )
        from botmesh.redis_store import RedisDurability

        return RedisDurability(
            url=_with_query(self.url, socket_timeout=REDIS_SOCKET_TIMEOUT_S, socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S),
            prefix=self.namespace, logger=self.logger,
        )


def _target(kind: str, server: PrivatePostgres | PrivateRedis, *, via: FaultProxy | None = None, name: str = "") -> Target:
    server.start()  # a no-op while it runs; brings it back after a test that failed while it was down
    url = server.url if via is None else via.url_for(server.url)
    logger, captured = _capture_logger(f"{kind}.{name or secrets.token_hex(3)}")
    return Target(kind, url, logger, captured)



# ----------------------------------------------------------------------------------------
# the channel and the bot
# ----------------------------------------------------------------------------------------


async def _eventually(cond: Callable[[], bool], timeout: float, what: str, *, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


class Channel:
    """The channel and the bot(s) behind it: feeds messages, keeps what was
    acknowledged, redelivers the rest; restarts the bot process on demand."""

    def __init__(self, target: Target, *, replies: int, on_ambiguous: str, instance_id: str = "sf-bot",
                 lease_ms: float = LEASE_MS, poll_ms: float = POLL_MS) -> None:
        self.target = target
        self.poll_ms = poll_ms
        self.before_reply: Callable[[Any, int], None] | None = None  # called in the handler before reply n
        self.replies = replies
        self.on_ambiguous = on_ambiguous
        self.instance_id = instance_id
        self.lease_ms = lease_ms
        self.provider = MockProvider()
        self.store = MemoryStore()
        self.bot: Bot | None = None
        self.bots: list[Bot] = []
        self.errors: list[dict[str, Any]] = []
        self.ambiguous: list[dict[str, Any]] = []
        self.dead: list[dict[str, Any]] = []
        self.journal_failed: set[str] = set()
        self.messages: dict[str, tuple[str, str]] = {}  # id -> (chat, text), every message ever fed
        self.acked: set[str] = set()
        self.unacked: dict[str, tuple[str, str]] = {}
        self.fed = 0
        self.nacks = 0
        self.receive_raised = 0
        self.started = time.monotonic()

    # -- the bot ----------------------------------------------------------------------
    async def start_bot(self) -> Bot:
        bot = Bot(
            self.provider,
            self.store,
            durability={
                "backend": self.target.make(),
                "instance_id": self.instance_id,
                "inbox": {"lease_ms": self.lease_ms, "max_attempts": 20,
                          "backoff": {"base_ms": 20, "cap_ms": 200, "jitter": 0.2}},
                "outbox": {"lease_ms": self.lease_ms, "retries": 20, "inline_max_ms": 1000,
                           "backoff": {"base_ms": 20, "cap_ms": 200, "jitter": 0.2},
                           "on_ambiguous": self.on_ambiguous},
                "poll_ms": self.poll_ms,
                "retention": 0,  # keep every record: the checks read them all
            },
            clock=RealClock(),
            rng=random.Random(len(self.bots)),
        )
        replies = self.replies

        @bot.otherwise
        async def answer(ctx: Any) -> None:
            for n in range(1, replies + 1):
                if self.before_reply is not None:
                    self.before_reply(ctx, n)
                await ctx.reply(f"re{n}:{ctx.event.id}")

        bot.on("error", self._on_error)
        bot.on("durability:ambiguous", self.ambiguous.append)
        bot.on("durability:dead", self.dead.append)
        await bot.start()
        self.bot = bot
        self.bots.append(bot)
        return bot

    def _on_error(self, payload: dict[str, Any]) -> None:
        self.errors.append(payload)
        if payload.get("stage") == "inbox.journal":
            self.journal_failed.add(str(payload.get("id")))

    async def kill_bot(self) -> None:
        """The bot process dies (TEST-3): tasks cancelled, the backend's connections
        dropped without a word; whatever the server acknowledged stays."""
        bot = self.bot
        assert bot is not None and bot.durability is not None
        await bot.abandon()
        dropped = bot.durability.backend.abandon()  # type: ignore[attr-defined]
        if isinstance(dropped, asyncio.Task):
            await dropped

    async def stop(self) -> None:
        if self.bot is not None:
            try:
                await asyncio.wait_for(self.bot.stop(), 15)
            except Exception:  # noqa: BLE001 - cleanup of a test that may have failed
                await self.kill_bot()

    # -- feeding ----------------------------------------------------------------------
    async def feed(self, id: str, chat: str) -> bool:
        """Deliver one message; True when it was acknowledged."""
        text = f"hello {id}"
        self.messages[id] = (chat, text)
        self.journal_failed.discard(id)
        self.fed += 1
        try:
            ok = await self.provider.deliver(self.provider.event(chat, text, id=id))
        except Exception:  # noqa: BLE001 - the webhook failed: the channel redelivers
            self.receive_raised += 1
            ok = False
        else:
            # deliver()'s answer is what a webhook acknowledges on; it must agree with the
            # error event the bot reports for a journal write that failed (INB-8)
            assert ok == (id not in self.journal_failed), f"{id}: deliver() said {ok}, errors {self.journal_failed}"
        if ok:
            self.acked.add(id)
            self.unacked.pop(id, None)
        else:
            self.nacks += 1
            self.unacked[id] = (chat, text)
        return ok

    async def feed_chat(self, ids: list[str], chat: str, *, pace: float = 0.005) -> None:
        for id in ids:
            await self.feed(id, chat)
            await asyncio.sleep(pace)

    def feeders(self, n: int, chats: int = 3, *, prefix: str = "m", pace: float = 0.005) -> list[asyncio.Task[None]]:
        """Tasks feeding ``n`` messages over ``chats`` chats (in order within a chat)."""
        per_chat: dict[str, list[str]] = collections.defaultdict(list)
        for i in range(n):
            per_chat[f"chat-{i % chats}"].append(f"{prefix}{i:03d}")
        return [asyncio.ensure_future(self.feed_chat(ids, chat, pace=pace)) for chat, ids in per_chat.items()]

    async def redeliver_until_acked(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.unacked:
            if time.monotonic() > deadline:
                raise AssertionError(f"the bot never acknowledged {sorted(self.unacked)} ({self.summary()})")
            for id, (chat, _) in sorted(self.unacked.items()):
                await self.feed(id, chat)
            if self.unacked:
                await asyncio.sleep(0.05)

    async def until_healthy(self, timeout: float = 20.0) -> None:
        """Wait until the backend answers again (a pool reconnects with a backoff)."""
        assert self.bot is not None and self.bot.durability is not None
        d = self.bot.durability
        deadline = time.monotonic() + timeout
        while True:
            try:
                await d.inbox.list(limit=1)
                return
            except BackendUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    # -- draining and checking ---------------------------------------------------------
    async def drain(self, timeout: float = 30.0) -> tuple[list[Any], list[Any]]:
        """Wait until every inbound record is ``done`` and every outbox record ``sent``
        or ``unknown`` (or ``dead``: reported by the checks); returns both journals."""
        assert self.bot is not None and self.bot.durability is not None
        d = self.bot.durability
        deadline = time.monotonic() + timeout
        why = "nothing read yet"
        while True:
            try:
                inbox = await d.inbox.list(limit=100_000)
                outbox = await d.outbox.list(limit=100_000)
            except BackendUnavailableError as exc:
                why = f"backend unavailable: {exc}"
            else:
                states = {r.id: r.state for r in inbox}
                open_in = sorted(i for i in self.acked if states.get(i) not in ("done", "dead"))
                open_in += sorted(r.id for r in inbox if r.state not in ("done", "dead") and r.id not in self.acked)
                open_out = sorted(r.key for r in outbox if r.state not in ("sent", "unknown", "dead"))
                if not open_in and not open_out:
                    return inbox, outbox
                why = f"inbound not done: {open_in[:10]}, sends not settled: {open_out[:10]}"
            if time.monotonic() > deadline:
                raise AssertionError(f"did not settle within {timeout}s: {why} ({self.summary()})")
            await asyncio.sleep(0.05)

    def summary(self, **extra: Any) -> str:
        parts = {
            "messages": len(self.messages), "fed": self.fed, "acknowledged": len(self.acked), "nacks": self.nacks,
            "delivered": len(self.provider.sent), "ambiguous": len(self.ambiguous), **extra,
            "backend_errors_logged": len(self.target.captured.errors),
            "seconds": round(time.monotonic() - self.started, 2),
        }
        return ", ".join(f"{k}={v}" for k, v in parts.items())


@dataclass
class Verdict:
    delivered: int
    duplicates: int
    lost: int
    ambiguous_keys: set[str]
    unknown_keys: set[str]
    line: str


def _verify(ch: Channel, inbox: list[Any], outbox: list[Any], name: str, *, allow_ambiguous: bool = True) -> Verdict:
    """The checks of the module docstring; prints the counts and returns them."""
    states = {r.id: r.state for r in inbox}
    out_states = {r.key: r.state for r in outbox}
    counts = collections.Counter(ch.provider.texts())
    expected = {f"re{n}:{id}": f"{id}:{n}" for id in ch.messages for n in range(1, ch.replies + 1)}
    ambiguous_keys = {str(e["key"]) for e in ch.ambiguous}
    unknown_keys = {k for k, s in out_states.items() if s == "unknown"}
    duplicates = sum(max(0, c - 1) for c in counts.values())
    lost = [expected[t] for t in expected if counts[t] == 0]
    line = ch.summary(duplicates=duplicates, lost=len(lost), unknown=len(unknown_keys))
    print(f"\n[server-faults] {name}: {line}")

    problems: list[str] = []
    not_done = sorted(i for i in ch.acked if states.get(i) != "done")
    if not_done:
        problems.append(f"acknowledged inbound not done (INB-2/INB-3): {[(i, states.get(i)) for i in not_done[:10]]}")
    if ch.unacked:
        problems.append(f"never acknowledged: {sorted(ch.unacked)[:10]}")
    stray = sorted(t for t in counts if t not in expected)
    if stray:
        problems.append(f"sent but never asked for: {stray[:10]}")
    if ch.dead or any(s == "dead" for s in list(states.values()) + list(out_states.values())):
        problems.append(f"dead letters: events {ch.dead[:5]}, "
                        f"records {[k for k, s in {**states, **out_states}.items() if s == 'dead'][:10]}")
    for text, key in sorted(expected.items(), key=lambda kv: kv[1]):
        n = counts[text]
        if n == 1:
            continue
        if key not in ambiguous_keys or not allow_ambiguous:
            rec = next((r for r in inbox if r.id == key.rsplit(":", 1)[0]), None)
            problems.append(f"{key}: delivered {n} times and not reported ambiguous (outbox state "
                            f"{out_states.get(key)}; inbound record {rec and (rec.state, rec.attempts, rec.error)})")
        elif n > 1 and ch.on_ambiguous == "skip":
            problems.append(f"{key}: delivered {n} times although on_ambiguous='skip' (OUT-14: never duplicated)")
        elif n == 0 and ch.on_ambiguous == "resend":
            problems.append(f"{key}: never delivered although on_ambiguous='resend' (OUT-14: never lost)")
        elif n == 0 and key not in unknown_keys:
            problems.append(f"{key}: ambiguous, not delivered, and its record is {out_states.get(key)!r}, not 'unknown'")
    unexplained_unknown = sorted(unknown_keys - ambiguous_keys)
    if unexplained_unknown:
        problems.append(f"records 'unknown' without a durability:ambiguous event: {unexplained_unknown[:10]}")
    if problems:
        lost_ids = {k.split(":")[0] for k in lost}
        related = [(e.get("stage"), e.get("id"), repr(e.get("error"))[:200]) for e in ch.errors if e.get("id") in lost_ids]
        problems.append(f"errors reported for the inbound of lost replies: {related[:6]}")
    assert not problems, f"{name}: {line}\n  " + "\n  ".join(problems[:25])
    return Verdict(len(ch.provider.sent), duplicates, len(lost), ambiguous_keys, unknown_keys, line)


# ----------------------------------------------------------------------------------------
# 1, 2: kill -9 of the server in the middle of a run
# ----------------------------------------------------------------------------------------

N_KILL = 60

KILL_CASES = [
    pytest.param("once", "skip", False, id="reply-once-skip"),
    pytest.param("twice", "resend", False, id="reply-twice-resend"),
    pytest.param("twice", "skip", True, id="reply-twice-skip-bot-restarted"),
]


async def _kill_run(ch: Channel, server: PrivatePostgres | PrivateRedis, name: str, *, restart_bot: bool) -> Verdict:
    await ch.start_bot()
    feeders = ch.feeders(N_KILL)
    try:
        await _eventually(lambda: len(ch.acked) >= N_KILL // 3, 30, f"{N_KILL // 3} acknowledged messages")
        acked_at_kill = len(ch.acked)
        await asyncio.to_thread(server.kill)  # SIGKILL of the server tree, while the bot works
        await _eventually(lambda: ch.nacks >= 3 or all(f.done() for f in feeders), 30, "failing deliveries")
        nacks_while_down = ch.nacks
        await asyncio.to_thread(server.start)  # crash recovery on the same data directory
        if restart_bot:  # the bot process dies too, and a new one comes up with the same instance_id
            await ch.kill_bot()
            await ch.start_bot()
        await asyncio.gather(*feeders)
        await ch.redeliver_until_acked()
        inbox, outbox = await ch.drain()
    finally:
        for f in feeders:
            f.cancel()
        await asyncio.gather(*feeders, return_exceptions=True)
        await ch.stop()
    verdict = _verify(ch, inbox, outbox, name)
    print(f"[server-faults] {name}: acknowledged before the kill={acked_at_kill}, "
          f"deliveries refused while down={nacks_while_down}, receive raised={ch.receive_raised}")
    # the backend reported the loss of its server (BACK-2: logger.error) and recovered by
    # itself: everything after the restart went through the same backend object
    assert ch.target.captured.errors, f"{name}: no logger.error record from the backend ({verdict.line})"
    assert nacks_while_down >= 1, f"{name}: the server was down but no delivery failed ({verdict.line})"
    assert len(ch.acked) == N_KILL
    return verdict


@pytest.mark.spec("BACK-2", *KILL_SPEC)
@pytest.mark.parametrize("replies, on_ambiguous, restart_bot", KILL_CASES)
async def test_kill9_postgres_mid_run(private_pg: PrivatePostgres, replies: str, on_ambiguous: str, restart_bot: bool) -> None:
    """kill -9 of PostgreSQL while 3 chats feed 60 messages; the server restarts on its
    data directory; the pool replaces the dead connections (BACK-2) without restarting
    the bot (or with, in the last case); nothing acknowledged is lost, nothing sent twice
    outside OUT-14."""
    name = f"postgres kill -9, reply {replies}, on_ambiguous={on_ambiguous}" + (", bot restarted" if restart_bot else "")
    ch = Channel(_target("postgres", private_pg), replies=1 if replies == "once" else 2, on_ambiguous=on_ambiguous)
    (await _kill_run(ch, private_pg, name, restart_bot=restart_bot))


@pytest.mark.spec("BACK-3", *KILL_SPEC)
@pytest.mark.parametrize("replies, on_ambiguous, restart_bot", KILL_CASES)
async def test_kill9_redis_mid_run(private_redis: PrivateRedis, replies: str, on_ambiguous: str, restart_bot: bool) -> None:
    """The same with Redis (AOF ``appendfsync always``): every acknowledged write is in
    the AOF when the server dies."""
    name = f"redis kill -9, reply {replies}, on_ambiguous={on_ambiguous}" + (", bot restarted" if restart_bot else "")
    ch = Channel(_target("redis", private_redis), replies=1 if replies == "once" else 2, on_ambiguous=on_ambiguous)
    (await _kill_run(ch, private_redis, name, restart_bot=restart_bot))


# ----------------------------------------------------------------------------------------
# 3: through the fault proxy
# ----------------------------------------------------------------------------------------

BACKENDS = ["postgres", "redis"]


def _server(kind: str, request: pytest.FixtureRequest) -> PrivatePostgres | PrivateRedis:
    return request.getfixturevalue("private_pg" if kind == "postgres" else "private_redis")  # type: ignore[no-any-return]


async def _stop_proxy(proxy: FaultProxy) -> None:
    """Stop the proxy once its clients are gone (the bot was stopped first), so that no
    connection handler has to be cancelled (Python 3.11's asyncio logs that as an error)."""
    proxy.clear()
    deadline = time.monotonic() + 2.0
    while proxy.stats.connections_active > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await proxy.stop()


async def _proxy_for(server: PrivatePostgres | PrivateRedis) -> FaultProxy:
    server.start()
    return await FaultProxy(server.host, server.port, cut_reply_wait=5.0).start()


@pytest.mark.spec("BACK-2", "BACK-3", "OUT-1", "OUT-2", "INB-2")
@pytest.mark.parametrize("kind", BACKENDS)
async def test_proxy_latency_exactly_once(kind: str, request: pytest.FixtureRequest) -> None:
    """(a) +20 ms on every chunk each way: messages are processed exactly once, no
    ambiguity, no error."""
    server = _server(kind, request)
    proxy = await _proxy_for(server)
    proxy.latency(20)
    ch = Channel(_target(kind, server, via=proxy, name="latency"), replies=2, on_ambiguous="skip", lease_ms=5000)
    try:
        await ch.start_bot()
        await asyncio.gather(*ch.feeders(12, chats=3, prefix="l"))
        await ch.redeliver_until_acked()
        inbox, outbox = await ch.drain()
    finally:
        await ch.stop()
        await _stop_proxy(proxy)
    v = _verify(ch, inbox, outbox, f"{kind} via proxy, latency 20 ms", allow_ambiguous=False)
    assert ch.nacks == 0 and not ch.errors and not ch.ambiguous, v.line
    assert v.delivered == 24 and v.duplicates == 0, v.line
    assert proxy.stats.faults_fired.get("latency", 0) > 0


@pytest.mark.spec("BACK-2", "BACK-3", "OUT-14", "INB-2", "INB-3", "INB-8", "GUAR-3")
@pytest.mark.parametrize("kind", BACKENDS)
async def test_proxy_connection_reset_mid_run(kind: str, request: pytest.FixtureRequest) -> None:
    """(b) every connection reset (RST) three times during a run of 45 messages: the
    backend reports it and recovers by itself; nothing lost or sent twice outside OUT-14."""
    server = _server(kind, request)
    proxy = await _proxy_for(server)
    ch = Channel(_target(kind, server, via=proxy, name="reset"), replies=2, on_ambiguous="skip")
    n = 45
    resets = 0
    try:
        await ch.start_bot()
        feeders = ch.feeders(n, chats=3, prefix="r")
        for threshold in (n // 5, 2 * n // 5, 3 * n // 5):
            await _eventually(lambda t=threshold: len(ch.acked) + ch.nacks >= t or all(f.done() for f in feeders),
                              30, f"{threshold} deliveries")
            resets += proxy.reset()
        await asyncio.gather(*feeders)
        await ch.redeliver_until_acked()
        inbox, outbox = await ch.drain()
    finally:
        await ch.stop()
        await _stop_proxy(proxy)
    v = _verify(ch, inbox, outbox, f"{kind} via proxy, {resets} connections reset")
    assert resets >= 3, v.line
    assert ch.target.captured.errors, f"no logger.error record from the backend ({v.line})"


@pytest.mark.spec("BACK-2", "BACK-3", "INB-8", "OUT-14")
@pytest.mark.parametrize("kind", BACKENDS)
async def test_proxy_blackhole_then_heal(kind: str, request: pytest.FixtureRequest) -> None:
    """(c) a blackhole (nothing forwarded, bytes held) for a while, then healed.

    A call fails with ``BackendUnavailableError`` instead of hanging: Redis after the
    client's socket timeout (0.5 s from the URL), PostgreSQL after ``query_timeout``
    (1 s; the connection is cut and replaced) or, when no idle connection is left, after
    the pool timeout (1 s). Deliveries meanwhile are refused and redelivered; held
    commands may land late, after the client gave up (outcome unknown). After healing
    nothing is lost or sent twice outside OUT-14."""
    server = _server(kind, request)
    proxy = await _proxy_for(server)
    ch = Channel(_target(kind, server, via=proxy, name="blackhole"), replies=1, on_ambiguous="skip")
    n = 30
    limit = REDIS_SOCKET_TIMEOUT_S if kind == "redis" else min(PG_QUERY_TIMEOUT_S, PG_POOL_TIMEOUT_S)
    try:
        bot = await ch.start_bot()
        assert bot.durability is not None
        kv: Any = bot.durability.backend.kv  # type: ignore[attr-defined]
        feeders = ch.feeders(n, chats=3, prefix="b", pace=0.01)
        await _eventually(lambda: len(ch.acked) >= n // 3, 30, f"{n // 3} acknowledged messages")
        proxy.blackhole(True)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError) as failed:
            await asyncio.wait_for(kv.get(bot.durability.scope, "inbox", "b000"), 10)
        elapsed = time.monotonic() - started
        assert limit * 0.8 <= elapsed < 5, f"a read failed after {elapsed:.2f}s: {failed.value}"
        await _eventually(lambda: ch.nacks >= 2 or all(f.done() for f in feeders), 20, "refused deliveries")
        proxy.blackhole(False)
        await asyncio.gather(*feeders)
        await ch.redeliver_until_acked()
        inbox, outbox = await ch.drain()
    finally:
        proxy.clear()
        await ch.stop()
        await _stop_proxy(proxy)
    v = _verify(ch, inbox, outbox, f"{kind} via proxy, blackhole then healed")
    print(f"[server-faults] {kind} blackhole: a read failed after {elapsed:.2f}s: {failed.value}")
    assert proxy.stats.faults_fired.get("blackhole", 0) > 0, v.line
    assert ch.target.captured.errors, f"no logger.error record from the backend ({v.line})"


@contextlib.asynccontextmanager
async def _pg_kv_via_proxy(
    server: PrivatePostgres, *, query_timeout: float | None
) -> AsyncIterator[tuple[Any, FaultProxy, _Captured]]:
    """An open ``PostgresKv`` (one connection, a table prefix of its own) reaching
    ``server`` through a fault proxy, with its captured logger; closed after."""
    from botmesh.postgres_store import PostgresKv

    proxy = await _proxy_for(server)
    logger, captured = _capture_logger(f"query-timeout-{query_timeout}")
    kv = PostgresKv(
        connection_string=proxy.url_for(server.url), table_prefix=f"qt{secrets.token_hex(4)}_",
        logger=logger, min_size=1, max_size=1, timeout=5.0, query_timeout=query_timeout,
    )
    try:
        await kv.open()
        yield kv, proxy, captured
    finally:
        await kv.close()
        await _stop_proxy(proxy)


@pytest.mark.spec("BACK-2", "OUT-14")
async def test_postgres_query_timeout_cuts_an_unanswered_call(private_pg: PrivatePostgres) -> None:
    """A partitioned server (a blackhole: the bytes are held, nothing comes back) makes a
    call fail after ``query_timeout`` with ``BackendUnavailableError`` saying so — not
    hang. The connection is cut, reported to ``logger.error`` and replaced: after the
    partition heals, the next call works. The cut write's outcome is unknown; read back
    by key it is either absent or exactly what was written (never something else)."""
    async with _pg_kv_via_proxy(private_pg, query_timeout=0.5) as (kv, proxy, captured):
        assert await kv.put("s", "inbox", "k1", {"n": 1}, expected_version=0) == 1
        proxy.blackhole(True)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError) as failed:
            await asyncio.wait_for(kv.put("s", "inbox", "k2", {"n": 2}, expected_version=0), 10)
        elapsed = time.monotonic() - started
        assert "no answer from the server within query_timeout=0.5s" in str(failed.value), failed.value
        assert 0.4 <= elapsed < 3.0, f"the call failed after {elapsed:.2f}s"
        assert any("query_timeout" in r.getMessage() for r in captured.errors), [r.getMessage() for r in captured.records]
        proxy.blackhole(False)
        got = await asyncio.wait_for(kv.get("s", "inbox", "k1"), 10)  # on a new connection
        assert got is not None and got.value == {"n": 1} and got.version == 1
        k2 = await kv.get("s", "inbox", "k2")
        assert k2 is None or (k2.value == {"n": 2} and k2.version == 1), k2
        print(f"[server-faults] postgres query_timeout=0.5s: a write under a blackhole failed after {elapsed:.2f}s; "
              f"after healing it had {'landed' if k2 is not None else 'not landed'}")


@pytest.mark.spec("BACK-2")
async def test_postgres_query_timeout_none_waits_for_the_partition_to_heal(private_pg: PrivatePostgres) -> None:
    """``query_timeout=None``: no limit — a call under a blackhole is still waiting
    after 1.5 s (three times the limit the test above cuts at), and completes once the
    partition heals (nothing cut, nothing logged)."""
    async with _pg_kv_via_proxy(private_pg, query_timeout=None) as (kv, proxy, captured):
        proxy.blackhole(True)
        call = asyncio.ensure_future(kv.put("s", "inbox", "k", {"n": 1}, expected_version=0))
        done, _ = await asyncio.wait({call}, timeout=1.5)
        assert not done, f"the call ended under a blackhole without a query_timeout: {call}"
        proxy.blackhole(False)
        assert await asyncio.wait_for(call, 10) == 1
        assert not captured.errors, [r.getMessage() for r in captured.errors]


class _CutAndPartition(FaultProxy):
    """A proxy whose ``cut_after_request`` also partitions the client from the server at
    the moment the cut fires (every other connection reset, new ones refused until
    :meth:`heal`): the client cannot even read the record back to learn the outcome."""

    partition_on_cut = False

    def _doom_client(self, link: Any) -> None:
        super()._doom_client(link)
        if self.partition_on_cut:
            self.partition_on_cut = False
            self.refuse(True)
            self.reset()

    def heal(self) -> None:
        self.refuse(False)


SENT_MARK = b'"state":"sent"'


@pytest.mark.spec("OUT-1", "OUT-2", "OUT-14", "GUAR-3", "GUAR-4", "INB-3", "BACK-2", "BACK-3")
@pytest.mark.parametrize("kind", BACKENDS)
async def test_proxy_outcome_unknown_never_double_sends(kind: str, request: pytest.FixtureRequest) -> None:
    """(d) "outcome unknown": the write that records ``sent`` reaches the server and
    commits, then the client's connection is reset before it reads the answer.

    Round 1 (8 messages): the backend reads the record back by key
    (``KvDurability._landed``), finds the write landed, carries on: one delivery each, no
    ambiguity. Round 2 (2 messages): at the cut the client is also partitioned from the
    server, so the read-back fails too; the handler's reply fails, the inbound record stays
    leased; once healed, the sweep takes it over and the handler runs again — its reply
    is answered from the outbox (OUT-2), never sent again. The channel gets every message
    exactly once."""
    server = _server(kind, request)
    server.start()
    proxy = await _CutAndPartition(server.host, server.port, cut_reply_wait=5.0).start()
    target = _target(kind, server, via=proxy, name="cut")
    target.pool_max = 1  # one connection: a partition leaves the backend no other way to the server
    ch = Channel(target, replies=1, on_ambiguous="resend")  # resend: a mistaken ambiguity would show as a duplicate
    resolved_by_readback = 0
    try:
        await ch.start_bot()
        for i in range(8):
            await ch.until_healthy()
            fired_before = proxy.stats.faults_fired.get("cut_after_request", 0)
            proxy.cut_after_request(SENT_MARK)
            if await ch.feed(f"u{i:03d}", "chat-u"):
                resolved_by_readback += 1  # no error anywhere: the read-back found the write landed
            assert proxy.stats.faults_fired.get("cut_after_request", 0) == fired_before + 1, f"u{i:03d}: no cut"
        # Normally all 8; one may miss when the replacement connection takes longer than the
        # pool timeout on a loaded machine (then the sweep finishes the message, as in round 2).
        assert resolved_by_readback >= 4, f"only {resolved_by_readback}/8 cuts resolved by reading back ({ch.errors[:3]})"
        await ch.redeliver_until_acked()
        for i in range(2):
            id = f"p{i:03d}"
            await ch.until_healthy()  # the previous partition is over for the backend too
            proxy.partition_on_cut = True
            proxy.cut_after_request(SENT_MARK)
            await ch.feed(id, "chat-p")
            proxy.heal()
            assert not proxy.partition_on_cut, f"{id}: the cut did not fire ({ch.summary()}; {ch.errors[-3:]})"
        await ch.redeliver_until_acked()
        inbox, outbox = await ch.drain()
    finally:
        proxy.clear()
        proxy.heal()
        await ch.stop()
        await _stop_proxy(proxy)
    fired = proxy.stats.faults_fired.get("cut_after_request", 0)
    v = _verify(ch, inbox, outbox, f"{kind} via proxy, outcome unknown on 'sent' ({fired} cuts)", allow_ambiguous=False)
    counts = collections.Counter(ch.provider.texts())
    assert all(c == 1 for c in counts.values()) and len(counts) == 10, f"{v.line}: {counts}"
    assert fired == 10, v.line
    assert not ch.ambiguous, f"an ambiguity was reported although every outcome could be read back: {ch.ambiguous}"
    assert ch.target.captured.errors, f"no logger.error record from the backend ({v.line})"
    stages = collections.Counter(str(e.get("stage")) for e in ch.errors)
    print(f"[server-faults] {kind} outcome unknown: {resolved_by_readback}/8 cuts resolved by reading back, "
          f"2 by the sweep; errors by stage {dict(stages)}; metrics "
          f"{ {k: v for k, v in (ch.bot.durability.metrics() if ch.bot and ch.bot.durability else {}).items() if v} }")


@pytest.mark.spec("INB-2", "INB-6", "INB-9", "OUT-2")
@pytest.mark.parametrize("kind", BACKENDS)
async def test_reply_failing_on_the_backend_is_not_lost(kind: str, request: pytest.FixtureRequest) -> None:
    """A send failing on the journal, made deterministic: inside
    the handler, the backend's next two answers are cut (the server closes the
    connection): the journal write of the reply, and the read that would tell whether
    it landed, so ``ctx.reply`` raises ``BackendUnavailableError`` — the reply may or
    may not be journaled (here it was, in state ``sending``: a record whose provider call
    nobody can rule out after the fact, so ``on_ambiguous="resend"``: under ``skip`` it
    would be reported ambiguous, OUT-14, and never sent); the next call (the completion
    of the inbound record) works. INB-2 says the
    record is ``done`` only when every send it made is recorded in the outbox, so the
    record must be processed again (INB-9: handlers are at-least-once) and the reply
    delivered — once. The sweep is driven by hand (``poll_ms`` 60 s) so that the cut
    cannot hit anything else."""
    server = _server(kind, request)
    proxy = await _proxy_for(server)
    ch = Channel(_target(kind, server, via=proxy, name="inb6"), replies=1, on_ambiguous="resend", poll_ms=60_000)
    cuts: list[str] = []

    def cut_once(ctx: Any, n: int) -> None:
        if not cuts:
            cuts.append(ctx.event.id)
            proxy.cut_reply_after(0, times=2)

    ch.before_reply = cut_once
    try:
        bot = await ch.start_bot()
        assert bot.durability is not None
        await ch.until_healthy()
        await asyncio.sleep(0.1)  # the first sweep (at start) is over: nothing else talks to the server
        acked = await ch.feed("x000", "chat-x")
        assert cuts == ["x000"] and proxy.stats.faults_fired.get("cut_reply") == 2, (cuts, proxy.stats)
        assert [e["stage"] for e in ch.errors] == ["handler"], ch.errors
        deadline = time.monotonic() + 2 * LEASE_MS / 1000 + 1
        while not ch.provider.sent and time.monotonic() < deadline:
            try:
                await bot.durability.sweep()  # what the sweep loop would do, LEASE_MS apart or sooner
            except BackendUnavailableError:
                pass
            await asyncio.sleep(0.05)
        record = await bot.durability.inbox.get("x000")
        reply = await bot.durability.outbox.get("x000:1")
    finally:
        await ch.stop()
        await _stop_proxy(proxy)
    line = ch.summary()
    print(f"\n[server-faults] {kind}, reply failing on the backend: acknowledged={acked}, inbound record "
          f"{record.state if record else None}, outbox record {reply.state if reply else None}, {line}")
    if not ch.provider.sent:
        raise AssertionError(f"INB-2: the reply was never sent ({line})")
    assert ch.provider.texts() == ["re1:x000"], f"the reply was sent more than once ({line})"

