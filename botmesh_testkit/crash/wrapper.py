"""Crash injection (TEST-1, TEST-2, TEST-3).

``crashable(backend)`` wraps any :class:`~botmesh.core.backend.DurabilityBackend`.
Every write operation of the interface is a named crash point (``"inbox.journal"``,
``"outbox.mark_sent"`` ... the catalogue in :mod:`botmesh_testkit.crash.points`), and
so is the provider's send when a
:class:`~botmesh_testkit.crash.provider.CrashableProvider` is built on the wrapper
(``"provider.send"``). At a crash the wrapper raises
:class:`~botmesh.core.testing.SimulatedCrash` and from then on refuses every call, so
nothing more reaches the backend — like a dead process. The recovery pattern (TEST-3):
abandon the crashed bot, start a new bot on the *inner* backend (or a reopened one) and
the same store with the same ``instance_id``, and check the outcome.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.testing import SimulatedCrash

from .intercept import InterceptedBackend
from .points import check_point


@dataclass(frozen=True)
class _Rule:
    when: str  # "before" | "after"
    op: str | None  # None: any point
    nth: int  # 1-based occurrence (of op, or of any point when op is None)


class CrashableBackend(InterceptedBackend):
    """A backend that dies on command. ``crashed`` tells whether it did;
    ``crash_point`` says where (``"before outbox.mark_sent #1"``); ``history`` lists the
    points entered, in order; ``raised`` holds the ``(point, occurrence)`` whose call
    raised (their "after" side was never reached)."""

    def __init__(self, inner: DurabilityBackend, *, serial: asyncio.Lock | None = None) -> None:
        super().__init__(inner, name=f"crashable({inner.name})", serial=serial)
        self.crashed = False
        self.crash_point: str | None = None
        self.history: list[str] = []
        self.raised: set[tuple[str, int]] = set()
        self._rules: list[_Rule] = []
        self._counts: Counter[str] = Counter()
        self._total = 0
        self.at_point: Callable[[str, str, int, int], None] | None = None
        """Called at every point passed, after the armed rules did not fire, with
        ``(when, op, nth, total)``: the crash matrix's shared prefix
        (:mod:`botmesh_testkit.matrix.shared`) forks the process there. It may raise (a
        forked copy dies there with :meth:`die`)."""

    # -- arming -------------------------------------------------------------------------
    def crash_before(self, op: str, nth: int = 1) -> CrashableBackend:
        """Die when the ``nth`` call of ``op`` is about to run (it does not happen)."""
        check_point(op)
        self._rules.append(_Rule("before", op, nth))
        return self

    def crash_after(self, op: str, nth: int = 1) -> CrashableBackend:
        """Die right after the ``nth`` call of ``op`` took effect (its caller never
        learns)."""
        check_point(op)
        self._rules.append(_Rule("after", op, nth))
        return self

    def crash_at(self, n: int, when: str = "before") -> CrashableBackend:
        """Die at the ``n``-th crash point passed, whatever it is (1-based)."""
        if n < 1 or when not in ("before", "after"):
            raise ValueError("crash_at(n): n >= 1 and when in ('before', 'after')")
        self._rules.append(_Rule(when, None, n))
        return self

    def arm(self, when: str, point: str, nth: int) -> CrashableBackend:
        """Die ``when`` (``"before"``/``"after"``) the ``nth`` call of ``point`` — or, with
        ``point == "*"``, at the ``nth`` crash point passed, whatever it is."""
        if point == "*":
            return self.crash_at(nth, when)
        if when == "before":
            return self.crash_before(point, nth)
        return self.crash_after(point, nth)

    # -- the mechanism --------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise :class:`SimulatedCrash` when the process is dead."""
        if self.crashed:
            raise SimulatedCrash(f"the process is dead (crashed {self.crash_point})")

    def die(self, when: str, op: str, nth: int) -> None:
        """Die now, at ``when`` ``op`` #``nth``, as an armed rule would (raises)."""
        self._die(when, op, nth)

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
        self.check_alive()
        self._counts[op] += 1
        self._total += 1
        nth, total = self._counts[op], self._total
        if self._fires("before", op, nth, total):
            self._die("before", op, nth)
        if self.at_point is not None:
            self.at_point("before", op, nth, total)
        self.history.append(op)
        return nth, total

    def failed(self, op: str, nth: int) -> None:
        """The call at point ``op`` raised: its "after" side is never reached."""
        self.raised.add((op, nth))

    def leave(self, op: str, nth: int, total: int) -> None:
        """Pass the "after" side of point ``op``."""
        if self._fires("after", op, nth, total):
            self._die("after", op, nth)
        if self.at_point is not None:
            self.at_point("after", op, nth, total)

    # -- the hooks of InterceptedBackend --------------------------------------------------
    def before_write(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.enter(op)

    def write_failed(self, op: str, token: Any, exc: Exception) -> None:
        self.failed(op, token[0])

    def after_write(self, op: str, token: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        self.leave(op, *token)

    def before_read(self) -> None:
        self.check_alive()


def crashable(backend: DurabilityBackend, *, serial: asyncio.Lock | None = None) -> CrashableBackend:
    """Wrap ``backend`` so that it can die at any of its write operations (TEST-1).
    ``serial``: run its calls one at a time under that lock (see :mod:`.intercept`)."""
    if not isinstance(backend, DurabilityBackend):
        raise TypeError(f"crashable() needs a DurabilityBackend, got {type(backend).__name__}")
    return CrashableBackend(backend, serial=serial)  # type: ignore[abstract]  # operations installed by setattr
