"""Scenarios: recovery stories written as short async functions, run by the pytest
plugin against every selected backend.

A scenario file is a Python module with functions decorated by :func:`scenario`. Each
function receives a :class:`Scenario` — a crash world (a channel, a virtual clock, a
store, successive bot incarnations on one backend) with a few verbs and expectations::

    from botmesh_testkit.scenario import scenario

    @scenario("GUAR-4", policies=["skip", "resend"])
    async def crash_after_recording_the_send(s):
        @s.on_message
        async def echo(ctx):
            await ctx.reply(f"echo {ctx.text}")

        await s.start(crash_after="outbox.mark_sent")   # "op" or "op#n"
        await s.receive("c1", "hi", id="m1")             # the bot dies inside
        s.expect_crashed()
        await s.restart()                                # same backend, store, instance_id
        await s.receive("c1", "hi", id="m1")             # the channel redelivers
        await s.drain()                                  # virtual time until all settled
        s.expect_delivered(["echo hi"])                  # exactly once

Run a folder of them with ``pytest --botmesh-scenarios=DIR`` (repeatable; ini key
``botmesh_scenarios``). Each scenario becomes one test item per backend
(``--botmesh-backend``, else the ini key ``botmesh_backend``, else ``sqlite``) and per
policy when ``policies`` is given (then ``s.policy`` is it, and it is the bot's
``outbox.on_ambiguous``). The scenarios shipped in ``botmesh_testkit/scenarios/`` — one
file per row of the GUAR table — run whenever ``--botmesh-backend`` is given.

With ``@scenario(..., crash="every")`` the runner chooses where the first incarnation
dies: a crash-free dry run of the scenario (at collection) records the crash points it
passes, and the scenario becomes one item per point, before and after each
(``name[sqlite-after:outbox.mark_sent:1]``); ``crash="random", count=N, seed=S`` draws N
of them. Such a scenario calls ``s.start()`` without crash arguments and
``await s.recover()`` where the story goes on (restart if it died, redeliver, drain).

A failing expectation raises :class:`ScenarioFailure`; the report names the scenario's
spec ids, the crash point and the crash points passed, what the channel delivered, the
events, and the command that reruns the item. ``requires=("survives_crash",)`` skips
the scenario on backends that do not claim a capability, naming it.

Scenario files are imported as plain modules (their folder is put on ``sys.path`` so
they may import helpers next to them); pytest's assertion rewriting does not apply, so
prefer the ``expect_*`` helpers, or give plain ``assert`` statements a message.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from dataclasses import dataclass
from typing import Any, TypeVar

from botmesh.core.bot import Bot, Handler, Pattern
from botmesh.core.config import DURABILITY_OPTIONS
from botmesh.core.flows import Flow
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.testing import SimulatedCrash

from ..backends.base import CAPABILITIES, BackendHarness
from ..backends.registry import resolve
from ..crash.points import POINTS
from ..crash.world import DRAIN_MS, World
from ..crash.wrapper import CrashableBackend
from ..matrix.cells import POLICIES, compress

_SetupT = TypeVar("_SetupT", bound=Callable[[Bot], object])
_HandlerT = TypeVar("_HandlerT", bound=Handler)

__all__ = ["CrashPoint", "DRAIN_MS", "Scenario", "ScenarioError", "ScenarioFailure", "ScenarioSpec", "scenario"]

_START_ARGS = ("crash_before", "crash_after", "crash_at")


def _closest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _same(filename: str, file: str) -> bool:
    return os.path.abspath(filename) == os.path.abspath(file)


def _caller(file: str) -> str:
    """``file:line`` of the innermost frame running the scenario file ``file``."""
    frame = sys._getframe(1)
    while frame is not None:
        if _same(frame.f_code.co_filename, file):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return file


def where_in_scenario(tb: TracebackType | None, file: str) -> str | None:
    """``file:line`` of the innermost frame of a traceback that runs the scenario file
    ``file``, or None when the error never passed through it."""
    found = None
    while tb is not None:
        if _same(tb.tb_frame.f_code.co_filename, file):
            found = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def innermost_is_own(tb: TracebackType | None, file: str) -> bool:
    """Whether the innermost frame of a traceback runs the scenario file ``file`` (the
    error is the scenario's own code's: a NameError, a wrong call)."""
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and _same(last.tb_frame.f_code.co_filename, file)


class ScenarioError(Exception):
    """A mistake in the scenario itself — an unknown crash point, keyword or requirement
    id, a crash armed and never reached, a story that checks the outcome without
    restarting the bot that died — never a violation by the backend. The message names
    the file and line and the fix; the plugin reports the item as a *scenario error* (not
    a broken requirement) without a traceback."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


