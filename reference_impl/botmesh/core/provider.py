"""The provider (channel) interface, inbound events and the provider errors of
OUT-7/OUT-8."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import BotmeshError


class ProviderError(BotmeshError):
    """An error raised by a provider. ``retryable`` says whether trying the same send
    again may succeed (OUT-8: ``retryable=False`` sends it straight to the DLQ)."""

    code = "PROVIDER_ERROR"
    retryable: bool = True

    def __init__(self, message: str, *, retryable: bool | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        if retryable is not None:
            self.retryable = retryable


class RateLimitedError(ProviderError):
    """The channel asked to slow down; the next attempt waits at least
    ``retry_after_ms`` (OUT-7, RETRY-1)."""

    code = "RATE_LIMITED"

    def __init__(self, message: str = "rate limited", *, retry_after_ms: float = 0.0, **details: Any) -> None:
        super().__init__(message, **details)
        self.retry_after_ms = float(retry_after_ms)


class DefinitiveProviderError(ProviderError):
    """Base of the errors that no retry can cure (OUT-8)."""

    retryable = False


class UnsupportedContentError(DefinitiveProviderError):
    code = "UNSUPPORTED_CONTENT"


class PayloadTooLargeError(DefinitiveProviderError):
    code = "PAYLOAD_TOO_LARGE"


class OutsideSessionWindowError(DefinitiveProviderError):
    code = "OUTSIDE_SESSION_WINDOW"


class RecipientUnreachableError(DefinitiveProviderError):
    code = "RECIPIENT_UNREACHABLE"


class MediaUnavailableError(ProviderError):
    """The media of a replayed message cannot be downloaded (MEDIA-3). ``reason`` is one
    of ``"not-durable"``, ``"provider-mismatch"``, ``"rehydrate-failed"``."""

    code = "MEDIA_UNAVAILABLE"
    retryable = False

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"media unavailable: {reason}")
        self.reason = reason


def is_definitive(error: BaseException) -> bool:
    """True for the errors that go straight to the DLQ (OUT-8)."""
    if isinstance(error, DefinitiveProviderError):
        return True
    return getattr(error, "retryable", True) is False


@dataclass
class InboundEvent:
    """A message or interaction the provider received.

    ``id`` is the channel's id of the event: a redelivery carries the same id (INB-4).
    ``media`` is the provider's own, possibly live, media reference.
    """

    id: str
    chat_id: str
    text: str = ""
    kind: str = "message"  # or "interaction"
    user_id: str | None = None
    media: Any = None
    data: dict[str, Any] = field(default_factory=dict)


Content = dict[str, Any]
"""Outgoing content: ``{"text": ...}``, ``{"media": {...}, "caption": ...}``, any JSON
object a provider understands; bytes values are allowed (journaled as base64, OUT-15)."""


class Provider(ABC):
    """A channel. The bot calls ``attach`` with its inbound entry point; the provider
    calls it for each event it receives (:meth:`deliver`) and awaits it: a webhook
    answers only when the event was journaled, and answers with an error status when
    :meth:`deliver` returns False, so that the channel redelivers (INB-8)."""

    name: str = "provider"
    text_limit: int | None = None
    """Longest text the channel accepts in one message (OUT-12); None: no limit."""

    def __init__(self) -> None:
        self._inbound: Callable[[InboundEvent], Awaitable[bool | None]] | None = None

    def attach(self, inbound: Callable[[InboundEvent], Awaitable[bool | None]]) -> None:
        self._inbound = inbound

    async def deliver(self, event: InboundEvent) -> bool:
        """Hand an inbound event to the attached bot. True when the bot took it:
        journaled and processed, recognised as a redelivery (INB-4), or dispatched without
        a journal (no durability, or ``fail_open``). False when the journal could not
        record it and it was not dispatched (INB-8, fail closed): acknowledge nothing to
        the channel then — answer the webhook with an error status — so that it
        redelivers; the bot has forgotten the event, so the redelivery is processed.

        It never raises for a journal failure, whatever the backend raised (a full disk,
        a server gone, a third party's own exception): a write that fails before the
        event is journaled is the False above; one that fails after it (settling it) is
        an ``error`` event, the sweep finishes the record and this returns True (INB-2,
        INB-3). It raises only for a programming error: with durability, an ``id`` that
        cannot be a journal key (not a non-empty ``str`` of at most 448 characters,
        valid Unicode without U+0000) raises
        :class:`~botmesh.core.errors.InvalidKeyError` (a ``ValueError``) naming it, before
        anything is journaled — a redelivery would not help; without an attached bot,
        ``BotmeshError``."""
        if self._inbound is None:
            raise BotmeshError("provider is not attached to a running bot")
        return (await self._inbound(event)) is not False

    async def start(self) -> None:
        """Connect the transport."""

    async def stop(self) -> None:
        """Disconnect the transport."""

    @abstractmethod
    async def send(self, chat_id: str, content: Content) -> str:
        """Send ``content`` to ``chat_id``; return the channel's message id. The provider
        never sees an idempotency key (OUT-6)."""

    async def edit(self, chat_id: str, message_id: str, content: Content) -> None:
        """Edit a sent message (not journaled, OUT-16)."""

    async def typing(self, chat_id: str) -> None:
        """Show a typing indicator (not journaled, OUT-16)."""

    # Optional media hooks (MEDIA-1, MEDIA-2). A provider that does not override them is
    # treated as one whose media tokens are already plain ids or URLs.
    serialize_media_ref: Callable[[Any], dict[str, Any] | None] | None = None
    """``serialize_media_ref(ref) -> {"v": ..., "data": ...} | None`` (synchronous)."""

    rehydrate_media_ref: Callable[[dict[str, Any], Any], Any] | None = None
    """``rehydrate_media_ref(stored, ref) -> ref``; raises ProviderError when ``stored``
    is invalid. Needs no live transport."""

    async def download_media(self, ref: Any) -> bytes:
        """Fetch the bytes of a media reference."""
        raise MediaUnavailableError("not-durable", f"{self.name} cannot download media")
