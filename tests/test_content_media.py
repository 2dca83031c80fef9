"""Outgoing content in the outbox — splitting (OUT-12, OUT-13), the journal encoding and
its bypass (OUT-15), what is not journaled (OUT-16) — and inbound media in a replay
(MEDIA-1 .. MEDIA-5)."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest
from botmesh.core import (
    Bot,
    MediaUnavailableError,
    OutboxRecord,
    ProviderError,
    SendFailedError,
    UnsupportedContentError,
    load_media_of,
)
from botmesh.core.content import part_key, split_text
from hypothesis import given, settings
from hypothesis import strategies as st

from botmesh_testkit.crash import World

LIMIT = 20
LONG = "The quick brown fox jumps over the lazy dog and keeps running far away."
PARTS = split_text(LONG, LIMIT)
URL = "https://media.mock.test/a.jpg"
JPEG = b"\xff\xd8\xff\xe0JPEG-BYTES-0123456789"
FAST = {"base_ms": 1000, "cap_ms": 60_000, "jitter": 0}


def fail_text(world: World, text: str, error: BaseException, times: int | None = None) -> None:
    """The channel rejects sends whose text is ``text`` (the first ``times`` of them, or
    all)."""
    count = [0]

    def predicate(chat_id: str, content: dict[str, Any]) -> bool:
        if content.get("text") != text or (times is not None and count[0] >= times):
            return False
        count[0] += 1
        return True

    world.channel.fail_when(predicate, error)


def called_texts(world: World) -> list[str]:
    return [str(c.content.get("text")) for c in world.channel.calls]


def keys_of(key: str, parts: int = 4) -> list[str]:
    """The record keys of a send ``key`` split into ``parts`` (OUT-12)."""
    return [part_key(key, i) for i in range(1, parts + 1)]


async def outbox_by_key(bot: Bot) -> dict[str, OutboxRecord]:
    assert bot.durability is not None
    return {r.key: r for r in await bot.durability.outbox.list()}


# -- split_text (OUT-12, OUT-13) ----------------------------------------------------------------

TEXTS = st.one_of(
    st.text(alphabet=st.sampled_from(["a", "b", "é", " ", "\n", "🙂"]), max_size=300),
    st.lists(st.sampled_from(["word", "x", "longerword", " ", "\n", "\n\n", "🙂"]), max_size=80).map("".join),
)


@pytest.mark.spec("OUT-12", "OUT-13")
@settings(max_examples=300, deadline=None, database=None)
@given(text=TEXTS, limit=st.integers(min_value=1, max_value=60))
def test_split_text_invariants(text: str, limit: int) -> None:
    """OUT-12/OUT-13: the parts joined give the text back, none exceeds the limit, none
    is empty (for a non-empty text), and the split is deterministic."""
    parts = split_text(text, limit)
    assert "".join(parts) == text
    assert all(len(p) <= limit for p in parts)
    if text:
        assert all(p for p in parts)
    if len(text) <= limit:
        assert parts == [text]
    else:
        assert len(parts) >= 2
    assert split_text(text, limit) == parts


@pytest.mark.spec("OUT-12")
def test_split_text_prefers_natural_breaks() -> None:
    """OUT-12: a paragraph break beats a line break beats a space (in the second half
    of the window); a word without breaks is cut hard."""
    assert split_text("aaaaaaaaaa\n\nbbbbbbb ccccccccccc", 22) == ["aaaaaaaaaa\n\n", "bbbbbbb ccccccccccc"]
    assert split_text("aaaaaaaa bbbbbbb\ncccccccccc", 20) == ["aaaaaaaa bbbbbbb\n", "cccccccccc"]
    assert split_text("x" * 45, 20) == ["x" * 20, "x" * 20, "x" * 5]


# -- OUT-12: a long reply becomes linked parts ----------------------------------------------------


def reply_long(bot: Bot) -> None:
    @bot.otherwise
    async def handler(ctx: Any) -> None:
        await ctx.reply(LONG)


@pytest.mark.spec("OUT-12")
async def test_long_reply_goes_out_as_ordered_linked_parts(harness: Any) -> None:
    """OUT-12: a reply over the channel's text limit is sent as several messages, in
    order, recorded as ``key``, ``key#2`` … each linked to the one before by
    ``previous_part``."""
    world = World(harness, setup=reply_long, text_limit=LIMIT)
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    assert len(PARTS) == 4
    assert world.channel.texts("c1") == PARTS
    assert "".join(world.channel.texts()) == LONG
    records = await outbox_by_key(bot)
    keys = keys_of("m1:1")
    assert sorted(records) == sorted(keys)
    assert [records[k].previous_part for k in keys] == [None, *keys[:-1]]
    assert [records[k].content["text"] for k in keys] == PARTS
    assert [records[k].state for k in keys] == ["sent"] * 4
    assert [records[k].message_id for k in keys] == [m.message_id for m in world.channel.sent]
    await world.close()


@pytest.mark.spec("OUT-12")
async def test_split_happens_after_the_before_send_hooks(harness: Any) -> None:
    """OUT-12: the text is split *after* the hooks: a short reply that a hook makes long
    goes out in parts, and the hook ran once."""
    hooked: list[str] = []

    def setup(bot: Bot) -> None:
        @bot.before("send")
        def footer(chat_id: str, content: dict[str, Any]) -> dict[str, Any]:
            hooked.append(content["text"])
            return {**content, "text": content["text"] + " " + LONG}

        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await ctx.reply("hi!")

    world = World(harness, setup=setup, text_limit=LIMIT)
    bot = await world.start()
    await world.receive("c1", "x", id="m1")
    assert hooked == ["hi!"]
    expected = split_text("hi! " + LONG, LIMIT)
    assert world.channel.texts() == expected
    assert len(await outbox_by_key(bot)) == len(expected)
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-7")
async def test_inline_part_never_overtakes_a_retrying_part(harness: Any) -> None:
    """OUT-12: while the first part is retried inline the later parts wait; waiting is
    not an attempt."""
    world = World(harness, setup=reply_long, text_limit=LIMIT, durability={"outbox": {"backoff": FAST}})
    bot = await world.start()
    fail_text(world, PARTS[0], ProviderError("flaky"), times=3)
    async with world.clock.auto():
        await world.receive("c1", "hi", id="m1")
    assert world.channel.texts() == PARTS
    assert called_texts(world) == [PARTS[0]] * 4 + PARTS[1:]
    records = await outbox_by_key(bot)
    assert records["m1:1"].attempts == 4
    assert [records[k].attempts for k in keys_of("m1:1")[1:]] == [1, 1, 1]
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-7", "OUT-10")
async def test_background_parts_keep_their_order_and_whole_retry_budget(harness: Any) -> None:
    """OUT-12: in the background sweep a part waits behind a failing earlier part
    without being charged; with ``retries=2`` each of the first two parts may fail twice
    and all parts still go out, in order."""
    world = World(harness, text_limit=LIMIT, durability={"outbox": {"retries": 2, "backoff": FAST}})
    bot = await world.start()
    fail_text(world, PARTS[0], ProviderError("flaky"), times=2)
    fail_text(world, PARTS[1], ProviderError("flaky"), times=2)
    assert await bot.enqueue("c1", LONG, idempotency_key="news") == {"key": "news"}
    await world.drain()
    assert world.channel.texts() == PARTS
    assert called_texts(world) == [PARTS[0]] * 3 + [PARTS[1]] * 3 + PARTS[2:]
    records = await outbox_by_key(bot)
    assert [records[k].state for k in keys_of("news")] == ["sent"] * 4
    assert [records[k].attempts for k in keys_of("news")] == [3, 3, 1, 1]
    assert world.named("durability:dead") == []
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-8", "OPS-1")
async def test_later_parts_die_with_a_dead_first_part(harness: Any) -> None:
    """OUT-12: when the first part goes to the DLQ (a definitive error) the later parts
    die with it, without reaching the channel."""
    errors: list[BaseException] = []

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            try:
                await ctx.reply(LONG)
            except SendFailedError as exc:
                errors.append(exc)

    world = World(harness, setup=setup, text_limit=LIMIT)
    bot = await world.start()
    fail_text(world, PARTS[0], UnsupportedContentError("no"))
    await world.receive("c1", "hi", id="m1")
    await world.drain()
    assert [e.key for e in errors] == ["m1:1"]  # type: ignore[attr-defined]
    assert world.channel.sent == []
    assert called_texts(world) == [PARTS[0]]
    assert bot.durability is not None
    dead = sorted(r.key for r in await bot.durability.outbox.list(state="dead"))
    assert dead == keys_of("m1:1")
    assert sorted(e["id"] for e in world.named("durability:dead")) == dead
    assert bot.durability.metrics()["outbox_dead"] == 4
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-7")
async def test_later_parts_die_when_the_first_exhausts_its_retries(harness: Any) -> None:
    """OUT-12: a first part that uses up its retries in the background takes the later
    parts to the DLQ; they are never tried."""
    world = World(harness, text_limit=LIMIT, durability={"outbox": {"retries": 1, "backoff": FAST}})
    bot = await world.start()
    fail_text(world, PARTS[0], ProviderError("down"))
    await bot.enqueue("c1", LONG, idempotency_key="n")
    await world.drain()
    assert called_texts(world) == [PARTS[0]] * 2
    assert bot.durability is not None
    assert sorted(r.key for r in await bot.durability.outbox.list(state="dead")) == keys_of("n")
    await world.close()


@pytest.mark.spec("OUT-12")
async def test_user_key_ending_in_hash_2_is_independent(harness: Any) -> None:
    """OUT-12: the link between parts is stored, never inferred from the key: the user's
    own key ``order#2`` is an independent send, sent even though ``order`` is dead."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    fail_text(world, "first", UnsupportedContentError("no"))
    with pytest.raises(SendFailedError):
        await bot.send("c1", "first", idempotency_key="order")
    result = await bot.send("c1", "second", idempotency_key="order#2")
    assert result.message_id is not None
    assert world.channel.texts() == ["second"]
    records = await outbox_by_key(bot)
    assert records["order"].state == "dead"
    assert records["order#2"].state == "sent"
    assert records["order#2"].previous_part is None
    # and in the background: "x#2" does not wait behind a failing "x"
    fail_text(world, "x-text", ProviderError("down"))
    await bot.enqueue("c1", "x-text", idempotency_key="x")
    await bot.enqueue("c1", "x2-text", idempotency_key="x#2")
    await world.clock.advance(1000)
    assert world.channel.texts() == ["second", "x2-text"]
    records = await outbox_by_key(bot)
    assert records["x#2"].state == "sent" and records["x#2"].previous_part is None
    assert records["x"].state == "failed"
    await world.close()


