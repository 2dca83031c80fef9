"""The Bot runtime: the subset of botmesh that durable message processing needs.

Without ``durability`` the bot runs the plain in-memory path and makes no journal write
at all (ENABLE-1); with it, every inbound event goes through the inbox and every send
through the outbox (see :mod:`botmesh.core.engine`).
"""

from __future__ import annotations

import inspect
import logging
import random
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, overload

from .clock import Clock, RealClock
from .config import parse_durability
from .engine import DurabilityRuntime, SendResult
from .errors import ConfigError
from .flows import Flow
from .host import ReplayedMedia
from .inputs import describe, text_problem
from .provider import InboundEvent, Provider
from .records import InboxRecord
from .store import MemoryStore, Store

log = logging.getLogger("botmesh")

Handler = Callable[["Context"], Awaitable[Any]]
_HandlerT = TypeVar("_HandlerT", bound="Handler | Flow")
Pattern = str | re.Pattern[str] | Callable[[InboundEvent], bool]
_UNSET: Any = object()
_EVENTS = ("error", "durability:dead", "durability:ambiguous")
_HOOKS = ("send",)


class UserView:
    """``ctx.user``: JSON values of the chat's user in the store (namespace ``user``)."""

    def __init__(self, store: Store, user_key: str) -> None:
        self._store = store
        self._key = user_key

    async def get(self, name: str, default: Any = None) -> Any:
        data = await self._store.get("user", self._key) or {}
        return data.get(name, default)

    async def set(self, name: str, value: Any) -> None:
        data = await self._store.get("user", self._key) or {}
        data[name] = value
        await self._store.set("user", self._key, data)


class Context:
    """What a handler receives for one inbound event (the
    :class:`~botmesh.core.host.HandlerContext` of this bot)."""

    def __init__(self, bot: Bot, event: InboundEvent, record: InboxRecord | None, replayed_media: ReplayedMedia | None) -> None:
        self.bot = bot
        self.event = event
        self.chat_id = event.chat_id
        self.text = event.text
        self.record_id = record.id if record is not None else None
        """Id of the inbox record being processed (None without durability)."""
        self.replayed = record is not None and (record.attempts > 1 or bool(record.extra.get("replayed")))
        self.replayed_media = replayed_media
        self.user = UserView(bot.store, event.user_id or event.chat_id)
        self.send_count = 0
        """Sends keyed under the inbound record so far (OUT-3 rule 2; the engine counts)."""
        self._flow_checkpoint: dict[str, Any] | None = None
        self.durability_failed: BaseException | None = None
        """Set when the journal failed under a send of this handler: the inbound record
        is then retried with backoff, not completed (INB-2; INB-5's rules)."""

    async def reply(self, content: Any, *, idempotency_key: str | None = None) -> SendResult:
        """Send to this chat. Durable: journaled under ``<record id>:<n>`` unless a key
        is given (OUT-3); retried inline up to ``outbox.inline_max_ms`` (OUT-9)."""
        return await self.bot._send(self.chat_id, content, idempotency_key=idempotency_key, ctx=self)

    async def typing(self) -> None:
        """Typing indicator: never journaled (OUT-16)."""
        await self.bot.provider.typing(self.chat_id)


