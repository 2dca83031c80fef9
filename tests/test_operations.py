"""Operating durability: events, metrics, the DLQ and the operator API (OPS-1, OPS-2),
retention (OPS-3), scopes on a shared backend (SCOPE-1..3, OUT-4), enqueue (OUT-10),
deferral of inline sends (OUT-9) and per-chat order (OUT-11)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from botmesh.core import (
    BackendUnavailableError,
    Bot,
    ProviderError,
    SendDeferredError,
    SendFailedError,
    Store,
    UnsupportedContentError,
    VirtualClock,
)
from botmesh.core.testing import MockProvider, SimulatedCrash

from botmesh_testkit.crash import CrashableProvider, crashable
from botmesh_testkit.crash import World

FAST = {"base_ms": 1000, "cap_ms": 60_000, "jitter": 0}
OPS2_METRICS = {
    "inbound_journaled",
    "inbound_duplicates",
    "inbound_replayed",
    "inbound_dead",
    "outbox_journaled",
    "outbox_deduped",
    "outbox_retried",
    "outbox_deferred",
    "outbox_dead",
    "outbox_ambiguous",
    "outbox_bypassed",
    "stale_leases",
    "outbox_diverged",
}


class FlakyStore(Store):
    """A store that can be "down" (INB-5): every call raises while ``state["down"]``."""

    def __init__(self, inner: Store, state: dict[str, Any]) -> None:
        self.inner = inner
        self.state = state

    def _check(self) -> None:
        if self.state.get("down") is not None:
            raise self.state["down"]

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def get(self, namespace: str, key: str) -> Any:
        self._check()
        return await self.inner.get(namespace, key)

    async def set(self, namespace: str, key: str, value: Any) -> None:
        self._check()
        await self.inner.set(namespace, key, value)

    async def delete(self, namespace: str, key: str) -> None:
        self._check()
        await self.inner.delete(namespace, key)

    async def append_message(self, entry: dict[str, Any]) -> None:
        self._check()
        await self.inner.append_message(entry)

    async def messages(self, chat_id: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        return await self.inner.messages(chat_id, limit=limit)


def echo_setup(runs: list[str], state: dict[str, Any] | None = None) -> Any:
    """Handlers: every message is answered ``echo: <text>``; ``runs`` records each
    handler run (by event id). With ``state``, the store can be taken down."""

    def setup(bot: Bot) -> None:
        if state is not None:
            bot.store = FlakyStore(bot.store, state)

        @bot.otherwise
        async def echo(ctx: Any) -> None:
            runs.append(ctx.event.id)
            await ctx.reply(f"echo: {ctx.text}")

    return setup


def fail_text(world: World, text: str, error: BaseException, times: int | None = None) -> None:
    count = [0]

    def predicate(chat_id: str, content: dict[str, Any]) -> bool:
        if content.get("text") != text or (times is not None and count[0] >= times):
            return False
        count[0] += 1
        return True

    world.channel.fail_when(predicate, error)


# -- OPS-2: metrics ---------------------------------------------------------------------------------


@pytest.mark.spec("OPS-2")
async def test_metrics_have_exactly_the_keys_of_ops2(harness: Any) -> None:
    """OPS-2: ``metrics()`` has exactly the 13 counters, all integers, zero at start;
    it is a copy (mutating it changes nothing)."""
    runs: list[str] = []
    world = World(harness, setup=echo_setup(runs))
    bot = await world.start()
    assert bot.durability is not None
    m = bot.durability.metrics()
    assert set(m) == OPS2_METRICS and len(m) == 13
    assert all(type(v) is int and v == 0 for v in m.values())
    m["inbound_journaled"] = 99
    await world.receive("c1", "hi", id="m1")
    await world.receive("c1", "hi", id="m1")  # redelivery
    m = bot.durability.metrics()
    assert set(m) == OPS2_METRICS
    assert m["inbound_journaled"] == 1
    assert m["outbox_journaled"] == 1
    assert m["inbound_duplicates"] == 1
    assert runs == ["m1"]
    await world.close()


# -- OPS-1 / OPS-2: the DLQ and the operator API ------------------------------------------------------


@pytest.mark.spec("OPS-1", "OPS-2", "INB-5")
async def test_dead_inbound_is_listed_and_replayed(harness: Any) -> None:
    """OPS-2: an inbound event that keeps failing before its handlers (the store is
    down) is in ``inbox.list(state="dead")`` after ``inbox.max_attempts``; OPS-1: a
    ``durability:dead`` event carries ``kind``, ``id`` and ``error``;
    ``replay_inbound(id)`` processes it again once the store is back."""
    runs: list[str] = []
    state: dict[str, Any] = {"down": BackendUnavailableError("store is down")}
    world = World(harness, setup=echo_setup(runs, state), durability={"inbox": {"max_attempts": 2, "backoff": FAST}})
    bot = await world.start()
    assert bot.durability is not None
    await world.receive("c1", "hello", id="m1")
    await world.drain()
    assert runs == []
    dead = await bot.durability.inbox.list(state="dead")
    assert [(r.id, r.attempts) for r in dead] == [("m1", 2)]
    assert await bot.durability.inbox.list(state="done") == []
    events = world.named("durability:dead")
    assert [(e["kind"], e["id"]) for e in events] == [("inbox", "m1")]
    assert "store is down" in str(events[0]["error"])
    assert bot.durability.metrics()["inbound_dead"] == 1

    state["down"] = None
    assert await bot.durability.replay_inbound("m1") is True
    assert runs == ["m1"]
    assert world.channel.texts() == ["echo: hello"]
    assert await bot.durability.inbox.list(state="dead") == []
    assert [r.state for r in await bot.durability.inbox.list()] == ["done"]
    assert bot.durability.metrics()["inbound_replayed"] >= 1
    await world.close()


@pytest.mark.spec("OPS-2", "INB-9", "OUT-2")
async def test_replay_of_a_processed_inbound_dedupes_its_sends(harness: Any) -> None:
    """OPS-2/INB-9: ``replay_inbound`` runs the handler again; its sends are answered
    from the outbox by key (nothing goes out twice). An unknown id gives False."""
    runs: list[str] = []
    world = World(harness, setup=echo_setup(runs))
    bot = await world.start()
    assert bot.durability is not None
    await world.receive("c1", "hello", id="m1")
    assert await bot.durability.replay_inbound("m1") is True
    assert runs == ["m1", "m1"]
    assert world.channel.texts() == ["echo: hello"]
    assert bot.durability.metrics()["outbox_deduped"] == 1
    assert await bot.durability.replay_inbound("nope") is False
    assert runs == ["m1", "m1"]
    await world.close()


@pytest.mark.spec("OPS-1", "OPS-2", "OUT-8")
async def test_dead_send_is_listed_retried_and_discarded(harness: Any) -> None:
    """OPS-2: a send that died is in ``outbox.list(state="dead")``; OPS-1: its
    ``durability:dead`` event has kind ``outbox``, its key as id, the error;
    ``retry_send(key)`` sends it again; ``discard(key)`` forgets a record."""
    world = World(harness)
    bot = await world.start()
    assert bot.durability is not None
    fail_text(world, "doomed", UnsupportedContentError("unsupported"))
    fail_text(world, "also doomed", UnsupportedContentError("unsupported"))
    with pytest.raises(SendFailedError) as info:
        await bot.send("c1", "doomed", idempotency_key="k-dead")
    assert info.value.key == "k-dead"
    with pytest.raises(SendFailedError):
        await bot.send("c1", "also doomed", idempotency_key="k-gone")
    assert sorted(r.key for r in await bot.durability.outbox.list(state="dead")) == ["k-dead", "k-gone"]
    events = world.named("durability:dead")
    assert [(e["kind"], e["id"]) for e in events] == [("outbox", "k-dead"), ("outbox", "k-gone")]
    assert isinstance(events[0]["error"], UnsupportedContentError)
    assert bot.durability.metrics()["outbox_dead"] == 2

    world.channel.clear_failures()
    assert await bot.durability.retry_send("k-dead") is True
    assert world.channel.texts() == ["doomed"]
    assert (await bot.durability.outbox.get("k-dead")).state == "sent"

    assert await bot.durability.outbox.discard("k-gone") is True
    assert await bot.durability.outbox.get("k-gone") is None
    assert await bot.durability.outbox.list(state="dead") == []
    assert await bot.durability.outbox.discard("k-gone") is False
    # a sent record cannot be retried, nor an unknown key
    assert await bot.durability.retry_send("k-dead") is False
    assert await bot.durability.retry_send("no-such-key") is False
    await world.clock.advance(5000)
    assert world.channel.texts() == ["doomed"]
    await world.close()


@pytest.mark.spec("OPS-2", "OUT-9")
async def test_retry_send_of_a_failed_send_goes_now(harness: Any) -> None:
    """OPS-2: ``retry_send`` of a ``failed`` send (waiting for its backoff) sends it at
    once, without waiting for the backoff; ``discard`` of a failed send means it never
    goes out."""
    world = World(harness, durability={"outbox": {"inline_max_ms": 0, "backoff": {"base_ms": "1m", "cap_ms": "1h"}}})
    bot = await world.start()
    assert bot.durability is not None
    world.channel.fail_next(ProviderError("blip"), times=2)
    with pytest.raises(SendDeferredError):
        await bot.send("c1", "later", idempotency_key="k-failed")
    with pytest.raises(SendDeferredError):
        await bot.send("c1", "never", idempotency_key="k-drop")
    assert (await bot.durability.outbox.get("k-failed")).state == "failed"
    t0 = world.clock.now()
    assert await bot.durability.retry_send("k-failed") is True
    assert world.clock.now() == t0
    assert world.channel.texts() == ["later"]
    assert await bot.durability.outbox.discard("k-drop") is True
    await world.clock.advance(5 * 60_000)
    assert world.channel.texts() == ["later"]
    await world.close()


@pytest.mark.spec("OPS-2", "OPS-1", "OUT-14", "TEST-3")
async def test_retry_send_of_an_unknown_send_resends_it(harness: Any) -> None:
    """OPS-2: a send left ``unknown`` by a crash (OUT-14, skip policy; OPS-1 event
    ``durability:ambiguous`` with key and chat_id) is sent again by ``retry_send``."""
    world = World(harness)
    await world.start(crash=True)
    assert world.crashable is not None
    world.crashable.crash_after("provider.send")
    outcome = await world.call(lambda bot: bot.send("c1", "maybe", idempotency_key="k-amb"))
    assert isinstance(outcome, SimulatedCrash)
    assert world.channel.texts() == ["maybe"]
    bot = await world.restart()
    assert bot.durability is not None
    await world.drain()
    assert (await bot.durability.outbox.get("k-amb")).state == "unknown"
    assert world.channel.texts() == ["maybe"]
    assert [(e["key"], e["chat_id"]) for e in world.named("durability:ambiguous")] == [("k-amb", "c1")]
    assert bot.durability.metrics()["outbox_ambiguous"] == 1
    assert await bot.durability.retry_send("k-amb") is True
    assert world.channel.texts() == ["maybe", "maybe"]
    assert (await bot.durability.outbox.get("k-amb")).state == "sent"
    await world.close()


# -- OPS-3: retention -----------------------------------------------------------------------------


@pytest.mark.spec("OPS-3", "INB-4")
async def test_redelivery_before_retention_is_a_duplicate(harness: Any) -> None:
    """OPS-3: before ``retention`` has passed the records are kept and a redelivery (to
    a restarted bot, so no in-memory dedupe helps) is recognised."""
    runs: list[str] = []
    world = World(harness, setup=echo_setup(runs), durability={"retention": "1m", "poll_ms": "1s"})
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    await world.clock.advance(50_000)
    assert bot.durability is not None
    assert [r.state for r in await bot.durability.inbox.list()] == ["done"]
    assert [r.state for r in await bot.durability.outbox.list()] == ["sent"]
    bot = await world.restart()
    await world.receive("c1", "hi", id="m1")
    assert runs == ["m1"]
    assert world.channel.texts() == ["echo: hi"]
    assert bot.durability is not None and bot.durability.metrics()["inbound_duplicates"] == 1
    await world.close()


@pytest.mark.spec("OPS-3")
async def test_records_are_purged_after_retention(harness: Any) -> None:
    """OPS-3: ``done``/``sent`` records are purged once ``retention`` has passed; a
    redelivery after the purge is processed again."""
    runs: list[str] = []
    world = World(harness, setup=echo_setup(runs), durability={"retention": "1m", "poll_ms": "1s"})
    bot = await world.start()
    assert bot.durability is not None
    await world.receive("c1", "hi", id="m1")
    await world.clock.advance(125_000)  # retention plus slack for the purge period
    assert await bot.durability.inbox.list() == []
    assert await bot.durability.outbox.list() == []
    bot = await world.restart()
    await world.receive("c1", "hi", id="m1")
    assert runs == ["m1", "m1"]
    assert world.channel.texts() == ["echo: hi", "echo: hi"]
    assert bot.durability is not None
    assert bot.durability.metrics()["inbound_duplicates"] == 0
    assert bot.durability.metrics()["inbound_journaled"] == 1
    await world.close()


@pytest.mark.spec("OPS-3")
async def test_dead_records_are_not_purged(harness: Any) -> None:
    """OPS-3: retention purges ``done``/``sent`` records only: the DLQ stays."""
    world = World(harness, durability={"retention": "1m", "poll_ms": "1s"})
    bot = await world.start()
    assert bot.durability is not None
    fail_text(world, "doomed", UnsupportedContentError("no"))
    with pytest.raises(SendFailedError):
        await bot.send("c1", "doomed", idempotency_key="k")
    await bot.send("c1", "fine", idempotency_key="ok")
    await world.clock.advance(5 * 60_000)
    assert [(r.key, r.state) for r in await bot.durability.outbox.list()] == [("k", "dead")]
    await world.close()


@pytest.mark.spec("OPS-3")
async def test_retention_zero_keeps_records(harness: Any) -> None:
    """OPS-3/CONF: ``retention=0`` keeps ``done``/``sent`` records for ever."""
    runs: list[str] = []
    world = World(harness, setup=echo_setup(runs), durability={"retention": 0, "poll_ms": "1d"})
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    await world.clock.advance(30 * 86_400_000)
    assert bot.durability is not None
    assert [r.state for r in await bot.durability.inbox.list()] == ["done"]
    assert [r.state for r in await bot.durability.outbox.list()] == ["sent"]
    bot = await world.restart()
    await world.receive("c1", "hi", id="m1")
    assert runs == ["m1"]
    assert bot.durability is not None and bot.durability.metrics()["inbound_duplicates"] == 1
    await world.close()


# -- SCOPE: several bots on one backend -----------------------------------------------------------


class _Pair:
    """Two bots (``bot_id`` "a" and "b") on ONE backend object and one store."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.chan: dict[str, MockProvider] = {"a": MockProvider(), "b": MockProvider()}
        self.runs: list[tuple[str, str]] = []
        self.bots: list[Bot] = []

    def make(self, name: str, backend: Any, store: Store, provider: Any = None) -> Bot:
        bot = Bot(
            provider or self.chan[name], store, {"backend": backend, "instance_id": f"inst-{name}"},
            bot_id=name, clock=self.clock, rng=random.Random(0),
        )

        @bot.otherwise
        async def handler(ctx: Any) -> None:
            self.runs.append((name, ctx.event.id))
            await ctx.reply(f"{name}: {ctx.text}")

        self.bots.append(bot)
        return bot

    async def close(self) -> None:
        for bot in self.bots:
            await bot.abandon()


