"""Both ordered indexes (``"due"``, ``"expires"``): ascending ``(score, key)``,
``upto`` inclusive, ``float('inf')``, ``limit``, entries that move, vanish and come back
with ``put`` and vanish with ``delete``; an unknown index name refused with
``ValueError``; several reads at once (``ranges``) answered as ``range`` answers each
(BACK-7)."""

from __future__ import annotations

from typing import TypedDict

import pytest
from botmesh.core.spi import INDEXES, DurableKv, IndexName

from .base import INF, KvFactory, KvSuiteBase, Scopes


class IndexTests(KvSuiteBase):
    """The ordered index tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    @pytest.mark.spec("BACK-7")
    @pytest.mark.parametrize("index", INDEXES)
    def test_range_is_ascending_by_score_then_key(self, kv_factory: KvFactory, index: IndexName) -> None:
        """BACK-7: ``range`` lists entries in ascending ``(score, key)`` order — ties
        broken by key — with float scores; the other index is independent."""
        scores = {"k3": 3.0, "b": 2.0, "k1": 1.0, "z": 1_700_000_000_000.25, "c": 2.0, "a": 2.0, "k0": 0.0}
        other: IndexName = "expires" if index == "due" else "due"

        async def body(kv: DurableKv, s: Scopes) -> None:
            for key, score in scores.items():
                await kv.put(s.a, "inbox", key, {"k": key}, expected_version=0, **_idx(index, score))
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
                await kv.put(s.a, "outbox", key, {}, expected_version=0, **_idx(index, score))
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
                await kv.put(s.a, "inbox", key, {}, expected_version=0, **_idx(index, score))
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

    @pytest.mark.spec("BACK-7")
    def test_ranges_answers_each_read_as_range_does(self, kv_factory: KvFactory) -> None:
        """BACK-7: ``ranges`` — several range reads at once, what the engine's sweep
        reads at every pass (both journals' due indexes) — answers each read, in the
        order given, with exactly the entries ``range`` lists for it: ascending
        ``(score, key)``, ``upto`` inclusive, cut to ``limit``, in its own scope, space
        and index only. A kv that answers the reads in one round trip must not mix them
        up, drop one, or lose the order."""
        data = {  # (space, key): (due, expires)
            ("inbox", "i3"): (3.0, 9.0), ("inbox", "i1"): (1.0, None), ("inbox", "i2a"): (2.0, 1.5),
            ("inbox", "i2b"): (2.0, None), ("outbox", "o1"): (1.5, 2.0), ("outbox", "o0"): (0.0, 0.5),
            ("outbox", "o9"): (None, 7.25), ("outbox", "o2"): (2.0, None),
        }
        reads_tried: list[list[tuple[str, IndexName]]] = [
            [("inbox", "due"), ("outbox", "due")], [("outbox", "due"), ("inbox", "due")],
            [("outbox", "expires"), ("inbox", "due")], [("inbox", "expires")],
            [("inbox", "due"), ("inbox", "due"), ("outbox", "expires")], [],
        ]

        def expected(space: str, index: IndexName, upto: float, limit: int) -> list[tuple[float, str]]:
            pos = 0 if index == "due" else 1
            entries: list[tuple[float, str]] = []
            for (sp, key), scores in data.items():
                score = scores[pos]
                if sp == space and score is not None and score <= upto:
                    entries.append((float(score), key))
            return sorted(entries)[:limit]

        async def body(kv: DurableKv, s: Scopes) -> None:
            for (space, key), (due, expires) in data.items():
                await kv.put(s.a, space, key, {"k": key}, expected_version=0, due=due, expires=expires)
                # the other scope has the same keys at other scores: a read must not see them
                await kv.put(s.b, space, key, {"k": key}, expected_version=0, due=0.25, expires=0.25)
            for reads in reads_tried:
                for upto, limit in ((INF, 100), (2.0, 100), (1.5, 1), (INF, 2), (-1.0, 5), (2.0, 0)):
                    got = await kv.ranges(s.a, reads, upto=upto, limit=limit)
                    want = [expected(space, index, upto, limit) for space, index in reads]
                    assert got == want, (
                        f"BACK-7: ranges({reads!r}, upto={upto!r}, limit={limit}) answers each read as range() "
                        f"does, in order; expected {want!r}, got {got!r}"
                    )
                    one_by_one = [await kv.range(s.a, space, index, upto=upto, limit=limit) for space, index in reads]
                    assert got == one_by_one, (
                        f"BACK-7: ranges({reads!r}, upto={upto!r}, limit={limit}) disagrees with range() read by "
                        f"read: {got!r} against {one_by_one!r}"
                    )
            try:
                got_bad = await kv.ranges(s.a, [("inbox", "due"), ("outbox", "dues")], upto=INF, limit=10)  # type: ignore[list-item]
            except ValueError as exc:
                assert "'dues'" in str(exc), f"BACK-7: the ValueError for an unknown index names it; got {exc}"
            else:
                raise AssertionError(f"BACK-7: ranges() with the unknown index 'dues' raises ValueError; it returned "
                                     f"{got_bad!r}")

        self.run_kv(kv_factory, body)


class _IndexScores(TypedDict):
    due: float | None
    expires: float | None


def _idx(index: IndexName, score: float | None) -> _IndexScores:
    """``due=score`` or ``expires=score`` (the other one None) as keyword arguments."""
    return {"due": score, "expires": None} if index == "due" else {"due": None, "expires": score}

