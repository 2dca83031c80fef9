"""INB — the inbox of the durability suite: journaling is create-if-absent and returns
the stored record on a redelivery (INB-1, INB-4, also under concurrency), completion
(INB-2), what is due after a crash and in which order (INB-3), retry later (INB-5),
charged executions and the DLQ (INB-7)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from .base import FAR, INC_1, INC_2, INF, LEASE_MS, OWNER_A, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _changes, _j, _when, inbound


class InboxTests(DurabilitySuiteBase):
    """The inbox tests (a mixin of :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("INB-1")
    def test_inb1_journal_stores_the_inbound_record_as_given(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-1: ``inbox_journal`` of a new id creates the record and returns it with
        ``created=True``; ``inbox_get`` and ``inbox_list`` then return exactly the record
        journaled — every field, the event payload, and fields unknown to this version
        (records keep them on read)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            rec = inbound("m1", text="héllo ✓ 🤖 \"quoted\" \\ \n")
            rec.event["data"] = {"n": [1, 2.5, None, True], "nested": {"k": "v"}}
            rec.event["media"] = {"v": 1, "data": {"file_id": "f-1"}}
            rec.extra = {"x_future_field": {"kept": [1, "two"]}}
            absent = await b.inbox_get(t.a, "m1")
            assert absent is None, f"INB-1: inbox_get of an id never journaled must return None; got {absent!r}"
            stored, created = await b.inbox_journal(t.a, rec)
            assert created is True, f"INB-1: inbox_journal of a new id must create it and return created=True; got {created!r}"
            assert _j(stored) == _j(rec), (
                f"INB-1: inbox_journal of a new id returns the record journaled; it differs in {_changes(rec, stored)}"
            )
            got = await b.inbox_get(t.a, "m1")
            assert _j(got) == _j(rec), (
                "INB-1: the journaled record must be readable before any handler runs, exactly as journaled "
                f"(every field, unknown ones included); inbox_get differs in {_changes(rec, got)}"
            )
            listed = await b.inbox_list(t.a)
            assert [_j(r) for r in listed] == [_j(rec)], (
                f"INB-1: inbox_list must list the journaled record exactly; got {[_j(r) for r in listed]!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-4")
    def test_inb4_journal_of_an_existing_id_returns_the_stored_record(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-4: journaling an id that exists returns the stored record and
        ``created=False`` and changes nothing — while it is leased and after it is
        done."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            first = inbound("m1", text="first")
            await b.inbox_journal(t.a, first)
            again = inbound("m1", chat_id="chat-2", text="redelivered", owner=OWNER_B, incarnation=INC_2, now=T0 + 5)
            stored, created = await b.inbox_journal(t.a, again)
            assert created is False, (
                f"INB-4: inbox_journal of an id that exists must return created=False (a redelivery); got {created!r}"
            )
            assert _j(stored) == _j(first), (
                "INB-4: inbox_journal of an id that exists must return the stored record, not the new one; "
                f"it differs from the stored one in {_changes(first, stored)}"
            )
            got = await b.inbox_get(t.a, "m1")
            assert _j(got) == _j(first), (
                f"INB-4: a redelivery must not change the stored record; it changed {_changes(first, got)}"
            )
            assert await b.inbox_complete(t.a, "m1", token=1, now=T0 + 10, expires_at=None) is True, (
                "INB-4: inbox_complete with the record's token must succeed (setting up the done record)"
            )
            done = await b.inbox_get(t.a, "m1")
            stored, created = await b.inbox_journal(t.a, again)
            assert created is False and _j(stored) == _j(done), (
                "INB-4: inbox_journal of an id whose record is done must return (the done record, False); "
                f"got created={created!r}, record differing in {_changes(done, stored)}"
            )
            after = await b.inbox_get(t.a, "m1")
            assert _j(after) == _j(done), (
                f"INB-4: a redelivery must not change a done record; it changed {_changes(done, after)}"
            )
            count = len(await b.inbox_list(t.a))
            assert count == 1, f"INB-4: one id is one record; inbox_list shows {count}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-4", "REPL-1")
    def test_inb4_concurrent_journals_of_one_id_create_it_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-4, REPL-1: the same inbound event journaled by many tasks at once is
        created exactly once; every other call gets the stored (winning) record and
        ``created=False``."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            records = [inbound("m1", text=f"copy {i}", owner=f"owner-{i}") for i in range(n)]
            outcomes = await asyncio.gather(*(b.inbox_journal(t.a, r) for r in records))
            created = [i for i, (_, c) in enumerate(outcomes) if c]
            assert len(created) == 1, (
                f"INB-4/REPL-1: {n} concurrent inbox_journal calls of one id must create it exactly once; "
                f"{len(created)} returned created=True"
            )
            stored = await b.inbox_get(t.a, "m1")
            assert _j(stored) == _j(records[created[0]]), (
                f"INB-4: the stored record must be the one whose journal returned created=True; differs in "
                f"{_changes(records[created[0]], stored)}"
            )
            wrong = [i for i, (r, _) in enumerate(outcomes) if _j(r) != _j(stored)]
            assert not wrong, (
                f"INB-4: every concurrent journal of an existing id must return the stored record; calls {wrong} "
                "returned another one"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-2")
    def test_inb2_complete_marks_the_record_done(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-2: ``inbox_complete`` with the lease's token marks the record ``done``; a
        done record is no longer due, is listed as done, and no fenced operation applies
        to it any more (a second completion returns False)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))
            ok = await b.inbox_complete(t.a, "m1", token=1, now=T0 + 5, expires_at=T0 + 1000)
            assert ok is True, f"INB-2: inbox_complete with the current lease's token must return True; got {ok!r}"
            done = await b.inbox_get(t.a, "m1")
            assert done is not None and done.state == "done", (
                f"INB-2: inbox_complete marks the record done; its state is {getattr(done, 'state', None)!r}"
            )
            assert done.id == "m1" and done.token == 1 and done.event == inbound("m1").event, (
                f"INB-2: inbox_complete changes the state, not the record's identity; got {_j(done)!r}"
            )
            due = await b.inbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"INB-2: a done record is settled: it must not be due; inbox_due lists {due!r}"
            listed = [r.id for r in await b.inbox_list(t.a, state="done")]
            assert listed == ["m1"], f"INB-2: inbox_list(state='done') must list it; got {listed!r}"
            again = await b.inbox_complete(t.a, "m1", token=1, now=T0 + 6, expires_at=None)
            assert again is False, (
                f"INB-2: inbox_complete of a record that is no longer leased must return False; got {again!r}"
            )
            after = await b.inbox_get(t.a, "m1")
            assert _j(after) == _j(done), f"INB-2: a refused completion changes nothing; it changed {_changes(done, after)}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-3", "INB-5")
    def test_inb3_unfinished_records_are_due_earliest_first(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-3: ``inbox_due`` lists the ids of the unfinished records — ``leased``
        (at their ``lease_until``) and ``pending`` (at their ``next_at``) — whose time is
        ``<= upto`` (inclusive), earliest first, up to ``limit``; never a ``done`` or
        ``dead`` one. The ids are chosen so that id order is the reverse of time order."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m3", lease_ms=60_000))  # due T0+60000
            await b.inbox_journal(t.a, inbound("m5", lease_ms=30_000))  # due T0+30000
            await b.inbox_journal(t.a, inbound("m9"))
            assert await b.inbox_retry_later(t.a, "m9", token=1, next_at=T0 + 5_000, error="e") is True  # due T0+5000
            await b.inbox_journal(t.a, inbound("m1"))
            assert await b.inbox_complete(t.a, "m1", token=1, now=T0, expires_at=None) is True
            await b.inbox_journal(t.a, inbound("m2"))
            assert await b.inbox_kill(t.a, "m2", token=1, now=T0, error="e") is True
            cases: list[tuple[float, int, list[str]]] = [
                (INF, 100, ["m9", "m5", "m3"]),
                (T0 + 4_999, 100, []),
                (T0 + 5_000, 100, ["m9"]),
                (T0 + 29_999, 100, ["m9"]),
                (T0 + 30_000, 100, ["m9", "m5"]),
                (T0 + 60_000, 100, ["m9", "m5", "m3"]),
                (INF, 2, ["m9", "m5"]),
                (INF, 1, ["m9"]),
            ]
            for upto, limit, expected in cases:
                got = await b.inbox_due(t.a, upto=upto, limit=limit)
                assert got == expected, (
                    "INB-3: inbox_due lists the ids of leased/pending records whose lease or retry time is <= upto, "
                    f"earliest first, up to limit (never done or dead ones); upto={_when(upto)}, limit={limit}: "
                    f"expected {expected!r}, got {got!r}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-5")
    def test_inb5_retry_later_makes_the_record_pending_until_next_at(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-5: ``inbox_retry_later`` moves a leased record to ``pending`` with its
        ``next_at`` and error; it is due, and claimable, only from ``next_at`` on; the
        claim then leases it with a larger token."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m1"))
            ok = await b.inbox_retry_later(t.a, "m1", token=1, next_at=T0 + 5_000, error="store down")
            assert ok is True, f"INB-5: inbox_retry_later with the lease's token must return True; got {ok!r}"
            rec = await b.inbox_get(t.a, "m1")
            assert rec is not None and (rec.state, rec.next_at, rec.error) == ("pending", T0 + 5_000, "store down"), (
                "INB-5: inbox_retry_later makes the record pending until next_at with the error; got "
                f"state={getattr(rec, 'state', None)!r}, next_at={getattr(rec, 'next_at', None)!r}, "
                f"error={getattr(rec, 'error', None)!r}"
            )
            early = await b.inbox_due(t.a, upto=T0 + 4_999, limit=10)
            assert early == [], f"INB-5: a pending record is not due before next_at; inbox_due(T0+4999) lists {early!r}"
            on_time = await b.inbox_due(t.a, upto=T0 + 5_000, limit=10)
            assert on_time == ["m1"], f"INB-5: a pending record is due at next_at; inbox_due(T0+5000) lists {on_time!r}"
            claimed = await b.inbox_claim(
                t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=T0 + 4_999, lease_ms=LEASE_MS, recover=False
            )
            assert claimed is None, f"INB-5: a pending record is not claimable before next_at; the claim returned {_j(claimed)!r}"
            unchanged = await b.inbox_get(t.a, "m1")
            assert _j(unchanged) == _j(rec), f"INB-5: a refused claim changes nothing; it changed {_changes(rec, unchanged)}"
            claimed = await b.inbox_claim(
                t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=T0 + 5_000, lease_ms=LEASE_MS, recover=False
            )
            assert claimed is not None and claimed.state == "leased" and claimed.owner == OWNER_B, (
                f"INB-5: a pending record is claimable at next_at (leased to the claimer); the claim returned {_j(claimed)!r}"
            )
            assert claimed.token > 1 and claimed.lease_until == T0 + 5_000 + LEASE_MS, (
                "INB-5/LEASE-2: the claim of a pending record gives a larger token and lease_until = now + lease_ms; "
                f"got token {claimed.token!r}, lease_until {claimed.lease_until!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-7")
    def test_inb7_every_claim_charges_one_execution(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-7: an execution is charged when it is claimed: ``attempts`` grows by one
        with every claim (takeover of an expired lease, recovery, claim of a pending
        record) and by nothing else (retry later, heartbeat, kill)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            rec = (await b.inbox_journal(t.a, inbound("m1")))[0]
            assert rec.attempts == 1
            now = T0
            for expected in (2, 3, 4):
                now = cast(float, rec.lease_until)  # set by the journal and by every claim
                got = await b.inbox_claim(t.a, "m1", owner=OWNER_B, incarnation=INC_2, now=now, lease_ms=LEASE_MS, recover=False)
                assert got is not None and got.attempts == expected, (
                    f"INB-7: every claim charges one execution: attempts must be {expected} after this claim; got "
                    f"{getattr(got, 'attempts', None)!r} (record {_j(got)!r})"
                )
                rec = got
            assert await b.inbox_heartbeat(t.a, "m1", token=rec.token, lease_until=now + 2 * LEASE_MS) is True
            assert await b.inbox_retry_later(t.a, "m1", token=rec.token, next_at=now + 10, error="e") is True
            pending = await b.inbox_get(t.a, "m1")
            assert pending is not None and pending.attempts == 4, (
                f"INB-7: only claims charge executions: heartbeat and retry_later keep attempts at 4; got {_j(pending)!r}"
            )
            got = await b.inbox_claim(t.a, "m1", owner=OWNER_A, incarnation=INC_1, now=now + 10, lease_ms=LEASE_MS, recover=False)
            assert got is not None and got.attempts == 5, (
                f"INB-7: the claim of a pending record charges one execution (attempts 5); got {_j(got)!r}"
            )
            assert await b.inbox_kill(t.a, "m1", token=got.token, now=now + 20, error="poison") is True
            dead = await b.inbox_get(t.a, "m1")
            assert dead is not None and dead.attempts == 5, f"INB-7: kill keeps attempts; got {_j(dead)!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-7", "INB-5", "OPS-2")
    def test_inb7_kill_moves_the_record_to_the_dlq(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """INB-7, INB-5: ``inbox_kill`` moves a record to ``dead`` (the DLQ) with its
        error: fenced with a token, unconditional with ``None`` for any record not done;
        a dead record is listed as dead (OPS-2), never due and never claimed."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            for id in ("m1", "m2", "m3"):
                await b.inbox_journal(t.a, inbound(id))
            ok = await b.inbox_kill(t.a, "m1", token=1, now=T0 + 1, error="poison message")
            assert ok is True, f"INB-7: inbox_kill with the lease's token must return True; got {ok!r}"
            dead = await b.inbox_get(t.a, "m1")
            assert dead is not None and dead.state == "dead" and dead.error == "poison message", (
                f"INB-7: inbox_kill moves the record to dead with its error; got {_j(dead)!r}"
            )
            ok = await b.inbox_kill(t.a, "m2", token=None, now=T0 + 1, error="operator")
            assert ok is True, f"INB-7: inbox_kill with token=None moves any record not done to dead; got {ok!r}"
            assert await b.inbox_complete(t.a, "m3", token=1, now=T0, expires_at=None) is True
            done = await b.inbox_get(t.a, "m3")
            refused = await b.inbox_kill(t.a, "m3", token=None, now=T0 + 1, error="operator")
            after = await b.inbox_get(t.a, "m3")
            assert refused is False and _j(after) == _j(done), (
                f"INB-7: inbox_kill never moves a done record; it returned {refused!r} and changed {_changes(done, after)}"
            )
            listed = [r.id for r in await b.inbox_list(t.a, state="dead")]
            assert listed == ["m1", "m2"], f"OPS-2: inbox_list(state='dead') must list the DLQ by id; got {listed!r}"
            due = await b.inbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"INB-7: a dead record is never due; inbox_due lists {due!r}"
            for owner, inc, recover in ((OWNER_A, INC_2, True), (OWNER_B, INC_2, False)):
                got = await b.inbox_claim(t.a, "m1", owner=owner, incarnation=inc, now=FAR, lease_ms=LEASE_MS, recover=recover)
                assert got is None, f"INB-7: a dead record is never claimed; a claim returned {_j(got)!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

