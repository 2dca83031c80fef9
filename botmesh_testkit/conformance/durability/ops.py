"""OPS — the operator API and retention: listing by state, replay of a dead inbound,
retry, discard (OPS-2); retention purges only expired ``done``/``sent`` records
(OPS-3)."""

from __future__ import annotations

from typing import Any

import pytest

from .base import INC_1, INF, LEASE_MS, OWNER_A, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _changes, _j, inbound, outbound


class OpsTests(DurabilitySuiteBase):
    """The operator API and retention tests (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("OPS-2")
    def test_ops2_inbox_list_filters_by_state_in_id_order(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``inbox_list`` lists the records ordered by id — all of them, or
        those of one state (``"dead"`` is the DLQ) — up to ``limit``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            for id in ("m5", "m4", "m3", "m2", "m1"):
                await b.inbox_journal(t.a, inbound(id))
            assert await b.inbox_retry_later(t.a, "m2", token=1, next_at=T0 + 1, error="e") is True
            assert await b.inbox_complete(t.a, "m3", token=1, now=T0, expires_at=None) is True
            assert await b.inbox_kill(t.a, "m1", token=1, now=T0, error="e") is True
            assert await b.inbox_kill(t.a, "m5", token=None, now=T0, error="e") is True
            cases: list[tuple[str | None, int, list[str]]] = [
                (None, 1000, ["m1", "m2", "m3", "m4", "m5"]),
                ("dead", 1000, ["m1", "m5"]),
                ("done", 1000, ["m3"]),
                ("pending", 1000, ["m2"]),
                ("leased", 1000, ["m4"]),
                (None, 2, ["m1", "m2"]),
                ("dead", 1, ["m1"]),
            ]
            for state, limit, expected in cases:
                got = [r.id for r in await b.inbox_list(t.a, state=state, limit=limit)]
                assert got == expected, (
                    f"OPS-2: inbox_list(state={state!r}, limit={limit}) lists the records of that state ordered by id; "
                    f"expected {expected!r}, got {got!r}"
                )
            states = {r.id: r.state for r in await b.inbox_list(t.a)}
            expected_states = {"m1": "dead", "m2": "pending", "m3": "done", "m4": "leased", "m5": "dead"}
            assert states == expected_states, (
                f"OPS-2: inbox_list shows each record's state; expected {expected_states!r}, got {states!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_outbox_list_filters_by_state(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``outbox_list`` lists the records — all of them, or those of one
        state (``"dead"`` is the DLQ) — up to ``limit``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            for key in ("k-sending", "k-failed", "k-sent", "k-dead", "k-dead-2", "k-unknown"):
                await b.outbox_journal(t.a, outbound(key))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 1, error="e") is True
            assert await b.outbox_mark_sent(t.a, "k-sent", token=1, message_id="x", now=T0, expires_at=None) is True
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            assert await b.outbox_mark_dead(t.a, "k-dead-2", token=None, now=T0, error="e") is True
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            expected: dict[str | None, list[str]] = {
                None: ["k-dead", "k-dead-2", "k-failed", "k-pending", "k-sending", "k-sent", "k-unknown"],
                "dead": ["k-dead", "k-dead-2"],
                "pending": ["k-pending"],
                "sending": ["k-sending"],
                "failed": ["k-failed"],
                "sent": ["k-sent"],
                "unknown": ["k-unknown"],
            }
            for state, keys in expected.items():
                got = sorted(r.key for r in await b.outbox_list(t.a, state=state))
                assert got == keys, f"OPS-2: outbox_list(state={state!r}) lists exactly {keys!r}; got {got!r}"
            limited = await b.outbox_list(t.a, limit=3)
            assert len(limited) == 3, f"OPS-2: outbox_list(limit=3) lists 3 of the 7 records; got {len(limited)}"
            limited = await b.outbox_list(t.a, state="dead", limit=1)
            assert len(limited) == 1 and limited[0].state == "dead", (
                f"OPS-2: outbox_list(state='dead', limit=1) lists one dead record; got {[_j(r) for r in limited]!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2", "INB-7")
    def test_ops2_replay_of_a_dead_inbound(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``inbox_replay`` makes a ``dead`` (or ``done``) record ``pending`` now
        with its attempts reset (INB-7) and returns it; it is then due and claimable at
        once. A leased record or an absent id gives None and changes nothing."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))
            assert await b.inbox_kill(t.a, "m1", token=1, now=T0 + 1, error="poison") is True
            replayed = await b.inbox_replay(t.a, "m1", now=T0 + 100)
            stored = await b.inbox_get(t.a, "m1")
            assert replayed is not None and _j(replayed) == _j(stored), (
                "OPS-2: inbox_replay of a dead record returns the stored record; returned "
                f"{_j(replayed)!r}, stored {_j(stored)!r}"
            )
            assert stored is not None and stored.state == "pending" and stored.attempts == 0, (
                f"OPS-2/INB-7: a replayed record is pending with its attempts reset; got {_j(stored)!r}"
            )
            dead = [r.id for r in await b.inbox_list(t.a, state="dead")]
            assert dead == [], f"OPS-2: a replayed record leaves the DLQ; inbox_list(state='dead') = {dead!r}"
            early = await b.inbox_due(t.a, upto=T0 + 99, limit=10)
            on_time = await b.inbox_due(t.a, upto=T0 + 100, limit=10)
            assert early == [] and on_time == ["m1"], (
                f"OPS-2: a replayed record is due now (T0+100); due(T0+99) = {early!r}, due(T0+100) = {on_time!r}"
            )
            claimed = await b.inbox_claim(
                t.a, "m1", owner=OWNER_A, incarnation=INC_1, now=T0 + 100, lease_ms=LEASE_MS, recover=False
            )
            assert claimed is not None and claimed.attempts == 1 and claimed.token > 1, (
                "OPS-2: a replayed record is claimable now, as a first charged execution with a larger token; "
                f"got {_j(claimed)!r}"
            )
            leased = await b.inbox_get(t.a, "m1")
            refused = await b.inbox_replay(t.a, "m1", now=T0 + 101)
            after = await b.inbox_get(t.a, "m1")
            assert refused is None and _j(after) == _j(leased), (
                f"OPS-2: inbox_replay of a leased record returns None and changes nothing; it returned {_j(refused)!r} "
                f"and changed {_changes(leased, after)}"
            )
            absent = await b.inbox_replay(t.a, "nope", now=T0 + 101)
            assert absent is None, f"OPS-2: inbox_replay of an absent id returns None; got {_j(absent)!r}"
            assert await b.inbox_complete(t.a, "m1", token=claimed.token, now=T0 + 102, expires_at=None) is True
            again = await b.inbox_replay(t.a, "m1", now=T0 + 103)
            assert again is not None and again.state == "pending", (
                f"OPS-2: inbox_replay of a done record makes it pending again; got {_j(again)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_retry_send_of_a_dead_failed_or_unknown_send(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-2: ``outbox_retry`` makes a ``dead``, ``failed`` or ``unknown`` send
        ``pending`` now with its attempts reset; it is due and claimable at once. A
        ``sent``, ``sending`` or ``pending`` send, or an absent key, gives False and
        changes nothing."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            for key in ("k-dead", "k-failed", "k-unknown", "k-sent", "k-sending"):
                await b.outbox_journal(t.a, outbound(key))
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", next_at=T0 + 500))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 10_000, error="e") is True
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            assert await b.outbox_mark_sent(t.a, "k-sent", token=1, message_id="x", now=T0, expires_at=None) is True
            for key in ("k-dead", "k-failed", "k-unknown"):
                ok = await b.outbox_retry(t.a, key, now=T0 + 100)
                rec = await b.outbox_get(t.a, key)
                assert ok is True and rec is not None and rec.state == "pending" and rec.attempts == 0, (
                    f"OPS-2: outbox_retry of a {key[2:]} send makes it pending now with attempts reset; it returned "
                    f"{ok!r}, record {_j(rec)!r}"
                )
            due = await b.outbox_due(t.a, upto=T0 + 100, limit=100)
            assert sorted(due) == ["k-dead", "k-failed", "k-unknown"], (
                f"OPS-2: retried sends are due now (T0+100); outbox_due lists {due!r}"
            )
            for key in ("k-dead", "k-failed", "k-unknown"):
                got = await b.outbox_claim(
                    t.a, key, owner=OWNER_A, incarnation=INC_1, now=T0 + 100, lease_ms=LEASE_MS, recover=False
                )
                assert got is not None and got[0].attempts == 1 and got[0].token > 1, (
                    f"OPS-2: a retried send is claimable now, as a first attempt with a larger token; {key!r}: {got!r}"
                )
            for key in ("k-sent", "k-sending", "k-pending", "absent"):
                before = await b.outbox_get(t.a, key)
                ok = await b.outbox_retry(t.a, key, now=T0 + 100)
                after = await b.outbox_get(t.a, key)
                assert ok is False and _j(after) == _j(before), (
                    f"OPS-2: outbox_retry applies to dead, failed or unknown sends only; on {key!r} it returned {ok!r} "
                    f"and changed {_changes(before, after)}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_discard_forgets_a_send(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OPS-2: ``outbox_discard`` forgets a send entirely — gone from get, list and
        due — and returns True; a second discard returns False; the key can then be
        journaled anew."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-dead"))
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            await b.outbox_journal(t.a, outbound("k-keep", state="pending"))
            for key in ("k-dead", "k-pending"):
                ok = await b.outbox_discard(t.a, key)
                assert ok is True, f"OPS-2: outbox_discard of an existing send returns True; {key!r} returned {ok!r}"
                gone = await b.outbox_get(t.a, key)
                assert gone is None, f"OPS-2: a discarded send is forgotten; outbox_get({key!r}) returned {_j(gone)!r}"
                again = await b.outbox_discard(t.a, key)
                assert again is False, f"OPS-2: a second outbox_discard returns False; {key!r} returned {again!r}"
            listed = [r.key for r in await b.outbox_list(t.a)]
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert listed == ["k-keep"] and due == ["k-keep"], (
                f"OPS-2: discarded sends are gone from list and due; outbox_list = {listed!r}, outbox_due = {due!r}"
            )
            _, created = await b.outbox_journal(t.a, outbound("k-dead", state="pending"))
            assert created is True, f"OPS-2: a discarded key can be journaled anew; created={created!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-3", "INB-4")
    def test_ops3_inbox_purge_removes_only_expired_done_records(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-3: ``inbox_purge`` deletes up to ``limit`` ``done`` records whose
        ``expires_at <= now`` and returns how many; nothing else — not a done record
        expiring later or kept (``None``), not a leased, pending, dead or replayed one.
        A redelivery is recognised only while its record exists (INB-4)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            expiries = {"d1": T0 + 100, "d2": T0 + 200, "d3": T0 + 300, "d4": None, "r1": T0 + 100}
            for id, expires in expiries.items():
                await b.inbox_journal(t.a, inbound(id))
                assert await b.inbox_complete(t.a, id, token=1, now=T0, expires_at=expires) is True
            assert await b.inbox_replay(t.a, "r1", now=T0 + 1) is not None  # pending again: not purgeable
            await b.inbox_journal(t.a, inbound("l1"))
            await b.inbox_journal(t.a, inbound("p1"))
            assert await b.inbox_retry_later(t.a, "p1", token=1, next_at=T0 + 50, error="e") is True
            await b.inbox_journal(t.a, inbound("x1"))
            assert await b.inbox_kill(t.a, "x1", token=1, now=T0, error="e") is True
            before = {r.id: _j(r) for r in await b.inbox_list(t.a)}
            first = await b.inbox_purge(t.a, now=T0 + 250, limit=1)
            assert first == 1, f"OPS-3: inbox_purge(limit=1) deletes one of the two expired done records; it returned {first!r}"
            rest = await b.inbox_purge(t.a, now=T0 + 250, limit=100)
            assert rest == 1, f"OPS-3: the second inbox_purge deletes the other expired done record; it returned {rest!r}"
            after = {r.id: _j(r) for r in await b.inbox_list(t.a)}
            kept = {k: v for k, v in before.items() if k not in ("d1", "d2")}
            assert after == kept, (
                "OPS-3: inbox_purge deletes only done records whose expires_at <= now (d1, d2 at T0+250), nothing "
                f"else; expected ids {sorted(kept)!r}, got {sorted(after)!r}"
                + ("" if sorted(after) != sorted(kept) else "; a kept record changed")
            )
            none_left = await b.inbox_purge(t.a, now=T0 + 250, limit=100)
            assert none_left == 0, f"OPS-3: nothing else is purgeable at T0+250; inbox_purge returned {none_left!r}"
            _, created = await b.inbox_journal(t.a, inbound("d1", now=T0 + 300))
            assert created is True, (
                f"OPS-3/INB-4: a redelivery is recognised only while its record exists; after the purge the id is new, "
                f"created={created!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-3", "OUT-2")
    def test_ops3_outbox_purge_removes_only_expired_sent_records(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-3: ``outbox_purge`` deletes up to ``limit`` ``sent`` records whose
        ``expires_at <= now`` and returns how many; nothing else — not a sent record
        expiring later or kept (``None``), not a pending, sending, failed, dead or
        unknown one."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            expiries = {"s1": T0 + 100, "s2": T0 + 200, "s3": T0 + 300, "s4": None}
            for key, expires in expiries.items():
                await b.outbox_journal(t.a, outbound(key))
                assert await b.outbox_mark_sent(t.a, key, token=1, message_id=f"id-{key}", now=T0, expires_at=expires) is True
            await b.outbox_journal(t.a, outbound("k-pending", state="pending"))
            for key in ("k-sending", "k-failed", "k-dead", "k-unknown"):
                await b.outbox_journal(t.a, outbound(key))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 5, error="e") is True
            assert await b.outbox_mark_dead(t.a, "k-dead", token=1, now=T0, error="e") is True
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            before = {r.key: _j(r) for r in await b.outbox_list(t.a)}
            first = await b.outbox_purge(t.a, now=T0 + 200, limit=1)
            assert first == 1, f"OPS-3: outbox_purge(limit=1) deletes one of the two expired sent records; it returned {first!r}"
            rest = await b.outbox_purge(t.a, now=T0 + 200, limit=100)
            assert rest == 1, f"OPS-3: the second outbox_purge deletes the other expired sent record; it returned {rest!r}"
            after = {r.key: _j(r) for r in await b.outbox_list(t.a)}
            kept = {k: v for k, v in before.items() if k not in ("s1", "s2")}
            assert after == kept, (
                "OPS-3: outbox_purge deletes only sent records whose expires_at <= now (s1, s2 at T0+200, inclusive), "
                f"nothing else; expected keys {sorted(kept)!r}, got {sorted(after)!r}"
                + ("" if sorted(after) != sorted(kept) else "; a kept record changed")
            )
            none_left = await b.outbox_purge(t.a, now=T0 + 200, limit=100)
            assert none_left == 0, f"OPS-3: nothing else is purgeable at T0+200; outbox_purge returned {none_left!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

