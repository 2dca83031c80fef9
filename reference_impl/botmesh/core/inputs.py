"""What the journals accept as keys, ids, names and index scores, checked in one place
(issue 13, BACK-7): the engine checks what a bot's caller gives it before any backend
sees it, and every built-in :class:`~botmesh.core.spi.DurableKv` checks its arguments
with the same functions, so that one bad input is refused the same way on memory, file,
SQLite, PostgreSQL and Redis — never stored as something else (an ``int`` as ``"5"``),
never a driver's own exception.

Keys (a record's key in a kv; an inbound event's id; an idempotency key):

* a ``str`` — nothing is converted: an ``int`` id would be stored as ``"5"`` by one
  backend and refused by another;
* non-empty;
* valid Unicode: no lone surrogate (``"\\ud800"`` cannot be encoded as UTF-8, which
  SQLite, PostgreSQL and Redis store);
* without U+0000 (PostgreSQL's ``text`` cannot hold it);
* at most :data:`MAX_KEY_CHARS` (512) characters in a kv — the ``DurableKv``
  contract — and at most :data:`MAX_ID_CHARS` (448) for what a caller gives the engine
  (inbound ids, ``idempotency_key=``): the engine derives keys from them
  (``<id>:<n>``, ``<key>#<part>``, ``<key>~<fingerprint>``) and keeps
  :data:`KEY_SUFFIX_RESERVE` characters for that, so a key derived from an accepted id
  still fits a kv.

Scopes and spaces are strings of the same kind without a length limit of their own;
``scan``'s ``after`` is any such string (empty included) or ``None``. Index scores
(``due``, ``expires``) are ``None`` or real numbers (not ``bool``) that a float holds,
``±inf`` included, NaN not; so is ``range``'s ``upto``. An ``expected_version``
is an ``int`` a signed 64-bit column holds (below 2**63 - 1, so the next one fits).

Every refusal is an :class:`~botmesh.core.errors.InvalidKeyError` or
:class:`~botmesh.core.errors.InvalidArgumentError` — both ``ValueError``; for a value of
the wrong type (an ``int`` key, a ``str`` score) also a ``TypeError`` — whose message
names the argument and shows the value (cut short when long), and whose ``argument`` /
``value`` say the same.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import InvalidArgumentError, InvalidArgumentTypeError, InvalidKeyError, InvalidKeyTypeError
from .spi import encode_json_object

__all__ = [
    "KEY_SUFFIX_RESERVE",
    "MAX_ID_CHARS",
    "MAX_KEY_CHARS",
    "MAX_VERSION",
    "check_after",
    "check_delete",
    "check_key",
    "check_name",
    "check_put",
    "check_range",
    "check_record",
    "check_scan",
    "check_score",
    "check_space",
    "check_upto",
    "check_version",
    "value_text",
    "describe",
    "text_problem",
]

MAX_KEY_CHARS = 512
"""The longest key a :class:`~botmesh.core.spi.DurableKv` must store (its contract)."""

KEY_SUFFIX_RESERVE = 64
"""Characters kept for what the engine appends to a caller's id or key (``:<n>``,
``~<12 hex digits>``, ``#<part>``)."""

MAX_ID_CHARS = MAX_KEY_CHARS - KEY_SUFFIX_RESERVE
"""The longest inbound id or ``idempotency_key`` the engine accepts (448)."""

MAX_VERSION = 2**63 - 1
"""The largest record version (a signed 64-bit integer in SQL backends)."""

_SHOWN = 60


def describe(value: Any) -> str:
    """``value`` for an error message: its repr, cut short (with its length) when long,
    preceded by its type when it is not a ``str``."""
    text = repr(value)
    if len(text) > _SHOWN + 20:
        size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as repr"
        text = f"{text[:_SHOWN]}... ({size})"
    return text if isinstance(value, str) else f"{type(value).__name__} {text}"


def text_problem(value: str) -> str | None:
    """Why the string ``value`` cannot be stored as a key or name (a lone surrogate,
    U+0000), or None."""
    if not value.isascii():  # (an ASCII string has no surrogate: not encoded for nothing)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"is not valid Unicode (a lone surrogate U+{ord(value[exc.start]):04X} at index {exc.start})"
    nul = value.find("\x00")
    if nul >= 0:
        return f"contains U+0000 (at index {nul}), which PostgreSQL cannot store"
    return None


def _refuse(argument: str, why: str, value: Any) -> InvalidKeyError:
    kind = InvalidKeyError if isinstance(value, str) else InvalidKeyTypeError
    return kind(f"{argument} {why}, got {describe(value)}", argument=argument, value=value)


def check_key(value: Any, argument: str = "key", *, limit: int = MAX_KEY_CHARS) -> str:
    """``value`` when it is a key (module docstring) of at most ``limit`` characters;
    :class:`InvalidKeyError` naming ``argument`` and the value otherwise."""
    if not isinstance(value, str):
        raise _refuse(argument, "must be a str", value)
    if not value:
        raise _refuse(argument, "must not be empty", value)
    if len(value) > limit:
        raise _refuse(argument, f"must be at most {limit} characters long, not {len(value)}", value)
    problem = text_problem(value)
    if problem is not None:
        raise _refuse(argument, problem, value)
    return value


def check_name(value: Any, argument: str) -> str:
    """``value`` when it is a scope or space name: a non-empty ``str``, valid Unicode,
    without U+0000 (no length limit)."""
    if not isinstance(value, str):
        raise _refuse(argument, "must be a str", value)
    if not value:
        raise _refuse(argument, "must not be empty", value)
    problem = text_problem(value)
    if problem is not None:
        raise _refuse(argument, problem, value)
    return value


