"""Outgoing content: normalisation, the journal encoding (OUT-15), fingerprints (OUT-5)
and the per-channel text splitter (OUT-12, OUT-13)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any


class UnencodableContent(Exception):
    """Content that cannot be journaled as JSON (a stream, a file object ...)."""


def normalize(content: Any) -> dict[str, Any]:
    """``"hi"`` -> ``{"text": "hi"}``; a dict is kept (shallow copy)."""
    if isinstance(content, str):
        return {"text": content}
    if isinstance(content, dict):
        return dict(content)
    raise TypeError(f"content must be a str or a dict, got {type(content).__name__}")


def _encode(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnencodableContent(f"{path}: key {k!r} is not a string")
            out[k] = _encode(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise UnencodableContent(f"{path}: {type(value).__name__} cannot be journaled")


def encode(content: dict[str, Any]) -> dict[str, Any]:
    """The JSON form journaled in the outbox: bytes become ``{"$bytes": base64}``.
    Raises :class:`UnencodableContent` for anything else that is not JSON."""
    encoded = _encode(content, "content")
    assert isinstance(encoded, dict)
    return encoded


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            return base64.b64decode(value["$bytes"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def decode(encoded: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode`."""
    decoded = _decode(encoded)
    assert isinstance(decoded, dict)
    return decoded


def encoded_size(encoded: dict[str, Any]) -> int:
    return len(json.dumps(encoded, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def fingerprint(chat_id: str, encoded: dict[str, Any]) -> str:
    """Hash of chat + content (OUT-5), stable across processes and versions."""
    canon = json.dumps([chat_id, encoded], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:32]


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


def part_key(key: str, index: int) -> str:
    """Key of part ``index`` (1-based) of the send ``key``: ``key``, ``key#2`` ...
    (OUT-12). The link between parts is stored in ``previous_part``, never inferred from
    the key."""
    return key if index == 1 else f"{key}#{index}"
