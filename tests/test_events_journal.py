"""``botmesh.events``: the journal's own API and ``events_durability`` (issue 15;
EVENTS-1 to EVENTS-6, BACK-5). The several-process half of the shared journal is in
tests/test_events_shared.py; the certification of the three testkit backends in
tests/test_events_certification.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from botmesh.core import Bot, InboundEvent, VirtualClock
from botmesh.core.errors import BackendUnavailableError, ConfigError, JournalCorruptError, JournalLockedError
from botmesh.core.memory import MemoryKv
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.store import MemoryStore
from botmesh.core.testing import MockProvider
from botmesh.events import (
    BOT_CHANNEL,
    EventJournalError,
    EventRecord,
    EventWorker,
    FileEventJournal,
    SharedFileEventJournal,
    events_durability,
)

spec = pytest.mark.spec
T0 = 1_000_000.0


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


HOLDER = """
import asyncio, sys
from botmesh.events import FileEventJournal, SharedFileEventJournal
async def main():
    kind, path = sys.argv[1], sys.argv[2]
    if kind == "exclusive":
        j = await FileEventJournal.open(path, lock=True)
    else:
        j = await SharedFileEventJournal.open(path)
    await j.append("from.child", {"pid": __import__("os").getpid()}, id="child-record")
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await j.close()
asyncio.run(main())
"""


# -- EVENTS-1: claims, channels, fencing --------------------------------------------------


@spec("EVENTS-1")
async def test_a_claim_without_a_channel_takes_only_records_without_one(tmp_path: Path) -> None:
    """EVENTS-1: records of channel "orders" and the bot's own channel are never handed
    to a claim without a channel, whatever their age; a claim of "orders" takes only
    those."""
    j = await FileEventJournal.open(tmp_path / "j")
    await j.append("o.created", {"n": 1}, channel="orders", now=T0)
    mine = await j.append("app.tick", {"n": 2}, now=T0 + 1)
    got = await j.claim("w", 1000, now=T0 + 2)
    assert got is not None and got.id == mine.id and got.channel is None
    assert await j.claim("w", 1000, now=T0 + 3) is None  # "orders" is there, claimable, and not taken
    orders = await j.claim("w", 1000, channel="orders", now=T0 + 4)
    assert orders is not None and orders.channel == "orders" and orders.payload == {"n": 1}
    with pytest.raises(EventJournalError, match="claimed by the bot"):
        await j.claim("w", 1000, channel=BOT_CHANNEL)
    with pytest.raises(EventJournalError, match="bot's own records"):
        await j.append("x", channel=BOT_CHANNEL)
    await j.close()


@spec("EVENTS-1", "LEASE-2")
async def test_fencing_tokens_refuse_a_holder_whose_lease_was_taken(tmp_path: Path) -> None:
    """LEASE-2 on the journal: a lease that expired is taken with a larger token; the old
    holder's complete/fail/release/heartbeat answer False and change nothing; the new
    holder's complete lands."""
    j = await FileEventJournal.open(tmp_path / "j", append_log=True)
    rec = await j.append("t", {"x": 1}, now=T0)
    first = await j.claim("a", 100, now=T0)
    assert first is not None and first.lease is not None and first.lease.token == 1 and first.attempts == 1
    assert await j.claim("b", 100, now=T0 + 50) is None  # the lease is live
    second = await j.claim("b", 100, now=T0 + 100)  # expired: taken over
    assert second is not None and second.lease is not None
    assert second.lease.token == 2 and second.lease.owner == "b" and second.attempts == 2
    for stale in (j.complete(rec.id, 1, now=T0 + 101), j.fail(rec.id, 1, "x", now=T0 + 101),
                  j.release(rec.id, 1, now=T0 + 101), j.heartbeat(rec.id, 1, 1000, now=T0 + 101)):
        assert await stale is False
    unchanged = await j.get(rec.id)
    assert unchanged is not None and unchanged.lease == second.lease and unchanged.state == "leased"
    assert await j.heartbeat(rec.id, 2, 1000, now=T0 + 110) is True
    assert (await j.get(rec.id)).lease.expires_at == T0 + 1110  # type: ignore[union-attr]
    assert await j.complete(rec.id, 2, now=T0 + 120) is True
    done = await j.get(rec.id)
    assert done is not None and done.state == "done" and done.lease is None
    assert await j.complete(rec.id, 2, now=T0 + 121) is False  # no longer leased
    await j.close()


