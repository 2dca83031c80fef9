"""OUT — the outbox of the durability suite: the journal keyed by idempotency key, every
field stored as given (content with base64 bytes, fingerprint, part links: OUT-1, OUT-5,
OUT-12, OUT-15), ``sent`` with the message id and staying sent (OUT-1, OUT-2), enqueued
sends and their due time (OUT-10), failures with a retry time (OUT-7), the DLQ (OUT-8),
split (OUT-13), ambiguity after an expired send lease and ``unknown`` (OUT-14)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from .base import FAR, INC_1, INC_2, INF, LEASE_MS, OWNER_A, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _changes, _j, _when, inbound, outbound


class OutboxTests(DurabilitySuiteBase):
    """The outbox tests (a mixin of :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("OUT-1", "OUT-5", "OUT-12", "OUT-15")
    def test_out1_journal_stores_the_send_as_given(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-1, OUT-5, OUT-12, OUT-15: ``outbox_journal`` of a new key creates the
        record and returns it with ``created=True``; ``outbox_get`` returns exactly
        what was journaled — the content as JSON with bytes as base64, the fingerprint,
        the part link, unknown fields. A record journaled ``sending`` is leased to its
        owner at once: nobody else can claim it."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            photo = {"type": "image", "image": {"$bytes": "iVBORw0KGgo="}, "caption": "héllo ✓ 🤖"}
            first = outbound("m1:1", content=photo)
            first.rule, first.inbound_id, first.fingerprint = "derived", "m1", "sha256:" + "ab" * 32
            first.extra = {"x_future_field": [1, {"kept": True}]}
            second = outbound("m1:1#2", state="pending", text="part two", previous_part="m1:1", part=2, seq=2)
            for rec in (first, second):
                absent = await b.outbox_get(t.a, rec.key)
                assert absent is None, f"OUT-1: outbox_get of a key never journaled must return None; got {absent!r}"
                stored, created = await b.outbox_journal(t.a, rec)
                assert created is True, f"OUT-1: outbox_journal of a new key must return created=True; got {created!r}"
                assert _j(stored) == _j(rec), (
                    f"OUT-1: outbox_journal returns the record journaled; differs in {_changes(rec, stored)}"
                )
                got = await b.outbox_get(t.a, rec.key)
                assert _j(got) == _j(rec), (
                    "OUT-1: a send is journaled before the provider is called, exactly as given (content with bytes "
                    f"as base64, fingerprint, part link, unknown fields); outbox_get of {rec.key!r} differs in "
                    f"{_changes(rec, got)}"
                )
            stolen = await b.outbox_claim(
                t.a, "m1:1", owner=OWNER_B, incarnation=INC_2, now=T0 + 1, lease_ms=LEASE_MS, recover=True
            )
            assert stolen is None, (
                f"OUT-1: a record journaled in state sending is leased to its owner; another owner's claim returned {stolen!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-1")
    def test_out1_mark_sent_stores_the_message_id(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-1: right after the provider answers, ``outbox_mark_sent`` with the lease's
        token records the provider's message id and state ``sent`` — for an inline send
        and for a claimed enqueued one; a sent record is listed as sent and never
        due."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-inline"))
            await b.outbox_journal(t.a, outbound("k-queued", state="pending"))
            claim = await b.outbox_claim(
                t.a, "k-queued", owner=OWNER_A, incarnation=INC_1, now=T0, lease_ms=LEASE_MS, recover=False
            )
            assert claim is not None, "OUT-1: setting up: the claim of a due pending send must succeed"
            for key, token, message_id in (("k-inline", 1, "wamid.HBgL-1"), ("k-queued", claim[0].token, "wamid.HBgL-2")):
                ok = await b.outbox_mark_sent(t.a, key, token=token, message_id=message_id, now=T0 + 10, expires_at=T0 + 1000)
                assert ok is True, f"OUT-1: outbox_mark_sent with the lease's token must return True; got {ok!r}"
                rec = await b.outbox_get(t.a, key)
                assert rec is not None and rec.state == "sent", (
                    f"OUT-1: outbox_mark_sent records state sent; {key!r} is in state {getattr(rec, 'state', None)!r}"
                )
                assert rec.message_id == message_id, (
                    f"OUT-1: outbox_mark_sent stores the provider's message id {message_id!r}; {key!r} has "
                    f"{rec.message_id!r}"
                )
            listed = sorted(r.key for r in await b.outbox_list(t.a, state="sent"))
            assert listed == ["k-inline", "k-queued"], f"OUT-1: outbox_list(state='sent') must list both; got {listed!r}"
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"OUT-1: a sent record is never due; outbox_due lists {due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-2")
    def test_out2_a_sent_record_stays_sent(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-2: a send whose key is ``sent`` is answered from the outbox: journaling
        its key again returns the sent record (``created=False``); no claim, no fenced
        operation, no ``mark_dead``, ``split`` or ``retry`` changes it; it is never
        due."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k1"))
            assert await b.outbox_mark_sent(t.a, "k1", token=1, message_id="wamid.1", now=T0 + 1, expires_at=None) is True
            sent = await b.outbox_get(t.a, "k1")
            stored, created = await b.outbox_journal(t.a, outbound("k1", text="other content", owner=OWNER_B, now=T0 + 5))
            assert created is False and _j(stored) == _j(sent), (
                "OUT-2: journaling a key that is already sent returns the sent record and created=False; got "
                f"created={created!r}, record differing in {_changes(sent, stored)}"
            )
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("outbox_claim (expired, other owner)", lambda: b.outbox_claim(
                    t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=False
                )),
                ("outbox_claim (recover, same owner)", lambda: b.outbox_claim(
                    t.a, "k1", owner=OWNER_A, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
                )),
                ("outbox_mark_sent (again)", lambda: b.outbox_mark_sent(
                    t.a, "k1", token=1, message_id="wamid.2", now=T0 + 2, expires_at=None
                )),
                ("outbox_mark_failed", lambda: b.outbox_mark_failed(t.a, "k1", token=1, next_at=T0 + 2, error="e")),
                ("outbox_mark_unknown", lambda: b.outbox_mark_unknown(t.a, "k1", token=1, now=T0 + 2)),
                ("outbox_mark_dead (token)", lambda: b.outbox_mark_dead(t.a, "k1", token=1, now=T0 + 2, error="e")),
                ("outbox_mark_dead (token=None)", lambda: b.outbox_mark_dead(t.a, "k1", token=None, now=T0 + 2, error="e")),
                ("outbox_heartbeat", lambda: b.outbox_heartbeat(t.a, "k1", token=1, lease_until=FAR)),
                ("outbox_split (token=None)", lambda: b.outbox_split(
                    t.a, "k1", token=None, content={"type": "text", "text": "x"}
                )),
                ("outbox_retry", lambda: b.outbox_retry(t.a, "k1", now=T0 + 2)),
            ]
            for name, call in calls:
                result = await call()
                after = await b.outbox_get(t.a, "k1")
                assert result in (None, False) and _j(after) == _j(sent), (
                    f"OUT-2: a sent record stays sent: {name} must be refused and change nothing; it returned "
                    f"{result!r} and changed {_changes(sent, after)}"
                )
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"OUT-2: a sent record is never due; outbox_due lists {due!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-2", "OUT-10")
    def test_out2_journal_of_an_existing_key_returns_the_stored_record(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-2, OUT-10: the outbox journal is create-if-absent by idempotency key:
        journaling a key that exists — pending, sending or failed — returns the stored
        record and ``created=False`` and changes nothing (a second enqueue of the same
        key does nothing)."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("reminder:1", state="pending", text="first", next_at=T0 + 100))
            await b.outbox_journal(t.a, outbound("k-sending", text="first"))
            await b.outbox_journal(t.a, outbound("k-failed", text="first"))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 50, error="e") is True
            for key in ("reminder:1", "k-sending", "k-failed"):
                before = await b.outbox_get(t.a, key)
                for state in ("pending", "sending"):
                    again = outbound(key, state=state, chat_id="chat-2", text="second", owner=OWNER_B, now=T0 + 7)
                    stored, created = await b.outbox_journal(t.a, again)
                    assert created is False and _j(stored) == _j(before), (
                        f"OUT-2/OUT-10: outbox_journal of the existing key {key!r} ({getattr(before, 'state', None)}) "
                        f"must return the stored record and created=False; got created={created!r}, record differing in "
                        f"{_changes(before, stored)}"
                    )
                    after = await b.outbox_get(t.a, key)
                    assert _j(after) == _j(before), (
                        f"OUT-2/OUT-10: journaling an existing key changes nothing; {key!r} changed {_changes(before, after)}"
                    )
            count = len(await b.outbox_list(t.a))
            assert count == 3, f"OUT-2: one key is one record; outbox_list shows {count} records for 3 keys"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-10", "REPL-1")
    def test_out10_concurrent_journals_of_one_key_create_it_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-10, REPL-1: many tasks journaling one idempotency key at once create it
        exactly once; every other call gets the stored record and ``created=False``."""
        n = self.concurrent_tasks

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            records = [outbound("reminder:1", state="pending", text=f"copy {i}", seq=i) for i in range(n)]
            outcomes = await asyncio.gather(*(b.outbox_journal(t.a, r) for r in records))
            created = [i for i, (_, c) in enumerate(outcomes) if c]
            assert len(created) == 1, (
                f"OUT-10/REPL-1: {n} concurrent outbox_journal calls of one key must create it exactly once; "
                f"{len(created)} returned created=True"
            )
            stored = await b.outbox_get(t.a, "reminder:1")
            assert _j(stored) == _j(records[created[0]]), (
                f"OUT-10: the stored record must be the creator's; differs in {_changes(records[created[0]], stored)}"
            )
            wrong = [i for i, (r, _) in enumerate(outcomes) if _j(r) != _j(stored)]
            assert not wrong, f"OUT-10: every other concurrent journal must return the stored record; calls {wrong} did not"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-10")
    def test_out10_an_enqueued_send_is_due_and_claimable_at_next_at(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-10: an enqueued (``pending``) send is due at its ``next_at`` and not
        before; it is claimable from then on: the claim returns it ``sending`` with a
        larger token, one more attempt, and the previous state ``pending``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            rec = (await b.outbox_journal(t.a, outbound("reminder:1", state="pending", next_at=T0 + 1_000)))[0]
            early = await b.outbox_due(t.a, upto=T0 + 999, limit=10)
            on_time = await b.outbox_due(t.a, upto=T0 + 1_000, limit=10)
            assert early == [] and on_time == ["reminder:1"], (
                f"OUT-10: an enqueued send is due at its next_at (T0+1000), not before; due(T0+999) = {early!r}, "
                f"due(T0+1000) = {on_time!r}"
            )
            got = await b.outbox_claim(
                t.a, "reminder:1", owner=OWNER_A, incarnation=INC_1, now=T0 + 999, lease_ms=LEASE_MS, recover=False
            )
            assert got is None, f"OUT-10: an enqueued send is not claimable before its next_at; the claim returned {got!r}"
            got = await b.outbox_claim(
                t.a, "reminder:1", owner=OWNER_A, incarnation=INC_1, now=T0 + 1_000, lease_ms=LEASE_MS, recover=False
            )
            assert got is not None, "OUT-10: an enqueued send is claimable at its next_at; the claim returned None"
            new, previous = got
            assert (new.state, previous, new.owner) == ("sending", "pending", OWNER_A), (
                "OUT-10: the claim returns the record in state sending, leased to the claimer, and the previous "
                f"state 'pending'; got state={new.state!r}, previous={previous!r}, owner={new.owner!r}"
            )
            assert new.token > rec.token and new.attempts == rec.attempts + 1, (
                f"OUT-10/LEASE-2: the claim gives a larger token and one more attempt; token {rec.token} -> "
                f"{new.token}, attempts {rec.attempts} -> {new.attempts}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-7")
    def test_out7_a_failed_send_is_retried_at_next_at(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-7: ``outbox_mark_failed`` with the lease's token moves the send to
        ``failed`` with its retry time and error; it is due and claimable only from
        ``next_at`` on; the claim counts one more attempt and reports the previous
        state ``failed``."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k1"))
            ok = await b.outbox_mark_failed(t.a, "k1", token=1, next_at=T0 + 2_000, error="timeout")
            assert ok is True, f"OUT-7: outbox_mark_failed with the lease's token must return True; got {ok!r}"
            rec = await b.outbox_get(t.a, "k1")
            assert rec is not None and (rec.state, rec.next_at, rec.error) == ("failed", T0 + 2_000, "timeout"), (
                f"OUT-7: outbox_mark_failed records state failed, next_at and the error; got {_j(rec)!r}"
            )
            early = await b.outbox_due(t.a, upto=T0 + 1_999, limit=10)
            on_time = await b.outbox_due(t.a, upto=T0 + 2_000, limit=10)
            assert early == [] and on_time == ["k1"], (
                f"OUT-7: a failed send is due at its next_at (T0+2000), not before; due(T0+1999) = {early!r}, "
                f"due(T0+2000) = {on_time!r}"
            )
            got = await b.outbox_claim(
                t.a, "k1", owner=OWNER_A, incarnation=INC_1, now=T0 + 1_999, lease_ms=LEASE_MS, recover=False
            )
            assert got is None, f"OUT-7: a failed send is not retried before its next_at; the claim returned {got!r}"
            got = await b.outbox_claim(
                t.a, "k1", owner=OWNER_A, incarnation=INC_1, now=T0 + 2_000, lease_ms=LEASE_MS, recover=False
            )
            assert got is not None and got[1] == "failed" and got[0].state == "sending", (
                f"OUT-7: a failed send is claimable at next_at, returning (sending record, 'failed'); got {got!r}"
            )
            assert got[0].attempts == 2 and got[0].token > 1, (
                "OUT-7: the retry counts a second attempt with a larger token; got attempts "
                f"{got[0].attempts}, token {got[0].token}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-7", "OUT-10", "OUT-14")
    def test_out7_due_sends_are_listed_earliest_first(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-7, OUT-10, OUT-14: ``outbox_due`` lists the keys of ``pending`` (at
        ``next_at``), ``failed`` (at ``next_at``) and ``sending`` (at ``lease_until``)
        records whose time is ``<= upto`` (inclusive), earliest first, up to ``limit``;
        never a ``sent``, ``dead`` or ``unknown`` one. Key order is the reverse of time
        order."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("a-sending"))  # due T0+60000
            await b.outbox_journal(t.a, outbound("b-failed"))
            assert await b.outbox_mark_failed(t.a, "b-failed", token=1, next_at=T0 + 20_000, error="e") is True
            await b.outbox_journal(t.a, outbound("c-pending", state="pending", next_at=T0 + 10_000))
            await b.outbox_journal(t.a, outbound("d-sent"))
            assert await b.outbox_mark_sent(t.a, "d-sent", token=1, message_id="x", now=T0, expires_at=None) is True
            await b.outbox_journal(t.a, outbound("e-dead"))
            assert await b.outbox_mark_dead(t.a, "e-dead", token=1, now=T0, error="e") is True
            await b.outbox_journal(t.a, outbound("f-unknown"))
            assert await b.outbox_mark_unknown(t.a, "f-unknown", token=1, now=T0) is True
            cases: list[tuple[float, int, list[str]]] = [
                (INF, 100, ["c-pending", "b-failed", "a-sending"]),
                (T0 + 9_999, 100, []),
                (T0 + 10_000, 100, ["c-pending"]),
                (T0 + 20_000, 100, ["c-pending", "b-failed"]),
                (T0 + 59_999, 100, ["c-pending", "b-failed"]),
                (T0 + 60_000, 100, ["c-pending", "b-failed", "a-sending"]),
                (INF, 2, ["c-pending", "b-failed"]),
                (INF, 1, ["c-pending"]),
            ]
            for upto, limit, expected in cases:
                got = await b.outbox_due(t.a, upto=upto, limit=limit)
                assert got == expected, (
                    "OUT-7: outbox_due lists the keys of pending/failed/sending records due (retry time or lease "
                    f"expiry) <= upto, earliest first, up to limit (never sent, dead or unknown); upto={_when(upto)}, "
                    f"limit={limit}: expected {expected!r}, got {got!r}"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-3", "OUT-7")
    def test_out7_a_sweep_pass_reads_both_journals_as_their_own_due_reads_do(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-3, OUT-7: ``due`` — what the engine's sweep reads at every pass — answers
        exactly ``(inbox_due(...), outbox_due(...))`` with the same ``upto`` and
        ``limit``: the inbox's ids first, the outbox's keys second, each earliest first,
        in the scope asked only. A backend that reads both at once must not swap them,
        mix them or lose one: a due send or message would never be swept."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.inbox_journal(t.a, inbound("m2", lease_ms=30_000))  # due T0+30000
            await b.inbox_journal(t.a, inbound("m1", lease_ms=60_000))  # due T0+60000
            await b.outbox_journal(t.a, outbound("k-sending"))  # due T0+60000
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", next_at=T0 + 10_000))
            await b.inbox_journal(t.b, inbound("m0", lease_ms=1_000))  # another scope: never seen from t.a
            await b.outbox_journal(t.b, outbound("k-other", state="pending", next_at=T0))
            cases: list[tuple[float, int, tuple[list[str], list[str]]]] = [
                (INF, 100, (["m2", "m1"], ["k-pending", "k-sending"])),
                (T0 + 9_999, 100, ([], [])),
                (T0 + 10_000, 100, ([], ["k-pending"])),
                (T0 + 30_000, 100, (["m2"], ["k-pending"])),
                (INF, 1, (["m2"], ["k-pending"])),
            ]
            for upto, limit, expected in cases:
                got = await b.due(t.a, upto=upto, limit=limit)
                own = (await b.inbox_due(t.a, upto=upto, limit=limit), await b.outbox_due(t.a, upto=upto, limit=limit))
                assert (list(got[0]), list(got[1])) == expected == own, (
                    "INB-3/OUT-7: due() answers (inbox_due, outbox_due) with the same upto and limit, in the scope "
                    f"asked; upto={_when(upto)}, limit={limit}: expected {expected!r}, got {got!r} (inbox_due and "
                    f"outbox_due give {own!r})"
                )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-8", "OUT-12", "OPS-2")
    def test_out8_mark_dead_moves_a_send_to_the_dlq(self, botmesh_harness_factory: HarnessFactory, tmp_path: Any) -> None:
        """OUT-8, OUT-12: ``outbox_mark_dead`` moves a send to ``dead`` with its error:
        fenced with a token; with ``None`` from any state but ``sent`` (a later part
        dies with an earlier one). A dead send is listed as dead (OPS-2), never due and
        never claimed."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k-sending"))
            ok = await b.outbox_mark_dead(t.a, "k-sending", token=1, now=T0 + 1, error="UnsupportedContentError")
            rec = await b.outbox_get(t.a, "k-sending")
            assert ok is True and rec is not None and rec.state == "dead" and rec.error == "UnsupportedContentError", (
                f"OUT-8: outbox_mark_dead with the lease's token moves the send to dead with its error; it returned "
                f"{ok!r}, record {_j(rec)!r}"
            )
            await b.outbox_journal(t.a, outbound("k-part", state="pending", previous_part="k-sending", part=2))
            await b.outbox_journal(t.a, outbound("k-failed"))
            assert await b.outbox_mark_failed(t.a, "k-failed", token=1, next_at=T0 + 5, error="e") is True
            await b.outbox_journal(t.a, outbound("k-unknown"))
            assert await b.outbox_mark_unknown(t.a, "k-unknown", token=1, now=T0) is True
            for key in ("k-part", "k-failed", "k-unknown"):
                ok = await b.outbox_mark_dead(t.a, key, token=None, now=T0 + 2, error="earlier part is dead")
                rec = await b.outbox_get(t.a, key)
                assert ok is True and rec is not None and rec.state == "dead", (
                    f"OUT-8/OUT-12: outbox_mark_dead with token=None moves a send in any state but sent to dead; "
                    f"{key!r} returned {ok!r}, state {getattr(rec, 'state', None)!r}"
                )
            listed = sorted(r.key for r in await b.outbox_list(t.a, state="dead"))
            assert listed == ["k-failed", "k-part", "k-sending", "k-unknown"], (
                f"OPS-2: outbox_list(state='dead') must list the DLQ; got {listed!r}"
            )
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert due == [], f"OUT-8: a dead send is never due; outbox_due lists {due!r}"
            got = await b.outbox_claim(
                t.a, "k-sending", owner=OWNER_A, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True
            )
            assert got is None, f"OUT-8: a dead send is never claimed; the claim returned {got!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-14")
    def test_out14_an_expired_send_is_claimed_as_ambiguous_and_marked_unknown(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-14: the claim of a send whose ``sending`` lease expired (its owner died
        during the provider call) reports the previous state ``sending`` — the
        ambiguity the caller resolves; so does a recovery claim (LEASE-4).
        ``outbox_mark_unknown`` with the lease's token then records ``unknown``: listed,
        never due, never claimed."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            await b.outbox_journal(t.a, outbound("k1"))
            got = await b.outbox_claim(
                t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=T0 + LEASE_MS, lease_ms=LEASE_MS, recover=False
            )
            assert got is not None and got[1] == "sending", (
                f"OUT-14: the claim of an expired sending lease must report the previous state 'sending'; got {got!r}"
            )
            await b.outbox_journal(t.a, outbound("k2"))
            rec2 = await b.outbox_claim(t.a, "k2", owner=OWNER_A, incarnation=INC_2, now=T0 + 1, lease_ms=LEASE_MS, recover=True)
            assert rec2 is not None and rec2[1] == "sending", (
                f"OUT-14/LEASE-4: a recovery claim of a send in flight must report the previous state 'sending'; got {rec2!r}"
            )
            ok = await b.outbox_mark_unknown(t.a, "k1", token=got[0].token, now=T0 + LEASE_MS + 1)
            rec = await b.outbox_get(t.a, "k1")
            assert ok is True and rec is not None and rec.state == "unknown", (
                f"OUT-14: outbox_mark_unknown with the lease's token records state unknown; it returned {ok!r}, "
                f"state {getattr(rec, 'state', None)!r}"
            )
            listed = [r.key for r in await b.outbox_list(t.a, state="unknown")]
            assert listed == ["k1"], f"OUT-14: outbox_list(state='unknown') must list it; got {listed!r}"
            due = await b.outbox_due(t.a, upto=INF, limit=100)
            assert "k1" not in due, f"OUT-14: an unknown send is skipped: never due; outbox_due lists {due!r}"
            again = await b.outbox_claim(t.a, "k1", owner=OWNER_B, incarnation=INC_2, now=FAR, lease_ms=LEASE_MS, recover=True)
            assert again is None, f"OUT-14: an unknown send is never claimed (never duplicated); the claim returned {again!r}"

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-12")
    def test_out12_parts_are_independent_records_linked_by_previous_part(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-12: parts ``key``, ``key#2``, ``key#3`` are independent records; the link
        is the stored ``previous_part``, never inferred from the key: a user's key
        ending in ``#2`` has none, and a part keeps its link when the earlier part is
        discarded."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            parts = [
                outbound("k", state="pending", text="one", part=1),
                outbound("k#2", state="pending", text="two", previous_part="k", part=2),
                outbound("k#3", state="pending", text="three", previous_part="k#2", part=3),
                outbound("user#2", state="pending", text="mine"),
            ]
            for rec in parts:
                _, created = await b.outbox_journal(t.a, rec)
                assert created is True, (
                    f"OUT-12: each part is its own record; journaling {rec.key!r} returned created={created!r}"
                )
            for rec in parts:
                got = await b.outbox_get(t.a, rec.key)
                assert got is not None and (
                    (got.previous_part, got.part, got.content) == (rec.previous_part, rec.part, rec.content)
                ), (
                    f"OUT-12: the part link is stored in the record; {rec.key!r}: expected previous_part="
                    f"{rec.previous_part!r}, part={rec.part}, got {_j(got)!r}"
                )
            assert await b.outbox_discard(t.a, "k") is True
            second = await b.outbox_get(t.a, "k#2")
            assert second is not None and second.previous_part == "k", (
                f"OUT-12: discarding the first part leaves the second with its link; got {_j(second)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OUT-13")
    def test_out13_split_replaces_the_content_and_nothing_else(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OUT-13: ``outbox_split`` replaces a record's content by its first part and
        changes nothing else: with ``token=None`` only for a ``pending``/``failed``
        record, with a token only for the ``sending`` lease of that token."""

        async def body(t: DurabilityTest) -> None:
            b = t.backend
            first: dict[str, object] = {"type": "text", "text": "first part"}
            await b.outbox_journal(t.a, outbound("k-pending", state="pending", text="x" * 5000))
            before = await b.outbox_get(t.a, "k-pending")
            assert before is not None
            ok = await b.outbox_split(t.a, "k-pending", token=None, content=first)
            after = await b.outbox_get(t.a, "k-pending")
            assert ok is True and after is not None and after.content == first, (
                f"OUT-13: outbox_split(token=None) of a pending record replaces its content; it returned {ok!r}, "
                f"content {getattr(after, 'content', None)!r}"
            )
            assert _j(after.copy(content=before.content)) == _j(before), (
                f"OUT-13: outbox_split changes the content only; it also changed {_changes(before.copy(content=first), after)}"
            )
            await b.outbox_journal(t.a, outbound("k-sending", text="y" * 5000))
            sending = await b.outbox_get(t.a, "k-sending")
            for token in (None, 0, 2):
                ok = await b.outbox_split(t.a, "k-sending", token=token, content=first)
                now = await b.outbox_get(t.a, "k-sending")
                assert ok is False and _j(now) == _j(sending), (
                    f"OUT-13: outbox_split of a sending record needs its lease's token (1); with token={token!r} it "
                    f"returned {ok!r} and changed {_changes(sending, now)}"
                )
            ok = await b.outbox_split(t.a, "k-sending", token=1, content=first)
            now = await b.outbox_get(t.a, "k-sending")
            assert ok is True and now is not None and now.content == first and now.state == "sending", (
                f"OUT-13: outbox_split with the lease's token replaces the content; it returned {ok!r}, got {_j(now)!r}"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)

