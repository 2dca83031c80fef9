"""Values round-trip exactly and are copies; keys up to 512 characters, unicode and
characters special to key prefixes or SQL patterns (BACK-7)."""

from __future__ import annotations

from typing import Any

import pytest
from botmesh.core.spi import DurableKv, Versioned

from .base import INF, KvFactory, KvSuiteBase, Scopes


class ValueTests(KvSuiteBase):
    """The value and key tests (a mixin of
    :class:`~botmesh_testkit.conformance.kv.DurableKvConformance`)."""

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



def _short(found: Any) -> str:
    """A bounded repr for messages about large values."""
    text = repr(found)
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} chars)"

