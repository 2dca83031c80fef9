"""A crash world: one outside world (a channel, a clock, a store) and successive bot
incarnations on one backend — the recovery pattern of TEST-3 as an object.

    world = World(harness, setup=register_handlers, instance_id="i1")
    bot = await world.start(crash=True)
    world.crashable.crash_before("outbox.mark_sent")
    await world.receive("chat-1", "hi", id="m1")      # dies inside
    bot = await world.restart()                      # same backend, store, instance_id
    await world.drain()
    assert world.channel.texts() == [...]
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
from collections.abc import Callable
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.bot import Bot
from botmesh.core.clock import VirtualClock
from botmesh.core.errors import BackendUnavailableError
from botmesh.core.provider import InboundEvent, Provider
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.store import Store
from botmesh.core.testing import MockProvider, SimulatedCrash

from ..backends.base import BackendHarness
from .intercept import InterceptedBackend
from .provider import ChannelProvider, CrashableProvider
from .wrapper import CrashableBackend, crashable

Journals = tuple[list[InboxRecord], list[OutboxRecord]]
"""The two journals as read at one moment: ``(inbox records, outbox records)``."""

DRAIN_MS = 150_000.0
"""Virtual time the crash matrix and the scenarios let pass after each stage: well past
the outbox's whole retry budget with the default backoff (about 31 s) and the inbox
backoff, so a correct backend always settles; a broken one that never settles is judged
after it."""


class World:
    """Successive bots on one backend, one channel, one virtual clock.

    ``setup(bot)`` registers the handlers; it runs for every incarnation, as the same
    code would after a real restart. ``durability`` holds extra options of the
    ``durability=`` setting. ``events`` records every ``error``, ``durability:dead`` and
    ``durability:ambiguous`` event of every incarnation.

    ``serial``: every incarnation's backend calls run one at a time under one lock
    (:mod:`.intercept`), so that the order of the points a run passes is the program's,
    not the network's. Default: when the harness names a server
    (``harness.server_address()``), where concurrent calls (a sweep pass beside a
    message) otherwise complete in the server's order and a seed would draw other cells
    from run to run; an embedded backend's order is already the program's.
    """

    def __init__(
        self,
        harness: BackendHarness,
        *,
        setup: Callable[[Bot], None] | None = None,
        instance_id: str = "i1",
        durability: dict[str, Any] | None = None,
        text_limit: int | None = None,
        seed: int = 0,
        clock: VirtualClock | None = None,
        serial: bool | None = None,
    ) -> None:
        self.harness = harness
        if serial is None:
            serial = harness.server_address() is not None
        self.serial: asyncio.Lock | None = asyncio.Lock() if serial else None
        self.setup = setup
        self.instance_id = instance_id
        self.options = dict(durability or {})
        self.clock = clock or VirtualClock()
        self.channel = MockProvider(text_limit=text_limit)
        self.rng = random.Random(seed)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.event_incarnations: list[int] = []
        self.bot: Bot | None = None
        self.crashable: CrashableBackend | None = None
        self.store: Store | None = None
        self.incarnations = 0
        self._opened = False
        self._store: Store | None = None  # a fork's copy of the store, used instead of the harness's

    async def _backend(self) -> tuple[Any, Store]:
        if not self._opened:
            self._opened = True
            backend, store = await self.harness.open()
        else:
            backend, store = await self.harness.reopen()
        return backend, store if self._store is None else self._store

    def fork(self, harness: BackendHarness) -> World:
        """A copy of this world as it is now, whose next :meth:`start` is the restart after
        a death on ``harness``'s storage instead: the same setup, ``instance_id``, options,
        time (a new clock at this instant), events and incarnation count, a copy of the
        channel (:meth:`MockProvider.copy <botmesh.core.testing.MockProvider.copy>`) and
        of the store (``copy.deepcopy``: the in-memory store a file harness keeps), and the
        random generator in the same state. ``harness`` must already be open (its next
        call is :meth:`~BackendHarness.reopen`); closing the fork closes it. This world is
        left as it was, so several forks can recover from one moment — the crash matrix
        recovers each crash state a power cut could leave this way. Call it after the
        death and before :meth:`restart`."""
        assert self.store is not None, "fork() a world that was started"
        clone = World(harness, setup=self.setup, instance_id=self.instance_id, durability=self.options,
                      clock=VirtualClock(self.clock.now(), settle_timeout_s=self.clock.settle_timeout_s),
                      serial=self.serial is not None)
        clone.channel = self.channel.copy()
        clone.rng.setstate(self.rng.getstate())
        clone.events = list(self.events)
        clone.event_incarnations = list(self.event_incarnations)
        clone.incarnations = self.incarnations
        clone.store = clone._store = copy.deepcopy(self.store)
        clone._opened = True
        return clone

    async def start(self, *, crash: bool = False, **durability: Any) -> Bot:
        """Start the next incarnation. ``crash=True`` wraps its backend and provider so
        that it can die (arm it through ``world.crashable``)."""
        backend, store = await self._backend()
        self.store = store
        provider: Provider
        if crash:
            self.crashable = crashable(backend, serial=self.serial)
            backend = self.crashable
            provider = CrashableProvider(self.crashable, self.channel)
        else:
            self.crashable = None
            backend = self.serialized(backend)
            provider = ChannelProvider(self.channel)
        options = {"backend": backend, "instance_id": self.instance_id, **self.options, **durability}
        bot = Bot(provider, store, options, clock=self.clock, rng=random.Random(self.rng.random()))
        for name in ("error", "durability:dead", "durability:ambiguous"):
            def listener(payload: dict[str, Any], name: str = name, n: int = self.incarnations + 1) -> None:
                self._record(n, name, payload)

            bot.on(name, listener)
        if self.setup is not None:
            self.setup(bot)
        self.bot = bot
        self.incarnations += 1
        try:
            await bot.start()
        except SimulatedCrash:
            pass
        return bot

    def serialized(self, backend: DurabilityBackend) -> DurabilityBackend:
        """``backend`` with its calls under this world's ``serial`` lock (one call at a
        time with every other bot of the world: a replica, a second bot), or ``backend``
        itself when the world has none."""
        if self.serial is None:
            return backend
        return InterceptedBackend(backend, serial=self.serial)  # type: ignore[abstract]

    @property
    def crashed(self) -> bool:
        return self.crashable is not None and self.crashable.crashed

    async def receive(self, chat_id: str, text: str = "", *, id: str, **kw: Any) -> bool:
        """Deliver an inbound event; False when the bot died while taking it."""
        assert self.bot is not None
        event = InboundEvent(id=id, chat_id=chat_id, text=text, **kw)
        try:
            await self.drive(self.bot.provider.deliver(event))
        except SimulatedCrash:
            return False
        return True

    async def drive(self, coro: Any) -> Any:
        """Await ``coro`` while moving virtual time forward whenever everything is blocked
        on the clock (a send retrying with backoff, a slow handler)."""
        task = asyncio.ensure_future(coro)
        if self.clock.auto_running:
            return await task  # the clock drives itself
        while not task.done():
            await self.clock.settle()
            if task.done():
                break
            if not await self.clock.step():
                await asyncio.wait({task}, timeout=0.01)
        return task.result()

    async def call(self, fn: Callable[[Bot], Any]) -> Any:
        """Run ``await fn(bot)``; a simulated death is swallowed (returns it)."""
        assert self.bot is not None
        try:
            return await self.drive(fn(self.bot))
        except SimulatedCrash as exc:
            return exc

    async def restart(self, **durability: Any) -> Bot:
        """Abandon the current bot as a dead process and start a new one on the same
        backend and store with the same ``instance_id`` (TEST-3)."""
        if self.bot is not None:
            await self.bot.abandon()
        return await self.start(**durability)

    async def drain(self, within_ms: float = 600_000.0) -> Journals | None:
        """Advance virtual time until nothing is due: every unfinished inbound record is
        settled and every send is sent, dead or unknown (or ``within_ms`` passed).

        The journals are looked at once the world is at rest, before time moves: when
        everything is settled already, no time passes (issue 16: a sweep pass, two index
        reads, saved per crash cell — the journals of a cell are settled when its drain
        begins as a rule; nothing is due in settled journals). Then time advances by the
        poll interval between looks.

        Every look after the first asks first for one record still due at any time
        (``due(upto=inf, limit=1)``, one read of both due indexes): a record listed there
        is unsettled by the backend's contract (``inbox_due``/``outbox_due`` list exactly
        the leased/pending inbound records and the pending/failed/sending sends, checked
        by the conformance suite), so the journals are read whole only when nothing is
        due — at the same tick as before, for the same answer. A drain that waits out a
        retry's backoff second by second (explore's stories: hours of virtual time) then
        reads one index entry per tick instead of both journals; a crash cell's drain,
        settled at its first look as a rule, reads as before.

        Returns the journals (inbox, outbox) as the look that found everything settled
        read them — nothing runs between that look and the return, so they are the
        journals as they are then — or None when it stopped otherwise (a death, or
        ``within_ms`` passed)."""
        assert self.bot is not None and self.bot.durability is not None
        d = self.bot.durability
        end = self.clock.now() + within_ms
        await self.clock.settle()
        first = True
        while True:
            if self.crashed:
                return None
            try:
                # a record still due is unsettled: no need to read the journals whole
                busy = not first and any(await d.backend.due(d.scope, upto=math.inf, limit=1))
                if not busy:
                    inbox = await d.backend.inbox_list(d.scope)
                    outbox = await d.backend.outbox_list(d.scope)
            except SimulatedCrash:
                return None
            except BackendUnavailableError:
                # Only the drain's own look failed (a backend that reads from its storage,
                # e.g. a shared journal, met an injected I/O error): look again next tick.
                busy = True
            if not busy and all(r.state in ("done", "dead") for r in inbox) and all(
                r.state in ("sent", "dead", "unknown") for r in outbox
            ):
                return inbox, outbox
            first = False
            if self.clock.now() >= end:
                return None
            await self.clock.advance(d.config.poll_ms)

    async def close(self, *, discard: bool = False) -> None:
        """Abandon the bot and close the harness; ``discard``: the storage is thrown away
        right after, so the harness may skip what only keeps it
        (:meth:`BackendHarness.discard <botmesh_testkit.backends.base.BackendHarness.discard>`)."""
        if self.bot is not None:
            await self.bot.abandon()
        if discard:
            await self.harness.discard()
        else:
            await self.harness.close()

    def _record(self, incarnation: int, name: str, payload: dict[str, Any]) -> None:
        self.events.append((name, payload))
        self.event_incarnations.append(incarnation)

    def named(self, event: str, *, incarnation: int | None = None) -> list[dict[str, Any]]:
        """Payloads of ``event`` (of one incarnation, 1-based, when given)."""
        return [
            payload
            for (name, payload), n in zip(self.events, self.event_incarnations, strict=True)
            if name == event and (incarnation is None or n == incarnation)
        ]