@pytest.mark.spec("OUT-12", "OUT-3")
async def test_explicit_key_parts(harness: Any) -> None:
    """OUT-12 with an explicit key: ``promo``, ``promo#2`` … chained by
    ``previous_part``; a second send under the key is answered from the outbox."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    first = await bot.send("c1", LONG, idempotency_key="promo")
    again = await bot.send("c1", LONG, idempotency_key="promo")
    assert world.channel.texts() == PARTS
    assert first.message_ids == [m.message_id for m in world.channel.sent]
    assert first.message_id == world.channel.sent[0].message_id
    assert again.deduped and again.message_id == first.message_id
    records = await outbox_by_key(bot)
    assert records[part_key("promo", 3)].previous_part == part_key("promo", 2)
    assert records[part_key("promo", 2)].previous_part == "promo"
    await world.close()


# -- OUT-13: a recorded send over the limit is split by the sweep ---------------------------------


def legacy_record(world: World, key: str = "legacy:1") -> OutboxRecord:
    now = world.clock.now()
    return OutboxRecord(
        key=key, chat_id="c1", content={"text": LONG}, fingerprint="", rule="explicit", origin="enqueue",
        state="pending", next_at=now, created_at=now, updated_at=now,
    )


@pytest.mark.spec("OUT-13")
async def test_sweep_splits_a_recorded_send_over_the_limit(harness: Any) -> None:
    """OUT-13: a pending record whose text exceeds the limit (an older version wrote it)
    is split by the sweep: the first part keeps the key, the others are recorded as
    ``key#2`` …; all go out in order; another pass records and sends nothing more."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start()
    assert bot.durability is not None
    await world.clock.settle()
    _, created = await bot.durability.backend.outbox_journal(bot.durability.scope, legacy_record(world))
    assert created
    await world.drain()
    assert world.channel.texts() == PARTS
    records = await outbox_by_key(bot)
    keys = keys_of("legacy:1")
    assert sorted(records) == sorted(keys)
    assert [records[k].content["text"] for k in keys] == PARTS
    assert [records[k].previous_part for k in keys] == [None, *keys[:-1]]
    assert all(records[k].state == "sent" for k in keys)
    journaled = bot.durability.metrics()["outbox_journaled"]
    assert journaled == 3
    # more passes: nothing recorded or sent twice
    await bot.durability.sweep()
    await world.clock.advance(5000)
    assert world.channel.texts() == PARTS
    assert sorted(await outbox_by_key(bot)) == sorted(keys)
    assert bot.durability.metrics()["outbox_journaled"] == journaled
    await world.close()


