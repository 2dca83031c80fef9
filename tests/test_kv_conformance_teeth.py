"""The shipped DurableKv conformance suite has teeth (BACK-7): bound to a kv with one
deliberate bug, it fails, and its output names the spec id and the contract sentence
that was broken.

Each broken kv below is a :class:`~botmesh.core.memory.MemoryKv` with one defect. Each
test writes, into a fresh ``pytester`` directory, what a third party would write — a
module with their kv (the class's source, copied from here) and a test module binding
:class:`DurableKvConformance` to it in three lines — and runs pytest on it in a
subprocess. The ``spec`` marker is registered there by an ini file (``pytester.makeini``),
with ``--strict-markers`` and warnings as errors, because the pytester directory does not
see this project's ``pyproject.toml``. A control run binds the unmodified ``MemoryKv``
the same way and must pass.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import textwrap
from typing import Any

import pytest
from botmesh.core.errors import VersionConflict
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities, Versioned, check_json_object

pytest_plugins = ["pytester"]


# --------------------------------------------------------------------------------------
# broken kvs (their source is copied into the pytester directory)
# --------------------------------------------------------------------------------------


class CasIgnoresVersionKv(MemoryKv):
    """Bug: put() ignores expected_version and always overwrites."""

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        current = await MemoryKv.get(self, scope, space, key)
        actual = 0 if current is None else current.version
        return await super().put(scope, space, key, value, expected_version=actual, due=due, expires=expires)


class DescendingRangeKv(MemoryKv):
    """Bug: range() lists entries in descending (score, key) order."""

    async def range(self, scope: str, space: str, index: Any, *, upto: float, limit: int) -> list[tuple[float, str]]:
        entries = await super().range(scope, space, index, upto=upto, limit=10**9)
        return sorted(entries, reverse=True)[:limit]


class IgnoresUptoKv(MemoryKv):
    """Bug: range() ignores ``upto`` (lists every entry)."""

    async def range(self, scope: str, space: str, index: Any, *, upto: float, limit: int) -> list[tuple[float, str]]:
        return await super().range(scope, space, index, upto=float("inf"), limit=limit)


class ScopeLeakKv(MemoryKv):
    """Bug: the scope is ignored — every scope shares one set of records."""

    def _space(self, scope: str, space: str) -> Any:
        return super()._space("", space)


class IndexNotMovedKv(MemoryKv):
    """Bug: a put() on an existing record keeps its old index entries."""

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        old = self._space(scope, space).get(key)
        version = await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)
        if old is not None:
            stored = self._space(scope, space)[key]
            self._space(scope, space)[key] = (stored[0], stored[1], old[2], old[3])
        return version


class VersionJumpKv(MemoryKv):
    """Bug: versions grow by 2 instead of exactly 1."""

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)
        stored = self._space(scope, space)[key]
        jumped = expected_version + 2
        self._space(scope, space)[key] = (stored[0], jumped, stored[2], stored[3])
        return jumped


class NonAtomicCasKv(MemoryKv):
    """Bug: put() checks the version, yields (as an I/O round trip would), then writes
    unconditionally — concurrent CAS calls can all win."""

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        current = await self.get(scope, space, key)
        found = 0 if current is None else current.version
        if found != expected_version:
            raise VersionConflict(f"expected {expected_version}, found {found}", key=key)
        await asyncio.sleep(0)
        self._space(scope, space)[key] = (check_json_object(value), expected_version + 1, due, expires)
        return expected_version + 1


class SharedValueKv(MemoryKv):
    """Bug: get() returns the stored dict itself instead of a copy."""

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        self._check()
        entry = self._space(scope, space).get(key)
        return None if entry is None else Versioned(entry[0], entry[1])


class ForgetfulKv(MemoryKv):
    """Bug: claims survives_crash, but each instance starts empty."""

    capabilities = Capabilities(survives_crash=True)


class StringifiedKeyKv(MemoryKv):
    """Bug: a key that is not a str is stored under ``str(key)`` (an int id as ``"5"``:
    what MemoryKv and SQLiteKv did before issue 13)."""

    async def get(self, scope: str, space: str, key: Any) -> Versioned | None:
        return await super().get(scope, space, key if isinstance(key, str) else str(key))

    async def put(self, scope: str, space: str, key: Any, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        key = key if isinstance(key, str) else str(key)
        return await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)


class DriverErrorKv(MemoryKv):
    """Bug: keys reach the "driver" unchecked, which encodes them first: an int key
    raises AttributeError and a lone surrogate UnicodeEncodeError (what RedisKv and
    SQLiteKv did before issue 13)."""

    async def get(self, scope: str, space: str, key: Any) -> Versioned | None:
        key.encode("utf-8")
        return await super().get(scope, space, key)

    async def put(self, scope: str, space: str, key: Any, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        key.encode("utf-8")
        return await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)


class NanScoreKv(MemoryKv):
    """Bug: a NaN index score is stored as no entry instead of being refused (what
    SQLite's REAL column did)."""

    async def put(self, scope: str, space: str, key: str, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        due = None if isinstance(due, float) and math.isnan(due) else due
        return await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)


class RecursionKv(MemoryKv):
    """Bug: the value is encoded without a depth guard, so a deeply nested one raises
    RecursionError."""

    async def put(self, scope: str, space: str, key: str, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        json.dumps(value, default=str)
        return await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)


class StaleCurrentKv(MemoryKv):
    """Bug: a conflict reports, as ``current``, the record before its last write (a
    snapshot taken too early), so a caller retrying from it would write on stale data."""

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        written = self.__dict__.setdefault("_written", {}).setdefault((scope, space, key), [])
        try:
            new = await super().put(scope, space, key, value, expected_version=expected_version, due=due, expires=expires)
        except VersionConflict as exc:
            if exc.found and len(written) >= 2:  # the value before the last write, at the current version
                raise VersionConflict.at(space, key, expected_version, exc.found, Versioned(written[-2], exc.found)) from None
            raise
        written.append(check_json_object(value))
        return new


class SwappedRangesKv(MemoryKv):
    """Bug: ``ranges`` answers several reads at once but hands the answers back in the
    reverse order of the reads (a one-round-trip kv that mixed up its tags); ``range``
    itself is right."""

    async def ranges(self, scope: str, reads: Any, *, upto: float, limit: int) -> list[list[tuple[float, str]]]:
        return list(reversed(await super().ranges(scope, reads, upto=upto, limit=limit)))


BROKEN: list[type[MemoryKv]] = [
    SwappedRangesKv,
    StaleCurrentKv,
    CasIgnoresVersionKv,
    DescendingRangeKv,
    IgnoresUptoKv,
    ScopeLeakKv,
    IndexNotMovedKv,
    VersionJumpKv,
    NonAtomicCasKv,
    SharedValueKv,
    ForgetfulKv,
    StringifiedKeyKv,
    DriverErrorKv,
    NanScoreKv,
    RecursionKv,
]

_HEADER = '''\
"""A third party's (broken) DurableKv implementations."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from botmesh.core.errors import VersionConflict
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities, Versioned, check_json_object
'''


def _module_source() -> str:
    return _HEADER + "\n\n" + "\n\n".join(inspect.getsource(cls) for cls in BROKEN)


def _run_suite_against(pytester: pytest.Pytester, kv_class: str, *extra: str) -> tuple[pytest.RunResult, str]:
    """Write the broken kvs' module and a test module binding the shipped suite to
    ``kv_class``, as a third party would, and run pytest on them in a subprocess."""
    pytester.makeini(
        textwrap.dedent(
            """\
            [pytest]
            addopts = --strict-markers
            markers =
                spec(*ids): the spec requirement ids a test checks
            filterwarnings =
                error
            """
        )
    )
    pytester.makepyfile(third_party_kvs=_module_source())
    pytester.makepyfile(
        test_third_party=textwrap.dedent(
            f"""\
            import pytest
            from botmesh_testkit.conformance.kv import DurableKvConformance
            from third_party_kvs import {kv_class}

            class Test{kv_class}(DurableKvConformance):
                @pytest.fixture
                def kv_factory(self):
                    return lambda: {kv_class}()
            """
        )
    )
    # Fixed seeds keep these runs (and their shrinking time) the same from run to run:
    # --botmesh-seed seeds the model-based test (it overrides --hypothesis-seed there; with
    # 30 examples a drawn one missed IndexNotMovedKv in that test alone in 3 of 300 seeds,
    # a red CI run), and a later --botmesh-seed in ``extra`` overrides this one.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "-q", "-rfs", "--hypothesis-seed=0",
                                           "--botmesh-seed=1", *extra)
    return result, result.stdout.str()