@spec("EVENTS-1")
async def test_fail_retry_dead_release_and_replay(tmp_path: Path) -> None:
    """The record's life (botmesh.events.records): a failure with retry_at is claimable
    again from then, one without is not, dead is final until replay(), which resets the
    attempts; release gives the lease back at once; list() filters by state and channel."""
    j = await FileEventJournal.open(tmp_path / "j")
    a = await j.append("t", 1, now=T0)
    b = await j.append("t", 2, now=T0 + 1)
    c = await j.append("t", 3, now=T0 + 2)
    ca = await j.claim("w", 1000, now=T0 + 10)
    assert ca is not None and ca.id == a.id
    assert await j.fail(a.id, 1, "boom", retry_at=T0 + 500, now=T0 + 11)
    cb = await j.claim("w", 1000, now=T0 + 12)
    assert cb is not None and cb.id == b.id  # a waits for its retry_at
    assert await j.fail(b.id, 1, "final", now=T0 + 13)
    cc = await j.claim("w", 1000, now=T0 + 14)
    assert cc is not None and cc.id == c.id
    assert await j.release(c.id, 1, now=T0 + 15)
    again = await j.claim("w", 1000, now=T0 + 16)
    assert again is not None and again.id == c.id and again.lease is not None and again.lease.token == 2
    assert await j.fail(c.id, 2, "poison", dead=True, now=T0 + 17)
    assert await j.claim("w", 1000, now=T0 + 100) is None  # a before its retry, b failed for good, c dead
    retried = await j.claim("w", 1000, now=T0 + 500)
    assert retried is not None and retried.id == a.id and retried.attempts == 2
    assert [r.id for r in await j.list(state="dead")] == [c.id]
    assert [r.id for r in await j.list(state=["failed", "dead"])] == [b.id, c.id]
    replayed = await j.replay(c.id, now=T0 + 600)
    assert replayed is not None and replayed.state == "replay" and replayed.attempts == 0 and replayed.error is None
    assert await j.replay(a.id, now=T0 + 601) is None  # leased: not replayed
    assert await j.replay("nope") is None
    took = await j.claim("w", 1000, now=T0 + 602)
    assert took is not None and took.id == c.id and took.lease is not None and took.lease.token == 3
    await j.close()


