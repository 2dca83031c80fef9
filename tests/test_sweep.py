"""The background sweep under load and under failure (issue 12): purging keeps up with a
sustained rate (OPS-3); a slow replayed handler never delays a due send; one record's
failure is an ``error`` event and the pass goes on with the others (INB-3, OUT-7);
replays run one at a time in due order, so a message that kills the process at every
replay is the only one dead-lettered (INB-7). Everything runs in virtual time
(``botmesh.core.clock.VirtualClock``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from botmesh.core import Bot, InboundEvent, MemoryDurability, ProviderError, VirtualClock
from botmesh.core.backend import DurabilityBackend
from botmesh.core.memory import MemoryKv
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.spi import Versioned
from botmesh.core.store import MemoryStore
from botmesh.core.testing import MockProvider, SimulatedCrash

from botmesh_testkit.backends.base import BackendHarness
from botmesh_testkit.crash import World
from botmesh_testkit.crash.intercept import InterceptedBackend

spec = pytest.mark.spec
FAST = {"base_ms": 1000, "cap_ms": 60_000, "jitter": 0}


def echo(bot: Bot) -> None:
    @bot.otherwise
    async def handler(ctx: Any) -> None:
        await ctx.reply(f"re:{ctx.text}")


async def journal_sizes(bot: Bot) -> tuple[int, int]:
    d = bot.durability
    assert d is not None
    return (len(await d.backend.inbox_list(d.scope, limit=10**7)),
            len(await d.backend.outbox_list(d.scope, limit=10**7)))


# -- OPS-3: purging keeps up ----------------------------------------------------------------


@spec("OPS-3")
async def test_purging_keeps_up_with_a_sustained_rate() -> None:
    """OPS-3 (issue 12): 20 messages a second (well above the 8/s the old purge of 500
    records per journal per minute kept up with), each answered, for 6 virtual minutes
    under a retention of 1 minute. Every record lives its retention plus at most one
    purge period (and a pass): each journal stays under ``rate * (retention + period +
    2 s)`` all along, and is empty once the traffic stops and that time has passed.
    Before the fix the journals grew by about 700 records a minute (about 5000 each at
    the end). Memory backend: the purge schedule is the engine's, the same on every
    backend, and 7200 messages on a file system would only measure its fsync."""
    rate, minutes, retention_s, period_s = 20, 6, 60, 60
    bound = rate * (retention_s + period_s + 2)
    clock = VirtualClock()
    bot = Bot(MockProvider(), MemoryStore(),
              {"backend": MemoryDurability(), "instance_id": "i1", "retention": "1m", "poll_ms": "1s"}, clock=clock)
    echo(bot)
    await bot.start()
    sizes: list[tuple[int, int]] = []
    for second in range(minutes * 60):
        await asyncio.gather(*(bot.provider.deliver(InboundEvent(id=f"m{second}-{i}", chat_id=f"c{i}", text="x"))
                               for i in range(rate)))
        await clock.advance(1000)
        if second % 30 == 29:
            sizes.append(await journal_sizes(bot))
    assert bot.durability is not None
    assert bot.durability.metrics()["inbound_journaled"] == rate * minutes * 60
    assert len(bot.provider.sent) == rate * minutes * 60  # type: ignore[attr-defined]
    print(f"\n[OPS-3] journal sizes (inbox, outbox) every 30 s at {rate} msg/s: {sizes}")
    assert max(max(s) for s in sizes) <= bound, (bound, sizes)
    # the journals reached their steady size and stayed there (no growth in the last minutes)
    steady = max(max(s) for s in sizes[4:8])
    assert max(max(s) for s in sizes[8:]) <= steady + 2 * rate, sizes
    await clock.advance((retention_s + period_s + 2) * 1000)
    assert await journal_sizes(bot) == (0, 0)
    await bot.stop()


@spec("OPS-3")
async def test_a_purge_backlog_is_worked_off_at_the_next_passes_not_the_next_period() -> None:
    """OPS-3: 5000 expired records per journal (a bot that was down for a while, or a
    retention just shortened): they are all purged within a few passes (``poll_ms`` =
    1 s apart), not one batch per purge period (that took 10 minutes before the fix).
    Memory backend: the schedule is the engine's."""
    clock = VirtualClock()
    backend = MemoryDurability()
    bot = Bot(MockProvider(), MemoryStore(), {"backend": backend, "instance_id": "i1", "retention": "1h",
                                              "poll_ms": "1s"}, clock=clock)
    await bot.start()
    await clock.settle()  # the first pass purged (nothing): the next purge is a period away
    d = bot.durability
    assert d is not None
    now = clock.now()
    for i in range(5000):
        rec = InboxRecord(id=f"m{i}", chat_id="c", event={"id": f"m{i}", "chat_id": "c"}, state="leased",
                          attempts=1, token=1, owner="i1", incarnation=d.incarnation, lease_until=now + 60_000,
                          claimed_at=now, created_at=now, updated_at=now)
        await backend.inbox_journal(d.scope, rec)
        assert await backend.inbox_complete(d.scope, f"m{i}", token=1, now=now, expires_at=now + 1)
        out = OutboxRecord(key=f"k{i}", chat_id="c", content={"text": "t"}, state="sending", attempts=1, token=1,
                           owner="i1", incarnation=d.incarnation, lease_until=now + 60_000, created_at=now,
                           updated_at=now)
        await backend.outbox_journal(d.scope, out)
        assert await backend.outbox_mark_sent(d.scope, f"k{i}", token=1, message_id="x", now=now,
                                              expires_at=now + 1)
    assert await journal_sizes(bot) == (5000, 5000)
    await clock.advance(60_000)  # the purge period comes: the first pass of the purge
    first = await journal_sizes(bot)
    assert first[0] < 5000 and first[1] < 5000  # it began
    await clock.advance(5_000)  # a few passes later, not another period
    assert await journal_sizes(bot) == (0, 0), first
    await bot.stop()


