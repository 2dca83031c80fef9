"""Records as the engine journals them (:func:`inbound`, :func:`outbound`), and the
helpers the failure messages use to show what a backend changed."""

from __future__ import annotations

from typing import Any

from botmesh.core.records import InboxRecord, OutboxRecord

from .base import INC_1, INF, LEASE_MS, OWNER_A, T0


def inbound(
    id: str,
    *,
    chat_id: str = "chat-1",
    text: str = "hi",
    owner: str = OWNER_A,
    incarnation: str = INC_1,
    now: float = T0,
    lease_ms: float = LEASE_MS,
) -> InboxRecord:
    """An inbox record as the engine journals an admitted event (INB-1): ``leased`` to
    ``owner`` until ``now + lease_ms``, attempts 1, token 1."""
    event: dict[str, Any] = {
        "id": id, "chat_id": chat_id, "text": text, "kind": "message", "user_id": "user-1", "data": {}, "media": None
    }
    return InboxRecord(
        id=id, kind="message", chat_id=chat_id, event=event, state="leased", attempts=1, token=1, owner=owner,
        incarnation=incarnation, lease_until=now + lease_ms, claimed_at=now, created_at=now, updated_at=now,
    )


def outbound(
    key: str,
    *,
    state: str = "sending",
    chat_id: str = "chat-1",
    text: str | None = None,
    content: dict[str, Any] | None = None,
    owner: str = OWNER_A,
    incarnation: str = INC_1,
    now: float = T0,
    lease_ms: float = LEASE_MS,
    next_at: float | None = None,
    previous_part: str | None = None,
    part: int = 1,
    seq: int = 1,
) -> OutboxRecord:
    """An outbox record as the engine journals a send (OUT-1): ``sending`` — an inline
    send leased to ``owner`` (attempts 1, token 1) — or ``pending`` — enqueued, or a
    part waiting behind an earlier one, due at ``next_at`` (default ``now``)."""
    if state not in ("sending", "pending"):
        raise ValueError(f"the engine journals sends as 'sending' or 'pending', not {state!r}")
    sending = state == "sending"
    return OutboxRecord(
        key=key, chat_id=chat_id, content=content or {"type": "text", "text": text or f"reply {key}"},
        fingerprint=f"fp:{key}", rule="explicit", previous_part=previous_part, part=part,
        origin="inline" if sending else "enqueue", state=state, attempts=1 if sending else 0, token=1 if sending else 0,
        owner=owner if sending else None, incarnation=incarnation if sending else None,
        lease_until=now + lease_ms if sending else None, claimed_at=now if sending else None,
        next_at=None if sending else (now if next_at is None else next_at), created_at=now, updated_at=now, seq=seq,
    )


def _j(record: Any) -> dict[str, Any] | None:
    """A record as JSON (None stays None): what is compared."""
    return None if record is None else record.to_json()


def _changes(before: Any, after: Any) -> str:
    """The fields that differ between two records, for messages."""
    a, b = _j(before), _j(after)
    if a is None or b is None:
        return f"{a!r} -> {b!r}"
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    return ", ".join(f"{k}: {x!r} -> {y!r}" for k, (x, y) in diff.items()) or "nothing"


def _when(t: float) -> str:
    """``T0+<ms>`` for messages."""
    if t == INF:
        return "inf"
    d = t - T0
    return "T0" if d == 0 else f"T0{d:+.0f}"
