"""Conformance suite of the :class:`~botmesh.core.spi.DurableKv` contract (BACK-7).

Subclass :class:`DurableKvConformance` and provide the ``kv_factory`` fixture::

    import pytest
    from botmesh_testkit.conformance.kv import DurableKvConformance

    class TestMyKv(DurableKvConformance):
        @pytest.fixture
        def kv_factory(self, tmp_path):
            return lambda: MyKv(path=tmp_path / "db")

Each call of the factory must return a **new, unopened** ``DurableKv`` on the **same**
storage. A backend whose storage is a shared server may hand out the same database to
every test: each test works in scopes of its own, named with a fresh random tag, and
deletes what it wrote when it is done (best effort).

What is checked, sentence by sentence of the docstrings of
:class:`~botmesh.core.spi.DurableKv` (the spec ids are on each test, in its docstring
and in ``@pytest.mark.spec``):

* compare-and-set with versions — BACK-7, and LEASE-2 where fencing relies on a stale
  version being refused;
* values round-trip exactly and are copies; keys up to 512 characters;
* odd inputs (issue 13): keys, scopes, spaces, scores, bounds and versions outside the
  contract refused with ``InvalidKeyError``/``InvalidArgumentError`` and values outside
  it with ``TypeError``/``ValueError`` — never a driver's own exception, never stored as
  something else, nothing changed — and odd-but-valid keys and values round-trip;
* both ordered indexes (``"due"``, ``"expires"``): ascending ``(score, key)``,
  ``upto`` inclusive, ``float('inf')``, ``limit``, entries that move, vanish and come
  back with ``put`` and vanish with ``delete``; an unknown index name refused with
  ``ValueError``;
* ``scan``: code-point key order, ``after``, ``limit``;
* scope (SCOPE-2) and space isolation;
* atomicity under concurrency: exactly one winner per CAS (REPL-1), exact counters;
* with ``multi_process``, the same between real processes: 4 processes, each with its
  own kv on the storage, make CAS increments on the same keys and none is lost (the
  ``kv_factory`` callable is pickled into them with dill);
* lifecycle: calls after ``close()`` raise ``BackendUnavailableError``; ``open`` and
  ``close`` are idempotent;
* survival of a process death, only when ``capabilities.survives_crash`` is claimed
  (otherwise the test is skipped with ``capability not claimed: survives_crash``);
* a Hypothesis state machine running the same random operations against the backend and
  against :class:`~botmesh.core.MemoryKv` (the reference), comparing every result
  and every ``VersionConflict``.

Every failure message starts with the spec id and states the contract sentence that was
broken, then what the backend did. The tests are plain synchronous pytest functions that
run their coroutine with :func:`asyncio.run`; no pytest plugin is needed to import or
run this package. Tuning knobs are class attributes (``timeout_seconds``,
``concurrent_tasks``, ``stateful_max_examples``, ``stateful_step_count``).

The suite is composed of one mixin class per concern (the style of fsspec's abstract
tests), each in a module of this package: :mod:`.cas`, :mod:`.values`, :mod:`.indexes`,
:mod:`.inputs`, :mod:`.scan`, :mod:`.isolation`, :mod:`.concurrency`, :mod:`.lifecycle`,
:mod:`.survival`, :mod:`.multi_process` and :mod:`.agreement` (the state machine), on the common ground of
:mod:`.base` (the fixture, the runner, :class:`Scopes`). :class:`DurableKvConformance`
is all of them; a project may bind fewer (``class TestMine(CasTests, ScanTests)``).
"""

from __future__ import annotations

from .agreement import AgreementTests, make_agreement_machine
from .base import INF, SPACES, KvFactory, KvSuiteBase, Scopes, T, crash
from .cas import CasTests
from .concurrency import ConcurrencyTests
from .indexes import IndexTests
from .inputs import InputTests
from .isolation import IsolationTests
from .lifecycle import LifecycleTests
from .multi_process import MultiProcessKvTests
from .scan import ScanTests
from .survival import SurvivalTests
from .values import ValueTests

__all__ = [
    "INF",
    "SPACES",
    "AgreementTests",
    "CasTests",
    "ConcurrencyTests",
    "DurableKvConformance",
    "IndexTests",
    "InputTests",
    "IsolationTests",
    "KvFactory",
    "KvSuiteBase",
    "LifecycleTests",
    "MultiProcessKvTests",
    "ScanTests",
    "Scopes",
    "SurvivalTests",
    "T",
    "ValueTests",
    "crash",
    "make_agreement_machine",
]


# pytest collects a class's tests base by base in reverse MRO order, so the concerns are
# listed last first: the suite's items keep their order (compare-and-set first, the
# state machine last).
class DurableKvConformance(
    AgreementTests,
    MultiProcessKvTests,
    SurvivalTests,
    LifecycleTests,
    ConcurrencyTests,
    IsolationTests,
    ScanTests,
    IndexTests,
    InputTests,
    ValueTests,
    CasTests,
):
    """The :class:`~botmesh.core.spi.DurableKv` conformance suite (BACK-7): every mixin
    of this package.

    Bind it by subclassing (the subclass's name must match pytest's ``python_classes``,
    ``Test*`` by default) and overriding the ``kv_factory`` fixture to return a
    zero-argument callable that builds a new, unopened kv on the same storage at each
    call. The tuning knobs may be overridden as well: ``timeout_seconds``
    (:class:`KvSuiteBase`), ``concurrent_tasks`` (:class:`ConcurrencyTests`),
    ``stateful_max_examples`` and ``stateful_step_count`` (:class:`AgreementTests`),
    ``processes``, ``process_increments``, ``process_keys``, ``process_rounds`` and
    ``process_seed`` (:class:`MultiProcessKvTests`).
    """