@pytest.mark.spec("OUT-13", "OUT-7")
async def test_split_first_part_retry_sends_only_the_first_part(harness: Any) -> None:
    """OUT-13: after the split, a failed first part is retried with its own (first
    part) content, and the split is not repeated."""
    world = World(harness, text_limit=LIMIT, durability={"outbox": {"backoff": FAST}})
    bot = await world.start()
    assert bot.durability is not None
    await world.clock.settle()
    fail_text(world, PARTS[0], ProviderError("flaky"), times=2)
    await bot.durability.backend.outbox_journal(bot.durability.scope, legacy_record(world))
    await world.drain()
    assert called_texts(world) == [PARTS[0]] * 3 + PARTS[1:]
    assert world.channel.texts() == PARTS
    assert len(await outbox_by_key(bot)) == len(PARTS)
    assert bot.durability.metrics()["outbox_journaled"] == len(PARTS) - 1
    await world.close()


@pytest.mark.spec("OUT-13", "OUT-14", "TEST-3")
@pytest.mark.parametrize(
    "arm",
    [
        ("after", "outbox.journal", 2),  # part 2 recorded, part 3 not yet
        ("before", "outbox.split", 1),  # every part recorded, first not yet shortened
        ("after", "outbox.split", 1),  # first shortened, not yet sent
    ],
    ids=lambda a: f"{a[0]}-{a[1]}-{a[2]}",
)
async def test_split_interrupted_by_a_crash_records_and_sends_nothing_twice(harness: Any, arm: tuple[str, str, int]) -> None:
    """OUT-13: the sweep's split dies half-way; after the restart (``resend`` policy,
    so the interrupted first part is sent) the same part keys are used and every part
    is recorded and sent exactly once, in order."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start(crash=True)
    assert bot.durability is not None and world.crashable is not None
    await world.clock.settle()
    await bot.durability.backend.outbox_journal(bot.durability.scope, legacy_record(world))  # outbox.journal #1
    when, op, nth = arm
    (world.crashable.crash_after if when == "after" else world.crashable.crash_before)(op, nth)
    await world.clock.advance(1000)
    assert world.crashed
    assert world.channel.calls == []
    bot = await world.restart(outbox={"on_ambiguous": "resend"})
    await world.drain()
    assert world.channel.texts() == PARTS
    records = await outbox_by_key(bot)
    keys = keys_of("legacy:1")
    assert sorted(records) == sorted(keys)
    assert [records[k].content["text"] for k in keys] == PARTS
    assert [records[k].previous_part for k in keys] == [None, *keys[:-1]]
    assert all(records[k].state == "sent" for k in keys)
    await world.close()


@pytest.mark.spec("OUT-13", "OUT-14", "OUT-12", "TEST-3")
async def test_split_interrupted_by_a_crash_is_finished_under_the_default_policy(harness: Any) -> None:
    """OUT-13: "a retry or a second pass records and sends nothing twice" — and the
    second pass finishes the split: after a crash between recording ``key#2`` and
    ``key#3`` (no provider call made yet), a restart with the default policy records
    every part key and sends each part at most once, in order (the head may be skipped
    as ``unknown``, OUT-14, but no later part is lost)."""
    world = World(harness, text_limit=LIMIT)
    bot = await world.start(crash=True)
    assert bot.durability is not None and world.crashable is not None
    await world.clock.settle()
    await bot.durability.backend.outbox_journal(bot.durability.scope, legacy_record(world))
    world.crashable.crash_after("outbox.journal", 2)
    await world.clock.advance(1000)
    assert world.crashed and world.channel.calls == []
    bot = await world.restart()
    await world.drain()
    records = await outbox_by_key(bot)
    assert sorted(records) == keys_of("legacy:1")
    assert world.channel.texts() in (PARTS, PARTS[1:])
    await world.close()


# -- OUT-15: the journal encoding and its bypass ----------------------------------------------------


@pytest.mark.spec("OUT-15")
async def test_bytes_are_journaled_as_base64_and_delivered_as_bytes(harness: Any) -> None:
    """OUT-15: content with bytes is journaled as JSON (bytes as base64) and the
    provider receives the bytes."""
    blob = bytes(range(256))

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await ctx.reply({"caption": "pic", "image": blob})

    world = World(harness, setup=setup)
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    assert [m.content for m in world.channel.sent] == [{"caption": "pic", "image": blob}]
    assert isinstance(world.channel.sent[0].content["image"], bytes)
    (record,) = (await outbox_by_key(bot)).values()
    encoded = json.dumps(record.content)  # plain JSON
    assert base64.b64encode(blob).decode("ascii") in encoded
    assert record.content["caption"] == "pic"
    assert bot.durability is not None and bot.durability.metrics()["outbox_bypassed"] == 0
    await world.close()


@pytest.mark.spec("OUT-15", "OUT-10", "TEST-3")
async def test_bytes_survive_the_journal_to_a_background_delivery(harness: Any) -> None:
    """OUT-15: an enqueued send with bytes, delivered by the sweep of the next
    incarnation (read back from the journal), reaches the channel as the same bytes."""
    blob = b"\x00\x01\x02binary\xff"
    world = World(harness)
    bot = await world.start()
    world.channel.fail_next(ProviderError("down"))
    await bot.enqueue("c1", {"document": blob, "filename": "a.bin"}, idempotency_key="doc")
    await world.clock.settle()
    assert world.channel.sent == []
    bot = await world.restart()
    world.channel.clear_failures()
    await world.drain()
    assert [m.content for m in world.channel.sent] == [{"document": blob, "filename": "a.bin"}]
    assert isinstance(world.channel.sent[0].content["document"], bytes)
    await world.close()


def _send_setup(content: Any, hooked: list[Any]) -> Any:
    def setup(bot: Bot) -> None:
        @bot.before("send")
        def hook(chat_id: str, c: dict[str, Any]) -> None:
            hooked.append(c)

        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await ctx.reply(content)

    return setup


@pytest.mark.spec("OUT-15")
async def test_content_over_max_payload_bypasses_the_outbox(harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    """OUT-15: content larger than ``outbox.max_payload_bytes`` is sent without a
    journal record, with a warning, counted in ``outbox_bypassed``."""
    hooked: list[Any] = []
    big = "x" * 500
    world = World(harness, setup=_send_setup(big, hooked), durability={"outbox": {"max_payload_bytes": 200}})
    bot = await world.start()
    with caplog.at_level(logging.WARNING):
        await world.receive("c1", "hi", id="m1")
    assert world.channel.texts() == [big]
    assert len(hooked) == 1
    assert await outbox_by_key(bot) == {}
    assert bot.durability is not None
    assert bot.durability.metrics()["outbox_bypassed"] == 1
    assert bot.durability.metrics()["outbox_journaled"] == 0
    assert any(r.levelno == logging.WARNING and "outbox" in r.getMessage() for r in caplog.records)
    # a payload under the limit is journaled
    await bot.send("c1", "small", idempotency_key="small")
    assert sorted(await outbox_by_key(bot)) == ["small"]
    assert bot.durability.metrics()["outbox_bypassed"] == 1
    await world.close()


@pytest.mark.spec("OUT-15")
async def test_default_max_payload_is_one_mebibyte(harness: Any) -> None:
    """OUT-15: the default ``max_payload_bytes`` is 1 MiB of journaled JSON: a 700 KiB
    blob (≈ 933 KiB as base64) is journaled, an 800 KiB one (≈ 1.07 MiB) bypasses."""
    world = World(harness)
    bot = await world.start()
    assert bot.durability is not None
    await bot.send("c1", {"blob": b"\x01" * (700 * 1024)}, idempotency_key="small")
    await bot.send("c1", {"blob": b"\x02" * (800 * 1024)}, idempotency_key="big")
    assert [len(m.content["blob"]) for m in world.channel.sent] == [700 * 1024, 800 * 1024]
    assert sorted(await outbox_by_key(bot)) == ["small"]
    assert bot.durability.metrics()["outbox_bypassed"] == 1
    await world.close()


class _Opaque:
    pass


@pytest.mark.spec("OUT-15")
@pytest.mark.parametrize("kind", ["generator", "object"])
async def test_unencodable_content_bypasses_the_outbox(harness: Any, kind: str) -> None:
    """OUT-15: content that cannot be encoded (a stream, an arbitrary object) is sent
    without a journal record, counted in ``outbox_bypassed``; the hooks run once."""
    value: Any = (chunk for chunk in [b"a", b"b"]) if kind == "generator" else _Opaque()
    hooked: list[Any] = []
    world = World(harness, setup=_send_setup({"text": "stream", "body": value}, hooked))
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    assert len(world.channel.sent) == 1
    assert world.channel.sent[0].content["body"] is value
    assert len(hooked) == 1
    assert await outbox_by_key(bot) == {}
    assert bot.durability is not None
    assert bot.durability.metrics()["outbox_bypassed"] == 1
    # the inbound record itself is journaled and settled
    assert [(r.id, r.state) for r in await bot.durability.inbox.list()] == [("m1", "done")]
    await world.close()


# -- OUT-16: typing indicators are not journaled ---------------------------------------------------


@pytest.mark.spec("OUT-16")
async def test_typing_writes_no_journal_record(harness: Any) -> None:
    """OUT-16: ``ctx.typing()`` reaches the channel and writes nothing to the outbox."""

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await ctx.typing()

    world = World(harness, setup=setup)
    bot = await world.start(crash=True)
    assert world.crashable is not None and bot.durability is not None
    await world.receive("c1", "hi", id="m1")
    assert world.channel.typing_calls == ["c1"]
    assert world.channel.calls == []
    assert await outbox_by_key(bot) == {}
    # (the sweep's retention purge is the only outbox operation allowed)
    assert [op for op in world.crashable.history if op.startswith("outbox.") and op != "outbox.purge"] == []
    assert "inbox.journal" in world.crashable.history
    assert bot.durability.metrics()["outbox_journaled"] == 0
    await world.close()


# -- MEDIA ------------------------------------------------------------------------------------------


def media_setup(seen: list[tuple[Any, ...]]) -> Any:
    """A handler that tries to load the media of each message, both ways."""

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            try:
                data = await load_media_of(ctx, throw_on_error=True)
                strict: Any = ("bytes", data)
            except MediaUnavailableError as exc:
                assert isinstance(exc, ProviderError)
                strict = ("unavailable", exc.reason)
            soft = await load_media_of(ctx)
            seen.append((ctx.replayed, strict, soft))
            await ctx.reply("processed")

    return setup


def _find_ref(value: Any) -> dict[str, Any] | None:
    """The first ``{"v": ..., "data": ...}`` object inside ``value``."""
    if isinstance(value, dict):
        if "v" in value and "data" in value:
            return value
        for v in value.values():
            found = _find_ref(v)
            if found is not None:
                return found
    if isinstance(value, list):
        for v in value:
            found = _find_ref(v)
            if found is not None:
                return found
    return None


@pytest.mark.spec("MEDIA-1", "MEDIA-4")
async def test_inbound_media_is_journaled_as_a_serialized_reference(harness: Any) -> None:
    """MEDIA-1: the inbox journals the provider's serializable, versioned reference of
    the media, never the bytes; MEDIA-4: nothing but what the provider serialized (no
    credential of the live reference) is written."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    bot = await world.start()
    await world.receive("c1", "", id="m1", media={"url": URL, "auth_token": "s3cr3t-credential"})
    assert seen == [(False, ("bytes", JPEG), JPEG)]
    assert bot.durability is not None
    (record,) = await bot.durability.inbox.list()
    dumped = json.dumps(record.to_json())
    ref = _find_ref(record.event["media"])
    assert ref is not None and (ref["v"], ref["data"]) == (1, {"url": URL})
    assert "s3cr3t-credential" not in dumped
    assert "JPEG-BYTES" not in dumped and base64.b64encode(JPEG).decode() not in dumped
    await world.close()


