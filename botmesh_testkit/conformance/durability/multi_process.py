"""Several processes on one storage (``multi_process``): two backends on the same storage
see each other's records and claim exclusively (REPL-1, REPL-4). Skipped when the
harness does not claim ``multi_process``; ``multi_host`` cannot be exercised from one
host."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .base import INC_2, LEASE_MS, OWNER_A, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _j, inbound, outbound


class MultiProcessTests(DurabilitySuiteBase):
    """The several-processes tests (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("REPL-1", "REPL-4", "LEASE-2", "INB-4")
    def test_repl4_two_processes_on_one_storage_claim_exclusively(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """REPL-1, REPL-4 (``multi_process``): two backends opened on the same storage
        (a second harness on the same ``workdir``, as another process would) see each
        other's records; a journal by one is a duplicate for the other (INB-4, OUT-2);
        concurrent claims from both have exactly one winner; the loser's stale token is
        refused by both (LEASE-2). Skipped when the harness does not claim
        ``multi_process``."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            t.require("multi_process")
            one = t.backend
            two = await t.another_process()
            await one.inbox_journal(t.a, inbound("m1"))
            seen = await two.inbox_get(t.a, "m1")
            assert seen is not None and seen.owner == OWNER_A, (
                f"REPL-4: a record journaled by one process is visible to another on the same storage; got {_j(seen)!r}"
            )
            _, created = await two.inbox_journal(t.a, inbound("m1", owner=OWNER_B))
            assert created is False, f"INB-4/REPL-4: a redelivery to another process is recognised; created={created!r}"
            results = await asyncio.gather(
                *(
                    (one if i % 2 == 0 else two).inbox_claim(
                        t.a, "m1", owner=f"owner-{i}", incarnation=f"inc-{i}", now=T0 + LEASE_MS, lease_ms=LEASE_MS, recover=False
                    )
                    for i in range(n)
                )
            )
            winners = [(i, r) for i, r in enumerate(results) if r is not None]
            assert winners, f"LEASE-2: an expired lease must be taken by one of {n} concurrent claimers; none got it"
            assert len(winners) == 1, (
                f"REPL-1: two processes never claim the same record: {n} concurrent claims from two backends on one "
                f"storage must have exactly one winner; {len(winners)} won"
            )
            winner, rec = winners[0]
            for name, backend in (("the first", one), ("the second", two)):
                got = await backend.inbox_get(t.a, "m1")
                assert got is not None and (got.owner, got.token) == (rec.owner, rec.token), (
                    f"REPL-1: {name} backend must see the winner's lease ({rec.owner}, token {rec.token}); got {_j(got)!r}"
                )
            loser = two if winner % 2 == 0 else one
            stale = await loser.inbox_complete(t.a, "m1", token=1, now=T0 + LEASE_MS + 1, expires_at=None)
            assert stale is False, f"LEASE-2/REPL-1: the old token is refused in another process too; it returned {stale!r}"
            holder = one if winner % 2 == 0 else two
            assert await holder.inbox_complete(t.a, "m1", token=rec.token, now=T0 + LEASE_MS + 2, expires_at=None) is True
            done = await loser.inbox_get(t.a, "m1")
            assert done is not None and done.state == "done", (
                f"REPL-4: the completion is visible to the other process; got {_j(done)!r}"
            )

            outcomes = await asyncio.gather(
                *((one if i % 2 == 0 else two).outbox_journal(t.a, outbound("k1", state="pending", seq=i)) for i in range(n))
            )
            created_count = sum(1 for _, c in outcomes if c)
            assert created_count == 1, (
                f"OUT-2/REPL-4: concurrent journals of one key from two processes create it exactly once; {created_count} did"
            )
            claim = await two.outbox_claim(t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=T0, lease_ms=LEASE_MS, recover=False)
            assert claim is not None
            assert await one.outbox_mark_sent(
                t.a, "k1", token=claim[0].token, message_id="wamid.X", now=T0, expires_at=None
            ) is True
            sent = await two.outbox_get(t.a, "k1")
            assert sent is not None and (sent.state, sent.message_id) == ("sent", "wamid.X"), (
                f"REPL-4: a send recorded by one process is answered from the outbox by the other; got {_j(sent)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

