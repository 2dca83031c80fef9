"""The records of a ``botmesh.events`` journal and the protocol both journals implement.

An :class:`EventRecord` is one event of an app's journal (or, in channel
:data:`BOT_CHANNEL`, one inbound record of a bot using the journal as its durability
backend, EVENTS-1). Its life::

    pending ──claim──▶ leased ──complete──▶ done
       ▲                 │ └──fail──▶ failed (claimable again at retry_at, if given)
       │                 │ └──fail(dead=True)──▶ dead
       └──release────────┘
    replay(id): done / failed / dead / pending ──▶ replay (claimable at once, attempts 0)

A claim hands out a **lease**: owner, fencing token, expiry. The token grows with every
claim of the record, so a holder whose lease expired and was taken by another cannot
complete, fail, release or heartbeat it any more (those calls answer ``False``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from botmesh.core.errors import BotmeshError

__all__ = [
    "ANY_CHANNEL",
    "BOT_CHANNEL",
    "BOT_EVENT_TYPES",
    "STATES",
    "EventJournalError",
    "EventRecord",
    "Lease",
    "LeasedEventJournal",
]

STATES: Final = ("pending", "leased", "done", "failed", "dead", "replay")
"""The states of an :class:`EventRecord` (module docstring)."""

BOT_CHANNEL: Final = "botwa:durable"
"""The channel of a bot's inbound records (EVENTS-1)."""

BOT_EVENT_TYPES: Final = ("botwa.inbound.message", "botwa.inbound.interaction")
"""The ``event_type`` of a bot's inbound records: a message, or an interaction (a button
or list reply)."""


class _AnyChannel:
    def __repr__(self) -> str:
        return "ANY_CHANNEL"


ANY_CHANNEL: Final[Any] = _AnyChannel()
"""``list(channel=ANY_CHANNEL)`` (the default) lists every channel; ``channel=None`` only
the app's own records (no channel)."""


class EventJournalError(BotmeshError):
    """A call the journal refuses for what it asks (an id that exists, a bot record given
    to an app's lease operation, ...). A ``ValueError`` is raised for malformed arguments."""


@dataclass(frozen=True)
class Lease:
    """Who holds a claimed record: ``owner``, the fencing ``token`` of this claim, and
    ``expires_at`` (milliseconds since the epoch)."""

    owner: str
    token: int
    expires_at: float


