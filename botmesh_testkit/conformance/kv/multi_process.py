"""Several real processes on one storage (``multi_process``): compare-and-set stays atomic
between processes, not only between the tasks of one event loop (BACK-7, REPL-1,
REPL-4). Skipped when the kv does not claim ``multi_process``.

The processes are real (:func:`botmesh_testkit.kill.workers.run_workers`): each builds
its own kv by calling the ``kv_factory`` fixture's callable, pickled into it with dill —
so the callable must be picklable (a lambda or function over paths, URLs and names is;
one over an open connection is not, and the test then fails saying so)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest
from botmesh.core.spi import DurableKv

from ...checker.contention import check_cas_increments, headline
from ...kill.contention import cas_increments
from ...kill.workers import run_workers
from .base import KvFactory, KvSuiteBase, Scopes


class MultiProcessKvTests(KvSuiteBase):
    """The several-processes test of the kv suite (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    processes: ClassVar[int] = 4
    """How many worker processes contend."""
    process_increments: ClassVar[int] = 40
    """Compare-and-set increments per process."""
    process_keys: ClassVar[int] = 3
    """How many keys they share (fewer keys than processes: some always collide)."""
    process_rounds: ClassVar[int] = 4
    """The increments come in this many rounds, each started by all processes at once."""
    process_seed: ClassVar[int] = 0
    """Seeds each process's choice of keys (the interleaving is the operating system's)."""

    @pytest.mark.spec("BACK-7", "REPL-1", "REPL-4")
    def test_back7_cas_from_several_processes_loses_no_update(self, kv_factory: KvFactory) -> None:
        """BACK-7, REPL-1, REPL-4 (``multi_process``): 4 processes, each with its own kv
        on the same storage, started together, each make 40 read-modify-write
        increments (``get``, then ``put(count + 1, expected_version=<version read>)``,
        again on ``VersionConflict``) on the same 3 keys, in rounds that start them
        together again. Every successful CAS is counted exactly once: no two puts win
        with one ``expected_version``, each returns exactly ``expected_version + 1``, the
        final count of each key equals the number of wins on it, at version wins + 1, and
        the versions a process reads or wins never go back. Holds whatever the
        interleaving; a put that checks the version and writes in two steps loses
        updates here and is caught. Skipped when the kv does not claim
        ``multi_process``."""
        if not bool(kv_factory().capabilities.multi_process):
            pytest.skip("capability not claimed: multi_process")
        n, increments = self.processes, self.process_increments
        keys = [f"counter-{i}" for i in range(self.process_keys)]

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key in keys:
                await kv.put(s.a, "outbox", key, {"count": 0}, expected_version=0)
            params: dict[str, Any] = {"scope": s.a, "space": "outbox", "keys": keys, "increments": increments,
                                      "rounds": self.process_rounds}
            run = await asyncio.to_thread(run_workers, kv_factory, cas_increments, processes=n,
                                          seed=self.process_seed, params=params,
                                          timeout=min(45.0, self.timeout_seconds * 0.75))
            assert not run.failures, (
                f"REPL-4: {n} processes each opening the kv on the same storage (multi_process) must be able to make "
                f"their CAS increments; {len(run.failures)} failed, {run.first_error()}\n{run.describe_failures()}"
            )
            final: dict[str, tuple[int, dict[str, Any]] | None] = {}
            for key in keys:
                got = await kv.get(s.a, "outbox", key)
                final[key] = None if got is None else (got.version, got.value)
            violations = check_cas_increments(run.values, final, increments=increments)
            assert not violations, headline(
                violations, f"compare-and-set is atomic across processes ({n} processes x {increments} CAS increments "
                            f"on {len(keys)} shared keys count every successful put exactly once)"
            )

        self.run_kv(kv_factory, body)
