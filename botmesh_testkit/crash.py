"""Crash injection (TEST-1, TEST-2, TEST-3).

``crashable(backend)`` wraps any :class:`~botmesh.core.backend.DurabilityBackend`.
Every write operation of the interface is a named crash point (``"inbox.journal"``,
``"outbox.mark_sent"`` ... :data:`botmesh.core.backend.WRITE_OPS`), and so is the
provider's send when a :class:`CrashableProvider` is built on the wrapper
(``"provider.send"``). At a crash the wrapper raises
:class:`~botmesh.core.testing.SimulatedCrash` and from then on refuses every call, so
nothing more reaches the backend — like a dead process. The recovery pattern (TEST-3):
abandon the crashed bot, start a new bot on the *inner* backend (or a reopened one) and
the same store with the same ``instance_id``, and check the outcome.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from botmesh.core.backend import READ_OPS, WRITE_OPS, DurabilityBackend
from botmesh.core.provider import Content, Provider
from botmesh.core.testing import SimulatedCrash

PROVIDER_SEND = "provider.send"


def crash_points() -> list[str]:
    """Every named crash point: the backend's write operations, then the provider's
    send."""
    return [*WRITE_OPS, PROVIDER_SEND]


@dataclass(frozen=True)
class _Rule:
    when: str  # "before" | "after"
    op: str | None  # None: any point
    nth: int  # 1-based occurrence (of op, or of any point when op is None)


class CrashableBackend(DurabilityBackend):
    """A backend that dies on command. ``crashed`` tells whether it did;
    ``crash_point`` says where (``"before outbox.mark_sent #1"``); ``history`` lists the
    points entered, in order; ``raised`` holds the ``(point, occurrence)`` whose call
    raised (their "after" side was never reached)."""

    def __init__(self, inner: DurabilityBackend) -> None:
        self.inner = inner
        self.name = f"crashable({inner.name})"
        self.capabilities = inner.capabilities
        self.crashed = False
        self.crash_point: str | None = None
        self.history: list[str] = []
        self.raised: set[tuple[str, int]] = set()
        self._rules: list[_Rule] = []
        self._counts: Counter[str] = Counter()
        self._total = 0

    # -- arming -------------------------------------------------------------------------
    def _validate(self, op: str) -> None:
        if op not in WRITE_OPS and op != PROVIDER_SEND:
            raise ValueError(f"unknown crash point {op!r}; known: {', '.join(crash_points())}")

    def crash_before(self, op: str, nth: int = 1) -> CrashableBackend:
        """Die when the ``nth`` call of ``op`` is about to run (it does not happen)."""
        self._validate(op)
        self._rules.append(_Rule("before", op, nth))
        return self

    def crash_after(self, op: str, nth: int = 1) -> CrashableBackend:
        """Die right after the ``nth`` call of ``op`` took effect (its caller never
        learns)."""
        self._validate(op)
        self._rules.append(_Rule("after", op, nth))
        return self

    def crash_at(self, n: int, when: str = "before") -> CrashableBackend:
        """Die at the ``n``-th crash point passed, whatever it is (1-based)."""
        if n < 1 or when not in ("before", "after"):
            raise ValueError("crash_at(n): n >= 1 and when in ('before', 'after')")
        self._rules.append(_Rule(when, None, n))
        return self

    # -- the mechanism --------------------------------------------------------------------
    def _check(self) -> None:
        if self.crashed:
            raise SimulatedCrash(f"the process is dead (crashed {self.crash_point})")

    def _die(self, when: str, op: str, nth: int) -> None:
        self.crashed = True
        self.crash_point = f"{when} {op} #{nth}"
        raise SimulatedCrash(f"simulated crash {self.crash_point}")

    def _fires(self, when: str, op: str, nth: int, total: int) -> bool:
        for rule in self._rules:
            if rule.when != when:
                continue
            if rule.op is None and rule.nth == total:
                return True
            if rule.op == op and rule.nth == nth:
                return True
        return False

    def enter(self, op: str) -> tuple[int, int]:
        """Pass the "before" side of point ``op``; returns its counters."""
        self._check()
        self._counts[op] += 1
        self._total += 1
        nth, total = self._counts[op], self._total
        if self._fires("before", op, nth, total):
            self._die("before", op, nth)
        self.history.append(op)
        return nth, total

    def failed(self, op: str, nth: int) -> None:
        """The call at point ``op`` raised: its "after" side is never reached."""
        self.raised.add((op, nth))

    def leave(self, op: str, nth: int, total: int) -> None:
        """Pass the "after" side of point ``op``."""
        if self._fires("after", op, nth, total):
            self._die("after", op, nth)

    async def start(self) -> None:
        self._check()
        await self.inner.start()

    async def stop(self) -> None:
        self._check()
        await self.inner.stop()


def _write(op: str, method: str) -> Any:
    async def call(self: CrashableBackend, *args: Any, **kwargs: Any) -> Any:
        nth, total = self.enter(op)
        try:
            result = await getattr(self.inner, method)(*args, **kwargs)
        except Exception:
            self.failed(op, nth)
            raise
        self.leave(op, nth, total)
        return result

    call.__name__ = method
    call.__doc__ = f"Crash point {op!r} around ``inner.{method}``."
    return call


def _read(method: str) -> Any:
    async def call(self: CrashableBackend, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return await getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = method
    return call


for _op, _method in WRITE_OPS.items():
    setattr(CrashableBackend, _method, _write(_op, _method))
for _method in READ_OPS.values():
    setattr(CrashableBackend, _method, _read(_method))
CrashableBackend.__abstractmethods__ = frozenset()


def crashable(backend: DurabilityBackend) -> CrashableBackend:
    """Wrap ``backend`` so that it can die at any of its write operations (TEST-1)."""
    if not isinstance(backend, DurabilityBackend):
        raise TypeError(f"crashable() needs a DurabilityBackend, got {type(backend).__name__}")
    # the operations are installed by setattr above (and __abstractmethods__ cleared),
    # which mypy cannot see
    return CrashableBackend(backend)  # type: ignore[abstract]


class ChannelProvider(Provider):
    """A provider that passes everything to ``channel`` (a ``MockProvider`` by default),
    which stands for the outside world shared by successive bot incarnations: what it
    recorded was delivered, whatever happens to the bot later."""

    def __init__(self, channel: Provider | None = None) -> None:
        super().__init__()
        from botmesh.core.testing import MockProvider

        self.channel = channel if channel is not None else MockProvider()
        self.name = self.channel.name
        self.text_limit = self.channel.text_limit
        self.serialize_media_ref = self.channel.serialize_media_ref
        self.rehydrate_media_ref = self.channel.rehydrate_media_ref

    async def send(self, chat_id: str, content: Content) -> str:
        return await self.channel.send(chat_id, content)

    async def typing(self, chat_id: str) -> None:
        await self.channel.typing(chat_id)

    async def download_media(self, ref: Any) -> bytes:
        return await self.channel.download_media(ref)


class CrashableProvider(ChannelProvider):
    """A provider that dies with its :class:`CrashableBackend` (TEST-2).

    Its own crash point is ``"provider.send"``: *before* means the call never reached the
    channel; *after* means the channel accepted the message and the process died before
    the answer came back.
    """

    def __init__(self, crashable: CrashableBackend, channel: Provider | None = None) -> None:
        super().__init__(channel)
        self.crashable = crashable

    async def send(self, chat_id: str, content: Content) -> str:
        nth, total = self.crashable.enter(PROVIDER_SEND)
        try:
            message_id = await self.channel.send(chat_id, content)
        except Exception:
            self.crashable.failed(PROVIDER_SEND, nth)
            raise
        self.crashable.leave(PROVIDER_SEND, nth, total)
        return message_id

    async def typing(self, chat_id: str) -> None:
        self.crashable._check()
        await super().typing(chat_id)

    async def download_media(self, ref: Any) -> bytes:
        self.crashable._check()
        return await super().download_media(ref)
