"""The engine's lease renewal (LEASE-1) and chat-order lock (OUT-11) as plain async
context managers: entered once or twice per message, where a generator-based
``contextlib.asynccontextmanager`` costs several calls more each time (issue 16)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType

from .clock import Clock, RealClock, VirtualClock, VirtualTimer
from .keylocks import acquire_waiting
from .turns import PLAIN_LOOP_TIME, monotonic


class FirstBeats:
    """The first beats of one runtime's heartbeats on the real clock, behind one timer.

    A block that ends before its first beat is due (nearly every one: a lease is renewed
    every ``lease_ms / 3``, 10 s by default) then costs an entry in a dict instead of a
    timer made and cancelled (``call_later`` twice per message, issue 16). The timer is
    armed for the earliest due first beat; when it fires, every block whose first beat is
    due starts beating (a task, as before) and it is armed again for the next one."""

    __slots__ = ("_due", "_timer", "_loop")

    _EARLY_S = 0.001
    """A first beat this close to due when the timer fires is started (the loop fires a
    timer up to its clock resolution early)."""

    def __init__(self) -> None:
        self._due: dict[Heartbeat, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, heartbeat: Heartbeat, delay_s: float) -> None:
        """Start ``heartbeat`` beating ``delay_s`` from now unless it was removed."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (a restart in another asyncio.run)
            self._loop, self._timer = loop, None
            self._due.clear()
        due = (monotonic() if type(loop).time is PLAIN_LOOP_TIME else loop.time()) + delay_s  # (turns.py)
        self._due[heartbeat] = due
        timer = self._timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(due, self._fire)

    def remove(self, heartbeat: Heartbeat) -> None:
        """``heartbeat``'s block ended: no first beat (the timer stays armed, and finds
        nothing due for it)."""
        self._due.pop(heartbeat, None)

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time() + self._EARLY_S
        due_next: float | None = None
        for heartbeat, due in list(self._due.items()):
            if due <= now:
                del self._due[heartbeat]
                heartbeat._start(False)
            elif due_next is None or due < due_next:
                due_next = due
        if due_next is not None:
            self._timer = loop.call_at(due_next, self._fire)


class Heartbeat:
    """``async with Heartbeat(clock, beat, lease_ms, first_beats)``: ``await beat(now +
    lease_ms)`` every ``lease_ms / 3`` while the block runs, until a beat returns False.
    On the real clock the wait for the first beat is the timer of ``first_beats``, shared
    by all the blocks of a runtime (:class:`FirstBeats`), not a task: most blocks end
    before it, and then no task was made. On the virtual clock it is a
    :meth:`VirtualClock.call_later <botmesh.core.clock.VirtualClock.call_later>` armed
    when the block starts. Either way a block that ends before its first beat takes no
    turn of the loop: its end removes the entry or cancels the timer, and the caller goes
    on. Only a block that did beat ends by cancelling its beating task and waiting for
    it. A beat that died of a ``BaseException`` that is not an ``Exception`` (a simulated
    process death) is raised when the block ends.

    (Earlier, a virtual-clock block that never beat ended after the three loop turns
    that cancelling a beating task had taken, to keep the order of the task-based
    heartbeat before it. The real clock takes none there, and those turns were a quarter
    of a crash cell's loop turns (issue 16): now neither clock takes them, and a run in
    virtual time ends a block as production does.)"""

    __slots__ = ("_clock", "_beat", "_lease_ms", "_tasks", "_first_beats", "_timer")

    def __init__(
        self, clock: Clock, beat: Callable[[float], Awaitable[bool]], lease_ms: float, first_beats: FirstBeats
    ) -> None:
        self._clock = clock
        self._beat = beat
        self._lease_ms = lease_ms
        self._tasks: list[asyncio.Task[None]] = []
        self._first_beats = first_beats
        self._timer: VirtualTimer | None = None  # virtual clock: the first beat's timer, until it fires

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

    def _first_beat(self) -> None:
        self._timer = None
        self._start(False)

    async def __aenter__(self) -> None:
        clock = self._clock
        if type(clock) is RealClock:
            self._first_beats.add(self, max(0.0, self._lease_ms / 3.0) / 1000.0)
        elif type(clock) is VirtualClock and self._lease_ms > 0:
            self._timer = clock.call_later(self._lease_ms / 3.0, self._first_beat)
        else:
            self._start(True)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        timer = self._timer
        if timer is not None:  # virtual clock, before the first beat: no task to end
            self._timer = None
            timer.cancel()
            return
        self._first_beats.remove(self)
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