def _assert_fails(result: pytest.RunResult, out: str, kv_class: str, tests: list[str], phrases: list[str]) -> None:
    assert result.ret != 0, f"the suite passed against {kv_class}, whose bug it must catch:\n{out}"
    for test in tests:
        assert f"FAILED test_third_party.py::Test{kv_class}::{test}" in out, (
            f"{test} did not fail against {kv_class}:\n{out}"
        )
    for phrase in phrases:
        assert phrase in out, f"the output against {kv_class} does not name {phrase!r}:\n{out}"


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-7")
def test_control_the_reference_memory_kv_passes(pytester: pytest.Pytester) -> None:
    """BACK-7: bound the same way, the unmodified MemoryKv passes; the crash test and the
    several-processes test are skipped with a reason naming the capability."""
    result, out = _run_suite_against(pytester, "MemoryKv")
    assert result.ret == 0, f"the reference MemoryKv must pass the shipped suite:\n{out}"
    assert "capability not claimed: survives_crash" in out, out
    assert "capability not claimed: multi_process" in out, out
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 30 and outcomes.get("skipped") == 2, outcomes


@pytest.mark.spec("BACK-7", "LEASE-2")
def test_cas_that_ignores_the_version_fails(pytester: pytest.Pytester) -> None:
    """BACK-7, LEASE-2: a put() that ignores expected_version is caught (a stale writer
    could overwrite a newer record: fencing would not hold)."""
    result, out = _run_suite_against(pytester, "CasIgnoresVersionKv")
    _assert_fails(
        result,
        out,
        "CasIgnoresVersionKv",
        [
            "test_create_on_existing_key_conflicts_and_changes_nothing",
            "test_stale_or_future_version_is_refused_and_nothing_changes",
            "test_agrees_with_the_reference_memory_kv",
        ],
        [
            "BACK-7: put() with expected_version=0 on an existing key must fail with VersionConflict",
            "BACK-7/LEASE-2: put() with expected_version=1 on a record at version 3 must fail",
        ],
    )