@pytest.mark.spec("MEDIA-2", "GUAR-2", "TEST-3")
async def test_replay_after_a_crash_rehydrates_the_media(harness: Any) -> None:
    """MEDIA-2: a message replayed after a crash gets its media reference rebuilt
    before the handler runs: ``load_media_of`` returns the bytes."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    await world.start(crash=True)
    assert world.crashable is not None
    world.crashable.crash_before("inbox.complete")
    assert await world.receive("c1", "", id="m1", media={"url": URL}) is False
    bot = await world.restart()
    await world.drain()
    assert seen == [(False, ("bytes", JPEG), JPEG), (True, ("bytes", JPEG), JPEG)]
    assert bot.durability is not None
    assert [(r.id, r.state) for r in await bot.durability.inbox.list()] == [("m1", "done")]
    assert world.channel.texts() == ["processed"]  # the reply was answered from the outbox
    await world.close()


@pytest.mark.spec("MEDIA-2", "OPS-2")
async def test_operator_replay_rehydrates_the_media(harness: Any) -> None:
    """MEDIA-2: ``replay_inbound`` of a settled message rebuilds its media reference."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    bot = await world.start()
    await world.receive("c1", "", id="m1", media={"url": URL})
    assert bot.durability is not None
    assert await bot.durability.replay_inbound("m1") is True
    assert seen == [(False, ("bytes", JPEG), JPEG), (True, ("bytes", JPEG), JPEG)]
    await world.close()


