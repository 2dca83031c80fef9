"""Several processes on one storage (``multi_process``): backends on the same storage see
each other's records and claim exclusively (REPL-1, REPL-4). Skipped when the harness
does not claim ``multi_process``; ``multi_host`` cannot be exercised from one host.

Two kinds of test. The first opens a second backend on the same storage *in this
process* (what another process would hold), to check visibility step by step. The
others run **real processes** at once (:func:`botmesh_testkit.kill.workers.run_workers`:
4 by default, started together behind a barrier), each building its own backend from
the harness's :meth:`~botmesh_testkit.backends.base.BackendHarness.kill_spec` — as the
kill loops do, a third party's ``module:factory`` included — so that a race between
processes (a compare-and-set that is only atomic within one event loop, a lock held in
one process's memory) can show: concurrent journals of the same records, and rounds of
concurrent claims of the same records with heartbeats, attempts on live leases and
writes with stale tokens. What each process saw and wrote comes back to this one and is
judged by :mod:`botmesh_testkit.checker.contention`, with checks that hold for every
interleaving. A harness that claims ``multi_process`` but gives no ``kill_spec()``
fails these (the claim cannot be checked)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest
from botmesh.core.backend import DurabilityBackend

from ...backends.base import KillSpec
from ...checker.contention import check_claim_rounds, check_journal_race, headline
from ...kill.contention import claim_rounds, journal_race, owner_of, round_time
from ...kill.workers import WorkersRun, Workload, run_workers
from .base import INC_2, LEASE_MS, OWNER_A, OWNER_B, T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .leases import JOURNALS, _Journal
from .records import _j, inbound, outbound


class MultiProcessTests(DurabilitySuiteBase):
    """The several-processes tests (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    processes: ClassVar[int] = 4
    """How many real processes the multi-process tests run at once."""
    process_records: ClassVar[int] = 6
    """Records each of them journals or claims."""
    process_rounds: ClassVar[int] = 4
    """Rounds of concurrent claims."""
    process_seed: ClassVar[int] = 0
    """Seeds each process's order of records (the interleaving is the operating system's)."""

    def _process_spec(self, t: DurabilityTest) -> KillSpec:
        spec = t.harness.kill_spec()
        if spec is None:
            raise AssertionError(
                f"REPL-4: the backend claims multi_process, but its harness ({type(t.harness).__name__}) gives no "
                "kill_spec(): other processes cannot open its storage, so the claim cannot be checked; implement "
                "BackendHarness.kill_spec() (a KillSpec a child process builds the backend from)"
            )
        return spec

    async def _processes(self, t: DurabilityTest, workload: Workload, params: dict[str, Any]) -> WorkersRun:
        """Run ``workload`` in :attr:`processes` real processes on the test's storage; a
        process that failed fails the test (REPL-4: it could not use the backend)."""
        spec = self._process_spec(t)
        n = self.processes
        run = await asyncio.to_thread(run_workers, spec, workload, processes=n, seed=self.process_seed,
                                      params=params, timeout=min(45.0, self.timeout_seconds * 0.75))
        assert not run.failures, (
            f"REPL-4: {n} processes each opening the backend on the same storage (multi_process) must be able to "
            f"work at once; {len(run.failures)} failed, {run.first_error()}\n{run.describe_failures()}"
        )
        return run

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


    @pytest.mark.spec("INB-4", "OUT-2", "REPL-4")
    def test_repl4_journals_from_several_processes_create_each_record_once(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-4, OUT-2, REPL-4 (``multi_process``): 4 real processes, started together,
        each journal the same 6 inbound records and the same 6 sends, each in its own
        order and under its own owner: each record is created by exactly one process,
        every other journal call returns the stored record (the creator's), and the
        stored record is the creator's. Skipped when the harness does not claim
        ``multi_process``."""
        m = self.process_records

        async def body(t: DurabilityTest) -> None:
            t.require("multi_process")
            ids, keys = [f"m{i}" for i in range(m)], [f"k{i}" for i in range(m)]
            params = {"scope": t.a, "inbox": [inbound(id).to_json() for id in ids],
                      "outbox": [outbound(key).to_json() for key in keys]}
            run = await self._processes(t, journal_race, params)
            b: DurabilityBackend = t.backend
            stored: dict[str, dict[str, str | None]] = {"inbox": {}, "outbox": {}}
            for id in ids:
                rec = await b.inbox_get(t.a, id)
                stored["inbox"][id] = None if rec is None else rec.owner
            for key in keys:
                out = await b.outbox_get(t.a, key)
                stored["outbox"][key] = None if out is None else out.owner
            violations = check_journal_race(run.values, stored, [owner_of(i) for i in range(self.processes)])
            assert not violations, headline(violations, f"journaling is create-if-absent across {self.processes} processes")

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("REPL-1", "LEASE-1", "LEASE-2", "REPL-3", "REPL-4")
    @pytest.mark.parametrize("journal", JOURNALS)
    def test_repl1_claims_from_several_processes_are_exclusive_and_fenced(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any, journal: str
    ) -> None:
        """REPL-1, LEASE-1, LEASE-2, REPL-3, REPL-4 (``multi_process``): 6 records are
        journaled, then 4 real processes claim every one of them at once, in 4 rounds
        (each after every earlier lease expired). In each round each record is claimed
        by exactly one process, with a fencing token larger than every earlier one and
        the lease the claim asked for; while that lease is live, the holder's heartbeat
        is kept, and the others can neither take the record nor write with the token of
        the lease they lost (heartbeat, complete / mark sent: refused). At the end each
        holder settles its records; every stale token is refused once more, and each
        record ends settled with its last holder's token. Holds for every interleaving.
        Skipped when the harness does not claim ``multi_process``."""
        m, rounds = self.process_records, self.process_rounds

        async def body(t: DurabilityTest) -> None:
            t.require("multi_process")
            j = _Journal(t.backend, journal)
            ids = [f"r{i}" for i in range(m)]
            for id in ids:
                await j.journal(t.a, id)  # leased to OWNER_A until T0 + LEASE_MS: expired in round 1
            params = {"scope": t.a, "journal": journal, "ids": ids, "rounds": rounds, "t0": T0, "lease_ms": LEASE_MS}
            run = await self._processes(t, claim_rounds, params)
            final = {id: _j(await j.get(t.a, id)) for id in ids}
            violations = check_claim_rounds(
                run.values, final, journal=journal, ids=ids, rounds=rounds,
                owners=[owner_of(i) for i in range(self.processes)],
                lease_until={r: round_time(T0, LEASE_MS, r) + LEASE_MS for r in range(1, rounds + 1)},
                settled_state=j.settled,
            )
            assert not violations, headline(
                violations, f"claims stay exclusive and fenced across processes ({rounds} rounds of {self.processes} "
                            f"processes claiming {m} {journal} records)"
            )

        self.run_backend(botmesh_harness_factory, tmp_path, body)
