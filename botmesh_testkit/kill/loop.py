"""The kill loop: one bot killed with ``SIGKILL`` and restarted with the same
``instance_id`` again and again at seeded moments, then drained and judged
(:class:`KillLoop`)."""

from __future__ import annotations

import asyncio
import os
import random
import shlex
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from functools import cached_property
from typing import Any

from ..backends.base import FileSpec, KillSpec, PostgresSpec, RedisSpec, SQLiteSpec, callable_name
from ..checker.judge import KillOracle, charged_deaths, judge, unfinished_charged
from ..checker.violation import Violation
from ..matrix.cells import POLICIES
from ..matrix.profiles import KILL_MESSAGES
from .childproc import replies
from .parent import Incarnation, Run, durability_options
from .result import KillInfo, KillResult
from .spec import BackendSpec, HarnessError, as_kill_spec

KILLS = 10
"""Kills of a kill loop unless told otherwise (:class:`KillLoop`, the command line)."""


def callable_repr(fn: Any) -> str:
    """A handler or factory for a reproduce line: ``module:qualname``, or the repr of
    :class:`replies` and None."""
    if fn is None or isinstance(fn, replies):
        return repr(fn)
    return callable_name(fn)


def spec_repr(spec: KillSpec) -> str:
    """The spec for a reproduce line, in its tuple form: callables by name, server URLs
    without their password."""
    from ..servers import redact_url

    def one(x: Any) -> str:
        if callable(x):
            return callable_repr(x)
        if isinstance(x, str) and "://" in x:
            return repr(redact_url(x))
        return repr(x)

    items = spec.as_tuple()
    return "(" + ", ".join(one(x) for x in items) + ("," if len(items) == 1 else "") + ")"


def _messages(spec: int | Iterable[Any], chats: int) -> list[tuple[str, str, str]]:
    if isinstance(spec, int):
        return [(f"m{i}", f"c{i % chats}", f"msg {i}") for i in range(1, spec + 1)]
    out: list[tuple[str, str, str]] = []
    for i, item in enumerate(spec, 1):
        if isinstance(item, str):
            out.append((f"m{i}", f"c{(i - 1) % chats}", item))
        else:
            id, chat, text = item
            out.append((str(id), str(chat), str(text)))
    return out


