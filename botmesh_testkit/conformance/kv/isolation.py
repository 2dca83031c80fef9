"""Scope (SCOPE-2) and space isolation: records live at ``(scope, space, key)``, and
two scopes never see each other even when one name is a prefix of the other."""

from __future__ import annotations


import pytest
from botmesh.core.spi import DurableKv, Versioned

from .base import SPACES, KvFactory, KvSuiteBase, Scopes, _expect_conflict, _state


class IsolationTests(KvSuiteBase):
    """The scope and space isolation tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

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

