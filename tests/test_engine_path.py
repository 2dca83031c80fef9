"""The engine's per-message path after issue 16: what one message costs the journal
(four writes, no read: the reply of an inbound journaled just now is journaled without
looking its key up first), that a send journaled before under a reply's key is still
answered from the outbox — by the journal write's conflict when the lookup was skipped,
with the ``before("send")`` hooks not run again when this process used that key
(OUT-10: explore found it when a handler enqueued under its next reply's derived key)
— and that heartbeats still run on the real clock, whose first beat is now a timer
(one per runtime, shared by its blocks: ``heartbeat.FirstBeats``).

Async code runs through ``asyncio.run`` inside plain tests. Nothing here times anything:
the real-clock test waits for events, with a long timeout only so that a broken
heartbeat fails instead of hanging."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from botmesh.core import Bot, MemoryStore
from botmesh.core import content as contentlib
from botmesh.core.clock import RealClock
from botmesh.core.heartbeat import FirstBeats, Heartbeat
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh.core.records import OutboxRecord
from botmesh.core.spi import Versioned
from botmesh.core.testing import MockProvider

T = TypeVar("T")
spec = pytest.mark.spec
GUARD_S = 120.0  # only so that a missing heartbeat fails rather than hangs


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class CountingKv(MemoryKv):
    """A MemoryKv counting its calls by method."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        self.calls["get"] += 1
        return await super().get(scope, space, key)

    async def put(self, scope: str, space: str, key: str, value: dict[str, Any], **kw: Any) -> int:
        self.calls["put"] += 1
        return await super().put(scope, space, key, value, **kw)


def replying_bot(kv: MemoryKv, provider: MockProvider, **durability: Any) -> Bot:
    bot = Bot(provider, MemoryStore(), {"backend": KvDurability(kv, name="counting"), **durability})

    @bot.otherwise
    async def reply(ctx: Any) -> None:
        await ctx.reply("ok")

    return bot


@spec("INB-1", "OUT-1", "OUT-2")
def test_a_message_costs_four_journal_writes_and_no_read() -> None:
    """One inbound and one reply: the inbound journaled, the reply journaled in state
    ``sending``, marked sent, the inbound completed — four CAS writes, no read: not
    before a CAS (the records were written last by this instance), not of a next part
    after a whole reply, and not of the reply's key (the inbound was journaled just
    now and no explicit key of that shape was used here). Replies all went out."""

    async def body() -> Counter[str]:
        kv = CountingKv()
        provider = MockProvider()
        bot = replying_bot(kv, provider, poll_ms="1h")  # no sweep pass in between
        await bot.start()
        await provider.receive("c1", "warm-up", id="warm")
        kv.calls.clear()
        for i in range(5):
            await provider.receive("c1", "hi", id=f"m{i}")
        calls = Counter(kv.calls)
        await bot.stop()
        assert provider.texts() == ["ok"] * 6
        return calls

    calls = run(body())
    assert calls == Counter(put=20), f"5 messages: expected 20 writes and no read, got {dict(calls)}"


@spec("OUT-2", "OUT-10")
@pytest.mark.parametrize("how", ["enqueue", "send"])
def test_a_reply_under_a_key_this_process_used_explicitly_is_looked_up_first(how: str) -> None:
    """OUT-10 (found by explore): a handler that first sends (or enqueues) under the
    derived key its next reply will take, then replies. The reply is answered from the
    outbox without running the ``before("send")`` hooks a second time: an explicit key
    of the derived shape used in this process turns the lookup back on. One text goes
    out, once; with the lookup skipped the hooks ran twice."""

    async def body() -> tuple[list[str], list[Any], dict[str, int]]:
        kv = CountingKv()
        provider = MockProvider()
        bot = Bot(provider, MemoryStore(), {"backend": KvDurability(kv, name="counting"), "poll_ms": "1h"})
        hooked: list[Any] = []
        bot.before("send", lambda chat_id, content: hooked.append(content.get("text")))

        @bot.otherwise
        async def handler(ctx: Any) -> None:
            key = f"{ctx.record_id}:1"
            if how == "enqueue":
                await ctx.bot.enqueue(ctx.event.chat_id, "first", idempotency_key=key)
            else:
                await ctx.bot.send(ctx.event.chat_id, "first", idempotency_key=key)
            await ctx.reply("first")

        await bot.start()
        await provider.receive("c1", "hi", id="m1")
        for _ in range(3):  # the enqueued send's delivery task
            await asyncio.sleep(0)
        assert bot.durability is not None
        metrics = bot.durability.metrics()
        await bot.stop()
        return provider.texts(), hooked, metrics

    texts, hooked, metrics = run(body())
    assert hooked == ["first"], f"the hooks ran {len(hooked)} times for one journaled send: {hooked}"
    assert texts == ["first"], texts
    assert metrics["outbox_journaled"] == 1, metrics


