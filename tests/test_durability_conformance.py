"""The shipped durability-level conformance suite (BACK-7) bound to the built-in
backends exactly as a third party binds it — a ``botmesh_harness_factory`` fixture
returning what :func:`botmesh_testkit.backends.resolve` gives for a name: memory, file
(snapshot only), file+log (with the append log) and SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from botmesh_testkit.backends import resolve
from botmesh_testkit.conformance.durability import DurabilityConformance, HarnessFactory


class TestMemoryDurability(DurabilityConformance):
    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        return resolve("memory")


class TestFileDurability(DurabilityConformance):
    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        return resolve("file")


class TestFileDurabilityAppendLog(DurabilityConformance):
    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        return resolve("file+log")


class TestSQLiteDurability(DurabilityConformance):
    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        return resolve("sqlite")


@pytest.mark.spec("BACK-7")
@pytest.mark.parametrize("name", ["memory", "sqlite"])
def test_clean_up_deletes_every_record_of_the_test_scopes(name: str, tmp_path: Path) -> None:
    """BACK-7: on storage that outlives a test (``clean_up_records``), the suite's
    best-effort clean-up leaves none of the records a test wrote, whatever their state,
    and touches no other scope."""
    from botmesh_testkit.conformance.durability import DurabilityTest, T0, inbound, outbound

    async def main() -> None:
        t = DurabilityTest(resolve(name), str(tmp_path))
        await t.open()
        try:
            b = t.backend
            for scope in t.scopes.all:
                for id in ("leased", "pending", "done", "dead"):
                    await b.inbox_journal(scope, inbound(id))
                assert await b.inbox_retry_later(scope, "pending", token=1, next_at=T0 + 5, error="e")
                assert await b.inbox_complete(scope, "done", token=1, now=T0, expires_at=None)
                assert await b.inbox_kill(scope, "dead", token=1, now=T0, error="e")
                await b.outbox_journal(scope, outbound("sending"))
                await b.outbox_journal(scope, outbound("pending", state="pending"))
            t.bot_scopes.append("other/bot")
            await b.inbox_journal("unrelated", inbound("keep"))
            await b.outbox_journal("unrelated", outbound("keep"))
            await t.clean_up()
            for scope in t.scopes.all:
                assert await b.inbox_list(scope) == [] and await b.outbox_list(scope) == []
            assert [r.id for r in await b.inbox_list("unrelated")] == ["keep"]
            assert [r.key for r in await b.outbox_list("unrelated")] == ["keep"]
        finally:
            await t.close()

    asyncio.run(main())
