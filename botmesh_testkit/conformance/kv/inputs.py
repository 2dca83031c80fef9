"""Odd inputs (BACK-7, issue 13): a kv refuses every argument outside the contract with
the project's error — ``InvalidKeyError``/``InvalidArgumentError`` for a key, scope,
space, score, bound or version; ``TypeError``/``ValueError`` for a value — never with
its driver's own exception (``AttributeError``, ``UnicodeEncodeError``, an SQL error),
never by storing something else (an ``int`` key as ``"5"``), and changes nothing;
odd-but-valid keys and values (control characters, noncharacters, unnormalised
Unicode, lone surrogates inside a value, deep nesting) round-trip exactly."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from botmesh.core.errors import InvalidArgumentError
from botmesh.core.spi import DurableKv, Versioned

from .base import INF, KvFactory, KvSuiteBase, Scopes, _state

BAD_KEYS: list[tuple[str, Any]] = [
    ("an int", 5),
    ("bytes", b"k"),
    ("a list", ["k"]),
    ("None", None),
    ("the empty string", ""),
    ("513 characters", "k" * 513),
    ("10,000 characters", "k" * 10_000),
    ("a lone high surrogate", "a\ud800b"),
    ("a lone low surrogate", "\udfff"),
    ("U+0000", "a\x00b"),
]
"""Keys outside the contract (a non-empty str of at most 512 characters, valid Unicode,
without U+0000), with the words the messages use for them."""

BAD_NAMES: list[tuple[str, Any]] = [
    ("an int", 5),
    ("the empty string", ""),
    ("a lone surrogate", "s\ud800"),
    ("U+0000", "s\x00"),
]
"""Scopes and spaces outside the contract."""

BAD_SCORES: list[tuple[str, Any]] = [
    ("NaN", math.nan),
    ("a str", "1"),
    ("a bool", True),
    ("an int too large for a float", 10**400),
]

BAD_VERSIONS: list[tuple[str, Any]] = [("a str", "0"), ("a float", 0.0), ("a bool", False), ("None", None), ("2**63", 2**63)]

BAD_VALUES: list[tuple[str, Any]] = [
    ("a list", [1]),
    ("a str", "v"),
    ("None", None),
    ("NaN inside", {"a": math.nan}),
    ("infinity inside", {"a": [1, -math.inf]}),
    ("a set inside", {"a": {1, 2}}),
    ("bytes inside", {"a": b"x"}),
    ("an object inside", {"a": object()}),
]


def _bind(fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Callable[[], Awaitable[Any]]:
    """``fn(*args, **kwargs)``, to be called later."""
    return lambda: fn(*args, **kwargs)


def _deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


ODD_KEYS: list[str] = [
    "\x01\x1f",
    "new\nline\ttab\r",
    " ",
    "\ufffe\uffff",
    "\U0010ffff",
    "e\u0301",  # e + combining acute: a key of its own, not normalised to "é"
    "\u00e9",
    "\ufeffbom",
    "\u202eright-to-left",
    "\\u0000",  # the six characters, not U+0000
]
"""Keys inside the contract that drivers may handle badly: each is stored, listed and
indexed exactly as given."""

ODD_VALUES: dict[str, dict[str, Any]] = {
    "lone surrogates": {"high": "\ud800", "low": "x\udfffy", "\udbff": "in a key"},
    "separators": {"text": "\u2028\u2029\x85", "bom": "\ufeff"},
    "big numbers": {"int": 10**30, "neg": -(10**30), "max": 1.7976931348623157e308, "min": 5e-324},
    "deep": _deep(127),  # 128 levels, the most the contract asks a kv to store
}
"""Values inside the contract (``json.dumps`` accepts them) that drivers may handle
badly: each round-trips exactly."""


class InputTests(KvSuiteBase):
    """The odd-input tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

    @staticmethod
    async def _seed(kv: DurableKv, s: Scopes) -> None:
        await kv.put(s.a, "inbox", "kept", {"v": 1}, expected_version=0, due=1.0, expires=2.0)
        await kv.put(s.a, "inbox", "kept", {"v": 2}, expected_version=1, due=3.0, expires=None)
        await kv.put(s.b, "inbox", "other", {"v": 3}, expected_version=0, due=None, expires=4.0)

    @staticmethod
    async def _refused(kv: DurableKv, s: Scopes, what: str, call: Callable[[], Awaitable[Any]],
                       errors: tuple[type[BaseException], ...], expected: str) -> None:
        """``call()`` must raise one of ``errors`` and leave both scopes as they were."""
        before = [await _state(kv, scope, "inbox") for scope in s.all]
        try:
            result = await call()
        except errors:
            pass
        except Exception as exc:
            raise AssertionError(
                f"BACK-7: {what} is outside the contract and must be refused with {expected} before the storage "
                f"sees it (never the driver's own error); it raised {type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        else:
            raise AssertionError(
                f"BACK-7: {what} is outside the contract and must be refused with {expected}, not stored as something "
                f"else; it returned {str(result)[:300]} and raised nothing"
            )
        after = [await _state(kv, scope, "inbox") for scope in s.all]
        assert after == before, f"BACK-7: a refused call changes nothing; after {what} the records changed"

    @pytest.mark.spec("BACK-7")
    def test_keys_outside_the_contract_are_refused_and_change_nothing(self, kv_factory: KvFactory) -> None:
        """BACK-7: a key that is not a non-empty ``str`` of at most 512 characters, valid
        Unicode without U+0000, is refused by ``get``, ``put`` and ``delete`` with
        ``InvalidKeyError`` (an ``InvalidArgumentError``, a ``ValueError``) and nothing
        changes — on a backend that cannot store it and on one that could."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await self._seed(kv, s)
            for words, key in BAD_KEYS:
                calls: dict[str, Callable[[], Awaitable[Any]]] = {
                    "get": _bind(kv.get, s.a, "inbox", key),
                    "put": _bind(kv.put, s.a, "inbox", key, {"v": 0}, expected_version=0, due=5.0),
                    "delete": _bind(kv.delete, s.a, "inbox", key, expected_version=1),
                }
                for op, call in calls.items():
                    await self._refused(kv, s, f"{op}() of a key that is {words}", call, (InvalidArgumentError,),
                                        "InvalidKeyError")

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7", "SCOPE-2")
    def test_scopes_spaces_scores_bounds_and_versions_outside_the_contract_are_refused(self, kv_factory: KvFactory) -> None:
        """BACK-7: a scope or space that is not a non-empty ``str`` (valid Unicode,
        without U+0000), an index score that is NaN or not a number a float holds, an
        ``upto`` of that kind, an ``after`` that is not a ``str`` or None, an
        ``expected_version`` that is not a 64-bit ``int``: refused with
        ``InvalidArgumentError`` by every method taking it, nothing changed."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await self._seed(kv, s)
            cases: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
            for words, name in BAD_NAMES:
                cases += [
                    (f"get() in a scope that is {words}", _bind(kv.get, name, "inbox", "kept")),
                    (f"put() in a scope that is {words}", _bind(kv.put, name, "inbox", "k", {}, expected_version=0)),
                    (f"delete() in a scope that is {words}", _bind(kv.delete, name, "inbox", "k", expected_version=1)),
                    (f"range() of a scope that is {words}", _bind(kv.range, name, "inbox", "due", upto=INF, limit=9)),
                    (f"scan() of a scope that is {words}", _bind(kv.scan, name, "inbox")),
                    (f"put() in a space that is {words}", _bind(kv.put, s.a, name, "k", {}, expected_version=0)),
                    (f"scan() of a space that is {words}", _bind(kv.scan, s.a, name)),
                ]
            for words, score in BAD_SCORES:
                cases += [
                    (f"put() with a due score that is {words}",
                     _bind(kv.put, s.a, "inbox", "k", {}, expected_version=0, due=score)),
                    (f"put() with an expires score that is {words}",
                     _bind(kv.put, s.a, "inbox", "kept", {}, expected_version=2, expires=score)),
                    (f"range() up to {words}", _bind(kv.range, s.a, "inbox", "due", upto=score, limit=9)),
                ]
            for words, version in BAD_VERSIONS:
                cases += [
                    (f"put() with an expected_version that is {words}",
                     _bind(kv.put, s.a, "inbox", "kept", {}, expected_version=version)),
                    (f"delete() with an expected_version that is {words}",
                     _bind(kv.delete, s.a, "inbox", "kept", expected_version=version)),
                ]
            for words, after in [("an int", 5), ("a lone surrogate", "\ud800"), ("U+0000", "\x00")]:
                cases.append((f"scan() after a bound that is {words}", _bind(kv.scan, s.a, "inbox", after=after)))
            for what, call in cases:
                await self._refused(kv, s, what, call, (InvalidArgumentError,), "InvalidArgumentError")

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_values_outside_the_contract_are_refused_with_type_or_value_error(self, kv_factory: KvFactory) -> None:
        """BACK-7: a value that is not a JSON object ``json.dumps`` accepts — not a dict,
        NaN or infinity inside, a set, bytes, any object, nesting too deep to encode —
        raises ``TypeError`` or ``ValueError`` (not ``RecursionError``, not a driver
        error) and nothing is stored."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            await self._seed(kv, s)
            for words, value in [*BAD_VALUES, ("nested 100,000 levels deep", _deep(100_000))]:
                await self._refused(kv, s, f"put() of a value that is {words}",
                                    _bind(kv.put, s.a, "inbox", "new", value, expected_version=0),
                                    (TypeError, ValueError), "TypeError or ValueError")
                await self._refused(kv, s, f"put() replacing a record with a value that is {words}",
                                    _bind(kv.put, s.a, "inbox", "kept", value, expected_version=2),
                                    (TypeError, ValueError), "TypeError or ValueError")

        self.run_kv(kv_factory, body)

    @pytest.mark.spec("BACK-7")
    def test_odd_but_valid_keys_and_values_round_trip_exactly(self, kv_factory: KvFactory) -> None:
        """BACK-7: keys with control characters other than U+0000, noncharacters, the
        last code point, unnormalised Unicode (``"e\\u0301"`` beside ``"é"``: two keys),
        a BOM, bidi controls — and values with lone surrogates in strings and keys, line
        separators, big numbers, 128 levels of nesting — are stored, listed, indexed and
        returned exactly as given."""

        async def body(kv: DurableKv, s: Scopes) -> None:
            for i, key in enumerate(ODD_KEYS):
                await kv.put(s.a, "outbox", key, {"i": i}, expected_version=0, due=float(i))
            for i, key in enumerate(ODD_KEYS):
                got = await kv.get(s.a, "outbox", key)
                assert got == Versioned({"i": i}, 1), f"BACK-7: the key {key!r} is stored as given; get() returned {got!r}"
            listed = [k for k, _ in await kv.scan(s.a, "outbox", limit=100)]
            assert listed == sorted(ODD_KEYS), (
                f"BACK-7: scan() lists every key exactly as given, in code-point order; expected {sorted(ODD_KEYS)!r}, "
                f"got {listed!r}"
            )
            ranged = await kv.range(s.a, "outbox", "due", upto=INF, limit=100)
            assert ranged == [(float(i), key) for i, key in enumerate(ODD_KEYS)], (
                f"BACK-7: range() returns the keys exactly as given; got {ranged!r}"
            )
            for name, value in ODD_VALUES.items():
                await kv.put(s.a, "inbox", name, value, expected_version=0)
                got = await kv.get(s.a, "inbox", name)
                assert got == Versioned(value, 1), (
                    f"BACK-7: a value json.dumps accepts ({name}) is returned unchanged; got {str(got)[:300]}"
                )
            scanned = dict(await kv.scan(s.a, "inbox", limit=100))
            for name, value in ODD_VALUES.items():
                assert scanned.get(name) == Versioned(value, 1), (
                    f"BACK-7: scan() returns the value ({name}) unchanged; got {str(scanned.get(name))[:300]}"
                )

        self.run_kv(kv_factory, body)
