"""Tests of ``botmesh.redis_store`` (``RedisKv``, ``RedisDurability``) and of the testkit's
``RedisHarness``, against a real Redis server.

Server: ``BOTMESH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). When it does not
answer, every test here FAILS (CI must run them) unless ``BOTMESH_ALLOW_SKIP_SERVICES=1``,
which turns that into a skip. Every test works under a fresh random prefix
(``t<uuid8>``) and deletes that prefix's keys when it ends, so runs and xdist workers
sharing one server never meet.

Spec ids: BACK-7 (the shipped DurableKv conformance suite), BACK-3 (key layout, one
scope's journal in one cluster slot, no store keys), SCOPE-2 (scopes isolated, scopes
with ``{`` ``}`` ``:`` included), REPL-1/REPL-4 (server-side CAS, shared backend),
LEASE-3 (per-boot instance id suffix on a shared backend), TEST-3 (restart recovery with
the harness), OUT-14 (ambiguity after a death inside a send).

The Redis Cluster tests start a private 3-node cluster from the local ``redis-server``
and ``redis-cli`` binaries in a temp dir on free ports (about a second); the same
fail/skip rule applies when they cannot be started.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

ALLOW_SKIP = os.environ.get("BOTMESH_ALLOW_SKIP_SERVICES") == "1"

try:
    import redis
except ImportError:  # pragma: no cover - depends on the environment
    if ALLOW_SKIP:
        pytest.skip("redis-py is not installed (BOTMESH_ALLOW_SKIP_SERVICES=1)", allow_module_level=True)
    raise

from botmesh.core.bot import Bot
from botmesh.core.errors import BackendUnavailableError, ConfigError, JournalCorruptError, VersionConflict
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import Capabilities, Versioned
from botmesh.core.records import InboxRecord
from botmesh.core.store import MemoryStore
from botmesh.core.testing import MockProvider
from botmesh.redis_store import RedisDurability, RedisKv, client_retries, key_pattern, scope_keys
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from botmesh_testkit.conformance.durability import HarnessFactory, MultiProcessTests
from botmesh_testkit.conformance.kv import DurableKvConformance, KvFactory
from botmesh_testkit.backends.redis import RedisHarness, prefix_for
from botmesh_testkit.crash import World

URL = os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0")
spec = pytest.mark.spec


# --------------------------------------------------------------------------------------
# the server, prefixes and cleanup
# --------------------------------------------------------------------------------------


def _unavailable(reason: str) -> None:
    """Fail (CI must run these tests) or, with BOTMESH_ALLOW_SKIP_SERVICES=1, skip."""
    if ALLOW_SKIP:
        pytest.skip(f"{reason} (BOTMESH_ALLOW_SKIP_SERVICES=1)")
    pytest.fail(f"{reason}; set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead", pytrace=False)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The server's URL, after checking that it answers."""
    client = redis.Redis.from_url(URL, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        _unavailable(f"no Redis server answers at {URL} (BOTMESH_REDIS_URL): {exc}")
    finally:
        client.close()
    return URL


def _delete_matching(client: redis.Redis, pattern: str, *, batch: int = 500) -> int:
    """Delete the keys matching ``pattern`` (``batch=1`` on a cluster node: one
    ``DEL`` may not span slots)."""
    deleted = 0
    keys = list(client.scan_iter(match=pattern, count=500))
    for i in range(0, len(keys), batch):
        deleted += int(client.delete(*keys[i : i + batch]))
    return deleted


def _keys_matching(client: redis.Redis, pattern: str) -> list[bytes]:
    return sorted(client.scan_iter(match=pattern, count=500))


@pytest.fixture
def sync_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(sync_client: redis.Redis) -> Iterator[str]:
    """A fresh random prefix ``t<uuid8>``; its keys are deleted when the test ends."""
    value = f"t{uuid.uuid4().hex[:8]}"
    yield value
    _delete_matching(sync_client, f"{value}:*")


def _no_retry_client(url: str) -> AsyncRedis:
    return AsyncRedis.from_url(url, retry=Retry(NoBackoff(), 0), retry_on_error=[])


# --------------------------------------------------------------------------------------
# BACK-7: the shipped conformance suite
# --------------------------------------------------------------------------------------


class TestRedisKvConformance(DurableKvConformance):
    """The DurableKv conformance suite against ``RedisKv(url=...)`` (a standalone
    server)."""

    @pytest.fixture
    def kv_factory(self, redis_url: str, prefix: str) -> KvFactory:
        return lambda: RedisKv(url=redis_url, prefix=prefix)


class TestRedisMultiProcess(MultiProcessTests):
    """The durability suite's several-processes tests (REPL-1, REPL-4): real processes,
    each with a RedisDurability of its own under the test's prefix, journal and claim the
    same records at once (the kv suite above has its CAS test across processes)."""

    @pytest.fixture
    def botmesh_harness_factory(self, redis_url: str) -> HarnessFactory:
        return lambda workdir: RedisHarness(workdir, url=redis_url)


# --------------------------------------------------------------------------------------
# BACK-3: key layout
# --------------------------------------------------------------------------------------


def _tag(key: bytes) -> bytes:
    """The Redis Cluster hash tag of ``key`` (between the first ``{`` and the first
    ``}`` after it), as the server computes it."""
    start = key.index(b"{")
    return key[start + 1 : key.index(b"}", start + 1)]


@spec("BACK-3")
async def test_keys_are_under_the_scope_hash_tag_and_one_slot_per_scope_journal(
    redis_url: str, prefix: str, sync_client: redis.Redis
) -> None:
    """BACK-3: after writes to both journals of a scope, the keys that exist are exactly
    ``<prefix>:{durable:inbox:<scope>}:...`` and ``<prefix>:{durable:outbox:<scope>}:...``,
    and all keys of one scope's journal hash to one cluster slot (so every write script
    touches one slot)."""
    kv = RedisKv(url=redis_url, prefix=prefix)
    await kv.open()
    scope = "tenant/env/bot/conn"
    try:
        for space in ("inbox", "outbox"):
            await kv.put(scope, space, "k1", {"n": 1}, expected_version=0, due=1.0, expires=2.0)
            await kv.put(scope, space, "k2", {"n": 2}, expected_version=0, due=None, expires=None)
    finally:
        await kv.close()
    keys = _keys_matching(sync_client, f"{prefix}:*")
    pattern = re.compile(
        rb"^" + re.escape(prefix.encode()) + rb":\{durable:(inbox|outbox):" + re.escape(scope.encode())
        + rb"\}:(records|due|expires|keys)$"
    )
    assert keys and all(pattern.match(k) for k in keys), f"BACK-3: keys outside the layout: {keys!r}"
    assert {pattern.match(k).group(1) for k in keys} == {b"inbox", b"outbox"}  # type: ignore[union-attr]
    for space in ("inbox", "outbox"):
        mine = [k for k in keys if f":{{durable:{space}:".encode() in k]
        assert {k.rsplit(b":", 1)[1] for k in mine} == {b"records", b"due", b"expires", b"keys"}
        assert {_tag(k) for k in mine} == {f"durable:{space}:{scope}".encode()}
        assert len({key_slot(k) for k in mine}) == 1, f"BACK-3: one journal in one slot; slots of {mine!r} differ"
        assert set(scope_keys(prefix, scope, space).values()) == set(mine)


# (U+0000 is refused in a scope by every kv, botmesh.core.inputs: U+0001 stands for the
# control characters instead)
LOOK_ALIKES = ["s", "s}", "s}:records", "{s}", "s:x", "s%7D", "s%", "s:{x}:y", "s\n", "s\x01"]


@spec("SCOPE-2", "BACK-3")
async def test_scopes_with_braces_and_colons_are_isolated_and_keep_their_hash_tag(
    redis_url: str, prefix: str, sync_client: redis.Redis
) -> None:
    """SCOPE-2, BACK-3: scopes containing ``}``, ``{``, ``:`` or ``%`` (and look-alikes of
    their encoding, such as ``s%7D`` beside ``s}``) each see only their own record,
    version and index entries; no key is shared between them; and a ``}`` in a scope can
    never end the hash tag early: every key's tag is ``durable:<space>:<encoded scope>``
    in full, one slot per scope."""
    kv = RedisKv(url=redis_url, prefix=prefix)
    await kv.open()
    try:
        for i, scope in enumerate(LOOK_ALIKES):
            for n in range(i + 1):  # scope i ends at version i + 1
                await kv.put(scope, "inbox", "k", {"scope": scope}, expected_version=n, due=float(i), expires=None)
        for i, scope in enumerate(LOOK_ALIKES):
            assert await kv.get(scope, "inbox", "k") == Versioned({"scope": scope}, i + 1)
            assert await kv.scan(scope, "inbox") == [("k", Versioned({"scope": scope}, i + 1))]
            assert await kv.range(scope, "inbox", "due", upto=float("inf"), limit=100) == [(float(i), "k")]
        await kv.delete("s}", "inbox", "k", expected_version=2)
        assert await kv.get("s", "inbox", "k") == Versioned({"scope": "s"}, 1)
        assert await kv.get("s%7D", "inbox", "k") == Versioned({"scope": "s%7D"}, 6)
        with pytest.raises(VersionConflict):
            await kv.put("s}", "inbox", "k", {}, expected_version=1)
    finally:
        await kv.close()
    layouts = {scope: set(scope_keys(prefix, scope, "inbox").values()) for scope in LOOK_ALIKES}
    for scope, keys in layouts.items():
        assert len({_tag(k) for k in keys}) == 1 and len({key_slot(k) for k in keys}) == 1
        tag = _tag(next(iter(keys)))
        assert tag.startswith(b"durable:inbox:") and b"}" not in tag and b"{" not in tag
        others = set().union(*(v for s, v in layouts.items() if s != scope))
        assert not keys & others, f"SCOPE-2: scope {scope!r} shares keys with another scope"
    stored = set(_keys_matching(sync_client, f"{prefix}:*"))
    assert stored <= set().union(*layouts.values()), "BACK-3: a key outside the layout was written"


@spec("BACK-3")
def test_spaces_with_colons_cannot_meet_other_spaces() -> None:
    """BACK-3: the space is encoded with ``:`` escaped, so space ``in:box`` with scope
    ``x`` and space ``in`` with scope ``box:x`` have different keys."""
    assert not set(scope_keys("p", "x", "in:box").values()) & set(scope_keys("p", "box:x", "in").values())


@spec("BACK-3", "SCOPE-2")
def test_the_keys_kept_per_scope_and_space_are_the_layouts_even_past_the_bound() -> None:
    """Issue 16: the Redis keys of a ``(prefix, scope, space)`` are made once and kept.
    What a kv answers is the layout's keys made without the cache for every pair,
    look-alike scopes included, also once more pairs were asked than are kept."""
    kv = RedisKv(url="redis://127.0.0.1:1/0", prefix="p")  # no call is made: no server needed
    pairs = [(scope, space) for scope in LOOK_ALIKES for space in ("inbox", "in:box", "outbox")]
    pairs += [(f"scope-{i}", "inbox") for i in range(scope_keys.cache_info().maxsize + 5)]
    for scope, space in pairs + pairs[:10]:
        made_now = scope_keys.__wrapped__("p", scope, space)  # the layout, made without the cache
        assert kv.keys_of(scope, space) == made_now, (scope, space)
    assert scope_keys.cache_info().currsize <= scope_keys.cache_info().maxsize


def test_key_pattern_matches_only_this_prefix() -> None:
    """The cleanup pattern covers the prefix's keys and not those of a longer prefix
    that starts with it; glob characters of a prefix are escaped."""
    assert key_pattern("bm1") == "bm1:{durable:*"
    assert key_pattern("a*b?[c]") == "a\\*b\\?\\[c\\]:{durable:*"


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------

BAD_PREFIXES: list[Any] = ["", "a{b", "a}b", "{x}", "a b", "a\tb", "a\nb", "a\x00b", "a\x7fb", "x" * 65, 5, None, b"bm"]


@pytest.mark.parametrize("bad", BAD_PREFIXES, ids=repr)
@pytest.mark.parametrize("cls", [RedisDurability, RedisKv])
def test_bad_prefix_is_a_config_error_naming_prefix(cls: type, bad: Any) -> None:
    """A bad ``prefix`` is refused at build time with a ConfigError naming the option
    ``prefix`` and showing the value."""
    with pytest.raises(ConfigError) as info:
        cls(url=URL, prefix=bad)
    assert info.value.option == "prefix"  # type: ignore[attr-defined]
    assert str(info.value).startswith("prefix: ") and repr(bad) in str(info.value)
    assert info.value.code == "CONFIG_INVALID"


@pytest.mark.parametrize("good", ["botmesh", "x" * 64, "bot:mesh", "app-1/prod", "é✓"])
def test_good_prefixes_are_accepted(good: str) -> None:
    assert RedisDurability(url=URL, prefix=good).prefix == good


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"url": URL, "cluster": ["127.0.0.1:7000"]}, {"url": URL, "client": "x"}],
    ids=["none", "url+cluster", "url+client"],
)
def test_exactly_one_of_client_url_cluster(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="exactly one of client=, url= or cluster="):
        RedisDurability(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"url": "http://example.com"}, "url"),
        ({"url": ""}, "url"),
        ({"cluster": []}, "cluster"),
        ({"cluster": ["no-port"]}, "cluster"),
        ({"cluster": [("h", "x")]}, "cluster"),
        ({"client": object()}, "client"),
    ],
)
def test_bad_connection_options_are_config_errors(kwargs: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisDurability(**kwargs)
    assert info.value.option == option  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("options", "extra"),
    [
        (["protocol", 2], {}),
        ({1: 2}, {}),
        ({"retry": None}, {}),
        ({"retry_on_timeout": True}, {}),
        ({"retry_on_error": []}, {}),
        ({"no_such_redis_py_option": 1}, {}),
        ({"protocol": 2}, {"client": "injected"}),
    ],
    ids=["not-a-mapping", "name-not-text", "retry", "retry_on_timeout", "retry_on_error", "unknown", "with-client"],
)
def test_bad_client_options_are_config_errors_naming_them(options: Any, extra: dict[str, Any]) -> None:
    """``client_options``: a mapping of redis-py option names; nothing that makes the
    client resend commands; only for a client the kv builds; an option redis-py does not
    take is refused when the client is built — each a ``ConfigError`` naming
    ``client_options``, nothing opened."""
    kwargs: dict[str, Any] = {"url": URL, "client_options": options}
    if extra.get("client") == "injected":
        kwargs = {"client": _no_retry_client(URL), "client_options": options}
    with pytest.raises(ConfigError) as info:
        RedisDurability(**kwargs)
    assert info.value.option == "client_options", info.value  # type: ignore[attr-defined]