def _replace(value: Any, old: Any, new: Any) -> Any:
    if value == old:
        return new
    if isinstance(value, dict):
        return {k: _replace(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, old, new) for v in value]
    return value


async def _tamper(world: World, id: str, old: Any, new: Any) -> None:
    """Edit the inbox record ``id`` in storage (as someone with access to the journal
    could), replacing every value ``old`` by ``new``."""
    assert world.crashable is not None and world.bot is not None and world.bot.durability is not None
    kv = world.crashable.inner.kv  # type: ignore[attr-defined]
    scope = world.bot.durability.scope
    found = await kv.get(scope, "inbox", id)
    assert found is not None
    changed = _replace(found.value, old, new)
    assert changed != found.value
    await kv.put(scope, "inbox", id, changed, expected_version=found.version,
                 due=found.value.get("lease_until"), expires=None)


async def _crash_and_replay(world: World, media: Any, before_restart: Any = None) -> Bot:
    await world.start(crash=True)
    assert world.crashable is not None
    world.crashable.crash_before("inbox.complete")
    assert await world.receive("c1", "", id="m1", media=media) is False
    if before_restart is not None:
        await before_restart()
    bot = await world.restart()
    await world.drain()
    return bot


@pytest.mark.spec("MEDIA-3", "MEDIA-1")
async def test_view_once_media_is_not_durable(harness: Any) -> None:
    """MEDIA-3 ``not-durable``: the provider did not serialize the reference (view-once
    media): the replayed message is processed, its download raises with reason
    ``not-durable`` (throw_on_error) or gives None."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    bot = await _crash_and_replay(world, {"url": URL, "view_once": True})
    assert seen[0] == (False, ("bytes", JPEG), JPEG)  # live: the live reference works
    assert seen[1:] == [(True, ("unavailable", "not-durable"), None)]
    assert bot.durability is not None
    (record,) = await bot.durability.inbox.list()
    assert record.state == "done"
    assert URL not in json.dumps(record.to_json())
    await world.close()


@pytest.mark.spec("MEDIA-3")
async def test_media_written_by_another_provider_is_a_mismatch(harness: Any) -> None:
    """MEDIA-3 ``provider-mismatch``: the record was written under another provider's
    name (the bot restarts on a channel named differently)."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG

    async def rename() -> None:
        world.channel.name = "other-channel"

    await _crash_and_replay(world, {"url": URL}, rename)
    assert seen[1:] == [(True, ("unavailable", "provider-mismatch"), None)]
    await world.close()


