"""One holder at a time per key, within one process: the engine's lock per idempotency
key (OUT-2, OUT-10), so that concurrent sends and enqueues of one key run the
``before("send")`` hooks and journal once, and the others then find the record."""

from __future__ import annotations

import asyncio
from types import TracebackType

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

    def hold(self, key: str) -> _Hold:
        """Hold ``key`` for the ``async with`` block."""
        return _Hold(self, key)


class _Hold:
    """One ``async with locks.hold(key)`` (a plain async context manager: entered once
    per send, where a generator-based one costs several calls more, issue 16)."""

    __slots__ = ("_locks", "_key", "_lock")

    def __init__(self, locks: KeyLocks, key: str) -> None:
        self._locks = locks
        self._key = key

    async def __aenter__(self) -> None:
        table, key = self._locks._locks, self._key
        lock, users = table.get(key) or (asyncio.Lock(), 0)
        table[key] = (lock, users + 1)
        self._lock = lock
        try:
            await acquire_waiting(self._locks._clock, lock)
        except BaseException:
            self._leave()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        table, key = self._locks._locks, self._key
        lock, users = table[key]
        if users <= 1:
            del table[key]
        else:
            table[key] = (lock, users - 1)
