"""Survival of a crash (``survives_crash``): everything acknowledged before
``harness.reopen()`` is there after it — records, states, tokens, and both indexes (a
leased record is still due at its ``lease_until``). Skipped when the harness does not
claim ``survives_crash``."""

from __future__ import annotations

from typing import Any

import pytest
from botmesh.core.backend import DurabilityBackend

from .base import INC_1, INC_2, INF, LEASE_MS, OWNER_A, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _j, inbound, outbound


class SurvivalTests(DurabilitySuiteBase):
    """The crash survival tests (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("INB-3", "LEASE-2", "OPS-3", "BACK-7")
    def test_inb3_acknowledged_inbox_writes_survive_a_crash(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-3, LEASE-2, OPS-3 (``survives_crash``): every inbox write acknowledged
        before the process died is there after ``harness.reopen()`` — each record with
        its state and token, the due index (a leased record still due at its
        ``lease_until``, not before), the retention index (an expired done record is
        purged), fencing (a stale token is still refused, the next claim's token is
        larger) and dedupe (INB-4); then again after a second death. Skipped when the
        harness does not claim ``survives_crash``."""

        async def body(t: DurabilityTest) -> None:
            t.require("survives_crash")
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))  # leased until T0+60000
            await b.inbox_journal(t.a, inbound("m2"))
            assert await b.inbox_retry_later(t.a, "m2", token=1, next_at=T0 + 5_000, error="store down") is True
            await b.inbox_journal(t.a, inbound("m3"))
            assert await b.inbox_complete(t.a, "m3", token=1, now=T0, expires_at=T0 + 100) is True
            await b.inbox_journal(t.a, inbound("m4"))
            assert await b.inbox_kill(t.a, "m4", token=1, now=T0, error="poison") is True
            await b.inbox_journal(t.a, inbound("m5", lease_ms=1_000))
            taken = await b.inbox_claim(
                t.a, "m5", owner=OWNER_B, incarnation=INC_2, now=T0 + 1_000, lease_ms=LEASE_MS, recover=False
            )
            assert taken is not None and taken.token == 2
            await b.inbox_journal(t.a, inbound("m6"))
            assert await b.inbox_complete(t.a, "m6", token=1, now=T0, expires_at=None) is True
            await b.inbox_journal(t.b, inbound("m1", text="other scope"))
            before, due_before = await _snapshot(b, t, "inbox")

            for death in (1, 2):
                b = await t.reopen()
                await _assert_all_there(b, t, "inbox", before, due_before, death)
                if death == 1:
                    early = await b.inbox_due(t.a, upto=T0 + LEASE_MS - 1, limit=100)
                    at = await b.inbox_due(t.a, upto=T0 + LEASE_MS, limit=100)
                    assert "m1" not in early and "m1" in at, (
                        f"INB-3: a leased record is still due at its lease_until (T0+60000) after a crash, not before; "
                        f"due(T0+59999) = {early!r}, due(T0+60000) = {at!r}"
                    )
                    stale = await b.inbox_complete(t.a, "m5", token=1, now=T0 + 2_000, expires_at=None)
                    assert stale is False, (
                        f"LEASE-2: a stale token is still refused after a crash; inbox_complete returned {stale!r}"
                    )
                    purged = await b.inbox_purge(t.a, now=T0 + 100, limit=100)
                    assert purged == 1 and await b.inbox_get(t.a, "m3") is None, (
                        f"OPS-3: the retention of a done record survives a crash: purging at its expires_at deletes it; "
                        f"inbox_purge returned {purged!r}"
                    )
                    _, created = await b.inbox_journal(t.a, inbound("m1", text="redelivered"))
                    assert created is False, f"INB-4: dedupe survives a crash: journaling m1 again returned created={created!r}"
                    got = await b.inbox_claim(
                        t.a, "m5", owner=OWNER_A, incarnation=INC_1, now=T0 + 1_000 + LEASE_MS, lease_ms=LEASE_MS, recover=False
                    )
                    assert got is not None and got.token > 2, (
                        f"LEASE-2: fencing tokens keep growing across a crash: the next claim of m5 must get a token > 2; "
                        f"got {_j(got)!r}"
                    )
                    before, due_before = await _snapshot(b, t, "inbox")

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-2", "OUT-14", "LEASE-2", "OPS-3", "BACK-7")
    def test_out2_acknowledged_outbox_writes_survive_a_crash(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-2, OUT-14, LEASE-2, OPS-3 (``survives_crash``): every outbox write
        acknowledged before the process died is there after ``harness.reopen()`` — each
        send with its state, message id and token; the due index (a send in flight is
        due at its ``lease_until``, and claimed then as ambiguous: OUT-14); a sent key
        is still answered from the outbox (OUT-2); the retention index; fencing; then
        again after a second death. Skipped when the harness does not claim
        ``survives_crash``."""

        async def body(t: DurabilityTest) -> None:
            t.require("survives_crash")
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-sending"))  # lease until T0+60000
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", next_at=T0 + 1_000))
            await b.outbox_journal(t.a, outbound("k-failed"))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 2_000, error="timeout") is True
            await b.outbox_journal(t.a, outbound("k-sent"))
            assert await b.outbox_mark_sent(t.a, "k-sent", token=1, message_id="wamid.SENT", now=T0, expires_at=T0 + 100) is True
            await b.outbox_journal(t.a, outbound("k-kept"))
            assert await b.outbox_mark_sent(t.a, "k-kept", token=1, message_id="wamid.KEPT", now=T0, expires_at=None) is True
            await b.outbox_journal(t.a, outbound("k-dead"))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("k-unknown"))
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            await b.outbox_journal(t.b, outbound("k-sent", state="pending", text="other scope"))
            before, due_before = await _snapshot(b, t, "outbox")

            for death in (1, 2):
                b = await t.reopen()
                await _assert_all_there(b, t, "outbox", before, due_before, death)
                if death == 1:
                    stored, created = await b.outbox_journal(t.a, outbound("k-sent", text="replayed"))
                    assert created is False and stored.state == "sent" and stored.message_id == "wamid.SENT", (
                        "OUT-2: a sent key is still answered from the outbox after a crash (the stored message id); got "
                        f"created={created!r}, record {_j(stored)!r}"
                    )
                    early = await b.outbox_due(t.a, upto=T0 + LEASE_MS - 1, limit=100)
                    assert "k-sending" not in early, (
                        f"OUT-14: a send in flight is not due before its lease_until after a crash; due(T0+59999) = {early!r}"
                    )
                    stolen = await b.outbox_claim(
                        t.a, "k-sending", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS - 1, lease_ms=LEASE_MS,
                        recover=False,
                    )
                    assert stolen is None, f"LEASE-2: an unexpired send lease survives a crash; a claim returned {stolen!r}"
                    got = await b.outbox_claim(
                        t.a, "k-sending", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS, lease_ms=LEASE_MS, recover=False
                    )
                    assert got is not None and got[1] == "sending" and got[0].token > 1, (
                        "OUT-14: after a crash, the send in flight is claimed at its lease_until as ambiguous "
                        f"(previous state 'sending') with a larger token; got {got!r}"
                    )
                    stale = await b.outbox_mark_sent(
                        t.a, "k-sending", token=1, message_id="late", now=T0 + LEASE_MS, expires_at=None
                    )
                    assert stale is False, (
                        f"LEASE-2: the dead owner's token is refused after a crash; outbox_mark_sent returned {stale!r}"
                    )
                    purged = await b.outbox_purge(t.a, now=T0 + 100, limit=100)
                    assert purged == 1 and await b.outbox_get(t.a, "k-sent") is None, (
                        f"OPS-3: the retention of a sent record survives a crash: purging at its expires_at deletes it; "
                        f"outbox_purge returned {purged!r}"
                    )
                    before, due_before = await _snapshot(b, t, "outbox")

        self.run_backend(botmesh_harness_factory, tmp_path, body)


_Listing = dict[str, dict[str, dict[str, Any] | None]]
"""Every record of one journal as JSON, by scope and then by id (inbox) or key (outbox)."""


async def _listing(b: DurabilityBackend, t: DurabilityTest, journal: str) -> _Listing:
    """What a backend shows of ``journal`` in the test's scopes."""
    if journal == "inbox":
        return {s: {r.id: _j(r) for r in await b.inbox_list(s)} for s in t.scopes.all}
    return {s: {r.key: _j(r) for r in await b.outbox_list(s)} for s in t.scopes.all}


async def _due(b: DurabilityBackend, t: DurabilityTest, journal: str) -> list[str]:
    """What is due in ``journal`` of the test's main scope, at any time."""
    if journal == "inbox":
        return await b.inbox_due(t.a, upto=INF, limit=100)
    return await b.outbox_due(t.a, upto=INF, limit=100)


async def _snapshot(b: DurabilityBackend, t: DurabilityTest, journal: str) -> tuple[_Listing, list[str]]:
    """What must still be there after a crash: the records and what is due."""
    return await _listing(b, t, journal), await _due(b, t, journal)


async def _assert_all_there(
    b: DurabilityBackend, t: DurabilityTest, journal: str, before: _Listing, due_before: list[str], death: int
) -> None:
    """Every write of ``journal`` acknowledged before death #``death`` is there after it,
    unchanged, and what was due is due in the same order."""
    spec, unfinished = ("INB-3", "records") if journal == "inbox" else ("OUT-2", "sends")
    after = await _listing(b, t, journal)
    for s in t.scopes.all:
        missing = sorted(set(before[s]) - set(after[s]))
        changed = sorted(k for k in before[s] if k in after[s] and after[s][k] != before[s][k])
        assert not missing and not changed and after[s] == before[s], (
            f"{spec}: every {journal} write acknowledged before a crash must be there after it "
            f"(capabilities.survives_crash); after death #{death}, scope {s!r}: missing {missing!r}, "
            f"changed {changed!r}, extra {sorted(set(after[s]) - set(before[s]))!r}"
        )
    due = await _due(b, t, journal)
    assert due == due_before, (
        f"{spec}: the {unfinished} left unfinished must still be due after a crash, in the same order; after death "
        f"#{death}: expected {due_before!r}, got {due!r}"
    )