async def test_bad_arguments_name_what_is_wrong(tmp_path: Path) -> None:
    j = await FileEventJournal.open(tmp_path / "j")
    with pytest.raises(ValueError, match="lease_ms"):
        await j.claim("w", 0)
    with pytest.raises(ValueError, match="owner"):
        await j.claim("", 10)
    with pytest.raises(ValueError, match="state must be one of"):
        await j.list(state="sleeping")
    with pytest.raises(TypeError):
        await j.append("t", {"x": object()})
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    bad, fine = await asyncio.gather(j.append("t", deep), j.append("t", "fine", id="fine"), return_exceptions=True)
    assert isinstance(bad, ValueError) and "nests deeper" in str(bad)  # refused alone, before the flush
    assert isinstance(fine, EventRecord) and await j.get("fine") is not None
    await j.append("t", id="same")
    with pytest.raises(EventJournalError, match="exists already"):
        await j.append("t", id="same")
    with pytest.raises(EventJournalError, match="bot's records"):
        await j.append("t", id="botwa:1:a:b")
    await j.close()
    with pytest.raises(ConfigError, match="compact_every"):
        await FileEventJournal.open(tmp_path / "k", append_log=True, compact_every=0)
    with pytest.raises(ConfigError, match="lock"):
        await FileEventJournal.open(tmp_path / "k", lock="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="heartbeat_ms"):
        await SharedFileEventJournal.open(tmp_path / "s", stale_lock_ms=100, heartbeat_ms=200)
    with pytest.raises(ConfigError, match="does not exist"):
        await FileEventJournal.open(tmp_path / "missing" / "j")


# -- writes: group commit, close() ----------------------------------------------------------


@spec("EVENTS-4")
@pytest.mark.parametrize("kind", ["exclusive", "shared", "shared+log"])
async def test_concurrent_writes_share_one_rewrite(tmp_path: Path, kind: str) -> None:
    """Writes called at the same time are committed by one write of the file (one
    snapshot rewrite, or one append); called one after the other, one each."""
    j: Any
    if kind == "exclusive":
        j = await FileEventJournal.open(tmp_path / "j")
    else:
        j = await SharedFileEventJournal.open(tmp_path / "j", append_log=kind.endswith("log"))
    before = j.writes
    for i in range(5):
        await j.append("seq", i)
    assert j.writes - before == 5
    before = j.writes
    await asyncio.gather(*(j.append("together", i) for i in range(10)))
    assert j.writes - before == 1
    await j.close()
    reopened = await FileEventJournal.open(tmp_path / "j")
    assert sorted(r.payload for r in await reopened.list(event_type="together")) == list(range(10))
    await reopened.close()


@spec("EVENTS-4")
@pytest.mark.parametrize("shared", [False, True])
async def test_close_lets_called_operations_finish_and_refuses_later_ones(tmp_path: Path, shared: bool) -> None:
    j: Any = await (SharedFileEventJournal.open(tmp_path / "j") if shared else FileEventJournal.open(tmp_path / "j"))
    pending = [asyncio.ensure_future(j.append("t", i)) for i in range(4)]
    await asyncio.sleep(0)  # called (queued), not yet written
    await j.close()
    assert all(p.done() and p.exception() is None for p in pending)
    for later in (j.append("late"), j.list(), j.claim("w", 10)):
        with pytest.raises(BackendUnavailableError, match="closed"):
            await later
    await j.close()  # idempotent
    again = await FileEventJournal.open(tmp_path / "j")
    assert sorted(r.payload for r in await again.list()) == [0, 1, 2, 3]
    await again.close()


# -- EVENTS-3: the lock ---------------------------------------------------------------------


@spec("EVENTS-3")
async def test_a_second_open_in_this_process_is_refused_until_close(tmp_path: Path) -> None:
    j = await FileEventJournal.open(tmp_path / "j", lock=True)
    with pytest.raises(JournalLockedError, match="already open in this process"):
        await FileEventJournal.open(tmp_path / "j", lock=True)
    with pytest.raises(JournalLockedError):
        await SharedFileEventJournal.open(tmp_path / "j")
    await j.close()
    again = await FileEventJournal.open(tmp_path / "j", lock=True)
    await again.close()


@spec("EVENTS-3", "EVENTS-4")
@pytest.mark.parametrize("second", ["exclusive", "shared"])
async def test_a_live_process_holding_the_journal_refuses_it_then_dies(tmp_path: Path, second: str) -> None:
    """EVENTS-3: a real child holds the journal with lock=True: a FileEventJournal and a
    SharedFileEventJournal (EVENTS-4) are refused naming its pid; once it is SIGKILLed
    the journal opens, with the child's acknowledged record."""
    path = tmp_path / "j"
    with subprocess.Popen([sys.executable, "-c", HOLDER, "exclusive", str(path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=child_env()) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            with pytest.raises(JournalLockedError) as caught:
                if second == "exclusive":
                    await FileEventJournal.open(path)
                else:
                    await SharedFileEventJournal.open(path)
            assert str(child.pid) in str(caught.value)
        finally:
            child.kill()
            child.wait()
    j: Any = await (FileEventJournal.open(path) if second == "exclusive" else SharedFileEventJournal.open(path))
    got = await j.get("child-record")
    assert got is not None and got.payload == {"pid": child.pid}
    await j.close()


@spec("EVENTS-4")
async def test_a_shared_journal_refuses_operations_once_an_exclusive_one_holds_the_file(tmp_path: Path) -> None:
    """EVENTS-4, "also when that journal opens later": a FileEventJournal(lock=True)
    that gets the file while a shared journal is open (here: the shared one's own lock
    file replaced under it, as a race with a closing exclusive owner could) makes every
    later shared operation fail with JournalLockedError, nothing written."""
    path = tmp_path / "j"
    shared = await SharedFileEventJournal.open(path)
    await shared.append("t", 1)
    os.unlink(str(path) + ".lock")  # the shared journal's long-lived lock is now on a dead name
    exclusive = await FileEventJournal.open(path, lock=True)
    with pytest.raises(JournalLockedError, match="lock=True"):
        await shared.append("t", 2)
    with pytest.raises(JournalLockedError):
        await shared.list()
    await exclusive.close()
    await shared.append("t", 3)  # the exclusive owner is gone
    assert sorted(r.payload for r in await shared.list()) == [1, 3]
    await shared.close()


# -- EVENTS-5 / BACK-5: the append log ------------------------------------------------------


async def _log_journal(path: Path, n: int) -> list[EventRecord]:
    j = await SharedFileEventJournal.open(path, append_log=True)
    recs = [await j.append("t", {"i": i}, id=f"r{i}", now=T0 + i) for i in range(n)]
    j.abandon()  # died: nothing folded
    return recs


@spec("EVENTS-5", "BACK-4")
async def test_the_log_is_compacted_every_n_entries(tmp_path: Path) -> None:
    path = tmp_path / "j"
    j = await SharedFileEventJournal.open(path, append_log=True, compact_every=4)
    for i in range(10):
        await j.append("t", i, id=f"r{i}")
    log = Path(str(path) + ".log").read_bytes()
    assert log.count(b"\n") == 1 + 2  # header + the two entries since the last compaction (at 8)
    await j.close()
    again = await SharedFileEventJournal.open(path, append_log=True)
    assert [r.payload for r in await again.list()] == list(range(10))
    await again.close()


@spec("EVENTS-5", "BACK-4")
@pytest.mark.parametrize("shared", [False, True])
async def test_a_crash_between_the_snapshot_and_the_truncation_is_harmless(tmp_path: Path, shared: bool) -> None:
    """EVENTS-5: the snapshot was rewritten with every entry (its log_seq) and the
    process died before truncating the log: the reopened journal holds each record once,
    at its version, and the next write continues the sequence."""
    path = tmp_path / "j"
    j: Any = await (SharedFileEventJournal.open(path, append_log=True) if shared
                    else FileEventJournal.open(path, append_log=True))
    for i in range(5):
        await j.append("t", i, id=f"r{i}")
    c = await j.claim("w", 1000)
    assert c is not None
    f = j.file
    f._write_snapshot(f.records, f._seq)  # compaction's first step, with the journal's own code
    log_before = Path(str(path) + ".log").read_bytes()
    j.abandon()  # ... and the process dies before the second
    assert log_before.count(b"\n") == 1 + 6
    again: Any = await (SharedFileEventJournal.open(path, append_log=True) if shared
                        else FileEventJournal.open(path, append_log=True))
    records = await again.list()
    assert [r.id for r in records] == [f"r{i}" for i in range(5)]
    assert [r.state for r in records] == ["leased", "pending", "pending", "pending", "pending"]
    assert records[0].lease is not None and records[0].lease.token == 1
    await again.append("t", 5, id="r5")
    await again.close()
    final = await FileEventJournal.open(path)
    assert len(await final.list()) == 6
    await final.close()


@spec("EVENTS-5", "BACK-5")
async def test_a_torn_last_line_is_trimmed(tmp_path: Path) -> None:
    path = tmp_path / "j"
    await _log_journal(path, 3)
    log = Path(str(path) + ".log")
    whole = log.read_bytes()
    log.write_bytes(whole + b"123 0badf00d {\"seq\":4,\"op\":\"pu")  # a write cut by the crash
    j = await SharedFileEventJournal.open(path, append_log=True)
    assert [r.id for r in await j.list()] == ["r0", "r1", "r2"]
    assert log.read_bytes() == whole  # trimmed
    await j.append("t", 3, id="r3")
    await j.close()


@spec("EVENTS-5", "BACK-5")
@pytest.mark.parametrize("shared", [False, True])
async def test_a_damaged_log_line_is_refused_naming_file_line_and_byte(tmp_path: Path, shared: bool) -> None:
    """BACK-5 for both journals: a complete line with a flipped byte, followed by more
    entries, is APPEND_LOG_CORRUPT with the line and its offset; the file is left as it
    is and nothing is opened."""
    path = tmp_path / "j"
    await _log_journal(path, 3)
    log = Path(str(path) + ".log")
    lines = log.read_bytes().split(b"\n")
    start = len(lines[0]) + 1 + len(lines[1]) + 1  # line 3: the entry of r1
    data = bytearray(log.read_bytes())
    data[start + 30] ^= 0x01
    log.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError) as caught:
        if shared:
            await SharedFileEventJournal.open(path, append_log=True)
        else:
            await FileEventJournal.open(path, append_log=True)
    err: Any = caught.value
    assert err.code == "APPEND_LOG_CORRUPT" and err.line == 3 and err.byte == start
    assert err.file == str(log.resolve())
    assert log.read_bytes() == bytes(data)


# -- events_durability (EVENTS-1, -2, -6) ---------------------------------------------------


def _bot(journal: Any, clock: VirtualClock, handled: list[str], outbox: Any = None) -> Bot:
    bot = Bot(MockProvider(), MemoryStore(),
              {"backend": events_durability(journal=journal, outbox=outbox), "instance_id": "i1", "poll_ms": "1s"},
              clock=clock)

    @bot.otherwise
    async def handler(ctx: Any) -> None:
        handled.append(ctx.text)
        await ctx.reply(f"re:{ctx.text}")

    return bot


@spec("EVENTS-1", "EVENTS-2")
@pytest.mark.parametrize("shared", [False, True])
async def test_the_bots_records_are_events_and_a_replay_is_swept(tmp_path: Path, shared: bool) -> None:
    """EVENTS-1: a bot on events_durability journals its inbound as events of channel
    botwa:durable (list() and get() see them, typed by kind); the app's claim never takes
    them; replay() of one puts it back and the bot's sweep runs it again (the reply is
    answered from the outbox: sent once). EVENTS-2: the outbox is in the same file (a
    reopen of the snapshot alone shows both journals)."""
    path = tmp_path / "j"
    j: Any = await (SharedFileEventJournal.open(path) if shared else FileEventJournal.open(path, lock=True))
    clock = VirtualClock()
    handled: list[str] = []
    bot = _bot(j, clock, handled)
    await bot.start()
    assert await bot.provider.deliver(InboundEvent(id="m1", chat_id="c1", text="hi"))
    assert await bot.provider.deliver(InboundEvent(id="b1", chat_id="c1", text="", kind="interaction"))
    assert handled == ["hi", ""]
    events = sorted(await j.list(channel=BOT_CHANNEL), key=lambda e: e.payload["id"], reverse=True)
    assert [(e.event_type, e.state, e.payload["id"]) for e in events] == [
        ("botwa.inbound.message", "done", "m1"), ("botwa.inbound.interaction", "done", "b1")]
    assert await j.list(channel=None) == []
    assert await j.claim("app", 1000, now=clock.now() + 10**9) is None  # EVENTS-1
    worker = EventWorker(j, lambda rec: asyncio.sleep(0), owner="app")
    assert await worker.run_once() is False
    replayed = await j.replay(events[0].id, now=clock.now())
    assert replayed is not None and replayed.state == "replay" and replayed.channel == BOT_CHANNEL
    await clock.advance(2000)
    assert handled == ["hi", "", "hi"]  # the sweep ran it again
    after = await j.get(events[0].id)
    assert after is not None and after.state == "done"
    assert [m.content.get("text") for m in bot.provider.sent] == ["re:hi", "re:"]  # type: ignore[attr-defined]
    await bot.stop()
    await j.close()
    reopened = await FileEventJournal.open(path)
    kv = events_durability(journal=reopened)
    await kv.start()
    scope = bot.durability.scope  # type: ignore[union-attr]
    outbox = await kv.outbox_list(scope)
    assert [o.state for o in outbox] == ["sent", "sent"]
    assert Path(str(path) + ".log").exists() is False  # one file: the snapshot holds both journals
    await reopened.close()


@spec("EVENTS-6")
async def test_the_outbox_can_live_in_a_database_kv(tmp_path: Path) -> None:
    """EVENTS-6: with outbox=kv the sends are in that DurableKv and not in the journal's
    file; the inbox stays in the journal. (A MemoryKv stands for the database kv: the
    routing is what is checked here; PostgresKv and RedisKv pass the DurableKv suite.)"""
    j = await FileEventJournal.open(tmp_path / "j")
    kv = MemoryKv()
    clock = VirtualClock()
    handled: list[str] = []
    bot = _bot(j, clock, handled, outbox=kv)
    await bot.start()
    assert await bot.provider.deliver(InboundEvent(id="m1", chat_id="c1", text="hi"))
    scope = bot.durability.scope  # type: ignore[union-attr]
    assert [k for k, _ in await kv.scan(scope, "outbox")] != []
    assert await kv.scan(scope, "inbox") == []
    assert all(s[1] != "outbox" for s in j.file.records)
    assert [e.payload["id"] for e in await j.list(channel=BOT_CHANNEL)] == ["m1"]
    await bot.stop()
    await j.close()


async def test_events_durability_refuses_a_journal_without_the_lock(tmp_path: Path) -> None:
    j = await FileEventJournal.open(tmp_path / "j", lock=False)
    with pytest.raises(ConfigError, match="lock=True"):
        events_durability(journal=j)
    with pytest.raises(ConfigError, match="journal must be"):
        events_durability(journal=str(tmp_path / "j"))
    await j.close()
    locked = await FileEventJournal.open(tmp_path / "j", lock=True)
    await locked.close()
    with pytest.raises(ConfigError, match="closed"):
        events_durability(journal=locked)


@spec("EVENTS-1")
async def test_an_event_worker_processes_the_apps_records_and_never_the_bots(tmp_path: Path) -> None:
    """EventWorker: claims only records without a channel (a pending bot record, due,
    stays untouched at its version), completes what its handler finishes, fails with a
    retry what raises, and sends it dead after max_attempts."""
    j = await FileEventJournal.open(tmp_path / "j")
    backend = events_durability(journal=j)
    await backend.start()
    bot_rec = InboxRecord(id="m1", chat_id="c1", state="pending", next_at=0.0, created_at=1.0, updated_at=1.0)
    await backend.inbox_journal("s", bot_rec)
    await backend.outbox_journal("s", OutboxRecord(key="k1", chat_id="c1", state="pending", created_at=1.0))
    await j.append("ok", {"n": 1})
    await j.append("bad", {"n": 2})
    seen: list[str] = []

    async def handler(rec: EventRecord) -> None:
        seen.append(rec.event_type)
        if rec.event_type == "bad":
            raise RuntimeError("nope")

    worker = EventWorker(j, handler, owner="w1", lease_ms=5000, retry_ms=1, max_attempts=2)
    while await worker.run_once():
        await asyncio.sleep(0.002)  # retry_ms
    assert seen == ["ok", "bad", "bad"]
    states = {r.event_type: r.state for r in await j.list(channel=None)}
    assert states == {"ok": "done", "bad": "dead"}
    untouched = await backend.inbox_get("s", "m1")
    assert untouched is not None and untouched.state == "pending" and untouched.token == 0
    assert (await backend.kv.get("s", "inbox", "m1")).version == 1  # type: ignore[union-attr]
    await j.close()


# -- a batch's append on the FUSE power-cut file system ---------------------------------------------------
@pytest.mark.spec("BACK-5", "EVENTS-1")
async def test_a_power_cut_during_a_batch_append_leaves_a_journal_that_opens(tmp_path: Path) -> None:
    """Eight changes of ~600 bytes each written as one batch of the events journal's append
    log, its fsync held on the FUSE power-cut file system, the power cut keeping a seeded
    subset of the unsynced pages (6 seeds): the journal reopens every time, with every
    acknowledged record and each record of the cut batch whole or not at all. Before the
    batch was cut into page-bounded appends, a cut that kept a later page without an
    earlier one left a hole of zeros before complete lines: the journal no longer opened."""
    import threading

    from conftest import require_fuse

    from botmesh.core.fileio import FileIO
    from botmesh.events._file import JournalFile
    from botmesh_testkit.crash.fs import PowerCutFS, PowerCutUnavailable

    class DiesAtTheCut(FileIO):
        """Real OS calls until the power is cut; then the process is dead in the story and
        the journal's undo of its failed append (a truncate) never happens."""

        dead = False

        def truncate(self, fd: int, size: int, *, fsync: bool) -> None:
            if self.dead:
                raise OSError(5, "the process died with the power")
            super().truncate(fd, size, fsync=fsync)

    def journal(path: Path, io: FileIO) -> JournalFile:
        return JournalFile(path, lock=False, shared=False, append_log=True, compact_every=None, compact_bytes=None,
                           fsync=True, io=io)

    require_fuse()
    io = DiesAtTheCut()
    try:
        mount = PowerCutFS(tmp_path / "fs").mount()
    except PowerCutUnavailable as exc:
        pytest.skip(f"no power-cut file system: {exc}")
    try:
        path = mount.path / "events.json"
        file = journal(path, io)
        await file.open()
        acknowledged: dict[str, tuple[dict[str, object], int]] = {}
        holes = 0
        for round_ in range(6):
            # acknowledged: one batch per record, each synced
            for i in range(8):
                key, version = f"e{i}", acknowledged.get(f"e{i}", ({}, 0))[1] + 1
                value: dict[str, object] = {"round": round_, "pad": "a" * 600}
                file.commit([("app", "events", key, (value, version, None, None), version)])
                acknowledged[key] = (value, version)
            batch = [("app", "events", f"e{i}", ({"round": round_, "batch": True, "pad": "b" * 600},
                                                 acknowledged[f"e{i}"][1] + 1, None, None), acknowledged[f"e{i}"][1] + 1)
                     for i in range(8)]
            rule = mount.hold("fsync", "events.json.log")

            def cut(seed: int = round_) -> None:
                nonlocal holes
                mount.wait_held()
                io.dead = True
                mount.cut("subset", seed=seed)
                holes += (path.parent / "events.json.log").read_bytes().count(b"\0")

            cutter = threading.Thread(target=cut)
            cutter.start()
            with pytest.raises(BackendUnavailableError):
                file.commit(batch)  # type: ignore[arg-type]
            cutter.join()
            mount.release(rule)
            file.abandon()
            io.dead = False
            file = journal(path, io)
            await file.open()  # JournalCorruptError here: a hole in the never-acknowledged batch refused
            got = {key: (entry[0], entry[1]) for key, entry in file.records.get(("app", "events"), {}).items()}
            for (_, _, key, entry, version) in batch:
                assert entry is not None
                assert got[key] in (acknowledged[key], (entry[0], version)), f"round {round_}: {key}: {got[key]}"
                acknowledged[key] = got[key]  # a record of the cut batch may have landed whole
        await file.close()
        assert holes, "no subset cut left a hole in the batch's write (the test did not test its point)"
    finally:
        mount.unmount()