@pytest.mark.spec("SCOPE-1")
def test_scope_is_derived_from_the_namespace() -> None:
    """SCOPE-1: ``bot.durability.scope`` is derived from tenant, environment, bot and
    connection: any difference gives another scope, the same namespace the same one."""
    def scope(**kw: Any) -> str:
        bot = Bot(MockProvider(), None, {}, clock=VirtualClock(), **kw)
        assert bot.durability is not None
        return bot.durability.scope

    variants = [
        {},
        {"bot_id": "other"},
        {"connection_id": "wa-2"},
        {"tenant_id": "t1"},
        {"tenant_id": "t2"},
        {"environment_id": "prod"},
        {"tenant_id": "t1", "environment_id": "prod"},
    ]
    scopes = [scope(**v) for v in variants]
    assert len(set(scopes)) == len(scopes)
    assert scope(tenant_id="t1", bot_id="x") == scope(tenant_id="t1", bot_id="x")


@pytest.mark.spec("SCOPE-1", "SCOPE-2", "INB-4")
async def test_two_bots_on_one_backend_each_see_only_their_records(harness: Any) -> None:
    """SCOPE-2: two bots share one backend object; the same event id reaches both and
    each processes it (no cross-bot dedupe); each lists only its own records."""
    backend, store = await harness.open()
    pair = _Pair()
    a, b = pair.make("a", backend, store), pair.make("b", backend, store)
    await a.start()
    await b.start()
    try:
        assert a.durability is not None and b.durability is not None
        assert a.durability.scope != b.durability.scope
        await pair.chan["a"].receive("c1", "hi", id="m1")
        await pair.chan["b"].receive("c1", "hi", id="m1")
        await pair.chan["a"].receive("c1", "hi", id="m1")  # a redelivery to a
        assert sorted(pair.runs) == [("a", "m1"), ("b", "m1")]
        assert pair.chan["a"].texts() == ["a: hi"]
        assert pair.chan["b"].texts() == ["b: hi"]
        assert a.durability.metrics()["inbound_duplicates"] == 1
        assert b.durability.metrics()["inbound_duplicates"] == 0
        assert [r.id for r in await a.durability.inbox.list()] == ["m1"]
        assert [r.id for r in await b.durability.inbox.list()] == ["m1"]
        assert [(r.key, r.message_id) for r in await a.durability.outbox.list()] == [
            ("m1:1", pair.chan["a"].sent[0].message_id)
        ]
        assert [(r.key, r.message_id) for r in await b.durability.outbox.list()] == [
            ("m1:1", pair.chan["b"].sent[0].message_id)
        ]
        # replaying b's record never touches a's
        assert await b.durability.replay_inbound("m1") is True
        assert pair.chan["a"].texts() == ["a: hi"] and pair.chan["b"].texts() == ["b: hi"]
        assert b.durability.metrics()["outbox_deduped"] == 1
        assert a.durability.metrics()["outbox_deduped"] == 0
    finally:
        await pair.close()