@dataclass(frozen=True)
class ScenarioSpec:
    """What :func:`scenario` attaches to a function."""

    fn: Callable[[Scenario], Awaitable[None]]
    ids: tuple[str, ...]
    policies: tuple[str, ...] | None
    requires: tuple[str, ...]
    timeout: float
    crash: str | None = None
    count: int = 0
    seed: int | None = None

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()


def scenario(
    *spec_ids: str,
    policies: Sequence[str] | None = None,
    requires: Sequence[str] = (),
    timeout: float = 60.0,
    crash: str | None = None,
    count: int = 10,
    seed: int | None = None,
) -> Callable[[Callable[[Scenario], Awaitable[None]]], Callable[[Scenario], Awaitable[None]]]:
    """Mark ``async def f(s: Scenario)`` as a scenario checking ``spec_ids``.

    ``policies`` — run once per ``outbox.on_ambiguous`` policy (``"skip"``,
    ``"resend"``). ``requires`` — capabilities the backend must claim (else skipped).
    ``timeout`` — real seconds before the run is failed (a backend that hangs).
    ``crash`` — let the runner choose where the first incarnation dies: ``"every"``
    (one item per crash point a crash-free dry run of the scenario passes, before and
    after each) or ``"random"`` (``count`` items dying at the n-th point, drawn from
    ``seed``, else from ``--botmesh-seed``). The scenario then calls ``s.start()``
    without crash arguments and ``await s.recover()`` where the story goes on.
    """
    if not spec_ids or not all(isinstance(i, str) and "-" in i for i in spec_ids):
        raise ValueError(f"@scenario needs spec ids like 'GUAR-3', got {spec_ids!r}")
    bad = [p for p in policies or () if p not in POLICIES]
    if bad:
        raise ValueError(f"@scenario policies: {bad!r}; choose from {', '.join(map(repr, POLICIES))}")
    unknown = [c for c in requires if c not in CAPABILITIES]
    if unknown:
        raise ValueError(f"@scenario requires: unknown capability {unknown!r}; known: {', '.join(CAPABILITIES)}")
    if crash not in (None, "every", "random"):
        raise ValueError(f"@scenario crash={crash!r}: choose None, 'every' or 'random'")
    if crash == "random" and (not isinstance(count, int) or count < 1):
        raise ValueError(f"@scenario count={count!r}: a positive number of random crash points")

    def mark(fn: Callable[[Scenario], Awaitable[None]]) -> Callable[[Scenario], Awaitable[None]]:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError(f"@scenario: {fn.__qualname__} must be an 'async def' function")
        fn.__botmesh_scenario__ = ScenarioSpec(  # type: ignore[attr-defined]
            fn, tuple(spec_ids), tuple(policies) if policies else None, tuple(requires), float(timeout),
            crash, count, seed)
        return fn

    return mark


@dataclass(frozen=True)
class CrashPoint:
    """Where the runner kills a scenario's first incarnation: ``when`` ("before" /
    "after") the ``nth`` call of ``op`` — or, with ``op == "*"``, the ``nth`` crash point
    passed, whatever it is."""

    when: str
    op: str
    nth: int

    @property
    def label(self) -> str:
        # no '#': the label is part of the item's name, which `pytest -k` must accept
        return f"{self.when}:{self.op}:{self.nth}" if self.op != "*" else f"random-{self.when}:{self.nth}"

    def arm(self, cb: CrashableBackend) -> None:
        """Arm this death on the first incarnation's crashable backend."""
        cb.arm(self.when, self.op, self.nth)


