"""What the durability engine, flows and media need from the bot, as protocols.

:mod:`botmesh.core.bot` imports the engine, flows and media; they in turn must call back
into the bot (the engine dispatches, prepares and runs handlers, emits events, runs the
send hooks). They do so through the protocols of this module, never by importing
``bot.py``, so the modules form no import cycle:

* :class:`BotHost` — what the engine calls on the bot. :class:`~botmesh.core.bot.Bot`
  implements it.
* :class:`HandlerContext` — the context of one inbound event as flows, media and the
  engine use it. :class:`~botmesh.core.bot.Context` implements it.
* :class:`ReplayedMedia` — the media of a replayed message, handed from the engine to the
  bot's :meth:`BotHost.prepare` and kept on the context.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, TypeVar

from .clock import Clock
from .provider import InboundEvent, Provider
from .records import InboxRecord

__all__ = ["BotHost", "CtxT", "HandlerContext", "ReplayedMedia"]


class ReplayedMedia:
    """The media of a replayed message: the rebuilt reference, or why it is missing."""

    def __init__(self, ref: Any = None, reason: str | None = None, detail: str | None = None) -> None:
        self.ref = ref
        self.reason = reason
        self.detail = detail


CtxT = TypeVar("CtxT", bound="HandlerContext")
"""The context type a host's :meth:`BotHost.prepare` makes and its
:meth:`BotHost.run_handlers` takes back (the bot's :class:`~botmesh.core.bot.Context`)."""


class HandlerContext(Protocol):
    """The context of one inbound event, as flows, media and the engine see it.

    The engine keeps two pieces of per-event bookkeeping on it: ``send_count`` numbers
    the sends keyed under the inbound record (OUT-3 rule 2), and ``durability_failed``
    is set when the journal failed under one of them, so that the inbound record is
    retried rather than completed (INB-2).
    """

    send_count: int
    durability_failed: BaseException | None

    @property
    def bot(self) -> BotHost[Any]:
        """The bot handling the event."""
        ...

    @property
    def event(self) -> InboundEvent:
        """The inbound event."""
        ...

    @property
    def text(self) -> str:
        """The event's text."""
        ...

    @property
    def record_id(self) -> str | None:
        """Id of the inbox record being processed (None without durability)."""
        ...

    @property
    def replayed_media(self) -> ReplayedMedia | None:
        """The media rebuilt for a replayed message (None for a live one)."""
        ...

    async def reply(self, content: Any, *, idempotency_key: str | None = None) -> object:
        """Send ``content`` to the event's chat."""
        ...


class BotHost(Protocol[CtxT]):
    """What the durability engine needs from the bot it serves.

    The engine owns the journals; the bot owns the handlers, listeners, hooks and the
    message log. These are the bot's parts the engine drives, each keeping the meaning
    it has on the bot's own (non-durable) path.
    """

    @property
    def provider(self) -> Provider:
        """The channel the bot receives from and sends to."""
        ...

    @property
    def clock(self) -> Clock:
        """The clock every reading of time goes through."""
        ...

    @property
    def rng(self) -> random.Random:
        """The source of backoff jitter."""
        ...

    @property
    def bot_id(self) -> str:
        """Part of the scope (SCOPE-1) and of the default ``instance_id`` (LEASE-3)."""
        ...

    @property
    def connection_id(self) -> str:
        """Part of the scope (SCOPE-1) and of the default ``instance_id`` (LEASE-3)."""
        ...

    @property
    def tenant_id(self) -> str | None:
        """Part of the scope (SCOPE-1)."""
        ...

    @property
    def environment_id(self) -> str | None:
        """Part of the scope (SCOPE-1)."""
        ...

    def forget_seen(self, event_id: str) -> None:
        """Drop ``event_id`` from the in-memory dedupe, so that a redelivery of an event
        the journal could not record is taken again (INB-8)."""
        ...

    async def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Call the listeners of ``event`` (``bot.on``); a listener never breaks
        processing."""
        ...

    async def dispatch(self, event: InboundEvent, record: InboxRecord | None) -> None:
        """The plain path: prepare and run the handlers, errors reported."""
        ...

    async def prepare(self, event: InboundEvent, record: InboxRecord | None, replayed_media: ReplayedMedia | None) -> CtxT:
        """The work before the handlers: the context of ``event``. May raise (INB-5)."""
        ...

    async def run_handlers(self, ctx: CtxT) -> None:
        """Route ``ctx`` to its handler; a handler's error is reported, not raised
        (INB-6)."""
        ...

    def has_before_send(self) -> bool:
        """Whether a ``before("send")`` hook is registered (without one,
        :meth:`run_before_send` returns its content itself)."""
        ...

    async def run_before_send(self, chat_id: str, content: dict[str, Any]) -> dict[str, Any] | None:
        """The ``before("send")`` hooks: the content to send, or None when cancelled."""
        ...

    async def after_send(
        self, chat_id: str, content: dict[str, Any], message_id: str, key: str | None, *, journaled: bool = False
    ) -> None:
        """The ``after("send")`` hooks and the message log, once the provider accepted a
        send. ``journaled``: ``content`` is the outbox's journal form of it (the hooks get
        it decoded, the log as it is)."""
        ...