@pytest.mark.spec("SCOPE-2", "LEASE-2", "LEASE-4", "TEST-3")
async def test_a_bot_never_claims_another_bots_abandoned_record(harness: Any) -> None:
    """SCOPE-2: bot a dies while processing m2; bot b keeps sweeping the shared backend
    long past a's lease and never claims it; a's restart recovers it."""
    backend, store = await harness.open()
    pair = _Pair()
    dying = crashable(backend)
    a = pair.make("a", dying, store, provider=CrashableProvider(dying, pair.chan["a"]))
    b = pair.make("b", backend, store)
    await a.start()
    await b.start()
    try:
        assert a.durability is not None and b.durability is not None
        dying.crash_before("inbox.complete")
        with pytest.raises(SimulatedCrash):
            await a.provider.deliver(pair.chan["a"].event("c1", "work", id="m2"))
        await a.abandon()
        await pair.clock.advance(3 * 60_000)  # far beyond inbox.lease_ms (60 s)
        assert pair.runs == [("a", "m2")]
        assert await b.durability.inbox.list() == []
        stuck = await backend.inbox_get(a.durability.scope, "m2")
        assert stuck is not None and (stuck.state, stuck.owner, stuck.token) == ("leased", "inst-a", 1)
        # the channel of a already got the reply: a's restart answers from the outbox
        a2 = pair.make("a", backend, store)
        await a2.start()
        await pair.clock.advance(2000)
        assert pair.runs == [("a", "m2"), ("a", "m2")]
        assert a2.durability is not None
        assert [(r.id, r.state) for r in await a2.durability.inbox.list()] == [("m2", "done")]
        assert pair.chan["a"].texts() == ["a: work"]
        assert pair.chan["b"].calls == []
    finally:
        await pair.close()