@pytest.mark.spec("BACK-7")
def test_descending_range_fails(pytester: pytest.Pytester) -> None:
    """BACK-7: a range() in descending order is caught."""
    result, out = _run_suite_against(pytester, "DescendingRangeKv")
    _assert_fails(
        result,
        out,
        "DescendingRangeKv",
        ["test_range_is_ascending_by_score_then_key[due]", "test_range_is_ascending_by_score_then_key[expires]"],
        ["BACK-7: range() of 'due' lists entries ascending by (score, key), ties broken by key"],
    )


@pytest.mark.spec("BACK-7")
def test_ranges_answering_in_the_wrong_order_fails(pytester: pytest.Pytester) -> None:
    """BACK-7: a ``ranges`` (the sweep's read of both journals' due indexes) that hands
    back its answers in the wrong order is caught, though ``range`` is right."""
    result, out = _run_suite_against(pytester, "SwappedRangesKv")
    _assert_fails(
        result,
        out,
        "SwappedRangesKv",
        ["test_ranges_answers_each_read_as_range_does"],
        ["BACK-7: ranges([('inbox', 'due'), ('outbox', 'due')], upto=inf, limit=100) answers each read as range() "
         "does, in order"],
    )


@pytest.mark.spec("BACK-7")
def test_range_ignoring_upto_fails(pytester: pytest.Pytester) -> None:
    """BACK-7: a range() that ignores ``upto`` is caught."""
    result, out = _run_suite_against(pytester, "IgnoresUptoKv")
    _assert_fails(
        result,
        out,
        "IgnoresUptoKv",
        ["test_range_upto_is_inclusive_and_may_be_infinite[due]", "test_agrees_with_the_reference_memory_kv"],
        ["BACK-7: range() of 'due' lists the entries with score <= upto (inclusive"],
    )


