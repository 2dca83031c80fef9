"""The crash matrix (TEST-4) and its history checker.

A **cell** is (backend, workload, ``on_ambiguous`` policy, crash point). Running it:
start a bot whose backend and provider can die, arm the crash, feed the workload's
messages and let time run until the crash fires; abandon the bot; start a new bot on the
same backend and store with the same ``instance_id``; let the channel redeliver every
message (webhooks redeliver until acknowledged) and drain in virtual time. The
**checker** then judges the history against the guarantees, using a crash-free run of
the same workload as the oracle:

* no admitted inbound lost: every message ends ``done`` (INB-2, INB-3, GUAR-1, GUAR-2);
* each send delivered exactly once, except in the ambiguity window of OUT-14 — with
  ``skip`` never more than once, with ``resend`` never less than once, and every
  difference accounted for by a ``durability:ambiguous`` event (GUAR-3, GUAR-4, OUT-2);
* nothing delivered that the oracle did not deliver (OUT-5), parts in order (OUT-12);
* no record left unsettled, nothing in a DLQ the oracle did not fill (OUT-7), and the
  metrics agree with the events (OPS-1, OPS-2).

The crash points of a cell come from a crash-free *dry run* of the workload on the same
backend: every (operation, occurrence) it passed, before and after; plus random cells
(``crash_at(n)``) drawn from a seed.
"""

from __future__ import annotations

import random
import shlex
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from botmesh.core.records import OutboxRecord
from botmesh.core.store import Store

from .backends import BackendHarness, resolve
from .workloads import WORKLOADS, Workload, transient
from .world import World

