"""``scan``: code-point key order, ``after``, ``limit``, paging (BACK-7)."""

from __future__ import annotations


import pytest
from botmesh.core.spi import DurableKv, Versioned

from .base import KvFactory, KvSuiteBase, Scopes


class ScanTests(KvSuiteBase):
    """The scan tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

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