class _ReplayBeforeRead(MemoryKv):
    """A memory kv on which another process replays inbound record ``id`` just before
    the purge reads it: between the purge's read of the ``expires`` index and its read
    of the record — the window a shared backend leaves open."""

    def __init__(self, id: str) -> None:
        super().__init__()
        self.id = id
        self.backend: MemoryDurability | None = None
        self.replayed_at: float | None = None

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        if key == self.id and self.replayed_at is not None and self.backend is not None:
            at, self.replayed_at = self.replayed_at, None
            assert await self.backend.inbox_replay(scope, key, now=at) is not None
        return await super().get(scope, space, key)


@spec("OPS-3", "OPS-2")
async def test_a_record_replayed_after_the_index_read_is_not_purged() -> None:
    """OPS-3 purges ``done`` records; a ``done`` record that another process replayed
    (``replay_inbound``: ``pending`` again, no expiry) after the purge read the
    ``expires`` index, but before it read the record, is no longer expired: the purge
    leaves it (it deleted it before the fix, and the replay was lost). The other expired
    record is purged as ever."""
    kv = _ReplayBeforeRead("m1")
    backend = MemoryDurability(kv)
    kv.backend = backend
    scope, now = "s", 1_000_000.0
    for id in ("m1", "m2"):
        rec = InboxRecord(id=id, chat_id="c", event={"id": id, "chat_id": "c"}, state="leased", attempts=1, token=1,
                          owner="i1", incarnation="x", lease_until=now + 60_000, claimed_at=now, created_at=now,
                          updated_at=now)
        await backend.inbox_journal(scope, rec)
        assert await backend.inbox_complete(scope, id, token=1, now=now, expires_at=now + 1)
    kv.replayed_at = now + 5
    assert await backend.inbox_purge(scope, now=now + 10, limit=100) == 1
    assert kv.replayed_at is None  # the replay happened inside the purge
    left = await backend.inbox_list(scope)
    assert [(r.id, r.state) for r in left] == [("m1", "pending")]
    assert await backend.inbox_due(scope, upto=now + 10, limit=10) == ["m1"]  # the sweep will run it


# -- replays never block due sends --------------------------------------------------------------


def slow_setup(started: list[str], finished: list[str]) -> Any:
    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            started.append(ctx.event.id)
            if ctx.text == "slow":
                await bot.clock.sleep(300_000)
            finished.append(ctx.event.id)
            await ctx.reply(f"re:{ctx.text}")

    return setup


