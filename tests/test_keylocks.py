"""The engine's locks under the virtual clock (OUT-10: one send per key at a time; OUT-11:
sends to a chat in order): a task waiting for a lock is never *busy*, or virtual time
could not move while the holder sleeps on its backoff.

The case that hung (found by the explore part, a sweep pass behind an inline send's
retry): the lock was just released to a waiter that has not resumed yet, so it reads as
unlocked, but a new acquirer still queues behind that waiter — which then takes the lock
and sleeps on the clock."""

from __future__ import annotations

import asyncio

import pytest

from botmesh.core.clock import VirtualClock
from botmesh.core.keylocks import KeyLocks


@pytest.mark.spec("OUT-10", "OUT-11")
def test_an_acquirer_queued_behind_a_woken_waiter_lets_time_move() -> None:
    order: list[str] = []

    async def main() -> None:
        clock = VirtualClock(settle_timeout_s=5.0)
        locks = KeyLocks(clock)
        release_first = asyncio.Event()

        async def first() -> None:
            async with locks.hold("k"):
                order.append("first holds")
                await release_first.wait()

        async def sleeper() -> None:
            with clock.busy():
                async with locks.hold("k"):
                    order.append("sleeper holds")
                    await clock.sleep(1_000)  # the send's backoff, the lock held

        async def late() -> None:
            with clock.busy():
                async with locks.hold("k"):
                    order.append("late holds")

        holder = asyncio.ensure_future(first())
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(sleeper())
        await asyncio.sleep(0)  # the sleeper now waits for the lock
        release_first.set()
        # scheduled after `first` resumes but before the sleeper's wake-up: `late` finds
        # the lock unlocked with a waiter ahead of it
        last = asyncio.ensure_future(late())
        await clock.advance(1_000)  # settles first: raises TimeoutError if `late` counts as busy
        await asyncio.gather(holder, queued, last)
        assert clock.active == 0

    asyncio.run(main())
    assert order == ["first holds", "sleeper holds", "late holds"]