@pytest.mark.spec("OUT-4", "SCOPE-2", "OUT-10")
async def test_explicit_keys_are_per_bot(harness: Any) -> None:
    """OUT-4: two bots on one backend both enqueue ``reminder:1``: each sends its own;
    a second enqueue of the key on one bot does nothing."""
    backend, store = await harness.open()
    pair = _Pair()
    a, b = pair.make("a", backend, store), pair.make("b", backend, store)
    await a.start()
    await b.start()
    try:
        assert a.durability is not None and b.durability is not None
        assert await a.enqueue("c1", "from a", idempotency_key="reminder:1") == {"key": "reminder:1"}
        assert await b.enqueue("c1", "from b", idempotency_key="reminder:1") == {"key": "reminder:1"}
        assert await a.enqueue("c1", "from a again", idempotency_key="reminder:1") == {"key": "reminder:1"}
        await pair.clock.advance(3000)
        assert pair.chan["a"].texts() == ["from a"]
        assert pair.chan["b"].texts() == ["from b"]
        assert [(r.key, r.state) for r in await a.durability.outbox.list()] == [("reminder:1", "sent")]
        assert [(r.key, r.state) for r in await b.durability.outbox.list()] == [("reminder:1", "sent")]
        # and an explicit send under the key is deduped per bot
        again = await b.send("c1", "from b", idempotency_key="reminder:1")
        assert again.deduped and again.message_id == pair.chan["b"].sent[0].message_id
    finally:
        await pair.close()


