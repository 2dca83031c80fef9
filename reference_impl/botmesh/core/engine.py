"""The durability engine: the inbox and outbox journals at work (INB, OUT, LEASE, SCOPE,
RETRY, OPS, MEDIA, GUAR of the spec).

Over 800 lines: the inbound path, the send path and the sweep's driver share one
runtime's state (chat and key locks, the records executing here, counters); the parts
that stand alone are already apart (``sweep``, ``outcomes``, ``keylocks``, ``content``).

One :class:`DurabilityRuntime` per bot. It owns no storage: every journal write goes to
the :class:`~botmesh.core.backend.DurabilityBackend`, every reading of time to the bot's
clock. Each unit of work runs inside ``clock.busy()`` so a virtual clock knows when it
may move time forward.

Choices where the spec is silent (also in the README):

* A fresh inline send is journaled directly in state ``sending`` (one write), so the
  ambiguity window of OUT-14 starts at that write: a crash right after it is treated as
  ambiguous on restart, although the provider may not have been called yet.
* LEASE-4 is implemented with an *incarnation* id (random per ``start()``): the first
  sweep after a start takes back every lease held by the same ``instance_id`` under
  another incarnation, whatever its expiry; later sweeps only take expired leases.
* ``attempts`` of an outbox record counts claims for sending (provider calls, plus the
  claim that resolves an ambiguity).
* Part keys (OUT-12), one send per key at a time (OUT-2, OUT-10), the keys the send
  errors carry (OUT-9) and unencodable content (OUT-15): README, "Choices where the
  spec is silent".
* Inbound ids and idempotency keys are checked here, before any backend sees them
  (:mod:`botmesh.core.inputs`, issue 13): a non-empty ``str`` of at most 448 characters
  (512, the kv's limit, less 64 kept for the suffixes derived keys get), valid Unicode,
  without U+0000. Anything else raises :class:`~botmesh.core.errors.InvalidKeyError` (a
  ``ValueError``) naming the argument and the value, nothing journaled and nothing sent,
  whatever the backend. Keys given to the operator API (``replay_inbound``,
  ``retry_send``, ``inbox.get`` ...) name existing records, so they may be up to 512.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Generic

from . import content as contentlib
from .backend import DurabilityBackend
from .config import DurabilityConfig
from .errors import DurabilityError, SendDeferredError, SendFailedError
from .heartbeat import ChatOrder, FirstBeats, Heartbeat
from .host import BotHost, CtxT, HandlerContext
from .inputs import MAX_ID_CHARS, check_key
from .keylocks import KeyLocks, acquire_waiting
from .media import journal_media, rehydrate
from .provider import InboundEvent, RateLimitedError, is_definitive
from .records import InboxRecord, OutboxRecord
from .outcomes import METRIC_KEYS, SendResult, _Dead, _Failed, _Sent, derive_scope
from .sweep import Purger, Replays, default_instance_id

log = logging.getLogger("botmesh.durability")

CANCEL_AGAIN_S = 0.5
"""How often ``stop()`` cancels again a task of the runtime that a first cancellation
did not end (see ``DurabilityRuntime._cancel_tasks``)."""

DERIVED_SHAPED_MAX = 10_000
"""Explicit keys shaped like derived ones (``…:<n>``) a runtime remembers; past that every
send looks its key up before its hooks run (OUT-10)."""
_DERIVED_SHAPE = re.compile(r":[0-9]+$")

__all__ = ["METRIC_KEYS", "DurabilityRuntime", "SendResult", "derive_scope"]

class _Journal:
    """``bot.durability.inbox`` / ``.outbox``: the operator's view of one journal."""

    def __init__(self, runtime: DurabilityRuntime[Any], kind: str) -> None:
        self._rt = runtime
        self._kind = kind

    async def list(self, state: str | None = None, *, limit: int = 1000) -> list[Any]:
        """Records of this journal, optionally of one state (``"dead"`` is the DLQ)."""
        b, scope = self._rt.backend, self._rt.scope
        if self._kind == "inbox":
            return list(await b.inbox_list(scope, state=state, limit=limit))
        return list(await b.outbox_list(scope, state=state, limit=limit))

    async def get(self, id: str) -> Any:
        check_key(id, "id")
        b, scope = self._rt.backend, self._rt.scope
        return await (b.inbox_get(scope, id) if self._kind == "inbox" else b.outbox_get(scope, id))

    async def discard(self, key: str) -> bool:
        """Forget an outbox record (OPS-2)."""
        if self._kind != "outbox":
            raise TypeError("discard is an outbox operation")
        check_key(key, "key")
        with self._rt.clock.busy():
            return await self._rt.backend.outbox_discard(self._rt.scope, key)