def crash_points_of(spec: ScenarioSpec, passed: list[str], raised: set[tuple[str, int]], seed: int) -> list[CrashPoint]:
    """The items of a ``crash="every"|"random"`` scenario, from its dry run."""
    import random

    if spec.crash == "random":
        rng = random.Random(f"{spec.seed if spec.seed is not None else seed}/{spec.name}")
        drawn: list[CrashPoint] = []
        while passed and len(drawn) < min(spec.count, 2 * len(passed)):  # distinct: item names stay unique
            point = CrashPoint(rng.choice(("before", "after")), "*", rng.randint(1, len(passed)))
            if point not in drawn:
                drawn.append(point)
        return drawn
    seen: dict[str, int] = {}
    points: list[CrashPoint] = []
    for op in passed:
        seen[op] = seen.get(op, 0) + 1
        points.append(CrashPoint("before", op, seen[op]))
        if (op, seen[op]) not in raised:
            points.append(CrashPoint("after", op, seen[op]))
    return points


def dry_run(spec: ScenarioSpec, backend: str, policy: str | None) -> tuple[list[str], set[tuple[str, int]]]:
    """Run the scenario once without a crash, recording the crash points its first
    incarnation passes; raises what the scenario raised."""
    with tempfile.TemporaryDirectory(prefix="botmesh-scenario-dry-") as tmp:
        code = spec.fn.__code__
        s = Scenario(resolve(backend)(tmp), backend=backend, ids=spec.ids, policy=policy, record_points=True,
                     origin=f"{code.co_filename}:{code.co_firstlineno}")

        async def run() -> None:
            try:
                await asyncio.wait_for(spec.fn(s), spec.timeout)
            finally:
                s._remember_crash()
                await s.world.close()

        asyncio.run(run())
        return s.points_passed, s.points_raised