async def _wire(url: str, prefix: str, harness: RedisHarness | None = None, **options: Any) -> tuple[int, Counter[str]]:
    """Round trips and commands on the wire (``CountingProxy``) of a kv's (or a
    harness's backend's) first call: one ``put`` on a new connection."""
    from botmesh.redis_store._lua import PUT
    from botmesh_testkit.servers.roundtrips import CountingProxy

    loader = redis.Redis.from_url(url)
    try:  # the script in the server's cache first: a NOSCRIPT answer would add its reload
        loader.script_load(PUT)
    finally:
        loader.close()
    parts = urlsplit(url)
    async with CountingProxy(parts.hostname or "127.0.0.1", parts.port or 6379, protocol="redis") as proxy:
        if harness is not None:
            harness.url = proxy.url_for(url)
            backend, _ = await harness.open()
            kv = backend.kv
        else:
            kv = RedisKv(url=proxy.url_for(url), prefix=prefix, **options)
        await kv.open()
        try:
            proxy.reset_counts()
            await kv.put("s", "inbox", "a", {"n": 1}, expected_version=0)  # the connection is made for it
            counts = proxy.reset_counts()
        finally:
            await kv.close()
            if harness is not None:
                harness.url = url
                await harness.close()
    return counts.round_trips, counts.commands