@pytest.mark.spec("SCOPE-3")
@pytest.mark.skip(reason="SCOPE-3 is a documentation requirement (a custom backend without scope() must not be shared)")
def test_custom_backend_without_scope_is_documented() -> None:
    """SCOPE-3: documentation only."""


# -- OUT-10: enqueue ----------------------------------------------------------------------------


@pytest.mark.spec("OUT-10", "OUT-6")
async def test_enqueue_returns_at_once_and_the_sweep_delivers(harness: Any) -> None:
    """OUT-10: ``enqueue`` runs the ``before("send")`` hooks once, journals the send and
    returns ``{key}`` without waiting for the channel; a second enqueue of the key does
    nothing; the sweep delivers it, runs ``after("send")`` and writes the message log.
    OUT-6: the channel never sees the key."""
    before: list[dict[str, Any]] = []
    after: list[tuple[str, str, str]] = []

    def setup(bot: Bot) -> None:
        @bot.before("send")
        def sign(chat_id: str, content: dict[str, Any]) -> dict[str, Any]:
            before.append(dict(content))
            return {**content, "text": content["text"] + " -- bot"}

        @bot.after("send")
        def sent(chat_id: str, content: dict[str, Any], message_id: str) -> None:
            after.append((chat_id, content["text"], message_id))

    world = World(harness, setup=setup, durability={"outbox": {"backoff": FAST}})
    bot = await world.start()
    assert bot.durability is not None
    world.channel.fail_next(ProviderError("busy"), times=3)
    t0 = world.clock.now()
    assert await bot.enqueue("c1", "remember the milk", idempotency_key="reminder:1") == {"key": "reminder:1"}
    assert world.clock.now() == t0
    assert before == [{"text": "remember the milk"}]
    rec = await bot.durability.outbox.get("reminder:1")
    assert rec is not None and rec.state in ("pending", "sending", "failed")
    assert await bot.enqueue("c1", "something else", idempotency_key="reminder:1") == {"key": "reminder:1"}
    assert len(before) == 1
    await world.drain()
    assert world.channel.texts() == ["remember the milk -- bot"]
    assert len(world.channel.calls) == 4
    assert all("reminder:1" not in repr(c.content) for c in world.channel.calls)
    message_id = world.channel.sent[0].message_id
    assert after == [("c1", "remember the milk -- bot", message_id)]
    rec = await bot.durability.outbox.get("reminder:1")
    assert rec is not None and (rec.state, rec.message_id) == ("sent", message_id)
    log = [m for m in await bot.messages("c1") if m["direction"] == "out"]
    assert [(m["message_id"], m["content"].get("text")) for m in log] == [(message_id, "remember the milk -- bot")]
    assert len(before) == 1
    await world.close()


