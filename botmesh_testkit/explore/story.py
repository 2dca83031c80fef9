"""The explorer's world and model, usable from a scenario file: what a story found by
``explore`` replays, line by line.

:class:`Explorer` wraps a :class:`~botmesh_testkit.scenario.Scenario` (a crash world: a
channel, a virtual clock, bot incarnations on one backend). Every verb of a story is
one of its methods; the model of what must have happened is kept beside the world, in
plain Python, and :meth:`Explorer.check` (after every step) and :meth:`Explorer.finish`
(at the end) compare the two. A story file looks like::

    from botmesh_testkit.explore.story import Explorer, reply, enqueue
    from botmesh_testkit.scenario import scenario

    @scenario("OUT-12", "OUT-2")
    async def explore_story(s):
        x = Explorer(s, text_limit=8)
        await x.start()
        await x.receive("c1", "m1", [reply("m1.0", key="a#2")])
        await x.receive("c1", "m2", [reply("m2.0 a long text", key="a")])
        await x.finish()

The handler every incarnation runs is the *plan handler*: the message ``m1`` does what
its plan (the actions given with its first delivery) says — replies under derived or
explicit keys (a text longer than the channel's limit is split, OUT-12), replies whose
content cannot be journaled (a NaN: bypasses the outbox, OUT-15), concurrent enqueues of
one key (OUT-10), a raise on its first n executions (the record is done all the same,
INB-6: a reprocessing after a crash runs it again, INB-9), minutes of virtual time on a
replay (:func:`slow`). A send the channel refuses
for good ends in the outbox's DLQ; the handler catches
:class:`~botmesh.core.errors.SendFailedError` and
:class:`~botmesh.core.errors.SendDeferredError`, as a careful handler does, and the
model checks the key each names (OUT-9).

What the model requires (each violation names its ids):

* every message the channel delivered is acknowledged in the end (redelivered until it
  is: INB-1, INB-8) and ends ``done`` — only after an execution of its handler ran to
  its end, returning or raising (INB-2, INB-6: a handler that raises is not retried) —
  or ``dead``, only when none ever finished and the process died at least
  ``inbox.max_attempts`` times (INB-7, GUAR-7); ``dead`` ones, and only they, are in
  the inbox DLQ;
* every journaled send of a ``done`` message reached the channel exactly once — each
  part of a split text once, in order — or is accounted for: an ambiguous part
  (``durability:ambiguous``, OUT-14) at most once under ``skip`` and at least once under
  ``resend``; a send to a chat that refuses for good is in the outbox DLQ instead
  (GUAR-1, GUAR-3, OUT-2, OUT-7, OUT-12, OUT-13);
* sends under one key are one send: only one text per key ever reaches the channel
  (OUT-2, OUT-3) — a part of a split text never takes the place of a user's key (OUT-12);
* a send that cannot be journaled reaches the channel once per execution that made it,
  never silently not at all (OUT-15);
* the ``before("send")`` hooks run at most once per journaled send and incarnation,
  however many concurrent enqueues of its key there are (OUT-10);
* a message's media loads as its reference allows: the bytes of a valid one, ``None``
  (or, with ``throw_on_error``, a ``MediaUnavailableError``) for an expired one, one
  whose download fails with another exception, a
  pre-feature bare token or a reference tampered with at rest — never another
  exception, and such a message is processed all the same, never dead-lettered for its
  reference (MEDIA-2, MEDIA-3, MEDIA-5);
* nothing reaches the channel that no handler sent, and no part twice unless an
  ambiguity event named it — under ``resend`` once more per ambiguity, at most one per
  death (after every step);
* the sweep's timing and purging (:mod:`~botmesh_testkit.explore.sweeping`, verbs
  :meth:`~Explorer.left_pending` — a record a dead process left pending, maybe
  unreadable for a while — and :meth:`~Explorer.burst` — 600 messages to a second bot
  whose retention is a minute — and the plan action :func:`slow`, a handler that takes
  minutes on a replay): a due send retry reaches the channel within a bound of its
  failure whatever a replayed handler does or another record's processing raises
  (OUT-7, RETRY-1); a record left pending is replayed within a bound (INB-3); the burst
  bot's journals keep no record past its retention and a minute (OPS-3);
* with a second live process (:mod:`.replicas`): no handler running in two live
  processes at once, no completion of a live process refused as stale, fencing tokens
  that only grow (LEASE-1, LEASE-2, LEASE-3, REPL-1); a burst of real processes
  (:mod:`.processes`) is judged as the suite's multi-process items judge it (BACK-7,
  INB-4, OUT-2, REPL-1, REPL-3, REPL-4, LEASE-1, LEASE-2).

Deaths (INB-7's accounting) are counted once per incarnation of the bot, also one in
the background (a replay of its sweep) during any step, and once per replica killed.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from botmesh.core import content as contentlib
from botmesh.core import media as medialib
from botmesh.core.errors import SendDeferredError, SendFailedError
from botmesh.core.provider import (InboundEvent, MediaUnavailableError, ProviderError, RateLimitedError,
                                   RecipientUnreachableError)
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.testing import SimulatedCrash

from .processes import ProcessVerbs
from .replicas import ReplicaVerbs
from .sweeping import SweepModel
from .violation import ExploreViolation

__all__ = ["Action", "ExploreViolation", "Explorer", "enqueue", "fail", "reply", "reply_nan", "slow"]

INBOX_MAX_ATTEMPTS = 3
"""``inbox.max_attempts`` of the explored bots (small, so that the DLQ is reached)."""
OUTBOX_RETRIES = 12
"""``outbox.retries`` of the explored bots: above the transient faults an example can
inject (:data:`MAX_TRANSIENT`), so a send dies only of a definitive refusal."""
MAX_TRANSIENT = 6
MEDIA_BYTES = b"explore media of "
FINISH_MS = 3_600_000.0
DRAIN_CHUNK_MS = 60_000.0
"""Virtual time :meth:`Explorer.finish` lets pass (past every retry and rate limit)."""


@dataclass(frozen=True)
class Action:
    """One thing a message's handler does (build them with :func:`reply`,
    :func:`reply_nan`, :func:`enqueue`, :func:`fail`, :func:`slow`)."""

    kind: str
    text: str = ""
    key: str | None = None
    n: int = 1

    def __repr__(self) -> str:
        if self.kind in ("fail", "slow"):
            return f"{self.kind}({self.n})"
        args = [repr(self.text)]
        if self.key is not None:
            args.append(f"key={self.key!r}")
        if self.kind == "enqueue":
            args.append(f"n={self.n}")
        return f"{self.kind}({', '.join(args)})"


def reply(text: str, key: str | None = None) -> Action:
    """``await ctx.reply(text, idempotency_key=key)``."""
    return Action("reply", text, key)


def reply_nan(text: str, key: str | None = None) -> Action:
    """``await ctx.reply({"text": text, "ratio": nan})``: content JSON cannot carry."""
    return Action("reply_nan", text, key)


def enqueue(text: str, key: str, n: int = 2) -> Action:
    """``n`` concurrent ``bot.enqueue(chat, text, idempotency_key=key)``."""
    return Action("enqueue", text, key, n)


def fail(times: int) -> Action:
    """Raise here on the first ``times`` executions that reach this point."""
    return Action("fail", n=times)


def slow(ms: int) -> Action:
    """Take ``ms`` of virtual time here when the execution is a replay (the sweep's, of
    a record a dead process left: a slow API on a cold start, a long job); a live
    delivery passes. A replayed handler that takes long holds up no due send (issue
    12)."""
    return Action("slow", n=ms)


@dataclass
class _Message:
    chat: str
    mid: str
    actions: tuple[Action, ...]
    acked: bool = False
    executions: int = 0
    raised: int = 0
    completed: int = 0
    fail_passes: Counter[int] = field(default_factory=Counter)
    media: str | None = None


@dataclass(frozen=True)
class _Send:
    mid: str
    index: int
    chat: str
    text: str
    key: str | None
    kind: str


class Explorer(ReplicaVerbs, ProcessVerbs, SweepModel):
    """A scenario's world driven by explore's verbs, with the model beside it (see the
    module docstring; the sweep's verbs and checks are :class:`~.sweeping.SweepModel`'s).
    ``policy`` is ``outbox.on_ambiguous``; ``text_limit`` the channel's limit (None: no
    split); ``default_id``: the bot runs on the default ``instance_id`` (LEASE-3) instead
    of ``i1`` (see :mod:`.replicas`)."""

    violation_type = ExploreViolation
    message_type = _Message
    outbox_retries = OUTBOX_RETRIES

    def __init__(self, s: Any, *, text_limit: int | None = None, policy: str = "skip",
                 on_diverged: str = "send", default_id: bool = False) -> None:
        self.s = s
        self.world = s.world
        self.world.channel.text_limit = text_limit
        self.text_limit = text_limit
        self.policy = policy
        s.configure(inbox={"max_attempts": INBOX_MAX_ATTEMPTS},
                    outbox={"on_ambiguous": policy, "retries": OUTBOX_RETRIES, "on_diverged": on_diverged})
        self.messages: dict[str, _Message] = {}
        self.order: list[str] = []
        self.hooks: Counter[tuple[int, str]] = Counter()
        self.bypass_ok: Counter[str] = Counter()
        self.bypass_reached: Counter[str] = Counter()
        self.media_errors: list[tuple[str, str]] = []
        """(message, what went wrong) of a media download that broke MEDIA-2/MEDIA-3."""
        self.bypass_raised: list[tuple[str, str]] = []
        """(text, error) of an unjournaled reply that raised what no provider raised (OUT-15)."""
        self.key_errors: list[tuple[str, str, str, str, bool]] = []
        """(error, key expected, key named, text, derived) of an error naming another key."""
        self.dead_chats: set[str] = set()
        self.crashes = 0
        """Deaths of the bot's incarnations and replicas so far (each counted once: :meth:`_note_death`)."""
        self._death_noted = 0
        self.instance = 1
        self.transient = 0
        self._inflight: set[asyncio.Future[Any]] = set()
        self._wrap_download()
        self._init_replicas(default_id)
        self._init_processes()
        self._init_sweep()
        s.setup(self._install)

    def _wrap_download(self) -> None:
        """The channel's download of a ``broken`` reference fails with an error that is
        no ``ProviderError`` (a provider breaking its contract: MEDIA-3 says a failed
        download all the same)."""
        channel = self.world.channel
        real = channel.download_media

        async def download_media(ref: Any) -> bytes:
            url = ref.get("url") if isinstance(ref, dict) else None
            if isinstance(url, str) and "/broken/" in url:
                raise OSError(f"explore: connection reset downloading {url}")
            data: bytes = await real(ref)
            return data

        channel.download_media = download_media

    # -- the bot --------------------------------------------------------------------------
    def _install(self, bot: Any) -> None:
        self._install_as(bot, self.world.incarnations + 1)
        if self.world.crashable is not None:
            self._poison(self.world.crashable)

    def _install_as(self, bot: Any, process: int) -> None:
        """The plan handler and the hook counter on ``bot``, the process ``process``
        (an incarnation of the world's bot, or ``-n`` for the n-th replica)."""

        def hook(chat_id: str, content: dict[str, Any]) -> None:
            self.hooks[(process, str(content.get("text", "")))] += 1

        bot.before("send")(hook)
        bot.otherwise(self._tracked(process, self._handle))

    async def _handle(self, ctx: Any) -> None:
        msg = self.messages.get(ctx.event.id)
        if msg is None:
            return
        msg.executions += 1
        self._started(msg.mid)
        derived = 0
        if msg.media is not None:
            await self._load_media(ctx, msg)
        try:
            for i, act in enumerate(msg.actions):
                if act.kind == "fail":
                    if msg.fail_passes[i] < act.n:
                        msg.fail_passes[i] += 1
                        raise RuntimeError(f"explore: {msg.mid} fails at action {i}")
                    continue
                if act.kind == "slow":
                    if id(ctx.event) not in self.live:  # a replay (a live delivery is quick)
                        await self._slow(act.n)
                    continue
                if act.kind == "enqueue":
                    assert act.key is not None
                    # waiting on its own subtasks, the handler is not busy work: when they all
                    # wait for the clock (a send of the key sleeping on its backoff holds the key's
                    # lock), virtual time must be able to move
                    with self.world.clock.waiting():
                        await asyncio.gather(*(ctx.bot.enqueue(ctx.chat_id, act.text, idempotency_key=act.key)
                                               for _ in range(act.n)))
                    continue
                if act.key is None:
                    derived += 1
                expected = act.key if act.key is not None else f"{ctx.record_id}:{derived}"
                body: Any = act.text if act.kind == "reply" else {"text": act.text, "ratio": float("nan")}
                if act.kind == "reply_nan":
                    self.bypass_reached[act.text] += 1
                try:
                    await ctx.reply(body, idempotency_key=act.key)
                    if act.kind == "reply_nan":
                        self.bypass_ok[act.text] += 1
                except (SendFailedError, SendDeferredError) as exc:
                    if exc.key != expected:
                        # a derived send that diverged (OUT-5, on_diverged=send) is journaled under a new
                        # key: the error must name that one, which the end checks against the outbox
                        self.key_errors.append((type(exc).__name__, expected, str(exc.key), act.text,
                                                act.key is None))
                except ProviderError:
                    if act.kind != "reply_nan":  # a bypassed send has no retry: its error reaches the handler
                        raise
                except Exception as exc:
                    if act.kind == "reply_nan":  # OUT-15: bypassed with a warning, not refused by the encoder
                        self.bypass_raised.append((act.text, f"{type(exc).__name__}: {exc}"))
                    raise
        except Exception:
            msg.raised += 1
            self.finished_in[msg.mid][self.world.incarnations] += 1
            raise
        msg.completed += 1
        self.finished_in[msg.mid][self.world.incarnations] += 1

    async def _load_media(self, ctx: Any, msg: _Message) -> None:
        """``load_media_of(ctx)``: the bytes of a valid reference, None for any other —
        never an exception (MEDIA-3); with ``throw_on_error`` only a
        ``MediaUnavailableError``."""
        want = MEDIA_BYTES + msg.mid.encode() if msg.media == "valid" else None
        try:
            got = await medialib.load_media_of(ctx)
        except Exception as exc:
            self.media_errors.append((msg.mid, f"load_media_of raised {type(exc).__name__}: {exc}"))
            return
        if got != want:
            self.media_errors.append((msg.mid, f"load_media_of gave {got!r:.60}, expected {want!r:.60}"))
        try:
            await medialib.load_media_of(ctx, throw_on_error=True)
        except MediaUnavailableError:
            if msg.media == "valid":
                self.media_errors.append((msg.mid, "load_media_of(throw_on_error=True) raised for a valid reference"))
        except Exception as exc:
            self.media_errors.append((msg.mid, f"load_media_of(throw_on_error=True) raised {type(exc).__name__}: "
                                               f"{exc}, not MediaUnavailableError"))

    async def _journal_before(self, msg: _Message) -> None:
        """What a process that died right after journaling ``msg`` left behind, with its
        media reference stored as a pre-feature version wrote it (``legacy``: a bare
        token) or altered at rest (``tampered``: a durable entry whose data is not an
        object): a pending record the sweep replays (MEDIA-3, MEDIA-5)."""
        d = self.world.bot.durability
        stored: Any = (f"legacy-token-{msg.mid}" if msg.media == "legacy"
                       else {"durable": {"provider": self.world.channel.name, "v": 1, "data": "tampered"}})
        now = self.world.clock.now()
        event = {"id": msg.mid, "chat_id": msg.chat, "text": msg.mid, "kind": "message", "user_id": None,
                 "data": {}, "media": stored}
        await d.backend.inbox_journal(d.scope, InboxRecord(id=msg.mid, chat_id=msg.chat, event=event, state="pending",
                                                           next_at=now, created_at=now, updated_at=now))

    def _note_death(self) -> None:
        """The bot's current incarnation died (or was killed alive): one death, however
        many verbs see it — it may die in the background (a replay of its sweep) during
        any step."""
        if self._death_noted != self.world.incarnations:
            self._death_noted = self.world.incarnations
            self.crashes += 1

    # -- verbs ----------------------------------------------------------------------------
    async def _quiet(self) -> None:
        """Let the world come to rest: every callback the event loop has ready has run,
        and no unit of busy work — a delivery, a sweep pass, a replay, a heartbeat, a
        replica booting inside a handler — has I/O in flight (the virtual clock's
        ``settle``). Every verb starts from there, and looks at the model only from
        there: what a verb does, where an armed death lands and what a check sees then
        depend on the story alone, never on how fast the backend answered. Explore runs
        each verb as a task of its own, a story replayed as a scenario awaits them one
        after the other in one coroutine — from the same rest both run the same
        interleavings. (A background pass or boot a verb set off — a restart's recovery
        pass, a replica's first sweep — would otherwise still be talking to the backend
        when the next verb began: a second bot used before its backend was open, a death
        armed at a crash point counted while another task passed some.)"""
        await self.world.clock.settle()

    async def _checked(self) -> None:
        """The model's check after a verb, from rest (:meth:`_quiet`)."""
        await self._quiet()
        self.check()

    async def start(self) -> None:
        """Start the first incarnation (dying where :meth:`crash_in` arms)."""
        await self._quiet()
        await self.world.start(crash=True)

    async def _deliver(self, msg: _Message, bot: Any = None) -> None:
        if bot is None and self.world.crashed:
            return
        media = None
        if msg.media in ("valid", "expired", "broken"):
            url = f"https://media.mock.test/{msg.media}/{msg.mid}"
            media = {"url": url}
            if msg.media == "valid":
                self.world.channel.media_bytes[url] = MEDIA_BYTES + msg.mid.encode()
        event = InboundEvent(id=msg.mid, chat_id=msg.chat, text=msg.mid, media=media)
        task = asyncio.ensure_future((bot or self.world.bot).provider.deliver(event))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        self.live[id(event)] = event
        try:
            ok = await self.world.drive(task)
        except SimulatedCrash:
            self._note_death()
            return
        finally:
            del self.live[id(event)]
        if ok:
            msg.acked = True

    async def _bury(self) -> None:
        """Cancel what the dead incarnation still had running outside its bot's own tasks
        (which ``abandon`` cancels): a delivery whose handler awaits work that will never
        finish. A dead process runs nothing; left alive, such a task keeps the virtual
        clock busy for good, and the next incarnation could never let time pass."""
        left = [t for t in self._inflight if not t.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
        self._inflight.clear()

    async def receive(self, chat: str, mid: str, actions: Sequence[Action], media: str | None = None,
                      replica: bool = False) -> None:
        """The channel delivers message ``mid`` (its plan: ``actions``), with ``media``:
        ``valid`` (a reference the channel serves), ``expired`` (one it no longer
        serves), ``broken`` (one whose download fails with an ``OSError``), or —
        journaled before this delivery, as a dead process left it — ``legacy`` or
        ``tampered`` (see :meth:`_journal_before`). Its handler loads the media first.
        With ``replica``, to the live replica (:meth:`replica`) instead of the bot."""
        await self._quiet()
        if replica:
            if self.replica_bot is None:
                raise ValueError("receive(replica=True): no replica is alive; boot one with replica()")
            if media in ("legacy", "tampered"):
                raise ValueError(f"receive(replica=True): media={media!r} is journaled by the main bot; "
                                 "the replica takes None, 'valid', 'expired' or 'broken'")
            if mid not in self.messages:
                self.messages[mid] = _Message(chat, mid, tuple(actions), media=media)
                self.order.append(mid)
            await self._deliver(self.messages[mid], self.replica_bot)
            await self._after_replica_step()
            return
        if mid not in self.messages:
            self.messages[mid] = _Message(chat, mid, tuple(actions), media=media)
            self.order.append(mid)
            if media in ("legacy", "tampered") and not self.world.crashed:
                try:
                    await self._journal_before(self.messages[mid])
                except SimulatedCrash:  # a crash armed at this write: the process dies here
                    self._note_death()
        await self._deliver(self.messages[mid])
        await self._checked()

    async def redeliver(self, mid: str) -> None:
        """The channel delivers ``mid`` again (a webhook retry, INB-4)."""
        await self._quiet()
        await self._deliver(self.messages[mid])
        await self._checked()

    async def crash_in(self, n: int, when: str = "before") -> None:
        """Arm a death ``when`` the ``n``-th crash point from now (any point)."""
        await self._quiet()
        cb = self.world.crashable
        if cb is not None and not cb.crashed:
            cb.crash_at(cb._total + n, when)

    async def restart(self, new_instance: bool = False) -> None:
        """The process dies (if it has not) and the next starts — with another
        ``instance_id`` when ``new_instance`` — then the channel redelivers every
        message it has not had acknowledged."""
        await self._quiet()
        self._note_deaths()
        if new_instance:
            self.instance += 1
            self.world.instance_id = f"i{self.instance}"
        if self.world.bot is not None:
            # a live process dies here: an execution it had in flight (a reply sleeping on its
            # inline retry's backoff) is cut short like one a crash cuts (INB-7); a dead one's
            # death is counted once
            self._note_death()
            await self.world.bot.abandon()
        await self._bury()
        await self.world.start(crash=True)
        for mid in self.order:
            if not self.messages[mid].acked:
                await self._deliver(self.messages[mid])
        await self._checked()

    async def fault(self, kind: str, chat: str | None = None, times: int = 1, skip: int = 0) -> None:
        """The channel fails: ``transient`` (the next ``times`` sends, after ``skip``
        sends that pass — a later part of a split text, OUT-9), ``rate`` (rate limited,
        retry after 20 s), ``refuse`` (every send to ``chat`` from now on,
        definitively)."""
        await self._quiet()
        ch = self.world.channel
        if kind == "refuse":
            assert chat is not None
            self.dead_chats.add(chat)
            ch.fail_when(lambda c, _content, chat=chat: c == chat, RecipientUnreachableError(f"explore: {chat} blocked"))
            return
        times = max(0, min(times, MAX_TRANSIENT - self.transient))
        self.transient += times
        if times:
            error = ProviderError("explore: transient") if kind == "transient" else RateLimitedError(retry_after_ms=20_000)
            if not skip:
                ch.fail_next(error, times=times)
                return
            left = {"skip": skip, "fail": times}

            def hit(_chat: str, _content: Any) -> bool:
                if left["fail"] <= 0:
                    return False
                if left["skip"] > 0:
                    left["skip"] -= 1
                    return False
                left["fail"] -= 1
                return True

            ch.fail_when(hit, error)

    async def advance(self, ms: float) -> None:
        """Let ``ms`` of virtual time pass."""
        await self._quiet()
        if not self.world.crashed:
            try:
                await self.world.clock.advance(ms)
            except SimulatedCrash:
                self._note_death()
        await self._checked()

    async def finish(self) -> None:
        """The end of the story: a dead process is restarted, every message is
        redelivered until acknowledged, time passes until everything settled; then the
        model's whole check."""
        await self._quiet()
        for _ in range(4):
            if self.world.crashed:
                await self.restart()
            elif any(not self.messages[m].acked for m in self.order):
                for mid in self.order:
                    if not self.messages[mid].acked:
                        await self._deliver(self.messages[mid])
            if not self.world.crashed:
                await self._drain()
            if not self.world.crashed:
                break
        if self.world.crashed:
            await self.restart()
            await self._drain()
        await self.final_check()

    async def _drain(self) -> None:
        """Let up to ``FINISH_MS`` pass until everything settled, checking the model every
        ``DRAIN_CHUNK_MS``: a backend that resends for ever fails at its first duplicate,
        not after an hour of virtual time swept second by second."""
        end = self.world.clock.now() + FINISH_MS + self.slow_total()
        while not self.world.crashed and self.world.clock.now() < end:
            await self.skip_busy(end)  # nothing can settle while a handler sleeps: no look every second
            before = self.world.clock.now()
            await self.world.drain(min(DRAIN_CHUNK_MS, end - before))
            self.check()
            if self.world.clock.now() - before < DRAIN_CHUNK_MS:
                return  # settled (or the process died) before the chunk was over

    # -- the model ------------------------------------------------------------------------
    def _parts(self, text: str, kind: str = "reply") -> list[str]:
        """The parts ``text`` reaches the channel as: split when journaled (OUT-12), whole
        when it bypasses the outbox (OUT-15: no record, so no part records)."""
        if kind == "reply_nan" or not self.text_limit:
            return [text]
        return contentlib.split_text(text, self.text_limit)

    def _sends(self) -> list[_Send]:
        out = []
        for mid in self.order:
            msg = self.messages[mid]
            for i, act in enumerate(msg.actions):
                if act.kind in ("reply", "reply_nan", "enqueue"):
                    out.append(_Send(mid, i, msg.chat, act.text, act.key, act.kind))
        return out

    def _reached(self, send: _Send, done: set[str]) -> bool:
        """Whether the handler certainly made ``send``: every action of a message that
        ended ``done``, and those before the raise of one that raised."""
        msg = self.messages[send.mid]
        if send.mid not in done:
            return False
        first_fail = next((i for i, a in enumerate(msg.actions) if a.kind == "fail"), len(msg.actions))
        return msg.completed > 0 or (msg.raised > 0 and send.index < first_fail)

    def _arrived_unreached(self, key: str, done: set[str], outbox: Sequence[OutboxRecord],
                          got: Counter[tuple[str, str]]) -> bool:
        """Whether a send of a message that did not end ``done`` (dead-lettered after
        executions cut short, its sends journaled all the same) took ``key`` and reached
        the channel: the later sends under that key are that one send (OUT-2). Such a
        send is one under the explicit ``key``, or a reply whose derived key is ``key``
        (``<record id>:<n>``, OUT-3) when the outbox journals it under that very key — a
        derived send that found the key taken diverged to a key of its own (OUT-5) and
        took nothing. (Found by CI's explore on memory, seed 5: a handler cut short by
        every restart replied under ``m2:1``; another message's explicit key ``m2:1``
        was then answered from that record, which this check took for a lost send.)"""
        journaled = {(contentlib.send_key_of(r.key, r.part), str(r.content.get("text"))) for r in outbox}
        for s in self._sends():
            if s.kind == "reply_nan" or self._reached(s, done):
                continue  # (content that cannot be journaled takes no key: OUT-15)
            parts = self._parts(s.text)
            if not any(got[(s.chat, p)] for p in parts):
                continue
            if s.key == key or (s.key is None and self._key_of(s) == key
                                and any((key, p) in journaled for p in parts)):
                return True
        return False

    def _key_of(self, send: _Send) -> str:
        """The send's key: the one given, or the derived ``<record id>:<n>`` (OUT-3)."""
        if send.key is not None:
            return send.key
        msg = self.messages[send.mid]
        n = sum(1 for a in msg.actions[: send.index + 1] if a.kind in ("reply", "reply_nan") and a.key is None)
        return f"{send.mid}:{n}"

    def _ambiguous_keys(self) -> set[str]:
        return {str(p.get("key")) for p in self.world.named("durability:ambiguous")}

    def _ambiguities(self) -> int:
        return len(self.world.named("durability:ambiguous"))

    def _arrivals_allowed(self) -> int:
        """How often a part may arrive under ``on_ambiguous=resend``: once, and once more
        per ambiguity — at least one, at most one per death (an ambiguity of a correct
        engine takes a death with a send in flight)."""
        self._note_deaths()
        return max(2, 1 + min(self._ambiguities(), self.crashes))

    def _delivered(self) -> Counter[tuple[str, str]]:
        return Counter((m.chat_id, str(m.content.get("text"))) for m in self.world.channel.sent)

    def check(self) -> None:
        """What must hold after every step: nothing reached the channel that no handler
        sent; no part twice unless an ambiguity named it; a bypassed send no more often
        than executions made it; the hooks; the keys named by errors."""
        if self.world.crashed:
            self._note_death()
        got = self._delivered()
        possible: dict[tuple[str, str], _Send] = {}
        for send in self._sends():
            for part in self._parts(send.text, send.kind):
                possible[(send.chat, part)] = send
        ambiguous = self._ambiguous_keys()
        for (chat, text), n in got.items():
            found = possible.get((chat, text))
            if found is None:
                raise ExploreViolation(("GUAR-3", "OUT-2"), f"{text!r} reached chat {chat!r}, which no handler sent")
            if found.kind == "reply_nan":
                if n > self.bypass_reached[found.text]:
                    raise ExploreViolation(("OUT-15",), f"the unjournaled send {text!r} reached the channel {n} times, "
                                           f"more than the {self.bypass_reached[found.text]} executions that made it")
            elif n > 1 and not (ambiguous and self.policy == "resend" and n <= self._arrivals_allowed()):
                # under on_ambiguous=resend each ambiguity allows one resend of a part (OUT-14; a
                # send in flight at two deaths is ambiguous twice), as the end's check says: a
                # backend that resends for ever fails here, not after an hour of virtual time
                raise ExploreViolation(("GUAR-3", "OUT-2", "OUT-12", "OUT-14"),
                                       f"{text!r} (message {found.mid}, action {found.index}) reached chat {chat!r} {n} "
                                       "times" + (f"; {self._ambiguities()} ambiguity event(s), naming "
                                                  f"{sorted(ambiguous)}" if ambiguous else ""))
        self._check_hooks()
        for mid, error in self.media_errors:
            raise ExploreViolation(("MEDIA-2", "MEDIA-3"), f"message {mid} ({self.messages[mid].media} media): {error}")
        for text, error in self.bypass_raised:
            raise ExploreViolation(("OUT-15",), f"the reply {text!r}, whose content cannot be journaled, raised {error} "
                                   "inside ctx.reply: such content bypasses the outbox with a warning")
        for error, expected, named, _text, derived in self.key_errors:
            if not derived:
                raise ExploreViolation(("OUT-9",), f"{error} of the send under the key {expected!r} names the key "
                                       f"{named!r}: the outbox key of a send with an explicit key is that key")
        self.check_replicas()
        self.check_sweep()

    def _check_hooks(self) -> None:
        journaled = {s.text for s in self._sends() if s.kind != "reply_nan"}
        for (incarnation, text), n in sorted(self.hooks.items()):
            if text in journaled and n > 1:
                raise ExploreViolation(("OUT-10",), f"the before('send') hooks ran {n} times for the send {text!r} in "
                                       f"incarnation {incarnation}: once per journaled send")

    async def final_check(self) -> None:
        """The model's whole check at the end (see the module docstring)."""
        await self._look_at_tokens()
        self.check()
        d = self.world.bot.durability
        inbox = {r.id: r for r in await d.inbox.list()}
        outbox = await d.outbox.list()
        dead_out = {r.key: r for r in outbox if r.state == "dead"}
        dead_in = {r.id for r in await d.inbox.list("dead")}
        got = self._delivered()
        position = {(m.chat_id, str(m.content.get("text"))): i for i, m in reversed(list(enumerate(self.world.channel.sent)))}
        ambiguous = self._ambiguous_keys()
        done: set[str] = set()
        for mid in self.order:
            msg = self.messages[mid]
            if not msg.acked:
                raise ExploreViolation(("INB-1", "INB-8"), f"message {mid} was never acknowledged, though the channel "
                                       "redelivered it after every restart")
            rec = inbox.get(mid)
            if rec is None or rec.state not in ("done", "dead"):
                raise ExploreViolation(("INB-1", "INB-2", "GUAR-1"),
                                       f"message {mid} was acknowledged and ended {rec.state if rec else 'missing'!r}")
            finished = msg.completed + msg.raised
            if rec.state == "done" and finished == 0:
                raise ExploreViolation(("INB-2", "INB-3"), f"message {mid} is 'done' but its handler never ran to its "
                                       f"end ({msg.executions} execution(s) started, every one cut short)")
            if rec.state == "dead" and msg.media in ("legacy", "tampered") and self.crashes < INBOX_MAX_ATTEMPTS:
                raise ExploreViolation(("MEDIA-3", "MEDIA-5", "INB-7"),
                                       f"message {mid}, whose stored media reference is {msg.media}, went to the DLQ "
                                       f"after {msg.executions} execution(s) of its handler and {self.crashes} death(s): "
                                       "a bad reference costs only the download, never the message")
            # an execution that finished in an incarnation that died since may have died before its
            # record was completed: from the journal's side it never finished (INB-7)
            settled = self.finished_in.get(mid, Counter())[self.world.incarnations]
            if rec.state == "dead" and (settled or self.crashes < INBOX_MAX_ATTEMPTS):
                raise ExploreViolation(("INB-6", "INB-7", "GUAR-7"),
                                       f"message {mid} went to the DLQ after {msg.executions} execution(s), "
                                       f"{finished} of them finished ({settled} in the live process), "
                                       f"{self.crashes} death(s) in all "
                                       f"(inbox.max_attempts={INBOX_MAX_ATTEMPTS}): only executions that never "
                                       "finish are charged, and a handler that raises is not retried")
            if (rec.state == "dead") != (mid in dead_in):
                raise ExploreViolation(("INB-6", "OPS-2"), f"message {mid} is {rec.state!r} but the inbox DLQ "
                                       f"{'does not hold' if rec.state == 'dead' else 'holds'} it")
            if rec.state == "done":
                done.add(mid)
        for error, expected, named, text, _derived in self.key_errors:
            texts = set(self._parts(text))
            if not any(contentlib.send_key_of(r.key, r.part) == named and str(r.content.get("text")) in texts
                       for r in outbox):
                raise ExploreViolation(("OUT-9", "OUT-5"), f"{error} of the send {text!r} (derived key {expected!r}) "
                                       f"names the key {named!r}, under which the outbox journals no part of it")
        reached = [send for send in self._sends() if self._reached(send, done)]
        for send in reached:
            if send.kind == "reply_nan":
                n = got[(send.chat, send.text)]
                if n < self.bypass_ok[send.text]:
                    raise ExploreViolation(("OUT-15",), f"the send {send.text!r}, whose content cannot be journaled, "
                                           f"returned {self.bypass_ok[send.text]} times and reached the channel {n} times")
        explicit: dict[str, list[_Send]] = defaultdict(list)
        derived_keys: set[str] = set()
        exact: list[_Send] = []
        for send in reached:
            if send.kind == "reply_nan":
                continue
            key = self._key_of(send)
            if send.key is None:
                derived_keys.add(key)
                exact.append(send)  # a derived send under a key taken already diverges (OUT-5): sent all the same
            else:
                explicit[key].append(send)
        for key, sends in explicit.items():
            arrived = sorted({s.text for s in sends if any(got[(s.chat, p)] for p in self._parts(s.text))})
            if len(arrived) > 1:
                raise ExploreViolation(("OUT-2", "OUT-3", "OUT-12"), f"sends under the one key {key!r} are one send, "
                                       f"but {len(arrived)} of them reached the channel: {arrived}")
            if arrived:
                exact.extend(s for s in sends if s.text == arrived[0])
            elif (key not in derived_keys and not ambiguous and not any(s.chat in self.dead_chats for s in sends)
                  and not self._arrived_unreached(key, done, outbox, got)
                  and not any(contentlib.send_key_of(k, r.part) == key for k, r in dead_out.items())):
                raise ExploreViolation(("GUAR-1", "OUT-2", "OUT-12"),
                                       f"nothing sent under the key {key!r} reached the channel, though "
                                       + ", ".join(f"message {s.mid} sent {s.text!r} under it" for s in sends))
        seen: set[tuple[str, str]] = set()
        for send in exact:
            if send.chat in self.dead_chats or (send.chat, send.text) in seen:
                continue
            seen.add((send.chat, send.text))
            parts = self._parts(send.text)
            counts = [got[(send.chat, p)] for p in parts]
            if all(c == 1 for c in counts):
                positions = [position[(send.chat, p)] for p in parts]
                if positions != sorted(positions):
                    raise ExploreViolation(("OUT-11", "OUT-12"), f"the parts of {send.text!r} reached the channel out "
                                           f"of order: {[p for _, p in sorted(zip(positions, parts, strict=True))]}")
                continue
            if ambiguous:
                if self.policy == "skip" and all(c <= 1 for c in counts):
                    continue
                if self.policy == "resend" and all(1 <= c <= self._arrivals_allowed() for c in counts):
                    continue
            raise ExploreViolation(("GUAR-1", "GUAR-3", "OUT-12", "OUT-14"),
                                   f"the send {send.text!r} of message {send.mid} (key {self._key_of(send)!r}) must "
                                   f"reach chat {send.chat!r} exactly once per part: parts {parts!r} arrived {counts} "
                                   "times" + (f"; ambiguity events named {sorted(ambiguous)}" if ambiguous else ""))
        for key, rec in dead_out.items():
            if rec.chat_id not in self.dead_chats:
                raise ExploreViolation(("OUT-7", "OPS-2"), f"the send {key!r} to chat {rec.chat_id!r} is in the outbox "
                                       "DLQ, though that chat never refused a send for good and every transient fault "
                                       f"was below outbox.retries={OUTBOX_RETRIES}")
