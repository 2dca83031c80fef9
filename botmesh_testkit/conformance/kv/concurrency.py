"""Atomicity under concurrency: exactly one winner per CAS (REPL-1, LEASE-2), no lost
update in read-modify-write loops (BACK-7)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import pytest
from botmesh.core.errors import VersionConflict
from botmesh.core.spi import DurableKv, Versioned

from .base import INF, KvFactory, KvSuiteBase, Scopes


class ConcurrencyTests(KvSuiteBase):
    """The concurrency tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    concurrent_tasks: ClassVar[int] = 50
    """How many tasks race for one CAS."""

    @pytest.mark.spec("BACK-7", "REPL-1", "LEASE-2")
    def test_concurrent_cas_on_one_key_has_exactly_one_winner(self, kv_factory: KvFactory) -> None:
        """BACK-7, REPL-1, LEASE-2: concurrent CAS calls on one key with the same
        ``expected_version`` have exactly one winner, the others raise
        ``VersionConflict`` — for creates, replaces and deletes. This is what makes claims
        exclusive and fencing tokens hold."""
        n = self.concurrent_tasks

        async def race(label: str, attempt: Callable[[int], Awaitable[Any]]) -> int:
            async def one(i: int) -> tuple[str, Any]:
                try:
                    return ("won", (i, await attempt(i)))
                except VersionConflict:
                    return ("conflict", i)

            outcomes = await asyncio.gather(*(one(i) for i in range(n)))
            winners = [o[1] for o in outcomes if o[0] == "won"]
            assert len(winners) == 1, (
                f"BACK-7/REPL-1: concurrent CAS calls on one key with the same expected_version have exactly one "
                f"winner, the others raise VersionConflict; {n} concurrent {label}: {len(winners)} won"
            )
            winner: int = winners[0][0]
            return winner

        async def body(kv: DurableKv, s: Scopes) -> None:
            w = await race(
                "creates (expected_version=0)",
                lambda i: kv.put(s.a, "inbox", "k", {"writer": i}, expected_version=0, due=float(i)),
            )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"writer": w}, 1), (
                f"BACK-7/REPL-1: the stored record is the winner's (writer {w}, version 1); got {got!r}"
            )
            w = await race(
                "replaces (expected_version=1)",
                lambda i: kv.put(s.a, "inbox", "k", {"writer": i}, expected_version=1, due=float(i)),
            )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"writer": w}, 2), (
                f"BACK-7/REPL-1: the stored record is the winner's (writer {w}, version 2); got {got!r}"
            )
            entries = await kv.range(s.a, "inbox", "due", upto=INF, limit=1000)
            assert entries == [(float(w), "k")], (
                f"BACK-7/REPL-1: the index entry is the winner's only ({(float(w), 'k')!r}); got {entries!r}"
            )
            await race("deletes (expected_version=2)", lambda i: kv.delete(s.a, "inbox", "k", expected_version=2))
            got = await kv.get(s.a, "inbox", "k")
            assert got is None, f"BACK-7: after the winning delete the record is gone; got {got!r}"

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7", "REPL-1")
    def test_concurrent_read_modify_write_loses_no_update(self, kv_factory: KvFactory) -> None:
        """BACK-7, REPL-1: 20 tasks each add 1 ten times by get + CAS put, retrying on
        ``VersionConflict``: the final count is exactly 200 at version 201 (each
        ``put`` and ``delete`` is atomic)."""
        tasks, increments = 20, 10

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "outbox", "counter", {"count": 0}, expected_version=0)

            async def worker() -> None:
                for _ in range(increments):
                    for _attempt in range(10_000):
                        current = await kv.get(s.a, "outbox", "counter")
                        assert current is not None, "BACK-7: the counter record vanished"
                        try:
                            await kv.put(
                                s.a, "outbox", "counter", {"count": current.value["count"] + 1},
                                expected_version=current.version,
                            )
                            break
                        except VersionConflict:
                            continue
                    else:
                        raise AssertionError("BACK-7: an increment kept conflicting 10000 times in a row")

            await asyncio.gather(*(worker() for _ in range(tasks)))
            got = await kv.get(s.a, "outbox", "counter")
            total = tasks * increments
            assert got == Versioned({"count": total}, total + 1), (
                f"BACK-7/REPL-1: each put is atomic, so {tasks} tasks x {increments} CAS increments with retry end at "
                f"count {total}, version {total + 1}; got {got!r}"
            )

        self.run_kv(kv_factory, body)