async def test_client_options_reach_the_client_the_kv_builds_and_the_url_wins(redis_url: str, prefix: str) -> None:
    """``client_options`` are the built client's, seen on the wire: with RESP2 and no
    ``CLIENT SETINFO`` (the testkit's lean options) a new connection's first call is its
    command alone; redis-py's defaults first send ``HELLO 3`` and the library's name and
    version (redis-py 8 also asks for maintenance notifications): three round trips or
    more; a ``protocol`` in the URL wins over the options."""
    from botmesh_testkit.backends.redis import lean_client_options

    trips, commands = await _wire(redis_url, prefix, client_options=lean_client_options())
    assert (trips, sorted(commands)) == (1, ["EVALSHA"]), (trips, commands)
    trips, commands = await _wire(redis_url, prefix + "p")
    assert commands["HELLO"] == 1 and commands["CLIENT"] >= 2 and trips >= 3, (trips, commands)
    sep = "&" if "?" in redis_url else "?"
    trips, commands = await _wire(f"{redis_url}{sep}protocol=3", prefix + "u", client_options=lean_client_options())
    assert commands["HELLO"] == 1 and trips >= 2, (trips, commands)


async def test_the_matrix_harness_connects_lean_and_the_others_as_redis_py_does(redis_url: str) -> None:
    """The crash matrix asks every cell's harness to ``reuse_storage()``: a Redis harness
    then builds its incarnations' clients with RESP2 and no ``CLIENT SETINFO`` (False:
    storage is not pooled), so a new connection's first call is one round trip; a harness
    the matrix did not ask keeps redis-py's defaults (three or more)."""
    with tempfile.TemporaryDirectory() as tmp:
        lean = RedisHarness(os.path.join(tmp, "matrix"), url=redis_url)
        assert lean.reuse_storage() is False
        assert (await _wire(redis_url, "", harness=lean))[0] == 1
        plain = RedisHarness(os.path.join(tmp, "other"), url=redis_url)
        assert (await _wire(redis_url, "", harness=plain))[0] >= 3


async def _server_lists(client: AsyncRedis, connection_id: int) -> bool:
    """Whether the server still lists the client connection ``connection_id``."""
    listed = await client.execute_command("CLIENT", "LIST", "ID", str(connection_id))
    return bool(listed)


async def _server_ended(client: AsyncRedis, connection_id: int) -> bool:
    """Whether the server, asked until it does (a closed socket reaches it a little
    later), no longer lists the client connection ``connection_id``."""
    for _ in range(200_000):
        if not await _server_lists(client, connection_id):
            return True
    return False


