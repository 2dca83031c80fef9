"""Whether a loop turn would let anything else run (issue 16).

A suspension point that yields to the event loop (``await asyncio.sleep(0)``) costs a
whole loop iteration — a ``select`` and the loop's bookkeeping — even when nothing else
is there to run. :func:`others_runnable` answers whether the turn could run anything:
on asyncio's own event loop, a ready callback or a timer due now; when neither is there,
the turn would only resume the caller at once, and every task, callback and timer runs
in the same order whether it is taken or not. Only an I/O readiness that arrives
exactly then would be seen a turn later — what real I/O timing decides anyway — so a
run in virtual time stays deterministic. On another loop, whose queues cannot be seen,
the answer is always yes.

Used by :class:`~botmesh.core.memory.MemoryKv` (:func:`suspension_point`, at the end
of every call) and :class:`~botmesh.core.group_commit.GroupCommit` (a group's leader
gathers other writers only while a turn could bring one)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator

__all__ = ["NOTHING", "TURN", "others_runnable", "suspension_point"]

PLAIN_LOOP_TIME = asyncio.BaseEventLoop.time
"""asyncio's own ``loop.time()``, which is ``time.monotonic()``: where ``type(loop).time``
is this, the module calls ``time.monotonic`` itself (a C call instead of a Python one;
issue 16: four per message)."""
monotonic = time.monotonic


class _Turn:
    """An awaitable that gives the loop one turn (what ``asyncio.sleep(0)`` does)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


class _Nothing:
    """An awaitable that completes at once (nothing else could run meanwhile)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield


TURN = _Turn()
"""Awaited: one loop turn."""
NOTHING = _Nothing()
"""Awaited: nothing (no turn)."""


def suspension_point() -> _Turn | _Nothing:
    """:data:`TURN` when a turn of the running loop could run something other than the
    caller (module docstring), else :data:`NOTHING`: ``await suspension_point()`` is a
    suspension point that costs no loop turn when nothing else could run. (One call:
    MemoryKv ends every call with it, issue 16.)"""
    loop = asyncio.get_running_loop()
    try:
        if loop._ready:  # type: ignore[attr-defined]
            return TURN
        scheduled = loop._scheduled  # type: ignore[attr-defined]
        if scheduled and scheduled[0]._when <= ((monotonic() if type(loop).time is PLAIN_LOOP_TIME else loop.time())
                                                 + loop._clock_resolution):  # type: ignore[attr-defined]
            return TURN
    except AttributeError:  # not asyncio's own loop: its queues cannot be seen
        return TURN
    return NOTHING


def others_runnable() -> bool:
    """Whether a turn of the running loop could run something other than the caller
    (module docstring): ``True`` on a loop whose queues cannot be seen."""
    return suspension_point() is TURN
