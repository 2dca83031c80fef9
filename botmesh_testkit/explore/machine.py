"""Explore: Hypothesis's stateful testing drives an :class:`~.story.Explorer` through
generated stories on one backend, and a failing story, shrunk, is written out as a
scenario file that fails the same way.

A story is a sequence of steps, each a verb of the Explorer: a message received (its media
drawn — none, valid, expired, failing to download, a pre-feature token, tampered with at
rest — and its plan drawn: replies under derived keys or adversarial explicit ones — ``"a"`` beside
``"a#2"``, a user's key that looks like a derived one, unicode, 448 characters — texts
split by the channel, unjournaled content, concurrent enqueues of one key, a handler that
raises, a handler that takes five minutes on a replay), a record a dead process left
pending (its plan drawn the same way; sometimes unreadable for five minutes), a
redelivery, a channel fault (transient, rate limited, a chat that refuses for good), a
death armed at the n-th crash point from now, a restart (with another ``instance_id`` or
the same), virtual time passing, and — in one story in :data:`VOLUME_ODDS`, once — a
burst of :data:`VOLUME_BURSTS` messages to a second bot whose retention is a minute
(OPS-3). On a backend that claims ``multi_process`` also a second live bot (a replica
booted now or during a handler's execution, on the default ``instance_id`` or its own,
taking messages, killed: :mod:`.replicas`; the story's bot then runs on the default
``instance_id`` or ``i1``) and, rarely (:data:`BURST_ODDS`, at most :data:`BURSTS` a
story), a burst of real processes contending on the storage (:mod:`.processes`). The
model is checked after every
step and at the end (:meth:`~.story.Explorer.finish`). Each example runs in a fresh
temporary directory, with its own event loop; each step has a real-time budget
(:data:`STEP_SECONDS`: a step that hangs is a failure).

Budget and reproduction: :func:`explore` runs at most ``examples`` examples and stops
starting new ones once ``seconds`` have passed (checked between chunks of
:data:`CHUNK` examples, the first chunk always runs; each chunk seeded ``seed + i``, so a run not cut by
time is the same run again under the same seed — in any process: Hypothesis's draw of a
literal found in the code it runs beside is kept out (:func:`_seed_only_draws`). With a
``database`` directory
(the plugin's: ``.pytest_cache/d/botmesh-explore/<backend>``) a failure found once is
replayed first by the next run, as Hypothesis does. Shrinking a failure is
Hypothesis's: it may take longer than the budget (each replay of a hanging step costs
:data:`STEP_SECONDS`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .story import Action, Explorer, ExploreViolation, enqueue, fail, reply, reply_nan, slow

__all__ = ["ExploreFailure", "ExploreRun", "explore", "render_story"]

STEP_SECONDS = 60.0
"""Real seconds one step may take (the world runs on a virtual clock: only a backend
that hangs comes near it)."""
CHUNK = 10
SHRINK_SECONDS = 60.0
"""Real seconds a failure is shrunk for at most (then the smallest story so far is the one
reported)."""
STEPS = 25
"""Steps per example at most (Hypothesis's ``stateful_step_count``)."""
CHATS = ("c1", "c2", "c3")
KEYS = ("a", "a#2", "order", "order#2", "m1:1", "m2:1", "clé-ключ", "k" * 448)
"""Explicit keys a plan draws from: two that differ only by a suffix a part key could
take (``#2``), a user's key equal to a derived one (``m1:1``), unicode, the longest id
(448 characters)."""
TEXT_LIMITS = (None, 16, 24)
REPLICA_IDS = (None, None, "replica")
"""The replica's ``instance_id``: mostly the default (LEASE-3), else an explicit one of its
own (booted again after a death, it is the same instance: LEASE-4)."""
REPLICA_DURING = (0, 1, 1, 2)
"""When the replica boots: now, or at the start of the 1st or 2nd handler execution from now."""
REPLICA_MEDIA = (None, None, None, "valid", "expired", "broken")
BURSTS = 1
"""Bursts of real processes a story runs at most (each costs process starts: about a
second for 4 processes)."""
BURST_ODDS = 6
"""A draw of the burst rule runs one once in this many (the others are no step at all):
about a quarter of the stories have a burst, which keeps the smoke budget."""
MEDIA = (None, None, None, None, "valid", "expired", "broken", "legacy", "tampered")
"""A message's media (:meth:`~.story.Explorer.receive`): mostly none."""
ADVANCES = (100.0, 1_000.0, 20_000.0, 60_000.0, 600_000.0)
"""Virtual time a step lets pass, ms (the sweep runs every ``poll_ms``, 1 s: ten minutes
are 600 sweeps; longer waits are the end's :meth:`~.story.Explorer.finish`)."""
SLOW_MS = (300_000,)
"""How long a ``slow`` action takes (virtual ms): a few seconds, or five minutes — well
over the bound the model gives a due retry (:data:`~.sweeping.RETRY_BOUND_MS`), so a
sweep that waits for a replayed handler shows."""
VOLUME_BURSTS = ((600, 20),)
"""(messages, per second) of a :meth:`~.story.Explorer.burst`: 600 messages at 20 a
second, over what a purge of 500 records per journal and minute deletes (OPS-3). Costly
on a backend whose deletes are slow (about 10 s on the file backend, 3 s on SQLite),
hence drawn only in one story in :data:`VOLUME_ODDS`, once."""
VOLUME_ODDS = 12
UNREADABLE_MS = (0, 0, 300_000)
"""How long the record of a :meth:`~.story.Explorer.left_pending` message cannot be read."""
IDS = ("GUAR-1", "GUAR-3", "GUAR-7", "INB-1", "INB-2", "INB-3", "INB-6", "INB-7", "INB-8", "MEDIA-2", "MEDIA-3",
       "MEDIA-5", "OPS-3", "OUT-2", "OUT-3", "OUT-5",
       "OUT-7", "OUT-9", "OUT-10", "OUT-11", "OUT-12", "OUT-14", "OUT-15", "RETRY-1", "LEASE-1", "LEASE-2", "LEASE-3",
       "REPL-1", "REPL-3", "REPL-4", "BACK-7", "INB-4")
"""The requirement ids the explorer's model checks (its item's ``spec`` marker)."""

STORY_IMPORTS = ("from botmesh_testkit.explore.story import Explorer, enqueue, fail, reply, reply_nan, slow\n"
                 "from botmesh_testkit.scenario import scenario\n")


@dataclass
class ExploreFailure:
    """A story that broke the model: the shrunk one of its kind of failure (the last one
    Hypothesis replayed for it)."""

    ids: tuple[str, ...]
    message: str
    lines: list[str]
    """The story's verbs as scenario lines (``await x.receive(...)``), the failing one last."""
    policy: str
    text_limit: int | None
    default_id: bool = False
    """The story's bot ran on the default ``instance_id`` (``Explorer(s, default_id=True)``)."""


@dataclass
class ExploreRun:
    """What :func:`explore` did: examples and steps run, and the failure if any."""

    backend: str
    seed: int
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    cut_by_time: bool = False
    failure: ExploreFailure | None = None
    story_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    others: list[ExploreFailure] = field(default_factory=list)
    """The other kinds of failure the run met (other sets of broken ids), each with its
    own shrunk story, in the order found (``failure`` is the first)."""

    @property
    def passed(self) -> bool:
        return self.failure is None

    def summary(self) -> str:
        head = (f"explore on {self.backend}, seed {self.seed}: {self.examples} stories, {self.steps} steps "
                f"in {self.seconds:.1f} s")
        if self.cut_by_time:
            head += " (stopped by the time budget)"
        return head + (": passed" if self.passed else ": FAILED")


class _Recorder:
    """What the examples of one :func:`explore` call share: counts, the failing story of each kind."""

    def __init__(self) -> None:
        self.examples = 0
        self.steps = 0
        self.failure: ExploreFailure | None = None
        """What to report when no story failed in a step (the run itself raised)."""
        self.found_after: int | None = None
        """Examples run when the first failure was seen (before shrinking)."""
        self.kinds: dict[tuple[str, ...], ExploreFailure] = {}
        """The last failing story of each kind of failure (its ids; an exception's type
        when it broke no id), in the order the kinds were first seen."""

    def failed(self, failure: ExploreFailure, exc: BaseException) -> None:
        self.kinds[failure.ids or (type(exc).__name__,)] = failure  # a kind seen again keeps its place

    def reported(self) -> tuple[ExploreFailure | None, list[ExploreFailure]]:
        """The failure to report and the other kinds found. Hypothesis tells failures
        apart by where they were raised, shrinks each kind on its own and replays each
        kind's smallest story last, so the last story of a kind is its shrunk one. The
        kind reported is the one found first — decided by the seed's stories, not by how
        far shrinking got within its time bound (the kind replayed last was)."""
        if not self.kinds:
            return self.failure, []
        first, *others = self.kinds.values()
        return first, others


def _text(mid: str, index: int, words: int) -> str:
    # unique words: no part of a split text can equal a part of another text
    return " ".join(f"{mid}.{index}.{j}" for j in range(words))


def _plan(mid: str, drawn: list[tuple[Any, ...]]) -> list[Action]:
    out: list[Action] = []
    for i, spec in enumerate(drawn):
        kind = spec[0]
        if kind == "fail":
            out.append(fail(spec[1]))
        elif kind == "slow":
            out.append(slow(spec[1]))
        elif kind == "enqueue":
            out.append(enqueue(_text(mid, i, spec[2]), key=spec[1], n=spec[3]))
        elif kind == "reply_nan":
            out.append(reply_nan(_text(mid, i, spec[2]), key=spec[1]))
        else:
            out.append(reply(_text(mid, i, spec[2]), key=spec[1]))
    return out


def _machine(backend: str, recorder: _Recorder, crashes: bool, replicas: bool = False,
             processes: tuple[str, ...] = ()) -> type:
    """The state machine class of one backend (built here: Hypothesis is imported only
    when explore runs); without ``crashes`` (a backend that does not claim
    ``survives_crash``) no story dies or restarts; with ``replicas`` (a backend that
    claims ``multi_process``) a second live process boots, takes messages and dies
    (:mod:`.replicas`), and the bot may run on the default ``instance_id`` — rules that
    a backend without the claim does not even have, so its stories are drawn as before;
    ``processes``: the workloads a burst of real processes may run (:mod:`.processes`;
    empty: no burst), at most one burst per story."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    from ..backends.registry import resolve
    from ..scenario.api import Scenario

    maybe_key = st.one_of(st.none(), st.none(), st.sampled_from(KEYS))
    words = st.integers(1, 6)
    action = st.one_of(
        st.tuples(st.just("reply"), maybe_key, words),
        st.tuples(st.just("reply"), maybe_key, words),
        st.tuples(st.just("reply_nan"), maybe_key, words),
        st.tuples(st.just("enqueue"), st.sampled_from(KEYS), words, st.integers(2, 3)),
        st.tuples(st.just("fail"), st.integers(1, 2)),
        st.tuples(st.just("slow"), st.sampled_from(SLOW_MS)),
    )

    class ExploreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tmp = tempfile.TemporaryDirectory(prefix="botmesh-explore-")
            self.loop = asyncio.new_event_loop()
            self.x: Explorer | None = None
            self.lines: list[str] = []
            self.policy = "skip"
            self.text_limit: int | None = None
            self.default_id = False
            self.failed = False
            self.volume = False
            self.bursts = 0

        def _step(self, line: str, make: Callable[[Explorer], Coroutine[Any, Any, None]]) -> None:
            assert self.x is not None
            self.lines.append(line)
            recorder.steps += 1
            try:
                self.loop.run_until_complete(asyncio.wait_for(make(self.x), STEP_SECONDS))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # a SimulatedCrash that escaped a verb is a failure too
                self.failed = True
                if isinstance(exc, TimeoutError):
                    exc = ExploreViolation(("GUAR-1",), f"the step `{line}` did not finish within {STEP_SECONDS:g} "
                                           "real seconds (the world runs on a virtual clock: the backend hangs)")
                ids = exc.ids if isinstance(exc, ExploreViolation) else ()
                message = exc.message if isinstance(exc, ExploreViolation) else f"{type(exc).__name__}: {exc}"
                recorder.failed(ExploreFailure(ids, message, list(self.lines), self.policy, self.text_limit,
                                               self.default_id), exc)
                if recorder.found_after is None:
                    recorder.found_after = recorder.examples
                raise exc from None

        # One initialize rule, so a story's first step is always its beginning: Hypothesis
        # draws the first step of every example, but may end one after it, and with a
        # second initialize rule (the volume draw had its own) an example could end
        # before ``begin`` ran — no story, yet it was counted as one.
        drawn_first: dict[str, Any] = {"policy": st.sampled_from(("skip", "resend")),
                                       "text_limit": st.sampled_from(TEXT_LIMITS),
                                       "volume": st.sampled_from((False,) * (VOLUME_ODDS - 1) + (True,))}
        if replicas:  # only then: the stories of other backends draw as before
            drawn_first["default_id"] = st.booleans()

        @initialize(**drawn_first)
        def begin(self, policy: str, text_limit: int | None, volume: bool, default_id: bool = False) -> None:
            self.policy, self.text_limit, self.default_id = policy, text_limit, default_id
            self.volume = volume  # a story with volumes: it may draw a burst (once)
            recorder.examples += 1  # a story counts once it has begun, not when Hypothesis makes its machine
            harness = resolve(backend)(self.tmp.name)
            s = Scenario(harness, backend=backend, ids=IDS, policy=policy, origin="explore")
            self.x = Explorer(s, text_limit=text_limit, policy=policy, default_id=default_id)
            self.count = 0
            self._step("await x.start()", lambda x: x.start())

        @rule(chat=st.sampled_from(CHATS), drawn=st.lists(action, min_size=1, max_size=4),
              media=st.sampled_from(MEDIA))
        def receive(self, chat: str, drawn: list[tuple[Any, ...]], media: str | None) -> None:
            self._receive(chat, drawn, media, replica=False)

        def _receive(self, chat: str, drawn: list[tuple[Any, ...]], media: str | None, *, replica: bool) -> None:
            self.count += 1
            mid = f"m{self.count}"
            actions = _plan(mid, drawn)
            extra = ("" if media is None else f", media={media!r}") + (", replica=True" if replica else "")
            self._step(f"await x.receive({chat!r}, {mid!r}, {actions!r}{extra})",
                       lambda x: x.receive(chat, mid, actions, media, replica=replica))

        @rule(chat=st.sampled_from(CHATS), drawn=st.lists(action, min_size=1, max_size=4),
              unreadable=st.sampled_from(UNREADABLE_MS))
        def left_pending(self, chat: str, drawn: list[tuple[Any, ...]], unreadable: int) -> None:
            self.count += 1
            mid = f"m{self.count}"
            actions = _plan(mid, drawn)
            extra = f", unreadable={unreadable}" if unreadable else ""
            self._step(f"await x.left_pending({chat!r}, {mid!r}, {actions!r}{extra})",
                       lambda x: x.left_pending(chat, mid, actions, unreadable))

        @precondition(lambda self: self.volume and not self.bursts)
        @rule(size=st.sampled_from(VOLUME_BURSTS))
        def burst(self, size: tuple[int, int]) -> None:
            n, per_second = size
            self.bursts += 1
            self._step(f"await x.burst({n}, {per_second})", lambda x: x.burst(n, per_second))

        @precondition(lambda self: self.count > 0)
        @rule(which=st.integers(0, 40))
        def redeliver(self, which: int) -> None:
            mid = f"m{which % self.count + 1}"
            self._step(f"await x.redeliver({mid!r})", lambda x: x.redeliver(mid))

        @rule(kind=st.sampled_from(("transient", "rate", "refuse")), chat=st.sampled_from(CHATS),
              times=st.integers(1, 3), skip=st.sampled_from((0, 0, 1, 2)))
        def fault(self, kind: str, chat: str, times: int, skip: int) -> None:
            if kind == "refuse":
                self._step(f"await x.fault('refuse', {chat!r})", lambda x: x.fault("refuse", chat))
            elif skip:
                self._step(f"await x.fault({kind!r}, times={times}, skip={skip})",
                           lambda x: x.fault(kind, times=times, skip=skip))
            else:
                self._step(f"await x.fault({kind!r}, times={times})", lambda x: x.fault(kind, times=times))

        @precondition(lambda self: crashes)
        @rule(n=st.integers(1, 12), when=st.sampled_from(("before", "after")))
        def crash_in(self, n: int, when: str) -> None:
            self._step(f"await x.crash_in({n}, {when!r})", lambda x: x.crash_in(n, when))

        @precondition(lambda self: crashes)
        @rule(new_instance=st.booleans())
        def restart(self, new_instance: bool) -> None:
            self._step(f"await x.restart(new_instance={new_instance})", lambda x: x.restart(new_instance))

        @rule(ms=st.sampled_from(ADVANCES))
        def advance(self, ms: float) -> None:
            self._step(f"await x.advance({ms:g})", lambda x: x.advance(ms))

        if replicas:  # defined only here: the stories of other backends draw as before
            @precondition(lambda self: self.x is not None and self.x.replica_bot is None
                          and self.x._armed_boot is None)
            @rule(instance_id=st.sampled_from(REPLICA_IDS), during=st.sampled_from(REPLICA_DURING))
            def boot_replica(self, instance_id: str | None, during: int) -> None:
                self._step(f"await x.replica({instance_id!r}, during={during})",
                           lambda x: x.replica(instance_id, during))

            @precondition(lambda self: self.x is not None and self.x.replica_bot is not None)
            @rule(chat=st.sampled_from(CHATS), drawn=st.lists(action, min_size=1, max_size=4),
                  media=st.sampled_from(REPLICA_MEDIA))
            def receive_at_replica(self, chat: str, drawn: list[tuple[Any, ...]], media: str | None) -> None:
                self._receive(chat, drawn, media, replica=True)

            @precondition(lambda self: self.x is not None and self.x.replica_bot is not None)
            @rule()
            def stop_replica(self) -> None:
                self._step("await x.stop_replica()", lambda x: x.stop_replica())

        if processes:  # likewise
            @precondition(lambda self: self.x is not None and self.x.bursts < BURSTS)
            @rule(workload=st.sampled_from(processes), seed=st.integers(0, 3), go=st.integers(0, BURST_ODDS - 1))
            def process_burst(self, workload: str, seed: int, go: int) -> None:
                # its own name: under ``burst`` it replaced the volume burst (OPS-3) on
                # every backend claiming multi_process, which then never drew one
                if go:  # drawn rarely: a burst costs process starts
                    return
                self._step(f"await x.processes({workload!r}, seed={seed})", lambda x: x.processes(workload, seed))

        def teardown(self) -> None:
            try:
                if self.x is not None and not self.failed:
                    self._step("await x.finish()", lambda x: x.finish())
            finally:
                try:
                    if self.x is not None:
                        self.loop.run_until_complete(asyncio.wait_for(self.x.world.close(), STEP_SECONDS))
                finally:
                    pending = asyncio.all_tasks(self.loop)
                    for task in pending:  # what a dead incarnation left running
                        task.cancel()
                    if pending:
                        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                    self.loop.close()
                    self.tmp.cleanup()

    ExploreMachine.__name__ = ExploreMachine.__qualname__ = f"Explore_{re.sub(r'[^0-9A-Za-z]', '_', backend)}"
    return ExploreMachine


def explore(backend: str, *, examples: int, seconds: float, seed: int, database: Path | None = None,
            shrink_seconds: float = SHRINK_SECONDS, crashes: bool = True, replicas: bool | None = None,
            processes: bool = True) -> ExploreRun:
    """Run up to ``examples`` generated stories on ``backend`` (a registry name or
    ``pkg.module:factory``), for at most about ``seconds`` (see the module docstring),
    shrinking a failure for at most about ``shrink_seconds``. ``replicas``: stories
    with a second live process (:mod:`.replicas`); None: when the backend's harness
    claims ``multi_process``. ``processes``: stories with a burst of real processes on
    the storage (:mod:`.processes`), when the backend claims ``multi_process`` and its
    harness gives a ``kill_spec()`` (``cas`` only for a ``DurableKv``'s)."""
    multi, workloads = _multi_process(backend)
    if replicas is None:
        replicas = multi
    from hypothesis.internal.conjecture import engine

    # Hypothesis's own bound on shrinking is 300 s, a module constant (internal: when a
    # later version drops it, shrinking keeps Hypothesis's default)
    saved = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if saved is not None:
        engine.MAX_SHRINKING_SECONDS = shrink_seconds  # type: ignore[assignment]
    # the stories provoke what the implementation warns about on purpose (a NaN content
    # bypassing the outbox, a dead incarnation's file lock taken over), thousands of times:
    # the model checks those outcomes, the warnings would only bury a failure's report
    quiet = logging.getLogger("botmesh")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with _seed_only_draws():  # the other Hypothesis internal a run sets, beside the bound on shrinking
            return _explore(backend, examples=examples, seconds=seconds, seed=seed, database=database,
                            crashes=crashes, replicas=replicas, processes=workloads if processes else ())
    finally:
        quiet.setLevel(level)
        if saved is not None:
            engine.MAX_SHRINKING_SECONDS = saved


def _multi_process(backend: str) -> tuple[bool, tuple[str, ...]]:
    """Whether ``backend`` claims ``multi_process``, and the workloads a burst of real
    processes can run on it. A third party's factory is called to learn its claims (its
    harness knows them only then) and whether it gives a ``DurableKv``; what it returns
    is not opened (an ``abandon()`` it has is called)."""
    from ..backends.factory import FactoryHarness
    from ..backends.registry import resolve
    from .processes import WORKLOADS

    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        harness = resolve(backend)(tmp)
        if isinstance(harness, FactoryHarness):
            made = harness._call()
            if asyncio.iscoroutine(made):
                made.close()  # an async factory: its claims stay unknown here
                return False, ()
            caps = getattr(made, "capabilities", None)
            close = getattr(made, "abandon", None)
            if callable(close) and not asyncio.iscoroutinefunction(close):
                close()
        else:
            caps = harness.capabilities
        if not (caps is not None and caps.multi_process):
            return False, ()
        if harness.kill_spec() is None:
            return True, ()
        with_kv = harness.kv_factory() is not None
        return True, tuple(w for w in WORKLOADS if with_kv or w != "cas")


@contextmanager
def _seed_only_draws() -> Iterator[None]:
    """Stories that depend on the seed alone. Hypothesis (6.13x on) now and then draws a
    constant taken from the literals of the modules the process has imported from the
    project itself (``sys.modules``), and caches the pool per kind of draw process-wide:
    the same seed gave other stories in CI's pytest worker, which had imported every test
    module, than alone (CI met a story no other run could draw). While a run explores,
    that pool is empty and the cache is one of its own; both are put back after. This
    reaches into Hypothesis's internals: a version without them explores as it does."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        get_local, cache = providers._get_local_constants, providers.CONSTANTS_CACHE
        empty = Constants()  # (empty sets: the pool is only looked through)
        own_cache = type(cache)(cache.max_size)
    except (ImportError, AttributeError, TypeError):
        yield
        return
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE = own_cache
    try:
        yield
    finally:
        providers._get_local_constants, providers.CONSTANTS_CACHE = get_local, cache


def _explore(backend: str, *, examples: int, seconds: float, seed: int, database: Path | None,
             crashes: bool, replicas: bool, processes: tuple[str, ...] = ()) -> ExploreRun:
    from hypothesis import HealthCheck, Verbosity, settings
    from hypothesis import seed as hseed
    from hypothesis.database import DirectoryBasedExampleDatabase
    from hypothesis.stateful import run_state_machine_as_test

    run = ExploreRun(backend, seed)
    recorder = _Recorder()
    started = time.monotonic()
    db = DirectoryBasedExampleDatabase(str(database)) if database is not None else None
    done = chunk = 0
    while done < examples:
        if chunk and time.monotonic() - started >= seconds:  # the first chunk always runs
            run.cut_by_time = True
            break
        n = min(CHUNK, examples - done)
        machine = hseed(seed + chunk)(_machine(backend, recorder, crashes, replicas, processes))
        config = settings(max_examples=n, deadline=None, database=db, stateful_step_count=STEPS,
                          suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, print_blob=False)
        try:
            run_state_machine_as_test(machine, settings=config)
        except Exception as exc:  # the model broke (or the backend raised): the recorded story says how
            if not recorder.kinds:
                recorder.failure = ExploreFailure((), f"{type(exc).__name__}: {exc}", [], "skip", None)
            elif type(exc).__name__.startswith("Flaky"):
                run.notes.append("the failure did not reproduce on Hypothesis's replay (flaky): the story below is "
                                 "the last run that failed")
            break
        done += n
        chunk += 1
    run.examples, run.steps = recorder.examples, recorder.steps
    # each kind has its own shrunk story; the one reported is the first found
    run.failure, run.others = recorder.reported()
    if recorder.found_after is not None:
        run.notes.append(f"first failing story: example {recorder.found_after}; the rest shrank it")
    run.seconds = time.monotonic() - started
    return run


def render_story(backend: str, seed: int, failure: ExploreFailure, kind: int = 1) -> tuple[str, str]:
    """The scenario file (its function's name, its text) that replays ``failure``, the
    ``kind``-th kind of failure the run found (1: the one reported), named
    ``explore_<backend>_seed<seed>_kind<k>_story``: no such name is part of another — of
    another kind, seed or backend — so ``-k NAME`` picks that one story in a folder that
    also holds the stories of earlier runs."""
    name = f"explore_{re.sub(r'[^0-9A-Za-z]', '_', backend)}_seed{seed}_kind{kind}_story"
    ids = failure.ids or IDS
    extra = ", default_id=True" if failure.default_id else ""
    body = [f"    x = Explorer(s, text_limit={failure.text_limit!r}, policy={failure.policy!r}{extra})"]
    body += [f"    {line}" for line in failure.lines]
    if not failure.lines or not failure.lines[-1].endswith("x.finish()"):
        body.append("    await x.finish()")
    head = (f'"""Found by explore on {backend} (seed {seed}): {failure.message[:300]}"""\n\n'
            if '"""' not in failure.message else f"# found by explore on {backend} (seed {seed})\n\n")
    text = (head + STORY_IMPORTS + "\n\n" + f"@scenario({', '.join(repr(i) for i in ids)})\n"
            f"async def {name}(s):\n" + "\n".join(body) + "\n")
    return name, text
