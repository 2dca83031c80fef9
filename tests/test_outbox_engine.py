"""Engine bugs of issue 12 in the outbox, each pinned by a regression test naming its id,
on every built-in backend and on the PostgreSQL and Redis servers:

* OUT-12: the keys of a split text's parts never collide with a user's keys (a user's
  ``a#2`` and the second part of ``a`` are two records);
* OUT-10: concurrent ``bot.enqueue`` calls with one key run the ``before("send")`` hooks
  once (and concurrent sends with one key call the provider once);
* OUT-9: a deferred split send's ``SendDeferredError`` carries the send's key;
* OUT-15: content JSON cannot hold (NaN, ±inf, lone surrogates, non-string keys)
  bypasses the outbox with a warning and is sent, the same on every backend.

The servers: ``BOTMESH_POSTGRES_URL`` / ``BOTMESH_REDIS_URL`` (defaults: the local
ones). When one cannot be reached its cases fail, unless
``BOTMESH_ALLOW_SKIP_SERVICES=1`` turns that into a skip (as in
``tests/test_postgres_store.py`` / ``tests/test_redis_store.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
from botmesh.core import Bot, OutboxRecord, ProviderError, SendDeferredError, SendFailedError, UnsupportedContentError
from botmesh.core.content import PART_SEPARATOR, legacy_part_key, part_key, split_text

from botmesh_testkit.backends import HARNESSES, BackendHarness
from botmesh_testkit.crash import World

ALLOW_SKIP = os.environ.get("BOTMESH_ALLOW_SKIP_SERVICES") == "1"
PG_URL = os.environ.get("BOTMESH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0")

LIMIT = 20
LONG = "The quick brown fox jumps over the lazy dog and keeps running far away."
PARTS = split_text(LONG, LIMIT)
FAST = {"base_ms": 1000, "cap_ms": 60_000, "jitter": 0}
BACKENDS = ["memory", "file", "file+log", "sqlite", "postgres", "redis"]


def _unavailable(reason: str) -> None:
    if ALLOW_SKIP:
        pytest.skip(f"{reason} (BOTMESH_ALLOW_SKIP_SERVICES=1)")
    pytest.fail(f"{reason}; set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead", pytrace=False)


def _server_harness(name: str, workdir: str) -> BackendHarness:
    if name == "postgres":
        try:
            import psycopg

            with psycopg.connect(PG_URL, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
        except Exception as exc:  # ImportError or a psycopg error
            _unavailable(f"PostgreSQL not usable at BOTMESH_POSTGRES_URL: {exc}")
        from botmesh_testkit.backends.postgres import PostgresHarness

        return PostgresHarness(workdir, url=PG_URL)
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3, socket_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        _unavailable(f"Redis not usable at BOTMESH_REDIS_URL ({REDIS_URL}): {exc}")
    from botmesh_testkit.backends.redis import RedisHarness

    return RedisHarness(workdir, url=REDIS_URL)


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[BackendHarness]:
    """Each test here runs on every built-in backend and on both servers."""
    name = request.param
    h = HARNESSES[name](str(tmp_path)) if name in HARNESSES else _server_harness(name, str(tmp_path))
    yield h
    asyncio.run(h.close())


def fail_text(world: World, text: str, error: BaseException, times: int | None = None) -> None:
    """The channel rejects sends whose text is ``text`` (the first ``times``, or all)."""
    count = [0]

    def predicate(chat_id: str, content: dict[str, Any]) -> bool:
        if content.get("text") != text or (times is not None and count[0] >= times):
            return False
        count[0] += 1
        return True

    world.channel.fail_when(predicate, error)


async def outbox_by_key(bot: Bot) -> dict[str, OutboxRecord]:
    assert bot.durability is not None
    return {r.key: r for r in await bot.durability.outbox.list()}


def chain_of(records: dict[str, OutboxRecord], first: str) -> list[OutboxRecord]:
    """The parts of the send ``first``, in order, followed through ``previous_part``."""
    chain = [records[first]]
    while True:
        nxt = [r for r in records.values() if r.previous_part == chain[-1].key]
        assert len(nxt) <= 1, f"two records chained behind {chain[-1].key!r}: {[r.key for r in nxt]}"
        if not nxt:
            return chain
        chain.append(nxt[0])


# -- OUT-12: part keys never collide with user keys ------------------------------------------------


@pytest.mark.spec("OUT-12", "OUT-2")
async def test_out12_user_key_like_a_part_key_then_a_split_under_its_base(harness: BackendHarness) -> None:
    """OUT-12: the user sends under ``a#2`` first, then a long text under ``a``: every
    part of ``a`` is journaled and reaches the channel in order, none chains behind the
    user's ``a#2``, and the user's record is left as it was."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    mine = await bot.send("c1", "mine", idempotency_key="a#2")
    long = await bot.send("c1", LONG, idempotency_key="a")
    assert world.channel.texts() == ["mine", *PARTS]
    assert len(long.message_ids) == len(PARTS) and long.key == "a"
    records = await outbox_by_key(bot)
    assert (records["a#2"].content, records["a#2"].previous_part, records["a#2"].message_id) == (
        {"text": "mine"}, None, mine.message_id,
    )
    chain = chain_of(records, "a")
    assert [r.content["text"] for r in chain] == PARTS
    assert [r.state for r in chain] == ["sent"] * len(PARTS)
    assert "a#2" not in [r.key for r in chain]
    assert len(records) == len(PARTS) + 1
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-2")
async def test_out12_split_first_then_the_user_sends_under_a_part_like_key(harness: BackendHarness) -> None:
    """OUT-12: a long text under ``order`` is split, then the user sends ``order#2`` and
    enqueues ``order#3``: both are the user's own sends, sent (not deduped against the
    parts) — and the parts are not answered from the user's records either."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    await bot.send("c1", LONG, idempotency_key="order")
    second = await bot.send("c1", "my own second", idempotency_key="order#2")
    assert not second.deduped and second.key == "order#2"
    assert await bot.enqueue("c1", "my own third", idempotency_key="order#3") == {"key": "order#3"}
    await world.drain()
    assert world.channel.texts() == [*PARTS, "my own second", "my own third"]
    assert bot.durability is not None and bot.durability.metrics()["outbox_deduped"] == 0
    again = await bot.send("c1", LONG, idempotency_key="order")
    assert again.deduped and world.channel.texts() == [*PARTS, "my own second", "my own third"]
    records = await outbox_by_key(bot)
    assert records["order#2"].content == {"text": "my own second"} and records["order#2"].previous_part is None
    assert [r.content["text"] for r in chain_of(records, "order")] == PARTS
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-3", "OUT-10")
async def test_out12_derived_and_enqueued_parts_leave_user_keys_alone(harness: BackendHarness) -> None:
    """OUT-12 for rule-2 keys and the sweep: a handler's long reply (key ``m1:1``) and an
    enqueued long text (key ``n``), with the user's ``m1:1#2`` and ``n#2`` journaled
    before them: all parts go out in order, and so do the user's sends."""

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await ctx.reply(LONG)

    world = World(harness, setup=setup, text_limit=LIMIT)
    bot = await world.start()
    await bot.enqueue("c2", "user m1:1#2", idempotency_key="m1:1#2")
    await bot.enqueue("c3", "user n#2", idempotency_key="n#2")
    await world.drain()
    await world.receive("c1", "hi", id="m1")
    await bot.enqueue("c3", LONG, idempotency_key="n")
    await world.drain()
    assert world.channel.texts("c1") == PARTS
    assert world.channel.texts("c2") == ["user m1:1#2"]
    assert world.channel.texts("c3") == ["user n#2", *PARTS]
    records = await outbox_by_key(bot)
    for first in ("m1:1", "n"):
        assert [r.content["text"] for r in chain_of(records, first)] == PARTS
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-3")
@pytest.mark.parametrize("key", ["a\x1f#2", "\x1f", "x\x1fy"])
async def test_out12_an_explicit_key_in_the_part_namespace_is_refused(harness: BackendHarness, key: str) -> None:
    """OUT-12: U+001F is reserved for part keys; an explicit key holding it is refused
    with a ``ValueError`` naming the key, before anything is journaled or sent — by
    ``bot.send`` and ``bot.enqueue`` alike. So is an empty key; a key that is not a
    string is a ``TypeError``."""
    assert PART_SEPARATOR == "\x1f" and part_key("a", 2) == "a\x1f#2"
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    with pytest.raises(ValueError, match="U\\+001F") as info:
        await bot.send("c1", "hi", idempotency_key=key)
    assert repr(key) in str(info.value)
    with pytest.raises(ValueError, match="U\\+001F"):
        await bot.enqueue("c1", "hi", idempotency_key=key)
    with pytest.raises(ValueError, match="must not be empty"):
        await bot.send("c1", "hi", idempotency_key="")
    with pytest.raises(TypeError, match="idempotency_key must be a str, got int 7"):
        await bot.send("c1", "hi", idempotency_key=7)  # type: ignore[arg-type]
    await world.drain()
    assert world.channel.calls == [] and await outbox_by_key(bot) == {}
    await world.close()


