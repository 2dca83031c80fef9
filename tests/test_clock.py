"""The virtual clock's settle (TEST-3, TEST-4: the crash world and the matrix drive time
with it): it returns only once no busy work is runnable, also when that work waits on
something other than the clock (a thread, as a backend's real I/O does)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from botmesh.core.clock import VirtualClock

spec = pytest.mark.spec


@spec("TEST-3", "TEST-4")
async def test_settle_waits_for_busy_work_blocked_on_a_thread() -> None:
    clock = VirtualClock(settle_timeout_s=30.0)
    release = threading.Event()
    steps: list[str] = []

    async def work() -> None:
        with clock.busy():
            steps.append("started")
            await asyncio.to_thread(release.wait)  # real I/O: not the clock, not runnable
            steps.append("after the thread")
            await asyncio.sleep(0)
            steps.append("done")

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    assert steps == ["started"] and clock.active == 1
    settling = asyncio.ensure_future(clock.settle())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not settling.done()  # the busy work is blocked, not finished: settle waits
    release.set()
    await settling
    assert steps == ["started", "after the thread", "done"] and clock.active == 0
    await task


@spec("TEST-3", "TEST-4")
async def test_settle_cancelled_while_waiting_leaves_nothing_behind() -> None:
    clock = VirtualClock(settle_timeout_s=30.0)
    release = threading.Event()

    async def work() -> None:
        with clock.busy():
            await asyncio.to_thread(release.wait)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    settling = asyncio.ensure_future(clock.settle())
    for _ in range(20):
        await asyncio.sleep(0)
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    release.set()
    await task
    await clock.settle()  # a later settle still returns once the work is over
    assert clock.active == 0


@spec("TEST-3", "TEST-4")
async def test_advance_returns_once_the_work_it_woke_has_settled() -> None:
    """``advance`` moves time past each deadline and returns only when what it woke ran
    to its end, including work that work started (a chain of tasks and kv-like yields)."""
    clock = VirtualClock(settle_timeout_s=30.0)
    done: list[float] = []

    async def chained() -> None:
        with clock.busy():
            for _ in range(10):
                await asyncio.sleep(0)
            done.append(clock.now())

    async def sleeper(ms: float) -> None:
        await clock.sleep(ms)
        with clock.busy():
            await asyncio.sleep(0)
            asyncio.ensure_future(chained())

    start = clock.now()
    tasks = [asyncio.ensure_future(sleeper(ms)) for ms in (10.0, 30.0)]
    await clock.advance(20.0)
    assert done == [start + 10.0] and clock.now() == start + 20.0
    await clock.advance(20.0)
    assert done == [start + 10.0, start + 30.0] and clock.now() == start + 40.0
    await asyncio.gather(*tasks)


@spec("TEST-3", "TEST-4")
async def test_busy_counts_a_task_once_and_waiting_lets_time_move() -> None:
    """A task's nested busy blocks count once, until the outermost ends (also by an
    exception); ``waiting`` inside one does not count, and counts again after."""
    clock = VirtualClock(settle_timeout_s=30.0)
    with clock.busy():
        with clock.busy():
            assert clock.active == 1
            with clock.waiting():
                assert clock.active == 0
            assert clock.active == 1
        assert clock.active == 1
    assert clock.active == 0
    with pytest.raises(ValueError), clock.busy():
        assert clock.active == 1
        raise ValueError("the work failed")
    assert clock.active == 0
    with clock.waiting():  # outside a busy block: nothing to release
        assert clock.active == 0
    assert clock.active == 0


def _turns_of_settle(
    prepare: Callable[[asyncio.AbstractEventLoop, list[str]], None] | None = None,
) -> tuple[int, list[str]]:
    """Loop turns one ``settle()`` took (after a first one, which warms up), on a loop
    that counts its turns; and what ``prepare(loop, ran)`` scheduled that ran by then."""
    loop = asyncio.new_event_loop()
    turns = 0
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counted() -> None:
        nonlocal turns
        turns += 1
        run_once()

    loop._run_once = counted  # type: ignore[attr-defined]
    clock = VirtualClock(start_ms=0.0)
    ran: list[str] = []

    async def main() -> int:
        nonlocal turns
        await clock.settle()
        if prepare is not None:
            prepare(loop, ran)
        turns = 0
        await clock.settle()
        return turns

    try:
        return loop.run_until_complete(main()), ran
    finally:
        loop.close()


@spec("TEST-3")
def test_settle_with_nothing_to_run_takes_one_turn() -> None:
    """No busy work, nothing ready, no loop timer due: ``settle`` gives the loop its one
    turn and returns, without a second turn to confirm (it would run nothing; issue 16)."""
    assert _turns_of_settle() == (1, [])


@spec("TEST-3")
def test_settle_runs_work_that_is_not_busy_to_its_end() -> None:
    """Callbacks that schedule more callbacks, and a loop timer due now: all of them have
    run when ``settle`` returns, one turn each."""
    def prepare(loop: asyncio.AbstractEventLoop, ran: list[str]) -> None:
        def chain(n: int) -> None:
            ran.append(f"soon{n}")
            if n < 3:
                loop.call_soon(chain, n + 1)
        loop.call_soon(chain, 1)
        loop.call_at(loop.time(), ran.append, "timer")

    turns, ran = _turns_of_settle(prepare)
    assert sorted(ran) == ["soon1", "soon2", "soon3", "timer"]
    assert turns >= 3


class _TaskClock(VirtualClock):
    """A virtual clock the heartbeat does not recognise: it waits for the first beat in a
    task of its own, as it did on every clock before."""


class _NoHeartbeat:
    """The block without a heartbeat: what a heartbeat that takes no loop turn must look
    like from outside."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _trace_heartbeat(clock: VirtualClock, yields_in_block: int, advance_ms: float, *,
                     heartbeat: bool = True) -> tuple[list[str], list[float]]:
    """Turn by turn, what a ticking task and a heartbeat block did: the order of the
    block's start, end and beats among the ticks (``heartbeat=False``: the same block
    without its heartbeat)."""
    from botmesh.core.heartbeat import FirstBeats, Heartbeat

    trace: list[str] = []
    beats: list[float] = []

    async def beat(until: float) -> bool:
        beats.append(clock.now())
        return True

    async def main() -> None:
        async def ticker() -> None:
            for n in range(12):
                trace.append(f"tick{n}")
                await asyncio.sleep(0)

        async def block() -> None:
            with clock.busy():
                async with Heartbeat(clock, beat, 3_000.0, FirstBeats()) if heartbeat else _NoHeartbeat():
                    trace.append("in")
                    for _ in range(yields_in_block):
                        await asyncio.sleep(0)
                    if advance_ms:
                        await clock.sleep(advance_ms)
                trace.append("out")

        ticking = asyncio.ensure_future(ticker())
        work = asyncio.ensure_future(block())
        if advance_ms:
            await clock.advance(advance_ms + 1.0)
        await asyncio.gather(work, ticking)

    asyncio.run(main())
    assert clock.next_deadline() is None, "the heartbeat left a timer behind"
    return trace, beats