@pytest.mark.spec("MEDIA-3", "MEDIA-4")
async def test_media_host_not_allowed_fails_rehydration(harness: Any) -> None:
    """MEDIA-3/MEDIA-4 ``rehydrate-failed``: a stored URL reference is validated when
    read; a host outside the allow-list is refused."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    evil = "https://evil.example/a.jpg"
    world.channel.media_bytes[evil] = b"evil bytes"
    await _crash_and_replay(world, {"url": evil})
    assert seen[0] == (False, ("bytes", b"evil bytes"), b"evil bytes")  # live: not from the journal
    assert seen[1:] == [(True, ("unavailable", "rehydrate-failed"), None)]
    await world.close()


@pytest.mark.spec("MEDIA-3", "MEDIA-4")
@pytest.mark.parametrize("tamper", ["host", "version"])
async def test_tampered_media_reference_fails_rehydration(harness: Any, tamper: str) -> None:
    """MEDIA-3/MEDIA-4 ``rehydrate-failed``: a journaled reference that was tampered
    with (another host, an unknown version) is rejected when read back."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    world.channel.media_bytes["https://evil.example/a.jpg"] = b"evil bytes"

    async def edit() -> None:
        if tamper == "host":
            await _tamper(world, "m1", URL, "https://evil.example/a.jpg")
        else:
            assert world.bot is not None and world.crashable is not None
            kv = world.crashable.inner.kv  # type: ignore[attr-defined]
            found = await kv.get(world.bot.durability.scope, "inbox", "m1")  # type: ignore[union-attr]
            ref = _find_ref(found.value)
            assert ref is not None and ref["v"] == 1
            await _tamper(world, "m1", ref, {**ref, "v": 99})

    await _crash_and_replay(world, {"url": URL}, edit)
    assert seen[1:] == [(True, ("unavailable", "rehydrate-failed"), None)]
    await world.close()