def legacy_chain(world: World, key: str, texts: list[str], *, split_done: bool = True) -> list[OutboxRecord]:
    """The records an earlier version journaled for a split text: ``key``, ``key#2`` …
    (``split_done=False``: it died after recording the second part, before the first
    record was cut down to its part, as OUT-13 allows)."""
    now = world.clock.now()
    first_text = texts[0] if split_done else "".join(texts)
    records = [
        OutboxRecord(
            key=key, chat_id="c1", content={"text": first_text}, fingerprint="", rule="explicit", origin="enqueue",
            state="pending", next_at=now, created_at=now, updated_at=now, seq=1,
        )
    ]
    for i, text in enumerate(texts[1:] if split_done else texts[1:2], start=2):
        records.append(
            OutboxRecord(
                key=legacy_part_key(key, i), chat_id="c1", content={"text": text}, fingerprint="", rule="explicit",
                origin="enqueue", previous_part=legacy_part_key(key, i - 1), part=i, state="pending", next_at=now,
                created_at=now, updated_at=now, seq=1,
            )
        )
    return records


@pytest.mark.spec("OUT-12", "OUT-13")
@pytest.mark.parametrize("split_done", [True, False], ids=["split-done", "split-half-done"])
async def test_out12_chains_of_an_earlier_version_stay_readable(harness: BackendHarness, split_done: bool) -> None:
    """OUT-12/OUT-13, upgrading: a chain an earlier version journaled under ``key#2`` …
    is delivered whole, in order, once — also when that version died in the middle of
    the split (``key#2`` recorded, the first record still holding the whole text): the
    split is finished under the old keys, no part is recorded under the new ones."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    assert bot.durability is not None
    await world.clock.settle()
    for rec in legacy_chain(world, "old", PARTS, split_done=split_done):
        _, created = await bot.durability.backend.outbox_journal(bot.durability.scope, rec)
        assert created
    await world.drain()
    assert world.channel.texts() == PARTS
    records = await outbox_by_key(bot)
    assert sorted(records) == sorted(legacy_part_key("old", i) for i in range(1, len(PARTS) + 1))
    assert [r.state for r in chain_of(records, "old")] == ["sent"] * len(PARTS)
    again = await bot.send("c1", LONG, idempotency_key="old")
    assert again.deduped and world.channel.texts() == PARTS
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-2")
async def test_out12_an_inline_send_over_a_chain_of_an_earlier_version(harness: BackendHarness) -> None:
    """OUT-12, upgrading: ``bot.send`` under the key of a pending chain an earlier
    version journaled sends its first part inline; the later parts follow, by their
    stored links, in order and once."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    assert bot.durability is not None
    await world.clock.settle()
    for rec in legacy_chain(world, "old", PARTS):
        await bot.durability.backend.outbox_journal(bot.durability.scope, rec)
    result = await bot.send("c1", LONG, idempotency_key="old")
    assert result.key == "old" and result.message_id == world.channel.sent[0].message_id
    await world.drain()
    assert world.channel.texts() == PARTS
    await world.close()


