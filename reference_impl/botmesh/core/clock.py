"""Injected time. The durability engine never reads the wall clock or sleeps directly:
it asks a :class:`Clock`. Production uses :class:`RealClock`; tests use
:class:`VirtualClock`, which runs leases, backoff and retention in virtual time.

How the virtual clock knows when it may move time forward: every unit of engine work
(an inbound event being processed, a sweep pass, a heartbeat write) runs inside
``clock.busy()``. A task sleeping on the clock inside such a block is not counted as
busy while it sleeps, and is counted again the moment the clock wakes it. When the count
reaches zero, nothing will happen before the next deadline, so the clock may jump there.
Real I/O done inside a busy block (a database round trip) keeps the count up, so time
never runs ahead of a query in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sized
from typing import Protocol, runtime_checkable

from .turns import others_runnable


@runtime_checkable
class Clock(Protocol):
    """What the engine needs of time. ``now()`` is milliseconds since the Unix epoch."""

    def now(self) -> float: ...

    async def sleep(self, ms: float) -> None: ...

    def busy(self) -> contextlib.AbstractContextManager[None]: ...

    def waiting(self) -> contextlib.AbstractContextManager[None]: ...


_NOTHING_TO_COUNT: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
"""The real clock's ``busy()`` and ``waiting()``: it counts nothing. One instance serves
every call (``nullcontext`` keeps no state of a ``with``; a message enters two)."""


class RealClock:
    """Wall-clock time and real sleeping."""

    def now(self) -> float:
        return time.time() * 1000.0

    async def sleep(self, ms: float) -> None:
        await asyncio.sleep(max(0.0, ms) / 1000.0)

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return _NOTHING_TO_COUNT

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        return _NOTHING_TO_COUNT


def resolve_waiter(waiter: asyncio.Future[None]) -> None:
    """Wake whoever waits on ``waiter`` (a callback: nothing if it is already done)."""
    if not waiter.done():
        waiter.set_result(None)


class _Sleeper:
    __slots__ = ("deadline", "future", "task", "woken", "cancelled", "callback")

    def __init__(
        self, deadline: float, future: asyncio.Future[None] | None, task: asyncio.Task[object] | None,
        callback: Callable[[], object] | None = None,
    ) -> None:
        self.deadline = deadline
        self.future = future
        self.task = task
        self.woken = False
        self.cancelled = False
        self.callback = callback

    def done(self) -> bool:
        future = self.future
        return self.cancelled or (self.woken if future is None else future.done())


class VirtualTimer:
    """What :meth:`VirtualClock.call_later` returns: :meth:`cancel` it before it is due
    and the callback is never called."""

    __slots__ = ("_sleeper",)

    def __init__(self, sleeper: _Sleeper) -> None:
        self._sleeper = sleeper

    def cancel(self) -> None:
        self._sleeper.cancelled = True


class _Busy:
    """:meth:`VirtualClock.busy` (a class, not ``contextlib.contextmanager``: entered for
    every unit of work, issue 16)."""

    __slots__ = ("_clock", "_task")

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock

    def __enter__(self) -> None:
        clock = self._clock
        task = self._task = asyncio.current_task()
        depth = clock._depth.get(task, 0) + 1
        clock._depth[task] = depth
        if depth == 1:
            clock._active += 1

    def __exit__(self, *exc: object) -> None:
        clock, task = self._clock, self._task
        depth = clock._depth[task] - 1
        if depth == 0:
            del clock._depth[task]
            clock._dec()
        else:
            clock._depth[task] = depth


class _Waiting:
    """:meth:`VirtualClock.waiting`."""

    __slots__ = ("_clock", "_in_busy")

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock

    def __enter__(self) -> None:
        clock = self._clock
        self._in_busy = clock._depth.get(asyncio.current_task(), 0) > 0
        if self._in_busy:
            clock._dec()

    def __exit__(self, *exc: object) -> None:
        if self._in_busy:
            self._clock._active += 1


class VirtualClock:
    """A clock whose time moves only when told to (``advance``, ``run_until``) or, in
    auto mode, whenever all busy work is blocked on the clock.

    ``settle_timeout_s`` bounds (in real seconds) how long the clock waits for busy work
    to become idle before it reports a stuck test instead of hanging.
    """

    def __init__(self, start_ms: float = 1_767_225_600_000.0, *, settle_timeout_s: float = 60.0) -> None:
        self._now = float(start_ms)
        self._heap: list[tuple[float, int, _Sleeper]] = []
        self._seq = itertools.count()
        self._active = 0
        self._depth: dict[asyncio.Task[object] | None, int] = {}
        self._idle: list[asyncio.Future[None]] = []  # settle()'s waits for the busy work to end
        self._new_sleeper: asyncio.Event | None = None
        self._auto_task: asyncio.Task[None] | None = None
        self.settle_timeout_s = settle_timeout_s

    # -- the Clock protocol -------------------------------------------------------------
    def now(self) -> float:
        return self._now

    async def sleep(self, ms: float) -> None:
        if ms <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        in_busy = self._depth.get(task, 0) > 0
        future: asyncio.Future[None] = loop.create_future()
        sleeper = _Sleeper(self._now + ms, future, task if in_busy else None)
        heapq.heappush(self._heap, (sleeper.deadline, next(self._seq), sleeper))
        if in_busy:
            self._dec()
        if self._new_sleeper is not None:
            self._new_sleeper.set()
        try:
            await future
        except asyncio.CancelledError:
            sleeper.cancelled = True
            if in_busy and not sleeper.woken:
                # the busy block we are in will decrement on exit: credit it back
                self._active += 1
            raise

    def call_later(self, ms: float, callback: Callable[[], object]) -> VirtualTimer:
        """Call ``callback()`` when virtual time reaches ``now + ms`` (``ms > 0``): when
        :meth:`sleep` taken now by a task outside busy work would wake it — the same
        deadline, the same place among the sleepers due at that instant, called where the
        sleeping task's wake-up would be scheduled — without a task (the engine's
        heartbeats wait for their first beat this way: issue 16)."""
        if not ms > 0:
            raise ValueError(f"call_later: ms must be > 0, got {ms!r}")
        sleeper = _Sleeper(self._now + ms, None, None, callback)
        heapq.heappush(self._heap, (sleeper.deadline, next(self._seq), sleeper))
        if self._new_sleeper is not None:
            self._new_sleeper.set()
        return VirtualTimer(sleeper)

    def busy(self) -> _Busy:
        """A unit of engine work: counted busy while it runs (module docstring)."""
        return _Busy(self)

    def waiting(self) -> _Waiting:
        """Inside a busy block, mark a wait on *another task's* progress (a per-chat
        lock held by a send that sleeps on its backoff): it does not count as busy, or
        time could never move. The task waking it is busy when it releases it, and the
        wake-up sits in the loop's ready queue, which ``settle`` waits for."""
        return _Waiting(self)

    # -- driving time -------------------------------------------------------------------
    def _dec(self) -> None:
        self._active -= 1
        if self._active == 0 and self._idle:
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                resolve_waiter(waiter)

    @property
    def auto_running(self) -> bool:
        """True inside ``async with clock.auto()``."""
        return self._auto_task is not None

    @property
    def active(self) -> int:
        """Number of busy units of work not blocked on the clock."""
        return self._active

    def next_deadline(self) -> float | None:
        """The earliest pending sleep deadline, or None when nothing sleeps."""
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    async def settle(self) -> None:
        """Wait (in real time) until no busy work is runnable and the event loop has run
        every ready callback.

        On an event loop whose ready queue can be seen (asyncio's own), the wait ends at
        the first turn that finds it empty with no busy work, confirmed one turn later
        when a loop timer is due (that turn runs it; with none due the turn would run
        nothing and is not taken, issue 16 — an I/O readiness arriving just then is seen
        at the next look, as :mod:`botmesh.core.turns` argues). While busy work runs,
        the wait is on a future the end of that work resolves (no turn of the loop is
        spent looking, and the work's own turns are not shared with this task: issue
        16). Where the queue cannot be seen (another loop), every look lets the loop run
        four turns first."""
        loop = asyncio.get_running_loop()
        ready_q: Sized | None = getattr(loop, "_ready", None)
        limit: float | None = None
        while True:
            if ready_q is None:
                for _ in range(4):
                    await asyncio.sleep(0)
            else:
                await asyncio.sleep(0)
            if self._active <= 0:
                if ready_q is None or not len(ready_q):
                    if ready_q is not None and not others_runnable():
                        return  # nothing ready and no timer due: a turn more would run nothing
                    await asyncio.sleep(0)
                    if self._active <= 0 and (ready_q is None or not len(ready_q)):
                        return
                continue  # work that is not busy is runnable: let it run
            if limit is None:
                limit = time.monotonic() + self.settle_timeout_s
            remaining = limit - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"VirtualClock: busy work did not become idle within {self.settle_timeout_s}s of real time"
                )
            # a future, not asyncio.wait_for: on 3.11 wait_for can swallow a cancellation
            # of the caller that races with the inner wait completing
            waiter: asyncio.Future[None] = loop.create_future()
            self._idle.append(waiter)
            timer = loop.call_later(remaining, resolve_waiter, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                if waiter in self._idle:
                    self._idle.remove(waiter)

    def _wake_due(self, until: float) -> bool:
        woke = False
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > until:
                break
            _, _, sleeper = heapq.heappop(self._heap)
            if deadline > self._now:
                self._now = deadline
            sleeper.woken = True
            if sleeper.task is not None:
                self._active += 1
            if sleeper.future is None:
                assert sleeper.callback is not None
                sleeper.callback()
            else:
                sleeper.future.set_result(None)
            woke = True
            # wake everything due at exactly this instant together
            nxt = self.next_deadline()
            if nxt is None or nxt > deadline:
                break
        return woke

    async def advance(self, ms: float) -> None:
        """Move time forward by ``ms``, waking sleepers in deadline order and letting the
        work they start settle at each step."""
        await self.advance_to(self._now + ms)

    async def advance_to(self, target: float) -> None:
        """Move time forward to ``target`` (milliseconds since the epoch). It returns
        settled: the last thing it does that can start work (waking what is due) is
        followed by a settle — moving ``now`` to ``target`` afterwards starts nothing."""
        await self.settle()
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > target:
                break
            self._wake_due(deadline)
            await self.settle()
        if target > self._now:
            self._now = target

    async def step(self) -> bool:
        """Jump to the next deadline (if any), wake what is due and settle. Returns False
        when nothing sleeps."""
        await self.settle()
        deadline = self.next_deadline()
        if deadline is None:
            return False
        self._wake_due(deadline)
        await self.settle()
        return True

    async def run_until(self, predicate: Callable[[], bool], *, within_ms: float = 3_600_000.0) -> None:
        """Advance deadline by deadline until ``predicate()`` holds; raise TimeoutError
        naming the virtual time spent when it does not hold within ``within_ms``."""
        limit = self._now + within_ms
        await self.settle()
        while not predicate():
            deadline = self.next_deadline()
            if deadline is None or deadline > limit:
                raise TimeoutError(f"condition not reached within {within_ms} ms of virtual time")
            self._wake_due(deadline)
            await self.settle()

    @contextlib.asynccontextmanager
    async def auto(self, *, max_ms: float | None = None) -> AsyncIterator[None]:
        """Within the block, time jumps to the next deadline whenever the busy work is
        idle: a test may simply ``await`` a dispatch whose send retries with backoff."""
        limit = None if max_ms is None else self._now + max_ms

        async def drive() -> None:
            while True:
                await self.settle()
                deadline = self.next_deadline()
                if deadline is None or (limit is not None and deadline > limit):
                    if self._new_sleeper is None:
                        self._new_sleeper = asyncio.Event()
                    self._new_sleeper.clear()
                    await self._new_sleeper.wait()
                    continue
                self._wake_due(deadline)

        self._auto_task = asyncio.ensure_future(drive())
        try:
            yield
        finally:
            task, self._auto_task = self._auto_task, None
            task.cancel()
            await asyncio.wait({task})
