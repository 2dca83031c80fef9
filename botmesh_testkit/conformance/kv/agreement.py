"""The model-based test: a Hypothesis state machine runs the same random operations
against the backend and against :class:`~botmesh.core.MemoryKv` (the reference),
comparing every result and every ``VersionConflict`` (BACK-7, SCOPE-2, LEASE-2)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from botmesh.core import MemoryKv
from botmesh.core.errors import VersionConflict
from botmesh.core.spi import INDEXES, DurableKv, IndexName
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .base import INF, KvFactory, KvSuiteBase, Scopes, T, _cleanup, _state, crash


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
    reopens the kv (or closes and reopens it) between steps, and every example that
    passed its steps ends with a kill and a reopen; nothing may be lost."""

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
            self.failed = False  # a step raised: the example has failed, teardown only cleans up
            try:
                self._step(self.oracle.open())
                self.kv = factory()
                self._step(self.kv.open())
            except BaseException:
                self.loop.close()
                raise

        # -- plumbing ---------------------------------------------------------------
        def _step(self, call: Awaitable[T]) -> T:
            try:
                return self.loop.run_until_complete(asyncio.wait_for(call, timeout))
            except BaseException:
                self.failed = True
                raise

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

        async def _all_same(self, *, after: str) -> None:
            """All four (scope, space) pairs agree in full (records and both indexes)."""
            for name in ("a", "b"):
                for space in ("inbox", "outbox"):
                    await self._same_state(name, self._scope(name), space, after=after)

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
            self._step(self._all_same(after="the steps so far"))

        @precondition(lambda self: survives_crash)
        @rule(how=st.sampled_from(["crash", "close"]))
        def reopen(self, how: str) -> None:
            """The process dies (or closes the kv) and a new instance opens the same
            storage: every acknowledged write is still there (``survives_crash``)."""
            self._reopen(how, after=f"reopen(how={how!r})")

        def _reopen(self, how: str, *, after: str) -> None:
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
            self._step(self._all_same(after=after))

        def teardown(self) -> None:
            try:
                # With survives_crash every example ends with a crash and a reopen: drawn
                # alone, the reopen step missed a kv that forgets every write on reopen in
                # 3 of 48 seeds with 30 examples, 1 of 399 with 60 (examples that drew no
                # reopen after their writes).
                if survives_crash and self.kv is not None and not self.failed:
                    self._reopen("crash", after="the last step and the crash every example ends with")
            finally:
                try:
                    if self.kv is not None:
                        self._step(_cleanup(self.kv, self.scopes))
                        self._step(self.kv.close())
                finally:
                    self.loop.close()

    return DurableKvAgreement



def run_seed(config: pytest.Config) -> int | None:
    """The run's ``--botmesh-seed`` (drawn and printed when not given), which seeds the
    state machine; None when the botmesh plugin is not loaded (Hypothesis draws one)."""
    found = getattr(config.pluginmanager.get_plugin("botmesh_session"), "seed", None)
    return int(found) if isinstance(found, int) else None


def example_database(config: pytest.Config) -> ExampleDatabase | None:
    """Hypothesis's database of failing examples, under pytest's cache directory
    (``.pytest_cache/d/botmesh-hypothesis``), never in the current directory; None (no
    database) when the cache is off (``-p no:cacheprovider``)."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return None
    return DirectoryBasedExampleDatabase(Path(cache.mkdir("botmesh-hypothesis")))


@contextlib.contextmanager
def hypothesis_home(config: pytest.Config) -> Iterator[None]:
    """Hypothesis's own files (its cache of the constants it found in the code under
    test) go under pytest's cache directory too, for the call (put back after: the
    user's own Hypothesis tests keep theirs); nothing changes when the cache is off."""
    from hypothesis import configuration

    cache = getattr(config, "cache", None)
    if cache is None:
        yield
        return
    before = getattr(configuration, "__hypothesis_home_directory", None)
    configuration.set_hypothesis_home_dir(Path(cache.mkdir("botmesh-hypothesis-home")))
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(before)


@contextlib.contextmanager
def shrink_bound(seconds: float) -> Iterator[None]:
    """Hypothesis stops shrinking a failing example after ``seconds`` (its own bound is
    five minutes, a module constant with no setting: lowered here for the call and put
    back after; left alone if a Hypothesis release renames it)."""
    from hypothesis.internal.conjecture import engine

    before = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if not isinstance(before, int):
        yield
        return
    engine.MAX_SHRINKING_SECONDS = max(1, min(before, int(seconds)))
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = before


class AgreementTests(KvSuiteBase):
    """The model-based agreement tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    stateful_max_examples: ClassVar[int] = 60
    """Hypothesis ``max_examples`` of the model-based test. 60: with 30, the test alone
    missed a kv that keeps a record's old index entries on a put (the teeth tests'
    ``IndexNotMovedKv``) in 4 of 600 drawn seeds, with 60 in none of 300; it costs about
    1 s more on SQLite and 5 s more on PostgreSQL (the dedicated index tests catch that
    bug whatever the seed)."""
    stateful_step_count: ClassVar[int] = 30
    """Hypothesis ``stateful_step_count`` of the model-based test."""
    stateful_shrink_seconds: ClassVar[float] = 20.0
    """Real seconds Hypothesis may spend shrinking a failing example of the model-based
    test (a broken kv used to take minutes here)."""


    @pytest.mark.spec("BACK-7", "SCOPE-2", "LEASE-2")
    def test_agrees_with_the_reference_memory_kv(self, kv_factory: KvFactory, request: pytest.FixtureRequest) -> None:
        """BACK-7, SCOPE-2, LEASE-2: random sequences of puts (current, zero, ahead and
        stale versions), deletes, gets, ranges and scans over 2 scopes x 2 spaces x 4
        keys give exactly the results of :class:`~botmesh.core.MemoryKv`, the
        reference — every return value and every ``VersionConflict``; with
        ``survives_crash`` the kv is also killed or closed and reopened between steps and
        killed and reopened at the end of every example.

        The examples derive from ``--botmesh-seed`` (the same seed gives the same
        operations), failing examples are kept under pytest's cache directory, and
        shrinking stops after ``stateful_shrink_seconds``."""
        machine = make_agreement_machine(
            kv_factory,
            survives_crash=self.claims_survives_crash(kv_factory),
            timeout=self.timeout_seconds,
        )
        drawn = run_seed(request.config)
        if drawn is not None:
            machine = seed(drawn)(machine)
        with shrink_bound(self.stateful_shrink_seconds), hypothesis_home(request.config):
            self._run_machine(machine, example_database(request.config))

    def _run_machine(self, machine: type[RuleBasedStateMachine], database: ExampleDatabase | None) -> None:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.stateful_max_examples,
                stateful_step_count=self.stateful_step_count,
                database=database,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                # No "explain" phase: re-running the failing example under tracing costs
                # far more than the rest, and the failing steps are printed anyway.
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
            ),
        )