# -- OUT-10: the hooks run once per journaled send ----------------------------------------------------


@pytest.mark.spec("OUT-10")
async def test_out10_concurrent_enqueues_of_one_key_run_the_hooks_once(harness: BackendHarness) -> None:
    """OUT-10: five concurrent ``bot.enqueue`` calls with one idempotency key journal one
    send, run the ``before("send")`` hooks once and send once."""
    hooked: list[str] = []

    def setup(bot: Bot) -> None:
        @bot.before("send")
        async def hook(chat_id: str, content: dict[str, Any]) -> dict[str, Any]:
            hooked.append(content["text"])
            await asyncio.sleep(0)  # a hook that awaits: the others get to run meanwhile
            return {**content, "text": content["text"] + "!"}

    world = World(harness, setup=setup)
    bot = await world.start()
    results = await asyncio.gather(*(bot.enqueue("c1", "remind", idempotency_key="r1") for _ in range(5)))
    assert results == [{"key": "r1"}] * 5
    await world.drain()
    assert hooked == ["remind"]
    assert world.channel.texts() == ["remind!"]
    assert bot.durability is not None and bot.durability.metrics()["outbox_journaled"] == 1
    assert len(bot.durability._key_locks) == 0  # no lock left behind per key
    await world.close()


@pytest.mark.spec("OUT-10", "OUT-2")
async def test_out10_concurrent_sends_of_one_key_to_two_chats_call_the_provider_once(harness: BackendHarness) -> None:
    """OUT-2/OUT-10: two concurrent ``bot.send`` calls with one explicit key (to two
    chats, so the per-chat order lock does not serialise them) journal one send, run the
    hooks once and call the provider once."""
    hooked: list[str] = []

    def setup(bot: Bot) -> None:
        @bot.before("send")
        async def hook(chat_id: str, content: dict[str, Any]) -> None:
            hooked.append(chat_id)
            await asyncio.sleep(0)

    world = World(harness, setup=setup)
    bot = await world.start()
    a, b = await asyncio.gather(
        bot.send("c1", "once", idempotency_key="k1"), bot.send("c2", "once", idempotency_key="k1")
    )
    await world.drain()
    assert len(world.channel.calls) == 1 and world.channel.texts() == ["once"]
    assert len(hooked) == 1
    assert {a.key, b.key} == {"k1"}
    await world.close()