@pytest.mark.spec("BACK-7", "SCOPE-2")
def test_scope_leakage_fails(pytester: pytest.Pytester) -> None:
    """SCOPE-2: a kv whose scopes share records is caught."""
    result, out = _run_suite_against(pytester, "ScopeLeakKv")
    _assert_fails(
        result,
        out,
        "ScopeLeakKv",
        ["test_scopes_are_isolated", "test_agrees_with_the_reference_memory_kv"],
        ["SCOPE-2: a record of one scope must be invisible from another"],
    )


@pytest.mark.spec("BACK-7")
def test_index_entry_not_moved_fails(pytester: pytest.Pytester) -> None:
    """BACK-7: a put() that leaves the old index entry in place is caught."""
    result, out = _run_suite_against(pytester, "IndexNotMovedKv")
    _assert_fails(
        result,
        out,
        "IndexNotMovedKv",
        ["test_index_entry_moves_when_put_changes_the_score[due]", "test_agrees_with_the_reference_memory_kv"],
        ["BACK-7: on success the index entries become exactly due/expires", "the entry moves, the old score is gone"],
    )


@pytest.mark.spec("BACK-7")
def test_versions_not_growing_by_one_fail(pytester: pytest.Pytester) -> None:
    """BACK-7: versions that grow by 2 are caught."""
    result, out = _run_suite_against(pytester, "VersionJumpKv")
    _assert_fails(
        result,
        out,
        "VersionJumpKv",
        ["test_replace_with_current_version_returns_next_version", "test_create_if_absent_returns_version_1"],
        ["BACK-7: put() with expected_version=1 must return 2 (versions grow by exactly 1)"],
    )


@pytest.mark.spec("BACK-7", "REPL-1")
def test_non_atomic_cas_fails(pytester: pytest.Pytester) -> None:
    """REPL-1: a CAS with a suspension point between its check and its write lets
    several concurrent writers win, and is caught."""
    result, out = _run_suite_against(pytester, "NonAtomicCasKv")
    _assert_fails(
        result,
        out,
        "NonAtomicCasKv",
        ["test_concurrent_cas_on_one_key_has_exactly_one_winner", "test_concurrent_read_modify_write_loses_no_update"],
        ["BACK-7/REPL-1: concurrent CAS calls on one key with the same expected_version have exactly one winner"],
    )


@pytest.mark.spec("BACK-7")
def test_returned_value_not_a_copy_fails(pytester: pytest.Pytester) -> None:
    """BACK-7: a get() that hands out the stored dict is caught."""
    result, out = _run_suite_against(pytester, "SharedValueKv")
    _assert_fails(
        result,
        out,
        "SharedValueKv",
        ["test_values_are_copies"],
        ["BACK-7: a returned value is a copy: mutating what get() returned must not change what is stored"],
    )


@pytest.mark.spec("BACK-7")
def test_false_survives_crash_claim_fails(pytester: pytest.Pytester) -> None:
    """BACK-7: a kv claiming ``survives_crash`` whose writes do not survive is caught
    (the crash test runs instead of being skipped)."""
    result, out = _run_suite_against(pytester, "ForgetfulKv")
    _assert_fails(
        result,
        out,
        "ForgetfulKv",
        ["test_acknowledged_writes_survive_a_crash", "test_agrees_with_the_reference_memory_kv"],
        ["BACK-7: a write that returned is durable to the degree capabilities.survives_crash claims"],
    )


