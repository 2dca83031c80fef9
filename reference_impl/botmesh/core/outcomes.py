"""What the durability engine returns and counts: :class:`SendResult` (what
``ctx.reply`` / ``bot.send`` give back), the outcomes of one send attempt, the metric
names of ``bot.durability.metrics()`` and the scope id of SCOPE-1. Kept apart from
:mod:`.engine` so that the engine module stays one concern (the journals at work)."""

from __future__ import annotations

from dataclasses import dataclass, field

METRIC_KEYS = (
    "inbound_journaled",
    "inbound_duplicates",
    "inbound_replayed",
    "inbound_dead",
    "outbox_journaled",
    "outbox_deduped",
    "outbox_retried",
    "outbox_deferred",
    "outbox_dead",
    "outbox_ambiguous",
    "outbox_bypassed",
    "stale_leases",
    "outbox_diverged",
)


@dataclass
class SendResult:
    """What ``ctx.reply``/``bot.send`` return. ``message_id`` is the provider's id of the
    first part (None when the send was skipped as ``unknown`` or is still pending);
    ``deduped`` is True when answered from the outbox (OUT-2)."""

    message_id: str | None
    key: str | None = None
    message_ids: list[str] = field(default_factory=list)
    deduped: bool = False
    state: str = "sent"


@dataclass
class _Sent:
    message_id: str
    settled: bool = True
    """``mark_sent`` took (False: the lease had been taken over meanwhile, LEASE-2)."""


@dataclass
class _Failed:
    error: BaseException
    delay: float


@dataclass
class _Dead:
    error: BaseException | str


def derive_scope(tenant_id: str | None, environment_id: str | None, bot_id: str, connection_id: str) -> str:
    """The scope id of SCOPE-1: ``tenant/environment/bot/connection`` ("-" when unset)."""
    return "/".join(p if p else "-" for p in (tenant_id, environment_id, bot_id, connection_id))
