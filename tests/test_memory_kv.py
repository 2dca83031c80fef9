"""The reference kv's calls are suspension points (BACK-7): whatever else is runnable at a
call — a task, a callback, a timer that is due — runs before the call returns, as it
would during the I/O of any other kv; the order of everything is the one a turn of the
loop per call gives."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from botmesh.core.memory import MemoryKv

spec = pytest.mark.spec

CALLS: list[tuple[str, Any]] = [
    ("put", lambda kv: kv.put("s", "inbox", "k", {"a": 1}, expected_version=0)),
    ("get", lambda kv: kv.get("s", "inbox", "k")),
    ("range", lambda kv: kv.range("s", "inbox", "due", upto=float("inf"), limit=10)),
    ("scan", lambda kv: kv.scan("s", "inbox")),
    ("delete", lambda kv: kv.delete("s", "inbox", "k", expected_version=1)),
]


@spec("BACK-7")
async def test_what_is_runnable_runs_during_every_call() -> None:
    kv = MemoryKv()
    await kv.open()
    loop = asyncio.get_running_loop()
    for name, call in CALLS:
        seen: list[str] = []
        loop.call_soon(seen.append, "callback")

        async def other(seen: list[str] = seen) -> None:
            seen.append("task")

        asyncio.ensure_future(other())
        await call(kv)
        assert seen == ["callback", "task"], name


@spec("BACK-7")
async def test_a_due_timer_keeps_its_place_around_a_call() -> None:
    """A timer due when a call ends runs before what the caller schedules after the call
    — its place when the call takes a turn of the loop."""
    kv = MemoryKv()
    await kv.open()
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    loop.call_at(loop.time() - 1.0, fired.append, "timer")  # due already
    await kv.put("s", "inbox", "k", {"a": 1}, expected_version=0)
    loop.call_soon(fired.append, "after the call")
    for _ in range(3):
        await asyncio.sleep(0)
    assert fired == ["timer", "after the call"]


@spec("BACK-7")
async def test_two_writers_take_turns_call_by_call() -> None:
    """Two tasks writing at once alternate at each call, the order one turn per call
    gives (each call's write is atomic, its end a suspension point)."""
    kv = MemoryKv()
    await kv.open()
    order: list[str] = []

    async def writer(name: str) -> None:
        for i in range(3):
            await kv.put("s", "inbox", f"{name}{i}", {"i": i}, expected_version=0)
            order.append(f"{name}{i}")

    await asyncio.gather(writer("a"), writer("b"))
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert [k for k, _ in await kv.scan("s", "inbox")] == ["a0", "a1", "a2", "b0", "b1", "b2"]



@spec("BACK-7")
async def test_on_asyncio_s_loop_with_nothing_runnable_no_turn_is_taken() -> None:
    from botmesh.core import memory, turns

    assert memory._suspension_point() is turns.NOTHING


@spec("BACK-7")
def test_a_loop_whose_queues_cannot_be_seen_always_gets_the_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an event loop other than asyncio's own (no ``_ready``/``_scheduled`` to look
    at), nothing tells that the turn may be skipped: every call takes it. (A sync test:
    no loop of the test runs while ``get_running_loop`` answers with the other loop.)"""
    from botmesh.core import memory, turns

    class Opaque:
        """Another loop, as the suspension point sees it (asyncio's queues not there)."""

        def time(self) -> float:
            return 0.0

    monkeypatch.setattr(turns.asyncio, "get_running_loop", lambda: Opaque())
    assert memory._suspension_point() is turns.TURN