@spec("OUT-2", "OUT-5", "OUT-10")
@pytest.mark.parametrize("recorded_text", ["ok", "something else"], ids=["same-content", "diverged"])
def test_a_fresh_inbound_whose_reply_key_is_in_the_outbox_is_answered_from_it(recorded_text: str) -> None:
    """An inbound journaled just now whose reply's derived key is recorded already (an
    explicit key of another send, or a record left by a purged inbound of the same id):
    the reply is answered from the outbox (OUT-2), not sent again; content other than
    recorded is counted as diverged and sent under a key of its own (OUT-5,
    ``on_diverged`` default ``send``), the recorded one left as it was. The reply's key
    is not looked up first (a record of another process or an earlier life of the id:
    this process never used the key), so the ``before("send")`` hooks run once here in
    both cases — once per incarnation, as OUT-10 allows — and when the key turns out
    recorded their output is dropped."""

    async def body() -> tuple[list[str], dict[str, int], OutboxRecord | None, list[Any]]:
        kv = MemoryKv()
        provider = MockProvider()
        bot = replying_bot(kv, provider, poll_ms="1h")
        hooked: list[Any] = []
        bot.before("send", lambda chat_id, content: hooked.append(content.get("text")))
        await bot.start()
        assert bot.durability is not None
        scope, backend = bot.durability.scope, bot.durability.backend
        content = contentlib.encode(contentlib.normalize(recorded_text))
        left = OutboxRecord(key="m1:1", chat_id="c1", content=content,
                            fingerprint=contentlib.fingerprint("c1", content), state="sent", message_id="earlier",
                            created_at=1.0, updated_at=1.0, sent_at=1.0)
        _, created = await backend.outbox_journal(scope, left)
        assert created
        await provider.receive("c1", "hi", id="m1")
        metrics = bot.durability.metrics()
        stored = await backend.outbox_get(scope, "m1:1")
        inbound = await backend.inbox_get(scope, "m1")
        await bot.stop()
        assert inbound is not None and inbound.state == "done"
        return provider.texts(), metrics, stored, hooked

    texts, metrics, stored, hooked = run(body())
    if recorded_text == "ok":
        assert texts == [], f"the recorded reply must not be sent again; sent {texts}"
        assert metrics["outbox_deduped"] == 1, metrics
        assert metrics["outbox_diverged"] == 0, metrics
    else:
        assert metrics["outbox_diverged"] == 1, metrics
        assert texts == ["ok"], f"on_diverged=send: the new content is sent once; sent {texts}"
    assert hooked == ["ok"], f"the hooks must run once: {hooked}"
    assert stored is not None and (stored.state, stored.message_id) == ("sent", "earlier")


class BeatSignals(KvDurability):
    """Sets an event at the first inbox and at the first outbox heartbeat that lands."""

    def __init__(self) -> None:
        super().__init__(MemoryKv(), name="beats")
        self.inbox_beat = asyncio.Event()
        self.outbox_beat = asyncio.Event()

    async def inbox_heartbeat(self, scope: str, id: str, **kw: Any) -> bool:
        ok = await super().inbox_heartbeat(scope, id, **kw)
        if ok:
            self.inbox_beat.set()
        return ok

    async def outbox_heartbeat(self, scope: str, key: str, **kw: Any) -> bool:
        ok = await super().outbox_heartbeat(scope, key, **kw)
        if ok:
            self.outbox_beat.set()
        return ok


@spec("LEASE-1")
def test_heartbeats_renew_leases_on_the_real_clock() -> None:
    """On the real clock the first beat of a lease is a timer (no task until it is due):
    a handler and a provider call that outlast a third of their leases still get their
    leases renewed, then complete with their token (no stale lease)."""

    async def body() -> None:
        backend = BeatSignals()

        class SlowProvider(MockProvider):
            async def send(self, chat_id: str, content: Any) -> str:
                await asyncio.wait_for(backend.outbox_beat.wait(), GUARD_S)
                return await super().send(chat_id, content)

        provider = SlowProvider()
        bot = Bot(provider, MemoryStore(), {"backend": backend, "poll_ms": "1h",
                                            "inbox": {"lease_ms": "30ms"}, "outbox": {"lease_ms": "30ms"}})

        @bot.otherwise
        async def slow(ctx: Any) -> None:
            await asyncio.wait_for(backend.inbox_beat.wait(), GUARD_S)
            await ctx.reply("ok")

        await bot.start()
        await provider.receive("c1", "hi", id="m1")
        assert bot.durability is not None
        metrics = bot.durability.metrics()
        inbound = await backend.inbox_get(bot.durability.scope, "m1")
        outbound = await backend.outbox_get(bot.durability.scope, "m1:1")
        await bot.stop()
        assert provider.texts() == ["ok"]
        assert metrics["stale_leases"] == 0, metrics
        assert inbound is not None and (inbound.state, inbound.token) == ("done", 1)
        assert outbound is not None and (outbound.state, outbound.token) == ("sent", 1)

    run(body())