@spec("INB-3", "OUT-7")
async def test_a_slow_replayed_handler_does_not_delay_a_due_send_retry(harness: BackendHarness) -> None:
    """Issue 12: the restarted bot replays a message whose handler takes 300 s; meanwhile
    an enqueued send fails once and is due again 1 s later: the sweep retries it on time
    (within 2 s), while the replay is still running; the replay finishes later and its
    reply goes out. Before the fix the retry waited the whole 300 s behind the replay."""
    started: list[str] = []
    finished: list[str] = []
    world = World(harness, setup=slow_setup(started, finished), durability={"outbox": {"backoff": FAST}})
    await world.start(crash=True)
    assert world.crashable is not None
    world.crashable.crash_after("inbox.journal")
    assert await world.receive("c1", "slow", id="m1") is False
    bot = await world.restart()
    await world.clock.settle()
    assert started == ["m1"] and finished == []  # the first pass's replay is in its handler
    world.channel.fail_next(ProviderError("503 from the channel"))
    await bot.enqueue("c2", "later", idempotency_key="k")
    await world.clock.settle()
    assert [c.error is not None for c in world.channel.calls] == [True]  # the first attempt failed
    await world.clock.advance(2_000)
    assert world.channel.texts() == ["later"]
    assert finished == []  # the replay still runs
    await world.clock.advance(300_000)
    assert finished == ["m1"] and world.channel.texts() == ["later", "re:slow"]
    assert bot.durability is not None
    assert [(r.id, r.state) for r in await bot.durability.inbox.list()] == [("m1", "done")]
    assert world.named("error") == []
    await world.close()


@spec("INB-3", "GUAR-5")
async def test_replays_run_one_at_a_time_in_due_order(harness: BackendHarness) -> None:
    """The replays of one pass run one after the other in due order (each chat's
    messages keep their order: a flow's answers), behind a slow one too."""
    started: list[str] = []
    finished: list[str] = []
    world = World(harness, setup=slow_setup(started, finished))
    bot = await world.start()
    await world.clock.settle()
    d = bot.durability
    assert d is not None
    now = world.clock.now()
    # waiting for a retry, due in this order; a1 is slow
    order = [("a1", "A", "slow"), ("b1", "B", "x"), ("a2", "A", "x"), ("b2", "B", "x")]
    for n, (id, chat, text) in enumerate(order):
        assert (await d.backend.inbox_journal(d.scope, _pending_inbound(id, chat, text, now + n)))[1]
    await world.clock.advance(d.config.poll_ms)
    assert started == ["a1"]
    await world.clock.advance(301_000)
    assert started == finished == ["a1", "b1", "a2", "b2"]
    assert world.channel.texts() == ["re:slow", "re:x", "re:x", "re:x"]
    await world.close()


@spec("INB-7", "GUAR-7", "INB-3")
async def test_a_message_that_kills_every_replay_is_the_only_one_dead_lettered(harness: BackendHarness) -> None:
    """INB-7: a message whose handler kills the process, due first among others waiting
    for a retry: each restart charges it one execution and only it (the replays run one
    at a time, so nothing else is in flight when it kills); after
    ``inbox.max_attempts`` it goes to the DLQ and every other message is processed and
    done in one execution. Replays running at once would charge every record in flight
    at each death and dead-letter the innocent messages with it."""
    world = World(harness, durability={"inbox": {"max_attempts": 3}})

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            if ctx.text == "poison":
                assert world.crashable is not None
                world.crashable.crashed = True  # the process dies in this handler
                raise SimulatedCrash("the handler killed the process")
            await ctx.reply(f"re:{ctx.text}")

    world.setup = setup
    await world.start(crash=True)
    assert world.bot is not None and world.crashable is not None
    d = world.bot.durability
    assert d is not None
    await world.clock.settle()
    now = world.clock.now()
    ids = ["p", "m1", "m2", "m3", "m4"]
    for n, id in enumerate(ids):
        rec = _pending_inbound(id, f"c{n}", "poison" if id == "p" else id, now + n)
        assert (await world.crashable.inner.inbox_journal(d.scope, rec))[1]
    deaths = 0
    for _ in range(10):
        await world.clock.advance(d.config.poll_ms)
        if not world.crashed:
            break
        deaths += 1
        await world.restart(crash=True)
    await world.drain()
    assert world.bot.durability is not None
    records = {r.id: r for r in await world.bot.durability.inbox.list()}
    assert records["p"].state == "dead" and deaths == 3
    assert {i: (records[i].state, records[i].attempts) for i in ids[1:]} == {i: ("done", 1) for i in ids[1:]}
    assert sorted(world.channel.texts()) == ["re:m1", "re:m2", "re:m3", "re:m4"]
    assert [e["id"] for e in world.named("durability:dead")] == ["p"]
    await world.close()


# -- one record's failure is isolated ---------------------------------------------------------


