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
* both ordered indexes (``"due"``, ``"expires"``): ascending ``(score, key)``,
  ``upto`` inclusive, ``float('inf')``, ``limit``, entries that move, vanish and come
  back with ``put`` and vanish with ``delete``; an unknown index name refused with
  ``ValueError``;
* ``scan``: code-point key order, ``after``, ``limit``;
* scope (SCOPE-2) and space isolation;
* atomicity under concurrency: exactly one winner per CAS (REPL-1), exact counters;
* lifecycle: calls after ``close()`` raise ``BackendUnavailableError``; ``open`` and
  ``close`` are idempotent;
* survival of a process death, only when ``capabilities.survives_crash`` is claimed
  (otherwise the test is skipped with ``capability not claimed: survives_crash``);
* a Hypothesis state machine running the same random operations against the backend and
  against :class:`~botmesh.core.spi.MemoryKv` (the reference), comparing every result
  and every ``VersionConflict``.

Every failure message starts with the spec id and states the contract sentence that was
broken, then what the backend did. The tests are plain synchronous pytest functions that
run their coroutine with :func:`asyncio.run`; no pytest plugin is needed to import or
run this module. Tuning knobs are class attributes (``timeout_seconds``,
``concurrent_tasks``, ``stateful_max_examples``, ``stateful_step_count``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypedDict, TypeVar

import pytest
from botmesh.core.errors import BackendUnavailableError, VersionConflict
from botmesh.core.spi import INDEXES, DurableKv, IndexName, MemoryKv, Versioned
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

__all__ = [
    "SPACES",
    "DurableKvConformance",
    "KvFactory",
    "Scopes",
    "crash",
    "make_agreement_machine",
]

T = TypeVar("T")

KvFactory = Callable[[], DurableKv]
"""What the ``kv_factory`` fixture returns: each call gives a new, unopened kv on the
same storage."""

SPACES: tuple[str, ...] = ("inbox", "outbox", "archive_1")
"""The spaces the suite writes to: the two the engine uses and one more, since a backend
must accept any short identifier-like space name."""

INF = math.inf

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


class Scopes:
    """Fresh scope names for one test, so that tests never see each other's records even
    on a shared server. ``b`` starts with ``a`` and adds characters that are special in
    key prefixes and SQL patterns (``:``, ``/``, ``%``, ``_``), so that a backend matching
    scopes by prefix or by pattern leaks and is caught."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:12]
        self.a = f"conformance/{tag}/a"
        self.b = f"conformance/{tag}/a:%_b"

    @property
    def all(self) -> tuple[str, str]:
        """Both scopes."""
        return (self.a, self.b)


_Body = Callable[[DurableKv, Scopes], Coroutine[Any, Any, None]]
"""A test's coroutine: it gets an open kv and the test's scopes."""


def crash(kv: DurableKv) -> None:
    """Let ``kv`` go as a dead process would: no ``close()``. A kv with an ``abandon()``
    method (release in-process handles and locks without flushing anything, as
    :class:`botmesh.core.file_backend.FileKv` has) gets it called; the caller then drops
    its last reference."""
    abandon = getattr(kv, "abandon", None)
    if callable(abandon):
        abandon()


async def _expect_conflict(call: Awaitable[Any], message: str) -> None:
    """Await ``call``; it must raise ``VersionConflict``. Otherwise fail with
    ``message`` and what happened instead."""
    try:
        result = await call
    except VersionConflict:
        return
    except Exception as exc:  # the backend raised the wrong type: say which
        raise AssertionError(f"{message}; it raised {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{message}; it returned {result!r} and raised nothing")


async def _expect_unavailable(call: Awaitable[Any], message: str) -> None:
    """Await ``call``; it must raise ``BackendUnavailableError``."""
    try:
        result = await call
    except BackendUnavailableError:
        return
    except Exception as exc:
        raise AssertionError(f"{message}; it raised {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{message}; it returned {result!r} and raised nothing")


async def _guarded(call: Awaitable[T]) -> T:
    """Await a test's coroutine, turning an error a kv raised where the contract says the
    call succeeds into an ``AssertionError`` that names the contract (the original stays
    chained, with its traceback)."""
    try:
        return await call
    except AssertionError:
        raise
    except VersionConflict as exc:
        raise AssertionError(
            "BACK-7: a put()/delete() with the record's current version must succeed (a record's version is 1 "
            "when it is created and grows by exactly 1 with every successful put); the kv raised "
            f"VersionConflict: {exc}"
        ) from exc
    except BackendUnavailableError as exc:
        raise AssertionError(
            f"BACK-7: a call on an open kv must succeed; the kv raised BackendUnavailableError: {exc}"
        ) from exc
    except Exception as exc:
        raise AssertionError(
            "BACK-7: errors of the underlying driver are raised as BackendUnavailableError (never the "
            f"driver's type), and a valid call must succeed; the kv raised {type(exc).__name__}: {exc}"
        ) from exc


async def _state(kv: DurableKv, scope: str, space: str) -> dict[str, Any]:
    """Everything a kv shows of ``(scope, space)``: every record by scan, and both
    indexes in full."""
    return {
        "records": await kv.scan(scope, space, after=None, limit=10_000),
        **{index: await kv.range(scope, space, index, upto=INF, limit=10_000) for index in INDEXES},
    }


async def _probe(kv: DurableKv, scope: str, space: str) -> dict[str, Any]:
    """:func:`_state` plus a few cut-off reads (``upto`` in the middle of the scores the
    state machine uses, small limits, ``after``), so that a wrong ``range`` or ``scan``
    is seen right after the write that exposes it: short failing examples shrink fast."""
    probe = await _state(kv, scope, space)
    for index in INDEXES:
        probe[f"{index} upto=1.0"] = await kv.range(scope, space, index, upto=1.0, limit=10_000)
        probe[f"{index} limit=2"] = await kv.range(scope, space, index, upto=INF, limit=2)
    probe["scan after='k10' limit=2"] = await kv.scan(scope, space, after="k10", limit=2)
    return probe


async def _cleanup(kv: DurableKv, scopes: Scopes) -> None:
    """Delete what a test wrote (best effort: a broken or closed kv must not hide the
    test's own failure)."""
    try:
        for scope in scopes.all:
            for space in SPACES:
                for key, found in await kv.scan(scope, space, after=None, limit=10_000):
                    with contextlib.suppress(Exception):
                        await kv.delete(scope, space, key, expected_version=found.version)
    except Exception:  # noqa: BLE001, S110 - best effort, see the docstring
        pass


# --------------------------------------------------------------------------------------
# the model-based test: the backend against MemoryKv, step by step
# --------------------------------------------------------------------------------------

_SCOPE_CHOICES = st.sampled_from(["a", "b"])
_SPACE_CHOICES = st.sampled_from(["inbox", "outbox"])
# Code-point order "k1" < "k10" < "k2" < "é": scans must agree on it.
_KEY_CHOICES = st.sampled_from(["k1", "k10", "k2", "é"])
_VERSION_CHOICES = st.sampled_from(["current", "zero", "ahead", "behind"])
# Few distinct scores, so that ties (broken by key) and exact `upto` hits are frequent.
_SCORES = st.sampled_from([None, 0.0, 1.0, 2.5, 1_700_000_000_000.5])
_UPTO = st.sampled_from([-1.0, 0.0, 1.0, 2.5, 1e12, 1_700_000_000_000.5, INF])
_LIMITS = st.sampled_from([0, 1, 2, 3, 100])
_AFTER = st.sampled_from([None, "", "k1", "k10", "k15", "é", "z"])
# A handful of values, one draw each: the value tests cover contents; here values only
# need to differ, and few draws keep shrinking quick.
_VALUES = st.sampled_from(
    [
        {"n": 0},
        {"n": 1, "s": "é✓🤖"},
        {"n": 2, "l": [0, 1.5, None, True, "y"], "o": {"k": {}}},
        {},
    ]
)


def make_agreement_machine(
    factory: KvFactory, *, survives_crash: bool, timeout: float
) -> type[RuleBasedStateMachine]:
    """A state machine that applies each random operation to a kv from ``factory`` and
    to a :class:`MemoryKv`, and fails as soon as a result (a return value, or a raised
    ``VersionConflict``) differs, or — after a write — the records and index entries of
    the ``(scope, space)`` written differ. With ``survives_crash`` it also kills and
    reopens the kv (or closes and reopens it) between steps; nothing may be lost."""

    class DurableKvAgreement(RuleBasedStateMachine):
        """Random CAS puts (current, zero, ahead and behind versions), deletes, gets,
        ranges on both indexes and scans over 2 scopes x 2 spaces x 4 keys."""

        def __init__(self) -> None:
            super().__init__()
            # The kv is async and Hypothesis drives rules synchronously: each step is one
            # coroutine run on this machine's own loop, closed in teardown.
            self.loop = asyncio.new_event_loop()
            self.scopes = Scopes()
            self.oracle = MemoryKv()
            self.kv: DurableKv | None = None
            try:
                self._step(self.oracle.open())
                self.kv = factory()
                self._step(self.kv.open())
            except BaseException:
                self.loop.close()
                raise

        # -- plumbing ---------------------------------------------------------------
        def _step(self, call: Awaitable[T]) -> T:
            return self.loop.run_until_complete(asyncio.wait_for(call, timeout))

        def _scope(self, name: str) -> str:
            return self.scopes.a if name == "a" else self.scopes.b

        def _backend(self) -> DurableKv:
            assert self.kv is not None, "internal: the kv under test is not open"
            return self.kv

        @staticmethod
        async def _outcome(call: Awaitable[Any]) -> tuple[str, Any]:
            try:
                return ("returned", await call)
            except VersionConflict:
                return ("raised", "VersionConflict")
            except Exception as exc:  # noqa: BLE001 - any other error is a disagreement to report
                return ("raised", f"{type(exc).__name__}: {exc}")

        async def _agree(
            self,
            what: str,
            call: Callable[[DurableKv], Awaitable[Any]],
            written: tuple[str, str, str] | None = None,
        ) -> None:
            """Run ``call`` on the reference, then on the backend; the outcomes must be
            equal, and after a write to ``written`` = (scope name, scope, space) so must
            everything the two show of that (scope, space)."""
            kv = self._backend()
            expected = await self._outcome(call(self.oracle))
            got = await self._outcome(call(kv))
            assert got == expected, (
                "BACK-7: the backend must behave exactly like the reference MemoryKv for the "
                f"same operations; {what}: MemoryKv {expected[0]} {expected[1]!r}, "
                f"the backend {got[0]} {got[1]!r}"
            )
            if written is not None:
                await self._same_state(*written, after=what)

        async def _same_state(self, name: str, scope: str, space: str, *, after: str) -> None:
            expected_state = await _probe(self.oracle, scope, space)
            got_state = await self._outcome(_probe(self._backend(), scope, space))
            assert got_state == ("returned", expected_state), (
                "BACK-7: every record and index entry must be exactly the reference MemoryKv's after "
                f"the same operations; after {after}, scope {name!r}, space {space!r}: MemoryKv has "
                f"{expected_state!r}, the backend {got_state[0]} {got_state[1]!r}"
            )

        async def _version(self, mode: str, scope: str, space: str, key: str) -> int:
            found = await self.oracle.get(scope, space, key)
            current = 0 if found is None else found.version
            if mode == "current":
                return current
            if mode == "zero":
                return 0
            if mode == "ahead":
                return current + 1
            return current - 1 if current >= 2 else current + 2  # "behind" (stale)

        # -- rules --------------------------------------------------------------------
        # Where puts went: replace/remove draw from it, so that writes over an existing
        # record (moving or removing its index entries) are frequent.
        written = Bundle("written")

        async def _write(
            self, scope: str, space: str, key: str, version: str, value: dict[str, Any] | None,
            due: float | None, expires: float | None,
        ) -> None:
            s = self._scope(scope)
            n = await self._version(version, s, space, key)
            if value is None:
                await self._agree(
                    f"delete({scope!r}, {space!r}, {key!r}, expected_version={n})",
                    lambda kv: kv.delete(s, space, key, expected_version=n),
                    written=(scope, s, space),
                )
            else:
                await self._agree(
                    f"put({scope!r}, {space!r}, {key!r}, {value!r}, expected_version={n}, "
                    f"due={due!r}, expires={expires!r})",
                    lambda kv: kv.put(s, space, key, value, expected_version=n, due=due, expires=expires),
                    written=(scope, s, space),
                )

        @rule(
            target=written,
            scope=_SCOPE_CHOICES,
            space=_SPACE_CHOICES,
            key=_KEY_CHOICES,
            version=_VERSION_CHOICES,
            value=_VALUES,
            due=_SCORES,
            expires=_SCORES,
        )
        def put(
            self,
            scope: str,
            space: str,
            key: str,
            version: str,
            value: dict[str, Any],
            due: float | None,
            expires: float | None,
        ) -> tuple[str, str, str]:
            self._step(self._write(scope, space, key, version, value, due, expires))
            return (scope, space, key)

        @rule(where=written, value=_VALUES, due=_SCORES, expires=_SCORES)
        def replace(
            self, where: tuple[str, str, str], value: dict[str, Any], due: float | None, expires: float | None
        ) -> None:
            """A put with the current version where an earlier put went."""
            self._step(self._write(*where, "current", value, due, expires))

        @rule(scope=_SCOPE_CHOICES, space=_SPACE_CHOICES, key=_KEY_CHOICES, version=_VERSION_CHOICES)
        def delete(self, scope: str, space: str, key: str, version: str) -> None:
            self._step(self._write(scope, space, key, version, None, None, None))

        @rule(where=written, version=_VERSION_CHOICES)
        def remove(self, where: tuple[str, str, str], version: str) -> None:
            """A delete where an earlier put went."""
            self._step(self._write(*where, version, None, None, None))

        @rule(scope=_SCOPE_CHOICES, space=_SPACE_CHOICES, key=_KEY_CHOICES)
        def get(self, scope: str, space: str, key: str) -> None:
            s = self._scope(scope)
            self._step(self._agree(f"get({scope!r}, {space!r}, {key!r})", lambda kv: kv.get(s, space, key)))

        @rule(
            scope=_SCOPE_CHOICES,
            space=_SPACE_CHOICES,
            index=st.sampled_from(INDEXES),
            upto=_UPTO,
            limit=_LIMITS,
        )
        def range(self, scope: str, space: str, index: IndexName, upto: float, limit: int) -> None:
            s = self._scope(scope)
            self._step(
                self._agree(
                    f"range({scope!r}, {space!r}, {index!r}, upto={upto!r}, limit={limit})",
                    lambda kv: kv.range(s, space, index, upto=upto, limit=limit),
                )
            )

        @rule(scope=_SCOPE_CHOICES, space=_SPACE_CHOICES, after=_AFTER, limit=_LIMITS)
        def scan(self, scope: str, space: str, after: str | None, limit: int) -> None:
            s = self._scope(scope)
            self._step(
                self._agree(
                    f"scan({scope!r}, {space!r}, after={after!r}, limit={limit})",
                    lambda kv: kv.scan(s, space, after=after, limit=limit),
                )
            )

        @rule()
        def everything(self) -> None:
            """All four (scope, space) pairs agree in full (records and both indexes)."""

            async def step() -> None:
                for name in ("a", "b"):
                    for space in ("inbox", "outbox"):
                        await self._same_state(name, self._scope(name), space, after="the steps so far")

            self._step(step())

        @precondition(lambda self: survives_crash)
        @rule(how=st.sampled_from(["crash", "close"]))
        def reopen(self, how: str) -> None:
            """The process dies (or closes the kv) and a new instance opens the same
            storage: every acknowledged write is still there (``survives_crash``)."""
            kv = self._backend()
            if how == "crash":
                crash(kv)
            else:
                self._step(kv.close())
            # Dropping the last reference is enough here (no gc.collect(): it would cost
            # more than the whole step); the crash test does a full collection.
            self.kv = None
            del kv
            self.kv = factory()
            self._step(self.kv.open())

            async def step() -> None:
                for name in ("a", "b"):
                    for space in ("inbox", "outbox"):
                        await self._same_state(name, self._scope(name), space, after=f"reopen(how={how!r})")

            self._step(step())

        def teardown(self) -> None:
            try:
                if self.kv is not None:
                    self._step(_cleanup(self.kv, self.scopes))
                    self._step(self.kv.close())
            finally:
                self.loop.close()

    return DurableKvAgreement


# --------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------


class DurableKvConformance:
    """The :class:`~botmesh.core.spi.DurableKv` conformance suite (BACK-7).

    Bind it by subclassing (the subclass's name must match pytest's ``python_classes``,
    ``Test*`` by default) and overriding the ``kv_factory`` fixture to return a
    zero-argument callable that builds a new, unopened kv on the same storage at each
    call. The class attributes below may be overridden as well.
    """

    timeout_seconds: ClassVar[float] = 60.0
    """Upper bound for one test's coroutine (and for one step of the state machine)."""
    concurrent_tasks: ClassVar[int] = 50
    """How many tasks race for one CAS."""
    stateful_max_examples: ClassVar[int] = 30
    """Hypothesis ``max_examples`` of the model-based test."""
    stateful_step_count: ClassVar[int] = 30
    """Hypothesis ``stateful_step_count`` of the model-based test."""

    @pytest.fixture
    def kv_factory(self) -> KvFactory:
        """Override me: return a callable giving a new, unopened ``DurableKv`` on the
        same storage at each call."""
        raise NotImplementedError(
            f"{type(self).__name__} must define a `kv_factory` fixture returning a zero-argument "
            "callable that builds a new, unopened DurableKv on the same storage"
        )

    # -- running -------------------------------------------------------------------------
    def run_kv(self, kv_factory: KvFactory, body: _Body) -> None:
        """Open a kv from ``kv_factory``, run ``body(kv, scopes)`` on a fresh event loop,
        then delete what it wrote and close the kv."""

        async def main() -> None:
            kv = kv_factory()
            await kv.open()
            scopes = Scopes()
            try:
                await _guarded(body(kv, scopes))
            except BaseException:
                try:
                    await _cleanup(kv, scopes)
                    await kv.close()
                except Exception:  # noqa: BLE001, S110 - the test's own failure is the one to report
                    pass
                raise
            await _cleanup(kv, scopes)
            await kv.close()

        asyncio.run(asyncio.wait_for(main(), self.timeout_seconds))

    @staticmethod
    def claims_survives_crash(kv_factory: KvFactory) -> bool:
        """Whether the kv claims ``capabilities.survives_crash`` (read from an instance
        that is never opened)."""
        return bool(kv_factory().capabilities.survives_crash)

    # -- compare-and-set -----------------------------------------------------------------
    @pytest.mark.spec("BACK-7")
    def test_create_if_absent_returns_version_1(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``put(expected_version=0)`` creates an absent record and returns 1;
        ``get`` returns it with version 1; ``get`` of an absent key returns None."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            absent = await kv.get(s.a, "inbox", "k")
            assert absent is None, f"BACK-7: get() of a key never written must return None; got {absent!r}"
            v = await kv.put(s.a, "inbox", "k", {"n": 1}, expected_version=0)
            assert v == 1, (
                "BACK-7: put() with expected_version=0 creates the record and must return version 1 "
                f"(a record's version is 1 when it is created); got {v!r}"
            )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"n": 1}, 1), (
                f"BACK-7: get() after a create must return the value written with version 1; got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_create_on_existing_key_conflicts_and_changes_nothing(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``put(expected_version=0)`` fails when the record exists: it raises
        ``VersionConflict`` and nothing changes (value, version, index entries)."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {"n": 1}, expected_version=0, due=10.0, expires=20.0)
            before = await _state(kv, s.a, "inbox")
            await _expect_conflict(
                kv.put(s.a, "inbox", "k", {"n": 2}, expected_version=0, due=5.0, expires=None),
                "BACK-7: put() with expected_version=0 on an existing key must fail with VersionConflict "
                "(expected_version=0 creates the record and fails when it exists)",
            )
            after = await _state(kv, s.a, "inbox")
            assert after == before, (
                "BACK-7: on a failed put() nothing changes (value, version and index entries); "
                f"before {before!r}, after {after!r}"
            )
            v = await kv.put(s.a, "inbox", "k", {"n": 3}, expected_version=1)
            assert v == 2, f"BACK-7: put() with expected_version=1 must return 2 (versions grow by exactly 1); got {v!r}"
            await _expect_conflict(
                kv.put(s.a, "inbox", "k", {"n": 4}, expected_version=0),
                "BACK-7: put() with expected_version=0 on a key at version 2 must fail with VersionConflict "
                "(expected_version=0 creates the record and fails when it exists)",
            )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"n": 3}, 2), (
                f"BACK-7: on a failed put() nothing changes; expected ({{'n': 3}}, 2), got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_replace_with_current_version_returns_next_version(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``put(expected_version=n)`` on a record at version n replaces it and
        returns n + 1 (versions grow by exactly 1 with every successful put)."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            v = await kv.put(s.a, "outbox", "k", {"i": 0}, expected_version=0)
            for i in range(1, 8):
                new = await kv.put(s.a, "outbox", "k", {"i": i}, expected_version=v)
                assert new == v + 1, (
                    f"BACK-7: put() with expected_version={v} must return {v + 1} "
                    f"(versions grow by exactly 1); got {new!r}"
                )
                got = await kv.get(s.a, "outbox", "k")
                assert got == Versioned({"i": i}, v + 1), (
                    f"BACK-7: get() after a replace must return the new value at version {v + 1}; got {got!r}"
                )
                v = new

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7", "LEASE-2")
    def test_stale_or_future_version_is_refused_and_nothing_changes(self, kv_factory: KvFactory) -> None:
        """BACK-7, LEASE-2: ``put(expected_version=n)`` fails with ``VersionConflict``
        when the current version is another — a writer holding an older version (an
        expired owner) can never overwrite a newer record; nothing changes (value,
        version, index entries)."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {"v": 1}, expected_version=0, due=1.0, expires=None)
            await kv.put(s.a, "inbox", "k", {"v": 2}, expected_version=1, due=2.0, expires=None)
            await kv.put(s.a, "inbox", "k", {"v": 3}, expected_version=2, due=3.0, expires=30.0)
            before = await _state(kv, s.a, "inbox")
            for stale in (1, 2, 4, 99):
                await _expect_conflict(
                    kv.put(s.a, "inbox", "k", {"v": "stale"}, expected_version=stale, due=0.5, expires=None),
                    f"BACK-7/LEASE-2: put() with expected_version={stale} on a record at version 3 must fail "
                    "with VersionConflict (it fails when the current version is another)",
                )
                after = await _state(kv, s.a, "inbox")
                assert after == before, (
                    f"BACK-7/LEASE-2: a put() refused for expected_version={stale} must change nothing "
                    f"(value, version, index entries); before {before!r}, after {after!r}"
                )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"v": 3}, 3), f"BACK-7/LEASE-2: the record must stay at ({{'v': 3}}, 3); got {got!r}"

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_replace_of_absent_record_conflicts(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``put(expected_version=n > 0)`` fails with ``VersionConflict`` when
        the record is absent, and creates nothing (no record, no index entry)."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            for n in (1, 2):
                await _expect_conflict(
                    kv.put(s.a, "inbox", "ghost", {"x": 1}, expected_version=n, due=1.0, expires=1.0),
                    f"BACK-7: put() with expected_version={n} on an absent key must fail with VersionConflict "
                    "(it fails when the record is absent)",
                )
            state = await _state(kv, s.a, "inbox")
            assert state == {"records": [], "due": [], "expires": []}, (
                f"BACK-7: a failed put() must create nothing (no record, no index entry); found {state!r}"
            )
            got = await kv.get(s.a, "inbox", "ghost")
            assert got is None, f"BACK-7: a failed put() must create nothing; get() returned {got!r}"

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_delete_with_current_version_removes_record_and_index_entries(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``delete(expected_version=n)`` on a record at version n removes the
        record and both its index entries."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "gone", {"x": 1}, expected_version=0, due=1.0, expires=2.0)
            await kv.put(s.a, "inbox", "gone", {"x": 2}, expected_version=1, due=3.0, expires=4.0)
            await kv.put(s.a, "inbox", "kept", {"y": 1}, expected_version=0, due=3.0, expires=4.0)
            await kv.delete(s.a, "inbox", "gone", expected_version=2)
            got = await kv.get(s.a, "inbox", "gone")
            assert got is None, f"BACK-7: delete() must remove the record; get() still returns {got!r}"
            state = await _state(kv, s.a, "inbox")
            expected = {
                "records": [("kept", Versioned({"y": 1}, 1))],
                "due": [(3.0, "kept")],
                "expires": [(4.0, "kept")],
            }
            assert state == expected, (
                "BACK-7: delete() removes the record and its index entries (and nothing else); "
                f"expected {expected!r}, found {state!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7", "LEASE-2")
    def test_delete_with_wrong_version_conflicts_and_changes_nothing(self, kv_factory: KvFactory) -> None:
        """BACK-7, LEASE-2: ``delete`` raises ``VersionConflict`` when the record is at
        another version, and nothing changes."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "outbox", "k", {"x": 1}, expected_version=0, due=1.0, expires=2.0)
            await kv.put(s.a, "outbox", "k", {"x": 2}, expected_version=1, due=5.0, expires=6.0)
            before = await _state(kv, s.a, "outbox")
            for wrong in (0, 1, 3):
                await _expect_conflict(
                    kv.delete(s.a, "outbox", "k", expected_version=wrong),
                    f"BACK-7: delete() with expected_version={wrong} on a record at version 2 must raise "
                    "VersionConflict (it raises when the record is at another version)",
                )
                after = await _state(kv, s.a, "outbox")
                assert after == before, (
                    f"BACK-7: a refused delete(expected_version={wrong}) must change nothing; "
                    f"before {before!r}, after {after!r}"
                )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_delete_of_absent_record_conflicts(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``delete`` raises ``VersionConflict`` when the record is absent —
        never written, or already deleted."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            for n in (0, 1):
                await _expect_conflict(
                    kv.delete(s.a, "inbox", "never", expected_version=n),
                    f"BACK-7: delete(expected_version={n}) of an absent key must raise VersionConflict "
                    "(it raises when the record is absent)",
                )
            await kv.put(s.a, "inbox", "once", {"x": 1}, expected_version=0)
            await kv.delete(s.a, "inbox", "once", expected_version=1)
            await _expect_conflict(
                kv.delete(s.a, "inbox", "once", expected_version=1),
                "BACK-7: a second delete() of a deleted record must raise VersionConflict "
                "(it raises when the record is absent)",
            )
            await _expect_conflict(
                kv.put(s.a, "inbox", "once", {"x": 2}, expected_version=1),
                "BACK-7: put() with expected_version=1 on a deleted record must fail with VersionConflict "
                "(it fails when the record is absent)",
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_recreate_after_delete_starts_again_at_version_1(self, kv_factory: KvFactory) -> None:
        """BACK-7: a record created again after a delete is a new record: version 1,
        with the index entries of the new ``put`` only."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {"gen": 1}, expected_version=0, due=1.0, expires=9.0)
            await kv.put(s.a, "inbox", "k", {"gen": 1}, expected_version=1, due=1.0, expires=9.0)
            await kv.delete(s.a, "inbox", "k", expected_version=2)
            v = await kv.put(s.a, "inbox", "k", {"gen": 2}, expected_version=0, due=None, expires=3.0)
            assert v == 1, f"BACK-7: a record's version is 1 when it is created (again, after a delete); got {v!r}"
            state = await _state(kv, s.a, "inbox")
            expected = {"records": [("k", Versioned({"gen": 2}, 1))], "due": [], "expires": [(3.0, "k")]}
            assert state == expected, (
                "BACK-7: the re-created record has exactly the value and index entries of its create; "
                f"expected {expected!r}, found {state!r}"
            )

        self.run_kv(kv_factory, body)

    # -- values and keys -----------------------------------------------------------------
    @pytest.mark.spec("BACK-7")
    def test_values_round_trip_exactly(self, kv_factory: KvFactory) -> None:
        """BACK-7: the backend stores and returns a JSON object unchanged — nested
        structures, every JSON type, unicode, escapes, big integers, about 100 KB — from
        ``get`` and from ``scan``."""
        big_text = "".join(chr(0x20 + (i * 7) % 0x2000) for i in range(50_000))
        values: dict[str, dict[str, Any]] = {
            "empty": {},
            "types": {
                "null": None,
                "true": True,
                "false": False,
                "int": -42,
                "big_int": 2**64 + 1,
                "float": 1.5,
                "small": 1e-7,
                "huge": 1.7976931348623157e308,
                "third": 0.1 + 0.2,
                "str": "",
                "list": [],
                "obj": {},
            },
            "nested": {"a": {"b": {"c": [1, [2, [3, {"d": [None, {"e": "deep"}]}]]]}}, "list": [{"x": i} for i in range(50)]},
            "unicode": {
                "text": "héllo wörld — ✓ 日本語 ﷺ 🤖👍🏽",
                "ключ": "значение",
                "🔑": "emoji key",
                "escapes": "quote \" apostrophe ' backslash \\ newline \n tab \t cr \r",
            },
            "large": {"blob": big_text, "items": [{"i": i, "s": "é✓" * 10} for i in range(1000)]},
        }
        assert len(str(values["large"])) > 100_000

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key, value in values.items():
                await kv.put(s.a, "inbox", key, value, expected_version=0)
            for key, value in values.items():
                got = await kv.get(s.a, "inbox", key)
                assert got is not None and got.value == value and got.version == 1, (
                    "BACK-7: the backend stores and returns a JSON object unchanged; "
                    f"get() of {key!r} returned a different value or version ({_short(got)})"
                )
                assert type(got.value) is dict, (
                    f"BACK-7: a record's value is a dict; get() of {key!r} returned a {type(got.value).__name__}"
                )
            scanned = dict(await kv.scan(s.a, "inbox", limit=100))
            for key, value in values.items():
                assert key in scanned and scanned[key] == Versioned(value, 1), (
                    "BACK-7: the backend stores and returns a JSON object unchanged; "
                    f"scan() returned a different value or version for {key!r} ({_short(scanned.get(key))})"
                )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_values_with_control_characters_round_trip(self, kv_factory: KvFactory) -> None:
        """BACK-7: a value is any JSON object ``json.dumps`` accepts — strings with
        control characters, U+0000 included, round-trip unchanged."""
        value = {"controls": "".join(chr(c) for c in range(0x20)) + "\x7f", "nul": "a\x00b", "\x00key": 1}

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "controls", value, expected_version=0)
            got = await kv.get(s.a, "inbox", "controls")
            assert got == Versioned(value, 1), (
                "BACK-7: the backend stores and returns a JSON object unchanged (control characters and "
                f"U+0000 included); got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_values_are_copies(self, kv_factory: KvFactory) -> None:
        """BACK-7: what is stored is a copy: mutating the dict given to ``put``, or a
        value returned by ``get`` or ``scan``, never changes what is stored."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            given: dict[str, Any] = {"list": [1, 2], "obj": {"a": 1}}
            await kv.put(s.a, "inbox", "k", given, expected_version=0)
            given["list"].append(3)
            given["obj"]["a"] = 2
            given["new"] = True
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"list": [1, 2], "obj": {"a": 1}}, 1), (
                "BACK-7: the backend stores a copy: mutating the dict passed to put() afterwards must not "
                f"change what is stored; get() returned {got!r}"
            )
            assert got is not None
            got.value["list"].append(99)
            got.value["obj"]["a"] = 99
            got.value["added"] = 1
            again = await kv.get(s.a, "inbox", "k")
            assert again == Versioned({"list": [1, 2], "obj": {"a": 1}}, 1), (
                "BACK-7: a returned value is a copy: mutating what get() returned must not change what is "
                f"stored; get() then returned {again!r}"
            )
            page = await kv.scan(s.a, "inbox")
            assert len(page) == 1, f"BACK-7: scan() must list the one record written; got {page!r}"
            scanned = page[0][1]
            scanned.value["list"].clear()
            scanned.value["obj"].clear()
            third = await kv.get(s.a, "inbox", "k")
            assert third == Versioned({"list": [1, 2], "obj": {"a": 1}}, 1), (
                "BACK-7: a returned value is a copy: mutating what scan() returned must not change what is "
                f"stored; get() then returned {third!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_keys_up_to_512_characters_and_unicode(self, kv_factory: KvFactory) -> None:
        """BACK-7: a key is any non-empty string up to 512 characters: long keys,
        unicode keys, and keys with characters special to key prefixes or SQL patterns
        are stored, listed and indexed as given."""
        keys = [
            "x" * 512,
            "é" * 512,
            "🤖" * 512,
            "a/b:c%d_e*f?g[h]i{j}k",
            "with space and 'quotes\"",
            "%",
            "_",
        ]

        async def body(kv: DurableKv, s: Scopes) -> None:
            for i, key in enumerate(keys):
                await kv.put(s.a, "inbox", key, {"i": i}, expected_version=0, due=float(i))
            for i, key in enumerate(keys):
                got = await kv.get(s.a, "inbox", key)
                assert got == Versioned({"i": i}, 1), (
                    f"BACK-7: a key is any non-empty string up to 512 characters; get() of key #{i} "
                    f"({key[:20]!r}..., {len(key)} chars) returned {got!r}"
                )
            scanned = [k for k, _ in await kv.scan(s.a, "inbox", limit=100)]
            assert scanned == sorted(keys), (
                "BACK-7: scan() lists every key exactly as given, ascending by code point; "
                f"expected {[k[:12] for k in sorted(keys)]!r}, got {[k[:12] for k in scanned]!r}"
            )
            ranged = await kv.range(s.a, "inbox", "due", upto=INF, limit=100)
            assert ranged == [(float(i), key) for i, key in enumerate(keys)], (
                "BACK-7: range() returns the keys exactly as given; "
                f"got {[(score, k[:12]) for score, k in ranged]!r}"
            )

        self.run_kv(kv_factory, body)

    # -- ordered indexes -----------------------------------------------------------------
    @pytest.mark.spec("BACK-7")
    @pytest.mark.parametrize("index", INDEXES)
    def test_range_is_ascending_by_score_then_key(self, kv_factory: KvFactory, index: IndexName) -> None:
        """BACK-7: ``range`` lists entries in ascending ``(score, key)`` order — ties
        broken by key — with float scores; the other index is independent."""
        scores = {"k3": 3.0, "b": 2.0, "k1": 1.0, "z": 1_700_000_000_000.25, "c": 2.0, "a": 2.0, "k0": 0.0}
        other: IndexName = "expires" if index == "due" else "due"

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key, score in scores.items():
                due, expires = (score, None) if index == "due" else (None, score)
                await kv.put(s.a, "inbox", key, {"k": key}, expected_version=0, due=due, expires=expires)
            got = await kv.range(s.a, "inbox", index, upto=INF, limit=100)
            expected = sorted((score, key) for key, score in scores.items())
            assert got == expected, (
                f"BACK-7: range() of {index!r} lists entries ascending by (score, key), ties broken by key; "
                f"expected {expected!r}, got {got!r}"
            )
            assert all(type(score) is float for score, _ in got), (
                f"BACK-7: range() entries are (score, key) with a float score; got {got!r}"
            )
            rest = await kv.range(s.a, "inbox", other, upto=INF, limit=100)
            assert rest == [], (
                f"BACK-7: put() sets each index entry independently (None: no entry); the {other!r} index "
                f"must be empty, got {rest!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    @pytest.mark.parametrize("index", INDEXES)
    def test_range_upto_is_inclusive_and_may_be_infinite(self, kv_factory: KvFactory, index: IndexName) -> None:
        """BACK-7: ``range`` lists entries whose score is ``<= upto`` (inclusive);
        ``upto`` may be ``float('inf')``."""
        scores = {"a": 1.0, "b": 2.0, "c": 2.0, "d": 3.5, "e": 1_700_000_000_000.5}

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key, score in scores.items():
                due, expires = (score, None) if index == "due" else (None, score)
                await kv.put(s.a, "outbox", key, {}, expected_version=0, due=due, expires=expires)
            everything = sorted((score, key) for key, score in scores.items())
            for upto in (-1.0, 0.999, 1.0, 2.0, 2.5, 3.5, 1_700_000_000_000.0, 1_700_000_000_000.5, INF):
                got = await kv.range(s.a, "outbox", index, upto=upto, limit=100)
                expected = [entry for entry in everything if entry[0] <= upto]
                assert got == expected, (
                    f"BACK-7: range() of {index!r} lists the entries with score <= upto (inclusive; upto may be "
                    f"float('inf')); upto={upto!r}: expected {expected!r}, got {got!r}"
                )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    @pytest.mark.parametrize("index", INDEXES)
    def test_range_limit(self, kv_factory: KvFactory, index: IndexName) -> None:
        """BACK-7: ``range`` returns up to ``limit`` entries: the first ones in
        ``(score, key)`` order."""
        scores = {f"k{i}": float(i // 2) for i in range(7)}

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key, score in reversed(list(scores.items())):
                due, expires = (score, None) if index == "due" else (None, score)
                await kv.put(s.a, "inbox", key, {}, expected_version=0, due=due, expires=expires)
            everything = sorted((score, key) for key, score in scores.items())
            for limit in (0, 1, 2, 3, 6, 7, 8, 1000):
                got = await kv.range(s.a, "inbox", index, upto=INF, limit=limit)
                assert got == everything[:limit], (
                    f"BACK-7: range() of {index!r} returns up to limit entries, the first in (score, key) order; "
                    f"limit={limit}: expected {everything[:limit]!r}, got {got!r}"
                )
            got = await kv.range(s.a, "inbox", index, upto=1.0, limit=3)
            assert got == [e for e in everything if e[0] <= 1.0][:3], (
                f"BACK-7: range() applies upto before limit; upto=1.0, limit=3: got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    @pytest.mark.parametrize("index", INDEXES)
    def test_index_entry_moves_when_put_changes_the_score(self, kv_factory: KvFactory, index: IndexName) -> None:
        """BACK-7: on success the index entries become exactly ``due`` / ``expires``: a
        put with another score moves the entry (the old score is gone)."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "other", {}, expected_version=0, **_idx(index, 3.0))
            v = await kv.put(s.a, "inbox", "k", {"n": 0}, expected_version=0, **_idx(index, 5.0))
            for score in (1.0, 10.0, 3.0, 5.0, 0.0):
                v = await kv.put(s.a, "inbox", "k", {"n": score}, expected_version=v, **_idx(index, score))
                got = await kv.range(s.a, "inbox", index, upto=INF, limit=100)
                expected = sorted([(score, "k"), (3.0, "other")])
                assert got == expected, (
                    f"BACK-7: on success the index entries become exactly due/expires: after a put() with "
                    f"{index}={score!r} the {index!r} index must hold {expected!r} (the entry moves, the old "
                    f"score is gone); got {got!r}"
                )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    @pytest.mark.parametrize("index", INDEXES)
    def test_index_entry_removed_by_put_with_none_and_restored(self, kv_factory: KvFactory, index: IndexName) -> None:
        """BACK-7: a put with ``None`` for an index removes the record's entry from it
        (None: no entry); a later put with a score adds it again."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "other", {}, expected_version=0, **_idx(index, 1.0))
            await kv.put(s.a, "inbox", "k", {}, expected_version=0, **_idx(index, 2.0))
            await kv.put(s.a, "inbox", "k", {}, expected_version=1, **_idx(index, None))
            got = await kv.range(s.a, "inbox", index, upto=INF, limit=100)
            assert got == [(1.0, "other")], (
                f"BACK-7: put() with {index}=None leaves no entry in the {index!r} index (None: no entry); "
                f"got {got!r}"
            )
            await kv.put(s.a, "inbox", "k", {}, expected_version=2, **_idx(index, 0.5))
            got = await kv.range(s.a, "inbox", index, upto=INF, limit=100)
            assert got == [(0.5, "k"), (1.0, "other")], (
                f"BACK-7: put() with {index}=0.5 after None must add the entry again; got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_delete_removes_both_index_entries(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``delete`` removes the record's entries from both indexes."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {}, expected_version=0, due=1.0, expires=1.0)
            await kv.put(s.a, "inbox", "j", {}, expected_version=0, due=2.0, expires=None)
            await kv.delete(s.a, "inbox", "k", expected_version=1)
            checks: list[tuple[IndexName, list[tuple[float, str]]]] = [("due", [(2.0, "j")]), ("expires", [])]
            for index, expected in checks:
                got = await kv.range(s.a, "inbox", index, upto=INF, limit=100)
                assert got == expected, (
                    f"BACK-7: delete() removes both index entries; the {index!r} index must be {expected!r}, "
                    f"got {got!r}"
                )

        self.run_kv(kv_factory, body)

    # -- scan ------------------------------------------------------------------------------
    @pytest.mark.spec("BACK-7")
    def test_scan_is_ascending_by_key_in_code_point_order(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``scan`` lists records ascending by key in code-point order (not
        locale collation, not UTF-16 order), each with its value and version."""
        keys = ["b", "a", "B", "a0", "a/", "k10", "k2", "é", "z", "Z", "ｚ", "🤖", "~", " "]

        async def body(kv: DurableKv, s: Scopes) -> None:
            for i, key in enumerate(keys):
                v = await kv.put(s.a, "inbox", key, {"i": i}, expected_version=0)
                if i % 3 == 0:
                    await kv.put(s.a, "inbox", key, {"i": i}, expected_version=v)
            got = await kv.scan(s.a, "inbox", limit=100)
            expected = sorted((key, Versioned({"i": i}, 2 if i % 3 == 0 else 1)) for i, key in enumerate(keys))
            assert [k for k, _ in got] == [k for k, _ in expected], (
                "BACK-7: scan() lists records ascending by key (code-point order); "
                f"expected {[k for k, _ in expected]!r}, got {[k for k, _ in got]!r}"
            )
            assert got == expected, (
                f"BACK-7: scan() returns each record with its value and version; expected {expected!r}, got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_scan_after_and_limit(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``scan`` returns up to ``limit`` records with key ``> after``
        (exclusive; all when ``after`` is None); paging with the last key seen lists
        every record exactly once."""
        keys = sorted(["k01", "k02", "k03", "k05", "k08", "k13", "k21"])

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key in reversed(keys):
                await kv.put(s.a, "outbox", key, {"key": key}, expected_version=0)
            for after in (None, "", "k01", "k04", "k05", "k21", "z"):
                for limit in (0, 1, 2, 100):
                    got = [k for k, _ in await kv.scan(s.a, "outbox", after=after, limit=limit)]
                    expected = [k for k in keys if after is None or k > after][:limit]
                    assert got == expected, (
                        "BACK-7: scan() returns up to limit records with key > after (all when after is None), "
                        f"ascending by key; after={after!r}, limit={limit}: expected {expected!r}, got {got!r}"
                    )
            default = [k for k, _ in await kv.scan(s.a, "outbox")]
            assert default == keys, f"BACK-7: scan() without after lists every record; got {default!r}"
            seen: list[str] = []
            after_key: str | None = None
            for _ in range(len(keys) + 2):
                page = await kv.scan(s.a, "outbox", after=after_key, limit=3)
                if not page:
                    break
                seen.extend(k for k, _ in page)
                after_key = page[-1][0]
            assert seen == keys, (
                "BACK-7: paging through scan() with after=<last key seen> lists every record exactly once, "
                f"in order; got {seen!r}"
            )

        self.run_kv(kv_factory, body)

    # -- isolation -------------------------------------------------------------------------
    @pytest.mark.spec("BACK-7", "SCOPE-2")
    def test_scopes_are_isolated(self, kv_factory: KvFactory) -> None:
        """BACK-7, SCOPE-2: two scopes never see each other's records, index entries or
        versions — the same key in two scopes is two independent records (even when one
        scope name is a prefix of the other)."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            a, b = s.a, s.b
            await kv.put(a, "inbox", "k", {"scope": "a"}, expected_version=0, due=1.0, expires=10.0)
            await kv.put(a, "inbox", "k", {"scope": "a"}, expected_version=1, due=1.0, expires=10.0)
            await kv.put(a, "inbox", "only-a", {}, expected_version=0, due=2.0)
            got_b = await kv.get(b, "inbox", "k")
            assert got_b is None, f"SCOPE-2: a record of one scope must be invisible from another; got {got_b!r}"
            v = await kv.put(b, "inbox", "k", {"scope": "b"}, expected_version=0, due=5.0, expires=None)
            assert v == 1, (
                "SCOPE-2: the same key in another scope is an independent record: creating it with "
                f"expected_version=0 must return 1; got {v!r}"
            )
            state_a = await _state(kv, a, "inbox")
            state_b = await _state(kv, b, "inbox")
            expected_a = {
                "records": [("k", Versioned({"scope": "a"}, 2)), ("only-a", Versioned({}, 1))],
                "due": [(1.0, "k"), (2.0, "only-a")],
                "expires": [(10.0, "k")],
            }
            expected_b = {"records": [("k", Versioned({"scope": "b"}, 1))], "due": [(5.0, "k")], "expires": []}
            assert state_a == expected_a and state_b == expected_b, (
                "SCOPE-2: two scopes never see each other's records, index entries or versions; "
                f"scope a: expected {expected_a!r}, got {state_a!r}; scope b: expected {expected_b!r}, got {state_b!r}"
            )
            await _expect_conflict(
                kv.put(b, "inbox", "k", {"scope": "b"}, expected_version=2),
                "SCOPE-2: versions are per scope: put() with the other scope's version 2 on a record at "
                "version 1 must fail with VersionConflict",
            )
            await kv.delete(a, "inbox", "k", expected_version=2)
            after_b = await _state(kv, b, "inbox")
            assert after_b == expected_b, (
                f"SCOPE-2: delete() in one scope must not touch another scope; scope b became {after_b!r}"
            )
            await kv.delete(b, "inbox", "k", expected_version=1)
            after_a = await kv.get(a, "inbox", "only-a")
            assert after_a == Versioned({}, 1), (
                f"SCOPE-2: delete() in one scope must not touch another scope; got {after_a!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_spaces_are_isolated(self, kv_factory: KvFactory) -> None:
        """BACK-7: records live at ``(scope, space, key)``: the same key in two spaces is
        two independent records with their own versions and index entries; any short
        identifier-like space name is accepted."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            for i, space in enumerate(SPACES):
                v = await kv.put(s.a, space, "k", {"space": space}, expected_version=0, due=float(i), expires=None)
                assert v == 1, (
                    f"BACK-7: the same key in space {space!r} is an independent record: its create must return 1; "
                    f"got {v!r}"
                )
                for _ in range(i):
                    v = await kv.put(s.a, space, "k", {"space": space}, expected_version=v, due=float(i), expires=None)
            for i, space in enumerate(SPACES):
                state = await _state(kv, s.a, space)
                expected = {
                    "records": [("k", Versioned({"space": space}, i + 1))],
                    "due": [(float(i), "k")],
                    "expires": [],
                }
                assert state == expected, (
                    "BACK-7: records, versions and index entries are per (scope, space); "
                    f"space {space!r}: expected {expected!r}, got {state!r}"
                )
            await kv.delete(s.a, "inbox", "k", expected_version=1)
            got = await kv.get(s.a, "outbox", "k")
            assert got == Versioned({"space": "outbox"}, 2), (
                f"BACK-7: delete() in one space must not touch another; outbox/k became {got!r}"
            )

        self.run_kv(kv_factory, body)

    # -- concurrency -----------------------------------------------------------------------
    @pytest.mark.spec("BACK-7", "REPL-1", "LEASE-2")
    def test_concurrent_cas_on_one_key_has_exactly_one_winner(self, kv_factory: KvFactory) -> None:
        """BACK-7, REPL-1, LEASE-2: concurrent CAS calls on one key with the same
        ``expected_version`` have exactly one winner, the others raise
        ``VersionConflict`` — for creates, replaces and deletes. This is what makes claims
        exclusive and fencing tokens hold."""
        n = self.concurrent_tasks

        async def race(label: str, attempt: Callable[[int], Awaitable[Any]]) -> int:
            async def one(i: int) -> tuple[str, Any]:
                try:
                    return ("won", (i, await attempt(i)))
                except VersionConflict:
                    return ("conflict", i)

            outcomes = await asyncio.gather(*(one(i) for i in range(n)))
            winners = [o[1] for o in outcomes if o[0] == "won"]
            assert len(winners) == 1, (
                f"BACK-7/REPL-1: concurrent CAS calls on one key with the same expected_version have exactly one "
                f"winner, the others raise VersionConflict; {n} concurrent {label}: {len(winners)} won"
            )
            winner: int = winners[0][0]
            return winner

        async def body(kv: DurableKv, s: Scopes) -> None:
            w = await race(
                "creates (expected_version=0)",
                lambda i: kv.put(s.a, "inbox", "k", {"writer": i}, expected_version=0, due=float(i)),
            )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"writer": w}, 1), (
                f"BACK-7/REPL-1: the stored record is the winner's (writer {w}, version 1); got {got!r}"
            )
            w = await race(
                "replaces (expected_version=1)",
                lambda i: kv.put(s.a, "inbox", "k", {"writer": i}, expected_version=1, due=float(i)),
            )
            got = await kv.get(s.a, "inbox", "k")
            assert got == Versioned({"writer": w}, 2), (
                f"BACK-7/REPL-1: the stored record is the winner's (writer {w}, version 2); got {got!r}"
            )
            entries = await kv.range(s.a, "inbox", "due", upto=INF, limit=1000)
            assert entries == [(float(w), "k")], (
                f"BACK-7/REPL-1: the index entry is the winner's only ({(float(w), 'k')!r}); got {entries!r}"
            )
            await race("deletes (expected_version=2)", lambda i: kv.delete(s.a, "inbox", "k", expected_version=2))
            got = await kv.get(s.a, "inbox", "k")
            assert got is None, f"BACK-7: after the winning delete the record is gone; got {got!r}"

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7", "REPL-1")
    def test_concurrent_read_modify_write_loses_no_update(self, kv_factory: KvFactory) -> None:
        """BACK-7, REPL-1: 20 tasks each add 1 ten times by get + CAS put, retrying on
        ``VersionConflict``: the final count is exactly 200 at version 201 (each
        ``put`` and ``delete`` is atomic)."""
        tasks, increments = 20, 10

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "outbox", "counter", {"count": 0}, expected_version=0)

            async def worker() -> None:
                for _ in range(increments):
                    for _attempt in range(10_000):
                        current = await kv.get(s.a, "outbox", "counter")
                        assert current is not None, "BACK-7: the counter record vanished"
                        try:
                            await kv.put(
                                s.a, "outbox", "counter", {"count": current.value["count"] + 1},
                                expected_version=current.version,
                            )
                            break
                        except VersionConflict:
                            continue
                    else:
                        raise AssertionError("BACK-7: an increment kept conflicting 10000 times in a row")

            await asyncio.gather(*(worker() for _ in range(tasks)))
            got = await kv.get(s.a, "outbox", "counter")
            total = tasks * increments
            assert got == Versioned({"count": total}, total + 1), (
                f"BACK-7/REPL-1: each put is atomic, so {tasks} tasks x {increments} CAS increments with retry end at "
                f"count {total}, version {total + 1}; got {got!r}"
            )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_an_unknown_index_name_is_refused(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``range`` over an index other than ``"due"`` and ``"expires"`` raises
        ``ValueError`` naming it — a misspelt name must not quietly read the other
        index (or nothing) and make a sweep miss due records."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {}, expected_version=0, due=1.0, expires=2.0)
            for bad in ("dues", "Due", "", "expire"):
                try:
                    got = await kv.range(s.a, "inbox", bad, upto=INF, limit=10)  # type: ignore[arg-type]
                except ValueError as exc:
                    assert repr(bad) in str(exc), (
                        f"BACK-7: the ValueError for an unknown index names it ({bad!r}); got {exc}"
                    )
                else:
                    raise AssertionError(
                        f"BACK-7: range over the unknown index {bad!r} raises ValueError; it returned {got!r}"
                    )

        self.run_kv(kv_factory, body)

    # -- lifecycle -------------------------------------------------------------------------
    @pytest.mark.spec("BACK-7")
    def test_calls_after_close_raise_backend_unavailable(self, kv_factory: KvFactory) -> None:
        """BACK-7: after ``close()`` every call raises ``BackendUnavailableError``."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {}, expected_version=0, due=1.0)
            await _cleanup(kv, s)
            await kv.close()
            # Coroutines are created one at a time, so none is left un-awaited on a failure.
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                ("get", lambda: kv.get(s.a, "inbox", "k")),
                ("put", lambda: kv.put(s.a, "inbox", "k2", {}, expected_version=0)),
                ("delete", lambda: kv.delete(s.a, "inbox", "k", expected_version=1)),
                ("range", lambda: kv.range(s.a, "inbox", "due", upto=INF, limit=10)),
                ("scan", lambda: kv.scan(s.a, "inbox")),
            ]
            for name, call in calls:
                await _expect_unavailable(
                    call(),
                    f"BACK-7: calls after close() raise BackendUnavailableError; {name}() after close()",
                )

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_open_and_close_are_idempotent(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``open()`` is idempotent (a second call changes nothing, the kv keeps
        working) and so is ``close()`` (a second call raises nothing)."""

        async def main() -> None:
            kv = kv_factory()
            s = Scopes()
            await kv.open()
            try:
                await kv.put(s.a, "inbox", "k", {"n": 1}, expected_version=0, due=1.0)
                await kv.open()
                got = await kv.get(s.a, "inbox", "k")
                assert got == Versioned({"n": 1}, 1), (
                    f"BACK-7: open() is idempotent: a second open() must keep the kv and its data; got {got!r}"
                )
                v = await kv.put(s.a, "inbox", "k", {"n": 2}, expected_version=1)
                assert v == 2, f"BACK-7: open() is idempotent: the kv must keep working after a second open(); got {v!r}"
                await _cleanup(kv, s)
            finally:
                await kv.close()
            try:
                await kv.close()
            except Exception as exc:
                raise AssertionError(
                    f"BACK-7: close() is idempotent: a second close() raised {type(exc).__name__}: {exc}"
                ) from exc

        asyncio.run(asyncio.wait_for(_guarded(main()), self.timeout_seconds))

    # -- crash survival --------------------------------------------------------------------
    @pytest.mark.spec("BACK-7")
    def test_acknowledged_writes_survive_a_crash(self, kv_factory: KvFactory) -> None:
        """BACK-7 (``survives_crash``): a write that returned is still there — value,
        version, index entries; a delete that returned stays deleted — when a new
        instance opens the same storage after the first one was dropped without
        ``close()`` (its ``abandon()`` called when it has one); and again after a clean
        ``close()``. Skipped when the kv does not claim ``survives_crash``."""
        if not self.claims_survives_crash(kv_factory):
            pytest.skip("capability not claimed: survives_crash")

        async def write(kv: DurableKv, oracle: MemoryKv, s: Scopes, round_: int) -> None:
            """Creates, replaces (moving and removing index entries) and a delete, each
            applied to the reference first and then to the kv."""
            for scope in s.all:
                for space in ("inbox", "outbox"):
                    for target in (oracle, kv):
                        for i in range(4):
                            await target.put(
                                scope, space, f"r{round_}-k{i}", {"i": i, "round": round_, "text": "é✓"},
                                expected_version=0, due=float(i), expires=float(10 - i),
                            )
                        await target.put(
                            scope, space, f"r{round_}-k1", {"i": 1, "replaced": 1},
                            expected_version=1, due=7.5, expires=None,
                        )
                        await target.put(
                            scope, space, f"r{round_}-k1", {"i": 1, "replaced": 2},
                            expected_version=2, due=8.5, expires=None,
                        )
                        await target.delete(scope, space, f"r{round_}-k2", expected_version=1)

        async def compare(kv: DurableKv, oracle: MemoryKv, s: Scopes, when: str) -> None:
            for scope in s.all:
                for space in ("inbox", "outbox"):
                    expected = await _state(oracle, scope, space)
                    got = await _state(kv, scope, space)
                    assert got == expected, (
                        "BACK-7: a write that returned is durable to the degree capabilities.survives_crash claims; "
                        f"{when}, a new instance must show every acknowledged write with its version and index "
                        f"entries; space {space!r}: expected {expected!r}, got {got!r}"
                    )

        async def main() -> None:
            s = Scopes()
            oracle = MemoryKv()
            first: DurableKv | None = kv_factory()
            assert first is not None
            await first.open()
            await write(first, oracle, s, 1)
            crash(first)
            first = None  # the dead process's objects are gone
            gc.collect()
            second = kv_factory()
            await second.open()
            try:
                await compare(second, oracle, s, "after the process died without close()")
                await write(second, oracle, s, 2)
            finally:
                await second.close()
            third = kv_factory()
            await third.open()
            try:
                await compare(third, oracle, s, "after close() and a new open()")
                await _cleanup(third, s)
            finally:
                await third.close()

        asyncio.run(asyncio.wait_for(_guarded(main()), self.timeout_seconds))

    # -- model-based -------------------------------------------------------------------------
    @pytest.mark.spec("BACK-7", "SCOPE-2", "LEASE-2")
    def test_agrees_with_the_reference_memory_kv(self, kv_factory: KvFactory) -> None:
        """BACK-7, SCOPE-2, LEASE-2: random sequences of puts (current, zero, ahead and
        stale versions), deletes, gets, ranges and scans over 2 scopes x 2 spaces x 4
        keys give exactly the results of :class:`~botmesh.core.spi.MemoryKv`, the
        reference — every return value and every ``VersionConflict``; with
        ``survives_crash`` the kv is also killed or closed and reopened between steps."""
        machine = make_agreement_machine(
            kv_factory,
            survives_crash=self.claims_survives_crash(kv_factory),
            timeout=self.timeout_seconds,
        )
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.stateful_max_examples,
                stateful_step_count=self.stateful_step_count,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                # No "explain" phase: re-running the failing example under tracing costs
                # far more than the rest, and the failing steps are printed anyway.
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
            ),
        )


class _IndexScores(TypedDict):
    due: float | None
    expires: float | None


def _idx(index: IndexName, score: float | None) -> _IndexScores:
    """``due=score`` or ``expires=score`` (the other one None) as keyword arguments."""
    return {"due": score, "expires": None} if index == "due" else {"due": None, "expires": score}


def _short(found: Any) -> str:
    """A bounded repr for messages about large values."""
    text = repr(found)
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} chars)"