@pytest.mark.spec("OUT-10", "OUT-3")
async def test_enqueue_without_a_key_gets_a_fresh_one(harness: Any) -> None:
    """OUT-10/OUT-3 rule 3: without a key each enqueue gets its own random key, and
    each is delivered."""
    world = World(harness)
    bot = await world.start()
    k1 = (await bot.enqueue("c1", "one"))["key"]
    k2 = (await bot.enqueue("c1", "two"))["key"]
    assert k1 and k2 and k1 != k2
    await world.drain()
    assert world.channel.texts() == ["one", "two"]
    await world.close()


# -- OUT-9: inline retry, then deferral ---------------------------------------------------------


def deferring_setup(outcomes: list[Any]) -> Any:
    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            started = bot.clock.now()
            try:
                outcomes.append(await ctx.reply("important"))
            except SendDeferredError as exc:
                outcomes.append((exc, bot.clock.now() - started))

    return setup


@pytest.mark.spec("OUT-9", "OUT-7")
async def test_reply_retries_inline_then_defers_to_the_sweep(harness: Any) -> None:
    """OUT-9: a reply that keeps failing retryably is retried inline for at most
    ``outbox.inline_max_ms`` of (virtual) time, then raises ``SendDeferredError`` with
    the outbox key (``outbox_deferred`` counts it); the sweep delivers it once the
    channel recovers."""
    outcomes: list[Any] = []
    world = World(
        harness, setup=deferring_setup(outcomes),
        durability={"outbox": {"inline_max_ms": "5s", "retries": 10, "backoff": FAST}},
    )
    bot = await world.start()
    assert bot.durability is not None
    world.channel.fail_when(lambda chat, content: True, ProviderError("outage"))
    async with world.clock.auto():
        await world.receive("c1", "hi", id="m1")
    ((exc, elapsed),) = outcomes
    assert isinstance(exc, SendDeferredError) and exc.key == "m1:1"
    assert 0 < elapsed <= 5000
    inline_calls = len(world.channel.calls)
    assert inline_calls >= 2  # it did retry inline
    assert bot.durability.metrics()["outbox_deferred"] == 1
    rec = await bot.durability.outbox.get("m1:1")
    assert rec is not None and rec.state == "failed"
    assert [r.state for r in await bot.durability.inbox.list()] == ["done"]
    world.channel.clear_failures()
    await world.drain()
    assert world.channel.texts() == ["important"]
    assert len(world.channel.calls) == inline_calls + 1
    rec = await bot.durability.outbox.get("m1:1")
    assert rec is not None and rec.state == "sent"
    await world.close()