@pytest.mark.spec("BACK-7")
def test_the_agreement_test_alone_catches_a_kv_that_forgets_on_reopen_whatever_it_draws(
        pytester: pytest.Pytester) -> None:
    """BACK-7: the model-based test ends every example with a crash and a reopen when the
    kv claims ``survives_crash``. Its drawn reopen steps alone missed ForgetfulKv in 3 of
    48 seeds with 30 examples, in 1 of 399 with 60 (the default since): seed 258, whose
    examples draw no reopen after a write (checked: with the final crash taken out of
    the machine's teardown, this test fails)."""
    result, out = _run_suite_against(pytester, "ForgetfulKv", "--botmesh-seed=258", "-k", "agrees")
    _assert_fails(
        result,
        out,
        "ForgetfulKv",
        ["test_agrees_with_the_reference_memory_kv"],
        # (shrunk, the failing example may end in a drawn reopen: the same check failing)
        ["BACK-7: every record and index entry must be exactly the reference MemoryKv's"],
    )


@pytest.mark.spec("BACK-7")
def test_a_key_stored_as_its_str_fails(pytester: pytest.Pytester) -> None:
    """BACK-7 (issue 13): a kv that stores an int key as ``"5"`` is caught: a key
    outside the contract must be refused, not stored as something else."""
    result, out = _run_suite_against(pytester, "StringifiedKeyKv")
    _assert_fails(
        result,
        out,
        "StringifiedKeyKv",
        ["test_keys_outside_the_contract_are_refused_and_change_nothing"],
        ["BACK-7: get() of a key that is an int is outside the contract and must be refused with InvalidKeyError, "
         "not stored as something else"],
    )


@pytest.mark.spec("BACK-7")
def test_a_drivers_own_error_for_an_odd_key_fails(pytester: pytest.Pytester) -> None:
    """BACK-7 (issue 13): a kv whose driver raises AttributeError / UnicodeEncodeError
    for an odd key is caught, the driver's error named."""
    result, out = _run_suite_against(pytester, "DriverErrorKv")
    _assert_fails(
        result,
        out,
        "DriverErrorKv",
        ["test_keys_outside_the_contract_are_refused_and_change_nothing"],
        ["BACK-7: get() of a key that is an int is outside the contract and must be refused with InvalidKeyError "
         "before the storage sees it (never the driver's own error); it raised AttributeError"],
    )


@pytest.mark.spec("BACK-7")
def test_a_nan_score_taken_as_no_entry_fails(pytester: pytest.Pytester) -> None:
    """BACK-7 (issue 13): a kv that takes a NaN ``due`` as no index entry is caught."""
    result, out = _run_suite_against(pytester, "NanScoreKv")
    _assert_fails(
        result,
        out,
        "NanScoreKv",
        ["test_scopes_spaces_scores_bounds_and_versions_outside_the_contract_are_refused"],
        ["BACK-7: put() with a due score that is NaN is outside the contract and must be refused with "
         "InvalidArgumentError"],
    )


@pytest.mark.spec("BACK-7")
def test_a_recursion_error_for_a_deep_value_fails(pytester: pytest.Pytester) -> None:
    """BACK-7 (issue 13): a kv that lets RecursionError escape for a deeply nested value
    is caught."""
    result, out = _run_suite_against(pytester, "RecursionKv")
    _assert_fails(
        result,
        out,
        "RecursionKv",
        ["test_values_outside_the_contract_are_refused_with_type_or_value_error"],
        ["BACK-7: put() of a value that is nested 100,000 levels deep is outside the contract and must be refused "
         "with TypeError or ValueError before the storage sees it (never the driver's own error); it raised "
         "RecursionError"],
    )


@pytest.mark.spec("BACK-7")
def test_a_conflict_reporting_a_stale_current_record_fails(pytester: pytest.Pytester) -> None:
    """BACK-7 (issue 16): a kv whose VersionConflict gives a ``current`` record other than
    the one stored (here: the value before the last write) is caught."""
    result, out = _run_suite_against(pytester, "StaleCurrentKv")
    _assert_fails(
        result,
        out,
        "StaleCurrentKv",
        ["test_a_conflict_reports_what_it_found"],
        ["BACK-7: the VersionConflict of put(expected_version=0) on a record at version 3 gives current="],
    )
