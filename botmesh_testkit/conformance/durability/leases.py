"""LEASE — leases and fencing, for both journals: a claim leases until ``now + lease_ms``;
heartbeats extend and never shorten (LEASE-1); only expired leases are taken, with a
strictly larger fencing token; every fenced operation with a stale token is refused and
changes nothing (LEASE-2); the recovery claim of a restarted incarnation (LEASE-4);
concurrent claims have exactly one winner (REPL-1).

Most tests hold for the inbox and the outbox alike: they run once per journal
(``JOURNALS``) through :class:`_Journal`, one vocabulary over both."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest
from botmesh.core.backend import DurabilityBackend
from botmesh.core.records import InboxRecord, OutboxRecord

from .base import FAR, INC_1, INC_2, INF, LEASE_MS, OWNER_A, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _changes, _j, _when, inbound, outbound


class _Journal:
    """The inbox or the outbox of a backend, with one vocabulary: ``journal`` a record
    leased to its owner, ``claim``, ``heartbeat``, ``settle`` (complete / mark sent),
    ``fenced`` (every fenced operation with a token)."""

    def __init__(self, backend: DurabilityBackend, kind: str) -> None:
        self.b = backend
        self.kind = kind
        self.leased = "leased" if kind == "inbox" else "sending"
        self.settled = "done" if kind == "inbox" else "sent"

    async def journal(
        self, scope: str, id: str, *, owner: str = OWNER_A, incarnation: str = INC_1, now: float = T0,
        lease_ms: float = LEASE_MS,
    ) -> Any:
        stored: InboxRecord | OutboxRecord
        if self.kind == "inbox":
            stored, _ = await self.b.inbox_journal(
                scope, inbound(id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms)
            )
        else:
            stored, _ = await self.b.outbox_journal(
                scope, outbound(id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms)
            )
        return stored

    async def claim(
        self, scope: str, id: str, *, owner: str, incarnation: str, now: float, lease_ms: float = LEASE_MS,
        recover: bool = False,
    ) -> Any:
        if self.kind == "inbox":
            return await self.b.inbox_claim(
                scope, id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms, recover=recover
            )
        got = await self.b.outbox_claim(
            scope, id, owner=owner, incarnation=incarnation, now=now, lease_ms=lease_ms, recover=recover
        )
        return None if got is None else got[0]

    async def heartbeat(self, scope: str, id: str, *, token: int, lease_until: float) -> bool:
        if self.kind == "inbox":
            return await self.b.inbox_heartbeat(scope, id, token=token, lease_until=lease_until)
        return await self.b.outbox_heartbeat(scope, id, token=token, lease_until=lease_until)

    async def settle(self, scope: str, id: str, *, token: int, now: float) -> bool:
        if self.kind == "inbox":
            return await self.b.inbox_complete(scope, id, token=token, now=now, expires_at=None)
        return await self.b.outbox_mark_sent(scope, id, token=token, message_id=f"msg-{id}", now=now, expires_at=None)

    async def get(self, scope: str, id: str) -> Any:
        return await (self.b.inbox_get(scope, id) if self.kind == "inbox" else self.b.outbox_get(scope, id))

    async def due(self, scope: str, *, upto: float, limit: int = 100) -> list[str]:
        if self.kind == "inbox":
            return await self.b.inbox_due(scope, upto=upto, limit=limit)
        return await self.b.outbox_due(scope, upto=upto, limit=limit)

    def fenced(self, scope: str, id: str, token: int, now: float) -> list[tuple[str, Callable[[], Awaitable[bool]]]]:
        """Every fenced operation of this journal with ``token``, by name."""
        b = self.b
        if self.kind == "inbox":
            return [
                ("inbox_heartbeat", lambda: b.inbox_heartbeat(scope, id, token=token, lease_until=FAR)),
                ("inbox_complete", lambda: b.inbox_complete(scope, id, token=token, now=now, expires_at=now)),
                ("inbox_retry_later", lambda: b.inbox_retry_later(scope, id, token=token, next_at=now, error="stale")),
                ("inbox_kill", lambda: b.inbox_kill(scope, id, token=token, now=now, error="stale")),
            ]
        return [
            ("outbox_heartbeat", lambda: b.outbox_heartbeat(scope, id, token=token, lease_until=FAR)),
            ("outbox_mark_sent", lambda: b.outbox_mark_sent(scope, id, token=token, message_id="stale", now=now, expires_at=now)),
            ("outbox_mark_failed", lambda: b.outbox_mark_failed(scope, id, token=token, next_at=now, error="stale")),
            ("outbox_mark_dead", lambda: b.outbox_mark_dead(scope, id, token=token, now=now, error="stale")),
            ("outbox_mark_unknown", lambda: b.outbox_mark_unknown(scope, id, token=token, now=now)),
            ("outbox_split", lambda: b.outbox_split(scope, id, token=token, content={"type": "text", "text": "stale"})),
        ]


JOURNALS = ("inbox", "outbox")



class LeaseTests(DurabilitySuiteBase):
    """The lease and fencing tests (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("LEASE-1")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease1_claim_leases_until_now_plus_lease_ms(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-1: a claim leases the record to ``owner`` (and ``incarnation``) until
        ``now + lease_ms``; the record is due again exactly at that time."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            await j.journal(t.a, "r1", lease_ms=LEASE_MS)
            got = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS + 100, lease_ms=30_000)
            until = T0 + LEASE_MS + 100 + 30_000
            assert got is not None, f"LEASE-1/LEASE-2: the claim of an expired {journal} lease must succeed; got None"
            assert (got.state, got.owner, got.incarnation, got.lease_until) == (j.leased, OWNER_B, INC_2, until), (
                f"LEASE-1: a claim leases the {journal} record to owner/incarnation until now + lease_ms "
                f"({_when(until)}); got state={got.state!r}, owner={got.owner!r}, incarnation={got.incarnation!r}, "
                f"lease_until={got.lease_until!r}"
            )
            stored = await j.get(t.a, "r1")
            assert _j(stored) == _j(got), f"LEASE-1: the claim returns the stored record; differs in {_changes(got, stored)}"
            before = await j.due(t.a, upto=until - 1)
            at = await j.due(t.a, upto=until)
            assert before == [] and at == ["r1"], (
                f"LEASE-1: a leased {journal} record is due at its lease_until, not before; "
                f"due({_when(until - 1)}) = {before!r}, due({_when(until)}) = {at!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-1", "REPL-3")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease1_heartbeat_extends_the_lease_and_never_shortens_it(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-1, REPL-3: a heartbeat with the lease's token extends ``lease_until``:
        the record is no longer due at the old deadline and nobody else can claim it
        there; a heartbeat with an earlier deadline never shortens the lease."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            await j.journal(t.a, "r1")  # lease until T0+60000
            ok = await j.heartbeat(t.a, "r1", token=1, lease_until=T0 + 90_000)
            assert ok is True, f"LEASE-1: a {journal} heartbeat with the lease's token must return True; got {ok!r}"
            rec = await j.get(t.a, "r1")
            assert rec is not None and rec.lease_until == T0 + 90_000, (
                f"LEASE-1: a heartbeat extends lease_until to T0+90000; got {getattr(rec, 'lease_until', None)!r}"
            )
            old = await j.due(t.a, upto=T0 + LEASE_MS)
            assert old == [], f"LEASE-1: after a heartbeat the record is not due at the old deadline; due lists {old!r}"
            stolen = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS)
            assert stolen is None, (
                f"LEASE-1/REPL-3: a lease extended by heartbeat cannot be claimed at the old deadline; got {_j(stolen)!r}"
            )
            await j.heartbeat(t.a, "r1", token=1, lease_until=T0 + 70_000)
            after = await j.get(t.a, "r1")
            assert after is not None and after.lease_until == T0 + 90_000, (
                "LEASE-1: a heartbeat never shortens a lease: after a heartbeat to T0+70000 the lease must stay "
                f"until T0+90000; got lease_until={getattr(after, 'lease_until', None)!r}"
            )
            early = await j.due(t.a, upto=T0 + 89_999)
            assert early == [], f"LEASE-1: a heartbeat never shortens a lease; due(T0+89999) lists {early!r}"
            stolen = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + 89_999)
            assert stolen is None, f"LEASE-1: a heartbeat never shortens a lease; a claim at T0+89999 returned {_j(stolen)!r}"
            due = await j.due(t.a, upto=T0 + 90_000)
            assert due == ["r1"], f"LEASE-1: the extended lease is due at its new lease_until; due lists {due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2", "REPL-1")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease2_an_unexpired_lease_is_never_claimed(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-2, REPL-1: while ``now < lease_until`` nobody claims the record —
        another owner (with or without ``recover``), or the holder's own incarnation —
        and a refused claim changes nothing."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1")
            attempts = [
                (OWNER_B, INC_2, T0, False),
                (OWNER_B, INC_2, T0 + LEASE_MS - 1, False),
                (OWNER_B, INC_2, T0 + LEASE_MS - 1, True),
                (OWNER_A, INC_1, T0 + LEASE_MS - 1, True),
            ]
            for owner, inc, now, recover in attempts:
                got = await j.claim(t.a, "r1", owner=owner, incarnation=inc, now=now, recover=recover)
                assert got is None, (
                    f"LEASE-2: an unexpired {journal} lease (until T0+60000) must not be claimed; a claim by "
                    f"{owner}/{inc} at {_when(now)} (recover={recover}) returned {_j(got)!r}"
                )
                after = await j.get(t.a, "r1")
                assert _j(after) == _j(rec), f"LEASE-2: a refused claim changes nothing; it changed {_changes(rec, after)}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease2_an_expired_lease_is_taken_over_with_a_larger_token(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-2: when a lease expires (``lease_until <= now``) another owner takes
        the record with a new, larger fencing token; and so on, each takeover with a
        larger token."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1")
            owners = [(OWNER_B, INC_2), (OWNER_A, INC_1), (OWNER_B, "incarnation-3")]
            for owner, inc in owners:
                now = rec.lease_until
                got = await j.claim(t.a, "r1", owner=owner, incarnation=inc, now=now)
                assert got is not None, (
                    f"LEASE-2: an expired {journal} lease (lease_until {_when(now)} <= now {_when(now)}) must be "
                    f"taken by another owner; the claim by {owner} returned None"
                )
                assert got.owner == owner and got.state == j.leased, (
                    f"LEASE-2: the takeover leases the record to the new owner {owner!r}; got {_j(got)!r}"
                )
                assert got.token > rec.token, (
                    f"LEASE-2: every new lease carries a larger fencing token; token went from {rec.token!r} to {got.token!r}"
                )
                rec = got

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2")
    def test_lease2_inbox_tokens_grow_across_every_claim(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """LEASE-2: an inbox record's fencing token grows strictly with every claim —
        after a takeover, a retry later, a kill and an operator replay, a completion and
        a replay: a replay never resets it."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            seen = [(await b.inbox_journal(t.a, inbound("m1")))[0].token]

            async def claim(now: float, why: str) -> InboxRecord:
                got = await b.inbox_claim(t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=now, lease_ms=LEASE_MS, recover=False)
                assert got is not None, f"LEASE-2: setting up: the claim {why} at {_when(now)} must succeed; got None"
                assert got.token > max(seen), (
                    f"LEASE-2: fencing tokens grow strictly with every claim; the claim {why} got token {got.token!r} "
                    f"after tokens {seen!r}"
                )
                seen.append(got.token)
                return got

            rec = await claim(T0 + LEASE_MS, "after the lease expired")
            assert await b.inbox_retry_later(t.a, "m1", token=rec.token, next_at=T0 + 70_000, error="e") is True
            rec = await claim(T0 + 70_000, "after retry_later")
            assert await b.inbox_kill(t.a, "m1", token=rec.token, now=T0 + 70_001, error="e") is True
            assert await b.inbox_replay(t.a, "m1", now=T0 + 70_002) is not None
            rec = await claim(T0 + 70_002, "after kill and replay")
            assert await b.inbox_complete(t.a, "m1", token=rec.token, now=T0 + 70_003, expires_at=None) is True
            assert await b.inbox_replay(t.a, "m1", now=T0 + 70_004) is not None
            await claim(T0 + 70_004, "after complete and replay")

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2")
    def test_lease2_outbox_tokens_grow_across_every_claim(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """LEASE-2: an outbox record's fencing token grows strictly with every claim —
        of an enqueued send, after a failure, after ``unknown`` and ``dead`` and an
        operator retry, after an expired lease: a retry never resets it."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            seen = [(await b.outbox_journal(t.a, outbound("k1", state="pending", next_at=T0)))[0].token]

            async def claim(now: float, why: str) -> OutboxRecord:
                got = await b.outbox_claim(t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=now, lease_ms=LEASE_MS, recover=False)
                assert got is not None, f"LEASE-2: setting up: the claim {why} at {_when(now)} must succeed; got None"
                assert got[0].token > max(seen), (
                    f"LEASE-2: fencing tokens grow strictly with every claim; the claim {why} got token {got[0].token!r} "
                    f"after tokens {seen!r}"
                )
                seen.append(got[0].token)
                return got[0]

            rec = await claim(T0, "of an enqueued send")
            assert await b.outbox_mark_failed(t.a, "k1", token=rec.token, next_at=T0 + 1_000, error="e") is True
            rec = await claim(T0 + 1_000, "after mark_failed")
            assert await b.outbox_mark_unknown(t.a, "k1", token=rec.token, now=T0 + 1_001) is True
            assert await b.outbox_retry(t.a, "k1", now=T0 + 1_002) is True
            rec = await claim(T0 + 1_002, "after unknown and retry")
            assert await b.outbox_mark_dead(t.a, "k1", token=rec.token, now=T0 + 1_003, error="e") is True
            assert await b.outbox_retry(t.a, "k1", now=T0 + 1_004) is True
            rec = await claim(T0 + 1_004, "after dead and retry")
            await claim(cast(float, rec.lease_until), "after the lease expired")  # a claimed send has a lease_until

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-2", "REPL-1")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease2_a_stale_token_is_refused_and_changes_nothing(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-2, REPL-1: after another owner took the record over, every fenced
        operation of the old owner (its token) returns False and changes nothing — so
        does a token from the future; the new owner's token works. Once settled, no
        fenced operation applies, even with the current token."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            await j.journal(t.a, "r1")
            taken = await j.claim(t.a, "r1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS)
            assert taken is not None, f"LEASE-2: setting up: the takeover of an expired {journal} lease must succeed"
            due = await j.due(t.a, upto=INF)
            for stale in (taken.token - 1, taken.token + 1):
                for name, call in j.fenced(t.a, "r1", stale, T0 + LEASE_MS + 1):
                    ok = await call()
                    assert ok is False, (
                        f"LEASE-2: {name} with a stale fencing token ({stale}; the lease's is {taken.token}) must be "
                        f"refused and return False; it returned {ok!r}"
                    )
                    after = await j.get(t.a, "r1")
                    assert _j(after) == _j(taken), (
                        f"LEASE-2: {name} with a stale fencing token ({stale}) must change nothing; it changed "
                        f"{_changes(taken, after)}"
                    )
                    now_due = await j.due(t.a, upto=INF)
                    assert now_due == due, f"LEASE-2: {name} with a stale token changed what is due: {due!r} -> {now_due!r}"
            ok = await j.settle(t.a, "r1", token=taken.token, now=T0 + LEASE_MS + 2)
            assert ok is True, f"LEASE-2: the new owner's token must work; settling with it returned {ok!r}"
            settled = await j.get(t.a, "r1")
            for name, call in j.fenced(t.a, "r1", taken.token, T0 + LEASE_MS + 3):
                ok = await call()
                after = await j.get(t.a, "r1")
                assert ok is False and _j(after) == _j(settled), (
                    f"LEASE-2: fenced operations apply only while the record is leased; {name} on a "
                    f"{settled.state} record returned {ok!r} and changed {_changes(settled, after)}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("LEASE-4")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_lease4_a_restarted_incarnation_recovers_its_own_lease_at_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """LEASE-4: with ``recover``, the same ``owner`` under another ``incarnation``
        takes back its unexpired lease at once, with a larger token; not without
        ``recover``, not under the same incarnation, never another owner. The dead
        incarnation's token is then stale."""

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1", owner=OWNER_A, incarnation=INC_1)
            refused = [
                (OWNER_A, INC_2, False, "without recover"),
                (OWNER_A, INC_1, True, "by the same incarnation"),
                (OWNER_B, INC_2, True, "by another owner"),
            ]
            for owner, inc, recover, why in refused:
                got = await j.claim(t.a, "r1", owner=owner, incarnation=inc, now=T0 + 1, recover=recover)
                assert got is None, (
                    f"LEASE-4: an unexpired {journal} lease is not recovered {why}; the claim returned {_j(got)!r}"
                )
            got = await j.claim(t.a, "r1", owner=OWNER_A, incarnation=INC_2, now=T0 + 1, recover=True)
            assert got is not None, (
                f"LEASE-4: the same owner under another incarnation must recover its unexpired {journal} lease at once "
                "(recover=True); the claim returned None"
            )
            assert (
                (got.owner, got.incarnation, got.lease_until) == (OWNER_A, INC_2, T0 + 1 + LEASE_MS) and got.token > rec.token
            ), (
                "LEASE-4: the recovered lease belongs to the new incarnation until now + lease_ms with a larger token; "
                f"got owner={got.owner!r}, incarnation={got.incarnation!r}, lease_until={got.lease_until!r}, "
                f"token {rec.token!r} -> {got.token!r}"
            )
            ok = await j.settle(t.a, "r1", token=rec.token, now=T0 + 2)
            assert ok is False, (
                f"LEASE-4/LEASE-2: the dead incarnation's token is stale after the recovery; settling returned {ok!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("REPL-1", "LEASE-2")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_repl1_concurrent_claims_have_exactly_one_winner(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """REPL-1: many owners claiming one expired lease at the same time: exactly one
        gets it (the stored owner is the winner, with a larger token); twice in a
        row."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            j = _Journal(t.backend, journal)
            rec = await j.journal(t.a, "r1")
            for round_ in (1, 2):
                now = rec.lease_until
                results = await asyncio.gather(
                    *(j.claim(t.a, "r1", owner=f"owner-{round_}-{i}", incarnation=f"inc-{i}", now=now) for i in range(n))
                )
                winners = [r for r in results if r is not None]
                assert winners, (
                    f"LEASE-2: an expired {journal} lease must be taken by one of {n} concurrent claimers; none got it"
                )
                assert len(winners) == 1, (
                    f"REPL-1: two replicas never claim the same record: {n} concurrent claims of one expired {journal} "
                    f"lease must have exactly one winner; {len(winners)} claims returned a record "
                    f"(owners {[w.owner for w in winners]!r})"
                )
                stored = await j.get(t.a, "r1")
                assert stored is not None and stored.owner == winners[0].owner and stored.token == winners[0].token, (
                    f"REPL-1: the stored lease is the winner's ({winners[0].owner!r}, token {winners[0].token}); "
                    f"got {_j(stored)!r}"
                )
                assert stored.token > rec.token, (
                    f"LEASE-2: the winner's token must be larger than {rec.token}; got {stored.token}"
                )
                rec = stored

        self.run_backend(botmesh_harness_factory, tmp_path, body)

