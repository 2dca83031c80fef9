"""SCOPE — several bots on one backend: two scopes never see or change each other's
records (SCOPE-1, SCOPE-2); explicit keys are per scope (OUT-4)."""

from __future__ import annotations

from typing import Any

import pytest

from .base import FAR, INC_2, INF, LEASE_MS, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _changes, _j, inbound, outbound


class ScopeTests(DurabilitySuiteBase):
    """The scope isolation tests (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("SCOPE-1", "SCOPE-2", "INB-4")
    def test_scope2_inbox_scopes_never_see_each_other(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """SCOPE-1, SCOPE-2: the same id in two scopes is two independent inbox records
        (no cross-scope dedupe); get, list, due, claim, complete, kill, replay and
        purge in one scope never see or change the other's records (the second
        scope's name extends the first's)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            a_m1 = (await b.inbox_journal(t.a, inbound("m1", text="scope a")))[0]
            await b.inbox_journal(t.a, inbound("m2"))
            assert await b.inbox_complete(t.a, "m2", token=1, now=T0, expires_at=T0 + 10) is True
            await b.inbox_journal(t.a, inbound("m3"))
            assert await b.inbox_kill(t.a, "m3", token=1, now=T0, error="e") is True
            a_before = {r.id: _j(r) for r in await b.inbox_list(t.a)}

            got = await b.inbox_get(t.b, "m1")
            assert got is None, f"SCOPE-2: a record of one scope is invisible from another; inbox_get returned {_j(got)!r}"
            b_m1, created = await b.inbox_journal(t.b, inbound("m1", text="scope b", owner=OWNER_B, lease_ms=10_000))
            assert created is True and b_m1.event["text"] == "scope b", (
                "SCOPE-2/INB-4: a bot only deduplicates its own records: the same id in another scope is a new record; "
                f"got created={created!r}, record {_j(b_m1)!r}"
            )
            listed = [r.id for r in await b.inbox_list(t.b)]
            assert listed == ["m1"], f"SCOPE-2: inbox_list sees only its own scope; got {listed!r}"
            for state in ("done", "dead"):
                other = [r.id for r in await b.inbox_list(t.b, state=state)]
                assert other == [], f"SCOPE-2: inbox_list(state={state!r}) sees only its own scope; got {other!r}"
            due = await b.inbox_due(t.b, upto=INF, limit=100)
            assert due == ["m1"], f"SCOPE-2: inbox_due sees only its own scope; got {due!r}"
            claims = [
                ("inbox_claim of the other scope's record", await b.inbox_claim(
                    t.b, "m3", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
                )),
                ("inbox_replay of the other scope's dead record", await b.inbox_replay(t.b, "m3", now=T0)),
                ("inbox_kill of the other scope's record", await b.inbox_kill(t.b, "m2", token=None, now=T0, error="e") or None),
            ]
            for what, result in claims:
                assert result is None, (
                    f"SCOPE-2: {what} must find nothing; it returned {_j(result) if not isinstance(result, bool) else result!r}"
                )
            assert await b.inbox_complete(t.b, "m1", token=b_m1.token, now=T0, expires_at=T0 + 5) is True
            purged = await b.inbox_purge(t.b, now=FAR, limit=100)
            assert purged == 1, f"SCOPE-2: inbox_purge purges its own scope's expired record only; it returned {purged!r}"
            a_after = {r.id: _j(r) for r in await b.inbox_list(t.a)}
            assert a_after == a_before, (
                "SCOPE-2: operations in one scope never change another scope's records; scope a changed: "
                f"{sorted(a_before)!r} -> {sorted(a_after)!r}"
                + ("" if sorted(a_after) != sorted(a_before) else f"; m1 {_changes(a_m1, await b.inbox_get(t.a, 'm1'))}")
            )
            a_due = await b.inbox_due(t.a, upto=INF, limit=100)
            assert a_due == ["m1"], f"SCOPE-2: scope a's due records are its own; inbox_due lists {a_due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("SCOPE-2", "OUT-4")
    def test_scope2_outbox_scopes_never_see_each_other(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """SCOPE-2, OUT-4: explicit keys are per bot: the same key in two scopes is two
        independent sends; get, list, due, claim, mark_sent, retry, discard and purge
        in one scope never see or change the other's records."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("reminder:1", text="a"))
            assert await b.outbox_mark_sent(t.a, "reminder:1", token=1, message_id="a-1", now=T0, expires_at=T0 + 10) is True
            await b.outbox_journal(t.a, outbound("k-dead"))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            a_before = {r.key: _j(r) for r in await b.outbox_list(t.a)}

            stored, created = await b.outbox_journal(t.b, outbound("reminder:1", state="pending", text="b"))
            assert created is True and stored.content["text"] == "b" and stored.state == "pending", (
                "SCOPE-2/OUT-4: explicit keys are per bot: the same key in another scope is a new send; got "
                f"created={created!r}, record {_j(stored)!r}"
            )
            listed = [r.key for r in await b.outbox_list(t.b)]
            assert listed == ["reminder:1"], f"SCOPE-2: outbox_list sees only its own scope; got {listed!r}"
            sent = [r.key for r in await b.outbox_list(t.b, state="sent")]
            assert sent == [], f"SCOPE-2: outbox_list(state='sent') sees only its own scope; got {sent!r}"
            due = await b.outbox_due(t.b, upto=INF, limit=100)
            assert due == ["reminder:1"], f"SCOPE-2: outbox_due sees only its own scope; got {due!r}"
            results: list[tuple[str, Any]] = [
                ("outbox_get of the other scope's key", await b.outbox_get(t.b, "k-dead")),
                ("outbox_claim of the other scope's key", await b.outbox_claim(
                    t.b, "k-pending", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
                )),
                ("outbox_retry of the other scope's dead send", await b.outbox_retry(t.b, "k-dead", now=T0) or None),
                ("outbox_discard of the other scope's send", await b.outbox_discard(t.b, "k-pending") or None),
                ("outbox_mark_dead of the other scope's send",
                 await b.outbox_mark_dead(t.b, "k-pending", token=None, now=T0, error="e") or None),
            ]
            for what, result in results:
                assert result is None, f"SCOPE-2: {what} must find nothing; it returned {result!r}"
            claim = await b.outbox_claim(
                t.b, "reminder:1", owner=OWNER_B, incarnation=INC_2, now=T0, lease_ms=LEASE_MS, recover=False
            )
            assert claim is not None, "SCOPE-2: setting up: scope b's own pending send must be claimable"
            assert await b.outbox_mark_sent(
                t.b, "reminder:1", token=claim[0].token, message_id="b-1", now=T0, expires_at=T0 + 5
            ) is True
            purged = await b.outbox_purge(t.b, now=FAR, limit=100)
            assert purged == 1, f"SCOPE-2: outbox_purge purges its own scope's expired send only; it returned {purged!r}"
            a_after = {r.key: _j(r) for r in await b.outbox_list(t.a)}
            assert a_after == a_before, (
                "SCOPE-2: operations in one scope never change another scope's records; scope a changed: "
                f"{sorted(a_before)!r} -> {sorted(a_after)!r}"
            )
            b_after = await b.outbox_get(t.b, "reminder:1")
            assert b_after is None, f"SCOPE-2: scope b's purged send is gone; got {_j(b_after)!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