POLICIES = ("skip", "resend")
DRAIN_MS = 150_000.0
"""Virtual time a cell lets pass after each stage: well past the outbox's whole retry
budget with the default backoff (about 31 s) and the inbox backoff, so a correct backend
always settles; a broken one that never settles is judged after it."""


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix. ``point`` is an operation name with ``nth`` its
    occurrence, or ``"*"`` with ``nth`` the n-th crash point passed (a random cell)."""

    backend: str
    workload: str
    policy: str
    when: str
    point: str
    nth: int

    @property
    def id(self) -> str:
        return f"{self.backend}/{self.workload}/{self.policy}/{self.when}:{self.point}#{self.nth}"

    def command(self, seed: int) -> str:
        return f"botmesh-testkit run --backend {shlex.quote(self.backend)} --seed {seed} --cell {shlex.quote(self.id)}"

    @staticmethod
    def parse(text: str) -> Cell:
        try:
            backend, workload, policy, rest = text.split("/", 3)
            when, point_nth = rest.split(":", 1)
            point, nth = point_nth.rsplit("#", 1)
            cell = Cell(backend, workload, policy, when, point, int(nth))
        except ValueError:
            raise ValueError(f"--cell {text!r}: expected BACKEND/WORKLOAD/POLICY/WHEN:POINT#N") from None
        if workload not in WORKLOADS or policy not in POLICIES or when not in ("before", "after"):
            raise ValueError(f"--cell {text!r}: unknown workload, policy or moment")
        return cell


@dataclass
class Violation:
    ids: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"[{', '.join(self.ids)}] {self.message}"


@dataclass
class Outcome:
    cell: Cell
    crashed: bool
    crash_point: str | None
    violations: list[Violation] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    deliveries: list[tuple[str, str]] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)
    seconds: float = 0.0
    recovery_lines: frozenset[int] | None = None
    """With ``measure_recovery``: the lines of the engine's recovery code that ran from
    the restart to the end of the drain (:mod:`botmesh_testkit.recovery_coverage`); empty
    when the crash did not fire. None when not measured."""
    recovery_note: str | None = None
    """Why ``recovery_lines`` is empty although measured (another tracer was active)."""

    @property
    def passed(self) -> bool:
        return not self.violations

    def report(self, seed: int) -> str:
        lines = [f"cell {self.cell.id}: {'passed' if self.passed else 'FAILED'}"]
        for v in self.violations:
            lines.append(f"  violated {v}")
        lines.append(f"  crash: {self.crash_point or 'did not fire'}")
        lines.append(f"  crash points passed: {compress(self.history) or '(none)'}")
        lines.append(f"  delivered: {self.deliveries}")
        if self.ambiguous:
            lines.append(f"  ambiguous keys: {self.ambiguous}")
        lines.append(f"  reproduce: {self.cell.command(seed)}")
        return "\n".join(lines)


def compress(history: list[str]) -> str:
    """``a > b > b > b`` -> ``a > b x3``: a readable minimal history."""
    parts: list[str] = []
    i = 0
    while i < len(history):
        j = i
        while j + 1 < len(history) and history[j + 1] == history[i]:
            j += 1
        parts.append(history[i] + (f" x{j - i + 1}" if j > i else ""))
        i = j + 1
    return " > ".join(parts)


@dataclass
class Oracle:
    deliveries: list[tuple[str, str]]
    inbox_states: dict[str, str]
    outbox_dead: int
    history: list[str]
    raised: set[tuple[str, int]]


def _world(harness: BackendHarness, w: Workload, policy: str, seed: int) -> World:
    return World(
        harness,
        setup=w.setup,
        durability={"outbox": {"on_ambiguous": policy}},
        text_limit=w.text_limit,
        seed=seed,
    )


async def _feed(world: World, messages: Iterable[tuple[str, str, str]]) -> None:
    for chat_id, text, id in messages:
        if world.crashed:
            return
        await world.receive(chat_id, text, id=id)


async def _play(world: World, w: Workload) -> None:
    """Feed the workload, letting time run between stages; stops at a crash."""
    await _feed(world, w.inbound)
    if not world.crashed:
        await world.drain(DRAIN_MS)
    if w.answers and not world.crashed:
        await _feed(world, w.answers)
        if not world.crashed:
            await world.drain(DRAIN_MS)


async def oracle(backend: str, workload: str, seed: int, workdir: str) -> Oracle:
    """A crash-free run: what the workload delivers, and the crash points it passes."""
    w = WORKLOADS[workload]
    harness = resolve(backend)(workdir)
    world = _world(harness, w, "skip", seed)
    try:
        await world.start(crash=True)  # armed with nothing: records the points passed
        world.channel.fail_next(transient(), times=w.channel_failures)
        await _play(world, w)
        assert world.crashable is not None and world.bot is not None and world.bot.durability is not None
        d = world.bot.durability
        inbox = {r.id: r.state for r in await d.inbox.list()}
        dead = len(await d.outbox.list(state="dead"))
        return Oracle([(m.chat_id, str(m.content.get("text"))) for m in world.channel.sent], inbox, dead,
                      list(world.crashable.history), set(world.crashable.raised))
    finally:
        await world.close()


def cells_for(
    backend: str, workload: str, history: list[str], policies: Iterable[str] = POLICIES,
    raised: set[tuple[str, int]] | None = None,
) -> list[Cell]:
    """Every (point, occurrence) the dry run passed, before and after (after only when
    the call returned: a call that raised has no "after"), per policy."""
    raised = raised or set()
    seen: Counter[str] = Counter()
    points: list[tuple[str, int]] = []
    for op in history:
        seen[op] += 1
        points.append((op, seen[op]))
    return [
        Cell(backend, workload, policy, when, op, nth)
        for policy in policies
        for op, nth in points
        for when in ("before", "after")
        if when == "before" or (op, nth) not in raised
    ]


def random_cells(backend: str, workload: str, history: list[str], count: int, rng: random.Random) -> list[Cell]:
    """``count`` cells crashing at the n-th point passed, n and the moment drawn from
    ``rng``."""
    if not history:
        return []
    return [
        Cell(backend, workload, rng.choice(POLICIES), rng.choice(("before", "after")), "*", rng.randint(1, len(history)))
        for _ in range(count)
    ]


class _StoreDown:
    """A store that is down: every call raises (the "store is down" of INB-5)."""

    def __getattr__(self, name: str) -> Any:
        async def down(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError(f"the store is down ({name})")

        return down


async def _recover(world: World, w: Workload) -> None:
    """After a crash: a new bot, then the channel's redeliveries, drained. With
    ``store_down_at_restart`` the bot's store fails during the first sweep pass."""
    await world.restart()
    if w.store_down_at_restart:
        assert world.bot is not None  # the restarted bot is not crashable: it is there
        bot, store = world.bot, world.bot.store
        bot.store = cast(Store, _StoreDown())
        try:
            await world.clock.settle()  # the first pass runs: its replays fail before their handlers
        finally:
            bot.store = store
    # the channel redelivers everything that was not acknowledged, in order
    await _feed(world, w.inbound)
    await world.drain(DRAIN_MS)
    if w.answers:
        await _feed(world, w.answers)
        await world.drain(DRAIN_MS)


