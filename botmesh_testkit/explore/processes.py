"""Real processes in a story: a burst of operating-system processes contending on the
explored backend's storage, for backends that claim ``multi_process`` and whose harness
tells a child process how to open that storage
(:meth:`~botmesh_testkit.backends.base.BackendHarness.kill_spec`). Mixed into
:class:`~.story.Explorer`.

``await x.processes(workload, seed=n)`` runs one of the conformance suite's
multi-process workloads (:mod:`botmesh_testkit.kill.contention`, through
:func:`~botmesh_testkit.kill.workers.run_workers`: :data:`PROCESSES` processes started
together behind a barrier, each on a backend of its own) on the story's storage, in a
scope of its own (the bots' records are not touched), while the story's bots stay alive;
what the processes saw and wrote is judged by :mod:`botmesh_testkit.checker.contention`,
whose checks hold for every interleaving — the outcome is checked, never timing, so a
story stays deterministic under its seed whatever the operating system's scheduling did
(a race that broke the contract is caught whenever it happened; a burst that happened
not to race passes):

* ``cas`` — read-modify-write increments by compare-and-set on a few shared keys of the
  backend's ``DurableKv`` (its harness's ``kv_factory()``; only for kv-based backends):
  every successful compare-and-set counted exactly once, one winner per version
  (BACK-7, REPL-1);
* ``journal`` — every process journals the same inbound records and sends: each created
  by exactly one process, the others answered with it (INB-4, OUT-2, REPL-4);
* ``claims-inbox`` / ``claims-outbox`` — rounds of claims of the same records by every
  process, heartbeats, attempts on live leases and writes with stale tokens: one winner
  per record and round, fencing tokens that only grow, a live lease never taken, stale
  writes refused (REPL-1, LEASE-1, LEASE-2, REPL-3).

A process that cannot open the storage or fails is a violation too (REPL-4: the backend
claims several processes). The setup and the final look go through a handle of the
story's own on the storage (a second harness on the same work directory, as the
replica's: :mod:`.replicas`).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["PROCESSES", "ProcessVerbs", "WORKLOADS"]

PROCESSES = 4
"""Processes a burst runs at once."""
WORKLOADS = ("cas", "journal", "claims-inbox", "claims-outbox")
KEYS = 3
"""Keys (cas) or records (the others) the processes share: fewer than processes, so some always collide."""
INCREMENTS = 12
"""Compare-and-set increments per process (cas)."""
ROUNDS = 2
TIMEOUT = 45.0
"""Real seconds a burst may take (its processes are killed after, and the story fails)."""


class ProcessVerbs:
    """Mixed into :class:`~.story.Explorer`: the ``processes`` verb."""

    s: Any
    world: Any

    async def _quiet(self) -> None:
        raise NotImplementedError  # Explorer's

    def _init_processes(self) -> None:
        self.bursts = 0
        self._side: Any = None  # (harness, backend) of the story's own handle on the storage

    async def _side_backend(self) -> Any:
        if self._side is None:
            from ..backends.registry import resolve

            harness = resolve(self.s.backend)(self.s.harness.workdir)
            self._replica_harnesses.append(harness)  # type: ignore[attr-defined]  # closed with the replicas'
            backend, _store = await harness.open()
            await backend.start()
            self._side = (harness, backend)
        return self._side[1]

    async def processes(self, workload: str, seed: int = 0) -> None:
        """A burst of :data:`PROCESSES` real processes running ``workload`` (one of
        :data:`WORKLOADS`) on the story's storage, under ``seed`` (each process's own
        order of keys and records); its outcome checked (see the module docstring)."""
        await self._quiet()
        from ..backends.registry import resolve
        from ..checker.contention import check_cas_increments, check_claim_rounds, check_journal_race
        from ..conformance.durability.base import LEASE_MS, T0
        from ..conformance.durability.leases import _Journal
        from ..conformance.durability.records import _j, inbound, outbound
        from ..kill.contention import cas_increments, claim_rounds, journal_race, owner_of, round_time
        from ..kill.workers import run_workers
        from .violation import ExploreViolation

        if workload not in WORKLOADS:
            raise ValueError(f"processes(): unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        self.bursts += 1
        scope = f"explore-processes-{self.bursts}"
        owners = [owner_of(i) for i in range(PROCESSES)]
        ids = [f"r{i}" for i in range(KEYS)]
        what = f"{PROCESSES} processes at once ({workload}, seed {seed})"
        if workload == "cas":
            target: Any = resolve(self.s.backend)(self.s.harness.workdir).kv_factory()
            if target is None:
                raise ValueError(f"processes('cas'): backend {self.s.backend!r} is not a DurableKv's (no kv_factory())")
            kv = target()
            await kv.open()
            try:
                for key in ids:
                    await kv.put(scope, "outbox", key, {"count": 0}, expected_version=0)
            finally:
                await kv.close()
            params: dict[str, Any] = {"scope": scope, "space": "outbox", "keys": ids, "increments": INCREMENTS,
                                      "rounds": ROUNDS}
            fn: Any = cas_increments
        else:
            target = self.s.harness.kill_spec()
            if target is None:
                raise ValueError(f"processes(): the harness of {self.s.backend!r} gives no kill_spec(): another "
                                 "process cannot open its storage")
            backend = await self._side_backend()
            if workload == "journal":
                params = {"scope": scope, "inbox": [inbound(i).to_json() for i in ids],
                          "outbox": [outbound(i).to_json() for i in ids]}
                fn = journal_race
            else:
                journal = _Journal(backend, workload.rpartition("-")[2])
                for i in ids:
                    await journal.journal(scope, i)  # leased until T0 + LEASE_MS: expired in round 1
                params = {"scope": scope, "journal": journal.kind, "ids": ids, "rounds": ROUNDS, "t0": T0,
                          "lease_ms": LEASE_MS}
                fn = claim_rounds
        run = await asyncio.to_thread(run_workers, target, fn, processes=PROCESSES, seed=seed, params=params,
                                      timeout=TIMEOUT)
        if run.failures:
            raise ExploreViolation(("REPL-4",), f"{what}: {len(run.failures)} could not work on the storage the "
                                   f"backend claims several processes may share: {run.first_error()}")
        if workload == "cas":
            kv = target()
            await kv.open()
            try:
                final: dict[str, Any] = {}
                for key in ids:
                    got = await kv.get(scope, "outbox", key)
                    final[key] = None if got is None else (got.version, got.value)
            finally:
                await kv.close()
            violations = check_cas_increments(run.values, final, increments=INCREMENTS)
        elif workload == "journal":
            stored: dict[str, dict[str, str | None]] = {"inbox": {}, "outbox": {}}
            for i in ids:
                rec = await backend.inbox_get(scope, i)
                stored["inbox"][i] = None if rec is None else rec.owner
                out = await backend.outbox_get(scope, i)
                stored["outbox"][i] = None if out is None else out.owner
            violations = check_journal_race(run.values, stored, owners)
        else:
            ended = {i: _j(await journal.get(scope, i)) for i in ids}
            violations = check_claim_rounds(
                run.values, ended, journal=journal.kind, ids=ids, rounds=ROUNDS, owners=owners,
                lease_until={r: round_time(T0, LEASE_MS, r) + LEASE_MS for r in range(1, ROUNDS + 1)},
                settled_state=journal.settled)
        if violations:
            first = violations[0]
            more = f" ({len(violations) - 1} more violation(s))" if len(violations) > 1 else ""
            raise ExploreViolation(first.ids, f"{what}: {first.message}{more}")