_GOOD_NAMES: set[str] = set()
"""Scope and space names found good already (``str`` exactly): a kv call names the same
few again and again, so their check is a set lookup (issue 16). Bounded."""
_MAX_GOOD_NAMES = 4096


def check_space(scope: Any, space: Any) -> None:
    """``scope`` and ``space`` of a kv call (:func:`check_name` each)."""
    good = _GOOD_NAMES
    for value, argument in ((scope, "scope"), (space, "space")):
        if type(value) is str and value in good:
            continue
        check_name(value, argument)
        if type(value) is str and len(good) < _MAX_GOOD_NAMES:
            good.add(value)


def _usual_record(scope: Any, space: Any, key: Any) -> bool:
    """True when ``scope`` and ``space`` are names known good and ``key`` is certainly a
    good key: a ``str``, ASCII, 1 to ``MAX_KEY_CHARS`` characters, without U+0000 (an
    ASCII string holds no surrogate) — the arguments of nearly every call, in one
    expression. False: not known, ask :func:`check_space` and :func:`check_key` (which
    also say why)."""
    good = _GOOD_NAMES
    return (type(scope) is str and type(space) is str and scope in good and space in good
            and type(key) is str and 0 < len(key) <= MAX_KEY_CHARS and key.isascii() and "\x00" not in key)


def check_record(scope: Any, space: Any, key: Any) -> None:
    """``scope``, ``space`` and ``key`` of a kv call."""
    if _usual_record(scope, space, key):
        return  # the same outcome as below, without its calls (issue 16: every kv call checks)
    check_space(scope, space)
    check_key(key)


def check_after(value: Any) -> str | None:
    """``scan``'s ``after``: ``None`` or a ``str`` (empty included), valid Unicode,
    without U+0000."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _refuse("after", "must be a str or None", value)
    problem = text_problem(value)
    if problem is not None:
        raise _refuse("after", problem, value)
    return value


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_score(value: Any, argument: str) -> float | None:
    """An index score (``due``, ``expires``) as stored: ``None``, or a real number as a
    ``float`` (``±inf`` included: every backend orders them); NaN, a number too large
    for a float and anything else raise :class:`InvalidArgumentError` naming
    ``argument``."""
    if value is None:
        return None
    if type(value) is float and value == value:  # the common case, NaN excluded
        return value
    return _number(value, argument)


def check_upto(value: Any) -> float:
    """``range``'s ``upto``: a real number, ``±inf`` allowed, NaN refused."""
    return _number(value, "upto")


def _number(value: Any, argument: str) -> float:
    if not _real(value):
        raise InvalidArgumentTypeError(
            f"{argument} must be a number (milliseconds), got {describe(value)}", argument=argument, value=value
        )
    try:
        number = float(value)
    except OverflowError:
        raise InvalidArgumentError(
            f"{argument} is out of the range of a float, got {describe(value)}", argument=argument, value=value
        ) from None
    if math.isnan(number):
        raise InvalidArgumentError(f"{argument} must not be NaN", argument=argument, value=value)
    return number


def check_version(value: Any) -> int:
    """An ``expected_version``: an ``int`` (not ``bool``) that a signed 64-bit column
    holds, one less at the top so that the new version fits too (a negative one matches
    no record: a conflict, as on every backend)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentTypeError(
            f"expected_version must be an int, got {describe(value)}", argument="expected_version", value=value
        )
    if not -MAX_VERSION - 1 <= value < MAX_VERSION:
        raise InvalidArgumentError(
            f"expected_version must be below {MAX_VERSION}, got {describe(value)}", argument="expected_version", value=value
        )
    return value


def check_put(
    scope: Any, space: Any, key: Any, expected_version: Any, due: Any, expires: Any
) -> tuple[float | None, float | None]:
    """The arguments of ``put`` but the value: checked, the two scores as stored."""
    # (_usual_record's test written out, not called: every journal write passes here, issue 16)
    good = _GOOD_NAMES
    if (type(scope) is str and type(space) is str and scope in good and space in good
            and type(key) is str and 0 < len(key) <= MAX_KEY_CHARS and key.isascii() and "\x00" not in key
            and type(expected_version) is int and -MAX_VERSION - 1 <= expected_version < MAX_VERSION
            and (due is None or (type(due) is float and due == due))
            and (expires is None or (type(expires) is float and expires == expires))):
        return due, expires  # what the checks below return for these, without their calls
    check_record(scope, space, key)
    check_version(expected_version)
    return check_score(due, "due"), check_score(expires, "expires")


def check_delete(scope: Any, space: Any, key: Any, expected_version: Any) -> None:
    """The arguments of ``delete``."""
    check_record(scope, space, key)
    check_version(expected_version)


def check_range(scope: Any, space: Any, upto: Any) -> float:
    """The arguments of ``range`` but the index name: checked, ``upto`` as a float."""
    check_space(scope, space)
    return check_upto(upto)


def check_scan(scope: Any, space: Any, after: Any) -> str | None:
    """The arguments of ``scan`` but ``limit``: checked, ``after`` as given."""
    check_space(scope, space)
    return check_after(after)


def value_text(value: Any) -> str:
    """The JSON text a kv stores for ``value``: compact, ASCII only, what
    :func:`~botmesh.core.spi.check_json_object` accepts; ``TypeError`` for a value that
    is not a dict or holds what JSON cannot, ``ValueError`` for NaN/infinity and for
    nesting too deep to encode."""
    return encode_json_object(value)  # (one encoder for every call: issue 16)