@spec("LEASE-1")
def test_a_shared_first_beat_timer_is_moved_earlier_for_a_shorter_lease() -> None:
    """``FirstBeats`` arms one timer for the earliest first beat of a runtime's blocks: a
    block with a short lease entered inside one with a long lease (first beat due in 20
    minutes) still gets its first beat a third of its own lease in, and the long block
    none meanwhile. Beats after the first one are the block's own task."""

    async def body() -> None:
        first_beats = FirstBeats()
        seen: list[str] = []
        short_beats = asyncio.Event()

        async def beat_long(until: float) -> bool:
            seen.append("long")
            return True

        async def beat_short(until: float) -> bool:
            seen.append("short")
            if seen.count("short") == 2:
                short_beats.set()
            return True

        async with Heartbeat(RealClock(), beat_long, 3_600_000.0, first_beats):
            async with Heartbeat(RealClock(), beat_short, 30.0, first_beats):
                await asyncio.wait_for(short_beats.wait(), GUARD_S)
        assert seen == ["short", "short"], f"only the short lease may have beaten, twice: {seen}"

    run(body())


@spec("OUT-15")
@pytest.mark.parametrize("hooked", [True, False], ids=["after-hook", "no-hook"])
def test_a_durable_send_logs_and_hooks_what_a_plain_send_does(hooked: bool) -> None:
    """The engine hands the bot the outbox's journal form of what it sent (bytes as
    ``{"$bytes": base64}``): the ``after("send")`` hooks still get the content decoded
    (bytes), and the message log holds what the bot without durability logs."""

    async def one(durability: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        provider = MockProvider()
        bot = Bot(provider, MemoryStore(), durability)
        hooked_content: list[dict[str, Any]] = []
        if hooked:
            @bot.after("send")
            def seen(chat_id: str, content: dict[str, Any], message_id: str) -> None:
                hooked_content.append(content)

        @bot.otherwise
        async def reply(ctx: Any) -> None:
            await ctx.reply({"text": "pic", "blob": b"\x00\xffpng", "meta": {"parts": [b"a", 1.5]}})

        await bot.start()
        await provider.receive("c1", "hi", id="m1")
        await bot.stop()
        log = [{k: v for k, v in m.items() if k not in ("at", "key")} for m in await bot.messages("c1")]
        return hooked_content, log

    async def body() -> None:
        durable_hooked, durable_log = await one({})
        plain_hooked, plain_log = await one(None)
        sent = {"text": "pic", "blob": b"\x00\xffpng", "meta": {"parts": [b"a", 1.5]}}
        assert durable_hooked == plain_hooked == ([sent] if hooked else [])
        assert durable_log == plain_log, f"durable log {durable_log} != plain log {plain_log}"
        out = [m for m in durable_log if m["direction"] == "out"]
        assert out and out[0]["content"]["blob"] == {"$bytes": "AP9wbmc="}, out

    run(body())


@spec("OUT-15")
@pytest.mark.parametrize(
    "content",
    [{"text": "hi", "parts": [1, 2.5, None, {"deep": [True]}]}, {"media": {"data": b"\x00\xff"}, "pair": ("a", 1)}],
    ids=["plain", "bytes-and-tuple"],
)
def test_the_memory_store_logs_a_copy_of_each_entry(content: dict[str, Any]) -> None:
    """``MemoryStore.append_message`` keeps its own deep copy of an entry, plain JSON or
    not (bytes, a tuple: kept as they are): what the caller changes afterwards, at any
    depth, is not in the log, and what the log hands out is a copy too."""

    async def body() -> None:
        store = MemoryStore()
        entry = {"direction": "out", "chat_id": "c", "content": content, "at": 1.5}
        await store.append_message(entry)
        logged = (await store.messages("c"))[0]
        assert logged == entry and logged["content"] is not content
        for value in content.values():
            if isinstance(value, (dict, list)):
                value.clear()
        entry["chat_id"] = "changed"
        again = (await store.messages("c"))[0]
        assert again == logged and type(again["content"].get("pair", ())) is tuple
        again["content"].clear()
        assert (await store.messages("c"))[0] == logged

    run(body())
