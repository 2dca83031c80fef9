"""Outgoing content: normalisation, the journal encoding (OUT-15), fingerprints (OUT-5),
the per-channel text splitter (OUT-12, OUT-13) and the keys of a split text's parts."""

from __future__ import annotations

import base64
import hashlib
import json
import math
from typing import Any

from .errors import InvalidKeyError
from .inputs import MAX_ID_CHARS, check_key, describe


class UnencodableContent(Exception):
    """Content that cannot be journaled as JSON (a stream, a file object, a NaN or
    infinite float, a string with a lone surrogate, a key that is not a string ...). The
    message names where in the content the value is (``content.meta.ratio: inf ...``)."""


def normalize(content: Any) -> dict[str, Any]:
    """``"hi"`` -> ``{"text": "hi"}``; a dict is kept (shallow copy)."""
    if isinstance(content, str):
        return {"text": content}
    if isinstance(content, dict):
        return dict(content)
    raise TypeError(f"content must be a str or a dict, got {type(content).__name__}")


def _check_str(value: str, path: str, what: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end]
        raise UnencodableContent(
            f"{path}: {what} {_short(value)} holds the lone surrogate {bad!r}, which JSON text in UTF-8 cannot carry"
        ) from None


def _short(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _encode(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnencodableContent(f"{path}: {value!r} is not a JSON number (JSON has no NaN or infinity)")
        return value
    if isinstance(value, str):
        _check_str(value, path, "the string")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnencodableContent(f"{path}: key {k!r} is not a string")
            _check_str(k, path, "the key")
            # an ASCII str (a text, the usual value) is kept as it is: no path built for it
            out[k] = v if type(v) is str and v.isascii() else _encode(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise UnencodableContent(f"{path}: {type(value).__name__} cannot be journaled")


def encode(content: dict[str, Any]) -> dict[str, Any]:
    """The JSON form journaled in the outbox: bytes become ``{"$bytes": base64}``.
    Raises :class:`UnencodableContent` for anything else that is not JSON — also for
    what Python's ``json`` would write but no backend may store (``NaN``, ``Infinity``,
    lone surrogates): every backend then sees the same thing, nothing (OUT-15)."""
    encoded = _encode(content, "content")
    assert isinstance(encoded, dict)
    return encoded


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and "$bytes" in value:
            return base64.b64decode(value["$bytes"])
        out = {}
        for k, v in value.items():  # a string (a text, the usual value) kept without a call
            out[k] = v if type(v) is str else _decode(v)
        return out
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def decode(encoded: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode`."""
    decoded = _decode(encoded)
    assert isinstance(decoded, dict)
    return decoded


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# (built once: json.dumps with options builds an encoder per call)


def encoded_size(encoded: dict[str, Any]) -> int:
    return len(_COMPACT.encode(encoded).encode("utf-8"))


def fingerprint(chat_id: str, encoded: dict[str, Any]) -> str:
    """Hash of chat + content (OUT-5), stable across processes and versions."""
    return _digest(_CANONICAL.encode([chat_id, encoded]).encode("utf-8"))


def _digest(canon: bytes) -> str:
    """The fingerprint of a canonical ``[chat_id, encoded]`` text."""
    return hashlib.sha256(canon).hexdigest()[:32]


def journal_form(chat_id: str, content: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
    """``content``'s journal form (:func:`encode`), its :func:`fingerprint` and its
    :func:`encoded_size`, from one encoding and one JSON text (issue 16: a send without
    ``before("send")`` hooks journals the very content it fingerprinted). The size is
    taken from the canonical text: it differs from the compact one only in the order of
    the keys, so it has the same length; minus the chat id's part of it."""
    encoded = encode(content)
    canon = _CANONICAL.encode([chat_id, encoded]).encode("utf-8")
    # canon is '[' + chat id + ',' + content + ']'
    size = len(canon) - len(_CANONICAL.encode(chat_id).encode("utf-8")) - 3
    return encoded, _digest(canon), size


def split_text(text: str, limit: int) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` characters, preferring a paragraph
    break, then a line break, then a space, in the second half of the window; else a hard
    cut. Deterministic: the same text and limit always give the same parts (OUT-13).
    Joining the parts gives back the text (separators stay at the end of a part)."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    parts: list[str] = []
    rest = text
    while len(rest) > limit:
        window = rest[:limit]
        cut = -1
        for sep in ("\n\n", "\n", " "):
            pos = window.rfind(sep)
            if pos >= limit // 2:
                cut = pos + len(sep)
                break
        if cut <= 0:
            cut = limit
        parts.append(rest[:cut])
        rest = rest[cut:]
    if rest or not parts:
        parts.append(rest)
    return parts


def split_content(content: dict[str, Any], limit: int | None) -> list[dict[str, Any]]:
    """One content per part when its ``text`` exceeds ``limit`` (OUT-12); else
    ``[content]``."""
    text = content.get("text")
    if limit is None or not isinstance(text, str) or len(text) <= limit:
        return [content]
    return [{**content, "text": chunk} for chunk in split_text(text, limit)]


PART_SEPARATOR = "\x1f"
"""U+001F (the ASCII *unit separator*): the character that puts the keys of a split
text's later parts in a namespace of their own (OUT-12). No idempotency key a user gives
may contain it (:func:`check_idempotency_key`), and the keys the engine makes itself
(``<inbound id>:<n>``, ``<key>~<fingerprint>``, ``rnd:<hex>``) never end in
``U+001F#<digits>``: so a part key never equals a user's key, whatever the user's key
looks like (``order#2`` included)."""


def part_key(key: str, index: int) -> str:
    """Key of part ``index`` (1-based) of the send ``key`` (OUT-12): ``key`` itself, then
    ``key + "\x1f#2"``, ``key + "\x1f#3"`` … — printed, ``key#2``, as the spec writes
    it; as a string never a key a user can send under. The link between parts is stored
    in ``previous_part``, never inferred from the key."""
    return key if index == 1 else f"{key}{PART_SEPARATOR}#{index}"


def legacy_part_key(key: str, index: int) -> str:
    """The part key earlier versions wrote (``key#2`` …), which a user's own key could
    equal. Read only: chains an earlier version journaled keep their keys (see
    :func:`send_key_of`), new ones use :func:`part_key`."""
    return key if index == 1 else f"{key}#{index}"


def send_key_of(key: str, part: int) -> str:
    """The key of the send that the record ``key`` (part ``part``) belongs to: the key
    of its first part — for a part written by this version or by an earlier one."""
    if part > 1:
        for suffix in (part_key("", part), legacy_part_key("", part)):
            if key.endswith(suffix) and len(key) > len(suffix):
                return key[: -len(suffix)]
    return key


def check_idempotency_key(key: Any) -> str:
    """An explicit ``idempotency_key=`` (OUT-3 rule 1), or an
    :class:`~botmesh.core.errors.InvalidKeyError` (a ``ValueError``; a ``TypeError`` too
    for a key that is not a ``str``) naming it: a key the engine accepts
    (:func:`botmesh.core.inputs.check_key`, at most
    :data:`~botmesh.core.inputs.MAX_ID_CHARS` characters) without U+001F, the character
    reserved for the keys of a split text's parts (:data:`PART_SEPARATOR`, OUT-12)."""
    checked = check_key(key, "idempotency_key", limit=MAX_ID_CHARS)
    if PART_SEPARATOR in checked:
        raise InvalidKeyError(
            f"idempotency_key contains U+001F (at index {checked.index(PART_SEPARATOR)}), reserved for the keys of a "
            f"split text's parts (OUT-12), got {describe(checked)}",
            argument="idempotency_key",
            value=checked,
        )
    return checked