async def run_cell(cell: Cell, seed: int, truth: Oracle, workdir: str, *, measure_recovery: bool = False) -> Outcome:
    """Run one cell and check its history. ``measure_recovery``: record the lines of
    the engine's recovery code run from the restart to the end of the drain
    (``Outcome.recovery_lines``)."""
    w = WORKLOADS[cell.workload]
    started = time.perf_counter()
    harness = resolve(cell.backend)(workdir)
    world = _world(harness, w, cell.policy, seed)
    try:
        await world.start(crash=True)
        cb = world.crashable
        assert cb is not None
        if cell.point == "*":
            cb.crash_at(cell.nth, cell.when)
        elif cell.when == "before":
            cb.crash_before(cell.point, cell.nth)
        else:
            cb.crash_after(cell.point, cell.nth)
        world.channel.fail_next(transient(), times=w.channel_failures)
        await _play(world, w)
        crashed, crash_point, history = cb.crashed, cb.crash_point, list(cb.history)
        recovery_lines: frozenset[int] | None = None
        recovery_note: str | None = None
        if crashed and measure_recovery:
            from .recovery_coverage import measure

            with measure() as measured:
                await _recover(world, w)
            recovery_lines, recovery_note = measured.lines, measured.note
        elif crashed:
            await _recover(world, w)
        elif measure_recovery:
            recovery_lines = frozenset()
        outcome = Outcome(cell, crashed, crash_point, history=history,
                          deliveries=[(m.chat_id, str(m.content.get("text"))) for m in world.channel.sent],
                          recovery_lines=recovery_lines, recovery_note=recovery_note)
        await check(world, truth, outcome)
        outcome.seconds = time.perf_counter() - started
        return outcome
    finally:
        await world.close()


def _order_streams(outbox: dict[str, OutboxRecord]) -> dict[tuple[str, str], str]:
    """``(chat, text) -> stream`` for the sends of an enqueued record and its parts:
    ``"enqueued <first part's key>"`` (the parts linked by ``previous_part``). Texts not
    listed are inline sends (one stream per chat)."""
    streams: dict[tuple[str, str], str] = {}
    for rec in outbox.values():
        if rec.origin != "enqueue":
            continue
        root, seen = rec, {rec.key}
        while root.previous_part is not None and root.previous_part in outbox and root.previous_part not in seen:
            root = outbox[root.previous_part]
            seen.add(root.key)
        streams[(rec.chat_id, str(rec.content.get("text")))] = f"enqueued {root.key!r}"
    return streams


def order_violations(
    want: list[tuple[str, str]], got: list[tuple[str, str]], streams: dict[tuple[str, str], str]
) -> list[Violation]:
    """First deliveries keep the oracle's order within each ordered stream of a chat: its
    inline sends (a handler's replies in the order made, parts included), and each
    enqueued send's parts (``streams``, from :func:`_order_streams`). An enqueued send is
    delivered by the sweep whenever it runs, so it has no order with respect to the
    inline replies (OUT-10): on a backend with real I/O the sweep may run while a handler
    journals its reply."""
    found: list[Violation] = []
    for chat in sorted({c for c, _ in want}):
        for stream in sorted({streams.get((chat, t), "inline") for c, t in want if c == chat}):
            want_order = [t for c, t in want if c == chat and streams.get((c, t), "inline") == stream]
            firsts: list[str] = []
            for c, t in got:
                if c == chat and t not in firsts and streams.get((c, t), "inline") == stream:
                    firsts.append(t)
            if [t for t in firsts if t in want_order] != [t for t in want_order if t in firsts]:
                where = "" if stream == "inline" else f" (the parts of {stream})"
                found.append(Violation(("OUT-12", "OUT-11"),
                                       f"chat {chat!r} got {firsts}{where}, expected the order {want_order}"))
    return found


