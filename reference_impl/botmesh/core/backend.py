"""The durability backend interface: the operations the engine performs on the two
journals. :class:`botmesh.core.kv_durability.KvDurability` implements it over any
:class:`~botmesh.core.spi.DurableKv`; a backend may also implement it directly.

Every **write** operation is named (``"inbox.journal"``, ``"outbox.mark_sent"`` ...,
see :data:`WRITE_OPS`): these names are the crash points of ``botmesh_testkit``'s
``crashable`` wrapper, and each one is a single atomic step — it either happens whole or
not at all.

Common rules:

* ``scope`` is the bot's namespace (SCOPE-1); an operation never sees or changes another
  scope's records (SCOPE-2).
* Times (``now``, ``next_at``, ``lease_until``, ``expires_at``) are milliseconds since
  the epoch read from the engine's clock; the backend never reads a clock of its own.
* Operations that take a ``token`` are **fenced**: they apply only when the record is
  still leased (state ``leased``/``sending``) under exactly that fencing token, and
  return ``False`` otherwise (the caller counts a stale lease, LEASE-2).
* Errors are botmesh's (:class:`~botmesh.core.errors.BackendUnavailableError` when the
  storage cannot be reached). A write that raised may or may not have been applied; the
  engine re-reads by key before acting on that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .records import InboxRecord, OutboxRecord
from .spi_types import Capabilities

WRITE_OPS: dict[str, str] = {
    "inbox.journal": "inbox_journal",
    "inbox.claim": "inbox_claim",
    "inbox.heartbeat": "inbox_heartbeat",
    "inbox.complete": "inbox_complete",
    "inbox.retry_later": "inbox_retry_later",
    "inbox.kill": "inbox_kill",
    "inbox.replay": "inbox_replay",
    "inbox.purge": "inbox_purge",
    "outbox.journal": "outbox_journal",
    "outbox.claim": "outbox_claim",
    "outbox.heartbeat": "outbox_heartbeat",
    "outbox.mark_sent": "outbox_mark_sent",
    "outbox.mark_failed": "outbox_mark_failed",
    "outbox.mark_dead": "outbox_mark_dead",
    "outbox.mark_unknown": "outbox_mark_unknown",
    "outbox.split": "outbox_split",
    "outbox.retry": "outbox_retry",
    "outbox.discard": "outbox_discard",
    "outbox.purge": "outbox_purge",
}
"""Crash-point name -> method name, for every write operation of the interface."""

READ_OPS: dict[str, str] = {
    "inbox.get": "inbox_get",
    "inbox.list": "inbox_list",
    "inbox.due": "inbox_due",
    "outbox.get": "outbox_get",
    "outbox.list": "outbox_list",
    "outbox.due": "outbox_due",
    "journals.due": "due",
}


class DurabilityBackend(ABC):
    """Where the inbox and outbox journals live."""

    name: str = "backend"
    capabilities: Capabilities = Capabilities()

    async def start(self) -> None:
        """Called by ``bot.start()`` (ENABLE-3). Idempotent."""

    async def stop(self) -> None:
        """Called by ``bot.stop()``. Idempotent."""

    async def durability_settings(self) -> dict[str, str] | None:
        """Optional: the live settings the backend's durability rests on, in the form of
        :meth:`botmesh.core.spi.DurableKv.durability_settings` (``None``, the default:
        not reported). Called on a started backend;
        :class:`~botmesh.core.kv_durability.KvDurability` asks its kv."""
        return None

    # -- inbox ------------------------------------------------------------------------
    @abstractmethod
    async def inbox_journal(self, scope: str, record: InboxRecord) -> tuple[InboxRecord, bool]:
        """Create ``record`` (normally state ``leased`` to its owner, attempts 1, token 1)
        unless a record with its id exists. Returns ``(stored, created)``: on a
        redelivery, the existing record and ``False`` (INB-4)."""

    @abstractmethod
    async def inbox_claim(
        self, scope: str, id: str, *, owner: str, incarnation: str, now: float, lease_ms: float, recover: bool
    ) -> InboxRecord | None:
        """Lease the record to ``owner`` when it is claimable: ``pending`` with
        ``next_at <= now``; ``leased`` with ``lease_until <= now``; or — with
        ``recover`` — ``leased`` to the same ``owner`` under another ``incarnation``
        (LEASE-4). The new lease has ``token`` one larger, ``attempts`` one larger
        (INB-7), ``lease_until = now + lease_ms``. Returns the new record, or None."""

    @abstractmethod
    async def inbox_heartbeat(self, scope: str, id: str, *, token: int, lease_until: float) -> bool:
        """Extend a lease (LEASE-1). Fenced."""

    @abstractmethod
    async def inbox_complete(self, scope: str, id: str, *, token: int, now: float, expires_at: float | None) -> bool:
        """Mark ``done`` (INB-2); purgeable from ``expires_at`` (None: kept). Fenced."""

    @abstractmethod
    async def inbox_retry_later(self, scope: str, id: str, *, token: int, next_at: float, error: str) -> bool:
        """Back to ``pending`` until ``next_at`` after a failure before the handlers
        (INB-5). Fenced."""

    @abstractmethod
    async def inbox_kill(self, scope: str, id: str, *, token: int | None, now: float, error: str) -> bool:
        """Move to ``dead`` (the DLQ). Fenced when ``token`` is given; ``None`` is an
        operator's or the engine's unconditional move of a non-done record."""

    @abstractmethod
    async def inbox_replay(self, scope: str, id: str, *, now: float) -> InboxRecord | None:
        """Operator replay (OPS-2): a ``dead``, ``done`` or ``pending`` record becomes
        ``pending`` now with its attempts reset. Returns it, or None when absent or
        leased."""

    @abstractmethod
    async def inbox_purge(self, scope: str, *, now: float, limit: int) -> int:
        """Delete up to ``limit`` records whose ``expires_at <= now`` (OPS-3). Returns how
        many were deleted."""

    @abstractmethod
    async def inbox_get(self, scope: str, id: str) -> InboxRecord | None: ...

    @abstractmethod
    async def inbox_list(self, scope: str, *, state: str | None = None, limit: int = 1000) -> list[InboxRecord]:
        """Records (optionally of one state), ordered by id."""

    @abstractmethod
    async def inbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        """Ids of ``leased``/``pending`` records whose lease or retry time is
        ``<= upto``, earliest first."""

    async def due(self, scope: str, *, upto: float, limit: int) -> tuple[list[str], list[str]]:
        """What one pass of the sweep reads: ``(inbox_due(...), outbox_due(...))`` with
        the same arguments. Each list is what its method would return at some instant
        during the call (not one snapshot of both). The default calls the two in turn;
        :class:`~botmesh.core.kv_durability.KvDurability` asks its kv for both indexes
        at once (:meth:`~botmesh.core.spi.DurableKv.ranges`: one round trip on a
        server)."""
        return (await self.inbox_due(scope, upto=upto, limit=limit),
                await self.outbox_due(scope, upto=upto, limit=limit))

    # -- outbox -----------------------------------------------------------------------
    @abstractmethod
    async def outbox_journal(self, scope: str, record: OutboxRecord) -> tuple[OutboxRecord, bool]:
        """Create ``record`` unless its key exists (then return the stored one and
        False). A record created in state ``sending`` is leased to its owner: the
        provider call may begin as soon as this returns (OUT-1)."""

    @abstractmethod
    async def outbox_claim(
        self, scope: str, key: str, *, owner: str, incarnation: str, now: float, lease_ms: float, recover: bool
    ) -> tuple[OutboxRecord, str] | None:
        """Lease a send: ``pending``/``failed`` with ``next_at`` due, or ``sending`` whose
        lease expired (or, with ``recover``, is held by the same owner under another
        incarnation). The record becomes ``sending`` with a larger token and
        ``attempts + 1``. Returns ``(new record, previous state)``: a previous state of
        ``sending`` is the ambiguity of OUT-14 the caller must resolve."""

    @abstractmethod
    async def outbox_heartbeat(self, scope: str, key: str, *, token: int, lease_until: float) -> bool: ...

    @abstractmethod
    async def outbox_mark_sent(
        self, scope: str, key: str, *, token: int, message_id: str, now: float, expires_at: float | None
    ) -> bool:
        """``sending`` -> ``sent`` with the provider's message id (OUT-1). Fenced."""

    @abstractmethod
    async def outbox_mark_failed(self, scope: str, key: str, *, token: int, next_at: float, error: str) -> bool:
        """``sending`` -> ``failed``, retry at ``next_at`` (OUT-7). Fenced."""

    @abstractmethod
    async def outbox_mark_dead(self, scope: str, key: str, *, token: int | None, now: float, error: str) -> bool:
        """To the DLQ (OUT-7, OUT-8, OUT-12). Fenced when ``token`` is given; otherwise
        any state but ``sent``."""

    @abstractmethod
    async def outbox_mark_unknown(self, scope: str, key: str, *, token: int, now: float) -> bool:
        """``sending`` -> ``unknown``: ambiguous and skipped (OUT-14). Fenced."""

    @abstractmethod
    async def outbox_split(self, scope: str, key: str, *, token: int | None, content: dict[str, object]) -> bool:
        """Replace the content of a record by its first part once the other parts are
        journaled (OUT-13). Fenced when ``token`` is given; otherwise only a
        ``pending``/``failed`` record."""

    @abstractmethod
    async def outbox_retry(self, scope: str, key: str, *, now: float) -> bool:
        """Operator retry (OPS-2): ``dead``, ``failed`` or ``unknown`` -> ``pending`` now,
        attempts reset."""

    @abstractmethod
    async def outbox_discard(self, scope: str, key: str) -> bool:
        """Forget a send entirely (OPS-2). True when a record was deleted."""

    @abstractmethod
    async def outbox_purge(self, scope: str, *, now: float, limit: int) -> int: ...

    @abstractmethod
    async def outbox_get(self, scope: str, key: str) -> OutboxRecord | None: ...

    @abstractmethod
    async def outbox_list(self, scope: str, *, state: str | None = None, limit: int = 1000) -> list[OutboxRecord]: ...

    @abstractmethod
    async def outbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        """Keys of ``pending``/``failed``/``sending`` records due (retry time or lease
        expiry) ``<= upto``, earliest first."""
