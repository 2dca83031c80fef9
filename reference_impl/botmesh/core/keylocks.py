"""One holder at a time per key, within one process: the engine's lock per idempotency
key (OUT-2, OUT-10), so that concurrent sends and enqueues of one key run the
``before("send")`` hooks and journal once, and the others then find the record."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from .clock import Clock


async def acquire_waiting(clock: Clock, lock: asyncio.Lock) -> None:
    """Take ``lock``, the wait (if any) counted as *waiting* on the clock, never as busy.

    Not only when ``lock.locked()``: a lock just released with a waiter not yet resumed
    is unlocked, yet ``acquire`` queues behind that waiter — which may then hold it while
    it sleeps on a backoff. A busy acquirer there would keep a virtual clock from ever
    moving (found by the testkit's explore part: a sweep pass hung behind an inline send's
    retry)."""
    with clock.waiting():
        await lock.acquire()


class KeyLocks:
    """``async with locks.hold(key)``: waits while another task holds ``key`` (as
    *waiting* for the clock, so a virtual clock may move time meanwhile). An entry lives
    only while someone holds or waits for it: random keys leave nothing behind."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            await acquire_waiting(self._clock, lock)
            try:
                yield
            finally:
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