@pytest.mark.spec("OUT-9")
async def test_bot_send_defers_too(harness: Any) -> None:
    """OUT-9: ``bot.send`` raises ``SendDeferredError`` with the key after
    ``inline_max_ms`` and the sweep keeps retrying it."""
    world = World(harness, durability={"outbox": {"inline_max_ms": "2s", "backoff": FAST}})
    bot = await world.start()
    assert bot.durability is not None
    world.channel.fail_next(ProviderError("outage"), times=3)
    t0 = world.clock.now()
    async with world.clock.auto():
        with pytest.raises(SendDeferredError) as info:
            await bot.send("c1", "later", idempotency_key="k1")
    assert info.value.key == "k1"
    assert world.clock.now() - t0 <= 2000
    assert world.channel.sent == []
    await world.drain()
    assert world.channel.texts() == ["later"]
    assert bot.durability.metrics()["outbox_deferred"] == 1
    await world.close()


# -- OUT-11: per-chat order ---------------------------------------------------------------------

GUARD_S = 6.0  # real-time guard: the virtual clock reports a stall after settle_timeout_s


@pytest.mark.spec("OUT-11")
async def test_sends_to_one_chat_keep_their_order_while_one_retries(harness: Any) -> None:
    """OUT-11: the first of two sends to one chat fails and is retried inline; the
    second (started while the first waits for its retry) reaches the channel after it.
    A send to another chat is not held up."""
    world = World(harness, durability={"outbox": {"backoff": FAST}})
    world.clock.settle_timeout_s = 3
    bot = await world.start()
    fail_text(world, "first", ProviderError("blip"), times=2)
    try:
        async with world.clock.auto():
            first = asyncio.ensure_future(bot.send("c1", "first", idempotency_key="k1"))
            while not world.channel.calls:
                await asyncio.sleep(0)
            second = asyncio.ensure_future(bot.send("c1", "second", idempotency_key="k2"))
            other = asyncio.ensure_future(bot.send("c2", "elsewhere", idempotency_key="k3"))
            await asyncio.wait_for(asyncio.gather(first, second, other), timeout=GUARD_S)
        assert world.channel.texts("c1") == ["first", "second"]
        assert world.channel.texts("c2") == ["elsewhere"]
        assert [c.content["text"] for c in world.channel.calls if c.chat_id == "c1"] == ["first"] * 3 + ["second"]
        # "elsewhere" went out while "first" was still waiting for its retry
        texts = [c.content["text"] for c in world.channel.calls]
        assert texts.index("elsewhere") < len(texts) - 1 - texts[::-1].index("first")
    finally:
        await world.close()


@pytest.mark.spec("OUT-11")
async def test_replies_of_two_messages_to_one_chat_keep_their_order(harness: Any) -> None:
    """OUT-11: two inbound messages of one chat handled concurrently: the reply of the
    first is retried inline, the reply of the second waits behind it."""
    runs: list[str] = []
    world = World(harness, setup=echo_setup(runs), durability={"outbox": {"backoff": FAST}})
    world.clock.settle_timeout_s = 3
    await world.start()
    fail_text(world, "echo: one", ProviderError("blip"), times=1)
    try:
        async with world.clock.auto():
            one = asyncio.ensure_future(world.receive("c1", "one", id="m1"))
            while not world.channel.calls:
                await asyncio.sleep(0)
            two = asyncio.ensure_future(world.receive("c1", "two", id="m2"))
            await asyncio.wait_for(asyncio.gather(one, two), timeout=GUARD_S)
        assert world.channel.texts() == ["echo: one", "echo: two"]
        assert runs == ["m1", "m2"]
    finally:
        await world.close()