class Bot:
    """A bot: a provider, a store, handlers and (optionally) durability.

    ``durability``: leave it out for the plain in-memory bot (ENABLE-1); ``{}`` for a
    fresh ``MemoryDurability`` (ENABLE-2); or a dict of the CONF table, e.g.
    ``{"backend": FileDurability..., "instance_id": "bot-1"}``. Validated here: a bad
    value raises ``ConfigError`` naming the option (CONF-1).

    ``clock`` is injected (tests pass a ``VirtualClock``); ``rng`` drives backoff jitter.

    A durable bot should also get a persistent store: checkpoints of ``.persistent()``
    flows live there (ENABLE-4; ``start()`` warns when a crash-surviving backend is paired
    with a ``MemoryStore`` and persistent flows). Give each replica running at the same
    time its own ``instance_id``: two live processes with the same id take each other's
    leases (LEASE-5, a misconfiguration).

    A bot is the :class:`~botmesh.core.host.BotHost` of its durability engine: the
    methods under "engine hooks" (``emit``, ``dispatch``, ``prepare``, ``run_handlers``,
    ``run_before_send``, ``after_send``, ``forget_seen``) are what the engine calls;
    applications do not need them.
    """

    def __init__(
        self,
        provider: Provider,
        store: Store | None = None,
        durability: Any = _UNSET,
        *,
        bot_id: str = "bot",
        connection_id: str = "default",
        tenant_id: str | None = None,
        environment_id: str | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not isinstance(provider, Provider):
            raise ConfigError(f"provider: expected a Provider, got {type(provider).__name__}", option="provider")
        if store is not None and not isinstance(store, Store):
            raise ConfigError(f"store: expected a Store, got {type(store).__name__}", option="store")
        _check_ids(bot_id=bot_id, connection_id=connection_id, tenant_id=tenant_id, environment_id=environment_id)
        self.provider = provider
        self.store: Store = store if store is not None else MemoryStore()
        self.bot_id = bot_id
        self.connection_id = connection_id
        self.tenant_id = tenant_id
        self.environment_id = environment_id
        self.clock: Clock = clock or RealClock()
        self.rng = rng or random.Random()
        self._handlers: list[tuple[Pattern, Handler | Flow]] = []
        self._fallback: Handler | Flow | None = None
        self._listeners: dict[str, list[Callable[[dict[str, Any]], Any]]] = {e: [] for e in _EVENTS}
        self._before: dict[str, list[Callable[..., Any]]] = {h: [] for h in _HOOKS}
        self._after: dict[str, list[Callable[..., Any]]] = {h: [] for h in _HOOKS}
        self._flows: dict[str, Flow] = {}
        self._memory_flows: dict[str, dict[str, Any]] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_max = 10_000
        self.durability: DurabilityRuntime[Context] | None = None
        if durability is not _UNSET and durability is not None:
            self.durability = DurabilityRuntime(self, parse_durability(durability))
        self.running = False

    # -- registration -------------------------------------------------------------------
    @overload
    def when(self, pattern: Pattern, handler: None = None) -> Callable[[_HandlerT], _HandlerT]: ...
    @overload
    def when(self, pattern: Pattern, handler: _HandlerT) -> _HandlerT: ...

    def when(
        self, pattern: Pattern, handler: _HandlerT | None = None
    ) -> _HandlerT | Callable[[_HandlerT], _HandlerT]:
        """Route events matching ``pattern`` (a text compared case-insensitively, a
        compiled regex searched in the text, or a predicate on the event) to ``handler``
        — an ``async def handler(ctx)`` or a :class:`Flow` to start. Usable as a
        decorator; returns the handler."""

        def register(fn: _HandlerT) -> _HandlerT:
            self._register_flow(fn)
            self._handlers.append((pattern, fn))
            return fn

        return register if handler is None else register(handler)

    @overload
    def otherwise(self, handler: None = None) -> Callable[[_HandlerT], _HandlerT]: ...
    @overload
    def otherwise(self, handler: _HandlerT) -> _HandlerT: ...

    def otherwise(self, handler: _HandlerT | None = None) -> _HandlerT | Callable[[_HandlerT], _HandlerT]:
        """The catch-all handler for events no pattern matched. Usable as a decorator;
        returns the handler."""

        def register(fn: _HandlerT) -> _HandlerT:
            self._register_flow(fn)
            self._fallback = fn
            return fn

        return register if handler is None else register(handler)

    def _register_flow(self, fn: Handler | Flow) -> None:
        if isinstance(fn, Flow):
            other = self._flows.get(fn.name)
            if other is not None and other is not fn:
                raise ConfigError(f"flow name {fn.name!r} is used by two flows", option="flow")
            self._flows[fn.name] = fn

    def on(self, event: str, fn: Callable[[dict[str, Any]], Any]) -> None:
        """Listen to ``error``, ``durability:dead`` (``kind``, ``id``, ``error``) or
        ``durability:ambiguous`` (``key``, ``chat_id``) (OPS-1)."""
        if event not in self._listeners:
            raise ConfigError(f"bot.on: unknown event {event!r}; known: {', '.join(_EVENTS)}", option="event")
        self._listeners[event].append(fn)

    def before(self, what: str, fn: Callable[..., Any] | None = None) -> Any:
        """``before("send")``: ``fn(chat_id, content) -> content | None``; returning
        None keeps the content, returning False cancels the send. Runs once per send,
        before it is journaled (OUT-5, OUT-10)."""
        return self._hook(self._before, what, fn)

    def after(self, what: str, fn: Callable[..., Any] | None = None) -> Any:
        """``after("send")``: ``fn(chat_id, content, message_id)`` once the provider
        accepted a send."""
        return self._hook(self._after, what, fn)

    def _hook(self, table: dict[str, list[Callable[..., Any]]], what: str, fn: Callable[..., Any] | None) -> Any:
        if what not in table:
            raise ConfigError(f"unknown hook {what!r}; known: {', '.join(table)}", option="hook")

        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            table[what].append(f)
            return f

        return register if fn is None else register(fn)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the store, start the durability backend (ENABLE-3) and its sweep —
        whose first pass recovers what a previous incarnation left (INB-3, LEASE-4) —
        then the provider."""
        await self.store.open()
        if (
            self.durability is not None
            and self.durability.backend.capabilities.survives_crash
            and isinstance(self.store, MemoryStore)
            and any(f.is_persistent for f in self._flows.values())
        ):  # ENABLE-4
            log.warning(
                "durable bot with a MemoryStore: checkpoints of .persistent() flows will not survive a restart; "
                "give the bot a persistent store (e.g. SQLiteStore)"
            )
        self.provider.attach(self._receive)
        if self.durability is not None:
            await self.durability.start()
        await self.provider.start()
        self.running = True

    async def stop(self) -> None:
        """Stop the provider, the sweep and the backend."""
        self.running = False
        await self.provider.stop()
        if self.durability is not None:
            await self.durability.stop()

    async def abandon(self) -> None:
        """Drop the bot as a dead process would: cancel its tasks, touch no storage
        (for recovery tests, TEST-3)."""
        self.running = False
        if self.durability is not None:
            await self.durability.abandon()

    # -- engine hooks (BotHost): events and send hooks -------------------------------------
    async def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Call the listeners of ``event``; with no ``error`` listener an error is
        logged. A listener that raises is logged and never breaks processing."""
        if event == "error" and not self._listeners["error"]:
            log.error("botmesh error: %r", payload.get("error"))
        for fn in list(self._listeners[event]):
            try:
                result = fn(payload)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a listener never breaks processing
                log.exception("listener of %s failed", event)

    def has_before_send(self) -> bool:
        """Whether a ``before("send")`` hook is registered (without one,
        :meth:`run_before_send` returns the content it is given, untouched)."""
        return bool(self._before["send"])

    async def run_before_send(self, chat_id: str, content: dict[str, Any]) -> dict[str, Any] | None:
        """Run the ``before("send")`` hooks: the content to send, or None when a hook
        cancelled the send."""
        for fn in self._before["send"]:
            result = fn(chat_id, content)
            if inspect.isawaitable(result):
                result = await result
            if result is False:
                return None
            if isinstance(result, dict):
                content = result
        return content

    async def after_send(
        self, chat_id: str, content: dict[str, Any], message_id: str, key: str | None, *, journaled: bool = False
    ) -> None:
        """Run the ``after("send")`` hooks and log the sent message in the store.
        ``journaled``: ``content`` is in its journal form (``content.encode``'s, as the
        outbox keeps it): the hooks get it decoded, the log takes it as it is."""
        hooks = self._after["send"]
        if journaled:
            logged = content
            if hooks:
                from . import content as contentlib

                content = contentlib.decode(content)
        else:
            logged = _loggable(content)
        for fn in hooks:
            result = fn(chat_id, content, message_id)
            if inspect.isawaitable(result):
                await result
        await self.store.append_message(
            {"direction": "out", "chat_id": chat_id, "content": logged, "message_id": message_id,
             "key": key, "at": self.clock.now()}
        )

    # -- inbound (engine hooks: forget_seen, dispatch, prepare, run_handlers) -----------------
    def forget_seen(self, event_id: str) -> None:
        """Drop ``event_id`` from the in-memory dedupe of redeliveries (INB-8: an event
        the journal could not record must be taken when redelivered)."""
        self._seen.pop(event_id, None)

    async def _receive(self, event: InboundEvent) -> bool:
        """The provider's entry point for an inbound event; False when the event was
        not taken (its journal write failed, INB-8) and must be redelivered. With
        durability, an id that cannot be a journal key raises ``InvalidKeyError`` (a
        ``ValueError``) before anything is remembered or journaled."""
        if self.durability is not None:
            self.durability.check_inbound_id(event.id)
        if event.id in self._seen:  # in-memory dedupe of redeliveries
            if self.durability is not None:
                self.durability._count("inbound_duplicates")
            return True
        self._seen[event.id] = None
        if len(self._seen) > self._seen_max:
            self._seen.popitem(last=False)
        if self.durability is not None:
            return await self.durability.admit(event)
        await self.dispatch(event, None)
        return True

    async def dispatch(self, event: InboundEvent, record: InboxRecord | None) -> None:
        """The plain path: prepare and run handlers; errors go to ``on("error")``."""
        try:
            ctx = await self.prepare(event, record, None)
        except Exception as exc:
            await self.emit("error", {"error": exc, "stage": "prepare", "id": event.id})
            return
        await self.run_handlers(ctx)

    async def prepare(self, event: InboundEvent, record: InboxRecord | None, replayed_media: ReplayedMedia | None) -> Context:
        """Work before the handlers: log the message and load the chat's flow
        checkpoint. A failure here is retried (INB-5)."""
        ctx = Context(self, event, record, replayed_media)
        await self.store.append_message(
            {"direction": "in", "chat_id": event.chat_id, "content": {"text": event.text}, "message_id": event.id,
             "at": self.clock.now()}
        )
        if any(f.is_persistent for f in self._flows.values()):
            ctx._flow_checkpoint = await self.store.get("flow", event.chat_id)
        return ctx

    def _match(self, pattern: Pattern, event: InboundEvent) -> bool:
        if isinstance(pattern, str):
            return event.text.strip().lower() == pattern.strip().lower()
        if isinstance(pattern, re.Pattern):
            return pattern.search(event.text) is not None
        return bool(pattern(event))

    async def run_handlers(self, ctx: Context) -> None:
        """Route to a waiting flow, else the first matching handler, else the catch-all.
        A handler that raises is reported and not retried (INB-6)."""
        try:
            if await self._continue_flow(ctx):
                return
            target: Handler | Flow | None = None
            for pattern, handler in self._handlers:
                if self._match(pattern, ctx.event):
                    target = handler
                    break
            if target is None:
                target = self._fallback
            if target is None:
                return
            if isinstance(target, Flow):
                await self._advance_flow(target, ctx, None)
            else:
                await target(ctx)
        except Exception as exc:
            await self.emit("error", {"error": exc, "stage": "handler", "id": ctx.event.id, "chat_id": ctx.chat_id})

    async def _continue_flow(self, ctx: Context) -> bool:
        checkpoint = ctx._flow_checkpoint
        if checkpoint is None:
            checkpoint = self._memory_flows.get(ctx.chat_id)
        if checkpoint is None:
            return False
        flow = self._flows.get(str(checkpoint.get("flow")))
        if flow is None:
            return False
        if ctx.record_id is not None and checkpoint.get("fed_by") == ctx.record_id:
            return True  # a replay of the record that wrote this checkpoint: already applied
        if not checkpoint.get("waiting"):
            return False
        await self._advance_flow(flow, ctx, checkpoint)
        return True

    async def _advance_flow(self, flow: Flow, ctx: Context, checkpoint: dict[str, Any] | None) -> None:
        new = await flow.run(ctx, checkpoint)
        if flow.is_persistent:  # FLOW-1: checkpoint at every step
            if new is None:
                # a tombstone, not a delete: a replay of the record that ended the flow
                # must recognise it was applied (fed_by) rather than route it as new
                new = {"flow": flow.name, "waiting": False, "ended": True, "fed_by": ctx.record_id}
            await self.store.set("flow", ctx.chat_id, new)
        elif new is None:
            self._memory_flows.pop(ctx.chat_id, None)
        else:
            self._memory_flows[ctx.chat_id] = new

    # -- outbound -------------------------------------------------------------------------------
    async def _send(self, chat_id: str, content: Any, *, idempotency_key: str | None, ctx: Context | None) -> SendResult:
        if self.durability is not None:
            return await self.durability.send(chat_id, content, idempotency_key=idempotency_key, ctx=ctx)
        from . import content as contentlib

        prepared = await self.run_before_send(chat_id, contentlib.normalize(content))
        if prepared is None:
            return SendResult(None, None, state="cancelled")
        message_id = str(await self.provider.send(chat_id, prepared))
        await self.after_send(chat_id, prepared, message_id, None)
        return SendResult(message_id, None, [message_id])

    async def send(self, chat_id: str, content: Any, *, idempotency_key: str | None = None) -> SendResult:
        """Send outside a handler: key rule 1 (explicit) or 3 (random) (OUT-3)."""
        return await self._send(chat_id, content, idempotency_key=idempotency_key, ctx=None)

    async def enqueue(self, chat_id: str, content: Any, *, idempotency_key: str | None = None) -> dict[str, str]:
        """Journal a send and return ``{"key": ...}`` at once (OUT-10); a second enqueue
        of the same key does nothing. Without durability it sends right away."""
        if self.durability is None:
            result = await self.send(chat_id, content)
            return {"key": result.key or ""}
        return await self.durability.enqueue(chat_id, content, idempotency_key=idempotency_key)

    async def broadcast(
        self, chat_ids: Iterable[str], content: Any, *, idempotency_key: str | None = None
    ) -> dict[str, SendResult | BaseException]:
        """Send ``content`` to each chat, one after the other. With ``idempotency_key``
        each chat's send is keyed ``<key>:<chat_id>`` so a rerun sends nothing twice.
        Returns the result (or the error) per chat."""
        if self.durability is not None:
            self.durability.check_idempotency_key(idempotency_key)
        results: dict[str, SendResult | BaseException] = {}
        for chat_id in chat_ids:
            key = None if idempotency_key is None else f"{idempotency_key}:{chat_id}"
            try:
                results[chat_id] = await self.send(chat_id, content, idempotency_key=key)
            except Exception as exc:
                results[chat_id] = exc
        return results

    async def messages(self, chat_id: str | None = None) -> list[dict[str, Any]]:
        """The message log of the store."""
        return await self.store.messages(chat_id)


def _check_ids(**ids: str | None) -> None:
    """The ids a bot's scope is made of (SCOPE-1): ``bot_id`` and ``connection_id`` a
    non-empty string, ``tenant_id`` and ``environment_id`` a string or None; every one
    valid Unicode without U+0000, since the scope is part of every journal key (issue
    13). ``ConfigError`` naming the option otherwise."""
    for option, value in ids.items():
        required = option in ("bot_id", "connection_id")
        if value is None and not required:
            continue
        if not isinstance(value, str) or (required and not value):
            raise ConfigError(f"{option}: expected a non-empty string, got {value!r}", option=option, value=value)
        problem = text_problem(value)
        if problem is not None:
            raise ConfigError(f"{option} {problem}: {describe(value)}", option=option, value=value)


def _loggable(content: dict[str, Any]) -> dict[str, Any]:
    from . import content as contentlib

    try:
        return contentlib.encode(content)
    except contentlib.UnencodableContent:
        return {"unloggable": True}