class _Poisoned(InterceptedBackend):
    """Claims of the records named in ``poison`` raise (a record the backend cannot
    decode, a bug in one code path): every other call passes through."""

    def __init__(self, inner: DurabilityBackend, poison: set[str]) -> None:
        super().__init__(inner)
        self.poison = poison

    def before_write(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op in ("inbox.claim", "outbox.claim") and len(args) > 1 and args[1] in self.poison:
            raise RuntimeError(f"poisoned {op} of {args[1]!r}")
        return None


def _pending_inbound(id: str, chat: str, text: str, now: float) -> InboxRecord:
    """An inbound record waiting for a retry that is due now."""
    return InboxRecord(id=id, chat_id=chat, event={"id": id, "chat_id": chat, "text": text, "kind": "message"},
                       state="pending", next_at=now, created_at=now, updated_at=now)


def _pending_send(key: str, chat: str, text: str, now: float) -> OutboxRecord:
    return OutboxRecord(key=key, chat_id=chat, content={"text": text}, rule="explicit", origin="enqueue",
                        state="pending", next_at=now, created_at=now, updated_at=now)


@spec("INB-3", "OUT-7", "OPS-1")
async def test_one_records_failure_is_an_error_event_and_the_pass_goes_on(harness: BackendHarness) -> None:
    """Issue 12: the claim of one inbound record and of one send raise on every pass:
    each is an ``error`` event naming its stage and record, and the others — another
    record of the same chat, a send due after the poisoned one — are processed in the
    same pass. Before the fix the first failure aborted the pass: nothing behind it was
    ever processed."""
    backend, store = await harness.open()
    clock = VirtualClock()
    provider = MockProvider()
    poisoned = _Poisoned(backend, {"a-poison"})
    bot = Bot(provider, store, {"backend": poisoned, "instance_id": "i1"}, clock=clock)
    echo(bot)
    errors: list[dict[str, Any]] = []
    bot.on("error", errors.append)
    try:
        await bot.start()
        await clock.settle()
        d = bot.durability
        assert d is not None
        now = clock.now()
        for rec in (_pending_inbound("a-poison", "c1", "bad", now), _pending_inbound("m2", "c1", "two", now)):
            assert (await backend.inbox_journal(d.scope, rec))[1]
        for out in (_pending_send("a-poison", "c2", "never", now), _pending_send("good", "c2", "fine", now + 1)):
            assert (await backend.outbox_journal(d.scope, out))[1]
        await clock.advance(d.config.poll_ms)
        assert sorted(provider.texts()) == ["fine", "re:two"]
        stages = {(e["stage"], e.get("id") or e.get("key")) for e in errors}
        assert stages == {("sweep.inbox", "a-poison"), ("sweep.outbox", "a-poison")}, errors
        assert all(isinstance(e["error"], RuntimeError) for e in errors)
        assert (await d.inbox.get("m2")).state == "done"
        assert (await d.outbox.get("good")).state == "sent"
        # the next passes fail on the same records again, and nothing else happens twice
        await clock.advance(3 * d.config.poll_ms)
        assert sorted(provider.texts()) == ["fine", "re:two"]
        assert len(errors) > 2
    finally:
        await bot.abandon()
        await harness.close()


@spec("ENABLE-3")
async def test_stop_ends_a_sweep_whose_cancellation_a_library_swallowed() -> None:
    """ENABLE-3: ``bot.stop()`` ends even when the sweep's cancellation is lost inside a
    backend call (Python 3.11's ``asyncio.wait_for`` drops it when its inner future
    completes at the same moment: psycopg-pool's wait for a connection; CI's fault test
    hung in ``stop()`` for a minute that way). Here the backend's due query swallows
    it; before the fix the sweep went on looping and ``stop()`` never returned."""
    entered, swallowed = asyncio.Event(), asyncio.Event()

    class Swallowing(MemoryDurability):  # type: ignore[misc]
        async def inbox_due(self, *args: Any, **kwargs: Any) -> list[str]:
            if not swallowed.is_set():
                entered.set()
                try:
                    await asyncio.Event().wait()  # until cancelled
                except asyncio.CancelledError:
                    swallowed.set()  # and carry on, as the library did
            return await super().inbox_due(*args, **kwargs)

    bot = Bot(MockProvider(), MemoryStore(), durability={"backend": Swallowing(), "poll_ms": 50})
    await bot.start()
    await entered.wait()
    stopping = asyncio.ensure_future(bot.stop())
    done, _ = await asyncio.wait({stopping}, timeout=30.0)  # a bound on the failure, not a timing
    assert swallowed.is_set(), "the backend never saw the cancellation"
    assert stopping in done, "ENABLE-3: bot.stop() did not end: the sweep loop outlived its lost cancellation"
    stopping.result()
