"""The engine's lease renewal (LEASE-1) and chat-order lock (OUT-11) as plain async
context managers: entered once or twice per message, where a generator-based
``contextlib.asynccontextmanager`` costs several calls more each time (issue 16)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType

from .clock import Clock, RealClock
from .keylocks import acquire_waiting


class Heartbeat:
    """``async with Heartbeat(clock, beat, lease_ms)``: ``await beat(now + lease_ms)``
    every ``lease_ms / 3`` while the block runs, until a beat returns False. On the real
    clock the wait for the first beat is a timer, not a task: most blocks end before it,
    and then no task was made. A beat that died of a ``BaseException`` that is not an
    ``Exception`` (a simulated process death) is raised when the block ends."""

    __slots__ = ("_clock", "_beat", "_lease_ms", "_tasks", "_timer")

    def __init__(self, clock: Clock, beat: Callable[[float], Awaitable[bool]], lease_ms: float) -> None:
        self._clock = clock
        self._beat = beat
        self._lease_ms = lease_ms
        self._tasks: list[asyncio.Task[None]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def _beats(self, sleep_first: bool) -> None:
        clock, lease_ms = self._clock, self._lease_ms
        while True:
            if sleep_first:
                await clock.sleep(lease_ms / 3.0)
            sleep_first = True
            with clock.busy():
                if not await self._beat(clock.now() + lease_ms):
                    return

    def _start(self, sleep_first: bool) -> None:
        self._tasks.append(asyncio.ensure_future(self._beats(sleep_first)))

    async def __aenter__(self) -> None:
        if type(self._clock) is RealClock:
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, self._lease_ms / 3.0) / 1000.0, self._start, False
            )
        else:
            self._start(True)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in self._tasks:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                died = task.exception()
                if not isinstance(died, Exception):  # a simulated process death
                    raise died  # type: ignore[misc]


class ChatOrder:
    """``async with ChatOrder(clock, lock)``: hold a chat's lock (OUT-11); waiting for it
    is not busy work (:func:`~botmesh.core.keylocks.acquire_waiting`)."""

    __slots__ = ("_clock", "_lock")

    def __init__(self, clock: Clock, lock: asyncio.Lock) -> None:
        self._clock = clock
        self._lock = lock

    async def __aenter__(self) -> None:
        await acquire_waiting(self._clock, self._lock)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()