class DurabilityRuntime(Generic[CtxT]):
    """``bot.durability``: the engine and its operator API (OPS-2). It drives its bot
    through :class:`~botmesh.core.host.BotHost` only (the bot's context type
    ``CtxT``)."""

    def __init__(self, bot: BotHost[CtxT], config: DurabilityConfig) -> None:
        self.bot = bot
        self.config = config
        self.backend: DurabilityBackend = config.backend
        self.clock = bot.clock
        self._now: Callable[[], float] = self.clock.now  # the bot's clock for good: bound once (issue 16)
        self.scope = derive_scope(bot.tenant_id, bot.environment_id, bot.bot_id, bot.connection_id)
        if config.instance_id is not None:
            self.instance_id = config.instance_id
        else:  # LEASE-3
            self.instance_id = default_instance_id(bot.bot_id, bot.connection_id, self.backend.capabilities)
        self.incarnation = uuid.uuid4().hex
        self.inbox = _Journal(self, "inbox")
        self.outbox = _Journal(self, "outbox")
        self._metrics = dict.fromkeys(METRIC_KEYS, 0)
        self._recovered = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweep_task: asyncio.Task[None] | None = None
        self._local_inbound: set[str] = set()
        self._fresh_inbound: set[str] = set()
        """Inbound records journaled by :meth:`admit` in this process and running their
        first execution here: no earlier execution can have journaled their derived sends."""
        self._derived_shaped: set[str] | None = set()
        """Explicit keys used here that have the shape of a derived one (``…:<n>``); None
        once more than :data:`DERIVED_SHAPED_MAX` were seen (every send looks up its key)."""
        self._chat_locks: dict[str, asyncio.Lock] = {}
        self._key_locks = KeyLocks(self.clock)  # OUT-2, OUT-10: one send per key at a time
        self._seq = 0
        self._first_beats = FirstBeats()  # the real clock's first heartbeats, one timer
        self._replays = Replays(self._spawn, self._replay_due, self._replay_failed)
        self._purger = Purger(lambda journal, exc: self._sweep_failed("sweep.purge", exc, journal=journal))

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self._recovered = False
        self._replays.reset()
        await self.backend.start()
        self._sweep_task = asyncio.ensure_future(self._sweep_loop())

    async def stop(self) -> None:
        await self._cancel_tasks()
        await self.backend.stop()

    async def abandon(self) -> None:
        """Stop every task of this runtime without touching the backend: what a process
        death leaves behind (tests, TEST-3)."""
        await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        """Cancel every task of this runtime and wait for each to end. A cancellation a
        library swallowed (Python 3.11's ``asyncio.wait_for`` loses it when its inner
        future completes at the same moment: psycopg-pool's wait for a connection is
        one) would leave the sweep loop running for ever and this wait with it: whatever
        still runs is cancelled again every :data:`CANCEL_AGAIN_S` seconds."""
        tasks = list(self._tasks)
        if self._sweep_task is not None:
            tasks.append(self._sweep_task)
        pending = set(tasks)
        while pending:
            for t in pending:
                t.cancel()
            # never raises for them; a cancellation of ours still does
            _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: a dead incarnation's errors are not reported again
        self._tasks.clear()
        self._sweep_task = None

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a simulated death ends background work silently, like a real one

    # -- metrics and events ---------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        """A copy of the counters of OPS-2."""
        return dict(self._metrics)

    def _count(self, name: str, n: int = 1) -> None:
        self._metrics[name] += n

    def _expires(self, now: float) -> float | None:
        """When a record settled at ``now`` expires (OPS-3), None when kept for ever."""
        r = self.config.retention_ms
        return None if r <= 0 else now + r

    def _chat_lock(self, chat_id: str) -> asyncio.Lock:
        lock = self._chat_locks.get(chat_id)
        if lock is None:
            lock = self._chat_locks[chat_id] = asyncio.Lock()
        return lock

    def _in_chat_order(self, chat_id: str) -> ChatOrder:
        """Hold the chat's lock (OUT-11); waiting for it is not busy work."""
        return ChatOrder(self.clock, self._chat_lock(chat_id))

    async def _claim_inbound(self, id: str, *, recover: bool) -> InboxRecord | None:
        return await self.backend.inbox_claim(
            self.scope, id, owner=self.instance_id, incarnation=self.incarnation, now=self._now(),
            lease_ms=self.config.inbox.lease_ms, recover=recover,
        )

    async def _claim_send(self, key: str, *, recover: bool) -> tuple[OutboxRecord, str] | None:
        return await self.backend.outbox_claim(
            self.scope, key, owner=self.instance_id, incarnation=self.incarnation, now=self._now(),
            lease_ms=self.config.outbox.lease_ms, recover=recover,
        )

    # -- heartbeat (LEASE-1) ------------------------------------------------------------
    def _heartbeat(self, beat: Callable[[float], Awaitable[bool]], lease_ms: float) -> Heartbeat:
        """Renew a lease every ``lease_ms / 3`` while the block runs (LEASE-1)."""
        return Heartbeat(self.clock, beat, lease_ms, self._first_beats)

    # -- inbox --------------------------------------------------------------------------
    def _serialize_event(self, event: InboundEvent) -> dict[str, Any]:
        return {
            "id": event.id,
            "chat_id": event.chat_id,
            "text": event.text,
            "kind": event.kind,
            "user_id": event.user_id,
            "data": event.data,
            "media": journal_media(self.bot.provider, event.media, self.config.inbox.media_refs),
        }

    @staticmethod
    def check_inbound_id(id: Any) -> str:
        """``id`` when it can be an inbound record's id (the module docstring);
        :class:`~botmesh.core.errors.InvalidKeyError` naming ``event.id`` otherwise."""
        return check_key(id, "event.id", limit=MAX_ID_CHARS)

    @staticmethod
    def check_idempotency_key(key: Any) -> str | None:
        """``key`` when it is None or can be a send's key (the module docstring, and no
        U+001F: OUT-12); :class:`~botmesh.core.errors.InvalidKeyError` naming
        ``idempotency_key`` otherwise."""
        return None if key is None else contentlib.check_idempotency_key(key)

    async def admit(self, event: InboundEvent) -> bool:
        """Journal an inbound event before any handler runs (INB-1), then process it.
        False when the journal could not record it and it was not dispatched (INB-8, fail
        closed): the channel must redeliver it. True otherwise. An id that cannot be a
        journal key raises ``InvalidKeyError`` (a ``ValueError``), nothing journaled."""
        self.check_inbound_id(event.id)
        with self.clock.busy():
            now = self._now()
            lease = self.config.inbox.lease_ms
            try:
                record = InboxRecord(
                    id=event.id, kind=event.kind, chat_id=event.chat_id, event=self._serialize_event(event),
                    state="leased", attempts=1, token=1, owner=self.instance_id, incarnation=self.incarnation,
                    lease_until=now + lease, claimed_at=now, created_at=now, updated_at=now,
                )
                stored, created = await self.backend.inbox_journal(self.scope, record)
            except Exception as exc:  # INB-8: fail closed
                self.bot.forget_seen(event.id)
                await self.bot.emit("error", {"error": exc, "stage": "inbox.journal", "id": event.id})
                if self.config.fail_open:
                    await self.bot.dispatch(event, None)
                    return True
                return False
            if not created:  # INB-4
                self._count("inbound_duplicates")
                return True
            self._count("inbound_journaled")
            self._fresh_inbound.add(stored.id)
            try:
                await self._execute(stored, event)
            except Exception as exc:
                # the inbound is journaled (the channel may acknowledge it), but settling it
                # failed (its completion or retry could not be written): its lease runs out
                # and the sweep finishes it, answered from the outbox (INB-2, INB-3)
                await self.bot.emit("error", {"error": exc, "stage": "inbox.settle", "id": event.id})
            finally:
                self._fresh_inbound.discard(stored.id)
            return True

    async def _execute(self, record: InboxRecord, live_event: InboundEvent | None) -> None:
        """Run the handlers for a leased record and settle it (INB-2, INB-5, INB-6)."""
        self._local_inbound.add(record.id)
        scope, b = self.scope, self.backend
        try:
            async with self._heartbeat(
                lambda until: b.inbox_heartbeat(scope, record.id, token=record.token, lease_until=until),
                self.config.inbox.lease_ms,
            ):
                replayed_media = None
                try:
                    if live_event is None:
                        ev = record.event
                        live_event = InboundEvent(
                            id=ev.get("id", record.id), chat_id=ev.get("chat_id", record.chat_id),
                            text=ev.get("text", ""), kind=ev.get("kind", record.kind), user_id=ev.get("user_id"),
                            data=ev.get("data") or {},
                        )
                        # MEDIA-2; never raises: a bad reference fails only the download (MEDIA-3)
                        replayed_media = rehydrate(self.bot.provider, ev.get("media"))
                    ctx = await self.bot.prepare(live_event, record, replayed_media)
                except Exception as exc:  # INB-5: failure before the handlers
                    await self._inbox_failed(record, exc)
                    return
                await self.bot.run_handlers(ctx)  # INB-6: handler errors are reported there
                if ctx.durability_failed is not None:  # INB-2: the handler's sends did not settle
                    await self._inbox_failed(record, ctx.durability_failed)
                    return
                now = self._now()
                ok = await b.inbox_complete(scope, record.id, token=record.token, now=now, expires_at=self._expires(now))
                if not ok:
                    self._count("stale_leases")
        finally:
            self._local_inbound.discard(record.id)

    async def _inbox_failed(self, record: InboxRecord, exc: BaseException) -> None:
        now = self._now()
        if record.attempts >= self.config.inbox.max_attempts:
            if await self.backend.inbox_kill(self.scope, record.id, token=record.token, now=now, error=repr(exc)):
                await self._dead("inbox", record.id, exc)
            else:
                self._count("stale_leases")
            return
        delay = self.config.inbox.backoff.delay(record.attempts, self.bot.rng.random())
        retried = await self.backend.inbox_retry_later(
            self.scope, record.id, token=record.token, next_at=now + delay, error=repr(exc)
        )
        if not retried:
            self._count("stale_leases")

    async def _dead(self, kind: str, id: str, error: BaseException | str) -> None:
        self._count("inbound_dead" if kind == "inbox" else "outbox_dead")
        await self.bot.emit("durability:dead", {"kind": kind, "id": id, "error": error})

    # -- the sweep (its machinery: sweep.py) ---------------------------------------------
    async def _sweep_loop(self) -> None:
        while True:
            with self.clock.busy():
                try:
                    await self.sweep()
                except Exception as exc:  # the journal failed under the pass itself (its read of what is due)
                    await self.bot.emit("error", {"error": exc, "stage": "sweep"})
            await self.clock.sleep(self.config.poll_ms)

    async def _sweep_failed(self, stage: str, exc: Exception, **where: str) -> None:
        """One record's failure in the sweep: reported (logged when nobody listens),
        never the end of the pass."""
        await self.bot.emit("error", {"error": exc, "stage": stage, **where})

    async def sweep(self) -> None:
        """One pass: recover or take over due inbound records (INB-3, INB-7, LEASE-2,
        LEASE-4) — handed to the replay task (``sweep.Replays`` running
        :meth:`_replay_due`, one at a time) the pass does not wait for —, deliver due
        sends (OUT-7, OUT-12..14), purge (OPS-3). A record's failure is an ``error`` event
        (``stage`` ``sweep.inbox``/``.outbox``/``.purge``, its ``id``/``key``); the pass
        goes on. The first pass after a start (LEASE-4) is repeated until it handed on
        all it found."""
        recover = not self._recovered
        upto = math.inf if recover else self._now()
        b, scope = self.backend, self.scope
        handed_on = True  # every record found was handed on: the recovery (if this is it) is over
        inbox_due, outbox_due = await b.due(scope, upto=upto, limit=100)  # one read of both journals
        for id in inbox_due:
            if id not in self._local_inbound and id not in self._replays:  # not running or queued here
                self._replays.add(id, recover=recover)
        records: list[OutboxRecord] = []
        for key in outbox_due:
            try:
                rec = await b.outbox_get(scope, key)
            except Exception as exc:
                handed_on = False
                await self._sweep_failed("sweep.outbox", exc, key=key)
                continue
            if rec is not None:
                records.append(rec)
        records.sort(key=lambda r: (r.created_at, r.seq, r.part, r.key))
        for rec in records:
            lock = self._chat_lock(rec.chat_id)
            if lock.locked():
                handed_on = False
                continue  # an inline send to this chat is in progress: keep its order (OUT-11)
            try:
                # unlocked, it may still have a waiter about to take it: not busy meanwhile
                await acquire_waiting(self.clock, lock)
                try:
                    await self._deliver(rec, recover=recover)
                finally:
                    lock.release()
            except Exception as exc:
                handed_on = False
                await self._sweep_failed("sweep.outbox", exc, key=rec.key)
        if handed_on:
            self._recovered = True
        await self._purger.run(b, scope, self._now, self.config.retention_ms)

    async def _replay_failed(self, id: str, recover: bool, exc: Exception) -> None:
        with self.clock.busy():
            if recover:
                self._recovered = False  # not taken back: the next pass recovers again
            await self._sweep_failed("sweep.inbox", exc, id=id)

    async def _replay_due(self, id: str, recover: bool) -> None:
        """Claim a due inbound record and run it again (INB-3, LEASE-2, LEASE-4), or
        dead-letter it when its executions keep dying (INB-7, GUAR-7)."""
        with self.clock.busy():
            b, scope = self.backend, self.scope
            record = await self._claim_inbound(id, recover=recover)
            if record is None:
                return  # taken elsewhere, or not due any more
            if record.attempts > self.config.inbox.max_attempts:  # INB-7, GUAR-7
                error = f"{record.attempts - 1} charged executions never finished"
                if await b.inbox_kill(scope, id, token=record.token, now=self._now(), error=error):
                    await self._dead("inbox", id, error)
                return
            self._count("inbound_replayed")
            await self._execute(record, None)

    async def _deliver(self, rec: OutboxRecord, *, recover: bool) -> None:
        """Deliver one due send from the background (enqueued, deferred, failed,
        ambiguous, or a part waiting behind an earlier one)."""
        b, scope = self.backend, self.scope
        if rec.previous_part is not None:  # OUT-12: never overtake an earlier part
            prev = await b.outbox_get(scope, rec.previous_part)
            if prev is None or prev.state == "dead":
                why = "previous part was discarded" if prev is None else f"previous part {prev.key!r} is dead"
                if rec.state != "sending" and await b.outbox_mark_dead(scope, rec.key, token=None, now=self._now(), error=why):
                    await self._dead("outbox", rec.key, why)
                return
            if prev.state not in ("sent", "unknown"):
                return  # waiting behind it is not an attempt
        if rec.state in ("pending", "failed"):
            # OUT-13: split before claiming, so a death in the middle is not an ambiguous send
            parts = contentlib.split_content(rec.content, self.bot.provider.text_limit)
            if len(parts) > 1:
                await self._journal_parts(rec, parts)
                if not await b.outbox_split(scope, rec.key, token=None, content=parts[0]):
                    return  # claimed or changed meanwhile: the next pass sees it
        claim = await self._claim_send(rec.key, recover=recover)
        if claim is None:
            return
        rec, previous_state = claim
        if previous_state == "sending":  # OUT-14, GUAR-3
            if not await self._ambiguous(rec):
                return
        elif previous_state == "failed":
            self._count("outbox_retried")
        rec = await self._split_claimed(rec)
        outcome = await self._attempt(rec)
        if isinstance(outcome, _Sent):
            await self._after_send(rec, outcome.message_id)

    async def _ambiguous(self, rec: OutboxRecord) -> bool:
        """Resolve a send found in flight under a dead lease. True: send it again."""
        self._count("outbox_ambiguous")
        await self.bot.emit("durability:ambiguous", {"key": rec.key, "chat_id": rec.chat_id})
        if self.config.outbox.on_ambiguous == "resend":
            return True
        if not await self.backend.outbox_mark_unknown(self.scope, rec.key, token=rec.token, now=self._now()):
            self._count("stale_leases")
        return False

    async def _split_claimed(self, rec: OutboxRecord) -> OutboxRecord:
        """OUT-13: a recorded text over the channel limit is split before it is sent; the
        other parts are journaled first, then the record keeps the first part."""
        parts = contentlib.split_content(rec.content, self.bot.provider.text_limit)
        if len(parts) == 1:
            return rec
        await self._journal_parts(rec, parts)
        if not await self.backend.outbox_split(self.scope, rec.key, token=rec.token, content=parts[0]):
            self._count("stale_leases")
        return rec.copy(content=parts[0])

    async def _journal_parts(self, first: OutboxRecord, parts: list[dict[str, Any]], *, resumed: bool = True) -> None:
        """Record parts 2.. of ``first`` (OUT-12, OUT-13) under :func:`part_key`. A split
        of a record that existed before (``resumed``) that an earlier version began under
        the old keys (``key#2`` … linked to ``first``) is finished under those keys, so
        that no part is recorded (and sent) twice."""
        keys = contentlib.part_key
        if resumed and len(parts) > 1:
            old = await self.backend.outbox_get(self.scope, contentlib.legacy_part_key(first.key, 2))
            if old is not None and old.previous_part == first.key and old.part == 2:
                keys = contentlib.legacy_part_key
        now = self._now()
        for i in range(2, len(parts) + 1):
            part = OutboxRecord(
                key=keys(first.key, i), chat_id=first.chat_id, content=parts[i - 1],
                fingerprint=first.fingerprint, rule=first.rule, inbound_id=first.inbound_id,
                previous_part=keys(first.key, i - 1), part=i, origin=first.origin, state="pending",
                next_at=now, created_at=first.created_at, updated_at=now, seq=first.seq,
            )
            _, created = await self.backend.outbox_journal(self.scope, part)
            if created:
                self._count("outbox_journaled")

    # -- one provider call ----------------------------------------------------------------
    async def _attempt(self, rec: OutboxRecord) -> _Sent | _Failed | _Dead:
        """Call the provider once for a claimed (``sending``) record and record the
        outcome (OUT-1, OUT-7, OUT-8)."""
        b, scope, cfg = self.backend, self.scope, self.config.outbox
        try:
            async with self._heartbeat(
                lambda until: b.outbox_heartbeat(scope, rec.key, token=rec.token, lease_until=until), cfg.lease_ms
            ):
                # OUT-6: the provider sees the chat and the content, never the key
                message_id = await self.bot.provider.send(rec.chat_id, contentlib.decode(rec.content))
        except Exception as exc:
            now = self._now()
            if is_definitive(exc) or rec.attempts >= cfg.retries + 1:
                if await b.outbox_mark_dead(scope, rec.key, token=rec.token, now=now, error=repr(exc)):
                    await self._dead("outbox", rec.key, exc)
                else:
                    self._count("stale_leases")
                return _Dead(exc)
            delay = cfg.backoff.delay(rec.attempts, self.bot.rng.random())
            if isinstance(exc, RateLimitedError):
                delay = max(delay, exc.retry_after_ms)
            if not await b.outbox_mark_failed(scope, rec.key, token=rec.token, next_at=now + delay, error=repr(exc)):
                self._count("stale_leases")
            return _Failed(exc, delay)
        now = self._now()
        if not await b.outbox_mark_sent(
            scope, rec.key, token=rec.token, message_id=str(message_id), now=now, expires_at=self._expires(now)
        ):
            self._count("stale_leases")  # LEASE-2: another owner took it over meanwhile
            return _Sent(str(message_id), settled=False)
        return _Sent(str(message_id))

    def _after_send(self, rec: OutboxRecord, message_id: str) -> Awaitable[None]:
        return self.bot.after_send(rec.chat_id, rec.content, message_id, rec.key, journaled=True)

    # -- sends ----------------------------------------------------------------------------
    def _key_for(self, ctx: HandlerContext | None, explicit: str | None) -> tuple[str, str]:
        if explicit is not None:
            # OUT-3 rule 1 (per bot: the scope isolates it, OUT-4); never a part's key (OUT-12)
            key = contentlib.check_idempotency_key(explicit)
            shaped = self._derived_shaped
            if shaped is not None and _DERIVED_SHAPE.search(key):
                shaped.add(key)
                if len(shaped) > DERIVED_SHAPED_MAX:
                    self._derived_shaped = None
            return key, "explicit"
        if ctx is not None and ctx.record_id is not None:
            ctx.send_count += 1
            return f"{ctx.record_id}:{ctx.send_count}", "derived"  # rule 2
        return f"rnd:{uuid.uuid4().hex}", "random"  # rule 3

    async def send(self, chat_id: str, content: Any, *, idempotency_key: str | None, ctx: HandlerContext | None) -> SendResult:
        """``ctx.reply``/``bot.send`` with durability (OUT-1..OUT-15)."""
        self.check_idempotency_key(idempotency_key)
        with self.clock.busy():
            content = contentlib.normalize(content)
            key, rule = self._key_for(ctx, idempotency_key)
            try:
                encoded, fp, size = contentlib.journal_form(chat_id, content)
            except contentlib.UnencodableContent as exc:
                return await self._bypass(chat_id, content, str(exc))
            async with self._in_chat_order(chat_id), self._key_locks.hold(key):  # OUT-11, OUT-2
                try:
                    step = await self._record_send(chat_id, content, key, rule, fp, ctx, (encoded, size))
                    if isinstance(step, SendResult):
                        return step
                    rec, existed, alone = step
                    if existed:
                        return await self._drive_existing(rec)
                    return await self._inline(rec, alone=alone)
                except DurabilityError as exc:
                    # The journal failed under this send (before it was recorded, or in
                    # the bookkeeping after it): the handler is cut short, so its later
                    # sends never happened. The inbound record must not be completed as if
                    # its effects had settled (INB-2): it is retried, and the replay is
                    # answered from the outbox for every send already recorded.
                    if ctx is not None:
                        ctx.durability_failed = exc
                    raise

    async def _find_send(self, key: str, rule: str, fp: str) -> OutboxRecord | str:
        """The record of a send journaled before under ``key`` (OUT-2), or the key to
        journal it under: ``key``, or a new one when a replay diverged (OUT-5)."""
        return await self._settle_found(key, rule, fp, await self.backend.outbox_get(self.scope, key))

    async def _settle_found(self, key: str, rule: str, fp: str, existing: OutboxRecord | None) -> OutboxRecord | str:
        """:meth:`_find_send` once the record under ``key`` (or None) is known."""
        if existing is not None and rule == "derived" and existing.fingerprint != fp:  # OUT-5
            self._count("outbox_diverged")
            log.warning(
                "outbox %r: a replay produced other content than the recorded send (on_diverged=%s)",
                key, self.config.outbox.on_diverged,
            )
            if self.config.outbox.on_diverged == "send":
                key = f"{key}~{fp[:12]}"
                existing = await self.backend.outbox_get(self.scope, key)
        return key if existing is None else existing

    async def _record_send(
        self, chat_id: str, content: dict[str, Any], key: str, rule: str, fp: str, ctx: HandlerContext | None,
        journal_form: tuple[dict[str, Any], int],
    ) -> SendResult | tuple[OutboxRecord, bool, bool]:
        """Find or journal the outbox record of a send (OUT-1, OUT-2, OUT-5): the record,
        whether it existed, and whether this call journaled it whole in state ``sending``
        (``_inline``'s ``alone``); or the result when nothing is to be sent now.

        The key is looked up before the ``before("send")`` hooks run: a send under it may
        have been journaled before, and then the hooks must not run in this incarnation
        again (OUT-10; found by explore: a handler enqueueing under its next reply's
        derived key). One lookup is skipped (a round trip per message saved, issue 16):
        a derived key of an inbound record in its first execution here (:meth:`admit`
        journaled it), when no explicit key of that shape was used in this process —
        nothing can be under it but another process's explicit key, and then the
        journal's create conflicts, returns that record, and it is settled as the
        lookup's would have been (OUT-2, OUT-5); the hooks ran once here for it, which
        OUT-10 allows (once per incarnation).

        ``journal_form``: ``content`` encoded and its size, as ``send`` fingerprinted it
        (:meth:`_encode_or_bypass` takes it when no hook ran)."""
        shaped = self._derived_shaped
        blind = (rule == "derived" and ctx is not None and ctx.record_id in self._fresh_inbound
                 and shaped is not None and key not in shaped)
        found = key if blind else await self._find_send(key, rule, fp)
        if isinstance(found, OutboxRecord):
            return found, True, False
        key = found
        prepared = await self.bot.run_before_send(chat_id, content)
        if prepared is None:
            return SendResult(None, key, state="cancelled")
        encoded = await self._encode_or_bypass(chat_id, prepared, journal_form)
        if isinstance(encoded, SendResult):
            return encoded
        rec, created = await self._journal_new(key, rule, chat_id, encoded, fp, ctx, origin="inline")
        if not created and blind:  # the record under the key, settled as a lookup would have
            settled = await self._settle_found(key, rule, fp, rec)
            if isinstance(settled, str):  # diverged (OUT-5): journaled under its own key
                found = await self._find_send(settled, "explicit", fp)
                if isinstance(found, OutboxRecord):
                    return found, True, False
                key = settled
                rec, created = await self._journal_new(key, rule, chat_id, encoded, fp, ctx, origin="inline")
        if not created:
            return rec, True, False  # another process journaled this key meanwhile (OUT-2)
        if rec.state != "sending":  # split into parts (OUT-12)
            claim = await self._claim_send(key, recover=False)
            if claim is None:
                return SendResult(None, key, state="pending")
            return claim[0], False, False
        return rec, False, True

    async def _journal_new(
        self, key: str, rule: str, chat_id: str, encoded: dict[str, Any], fp: str, ctx: HandlerContext | None, *, origin: str
    ) -> tuple[OutboxRecord, bool]:
        """Journal a new send (OUT-1): one record in state ``sending`` (inline, fits the
        channel) or ``pending``; a text over the limit is split into parts first
        (OUT-12). Returns the record and whether this call created it (False: the key
        was journaled meanwhile, by another process; the record is the stored one)."""
        now = self._now()
        self._seq += 1
        parts = contentlib.split_content(encoded, self.bot.provider.text_limit)
        inline_single = origin == "inline" and len(parts) == 1
        rec = OutboxRecord(
            key=key, chat_id=chat_id, content=encoded, fingerprint=fp, rule=rule,
            inbound_id=ctx.record_id if ctx is not None else None, origin=origin,
            state="sending" if inline_single else "pending", attempts=1 if inline_single else 0,
            token=1 if inline_single else 0,
            owner=self.instance_id if inline_single else None, incarnation=self.incarnation if inline_single else None,
            lease_until=now + self.config.outbox.lease_ms if inline_single else None,
            claimed_at=now if inline_single else None, next_at=None if inline_single else now,
            created_at=now, updated_at=now, seq=self._seq,
        )
        stored, created = await self.backend.outbox_journal(self.scope, rec)
        if not created:
            return stored, False
        self._count("outbox_journaled")
        if len(parts) > 1:
            await self._journal_parts(rec, parts, resumed=False)
            # declined: a sweep (of this process or another) claimed the record, pending and due
            # since it was journaled, and splits it itself — no lease of ours was taken, so
            # nothing for stale_leases (LEASE-2); the claim below finds it taken
            await self.backend.outbox_split(self.scope, key, token=None, content=parts[0])
            rec = rec.copy(content=parts[0])
        return rec, True

    async def _drive_existing(self, rec: OutboxRecord) -> SendResult:
        """A send whose key is journaled already: answer from the outbox (OUT-2) or
        finish it."""
        if rec.state == "sent":
            self._count("outbox_deduped")
            return SendResult(rec.message_id, rec.key, [rec.message_id] if rec.message_id else [], deduped=True)
        if rec.state == "dead":
            raise SendFailedError(rec.key, rec.error or "dead")
        if rec.state == "unknown":
            return SendResult(None, rec.key, state="unknown")
        claim = await self._claim_send(rec.key, recover=True)
        if claim is None:  # in flight elsewhere or not due yet: the sweep owns it now
            return SendResult(None, rec.key, state=rec.state)
        new, previous_state = claim
        if previous_state == "sending" and not await self._ambiguous(new):
            return SendResult(None, rec.key, state="unknown")
        new = await self._split_claimed(new)
        return await self._inline(new)

    async def _inline(self, rec: OutboxRecord, *, alone: bool = False) -> SendResult:
        """Send a claimed record and its later parts, retrying inline for up to
        ``outbox.inline_max_ms`` (OUT-9), then raising ``SendDeferredError``.

        ``alone``: ``rec`` was journaled by this very send, whole (one part, directly in
        state ``sending``). When its ``mark_sent`` then takes at the first attempt, nobody
        claimed it in between (LEASE-2) — splitting a record takes a claim, or a state
        other than ``sending`` — so no later part can exist and none is looked for (a
        read saved per message)."""
        started = self._now()
        first_key = rec.key
        ids: list[str] = []
        while True:
            outcome = await self._attempt(rec)
            if isinstance(outcome, _Sent):
                ids.append(outcome.message_id)
                await self._after_send(rec, outcome.message_id)
                nxt = None if alone and outcome.settled else await self._next_part(rec)
                if nxt is None:
                    return SendResult(ids[0], first_key, ids)
                rec = nxt
                continue
            # OUT-9: the errors name the send (``first_key``) and the part's record
            if isinstance(outcome, _Dead):
                cause = outcome.error if isinstance(outcome.error, BaseException) else None
                raise SendFailedError(first_key, repr(outcome.error), cause, part_key=rec.key)
            if self._now() + outcome.delay - started > self.config.outbox.inline_max_ms:
                self._count("outbox_deferred")
                raise SendDeferredError(first_key, outcome.error, part_key=rec.key)
            await self.clock.sleep(outcome.delay)
            claim = await self._claim_send(rec.key, recover=False)
            if claim is None:
                self._count("outbox_deferred")
                raise SendDeferredError(first_key, outcome.error, part_key=rec.key)
            self._count("outbox_retried")
            rec = claim[0]
            alone = False  # it was failed meanwhile: another process may have split it (OUT-13)

    async def _following_part(self, rec: OutboxRecord) -> OutboxRecord | None:
        """The part journaled right after ``rec`` (linked by ``previous_part``), if any
        — a user's record under a key that looks like a part's never is (OUT-12). The
        later parts of a chain an earlier version journaled under ``key#2`` … are not
        followed here: the sweep sends them, each due as soon as the one before is
        sent."""
        base = contentlib.send_key_of(rec.key, rec.part)
        nxt = await self.backend.outbox_get(self.scope, contentlib.part_key(base, rec.part + 1))
        return nxt if nxt is not None and nxt.previous_part == rec.key else None

    async def _next_part(self, rec: OutboxRecord) -> OutboxRecord | None:
        nxt = await self._following_part(rec)
        if nxt is None:
            return None
        claim = await self._claim_send(nxt.key, recover=False)
        return None if claim is None else claim[0]

    async def _encode_or_bypass(
        self, chat_id: str, prepared: dict[str, Any], known: tuple[dict[str, Any], int] | None = None
    ) -> dict[str, Any] | SendResult:
        """The journal form of content after the hooks, or — when it cannot be journaled
        or is over ``outbox.max_payload_bytes`` — the result of sending it without the
        outbox (OUT-15). ``known``: the journal form and size of the content before the
        ``before("send")`` hooks, taken when no hook is registered (hooks are only ever
        added, so none ran and ``prepared`` is that content); with hooks the content is
        encoded and measured again (a hook may change it in place)."""
        if known is not None and not self.bot.has_before_send():
            encoded, size = known
        else:
            try:
                encoded = contentlib.encode(prepared)
            except contentlib.UnencodableContent as exc:
                return await self._bypass(chat_id, prepared, str(exc), hooks_done=True)
            size = contentlib.encoded_size(encoded)
        if size > self.config.outbox.max_payload_bytes:
            return await self._bypass(chat_id, prepared, "payload over outbox.max_payload_bytes", hooks_done=True)
        return encoded

    async def _bypass(self, chat_id: str, content: dict[str, Any], why: str, *, hooks_done: bool = False) -> SendResult:
        """OUT-15: content that cannot be journaled is sent without the outbox."""
        self._count("outbox_bypassed")
        log.warning("send to %r bypasses the outbox: %s", chat_id, why)
        if not hooks_done:
            prepared = await self.bot.run_before_send(chat_id, content)
            if prepared is None:
                return SendResult(None, None, state="cancelled")
            content = prepared
        message_id = str(await self.bot.provider.send(chat_id, content))
        await self.bot.after_send(chat_id, content, message_id, None)
        return SendResult(message_id, None, [message_id])

    async def enqueue(self, chat_id: str, content: Any, *, idempotency_key: str | None) -> dict[str, str]:
        """OUT-10: run the ``before("send")`` hooks once, journal, return ``{"key"}`` at
        once; the sweep delivers it."""
        self.check_idempotency_key(idempotency_key)
        with self.clock.busy():
            content = contentlib.normalize(content)
            key, rule = self._key_for(None, idempotency_key)
            async with self._key_locks.hold(key):  # hooks once per journaled send
                if await self.backend.outbox_get(self.scope, key) is not None:
                    return {"key": key}
                try:
                    encoded, fp, size = contentlib.journal_form(chat_id, content)
                except contentlib.UnencodableContent as exc:
                    await self._bypass(chat_id, content, str(exc))
                    return {"key": key}
                prepared = await self.bot.run_before_send(chat_id, content)
                if prepared is None:
                    return {"key": key}
                journaled = await self._encode_or_bypass(chat_id, prepared, (encoded, size))
                if isinstance(journaled, SendResult):
                    return {"key": key}
                _, created = await self._journal_new(key, rule, chat_id, journaled, fp, None, origin="enqueue")
            if created:
                self._spawn(self._deliver_soon(key))
            return {"key": key}

    async def _deliver_soon(self, key: str) -> None:
        try:
            await self._deliver_key(key)
        except Exception as exc:  # the sweep will try again; report it
            await self.bot.emit("error", {"error": exc, "stage": "enqueue", "key": key})

    async def _deliver_key(self, key: str) -> None:
        with self.clock.busy():
            rec = await self.backend.outbox_get(self.scope, key)
            if rec is None:
                return
            async with self._in_chat_order(rec.chat_id):
                while rec is not None:
                    await self._deliver(rec, recover=False)
                    done = await self.backend.outbox_get(self.scope, rec.key)
                    if done is None or done.state != "sent":
                        return
                    rec = await self._following_part(done)

    # -- operator API (OPS-2) --------------------------------------------------------------
    async def replay_inbound(self, id: str) -> bool:
        """Process an inbound record again (a dead one, say). Returns False when there
        is no such record or it is leased."""
        check_key(id, "id")
        with self.clock.busy():
            rec = await self.backend.inbox_replay(self.scope, id, now=self._now())
            if rec is None:
                return False
            claimed = await self._claim_inbound(id, recover=False)
            if claimed is None:
                return False
            self._count("inbound_replayed")
            await self._execute(claimed, None)
            return True

    async def retry_send(self, key: str) -> bool:
        """Send a ``dead``, ``failed`` or ``unknown`` record again."""
        check_key(key, "key")
        with self.clock.busy():
            if not await self.backend.outbox_retry(self.scope, key, now=self._now()):
                return False
            rec = await self.backend.outbox_get(self.scope, key)
            if rec is not None:
                async with self._in_chat_order(rec.chat_id):
                    await self._deliver(rec, recover=False)
            return True
