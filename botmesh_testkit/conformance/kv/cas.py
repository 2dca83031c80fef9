"""Compare-and-set with versions (BACK-7, and LEASE-2 where fencing relies on a stale
version being refused): create-if-absent, replace, delete, each refused with
``VersionConflict`` and changing nothing at another version."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from botmesh.core.errors import VersionConflict
from botmesh.core.spi import DurableKv, Versioned

from .base import KvFactory, KvSuiteBase, Scopes, _expect_conflict, _state


class CasTests(KvSuiteBase):
    """The compare-and-set tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

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


    @pytest.mark.spec("BACK-7")
    def test_a_conflict_reports_what_it_found(self, kv_factory: KvFactory) -> None:
        """BACK-7: a ``VersionConflict`` that gives ``found`` gives the version the record
        is at (0: absent), and one that gives ``current`` (optional: the record found, in
        the same round trip) gives exactly what ``get`` returns — a caller retries its
        compare-and-set from it without reading again — as its own copy."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await kv.put(s.a, "inbox", "k", {"v": 1}, expected_version=0)
            await kv.put(s.a, "inbox", "k", {"v": 2, "nested": {"a": [1, 2]}}, expected_version=1, due=4.0)
            await kv.put(s.a, "inbox", "k", {"v": 3, "nested": {"a": [1, 2]}}, expected_version=2, due=5.0)
            stored = await kv.get(s.a, "inbox", "k")
            attempts: list[tuple[str, Callable[[], Awaitable[Any]], Versioned | None]] = [
                ("put(expected_version=0) on a record at version 3",
                 lambda: kv.put(s.a, "inbox", "k", {"x": 1}, expected_version=0), stored),
                ("put(expected_version=2) on a record at version 3",
                 lambda: kv.put(s.a, "inbox", "k", {"x": 1}, expected_version=2), stored),
                ("put(expected_version=4) on a record at version 3",
                 lambda: kv.put(s.a, "inbox", "k", {"x": 1}, expected_version=4), stored),
                ("delete(expected_version=1) of a record at version 3",
                 lambda: kv.delete(s.a, "inbox", "k", expected_version=1), stored),
                ("put(expected_version=2) of an absent record",
                 lambda: kv.put(s.a, "inbox", "absent", {"x": 1}, expected_version=2), None),
                ("delete(expected_version=1) of an absent record",
                 lambda: kv.delete(s.a, "inbox", "absent", expected_version=1), None),
            ]
            for what, attempt, record in attempts:
                try:
                    await attempt()
                except VersionConflict as exc:
                    conflict = exc
                else:
                    raise AssertionError(f"BACK-7: {what} must raise VersionConflict")
                version = 0 if record is None else record.version
                found = getattr(conflict, "found", None)
                assert found is None or found == version, (
                    f"BACK-7: the VersionConflict of {what} must give found={version} (the version found, 0: "
                    f"absent); got found={found!r}"
                )
                current = getattr(conflict, "current", None)
                assert current is None or current == record, (
                    f"BACK-7: the VersionConflict of {what} gives current={current!r}, but the record found "
                    f"is {record!r} (current must be exactly what get() returns)"
                )
                if current is not None:
                    current.value["nested"]["a"].append("mutated")
                    again = await kv.get(s.a, "inbox", "k")
                    assert again == record, (
                        "BACK-7: the current record of a VersionConflict must be the caller's own copy; "
                        f"mutating it changed the stored record to {again!r}"
                    )

        self.run_kv(kv_factory, body)