class ScenarioFailure(AssertionError):
    """An expectation of a scenario did not hold; the message starts with the spec ids
    it breaks (``ids``): those the expectation named with ``ids=``, else all the
    scenario's."""

    def __init__(self, message: str, ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.ids = tuple(ids)


def _point(text: str) -> tuple[str, int]:
    op, _, nth = text.partition("#")
    try:
        return op, int(nth) if nth else 1
    except ValueError:
        raise ValueError(f"crash point {text!r}: expected 'op' or 'op#n' (e.g. 'outbox.mark_sent#2')") from None


class Scenario:
    """The world a scenario runs in. See the module docstring for an example."""

    def __init__(self, harness: BackendHarness, *, backend: str, ids: Sequence[str], policy: str | None = None,
                 instance_id: str = "i1", seed: int = 0, point: CrashPoint | None = None,
                 record_points: bool = False, origin: str = "?") -> None:
        self.harness = harness
        self.origin = origin
        """``file:line`` of the scenario function (where its mistakes are reported)."""
        self.file = origin.rpartition(":")[0] or origin
        self.point = point
        """Where the runner makes the first incarnation die (``crash="every"|"random"``)."""
        self._record_points = record_points
        self.points_passed: list[str] = []
        self.points_raised: set[tuple[str, int]] = set()
        self._received: list[tuple[str, str, str, dict[str, Any]]] = []
        self.backend = backend
        self.ids = tuple(ids)
        self.policy = policy
        self._setups: list[Callable[[Bot], object]] = []
        durability: dict[str, Any] = {}
        if policy is not None:
            durability["outbox"] = {"on_ambiguous": policy}
        self.world = World(harness, setup=self._setup_bot, instance_id=instance_id, durability=durability, seed=seed)
        self.last_crash: str | None = None
        self.last_history: list[str] = []

    # -- what the bot does ---------------------------------------------------------------
    def _setup_bot(self, bot: Bot) -> None:
        for fn in self._setups:
            fn(bot)

    def setup(self, fn: _SetupT) -> _SetupT:
        """Decorator: ``fn(bot)`` registers handlers; it runs for every incarnation."""
        self._setups.append(fn)
        return fn

    def on_message(self, handler: _HandlerT) -> _HandlerT:
        """Decorator: the handler of every message no other pattern takes."""
        self._setups.append(lambda bot: bot.otherwise(handler))
        return handler

    def when(self, pattern: Pattern, handler: Handler | Flow) -> None:
        """``bot.when(pattern, handler)`` on every incarnation (a handler or a Flow)."""
        self._setups.append(lambda bot: bot.when(pattern, handler))

    def configure(self, **durability: Any) -> None:
        """Extra ``durability=`` options for every incarnation (``inbox={...}``...)."""
        self.world.options.update(durability)

    @staticmethod
    def die(reason: str = "the handler killed the process") -> SimulatedCrash:
        """``raise s.die()`` inside a handler: the process dies there."""
        return SimulatedCrash(reason)

    # -- verbs ---------------------------------------------------------------------------
    async def start(self, *, crash_before: str | None = None, crash_after: str | None = None,
                    crash_at: int | None = None, **durability: Any) -> Bot:
        """Start the next incarnation; arm at most one crash point (``"op"`` or
        ``"op#n"``, see ``botmesh-testkit points``; ``crash_at=n``: the n-th point)."""
        where = _caller(self.file)
        unknown = [k for k in durability if k not in DURABILITY_OPTIONS or k == "backend"]
        if unknown:
            known = (*_START_ARGS, *(o for o in DURABILITY_OPTIONS if o != "backend"))
            raise ScenarioError(where, f"start(): unknown keyword {unknown[0]!r}{_closest(unknown[0], known)}; "
                                f"start() takes {', '.join(known)}")
        armed = [x for x in (crash_before, crash_after, crash_at) if x is not None]
        if len(armed) > 1:
            raise ScenarioError(where, "start(): give at most one of crash_before, crash_after, crash_at")
        first = self.world.incarnations == 0
        auto = first and (self.point is not None or self._record_points)
        if armed and (self.point is not None or self._record_points):
            raise ScenarioError(where, "start(): this scenario's crash points are chosen by the runner "
                                "(@scenario(crash=...)); call s.start() without crash arguments")
        for text in (crash_before, crash_after):
            if text is not None:
                self._check_point(text, where)
        if crash_at is not None and (isinstance(crash_at, bool) or not isinstance(crash_at, int) or crash_at < 1):
            raise ScenarioError(where, f"start(crash_at={crash_at!r}): the n-th crash point passed, n >= 1")
        if self.world.bot is not None:
            await self.world.bot.abandon()
        bot = await self.world.start(crash=bool(armed) or auto, **durability)
        cb = self.world.crashable
        if auto and cb is not None:
            self._first = cb
            if self.point is not None:
                self.point.arm(cb)
        if cb is not None and not auto:
            if crash_before is not None:
                cb.crash_before(*_point(crash_before))
                self._armed = (f"crash_before={crash_before!r}", where)
            elif crash_after is not None:
                cb.crash_after(*_point(crash_after))
                self._armed = (f"crash_after={crash_after!r}", where)
            elif crash_at is not None:
                cb.crash_at(crash_at)
                self._armed = (f"crash_at={crash_at!r}", where)
        return bot

    @staticmethod
    def _check_point(text: str, where: str) -> None:
        op, _, nth = text.partition("#")
        if op not in POINTS:
            raise ScenarioError(where, f"unknown crash point {op!r}{_closest(op, POINTS)}; the points are listed by "
                                f"`botmesh-testkit points`: {', '.join(POINTS)}")
        if nth and (not nth.isdigit() or int(nth) < 1):
            raise ScenarioError(where, f"crash point {text!r}: expected 'op' or 'op#n' with n >= 1 "
                                "(e.g. 'outbox.mark_sent#2')")

    def mistake(self, failure: BaseException | None = None) -> ScenarioError | None:
        """The scenario's own mistake behind the end of its run (``failure`` is what it
        raised, None when it returned), if any: a crash it armed and never reached, or an
        outcome checked (or the story ended) while the bot that died was never restarted."""
        self._remember_crash()
        armed = getattr(self, "_armed", None)
        if armed is not None and not self.last_crash:
            label, where = armed
            passed = compress(self.world.crashable.history) if self.world.crashable is not None else "none"
            return ScenarioError(where, f"start({label}) armed a crash that was never reached, so the story does not "
                                 f"test what it says; the crash points it passed: {passed or 'none'}")
        if self.crashed:
            if failure is not None and not isinstance(failure, AssertionError):
                return None
            at = self.last_crash or "its crash point"
            fix = ("call `await s.recover()` where the story goes on" if self.point is not None
                   else "call `await s.recover()` (or `await s.restart()`) after the crash")
            if failure is None:
                return ScenarioError(self.origin, f"the story ends with the bot dead (it died at {at}) and never "
                                     f"restarts it, so nothing about the recovery was checked: {fix}")
            where = where_in_scenario(failure.__traceback__, self.file) or self.origin
            return ScenarioError(where, f"the outcome was checked while the bot was dead (it died at {at}) and had "
                                 f"not been restarted: {fix} before checking it (the failed check: {failure})")
        return None

    async def restart(self, **kwargs: Any) -> Bot:
        """The current bot dies (if it has not already); the next one starts on the same
        backend and store with the same ``instance_id``. Takes :meth:`start`'s
        arguments."""
        self._remember_crash()
        return await self.start(**kwargs)

    async def receive(self, chat_id: str, text: str = "", *, id: str, **kw: Any) -> bool:
        """The channel delivers an inbound message; False when the bot died taking it (or
        was already dead)."""
        self._received.append((chat_id, text, id, kw))
        if self.crashed:
            return False
        ok = await self.world.receive(chat_id, text, id=id, **kw)
        self._remember_crash()
        return ok

    async def recover(self, within_ms: float = DRAIN_MS) -> None:
        """What the outside world does after a death, then time: if the current bot
        died, start the next one and let the channel redeliver every message it had
        delivered, in order (webhooks redeliver until acknowledged; a duplicate is
        recognised, INB-4); then :meth:`drain`. Without a death it only drains."""
        if self.crashed:
            await self.restart()
            for chat_id, text, id, kw in list(self._received):
                await self.world.receive(chat_id, text, id=id, **kw)
        await self.drain(within_ms)

    async def drain(self, within_ms: float = DRAIN_MS) -> None:
        """Let virtual time run until every record is settled (or ``within_ms``)."""
        await self.world.drain(within_ms)
        self._remember_crash()

    async def advance(self, ms: float) -> None:
        """Let ``ms`` of virtual time pass."""
        await self.world.clock.advance(ms)

    def _remember_crash(self) -> None:
        cb = self.world.crashable
        if cb is not None and cb.crashed:
            self.last_crash = cb.crash_point
            self.last_history = list(cb.history)
        first = getattr(self, "_first", None)
        if first is not None:
            self.points_passed = list(first.history)
            self.points_raised = set(first.raised)

    # -- what happened -------------------------------------------------------------------
    @property
    def bot(self) -> Bot:
        assert self.world.bot is not None, "call await s.start() first"
        return self.world.bot

    @property
    def crashed(self) -> bool:
        """Whether the current incarnation died at its armed crash point."""
        return self.world.crashed

    @property
    def capabilities(self) -> Any:
        return self.harness.capabilities

    def delivered(self, chat_id: str | None = None) -> list[str]:
        """Texts the channel accepted, in order (of one chat when given)."""
        return self.world.channel.texts(chat_id)

    async def inbox(self, state: str | None = None) -> list[InboxRecord]:
        d = self.bot.durability
        assert d is not None
        return list(await d.inbox.list(state))

    async def outbox(self, state: str | None = None) -> list[OutboxRecord]:
        d = self.bot.durability
        assert d is not None
        return list(await d.outbox.list(state))

    def metrics(self) -> dict[str, int]:
        d = self.bot.durability
        assert d is not None
        return d.metrics()

    def events(self, name: str) -> list[dict[str, Any]]:
        """Payloads of ``error``, ``durability:dead`` or ``durability:ambiguous`` events of
        every incarnation."""
        return self.world.named(name)

    # -- expectations --------------------------------------------------------------------
    def fail(self, message: str, *, ids: Sequence[str] | None = None) -> ScenarioFailure:
        """The failure to raise: ``message`` prefixed by the ids it breaks — ``ids`` when
        given (the one requirement this expectation checks: only it is reported broken),
        else every id of the scenario."""
        broken = self.ids if ids is None else tuple(ids)
        if ids is not None:
            from ..requirements import suggest, unknown

            bad = unknown(broken) if broken else ["(none)"]
            outside = [i for i in broken if i not in self.ids]
            if outside and not bad:
                raise ScenarioError(_caller(self.file), f"ids={list(broken)!r}: {outside[0]!r} is not among this "
                                    f"scenario's ids ({', '.join(self.ids)}); add it to @scenario(...)")
            if bad:
                close = suggest(bad[0]) if broken else []
                raise ScenarioError(_caller(self.file), f"ids={list(broken)!r}: {bad[0]!r} is not a requirement id "
                                    "of the spec" + (f" (closest: {', '.join(close)})" if close else "")
                                    + "; `botmesh-testkit spec` lists them")
        return ScenarioFailure(f"[{', '.join(broken)}] {message}", broken)

    def expect(self, condition: object, message: str, *, ids: Sequence[str] | None = None) -> None:
        """Fail with ``message`` unless ``condition``; the failure breaks ``ids`` when
        given (e.g. ``ids=["OPS-1"]`` for a metric), else every id of the scenario."""
        if not condition:
            raise self.fail(message, ids=ids)

    def expect_crashed(self) -> None:
        self.expect(self.crashed or self.last_crash, "the armed crash point was never reached: the scenario "
                    "did not test what it says (check the point with `botmesh-testkit points`)")

    def expect_delivered(self, texts: Sequence[str], chat_id: str | None = None) -> None:
        """The channel received exactly ``texts``, in this order (each exactly once
        unless listed twice)."""
        got = self.delivered(chat_id)
        where = f" to {chat_id}" if chat_id else ""
        self.expect(got == list(texts), f"delivered{where} {got!r}, expected exactly {list(texts)!r}")

    async def expect_states(self, inbox: dict[str, str] | None = None, outbox: dict[str, str] | None = None) -> None:
        """The journals hold these records in these states (``{id_or_key: state}``)."""
        if inbox is not None:
            got = {r.id: r.state for r in await self.inbox() if r.id in inbox}
            self.expect(got == inbox, f"inbox states {got!r}, expected {inbox!r}")
        if outbox is not None:
            got = {r.key: r.state for r in await self.outbox() if r.key in outbox}
            self.expect(got == outbox, f"outbox states {got!r}, expected {outbox!r}")

    def story(self) -> list[str]:
        """What happened, for a failure report."""
        lines = [f"crash: {self.last_crash or 'none'}"]
        if self.last_history:
            lines.append(f"crash points passed before it: {compress(self.last_history)}")
        lines.append(f"delivered: {[(m.chat_id, m.content.get('text')) for m in self.world.channel.sent]}")
        if self.world.events:
            lines.append(f"events: {self.world.events}")
        lines.append(f"incarnations: {self.world.incarnations}")
        return lines