class KillLoop:
    """Kill one bot ``kills`` times with SIGKILL at seeded moments, restart it with the
    same ``instance_id`` each time, let the last incarnation drain, judge.

    ``backend_spec``: a :class:`~botmesh_testkit.backends.base.KillSpec`, or its tuple
    form (see :mod:`botmesh_testkit.kill.spec`; converted, and a bad one refused with
    :class:`HarnessError`, when the loop runs). ``handler``: ``async def handler(ctx)``
    run for every message (default :class:`replies` ``(2)``); or ``setup(bot)`` to
    register handlers yourself. ``messages``: a count (``m1``.. on ``chats`` chats) or a
    list of texts or ``(id, chat, text)``. Messages are released over the kill cycles;
    every cycle's child first gets every message not yet acknowledged (redelivery).

    Each kill is drawn from ``seed``: with probability ``marker_share`` the child
    freezes at a random marker (before/after a journal write, a provider send, a
    handler) and is killed there; otherwise it is killed after a random delay (anywhere:
    inside a write, a handler, the startup). ``on_ambiguous`` is the outbox policy under
    test. ``text_limit``: the channel's text limit — longer texts are split into parts
    (OUT-12, OUT-13), so kills land between the parts' journal writes, splits and sends;
    the reproduce command carries it (``--text-limit``). ``oracle``: run the same
    messages once without kills on SQLite first and
    compare deliveries with it (as the crash matrix does). ``drain_timeout``: seconds the
    last child gets to settle everything; past it the result fails, naming what is left.
    """

    def __init__(
        self,
        backend_spec: BackendSpec,
        handler: Callable[[Any], Awaitable[Any]] | None = None,
        *,
        messages: int | Iterable[Any] = KILL_MESSAGES,
        kills: int = KILLS,
        seed: int = 0,
        on_ambiguous: str = "skip",
        workdir: str | None = None,
        setup: Callable[[Any], None] | None = None,
        chats: int = 3,
        max_attempts: int = 5,
        retries: int = 5,
        lease_ms: float = 2000.0,
        poll_ms: float = 50.0,
        durability: dict[str, Any] | None = None,
        instance_id: str = "kill-1",
        concurrency: int = 1,
        fail_rate: float = 0.0,
        text_limit: int | None = None,
        oracle: bool | KillOracle = True,
        marker_share: float = 0.65,
        start_method: str = "forkserver",
        drain_timeout: float = 30.0,
        cycle_timeout: float = 20.0,
        max_self_deaths: int | None = None,
        progress: Callable[[str], None] | None = None,
        after_kill: Callable[[int], str | None] | None = None,
        label: str = "kill loop",
    ) -> None:
        if on_ambiguous not in POLICIES:
            raise ValueError(f"on_ambiguous must be one of {POLICIES}, got {on_ambiguous!r}")
        if text_limit is not None and (not isinstance(text_limit, int) or isinstance(text_limit, bool) or text_limit < 1):
            raise ValueError(f"text_limit must be a whole number of characters >= 1 (or None: no limit), "
                             f"got {text_limit!r}")
        if handler is None and setup is None:
            handler = replies(2)
        self.backend_spec = backend_spec
        self.handler = handler
        self.setup = setup
        self.messages = _messages(messages, chats)
        self.kills = kills
        self.seed = seed
        self.policy = on_ambiguous
        self.workdir: str | None = workdir
        """Where the journal (for specs under it), ledgers and child logs go; kept after
        the run for post-mortems. None: a fresh temporary directory at :meth:`run`."""
        self.max_attempts = max_attempts
        self.retries = retries
        self.options = durability_options(on_ambiguous, lease_ms, poll_ms, max_attempts, retries, durability)
        self.instance_id = instance_id
        self.concurrency = concurrency
        self.fail_rate = fail_rate
        self.text_limit = text_limit
        self.oracle = oracle
        self.marker_share = marker_share
        self.start_method = start_method
        self.drain_timeout = drain_timeout
        self.cycle_timeout = cycle_timeout
        self.max_self_deaths = max_self_deaths if max_self_deaths is not None else 2 * max_attempts * len(self.messages) + 10
        self.progress = progress
        self.after_kill = after_kill
        """Called with the kill's number (1-based) once the killed child is gone and
        before the next one starts — the power-cut loop cuts the power there; what it
        returns is added to the kill's point in the report."""
        self.label = label
        self.runs: list[Run] = []
        self._kw = dict(messages=messages if isinstance(messages, int) else len(self.messages), kills=kills, seed=seed,
                        on_ambiguous=on_ambiguous, chats=chats, max_attempts=max_attempts, lease_ms=lease_ms,
                        poll_ms=poll_ms, concurrency=concurrency, fail_rate=fail_rate, marker_share=marker_share)
        if text_limit is not None:  # only when set: the call form of a loop without one stays as it was
            self._kw["text_limit"] = text_limit

    # -- public --------------------------------------------------------------------------
    @cached_property
    def spec(self) -> KillSpec:
        """The backend spec as a :class:`~botmesh_testkit.backends.base.KillSpec`."""
        return as_kill_spec(self.backend_spec)

    def run(self) -> KillResult:
        """Run the loop (blocking) and return the judged result; never raises for a
        broken guarantee (see :meth:`KillResult.assert_ok`), raises
        :class:`HarnessError` when the harness itself cannot run."""
        started = time.monotonic()
        spec = self.spec  # a bad spec is refused before any child starts
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="botmesh-kill-")
        try:
            oracle = self._oracle()
            return self._main(spec, oracle, started)
        finally:
            self.cleanup()

    async def arun(self) -> KillResult:
        """:meth:`run` in a thread, for async tests."""
        return await asyncio.to_thread(self.run)

    def cleanup(self) -> list[int]:
        """Kill whatever child is left (they all are gone after :meth:`run`)."""
        pids: list[int] = []
        for r in self.runs:
            pids += r.cleanup()
        return pids

    def stray_pids(self) -> list[int]:
        """Pids of this loop's children that still exist (should be none after a run)."""
        return [p for r in self.runs for p in r.stray_pids()]

    def reproduce(self) -> str:
        """One command that runs this loop again: the kill command line for the built-in
        handler on a built-in backend, else the ``KillLoop(...)`` call (after the pytest
        node, inside a test)."""
        node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        kw = ", ".join(f"{k}={v!r}" for k, v in self._kw.items())
        spec = self.spec
        call = f"KillLoop({spec_repr(spec)}, {callable_repr(self.handler)}, {kw})"
        if isinstance(self.handler, replies) and self.setup is None and isinstance(
                spec, (FileSpec, SQLiteSpec, PostgresSpec, RedisSpec)):
            backend = spec.name
            server = ""
            if isinstance(spec, (PostgresSpec, RedisSpec)):
                from ..servers import redact_url

                server = f" --{spec.kind}-url {shlex.quote(redact_url(spec.url))}"
            cli = (f"python -m botmesh_testkit.kill --backend {backend}{server} --messages {self._kw['messages']} "
                   f"--kills {self.kills} --seed {self.seed} --policy {self.policy} --replies {self.handler.n}"
                   + (f" --text-limit {self.text_limit}" if self.text_limit is not None else ""))
            return cli + (f"  (or pytest {shlex.quote(node)})" if node else "")
        return (f"pytest {shlex.quote(node)}  # " if node else "") + call

    # -- internals ---------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def _new_run(self, spec: KillSpec, sub: str) -> Run:
        assert self.workdir is not None
        workdir = os.path.join(self.workdir, sub)
        os.makedirs(workdir, exist_ok=True)
        if isinstance(spec, (FileSpec, SQLiteSpec)) and os.path.dirname(spec.path):
            os.makedirs(os.path.dirname(spec.path), exist_ok=True)
        run = Run(spec, self.handler, setup=self.setup, durability=self.options, workdir=workdir,
                  start_method=self.start_method, concurrency=self.concurrency, fail_rate=self.fail_rate,
                  seed=self.seed, text_limit=self.text_limit)
        self.runs.append(run)
        return run

    def _oracle(self) -> KillOracle | None:
        if isinstance(self.oracle, KillOracle):
            return self.oracle
        if not self.oracle:
            return None
        assert self.workdir is not None  # run() sets it before asking for the oracle
        run = self._new_run(SQLiteSpec(os.path.join(self.workdir, "oracle", "oracle.db")), "oracle")
        run.add_messages(self.messages)
        t0 = time.monotonic()
        inc, problem = self._settle(run, None, deadline=time.monotonic() + self.drain_timeout)
        if problem:
            raise HarnessError(f"the run without kills (oracle) did not settle: {problem}")
        first = run.incarnations[0]
        elapsed = time.monotonic() - (first.ready_at if first.ready_at is not None else t0)
        assert inc is not None
        run.stop(inc)
        inbox, _ = run.journal()
        counted = sum(1 for i in run.incarnations for m in i.markers if m.seq is not None)
        n = max(1, len(self.messages))
        ledger = run.ledger()
        by_inbound: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
        for d in ledger:
            if d.key is not None and ":" in d.key:
                by_inbound[d.key.rpartition(":")[0]][(d.chat, d.text)] += 1
        return KillOracle(
            deliveries=Counter((d.chat, d.text) for d in ledger),
            by_inbound=dict(by_inbound),
            inbox_states={r.id: r.state for r in inbox},
            markers_per_message=counted / n,
            ms_per_message=1000.0 * elapsed / n,
            self_deaths=sum(1 for i in run.incarnations if i.end == "died"),
        )

    def _start(self, run: Run, stop_at: int | None) -> Incarnation:
        return run.spawn("bot", self.instance_id, stop_at)

    def last_attempts(self, run: Run, inc: Incarnation, earlier: dict[str, int] | None = None) -> list[str]:
        """The inbound ids that a kill of ``inc`` now (by the markers the parent has read)
        would charge their last allowed execution: ``inbox.max_attempts`` - 1 earlier
        incarnations died with an execution of it unfinished, and ``inc`` has one in
        flight. Counted as the judge counts (an upper bound, see
        :func:`~botmesh_testkit.checker.judge.charged_deaths`).

        The loop never kills there. By INB-7 the engine would rightly put such a
        message in the DLQ after the kill, but a message does not *keep killing the
        process* because the harness's random kills happened to land on its recovery
        max_attempts times (a busy machine makes the early life of every incarnation,
        where the last victim is re-executed, last longer: kills at small delays and
        marker numbers all land there); the loop would then test INB-7 instead of the
        recovery it is there for, and the sends that message never made are excused.
        Messages that kill the process themselves still reach the DLQ: their own
        deaths count, the harness only never adds the last one."""
        if earlier is None:  # ``earlier``: charged_deaths of the other incarnations, when known
            earlier = charged_deaths(i for i in run.incarnations if i is not inc)
        return sorted(id for id in unfinished_charged(inc.markers) if earlier.get(id, 0) + 1 >= self.max_attempts)

    def _drained(self, run: Run, inc: Incarnation) -> None:
        """Read everything a stopped (SIGSTOP or frozen) child wrote before it stopped."""
        before = -1
        while before != len(inc.markers) and inc.alive:
            before = len(inc.markers)
            run.pump(0.0)

    def _crashed(self, inc: Incarnation) -> None:
        if inc.end == "died" and inc.exitcode is not None and inc.exitcode > 0:
            raise HarnessError(f"child {inc.name}#{inc.n} (pid {inc.pid}) crashed with exit code {inc.exitcode}; "
                               f"its log:\n{inc.log_tail()}")

    def _settle(self, run: Run, inc: Incarnation | None, deadline: float) -> tuple[Incarnation | None, str | None]:
        """Keep one child alive (restarting it after a death of its own), feed it every
        unacknowledged message, until it reports everything settled. Returns the live
        child, or a description of what is left when ``deadline`` passed."""
        deaths = 0
        fed = inc is not None
        last_status: Any = None
        next_status = 0.0
        while True:
            if inc is None or not inc.alive:
                if inc is not None:
                    self._crashed(inc)
                    deaths += 1
                    if deaths > self.max_self_deaths:
                        return inc, f"the child died {deaths} times by itself while draining"
                inc = self._start(run, None)
                fed = False
            if not fed and (inc.ready_at is not None):
                run.feed(inc, run.unacked())
                fed = True
            if time.monotonic() > deadline:
                left = run.unacked()
                return inc, (f"did not settle in time: unacknowledged {left[:10]}{'...' if len(left) > 10 else ''}; "
                             f"last status {last_status}")
            run.pump(0.02)
            if not inc.alive or not fed:
                continue
            if run.nacked:
                run.refeed_nacked(inc)
            if not run.unacked() and time.monotonic() >= next_status:
                next_status = time.monotonic() + 0.05
                last_status = run.request(inc, "status")
                if last_status is not None and last_status.get("settled") and not run.unacked():
                    return inc, None

    def _plan(self, rng: random.Random, oracle: KillOracle | None, pending: int, startup_ms: float,
              ms_per_marker: float | None = None) -> tuple[str, float]:
        """Where the next incarnation dies: at a random counted marker, or after a random
        delay from its start. The delay's range is the startup plus the expected work of
        the pending messages; the work's pace is the oracle's, or the pace this run's
        children actually kept (``ms_per_marker``, the median over the incarnations so
        far) when that is slower. Without the second, a machine that got busier after the
        oracle ran puts every delay inside the first message's recovery, so one message is
        killed on each of its executions and goes to the DLQ after ``inbox.max_attempts``
        (INB-7, correct by the spec, but not what the loop means to test)."""
        per_msg_markers = oracle.markers_per_message if oracle else 12.0
        per_msg_ms = oracle.ms_per_message if oracle else 15.0
        if ms_per_marker is not None:
            per_msg_ms = max(per_msg_ms, ms_per_marker * per_msg_markers)
        if rng.random() < self.marker_share:
            top = max(2, int(per_msg_markers * max(1, pending) * 0.9))
            return "marker", float(rng.randint(1, top))
        return "delay", rng.uniform(0.0, startup_ms + per_msg_ms * max(1, pending) * 1.2)

    def _main(self, spec: KillSpec, oracle: KillOracle | None, started: float) -> KillResult:
        run = self._new_run(spec, "run")
        rng = random.Random(self.seed)
        kills: list[KillInfo] = []
        self_deaths = 0
        released = 0
        startup: list[float] = []
        pace: list[float] = []
        """ms per counted marker of each killed incarnation (the pace the children keep)."""
        notes: list[str] = []
        previous_kill: float | None = None
        previous_info: KillInfo | None = None
        inc: Incarnation | None  # each cycle starts one; the last settle may end without one
        kill_phase_start = time.monotonic()
        while len(kills) < self.kills:
            # messages are spread over the cycles, so that every cycle has fresh work
            upto = round((len(kills) + 1) * len(self.messages) / self.kills)
            batch = self.messages[released:upto]
            released = max(released, upto)
            run.add_messages(batch)
            pending = len(run.unacked())
            mode, amount = self._plan(rng, oracle, pending, statistics.median(startup) if startup else 50.0,
                                      statistics.median(pace) if pace else None)
            stop_at = int(amount) if mode == "marker" else None
            inc = self._start(run, stop_at)
            planned = f"marker #{stop_at}" if mode == "marker" else f"{amount:.0f} ms after start"
            deadline = inc.started + self.cycle_timeout
            fed = False
            earlier = charged_deaths(i for i in run.incarnations if i is not inc)
            moved: list[str] = []
            """Where this cycle's kill would have charged a message its last allowed
            execution (see :meth:`last_attempts`): it moved on from there."""
            while inc.alive and time.monotonic() < deadline:
                run.pump(0.005)
                if inc.ready_at is not None and not fed:
                    startup.append(1000.0 * (inc.ready_at - inc.started))
                    run.feed(inc, run.unacked())
                    fed = True
                if fed and run.nacked:
                    run.refeed_nacked(inc)
                if mode == "marker" and inc.frozen:
                    self._drained(run, inc)
                    spare = self.last_attempts(run, inc, earlier)
                    if not spare:
                        break
                    # not here: the kill moves on to the next counted marker
                    frozen_at = inc.last_marker()
                    inc.stop_at = max((m.seq for m in inc.markers if m.seq is not None), default=0) + 1
                    inc.frozen = False
                    moved.append(f"{frozen_at} ({', '.join(spare)})")
                    run.send(inc, ("go", inc.stop_at))
                    continue
                if mode == "delay" and time.monotonic() >= inc.started + amount / 1000.0:
                    if self.last_attempts(run, inc, earlier):
                        continue  # wait for the next marker and look again
                    run.freeze(inc)  # SIGSTOP: what it wrote before is all there is
                    self._drained(run, inc)
                    spare = self.last_attempts(run, inc, earlier)
                    if not spare:
                        break
                    moved.append(f"{inc.last_marker() or 'startup'} ({', '.join(spare)})")
                    run.thaw(inc)
                if mode == "marker" and fed and not run.unacked():
                    last_t = inc.markers[-1].t if inc.markers else inc.ready_at or inc.started
                    if (time.monotonic() - last_t > max(0.15, 3 * self.options["poll_ms"] / 1000.0)
                            and not self.last_attempts(run, inc, earlier)):
                        mode = "idle"
                        break
            if previous_info is not None and previous_kill is not None:
                if inc.ready_at is not None:
                    previous_info.kill_to_ready_ms = 1000.0 * (inc.ready_at - previous_kill)
                if inc.swept_at is not None:
                    previous_info.kill_to_recovered_ms = 1000.0 * (inc.swept_at - previous_kill)
                previous_info = None
            if not inc.alive:
                self._crashed(inc)
                self_deaths += 1
                if self_deaths > self.max_self_deaths:
                    raise HarnessError(f"the child died {self_deaths} times by itself; last log:\n{inc.log_tail()}")
                self._say(f"incarnation {inc.n} died by itself (exit {inc.exitcode})")
                continue
            if time.monotonic() >= deadline and mode == "marker" and not inc.frozen:
                mode = "idle"
                notes.append(f"incarnation {inc.n}: planned {planned} not reached in {self.cycle_timeout:.0f} s")
            last = inc.last_marker()
            if mode == "marker":
                point = str(last)
            elif mode == "idle":
                point = f"idle (planned {planned}; last marker {last})"
            else:
                point = (f"after {1000.0 * (time.monotonic() - inc.started):.0f} ms"
                         + (f", last marker {last}" if last else ", before any marker"))
            if moved:
                notes.append(f"incarnation {inc.n}: kill moved on from {'; '.join(moved[:3])}"
                             + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
                             + f": a kill there would have charged the message its last of "
                             f"{self.max_attempts} executions (INB-7)")
            run.kill(inc, point)
            counted = [m.t for m in inc.markers if m.seq is not None]
            if len(counted) >= 2:
                pace.append(1000.0 * (counted[-1] - counted[0]) / (len(counted) - 1))
            landed = point if mode != "delay" else (str(last) if last else "startup")
            if self.after_kill is not None:
                extra = self.after_kill(len(kills) + 1)
                if extra:
                    landed = f"{landed}; {extra}"
            info = KillInfo(inc.n, mode, landed, planned)
            kills.append(info)
            previous_kill, previous_info = inc.killed_at, info
            self._say(f"kill {len(kills)}/{self.kills}: incarnation {inc.n} {mode} at {point}")
        kill_phase = time.monotonic() - kill_phase_start
        run.add_messages(self.messages[released:])
        return self._conclude(run, spec, oracle, kills, notes, started, kill_phase, previous_kill, previous_info)

    def _conclude(self, run: Run, spec: KillSpec, oracle: KillOracle | None, kills: list[KillInfo], notes: list[str],
                  started: float, kill_phase: float, previous_kill: float | None,
                  previous_info: KillInfo | None) -> KillResult:
        """Let a last incarnation drain every message of ``run``, then judge the run."""
        inc, problem = self._settle(run, None, deadline=time.monotonic() + self.drain_timeout)
        if previous_info is not None and previous_kill is not None and inc is not None and run.incarnations:
            first = next((i for i in run.incarnations if i.started >= previous_kill), None)
            if first is not None and first.ready_at is not None:
                previous_info.kill_to_ready_ms = 1000.0 * (first.ready_at - previous_kill)
            if first is not None and first.swept_at is not None:
                previous_info.kill_to_recovered_ms = 1000.0 * (first.swept_at - previous_kill)
        violations: list[Violation] = []
        if problem:
            violations.append(Violation(("INB-3", "OUT-7"), f"the last incarnation {problem}"))
            run.cleanup()
        elif inc is not None and not run.stop(inc):
            notes.append(f"incarnation {inc.n} did not stop cleanly")
        inbox, outbox = run.journal()
        ledger = run.ledger()
        found, acc = judge(
            policy=self.policy, max_attempts=self.max_attempts, messages=run.messages, acked=run.acked,
            inbox=inbox, outbox=outbox, ledger=ledger, events=run.events, incarnations=run.incarnations,
            oracle=oracle, fail_rate=self.fail_rate, text_limit=self.text_limit,
        )
        violations += found
        stray = run.stray_pids()
        if stray:
            violations.append(Violation(("TEST-4",), f"child processes still alive after the run: {stray}"))
        return KillResult(
            backend=spec.name, policy=self.policy, seed=self.seed, params=dict(self._kw), kills=kills,
            self_deaths=sum(1 for i in run.incarnations if i.end == "died"), incarnations=len(run.incarnations),
            messages=len(run.messages), acked=len(run.acked), feeds=run.feeds, deliveries=len(ledger),
            distinct_keys=len({d.key for d in ledger}), inbox_states=dict(Counter(r.state for r in inbox)),
            outbox_states=dict(Counter(r.state for r in outbox)), violations=violations, accounting=acc,
            seconds=time.monotonic() - started, kill_phase_seconds=kill_phase, reproduce=self.reproduce(),
            events=dict(Counter(e.name for e in run.events)), notes=notes, run=run, label=self.label,
        )
