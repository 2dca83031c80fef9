"""The argument checks every built-in kv runs on each call (BACK-7: one contract for all
backends) decide in one expression for the arguments of nearly every call (issue 16);
these tests hold that shortcut to the checks it stands for: the same value returned,
or the same error, for good and bad arguments alike."""

from __future__ import annotations

from typing import Any

import pytest
from botmesh.core.inputs import (
    MAX_KEY_CHARS,
    MAX_VERSION,
    check_key,
    check_put,
    check_record,
    check_score,
    check_space,
    check_version,
)
from hypothesis import given, settings
from hypothesis import strategies as st

# each argument is a good one three times in four, so that all six are good together (the
# shortcut's case) often, and one bad argument among good ones too
def _mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, good, bad)


NAMES = _mostly(st.sampled_from(["bot", "inbox", "outbox", "é-scope"]),
                st.one_of(st.sampled_from(["", "a\x00b", "s\ud800", "x" * 600]), st.integers(), st.none(),
                          st.binary(max_size=3)))
KEYS = _mostly(
    st.one_of(st.sampled_from(["m1", "m1:1", "ключ", "x" * MAX_KEY_CHARS, " ", "\n\t"]), st.text(min_size=1, max_size=8)),
    st.one_of(st.sampled_from(["", "a\x00", "\x00", "k\ud801", "x" * (MAX_KEY_CHARS + 1)]), st.integers(), st.none(),
              st.booleans()),
)
VERSIONS = _mostly(st.one_of(st.sampled_from([0, 1, -1, MAX_VERSION - 1, -MAX_VERSION - 1]), st.integers()),
                   st.sampled_from([MAX_VERSION, -MAX_VERSION - 2, True, False, 1.0, "1", None]))
SCORES = _mostly(st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.5])),
                 st.sampled_from([float("nan"), 3, True, 10**400, "1", 2**53 + 1]))


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # the error's type and words are the outcome
        return type(exc).__name__, str(exc)


def _put_by_parts(scope: Any, space: Any, key: Any, version: Any, due: Any, expires: Any) -> Any:
    check_space(scope, space)
    check_key(key)
    check_version(version)
    return check_score(due, "due"), check_score(expires, "expires")


def _record_by_parts(scope: Any, space: Any, key: Any) -> None:
    check_space(scope, space)
    check_key(key)


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    """Equal outcomes; a NaN score (refused anyway) compares by its text."""
    return repr(a) == repr(b)


@pytest.mark.spec("BACK-7")
@settings(max_examples=600, deadline=None, database=None)
@given(scope=NAMES, space=NAMES, key=KEYS, version=VERSIONS, due=SCORES, expires=SCORES, parts_first=st.booleans())
def test_check_put_decides_as_its_parts_do(scope: Any, space: Any, key: Any, version: Any, due: Any, expires: Any,
                                           parts_first: bool) -> None:
    """``check_put`` returns what checking the names, the key, the version and the two
    scores one by one returns, or raises the same error — whether the names were seen
    good before (the shortcut's case) or not."""
    args = (scope, space, key, version, due, expires)
    if parts_first:
        by_parts = _outcome(_put_by_parts, *args)
        whole = _outcome(check_put, *args)
    else:
        whole = _outcome(check_put, *args)
        by_parts = _outcome(_put_by_parts, *args)
    assert _same(whole, by_parts), (args, whole, by_parts)
    assert _same(_outcome(check_record, scope, space, key), _outcome(_record_by_parts, scope, space, key))


@pytest.mark.spec("BACK-7")
@pytest.mark.parametrize("key, error", [
    ("a\x00", "contains U+0000"),
    ("", "must not be empty"),
    ("x" * (MAX_KEY_CHARS + 1), f"at most {MAX_KEY_CHARS} characters"),
    ("k\ud801", "lone surrogate"),
    (7, "must be a str"),
])
def test_a_bad_key_is_refused_under_names_seen_good(key: Any, error: str) -> None:
    """Names already known good do not let a bad key through: the error names ``key``
    and says why."""
    check_record("bot", "inbox", "fine")  # the names are known good from here on
    for call in (lambda: check_put("bot", "inbox", key, 0, None, None), lambda: check_record("bot", "inbox", key)):
        with pytest.raises(ValueError) as caught:  # InvalidKeyError and InvalidKeyTypeError both are
            call()
        assert "key" in str(caught.value) and error in str(caught.value), caught.value


GOOD = ("bot", "inbox", "m1", 3, 1.5, None)
BAD = {
    0: ["", "a\x00b", "s\ud800", 5, None],
    1: ["", "a\x00b", "s\ud800", b"x"],
    2: ["", "a\x00", "k\ud801", "x" * (MAX_KEY_CHARS + 1), 7, None, True],
    3: [MAX_VERSION, -MAX_VERSION - 2, True, 1.0, "1", None],
    4: [float("nan"), 3, True, 10**400, "1", 2**53 + 1],
    5: [float("nan"), 3, False, 10**400, "1"],
}


@pytest.mark.spec("BACK-7")
@pytest.mark.parametrize("position, bad", [(p, v) for p, values in BAD.items() for v in values])
def test_one_bad_argument_among_good_ones_is_decided_as_by_the_parts(position: int, bad: Any) -> None:
    """Every argument, bad while the others are good and the names known good: the
    shortcut's nearest miss."""
    check_record("bot", "inbox", "m1")
    args = list(GOOD)
    args[position] = bad
    assert _same(_outcome(check_put, *args), _outcome(_put_by_parts, *args)), args
    if position < 3:
        assert _same(_outcome(check_record, *args[:3]), _outcome(_record_by_parts, *args[:3])), args
