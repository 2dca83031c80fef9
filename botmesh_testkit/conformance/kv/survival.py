"""Survival of a process death, only when ``capabilities.survives_crash`` is claimed
(otherwise the test is skipped with ``capability not claimed: survives_crash``)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from botmesh.core import MemoryKv
from botmesh.core.spi import DurableKv

from .base import KvFactory, KvSuiteBase, Scopes, _cleanup, _guarded, _state, crash


class SurvivalTests(KvSuiteBase):
    """The crash survival tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    @pytest.mark.spec("BACK-7")
    def test_acknowledged_writes_survive_a_crash(self, kv_factory: KvFactory) -> None:
        """BACK-7 (``survives_crash``): a write that returned is still there — value,
        version, index entries; a delete that returned stays deleted — when a new
        instance opens the same storage after the first one was dropped without
        ``close()`` (its ``abandon()`` called when it has one); and again after a clean
        ``close()``. Skipped when the kv does not claim ``survives_crash``."""
        if not self.claims_survives_crash(kv_factory):
            pytest.skip("capability not claimed: survives_crash")

        async def write(kv: DurableKv, oracle: MemoryKv, s: Scopes, round_: int) -> None:
            """Creates, replaces (moving and removing index entries) and a delete, each
            applied to the reference first and then to the kv."""
            for scope in s.all:
                for space in ("inbox", "outbox"):
                    for target in (oracle, kv):
                        for i in range(4):
                            await target.put(
                                scope, space, f"r{round_}-k{i}", {"i": i, "round": round_, "text": "é✓"},
                                expected_version=0, due=float(i), expires=float(10 - i),
                            )
                        await target.put(
                            scope, space, f"r{round_}-k1", {"i": 1, "replaced": 1},
                            expected_version=1, due=7.5, expires=None,
                        )
                        await target.put(
                            scope, space, f"r{round_}-k1", {"i": 1, "replaced": 2},
                            expected_version=2, due=8.5, expires=None,
                        )
                        await target.delete(scope, space, f"r{round_}-k2", expected_version=1)

        async def compare(kv: DurableKv, oracle: MemoryKv, s: Scopes, when: str) -> None:
            for scope in s.all:
                for space in ("inbox", "outbox"):
                    expected = await _state(oracle, scope, space)
                    got = await _state(kv, scope, space)
                    assert got == expected, (
                        "BACK-7: a write that returned is durable to the degree capabilities.survives_crash claims; "
                        f"{when}, a new instance must show every acknowledged write with its version and index "
                        f"entries; space {space!r}: expected {expected!r}, got {got!r}"
                    )

        async def main() -> None:
            s = Scopes()
            oracle = MemoryKv()
            first: DurableKv | None = kv_factory()
            assert first is not None
            await first.open()
            await write(first, oracle, s, 1)
            crash(first)
            first = None  # the dead process's objects are gone
            gc.collect()
            second = kv_factory()
            await second.open()
            try:
                await compare(second, oracle, s, "after the process died without close()")
                await write(second, oracle, s, 2)
            finally:
                await second.close()
            third = kv_factory()
            await third.open()
            try:
                await compare(third, oracle, s, "after close() and a new open()")
                await _cleanup(third, s)
            finally:
                await third.close()

        asyncio.run(asyncio.wait_for(_guarded(main()), self.timeout_seconds))