@pytest.mark.spec("MEDIA-5")
async def test_media_refs_off_journals_the_raw_token(harness: Any) -> None:
    """MEDIA-5: with ``inbox.media_refs=False`` the raw media token is journaled as it
    is (not the provider's serialized reference), and a replay hands it back."""
    seen: list[tuple[Any, ...]] = []
    token = {"url": URL, "extra": "kept-as-is"}
    world = World(harness, setup=media_setup(seen), durability={"inbox": {"media_refs": False}})
    world.channel.media_bytes[URL] = JPEG
    bot = await _crash_and_replay(world, token)
    assert bot.durability is not None
    (record,) = await bot.durability.inbox.list()
    dumped = json.dumps(record.to_json())
    assert "kept-as-is" in dumped
    assert _find_ref(record.event) is None
    assert seen == [(False, ("bytes", JPEG), JPEG), (True, ("bytes", JPEG), JPEG)]
    await world.close()


# -- issue 12: a bad stored media reference never costs the message (MEDIA-3, MEDIA-5) -----------


async def _set_journaled_media(world: World, id: str, value: Any) -> None:
    """Overwrite what the inbox record ``id`` journaled as its media (``event["media"]``)
    in storage: a record written before the feature, or one tampered with."""
    assert world.crashable is not None and world.bot is not None and world.bot.durability is not None
    kv = world.crashable.inner.kv  # type: ignore[attr-defined]
    scope = world.bot.durability.scope
    found = await kv.get(scope, "inbox", id)
    assert found is not None and found.value["event"]["media"] is not None
    changed = json.loads(json.dumps(found.value))
    changed["event"]["media"] = value
    await kv.put(scope, "inbox", id, changed, expected_version=found.version,
                 due=found.value.get("lease_until"), expires=None)


async def _settled_once_replayed(world: World) -> None:
    """The replayed message was processed in one execution: done, one reply (answered
    from the outbox on the replay), no ``error`` event, nothing dead."""
    assert world.bot is not None and world.bot.durability is not None
    (record,) = await world.bot.durability.inbox.list()
    assert (record.state, record.attempts, record.error) == ("done", 2, None)
    assert world.named("error") == [] and world.named("durability:dead") == []
    assert world.channel.texts() == ["processed"]


@pytest.mark.spec("MEDIA-5", "MEDIA-3")
@pytest.mark.parametrize("token", ["file-id-123", "strawberry-raw", 42, ["a", "b"]],
                         ids=["str", "str-containing-raw", "int", "list"])
