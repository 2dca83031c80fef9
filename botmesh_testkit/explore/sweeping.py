"""The sweep's side of the explorer (issue 12): volumes and retention (OPS-3), slow and
unreadable replays, and the timing the model requires of the background sweep.

:class:`SweepModel` is a part of :class:`~botmesh_testkit.explore.story.Explorer` (its
verbs :meth:`~SweepModel.burst` and :meth:`~SweepModel.left_pending`, and the checks
:meth:`~SweepModel.check_sweep` runs after every step). What it requires:

* **purging keeps up** (OPS-3): a burst of messages to another bot on the backend (its
  retention one minute) leaves, at the end, no record in its journals of a message that
  finished more than the retention plus :data:`PURGE_GRACE_MS` ago — a burst of 600
  messages at 20 a second is over any purge that deletes at most 500 records per
  journal per minute (the old cap: above about 8 messages a second sustained, the
  journals grew without bound);
* **a due send retry is never held up** (OUT-7, RETRY-1): a send the channel failed
  transiently is tried again within :data:`RETRY_BOUND_MS` of that failure, as long as
  the process lives — whatever a replayed handler is doing (a handler sleeping five
  minutes on a replay) and whether another record's processing in the sweep raises (a
  record the journal cannot read);
* **a record left pending is replayed** (INB-3): a message a dead process journaled
  and never handled (:meth:`~SweepModel.left_pending`) starts its handler within
  :data:`RETRY_BOUND_MS` of becoming due (or of its record becoming readable again),
  plus the time slow handlers ran meanwhile (replays run one at a time, by design) —
  another record whose claim raises does not stop it.

Choices the spec leaves open (documented here and in the README): the model allows a
purge to come up to a minute late (the reference engine purges once a minute when not
behind), and the bounds above count the backoff's cap with its jitter (72 s), the inline
retries that may hold a chat's order (:data:`~botmesh_testkit.explore.story.MAX_TRANSIENT`
failures of at most ``inline_max_ms`` each) and a pass.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from typing import Any

from botmesh.core.bot import Bot
from botmesh.core.provider import InboundEvent, ProviderError, is_definitive
from botmesh.core.records import InboxRecord
from botmesh.core.store import MemoryStore
from botmesh.core.testing import MockProvider, SimulatedCrash

__all__ = ["BURST_BOT", "BURST_RETENTION_MS", "PURGE_GRACE_MS", "RETRY_BOUND_MS", "SweepModel"]

BURST_BOT = "burst"
"""``bot_id`` (and ``instance_id``) of the bot :meth:`SweepModel.burst` starts beside the
explored one, on the same backend: its records live under a scope of their own."""
BURST_RETENTION_MS = 60_000.0
"""``retention`` of the burst bot: one minute, short enough that purging matters within
a story, long enough that the old purge period (a minute) applies."""
PURGE_GRACE_MS = 62_000.0
"""How late the model allows a purge: one purge period of a minute (the reference
engine's, when not behind) and two passes."""
RETRY_BOUND_MS = 75_000.0
"""A failed send is tried again within 75 s of virtual time while its process lives: the
outbox backoff's cap (60 s) with its jitter (±20 %) — the longest wait the engine may
choose after a failed attempt; a rate limit's ``retry_after`` of 20 s is below — and a
few passes; plus :data:`INLINE_HOLD_MS` per failed call meanwhile."""
INLINE_HOLD_MS = 15_000.0
"""How long one failed call may hold what a due record waits for: a send retried inline
holds its chat's order (OUT-11) for up to ``outbox.inline_max_ms`` (15 s); a replayed
handler's inline retries hold the replays behind it as long."""


def _text_of(content: Any) -> str:
    return str(content.get("text")) if isinstance(content, dict) else str(content)


class SweepModel:
    """The verbs and checks of the module docstring, mixed into the explorer (which owns
    ``world``, ``messages``, ``order``, ``crashes``, ``dead_chats`` and the methods
    below that raise ``NotImplementedError`` here)."""

    world: Any
    messages: dict[str, Any]
    order: list[str]
    crashes: int
    dead_chats: set[str]
    violation_type: Any
    """The explorer's violation (``ExploreViolation(ids, message)``)."""
    message_type: Any
    """The explorer's record of a message (``_Message(chat, mid, actions)``)."""
    outbox_retries: int

    def check(self) -> None:
        raise NotImplementedError

    def _note_death(self) -> None:
        raise NotImplementedError

    async def _quiet(self) -> None:
        raise NotImplementedError  # Explorer's

    async def _checked(self) -> None:
        raise NotImplementedError  # Explorer's

    async def _deliver(self, msg: Any) -> None:
        raise NotImplementedError

    def _violation(self, ids: tuple[str, ...], message: str) -> AssertionError:
        error: AssertionError = self.violation_type(ids, message)
        return error

    def _init_sweep(self) -> None:
        self.calls: list[tuple[float, str, str, BaseException | None]] = []
        """Every provider call the channel saw: (virtual time, chat, text, error or None)."""
        self.deaths: list[float] = []
        """Virtual time at which each death was seen (at or after the death itself)."""
        self.slow_spans: list[tuple[float, float]] = []
        """(start, end) of every slow sleep of a handler (:func:`~.story.slow`)."""
        self.live: dict[int, Any] = {}
        """The inbound events the channel is delivering right now, by ``id()``: a handler
        whose ``ctx.event`` is none of them runs a replay."""
        self.started: dict[str, list[float]] = {}
        """Virtual times at which each message's handler started."""
        self.finished_in: dict[str, Counter[int]] = defaultdict(Counter)
        """Per message, how many executions ran to their end in each incarnation."""
        self.pending_due: dict[str, float] = {}
        """Messages :meth:`left_pending` journaled, and when their record became due."""
        self.unreadable: dict[str, float] = {}
        """Records whose reads and claims raise, and until when (virtual ms)."""
        self.burst_log: list[tuple[float, bool]] = []
        """(virtual time, answered) of every message of every burst."""
        self.volume_bursts = 0
        """Bursts of :meth:`burst` so far (:mod:`.processes` counts its own, ``bursts``)."""
        self._wrap_send()

    # -- the world's side -----------------------------------------------------------------
    def _wrap_send(self) -> None:
        """Log every call of the channel with the virtual time it was made at."""
        channel = self.world.channel
        real = channel.send

        async def send(chat_id: str, content: Any) -> str:
            at = self.world.clock.now()
            try:
                message_id: str = await real(chat_id, content)
            except BaseException as exc:
                self.calls.append((at, chat_id, _text_of(content), exc))
                raise
            self.calls.append((at, chat_id, _text_of(content), None))
            return message_id

        channel.send = send

    def _poison(self, backend: Any) -> None:
        """On this incarnation's backend, reads and claims of an :attr:`unreadable` record
        raise until its time is over (a record the journal cannot read for a while: a
        torn write, a codec bug in one code path)."""
        for name in ("inbox_get", "inbox_claim"):
            real = getattr(backend, name)

            async def call(scope: str, id: str, *args: Any, _real: Any = real, _name: str = name,
                           **kwargs: Any) -> Any:
                until = self.unreadable.get(id)
                if until is not None and self.world.clock.now() < until:
                    raise RuntimeError(f"explore: the journal cannot read the record {id!r} ({_name})")
                return await _real(scope, id, *args, **kwargs)

            setattr(backend, name, call)

    def _started(self, mid: str) -> None:
        self.started.setdefault(mid, []).append(self.world.clock.now())

    async def _slow(self, ms: float) -> None:
        now = self.world.clock.now()
        self.slow_spans.append((now, now + ms))
        await self.world.clock.sleep(ms)

    def slow_total(self) -> float:
        """Virtual time every slow action of the story takes once (the end lets that much
        more pass: replays run one at a time)."""
        return float(sum(a.n for m in self.messages.values() for a in m.actions if a.kind == "slow"))

    async def skip_busy(self, end: float) -> None:
        """Let time pass (up to ``end``) while a handler sleeps in a slow action or a
        record cannot be read: the world cannot settle before (the end's drain looks at
        the journals only after)."""
        now = self.world.clock.now()
        until = max([e for _, e in self.slow_spans if e > now] + [u for u in self.unreadable.values() if u > now],
                    default=now)
        if until > now and not self.world.crashed:
            await self.world.clock.advance(min(until, end) - now)
            self.check()

    # -- verbs ----------------------------------------------------------------------------
    async def left_pending(self, chat: str, mid: str, actions: Any, unreadable: float = 0.0) -> None:
        """A process died right after journaling message ``mid`` (its plan: ``actions``):
        its record is ``pending``, due now, and the sweep must replay it (INB-3). With
        ``unreadable`` (virtual ms), every read and claim of that record raises for that
        long. Then the channel delivers ``mid`` (a duplicate of the journaled record)."""
        await self._quiet()
        if mid not in self.messages:
            msg = self.messages[mid] = self.message_type(chat, mid, tuple(actions))
            self.order.append(mid)
            if not self.world.crashed:
                now = self.world.clock.now()
                if unreadable:
                    self.unreadable[mid] = now + unreadable
                d = self.world.bot.durability
                event: dict[str, Any] = {"id": mid, "chat_id": chat, "text": mid, "kind": "message", "user_id": None, "data": {}}
                try:
                    await d.backend.inbox_journal(d.scope, InboxRecord(id=mid, chat_id=chat, event=event,
                                                                       state="pending", next_at=now, created_at=now,
                                                                       updated_at=now))
                    self.pending_due[mid] = now
                except SimulatedCrash:  # a crash armed at this write: the process dies here
                    self._note_death()
            await self._deliver(msg)
        else:
            await self._deliver(self.messages[mid])
        await self._checked()

    async def burst(self, n: int, per_second: int) -> None:
        """Another bot on the backend (``bot_id`` and ``instance_id`` :data:`BURST_BOT`,
        ``retention`` one minute, a channel of its own) takes ``n`` messages,
        ``per_second`` a second of virtual time (every hundredth answered: the outbox is
        purged too; purges of the inbox alone cost the seconds a slow backend takes);
        then its traffic stops, and once the retention and
        :data:`PURGE_GRACE_MS` have passed, its journals must hold no record of a message
        that finished before that (OPS-3). The explored bot lives on meanwhile; when it
        dies the burst stops there (a dead process's world stands still) and is judged
        at that time."""
        await self._quiet()
        if self.world.crashed:
            await self._checked()
            return
        self.volume_bursts += 1
        tag = f"b{self.volume_bursts}"
        backend = self.world.crashable.inner if self.world.crashable is not None else self.world.bot.durability.backend
        backend = self.world.serialized(backend)  # one call at a time with the explored bot's (as a replica's)
        bot = Bot(MockProvider(), MemoryStore(), {"backend": backend, "instance_id": BURST_BOT,
                                                  "retention": BURST_RETENTION_MS, "poll_ms": 1000.0},
                  clock=self.world.clock, bot_id=BURST_BOT)

        @bot.otherwise
        async def answer(ctx: Any) -> None:
            if ctx.event.id.endswith("00"):
                await ctx.reply(f"re:{ctx.event.id}")

        try:
            await bot.start()
            for first in range(0, n, per_second):
                ids = [f"{tag}.{i}" for i in range(first, min(n, first + per_second))]
                now = self.world.clock.now()
                await self.world.drive(asyncio.gather(*(bot.provider.deliver(InboundEvent(
                    id=i, chat_id=f"{tag}.{j % 7}", text=i)) for j, i in enumerate(ids))))
                self.burst_log.extend((now, i.endswith("00")) for i in ids)
                await self.world.clock.advance(1000.0)
                if self.world.crashed:
                    break
            if not self.world.crashed:
                await self.world.clock.advance(BURST_RETENTION_MS + PURGE_GRACE_MS)
            await self._check_purged(bot)
        finally:
            await bot.abandon()
        await self._checked()

    async def _check_purged(self, bot: Bot) -> None:
        d = bot.durability
        assert d is not None
        cutoff = self.world.clock.now() - BURST_RETENTION_MS - PURGE_GRACE_MS
        inbox = len(await d.backend.inbox_list(d.scope, limit=10**7))
        outbox = len(await d.backend.outbox_list(d.scope, limit=10**7))
        may_in = sum(1 for at, _ in self.burst_log if at > cutoff)
        may_out = sum(1 for at, answered in self.burst_log if answered and at > cutoff)
        if inbox > may_in or outbox > may_out:
            raise self._violation(
                ("OPS-3",),
                f"after a burst of messages to the bot {BURST_BOT!r} (retention {BURST_RETENTION_MS / 1000:g} s) its "
                f"journals hold {inbox} inbound and {outbox} outbound records, where at most {may_in} and {may_out} "
                f"(of the messages finished within the retention and {PURGE_GRACE_MS / 1000:g} s) may remain: "
                "purging does not keep up")

    # -- the model ------------------------------------------------------------------------
    def _note_deaths(self) -> None:
        """Count a death no verb saw (the process died in the background: a pass, a
        heartbeat, a replay), and note the time of every death."""
        if self.world.crashed:
            self._note_death()
        now = self.world.clock.now()
        while len(self.deaths) < self.crashes:
            self.deaths.append(now)

    def _died_within(self, start: float, end: float) -> bool:
        return any(start <= d <= end for d in self.deaths)

    def check_sweep(self) -> None:
        """After every step: no due send retry and no record left pending waits longer
        than the model allows (see the module docstring)."""
        self._note_deaths()
        if self.world.crashed:
            return
        now = self.world.clock.now()
        self._check_retries(now)
        self._check_pending(now)

    def _bypassed(self) -> set[str]:
        return {a.text for m in self.messages.values() for a in m.actions if a.kind == "reply_nan"}

    def _failed_calls(self, start: float, end: float, chat: str | None = None) -> int:
        """Failed calls (to ``chat``, or any) made within [start, end]."""
        return sum(1 for at, c, _, error in self.calls
                   if error is not None and start <= at <= end and (chat is None or c == chat))

    def _check_retries(self, now: float) -> None:
        """Each failed call (a transient error) is followed by the next call of its text
        — or by now — within the bound; checked over the whole history, so a retry that
        came late shows after the fact too."""
        after: dict[tuple[str, str], float] = {}
        failures: dict[tuple[str, str], int] = {}
        late: list[tuple[float, float, str, str, BaseException]] = []
        for at, chat, text, error in reversed(self.calls):
            key = (chat, text)
            if error is not None and isinstance(error, ProviderError) and not is_definitive(error):
                failures[key] = failures.get(key, 0) + 1
                end = after.get(key, now)
                if end - at > RETRY_BOUND_MS:
                    late.append((at, end, chat, text, error))
            after[key] = at
        if not late:
            return
        bypassed = self._bypassed()
        for at, end, chat, text, error in reversed(late):
            if (chat in self.dead_chats or text in bypassed or self._died_within(at, end)
                    or failures[(chat, text)] + len(self.deaths) > self.outbox_retries):
                continue  # no retry is due: a definitive refusal, no outbox, a death, the retries spent
            allowed = RETRY_BOUND_MS + INLINE_HOLD_MS * (self._failed_calls(at, end, chat) - 1)
            if end - at <= allowed:
                continue
            when = (f"was tried again only {(end - at) / 1000:g} s" if end < now
                    else f"has not been tried again for {(end - at) / 1000:g} s")
            raise self._violation(
                ("OUT-7", "RETRY-1"),
                f"the send {text!r} to chat {chat!r} failed ({type(error).__name__}: {error}) and {when} of virtual "
                "time later, the process alive all along: a due retry must reach "
                f"the channel within {allowed / 1000:g} s (the backoff's cap with its jitter and a few passes, and "
                f"{INLINE_HOLD_MS / 1000:g} s for each other failed call to the chat meanwhile) — whatever a replayed "
                "handler does, and whatever another record's processing in the sweep raises")

    def _busy(self, start: float, end: float) -> float:
        """Virtual time slow handlers slept within [start, end] (summed)."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.slow_spans)

    def _check_pending(self, now: float) -> None:
        """Each record :meth:`left_pending` journaled starts its handler within the bound
        of becoming due (checked after the fact too)."""
        for mid, journaled in self.pending_due.items():
            started = self.started.get(mid)
            end = started[0] if started else now
            if self._died_within(journaled, end):
                continue
            due = max(journaled, self.unreadable.get(mid, journaled))
            allowed = RETRY_BOUND_MS + self._busy(journaled, end) + INLINE_HOLD_MS * self._failed_calls(journaled, end)
            if end - due > allowed:
                unreadable = (f", its record unreadable for {(due - journaled) / 1000:g} s" if due > journaled else "")
                what = (f"its handler started only {(end - due) / 1000:g} s after it was due" if started else
                        f"it was due {(end - due) / 1000:g} s ago and its handler never started")
                raise self._violation(
                    ("INB-3",),
                    f"message {mid}, which a dead process left pending{unreadable}: {what}, the process alive all "
                    f"along: the sweep must replay it within {allowed / 1000:g} s ({RETRY_BOUND_MS / 1000:g} s, the "
                    f"time slow handlers ran and {INLINE_HOLD_MS / 1000:g} s per failed call meanwhile) — another "
                    "record whose processing raises does not stop it")