async def check(world: World, truth: Oracle, outcome: Outcome) -> None:
    """The history checker: append every broken guarantee to ``outcome.violations``."""
    assert world.bot is not None and world.bot.durability is not None
    d = world.bot.durability
    policy = outcome.cell.policy
    v = outcome.violations
    inbox = {r.id: r for r in await d.inbox.list()}
    outbox = {r.key: r for r in await d.outbox.list()}

    # inbound: nothing admitted is lost, everything settles as in the oracle
    for id, state in truth.inbox_states.items():
        rec = inbox.get(id)
        if rec is None:
            v.append(Violation(("GUAR-1", "INB-1"), f"inbound {id!r} has no record after its redelivery"))
        elif rec.state != state:
            ids = ("INB-3", "INB-7") if rec.state == "dead" else ("INB-2", "INB-3")
            v.append(Violation(ids, f"inbound {id!r} ended {rec.state!r}, expected {state!r}"))

    # sends: exactly once, except what an ambiguity event accounts for
    ambiguous_events = world.named("durability:ambiguous")
    ambiguous_texts: Counter[tuple[str, str]] = Counter()
    for event in {e["key"]: e for e in ambiguous_events}.values():
        outcome.ambiguous.append(event["key"])
        rec = outbox.get(event["key"])
        if rec is None:
            v.append(Violation(("OUT-14",), f"ambiguous key {event['key']!r} has no outbox record"))
            continue
        ambiguous_texts[(rec.chat_id, str(rec.content.get("text")))] += 1
    expected = Counter(truth.deliveries)
    delivered = Counter(outcome.deliveries)
    for item in sorted(set(expected) | set(delivered)):
        want, got, amb = expected[item], delivered[item], ambiguous_texts[item]
        if want == 0:
            v.append(Violation(("OUT-5", "OUT-2"), f"{item} delivered {got}x, the crash-free run never sent it"))
        elif policy == "skip" and got > want:
            v.append(Violation(("OUT-2", "OUT-14", "GUAR-4"), f"{item} delivered {got}x (duplicate under on_ambiguous=skip)"))
        elif policy == "skip" and got < want - amb:
            v.append(Violation(("GUAR-2", "OUT-1"), f"{item} delivered {got}x, expected {want} ({amb} ambiguous)"))
        elif policy == "resend" and got < want:
            v.append(Violation(("OUT-14", "GUAR-2"), f"{item} delivered {got}x, expected {want} "
                                                   "(lost under on_ambiguous=resend)"))
        elif policy == "resend" and got > want + amb:
            v.append(Violation(("OUT-2", "GUAR-4"), f"{item} delivered {got}x, only {amb} ambiguous "
                                                  "send(s) account for duplicates"))

    # order of parts and sends per chat (OUT-11, OUT-12)
    v.extend(order_violations(truth.deliveries, outcome.deliveries, _order_streams(outbox)))

    # every record settled; DLQ and metrics consistent
    unsettled = [k for k, r in outbox.items() if r.state not in ("sent", "unknown", "dead")]
    if unsettled:
        v.append(Violation(("OUT-7", "OUT-9"), f"outbox records never settled: {unsettled}"))
    dead = [k for k, r in outbox.items() if r.state == "dead"]
    if len(dead) > truth.outbox_dead:
        v.append(Violation(("OUT-7", "OUT-8"), f"outbox records in the DLQ that a crash-free run does not have: {dead}"))
    unknown = [k for k, r in outbox.items() if r.state == "unknown"]
    if policy == "resend" and unknown:
        v.append(Violation(("OUT-14",), f"records marked unknown under on_ambiguous=resend: {unknown}"))
    if policy == "skip" and len(unknown) > len(ambiguous_events):
        v.append(Violation(("OUT-14", "OPS-1"), f"unknown records {unknown} without a durability:ambiguous event"))
    # the metrics are the final incarnation's: compare with its own events (a dead
    # incarnation may have emitted an event for a key the next one resolves again)
    metrics = d.metrics()
    own = world.named("durability:ambiguous", incarnation=world.incarnations)
    if metrics["outbox_ambiguous"] != len(own):
        v.append(Violation(("OPS-2", "OUT-14"),
                           f"metrics outbox_ambiguous={metrics['outbox_ambiguous']} but {len(own)} ambiguous events"))
    own_dead = world.named("durability:dead", incarnation=world.incarnations)
    if metrics["inbound_dead"] + metrics["outbox_dead"] != len(own_dead):
        v.append(Violation(("OPS-2", "OPS-1"), f"dead counters {metrics['inbound_dead']}+{metrics['outbox_dead']} "
                           f"but {len(own_dead)} durability:dead events"))


@dataclass
class MatrixResult:
    seed: int
    outcomes: list[Outcome]
    seconds: float

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.passed]


async def run_matrix(
    backends: list[str],
    workloads: list[str],
    *,
    policies: Iterable[str] = POLICIES,
    random_per_workload: int = 0,
    seed: int = 0,
    only: Cell | None = None,
    progress: Callable[[Outcome], None] | None = None,
    measure_recovery: bool = False,
) -> MatrixResult:
    """Run the matrix. ``only`` runs one cell (the reproduce command);
    ``measure_recovery`` is passed to :func:`run_cell`."""
    started = time.perf_counter()
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    policies = list(policies)
    for backend in backends:
        for workload in workloads:
            if only is not None and (only.backend != backend or only.workload != workload):
                continue
            with tempfile.TemporaryDirectory(prefix="botmesh-oracle-") as tmp:
                truth = await oracle(backend, workload, seed, tmp)
            cells = cells_for(backend, workload, truth.history, policies, truth.raised)
            cells += random_cells(backend, workload, truth.history, random_per_workload, rng)
            if only is not None:
                cells = [only]
            for cell in cells:
                with tempfile.TemporaryDirectory(prefix="botmesh-cell-") as tmp:
                    outcome = await run_cell(cell, seed, truth, tmp, measure_recovery=measure_recovery)
                outcomes.append(outcome)
                if progress is not None:
                    progress(outcome)
    return MatrixResult(seed, outcomes, time.perf_counter() - started)

