"""Conformance suite of the durability backend contract — the
:class:`~botmesh.core.backend.DurabilityBackend` interface (BACK-7).

Subclass :class:`DurabilityConformance` and provide the ``botmesh_harness_factory``
fixture: a callable ``factory(workdir: str) -> BackendHarness``, exactly what
:func:`botmesh_testkit.backends.resolve` returns::

    import pytest
    from botmesh_testkit.backends import resolve
    from botmesh_testkit.conformance.durability import DurabilityConformance

    class TestMyBackend(DurabilityConformance):
        @pytest.fixture
        def botmesh_harness_factory(self):
            return resolve("mypkg.mod:factory")   # or: lambda workdir: MyHarness(workdir)

Each test builds its own harness with ``botmesh_harness_factory(str(tmp_path))``, opens
it, ``await backend.start()``, works in scopes of its own (a fresh random tag per test,
the second scope's name extending the first with ``:%_`` so that matching scopes by
prefix or pattern leaks and is caught), and stops the backends and closes the harness at
the end, also when it fails. With ``clean_up_records`` (by default when the harness
claims ``shared``: storage that outlives the test's directory) it also deletes, best
effort, what it wrote.

What is checked — the spec ids are on each test, in its docstring and in
``@pytest.mark.spec``; every failure message starts with the id and states the broken
requirement, then what the backend did:

* INB — journaling is create-if-absent and returns the stored record on a redelivery
  (INB-1, INB-4, also under concurrency), completion (INB-2), what is due after a crash
  and in which order (INB-3), retry later (INB-5), charged executions and the DLQ
  (INB-7);
* OUT — the outbox journal keyed by idempotency key, every field stored as given
  (content with base64 bytes, fingerprint, part links: OUT-1, OUT-5, OUT-12, OUT-15),
  ``sent`` with the message id and staying sent (OUT-1, OUT-2), enqueued sends and their
  due time (OUT-10), failures with a retry time (OUT-7), the DLQ (OUT-8), split (OUT-13),
  ambiguity after an expired send lease and ``unknown`` (OUT-14), explicit keys per
  scope (OUT-4);
* LEASE — a claim leases until ``now + lease_ms``; heartbeats extend and never shorten
  (LEASE-1); only expired leases are taken, with a strictly larger fencing token; every
  fenced operation with a stale token is refused and changes nothing (LEASE-2); the
  recovery claim of a restarted incarnation (LEASE-4);
* SCOPE — two scopes never see or change each other's records (SCOPE-1, SCOPE-2);
* OPS — listing by state, replay of a dead inbound, retry, discard (OPS-2), retention
  purges only expired ``done``/``sent`` records (OPS-3);
* REPL — concurrent claims have exactly one winner (REPL-1); with ``multi_process``,
  two backends on the same storage see each other's claims exclusively (REPL-4), and
  real processes (4, each building its own backend from the harness's ``kill_spec()``)
  journal the same records (each created once: INB-4, OUT-2) and claim them in rounds
  (one live lease per record, tokens that only grow, stale writes refused: REPL-1,
  LEASE-2, REPL-3);
* survival — with ``survives_crash``, everything acknowledged before ``harness.reopen()``
  is there after it: records, states, tokens, and both indexes (a leased record is still
  due at its ``lease_until``);
* end to end — through a :class:`~botmesh.core.Bot` on the backend: journaled before the
  handler and done after it, reprocessed after a restart with its sends answered from
  the outbox, a dead inbound replayed by the operator.

Not checkable at this level (they are the engine's, a configuration's or a document's,
whatever the backend does): INB-6, INB-8, INB-9, OUT-3, OUT-6, OUT-9, OUT-11, OUT-16,
OUT-17, LEASE-3, LEASE-5, SCOPE-3, OPS-1 and the metrics of OPS-2; ``multi_host``
cannot be exercised from one host.

Capabilities are read from the harness after ``open()`` (a factory harness learns them
from the backend it built); a test whose capability is not claimed is skipped with
``capability not claimed: <name>``. ``now``, ``next_at``, ``lease_until`` and
``expires_at`` are explicit numbers: nothing sleeps, and the backend must never read a
clock of its own.

The tests are plain synchronous pytest functions that run their coroutine with
:func:`asyncio.run`; no pytest plugin is needed to import or run this package (the
``spec`` marker is registered by the testkit's plugin). Tuning knobs are class
attributes (``timeout_seconds``, ``concurrent_tasks``, ``clean_up_records``).

The suite is composed of one mixin class per concern (the style of fsspec's abstract
tests), each in a module of this package: :mod:`.inbox` (INB), :mod:`.leases` (LEASE,
REPL-1), :mod:`.outbox` (OUT), :mod:`.ops` (OPS), :mod:`.scopes` (SCOPE),
:mod:`.survival` (``survives_crash``), :mod:`.multi_process` (``multi_process``) and
:mod:`.end_to_end` (through a Bot), on the common ground of :mod:`.base` (the fixture,
the runner, :class:`DurabilityTest`) and :mod:`.records`. :class:`DurabilityConformance`
is all of them; a project may bind fewer (``class TestMine(InboxTests, LeaseTests)``).
"""

from __future__ import annotations

from .base import (
    FAR,
    INC_1,
    INC_2,
    INF,
    LEASE_MS,
    OWNER_A,
    OWNER_B,
    T0,
    DurabilitySuiteBase,
    DurabilityTest,
    HarnessFactory,
)
from .end_to_end import EndToEndTests
from .inbox import InboxTests
from .leases import JOURNALS, LeaseTests
from .multi_process import MultiProcessTests
from .ops import OpsTests
from .outbox import OutboxTests
from .records import inbound, outbound
from .scopes import ScopeTests
from .survival import SurvivalTests

__all__ = [
    "FAR",
    "INC_1",
    "INC_2",
    "INF",
    "JOURNALS",
    "LEASE_MS",
    "OWNER_A",
    "OWNER_B",
    "T0",
    "DurabilityConformance",
    "DurabilitySuiteBase",
    "DurabilityTest",
    "EndToEndTests",
    "HarnessFactory",
    "InboxTests",
    "LeaseTests",
    "MultiProcessTests",
    "OpsTests",
    "OutboxTests",
    "ScopeTests",
    "SurvivalTests",
    "inbound",
    "outbound",
]


# pytest collects a class's tests base by base in reverse MRO order, so the concerns are
# listed last first: the suite's items keep their order (inbox first, end to end last).
class DurabilityConformance(
    EndToEndTests,
    MultiProcessTests,
    SurvivalTests,
    ScopeTests,
    OpsTests,
    OutboxTests,
    LeaseTests,
    InboxTests,
):
    """The durability backend conformance suite (BACK-7): every mixin of this package.

    Bind it by subclassing (the subclass's name must match pytest's ``python_classes``,
    ``Test*`` by default) and overriding the ``botmesh_harness_factory`` fixture to
    return ``factory(workdir) -> BackendHarness`` (what
    :func:`botmesh_testkit.backends.resolve` returns). The class attributes of
    :class:`DurabilitySuiteBase` (``timeout_seconds``, ``concurrent_tasks``,
    ``clean_up_records``) and of :class:`MultiProcessTests` (``processes``,
    ``process_records``, ``process_rounds``, ``process_seed``) may be overridden as well.
    """