@pytest.mark.spec("OUT-2", "OUT-10", "LEASE-2")
async def test_out2_a_key_another_replica_journals_meanwhile_is_not_sent_again(harness: BackendHarness) -> None:
    """OUT-2 across processes: while this bot runs the hooks of ``bot.send(key="k")``,
    another replica journals ``k`` and is sending it. This bot's journal write then finds
    the record: it does not call the provider under the other's lease (it answers
    ``state="sending"``), and the send is resolved by the lease rules, not duplicated."""
    world = World(harness)

    def setup(bot: Bot) -> None:
        @bot.before("send")
        async def other_replica_journals_meanwhile(chat_id: str, content: dict[str, Any]) -> None:
            d = bot.durability
            assert d is not None
            now = world.clock.now()
            await d.backend.outbox_journal(d.scope, OutboxRecord(
                key="k", chat_id=chat_id, content=dict(content), fingerprint="", rule="explicit", state="sending",
                attempts=1, token=1, owner="replica-2", incarnation="other", lease_until=now + 60_000, claimed_at=now,
                created_at=now, updated_at=now, seq=1,
            ))

    world.setup = setup
    bot = await world.start()
    result = await bot.send("c1", "once", idempotency_key="k")
    assert (result.key, result.state, result.message_id) == ("k", "sending", None)
    assert world.channel.calls == []
    rec = (await outbox_by_key(bot))["k"]
    assert (rec.owner, rec.token) == ("replica-2", 1)
    await world.close()


# -- OUT-9: a deferred split send carries the send's key --------------------------------------------


