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

Used by :class:`~botmesh.core.memory.MemoryKv` (the suspension point at the end of
every call) and :class:`~botmesh.core.group_commit.GroupCommit` (a group's leader
gathers other writers only while a turn could bring one)."""

from __future__ import annotations

import asyncio

__all__ = ["others_runnable"]


def others_runnable() -> bool:
    """Whether a turn of the running loop could run something other than the caller
    (module docstring): ``True`` on a loop whose queues cannot be seen."""
    loop = asyncio.get_running_loop()
    try:
        if loop._ready:  # type: ignore[attr-defined]
            return True
        scheduled = loop._scheduled  # type: ignore[attr-defined]
        return bool(scheduled) and scheduled[0]._when <= loop.time() + loop._clock_resolution  # type: ignore[attr-defined]
    except AttributeError:  # not asyncio's own loop: its queues cannot be seen
        return True