@dataclass
class EventRecord:
    """One event. Times are milliseconds since the epoch. ``payload`` is any JSON value.
    ``token`` is the last fencing token handed out for this record (0: never claimed);
    ``lease`` is set only in state ``leased``. ``available_at``: not claimed before
    (``None``: at once). ``meta`` is kept for the journal's own use (a bot record's scope
    and key)."""

    id: str
    channel: str | None
    event_type: str
    payload: Any = None
    state: str = "pending"
    attempts: int = 0
    token: int = 0
    lease: Lease | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    available_at: float | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The record as the journal stores it (a JSON object)."""
        lease = None if self.lease is None else {
            "owner": self.lease.owner, "token": self.lease.token, "expires_at": self.lease.expires_at}
        return {
            "id": self.id, "channel": self.channel, "event_type": self.event_type, "payload": self.payload,
            "state": self.state, "attempts": self.attempts, "token": self.token, "lease": lease,
            "created_at": self.created_at, "updated_at": self.updated_at, "available_at": self.available_at,
            "error": self.error, "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventRecord:
        """The record :meth:`to_json` wrote."""
        lease = data.get("lease")
        return cls(
            id=data["id"], channel=data.get("channel"), event_type=data.get("event_type", ""),
            payload=data.get("payload"), state=data.get("state", "pending"), attempts=data.get("attempts", 0),
            token=data.get("token", 0),
            lease=None if lease is None else Lease(lease["owner"], lease["token"], lease["expires_at"]),
            created_at=data.get("created_at", 0.0), updated_at=data.get("updated_at", 0.0),
            available_at=data.get("available_at"), error=data.get("error"), meta=dict(data.get("meta") or {}),
        )

    def claimable(self, now: float) -> bool:
        """Whether a claim at ``now`` may take it: ``pending``/``replay`` that is
        available, ``failed`` with a ``retry_at`` reached, or ``leased`` past its
        expiry."""
        if self.state in ("pending", "replay"):
            return self.available_at is None or self.available_at <= now
        if self.state == "failed":
            return self.available_at is not None and self.available_at <= now
        if self.state == "leased":
            return self.lease is None or self.lease.expires_at <= now
        return False


def check_lease_ms(lease_ms: Any) -> float:
    """``lease_ms`` as a positive finite float, ``ValueError`` naming it otherwise."""
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, (int, float)) or not math.isfinite(lease_ms) or lease_ms <= 0:
        raise ValueError(f"lease_ms must be a positive number of milliseconds, got {lease_ms!r}")
    return float(lease_ms)


class LeasedEventJournal(ABC):
    """The protocol of :class:`~botmesh.events.FileEventJournal` and
    :class:`~botmesh.events.SharedFileEventJournal`: every operation is atomic (it reads
    and writes under the journal's lock, between processes too for the shared one), and
    every lease operation is checked against the fencing token (module docstring). Times
    default to the wall clock; ``now=`` (milliseconds) sets them (tests, virtual time)."""

    fsync: bool
    """Whether each write is forced to disk before it returns."""
    append_log: bool
    """Whether writes append to ``<path>.log``."""
    multi_process: bool = False
    """Whether several processes may open the journal's file at once."""

    @property
    @abstractmethod
    def path(self) -> str:
        """The journal's file (absolute)."""

    @abstractmethod
    async def append(self, event_type: str, payload: Any = None, *, channel: str | None = None, id: str | None = None,
                     available_at: float | None = None, now: float | None = None) -> EventRecord:
        """Add a ``pending`` record; ``id`` defaults to a new unique one; an ``id`` that
        exists raises :class:`EventJournalError`."""

    @abstractmethod
    async def get(self, id: str) -> EventRecord | None:
        """The record ``id``, or ``None``."""

    @abstractmethod
    async def list(self, *, channel: Any = ANY_CHANNEL, state: str | Sequence[str] | None = None,
                   event_type: str | None = None, limit: int = 1000) -> list[EventRecord]:
        """Records in creation order, filtered by channel (``None``: the app's own),
        state(s) and type."""

    @abstractmethod
    async def replay(self, id: str, *, now: float | None = None) -> EventRecord | None:
        """Put a record that is not leased back to be processed again (state ``replay``,
        attempts 0, available at once); ``None`` when absent or leased."""

    @abstractmethod
    async def claim(self, owner: str, lease_ms: float, *, channel: str | None = None,
                    now: float | None = None) -> EventRecord | None:
        """Lease the oldest claimable record of ``channel`` to ``owner``; a claim without
        a channel only takes records without a channel (EVENTS-1). ``None`` when there is
        none."""

    @abstractmethod
    async def heartbeat(self, id: str, token: int, lease_ms: float, *, now: float | None = None) -> bool:
        """Extend the lease to ``now + lease_ms``; ``False`` when ``token`` is not the live
        lease's."""

    @abstractmethod
    async def complete(self, id: str, token: int, *, now: float | None = None) -> bool:
        """``leased`` → ``done``; ``False`` when ``token`` is not the current lease's."""

    @abstractmethod
    async def fail(self, id: str, token: int, error: str, *, retry_at: float | None = None, dead: bool = False,
                   now: float | None = None) -> bool:
        """``leased`` → ``failed`` (claimable again from ``retry_at`` when given) or, with
        ``dead``, ``dead``; ``False`` when ``token`` is not the current lease's."""

    @abstractmethod
    async def release(self, id: str, token: int, *, now: float | None = None) -> bool:
        """Give the lease back: ``leased`` → ``pending`` (the attempt stays counted);
        ``False`` when ``token`` is not the current lease's."""

    @abstractmethod
    async def close(self) -> None:
        """Let operations already called finish, then close; later calls raise
        ``BackendUnavailableError``. Idempotent."""