async def test_a_pre_feature_bare_token_replays_as_before(harness: Any, token: Any) -> None:
    """MEDIA-5 (issue 12): a record written before the feature journaled the bare token.
    Its replay hands the token to the provider as it is (as before): the message is
    processed; the mock channel cannot download such a token, so only the download fails
    (``rehydrate-failed``, None without ``throw_on_error``). Before the fix the replay
    raised TypeError/AttributeError, and the message was retried and dead-lettered."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    asked: list[Any] = []
    download = world.channel.download_media

    async def recording(ref: Any) -> bytes:
        asked.append(ref)
        return await download(ref)

    world.channel.download_media = recording  # type: ignore[method-assign]
    await _crash_and_replay(world, {"url": URL}, lambda: _set_journaled_media(world, "m1", token))
    assert seen[1:] == [(True, ("unavailable", "rehydrate-failed"), None)]
    assert asked[-2:] == [token, token]  # the replay asked the provider with the bare token, both ways
    await _settled_once_replayed(world)
    await world.close()


@pytest.mark.spec("MEDIA-5")
async def test_a_pre_feature_token_that_is_an_object_replays_as_before(harness: Any) -> None:
    """MEDIA-5: a pre-feature token that is an object (not one of the inbox's envelopes)
    is handed back as it is, so a channel that still serves it downloads the bytes."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    await _crash_and_replay(world, {"url": URL}, lambda: _set_journaled_media(world, "m1", {"url": URL}))
    assert seen[1:] == [(True, ("bytes", JPEG), JPEG)]
    await _settled_once_replayed(world)
    await world.close()


@pytest.mark.spec("MEDIA-3", "MEDIA-4")
@pytest.mark.parametrize("data", ["https://media.mock.test/a.jpg", ["x"], 7, None])
async def test_a_stored_reference_whose_data_is_not_an_object_fails_rehydration(harness: Any, data: Any) -> None:
    """MEDIA-3 (issue 12): a journaled reference whose ``data`` is not an object is
    invalid: ``rehydrate-failed``, the message processed in one execution."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    bad = {"durable": {"provider": "mock", "v": 1, "data": data}}
    await _crash_and_replay(world, {"url": URL}, lambda: _set_journaled_media(world, "m1", bad))
    assert seen[1:] == [(True, ("unavailable", "rehydrate-failed"), None)]
    await _settled_once_replayed(world)
    await world.close()


@pytest.mark.spec("MEDIA-3")
@pytest.mark.parametrize("bad", [{"durable": "not an object"}, {"durable": None}, {"durable": [1, 2]}])
async def test_a_malformed_envelope_fails_rehydration(harness: Any, bad: Any) -> None:
    """MEDIA-3: the inbox's ``durable`` envelope holding something other than an object
    is ``rehydrate-failed``; the message is processed."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG
    await _crash_and_replay(world, {"url": URL}, lambda: _set_journaled_media(world, "m1", bad))
    assert seen[1:] == [(True, ("unavailable", "rehydrate-failed"), None)]
    await _settled_once_replayed(world)
    await world.close()


@pytest.mark.spec("MEDIA-3", "MEDIA-2")
@pytest.mark.parametrize("error", [TypeError("bad operand"), AttributeError("'str' object has no attribute 'get'"),
                                   KeyError("url")], ids=lambda e: type(e).__name__)
async def test_a_provider_whose_rehydration_breaks_its_contract_costs_only_the_download(
        harness: Any, error: Exception) -> None:
    """MEDIA-3: ``rehydrate_media_ref`` must raise a ``ProviderError`` for an invalid
    reference; one that raises anything else still costs only the download
    (``rehydrate-failed``), never the message."""
    seen: list[tuple[Any, ...]] = []
    world = World(harness, setup=media_setup(seen))
    world.channel.media_bytes[URL] = JPEG

    def broken(stored: dict[str, Any], ref: Any) -> Any:
        raise error

    async def break_it() -> None:
        world.channel.rehydrate_media_ref = broken  # type: ignore[method-assign,assignment]

    await _crash_and_replay(world, {"url": URL}, break_it)
    assert seen[1:] == [(True, ("unavailable", "rehydrate-failed"), None)]
    await _settled_once_replayed(world)
    await world.close()


@pytest.mark.spec("MEDIA-3")
@pytest.mark.parametrize("replayed", [False, True], ids=["live", "replayed"])
@pytest.mark.parametrize("error", [OSError("connection reset"), RuntimeError("boom"), ValueError("bad ref")],
                         ids=lambda e: type(e).__name__)
async def test_any_failed_download_resolves_none_or_raises_media_unavailable(
        harness: Any, replayed: bool, error: Exception) -> None:
    """MEDIA-3 (issue 12): ``load_media_of`` without ``throw_on_error`` resolves None
    for any failed download — not only a ``ProviderError`` — and with it raises
    ``MediaUnavailableError`` (``rehydrate-failed``, the provider's error as its cause).
    The message is processed either way."""
    causes: list[BaseException | None] = []
    seen: list[tuple[Any, ...]] = []

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            try:
                strict: Any = ("bytes", await load_media_of(ctx, throw_on_error=True))
            except MediaUnavailableError as exc:
                strict = ("unavailable", exc.reason)
                causes.append(exc.__cause__)
            seen.append((ctx.replayed, strict, await load_media_of(ctx)))
            await ctx.reply("processed")

    world = World(harness, setup=setup)

    async def failing(ref: Any) -> bytes:
        raise error

    world.channel.download_media = failing  # type: ignore[method-assign]
    if replayed:
        await _crash_and_replay(world, {"url": URL})
        await _settled_once_replayed(world)
    else:
        await world.start()
        await world.receive("c1", "", id="m1", media={"url": URL})
        assert world.named("error") == []
    assert seen[-1] == (replayed, ("unavailable", "rehydrate-failed"), None)
    assert causes[-1] is error
    await world.close()
