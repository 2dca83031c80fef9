"""Test doubles shipped with botmesh: :class:`MockProvider`, a provider that records
every call and can be told to fail, and :class:`SimulatedCrash`, the exception a
simulated process death raises. The crash-injection machinery itself (``crashable``,
``CrashableProvider``) lives in ``botmesh_testkit``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .provider import Content, InboundEvent, MediaUnavailableError, Provider, ProviderError


class SimulatedCrash(BaseException):
    """Raised where a simulated process dies. It derives from ``BaseException`` so that
    no ``except Exception`` of the bot or of a handler swallows it: like a real death,
    it stops everything on its way up."""


@dataclass
class SentMessage:
    chat_id: str
    content: Content
    message_id: str


@dataclass
class Call:
    """One call of ``send``: what was asked, and what came of it."""

    chat_id: str
    content: Content
    message_id: str | None = None
    error: BaseException | None = None


_MEDIA_HOSTS = ("media.mock.test",)


class MockProvider(Provider):
    """A provider for tests.

    * ``sent`` — every message the channel accepted, in order; ``calls`` — every call,
      failed ones included.
    * ``fail_next(error, times=1)`` — the next ``times`` sends raise ``error``;
      ``fail_when(predicate, error)`` — sends whose ``(chat_id, content)`` match raise.
    * ``receive(chat_id, text, id=...)`` — deliver an inbound event to the bot and wait
      until it was processed.
    * media: references are ``{"url": "https://media.mock.test/..."}``; they serialize
      as ``{"v": 1, "data": {"url": ...}}`` and rehydrate only for hosts in
      ``media_hosts`` (MEDIA-4); ``media_bytes`` maps a URL to its content.
    """

    name = "mock"

    def __init__(self, *, text_limit: int | None = None, name: str = "mock") -> None:
        super().__init__()
        self.name = name
        self.text_limit = text_limit
        self.sent: list[SentMessage] = []
        self.calls: list[Call] = []
        self.typing_calls: list[str] = []
        self._failures: list[BaseException] = []
        self._rules: list[tuple[Callable[[str, Content], bool], BaseException]] = []
        self._ids = itertools.count(1)
        self._events = itertools.count(1)
        self.media_hosts: tuple[str, ...] = _MEDIA_HOSTS
        self.media_bytes: dict[str, bytes] = {}
        self.refused: list[str] = []
        """Ids of the events :meth:`receive` delivered that the bot did not take
        (:meth:`Provider.deliver` returned False: the journal write failed, INB-8) — a
        real webhook would have answered with an error status."""

    def copy(self) -> MockProvider:
        """An independent copy of this channel as it is now: what it accepted, its calls,
        the failures still pending, the media it serves; it numbers its next message and
        event where this one would. Attached to no bot. For tests that branch one history
        into several (``botmesh_testkit``'s crash matrix recovers each crash state a power
        cut could leave from the same moment)."""
        clone = MockProvider(text_limit=self.text_limit, name=self.name)
        clone.sent = list(self.sent)
        clone.calls = list(self.calls)
        clone.typing_calls = list(self.typing_calls)
        clone._failures = list(self._failures)
        clone._rules = list(self._rules)
        clone.media_hosts = self.media_hosts
        clone.media_bytes = dict(self.media_bytes)
        clone.refused = list(self.refused)
        # Read each counter's next value once and restart both sides there.
        next_id, next_event = next(self._ids), next(self._events)
        self._ids, clone._ids = itertools.count(next_id), itertools.count(next_id)
        self._events, clone._events = itertools.count(next_event), itertools.count(next_event)
        return clone

    def fail_next(self, error: BaseException, times: int = 1) -> None:
        self._failures.extend([error] * times)

    def fail_when(self, predicate: Callable[[str, Content], bool], error: BaseException) -> None:
        self._rules.append((predicate, error))

    def clear_failures(self) -> None:
        self._failures.clear()
        self._rules.clear()

    async def send(self, chat_id: str, content: Content) -> str:
        call = Call(chat_id, content)
        self.calls.append(call)
        error: BaseException | None = None
        if self._failures:
            error = self._failures.pop(0)
        else:
            for predicate, rule_error in self._rules:
                if predicate(chat_id, content):
                    error = rule_error
                    break
        if error is not None:
            call.error = error
            raise error
        message_id = f"{self.name}-{next(self._ids)}"
        call.message_id = message_id
        self.sent.append(SentMessage(chat_id, content, message_id))
        return message_id

    async def typing(self, chat_id: str) -> None:
        self.typing_calls.append(chat_id)

    def texts(self, chat_id: str | None = None) -> list[str]:
        """Texts of the accepted messages, optionally for one chat."""
        return [str(m.content.get("text")) for m in self.sent if chat_id is None or m.chat_id == chat_id]

    def event(self, chat_id: str, text: str = "", *, id: str | None = None, kind: str = "message",
              media: Any = None, user_id: str | None = None) -> InboundEvent:
        return InboundEvent(id=id or f"evt-{next(self._events)}", chat_id=chat_id, text=text, kind=kind,
                            media=media, user_id=user_id)

    async def receive(self, chat_id: str, text: str = "", *, id: str | None = None, kind: str = "message",
                      media: Any = None, user_id: str | None = None) -> InboundEvent:
        event = self.event(chat_id, text, id=id, kind=kind, media=media, user_id=user_id)
        if not await self.deliver(event):
            self.refused.append(event.id)
        return event

    # -- media (MEDIA-1, MEDIA-2, MEDIA-4) ------------------------------------------------
    def _serialize(self, ref: Any) -> dict[str, Any] | None:
        if isinstance(ref, dict) and ref.get("view_once"):
            return None
        if isinstance(ref, dict) and isinstance(ref.get("url"), str):
            return {"v": 1, "data": {"url": ref["url"]}}  # never a credential (MEDIA-4)
        return None

    def _rehydrate(self, stored: dict[str, Any], ref: Any) -> Any:
        if stored.get("v") != 1:
            raise ProviderError(f"unknown media reference version {stored.get('v')!r}", retryable=False)
        data = stored.get("data")
        if not isinstance(data, dict):
            raise ProviderError(f"media reference data must be an object, got {data!r:.80}", retryable=False)
        url = data.get("url")
        if not isinstance(url, str) or not url.startswith("https://"):
            raise ProviderError("media reference without an https url", retryable=False)
        host = url[len("https://"):].split("/", 1)[0]
        if host not in self.media_hosts:
            raise ProviderError(f"media host {host!r} is not allowed", retryable=False)
        return {"url": url}

    serialize_media_ref = _serialize
    rehydrate_media_ref = _rehydrate

    async def download_media(self, ref: Any) -> bytes:
        url = ref.get("url") if isinstance(ref, dict) else None
        if url not in self.media_bytes:
            raise MediaUnavailableError("rehydrate-failed", f"no media at {url!r}")
        return self.media_bytes[url]