@spec("TEST-3", "BACK-3")
async def test_matrix_incarnations_keep_idle_connections_and_drop_the_ones_in_flight(redis_url: str) -> None:
    """In the crash matrix a Redis harness's incarnations share one client: a restart
    hands the next incarnation the connections that were idle in the pool (the same
    server session), and drops every connection the dead incarnation had checked out —
    here one blocked in ``BLPOP``: its caller fails, the server sees the session end, and
    the next incarnation never uses it. A harness the matrix did not ask gives each
    incarnation a client of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        harness = RedisHarness(os.path.join(tmp, "matrix"), url=redis_url)
        harness.reuse_storage()
        watcher = AsyncRedis.from_url(redis_url)
        try:
            first, _ = await harness.open()
            await first.start()
            await first.kv.put("s", "inbox", "a", {"n": 1}, expected_version=0)
            idle_id = await first.kv.client.client_id()  # one connection, idle in the pool again
            second, _ = await harness.reopen()
            await second.start()
            assert await second.kv.client.client_id() == idle_id  # the idle session, handed over
            assert await second.kv.get("s", "inbox", "a") == Versioned({"n": 1}, 1)

            blocked = asyncio.ensure_future(second.kv.client.blpop([f"{harness.prefix}:blocked"], timeout=60))
            waiting: list[Any] = []
            for _ in range(200_000):  # until the server lists the BLPOP waiting (nothing else blocks)
                waiting = [c for c in await watcher.client_list() if c.get("cmd") == "blpop"]
                if waiting or blocked.done():
                    break
            assert len(waiting) == 1 and not blocked.done(), (waiting, blocked)
            blocked_id = int(waiting[0]["id"])  # the session handed over, now in flight
            third, _ = await harness.reopen()
            with pytest.raises(redis.exceptions.ConnectionError):
                await asyncio.wait_for(blocked, 30)  # dropped at the restart: its reply reaches nobody
            assert await _server_ended(watcher, blocked_id)
            await third.start()
            assert await third.kv.get("s", "inbox", "a") == Versioned({"n": 1}, 1)
            third_id = await third.kv.client.client_id()
            assert third_id != blocked_id and await _server_lists(watcher, third_id)
            await harness.close()
            assert await _server_ended(watcher, third_id)  # closed with the harness
        finally:
            await watcher.aclose()
        plain = RedisHarness(os.path.join(tmp, "plain"), url=redis_url)
        one, _ = await plain.open()
        two, _ = await plain.reopen()
        assert one.kv.owns_client and two.kv.owns_client and one.kv.client is None and two.kv.client is not None
        await plain.close()


def _count_execute_command(client: AsyncRedis) -> Counter[str]:
    """Count the commands ``client`` sends through redis-py's ``execute_command``, and
    its pipelines as ``"pipeline"`` (the instance attributes shadow the methods; the
    kv's auto-pipeline looks them up per call)."""
    seen: Counter[str] = Counter()
    plain, plain_pipeline = client.execute_command, client.pipeline

    async def counted(*args: Any, **options: Any) -> Any:
        seen[str(args[0]).upper()] += 1
        return await plain(*args, **options)

    def pipeline(*args: Any, **options: Any) -> Any:
        seen["pipeline"] += 1
        return plain_pipeline(*args, **options)

    client.execute_command = counted  # type: ignore[method-assign]
    client.pipeline = pipeline  # type: ignore[method-assign]
    return seen


async def _kv_calls(kv: RedisKv) -> None:
    """One call of each kind, with their answers checked."""
    assert await kv.put("s", "inbox", "b", {"n": 2}, expected_version=0, due=5.0, expires=7.0) == 1
    assert await kv.get("s", "inbox", "b") == Versioned({"n": 2}, 1)
    assert await kv.range("s", "inbox", "due", upto=10.0, limit=10) == [(5.0, "b")]
    assert await kv.ranges("s", [("inbox", "expires"), ("outbox", "due")], upto=10.0, limit=10) == [[(7.0, "b")], []]
    assert [k for k, _ in await kv.scan("s", "inbox")] == ["a", "b"]
    await kv.delete("s", "inbox", "b", expected_version=1)
    assert await kv.get("s", "inbox", "b") is None
    together = await asyncio.gather(*(kv.get("s", "inbox", k) for k in "aab"))  # one alone, then a batch of two
    assert together == [Versioned({"n": 1}, 1), Versioned({"n": 1}, 1), None]


@spec("BACK-3", "BACK-7")
async def test_a_lone_call_of_a_kv_built_from_a_url_skips_execute_command(redis_url: str, prefix: str) -> None:
    """Issue 16: on a client the kv built from its URL, a call made while nothing else
    is in flight is sent on an idle pooled connection by hand, without redis-py's
    ``execute_command`` (its retry wrapper, locks and metrics hooks cost ~30 % of the
    client's CPU per command) — get, put, delete and the scripts of range, ranges and
    scan alike, with the same answers —, and so are the batches of calls made while
    one is in flight, instead of a redis-py pipeline. On a client the caller built,
    which the kv does not know the pool or connections of, every call takes
    ``execute_command`` and every batch a pipeline."""
    kv = RedisKv(url=redis_url, prefix=f"{prefix}:own")
    await kv.open()
    try:
        assert await kv.put("s", "inbox", "a", {"n": 1}, expected_version=0) == 1  # a first connection, now idle
        seen = _count_execute_command(kv.client)
        await _kv_calls(kv)
        assert not seen, seen
    finally:
        await kv.close()
    given = AsyncRedis.from_url(redis_url)
    try:
        other = RedisKv(client=given, prefix=f"{prefix}:given")
        await other.open()
        await other.put("s", "inbox", "a", {"n": 1}, expected_version=0)
        seen = _count_execute_command(given)
        await _kv_calls(other)
        # put, range, ranges, scan, delete; two gets, one more alone, a pipeline of two
        assert seen == Counter({"EVALSHA": 5, "HGET": 3, "pipeline": 1}), seen
        await other.close()
    finally:
        await given.aclose()


@spec("BACK-3", "BACK-7")
async def test_a_lone_call_on_a_connection_the_server_closed_reconnects(redis_url: str, prefix: str) -> None:
    """A pooled connection the server closed while it was idle (``CLIENT KILL``: an
    idle timeout, a restart) is not used for the next lone call as it is: the call is
    sent on a new connection and answers. (Through redis-py's ``execute_command`` —
    before issue 16's change, or with ``auto_pipeline=False`` — redis-py 8 with its
    RESP3 maintenance notifications sends it on the closed connection, and the call
    fails with ``BackendUnavailableError``.)"""
    kv = RedisKv(url=redis_url, prefix=prefix)
    watcher = AsyncRedis.from_url(redis_url)
    await kv.open()
    try:
        await kv.put("s", "inbox", "a", {"n": 1}, expected_version=0)
        idle_id = await kv.client.client_id()
        await watcher.client_kill_filter(_id=idle_id)
        assert await _server_ended(watcher, idle_id)
        assert await kv.get("s", "inbox", "a") == Versioned({"n": 1}, 1)
        assert await kv.client.client_id() != idle_id
    finally:
        await watcher.aclose()
        await kv.close()


@spec("BACK-3", "BACK-7")
async def test_a_lone_call_cancelled_midway_leaves_no_reply_for_the_next_one(redis_url: str, prefix: str) -> None:
    """A lone call cancelled while it waits for its reply takes its connection down with
    it: the server sees that session end (the blocked command never gets its element),
    and the next call, on another connection, reads its own reply — never the late reply
    of the cancelled one."""
    kv = RedisKv(url=redis_url, prefix=prefix)
    watcher = AsyncRedis.from_url(redis_url)
    await kv.open()
    try:
        await kv.put("s", "inbox", "a", {"n": 1}, expected_version=0)  # a first connection, now idle
        assert kv._pipeline is not None
        waits = asyncio.ensure_future(kv._pipeline.call("BZPOPMIN", f"{prefix}:wait", 60))
        waiting: list[Any] = []
        for _ in range(200_000):  # until the server lists the call blocked (no other test uses BZPOPMIN)
            waiting = [c for c in await watcher.client_list() if c.get("cmd") == "bzpopmin"]
            if waiting or waits.done():
                break
        assert len(waiting) == 1 and not waits.done(), (waiting, waits)
        waits.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waits
        assert await _server_ended(watcher, int(waiting[0]["id"]))
        await watcher.zadd(f"{prefix}:wait", {"late": 1})
        assert await kv.get("s", "inbox", "a") == Versioned({"n": 1}, 1)
        assert await watcher.zcard(f"{prefix}:wait") == 1  # nobody took it
    finally:
        await watcher.aclose()
        await kv.close()


@spec("GUAR-1", "BACK-3")
async def test_durability_settings_are_what_the_server_says(redis_url: str, sync_client: redis.Redis) -> None:
    """``CONFIG GET appendonly`` / ``appendfsync`` of the server the kv writes to, whatever
    they are (the shared server is only read); a closed kv is unavailable."""
    expected = {"kind": "redis"}
    for name in ("appendonly", "appendfsync"):
        expected.update({k: str(v) for k, v in sync_client.config_get(name).items()})
    backend = RedisDurability(url=redis_url, prefix="bmsettings")
    await backend.start()
    try:
        assert await backend.durability_settings() == expected
    finally:
        await backend.stop()
    with pytest.raises(BackendUnavailableError):
        await backend.durability_settings()


@spec("GUAR-1", "BACK-3")
async def test_a_server_that_refuses_config_leaves_the_settings_out_saying_why() -> None:
    """A server with ``CONFIG`` renamed away (as managed services do): not an outage —
    the two settings are left out and ``unreadable`` says why."""
    from botmesh_testkit.servers import PrivateRedis, find_redis_server

    if find_redis_server() is None:
        _unavailable("redis-server not found: cannot start a private server")
    with PrivateRedis(extra_args=["--rename-command", "CONFIG", ""]) as server:
        kv = RedisKv(url=server.url, prefix="bmsettings")
        await kv.open()
        try:
            settings = await kv.durability_settings()
        finally:
            await kv.close()
    assert set(settings) == {"kind", "unreadable"} and settings["kind"] == "redis"
    assert settings["unreadable"].startswith("CONFIG GET refused: ") and "CONFIG" in settings["unreadable"]


@spec("LEASE-3", "REPL-4")
def test_capabilities_are_shared_and_default_instance_ids_get_a_per_boot_suffix() -> None:
    """REPL-4, LEASE-3: the backend is shared across hosts; two bots on it without an
    explicit instance_id get distinct ids ``<hostname>/<bot_id>/<connection_id>/<suffix>``
    (the engine adds the suffix for every shared backend)."""
    backend = RedisDurability(url=URL, prefix="bmcaps")
    assert backend.capabilities == Capabilities(survives_crash=True, multi_process=True, multi_host=True, shared=True)
    a = Bot(MockProvider(), MemoryStore(), {"backend": backend}, bot_id="b", connection_id="c")
    b = Bot(MockProvider(), MemoryStore(), {"backend": RedisDurability(url=URL, prefix="bmcaps")}, bot_id="b",
            connection_id="c")
    assert a.durability is not None and b.durability is not None
    base = f"{socket.gethostname()}/b/c/"
    assert a.durability.instance_id.startswith(base) and b.durability.instance_id.startswith(base)
    assert a.durability.instance_id != b.durability.instance_id


# --------------------------------------------------------------------------------------
# client ownership
# --------------------------------------------------------------------------------------


def _named_clients(client: redis.Redis, name: str) -> int:
    return sum(1 for c in client.client_list() if c.get("name") == name)


async def _wait_for(check: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        await asyncio.sleep(0.02)
    return bool(check())


@spec("BACK-3")
async def test_own_client_is_closed_at_stop_and_rebuilt_at_start(
    redis_url: str, prefix: str, sync_client: redis.Redis
) -> None:
    """With ``url=`` the backend builds its own client and closes it at ``stop()``: its
    connections leave the server; calls then raise BackendUnavailableError; a later
    ``start()`` works again with a new client."""
    name = f"bm-own-{prefix}"
    sep = "&" if "?" in redis_url else "?"
    backend = RedisDurability(url=f"{redis_url}{sep}client_name={name}", prefix=prefix)
    assert backend.owns_client
    await backend.start()
    await backend.kv.put("s", "inbox", "k", {"n": 1}, expected_version=0)
    assert _named_clients(sync_client, name) >= 1
    await backend.stop()
    assert backend.kv.client is None
    assert await _wait_for(lambda: _named_clients(sync_client, name) == 0), "the own client was not closed at stop"
    with pytest.raises(BackendUnavailableError):
        await backend.kv.get("s", "inbox", "k")
    await backend.stop()  # idempotent
    await backend.start()
    try:
        assert await backend.kv.get("s", "inbox", "k") == Versioned({"n": 1}, 1)
    finally:
        await backend.stop()


@spec("BACK-3")
async def test_injected_client_is_left_open_at_stop(redis_url: str, prefix: str, sync_client: redis.Redis) -> None:
    """An injected client belongs to its owner: ``stop()`` leaves it connected and usable;
    only the backend's own calls are refused after ``stop()``."""
    name = f"bm-inj-{prefix}"
    client = AsyncRedis.from_url(redis_url, retry=Retry(NoBackoff(), 0), retry_on_error=[], client_name=name)
    try:
        backend = RedisDurability(client=client, prefix=prefix)
        assert not backend.owns_client and backend.kv.client is client
        await backend.start()
        await backend.kv.put("s", "inbox", "k", {"n": 1}, expected_version=0)
        await backend.stop()
        assert await client.ping() is True
        assert _named_clients(sync_client, name) >= 1, "stop() closed the injected client's connections"
        with pytest.raises(BackendUnavailableError):
            await backend.kv.get("s", "inbox", "k")
        await backend.start()
        assert await backend.kv.get("s", "inbox", "k") == Versioned({"n": 1}, 1)
        await backend.stop()
    finally:
        await client.aclose()


# --------------------------------------------------------------------------------------
# no automatic retry of a write
# --------------------------------------------------------------------------------------


class CuttingServer:
    """A TCP listener speaking just enough RESP for redis-py's connection handshake
    (``+OK`` to everything, nil to ``HGET``) that, when a script call (``EVALSHA``/``EVAL``) arrives,
    records it and closes the connection without replying: the client cannot know
    whether the write landed. ``scripts`` counts how many times one arrived. With
    ``stall``, it stops reading the connection instead (kept open) as soon as it has read
    a script call's name: a command too large for the socket buffers cannot be sent
    whole, and its sender waits for the server to take the rest."""

    def __init__(self, *, stall: bool = False) -> None:
        self.commands: list[list[bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0
        self.stall = stall
        self._closing = asyncio.Event()  # set on exit: a stalled connection ends
        self._handlers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> CuttingServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        self._closing.set()
        await asyncio.gather(*self._handlers, return_exceptions=True)  # each closed its connection

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def scripts(self) -> int:
        return sum(1 for c in self.commands if c and c[0].upper() in (b"EVALSHA", b"EVAL"))

    @staticmethod
    async def _read_arg(reader: asyncio.StreamReader) -> bytes:
        size = await reader.readline()
        return (await reader.readexactly(int(size[1:].strip()) + 2))[:-2]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                header = await reader.readline()
                if not header.startswith(b"*"):
                    break
                name = (await self._read_arg(reader)).upper()
                script = name in (b"EVALSHA", b"EVAL")
                if script and self.stall:
                    self.commands.append([name])
                    await self._closing.wait()  # reads nothing more until the server is closed
                    break
                command = [name] + [await self._read_arg(reader) for _ in range(int(header[1:].strip()) - 1)]
                self.commands.append(command)
                if script:
                    break  # it arrived; the reply never leaves
                writer.write(b"+PONG\r\n" if name == b"PING" else b"_\r\n" if name == b"HGET" else b"+OK\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


@spec("REPL-1", "BACK-7")
@pytest.mark.parametrize("op", ["put", "delete"])
async def test_a_write_cut_after_it_was_sent_is_sent_once_and_raises_unavailable(op: str, prefix: str) -> None:
    """The connection is cut after the write script reached the server: the call raises
    BackendUnavailableError and the script arrived exactly once — the client never
    resent it (a resent CAS that had landed would come back as a false conflict). A
    client that retries (the control) would have sent it 4 times."""
    async with CuttingServer() as server:
        kv = RedisKv(url=server.url, prefix=prefix)
        await kv.open()
        try:
            with pytest.raises(BackendUnavailableError) as info:
                if op == "put":
                    await kv.put("s", "inbox", "k", {"n": 1}, expected_version=0, due=1.0)
                else:
                    await kv.delete("s", "inbox", "k", expected_version=1)
            assert info.value.operation == op  # type: ignore[attr-defined]
            assert server.scripts == 1, f"the write was sent {server.scripts} times"
        finally:
            await kv.close()

    async with CuttingServer() as control:
        retrying = AsyncRedis.from_url(control.url, retry=Retry(NoBackoff(), 3))
        try:
            with pytest.raises(redis.ConnectionError):
                await retrying.evalsha("0" * 40, 0)
        finally:
            await retrying.aclose()
        assert control.scripts == 4, "control: a client with 3 retries must resend the script 3 times"


@spec("BACK-3", "BACK-7")
async def test_commands_are_sent_without_a_task_each(prefix: str) -> None:
    """The clients the kv builds from a URL send a command without the task per command
    that redis-py's own send makes when the connection has a socket timeout (issue 16,
    ``botmesh.redis_store._driver``): 20 reads and 5 writes, after the first call
    connected, create no task."""
    kv = RedisKv(url=URL, prefix=prefix)
    await kv.open()
    loop = asyncio.get_running_loop()
    made: list[object] = []
    previous = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        assert await kv.get("s", "inbox", "k") is None  # connects (and loads nothing yet)
        version = await kv.put("s", "inbox", "k", {"n": 0}, expected_version=0)  # loads the script if needed
        loop.set_task_factory(counting)
        try:
            for n in range(5):
                version = await kv.put("s", "inbox", "k", {"n": n + 1}, expected_version=version)
            for _ in range(20):
                found = await kv.get("s", "inbox", "k")
                assert found is not None and found.value == {"n": 5}
        finally:
            loop.set_task_factory(previous)
    finally:
        await kv.close()
    assert made == [], f"{len(made)} tasks for 25 commands: {made[:3]}"


@spec("BACK-3", "BACK-7")
async def test_a_command_the_server_does_not_take_times_out_as_unavailable(prefix: str) -> None:
    """A server that stops reading: a write too large to be sent at once waits for the
    socket's drain under the socket timeout and fails as ``BackendUnavailableError``
    (redis-py's ``TimeoutError`` beneath) instead of hanging; the connection is dropped."""
    async with CuttingServer(stall=True) as server:
        kv = RedisKv(url=server.url + "?socket_timeout=0.5", prefix=prefix)
        await kv.open()
        try:
            with pytest.raises(BackendUnavailableError) as info:
                await asyncio.wait_for(
                    kv.put("s", "inbox", "k", {"blob": "x" * 32_000_000}, expected_version=0), 10)
            assert isinstance(info.value.__cause__, redis.TimeoutError), repr(info.value.__cause__)
            assert server.scripts == 1
            # the stalled connection was dropped: the next call connects again and is answered
            assert await asyncio.wait_for(kv.get("s", "inbox", "k"), 10) is None
            assert server.connections == 2, f"{server.connections} connections"
        finally:
            await kv.close()


@spec("REPL-1")
async def test_kv_durability_rereads_by_key_after_an_unknown_outcome(prefix: str) -> None:
    """KvDurability's write path over RedisKv: the cut write raises
    BackendUnavailableError (the read-back by key fails as well on this server); the
    write was still sent only once."""
    async with CuttingServer() as server:
        backend = KvDurability(RedisKv(url=server.url, prefix=prefix))
        await backend.start()
        try:
            with pytest.raises(BackendUnavailableError):
                await backend.inbox_journal("s", InboxRecord(id="k", lease_until=1.0))
            assert server.scripts == 1
            assert any(c[0].upper() == b"HGET" for c in server.commands), "no read-back by key after the cut"
        finally:
            await backend.stop()


def test_injected_clients_that_retry_are_refused() -> None:
    """An injected client whose policy resends commands is refused (ConfigError naming
    ``client``); clients built from url/cluster, and injected clients built with
    ``Retry(NoBackoff(), 0)``, never retry."""
    for retrying in (
        AsyncRedis(host="127.0.0.1", port=6379),  # redis-py's default: 3 retries
        AsyncRedis(host="127.0.0.1", port=6379, retry=Retry(NoBackoff(), 1)),
        AsyncRedis(host="127.0.0.1", port=6379, retry=Retry(NoBackoff(), -1)),
    ):
        assert client_retries(retrying) != 0
        with pytest.raises(ConfigError, match="retries commands") as info:
            RedisDurability(client=retrying, prefix="bm")
        assert info.value.option == "client"  # type: ignore[attr-defined]
    ok = AsyncRedis(host="127.0.0.1", port=6379, retry=Retry(NoBackoff(), 0))
    assert RedisDurability(client=ok, prefix="bm").kv.client is ok
    own = RedisKv(url=URL, prefix="bm")
    assert own.client is not None and client_retries(own.client) == 0
    own_cluster = RedisKv(cluster=["127.0.0.1:7000"], prefix="bm")
    assert own_cluster.client is not None and client_retries(own_cluster.client) == 0


async def test_a_cancellation_swallowed_by_the_driver_is_raised_again(prefix: str) -> None:
    """redis-py's ``asyncio.wait_for`` around socket writes drops a cancellation that
    arrives as the write completes (Python 3.11); the kv raises ``CancelledError`` itself
    then, so cancelling a task blocked on it (``bot.stop()`` cancelling the sweep) always
    ends the task. Modelled with a driver call that swallows the cancellation."""
    kv = RedisKv(url=URL, prefix=prefix)
    await kv.open()
    entered = asyncio.Event()

    async def swallowing(client: Any, scripts: Any) -> str:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "swallowed"
        return "slept"

    task = asyncio.ensure_future(kv._call("get", swallowing))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    await kv.close()


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("decode", [False, True])
async def test_injected_clients_of_either_protocol_and_decoding_work(
    redis_url: str, prefix: str, protocol: int, decode: bool
) -> None:
    """An injected client may speak RESP2 or RESP3 and may decode responses: every
    operation gives the same results."""
    client = AsyncRedis.from_url(redis_url, retry=Retry(NoBackoff(), 0), retry_on_error=[], protocol=protocol,
                                 decode_responses=decode)
    kv = RedisKv(client=client, prefix=prefix)
    await kv.open()
    try:
        await kv.put("s", "inbox", "b", {"n": "é"}, expected_version=0, due=2.5, expires=None)
        await kv.put("s", "inbox", "a", {"n": 1}, expected_version=0, due=2.5, expires=1.0)
        assert await kv.get("s", "inbox", "b") == Versioned({"n": "é"}, 1)
        assert await kv.range("s", "inbox", "due", upto=float("inf"), limit=10) == [(2.5, "a"), (2.5, "b")]
        assert await kv.range("s", "inbox", "expires", upto=1.0, limit=10) == [(1.0, "a")]
        assert await kv.scan("s", "inbox", after="a") == [("b", Versioned({"n": "é"}, 1))]
        await kv.delete("s", "inbox", "a", expected_version=1)
        assert [k for k, _ in await kv.scan("s", "inbox")] == ["b"]
    finally:
        await kv.close()
        await client.aclose()


async def test_a_foreign_value_under_our_keys_is_reported_not_used(
    redis_url: str, prefix: str, sync_client: redis.Redis
) -> None:
    """A hash field that is not a record written by this backend: reads raise
    JournalCorruptError naming the Redis key and the record key; writes fail in the
    script and change nothing."""
    records = scope_keys(prefix, "s", "inbox")["records"]
    sync_client.hset(records, "k", "not json")
    sync_client.zadd(scope_keys(prefix, "s", "inbox")["keys"], {"k": 0})
    kv = RedisKv(url=redis_url, prefix=prefix)
    await kv.open()
    try:
        with pytest.raises(JournalCorruptError, match="malformed record 'k'") as info:
            await kv.get("s", "inbox", "k")
        assert info.value.redis_key == records.decode()  # type: ignore[attr-defined]
        with pytest.raises(JournalCorruptError):
            await kv.scan("s", "inbox")
        for call in (
            lambda: kv.put("s", "inbox", "k", {}, expected_version=1),
            lambda: kv.delete("s", "inbox", "k", expected_version=1),
        ):
            with pytest.raises(BackendUnavailableError, match="malformed record"):
                await call()
        assert sync_client.hget(records, "k") == b"not json"
    finally:
        await kv.close()


async def test_driver_errors_are_backend_unavailable_and_logged(prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens: every call raises BackendUnavailableError (never redis-py's
    type), naming the operation, and the error goes to the logger."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kv = RedisKv(url=f"redis://127.0.0.1:{port}/0", prefix=prefix)
    await kv.open()
    try:
        calls = {
            "get": lambda: kv.get("s", "inbox", "k"),
            "put": lambda: kv.put("s", "inbox", "k", {}, expected_version=0),
            "delete": lambda: kv.delete("s", "inbox", "k", expected_version=1),
            "range": lambda: kv.range("s", "inbox", "due", upto=1.0, limit=1),
            "scan": lambda: kv.scan("s", "inbox"),
        }
        with caplog.at_level("ERROR", logger="botmesh.redis_store"):
            for name, call in calls.items():
                with pytest.raises(BackendUnavailableError, match=f"redis {name} failed"):
                    await call()
        assert len([r for r in caplog.records if r.name == "botmesh.redis_store"]) == len(calls)
    finally:
        await kv.close()


# --------------------------------------------------------------------------------------
# a bot end to end, and the harness
# --------------------------------------------------------------------------------------


@spec("BACK-3", "INB-4", "OUT-2", "REPL-4")
async def test_bot_end_to_end_and_a_restarted_bot_sees_the_record_done(
    redis_url: str, prefix: str, sync_client: redis.Redis
) -> None:
    """A bot on RedisDurability processes a message (journaled, replied, done); a new bot
    process with the same instance_id on a new backend object with the same prefix sees
    the inbound record done and the reply sent, and takes a redelivery as a duplicate
    (nothing sent twice). The keys written are the BACK-3 layout for the bot's scope,
    and nothing else."""

    def make(provider: MockProvider) -> Bot:
        bot = Bot(provider, MemoryStore(), {"backend": RedisDurability(url=redis_url, prefix=prefix),
                                            "instance_id": "bot-1"})

        @bot.when("hi")
        async def hi(ctx: Any) -> None:
            await ctx.reply("hello!")

        return bot

    first_channel = MockProvider()
    first = make(first_channel)
    await first.start()
    try:
        await first_channel.receive("chat-1", "hi", id="wamid.1")
        assert first_channel.texts() == ["hello!"]
        assert first.durability is not None
        scope = first.durability.scope
    finally:
        await first.stop()

    keys = _keys_matching(sync_client, f"{prefix}:*")
    allowed = set(scope_keys(prefix, scope, "inbox").values()) | set(scope_keys(prefix, scope, "outbox").values())
    assert keys and set(keys) <= allowed, f"BACK-3: keys outside the layout: {set(keys) - allowed!r}"
    assert any(b"{durable:inbox:" + scope.encode() + b"}" in k for k in keys)
    assert any(b"{durable:outbox:" + scope.encode() + b"}" in k for k in keys)

    second_channel = MockProvider()
    second = make(second_channel)
    await second.start()
    try:
        assert second.durability is not None
        record = await second.durability.inbox.get("wamid.1")
        assert record is not None and record.state == "done"
        send = await second.durability.outbox.get("wamid.1:1")
        assert send is not None and send.state == "sent"
        await second_channel.receive("chat-1", "hi", id="wamid.1")
        assert second_channel.texts() == []
        assert second.durability.metrics()["inbound_duplicates"] == 1
    finally:
        await second.stop()


def test_harness_prefix_is_derived_from_the_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same workdir, same storage; another workdir, other storage; ``from_env`` reads
    BOTMESH_REDIS_URL."""
    a = RedisHarness(str(tmp_path / "a"), url=URL)
    assert a.prefix == prefix_for(str(tmp_path / "a")) == RedisHarness(str(tmp_path / "a"), url=URL).prefix
    assert a.prefix != RedisHarness(str(tmp_path / "b"), url=URL).prefix
    assert re.fullmatch(r"bm[0-9a-f]{10}", a.prefix)
    assert a.capabilities.shared and a.capabilities.survives_crash
    monkeypatch.setenv("BOTMESH_REDIS_URL", "redis://example.invalid:6380/3")
    assert RedisHarness.from_env(str(tmp_path / "a")).url == "redis://example.invalid:6380/3"
    assert RedisHarness.from_env(str(tmp_path / "a")).prefix == a.prefix


@spec("TEST-3", "OUT-14", "GUAR-3")
async def test_harness_restart_after_a_death_inside_a_send(redis_url: str, sync_client: redis.Redis) -> None:
    """The README's recovery pattern on RedisHarness: the bot dies between the channel's
    acceptance and ``outbox.mark_sent``; the restarted incarnation (same prefix, a new
    client, the old one's sockets dropped) reports the send ambiguous, sends nothing
    twice and settles the inbound record. ``close()`` deletes the prefix's keys."""
    harness = RedisHarness(tempfile.mkdtemp(prefix="botmesh-redis-"), url=redis_url)

    def setup(bot: Bot) -> None:
        @bot.when("hi")
        async def hi(ctx: Any) -> None:
            await ctx.reply("hello")

    world = World(harness, setup=setup, instance_id="i1")
    try:
        await world.start(crash=True)
        assert world.crashable is not None
        world.crashable.crash_before("outbox.mark_sent")
        await world.receive("chat-1", "hi", id="m1")
        assert world.crashed
        old = harness.backend
        await world.restart()
        assert harness.backend is not old and old.kv.client is None
        with pytest.raises(BackendUnavailableError):
            await old.kv.get("s", "inbox", "k")
        await world.drain()
        assert world.named("durability:ambiguous") == [{"key": "m1:1", "chat_id": "chat-1"}]
        assert world.channel.texts() == ["hello"]
        assert world.bot is not None and world.bot.durability is not None
        assert (await world.bot.durability.inbox.get("m1")).state == "done"  # type: ignore[union-attr]
        assert _keys_matching(sync_client, f"{harness.prefix}:*")
    finally:
        await world.close()
        shutil.rmtree(harness.workdir, ignore_errors=True)
    assert _keys_matching(sync_client, f"{harness.prefix}:*") == [], "close() left keys behind"


@spec("TEST-3")
async def test_harness_close_deletes_the_keys_with_the_last_incarnations_client(
    redis_url: str, sync_client: redis.Redis
) -> None:
    """``close()`` deletes the prefix's keys on the last incarnation's client while it is
    there (no client of its own is built), and on a client of its own when the last
    incarnation's is gone (abandoned); every key goes either way."""
    def no_client() -> Any:
        raise AssertionError("close() built a client of its own although the last incarnation's was there")

    for abandoned in (False, True):
        harness = RedisHarness(tempfile.mkdtemp(prefix="botmesh-redis-"), url=redis_url)
        try:
            backend, _ = await harness.open()
            await backend.start()
            await backend.inbox_journal("s", InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0))
            assert _keys_matching(sync_client, f"{harness.prefix}:*")
            if abandoned:
                drop = backend.kv.abandon()
                assert drop is not None
                await drop
            else:
                harness._cleaning_client = no_client  # type: ignore[method-assign]
            await harness.close()
            assert _keys_matching(sync_client, f"{harness.prefix}:*") == [], "close() left keys behind"
            assert backend.kv.client is None
        finally:
            shutil.rmtree(harness.workdir, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Redis Cluster: a private 3-node cluster from the local binaries
# --------------------------------------------------------------------------------------


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free as well."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _start_node(server: str, workdir: str, deadline: float) -> tuple[subprocess.Popen[bytes], int]:
    """Start one cluster-enabled ``redis-server`` on a free port; retried on another port
    when the chosen one was taken meanwhile (another xdist worker may be doing the same).
    The node is ours only when the server answering on the port has our process id."""
    last = "no attempt"
    for _ in range(5):
        port = _free_cluster_port()
        with open(os.path.join(workdir, f"{port}.log"), "wb") as log:
            proc = subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "5000",
                 "--dir", workdir, "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with redis.Redis(port=port, socket_connect_timeout=0.5) as probe:
                    pid = probe.info("server")["process_id"]
            except redis.RedisError:
                time.sleep(0.05)
                continue
            if pid == proc.pid:
                return proc, port
            break  # someone else's server answers on this port
        last = f"port {port}: exit code {proc.poll()}"
        proc.kill()
        proc.wait()
    raise RuntimeError(f"could not start a cluster node ({last})")


@pytest.fixture(scope="module")
def cluster_nodes() -> Iterator[list[str]]:
    """``host:port`` of a private 3-node Redis Cluster (no replicas, no persistence),
    stopped at the end of the module."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        _unavailable("redis-server / redis-cli binaries not found: cannot start a private Redis Cluster")
    assert server and cli
    workdir = tempfile.mkdtemp(prefix="botmesh-redis-cluster-")
    procs: list[subprocess.Popen[bytes]] = []
    nodes: list[str] = []
    try:
        deadline = time.monotonic() + 30
        for _ in range(3):
            proc, port = _start_node(server, workdir, deadline)
            procs.append(proc)
            nodes.append(f"127.0.0.1:{port}")
        created = subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout!r} {created.stderr!r}")
        while True:
            states = []
            for node in nodes:
                with redis.Redis(port=int(node.rsplit(":", 1)[1])) as probe:
                    states.append(probe.cluster("info").get("cluster_state"))
            if all(s == "ok" for s in states):
                break
            if time.monotonic() > deadline + 30:
                raise RuntimeError(f"the cluster did not become ok: {states!r}")
            time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001 - reported as fail/skip below
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        _unavailable(f"cannot start a private Redis Cluster: {exc}")
    try:
        yield nodes
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def cluster_prefix(cluster_nodes: list[str]) -> Iterator[str]:
    value = f"t{uuid.uuid4().hex[:8]}"
    yield value
    for node in cluster_nodes:
        host, port = node.rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port))
        try:
            _delete_matching(client, f"{value}:*", batch=1)
        finally:
            client.close()


@spec("GUAR-1", "BACK-3")
async def test_cluster_durability_settings_are_read_from_every_primary(cluster_nodes: list[str]) -> None:
    """On a Cluster every primary is asked: one value when they agree, each node's when
    they do not (one node switched to ``appendfsync always`` for the test)."""
    kv = RedisKv(cluster=cluster_nodes, prefix="bmsettings")
    await kv.open()
    host, port = cluster_nodes[0].rsplit(":", 1)
    node = redis.Redis(host=host, port=int(port))
    try:
        assert await kv.durability_settings() == {"kind": "redis", "appendonly": "no", "appendfsync": "everysec"}
        node.config_set("appendfsync", "always")
        mixed = (await kv.durability_settings())["appendfsync"]
        assert f"always on {cluster_nodes[0]}" in mixed and mixed.count("everysec on ") == 2, mixed
    finally:
        node.config_set("appendfsync", "everysec")
        node.close()
        await kv.close()


class TestRedisKvClusterConformance(DurableKvConformance):
    """The DurableKv conformance suite through ``cluster=`` on a 3-node Redis Cluster: the
    scopes of a test land in different slots (and nodes), each write script in one."""

    stateful_max_examples = 15

    @pytest.fixture
    def kv_factory(self, cluster_nodes: list[str], cluster_prefix: str) -> KvFactory:
        return lambda: RedisKv(cluster=cluster_nodes, prefix=cluster_prefix)


@spec("BACK-3", "SCOPE-2")
async def test_cluster_scopes_spread_over_nodes_and_each_journal_stays_in_one_slot(
    cluster_nodes: list[str], cluster_prefix: str
) -> None:
    """BACK-3 on a real cluster: many scopes (some with ``}``) are written through one
    ``cluster=`` backend given as a URL; they spread over every node, and each journal's
    keys are all on the node owning its slot (a script spanning slots would be refused
    with CROSSSLOT)."""
    kv = RedisKv(cluster=f"redis://{cluster_nodes[0]}", prefix=cluster_prefix)
    await kv.open()
    scopes = [f"scope-{i}" + ("}" if i % 3 == 0 else "") for i in range(24)]
    try:
        for scope in scopes:
            await kv.put(scope, "inbox", "k", {"scope": scope}, expected_version=0, due=1.0, expires=2.0)
        for scope in scopes:
            assert await kv.scan(scope, "inbox") == [("k", Versioned({"scope": scope}, 1))]
    finally:
        await kv.close()
    owners: set[str] = set()
    for scope in scopes:
        keys = list(scope_keys(cluster_prefix, scope, "inbox").values())
        assert len({key_slot(k) for k in keys}) == 1
        holders = set()
        for node in cluster_nodes:
            host, port = node.rsplit(":", 1)
            client = redis.Redis(host=host, port=int(port))
            try:
                if any(client.execute_command("CLUSTER", "COUNTKEYSINSLOT", key_slot(k)) for k in keys):
                    holders.add(node)
            finally:
                client.close()
        assert len(holders) == 1, f"scope {scope!r}: keys on {holders!r}"
        owners |= holders
    assert len(owners) == 3, f"24 scopes should reach all 3 nodes; reached {owners!r}"