@pytest.mark.spec("OUT-9", "OUT-12")
async def test_out9_deferred_split_send_carries_the_send_key(harness: BackendHarness) -> None:
    """OUT-9: the first part of a split ``bot.send`` goes out, the second keeps failing
    past ``outbox.inline_max_ms``: ``SendDeferredError.key`` is the send's key ``K``
    (the part's record is named by ``part_key``); the sweep finishes the send later."""
    world = World(harness, text_limit=LIMIT, durability={"outbox": {"backoff": FAST, "inline_max_ms": 5000}})
    bot = await world.start()
    fail_text(world, PARTS[1], ProviderError("flaky"), times=4)
    with pytest.raises(SendDeferredError) as info:
        await world.drive(bot.send("c1", LONG, idempotency_key="K"))
    assert info.value.key == "K"
    assert info.value.part_key is not None and info.value.part_key != "K"
    records = await outbox_by_key(bot)
    assert records[info.value.part_key].content["text"] == PARTS[1]
    await world.drain()
    assert world.channel.texts() == PARTS
    await world.close()


@pytest.mark.spec("OUT-9", "OUT-8", "OUT-12")
async def test_out9_a_later_part_dead_inline_names_the_send_and_the_part(harness: BackendHarness) -> None:
    """OUT-9/OUT-8: when a later part of an inline split send dies (a definitive error),
    ``SendFailedError.key`` is the send's key and ``part_key`` the dead part's."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    fail_text(world, PARTS[2], UnsupportedContentError("no"))
    with pytest.raises(SendFailedError) as info:
        await bot.send("c1", LONG, idempotency_key="K")
    assert (info.value.key, info.value.part_key) == ("K", part_key("K", 3))
    assert repr(part_key("K", 3)) in str(info.value)
    assert world.channel.texts() == PARTS[:2]
    await world.close()


# -- OUT-15: content JSON cannot hold bypasses the outbox ----------------------------------------------

UNENCODABLE: dict[str, tuple[dict[Any, Any], str]] = {  # content, and what the warning names
    "nan": ({"text": "n", "score": math.nan}, "content.score: nan is not a JSON number"),
    "inf": ({"text": "i", "meta": {"ratio": math.inf}}, "content.meta.ratio: inf is not a JSON number"),
    "-inf": ({"text": "m", "values": [1.0, -math.inf]}, "content.values[1]: -inf is not a JSON number"),
    "surrogate": ({"text": "s\ud800"}, "content.text: the string 's\\ud800' holds the lone surrogate"),
    "surrogate-key": ({"text": "k", "meta": {"\udfff": 1}}, "content.meta: the key '\\udfff' holds the lone surrogate"),
    "int-key": ({"text": "d", "meta": {1: "x"}}, "content.meta: key 1 is not a string"),
}


@pytest.mark.spec("OUT-15", "INB-2")
@pytest.mark.parametrize("case", list(UNENCODABLE))
async def test_out15_unencodable_content_bypasses_the_outbox(
    harness: BackendHarness, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """OUT-15: a reply whose content JSON cannot hold (NaN, ±inf, a lone surrogate, a
    non-string key) is sent without the outbox — counted in ``outbox_bypassed``, with a
    warning naming where in the content the value is — instead of raising from
    ``ctx.reply`` while the inbound ends ``done`` with the reply never sent. The next
    reply of the handler is journaled as usual."""
    content, named = UNENCODABLE[case]
    errors: list[BaseException] = []

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            try:
                await ctx.reply(content)
            except Exception as exc:  # recorded: the test fails below naming it
                errors.append(exc)
            await ctx.reply("after")

    world = World(harness, setup=setup)
    bot = await world.start()
    with caplog.at_level(logging.WARNING, logger="botmesh.durability"):
        await world.receive("c1", "hi", id="m1")
    assert errors == []
    assert len(world.channel.sent) == 2
    assert world.channel.sent[0].content.keys() == content.keys()
    assert world.channel.texts() == [content["text"], "after"]
    assert bot.durability is not None
    assert bot.durability.metrics()["outbox_bypassed"] == 1
    warnings = [r.getMessage() for r in caplog.records if "bypasses the outbox" in r.getMessage()]
    assert len(warnings) == 1 and named in warnings[0], warnings
    records = await outbox_by_key(bot)
    assert [r.content for r in records.values()] == [{"text": "after"}]
    inbound = await bot.durability.inbox.get("m1")
    assert inbound is not None and inbound.state == "done"
    await world.close()