@spec("LEASE-1", "TEST-3", "TEST-4")
@pytest.mark.parametrize("yields_in_block", [0, 1, 5])
def test_a_heartbeat_block_that_never_beat_ends_without_a_loop_turn(yields_in_block: int) -> None:
    """On the virtual clock a heartbeat block waits for its first beat on a timer, not a
    task, and a block that ends before it (nearly every one) takes no loop turn at its
    start or its end — as on the real clock: the other work runs at the same turns as
    beside the same block without a heartbeat, and no timer is left."""
    traced = _trace_heartbeat(VirtualClock(start_ms=0.0), yields_in_block, 0.0)
    bare = _trace_heartbeat(VirtualClock(start_ms=0.0), yields_in_block, 0.0, heartbeat=False)
    assert traced == bare
    assert traced[1] == []


@spec("LEASE-1", "TEST-3", "TEST-4")
def test_a_heartbeat_that_beat_ends_like_a_beating_task() -> None:
    """A block that outlives its first beat beats every third of its lease (1 s of a 3 s
    lease), and ends as a block whose heartbeat was a task from its start does (a clock
    the heartbeat does not recognise still gets one): its beating task cancelled and
    waited for, at the same turns among the other work."""
    traced = _trace_heartbeat(VirtualClock(start_ms=0.0), 2, 2_500.0)
    tasked = _trace_heartbeat(_TaskClock(start_ms=0.0), 2, 2_500.0)
    assert traced == tasked
    assert traced[1] == [1_000.0, 2_000.0]


@spec("TEST-3")
@pytest.mark.parametrize("ms", [0.0, -5.0, float("nan")])
def test_call_later_refuses_a_delay_that_is_not_positive(ms: float) -> None:
    with pytest.raises(ValueError, match="ms must be > 0"):
        VirtualClock().call_later(ms, lambda: None)


@spec("TEST-3")
async def test_call_later_calls_at_the_deadline_unless_cancelled() -> None:
    clock = VirtualClock(start_ms=0.0)
    called: list[float] = []
    clock.call_later(10.0, lambda: called.append(clock.now()))
    clock.call_later(20.0, lambda: called.append(-1.0)).cancel()
    await clock.advance(30.0)
    assert called == [10.0] and clock.next_deadline() is None
