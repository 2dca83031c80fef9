"""Running the crash matrix (TEST-4).

A **cell** is (backend, workload, ``on_ambiguous`` policy, crash point). Running it:
start a bot whose backend and provider can die, arm the crash, feed the workload's
messages and let time run until the crash fires; abandon the bot; start a new bot on the
same backend and store with the same ``instance_id``; let the channel redeliver every
message (webhooks redeliver until acknowledged) and drain in virtual time. The history
check (:func:`botmesh_testkit.checker.history.check`) then judges the history against the
guarantees, using a crash-free run of the same workload as the oracle.

The crash points of a cell come from a crash-free *dry run* of the workload on the same
backend: every (operation, occurrence) it passed, before and after; plus random cells
(``crash_at(n)``) drawn from a seed (:func:`botmesh_testkit.matrix.cells.draw_cells`).

For a backend whose harness does its file I/O through ``botmesh.core.fileio`` (``file``,
``file+log``: :meth:`~botmesh_testkit.backends.base.BackendHarness.use_file_io`) and that
claims ``survives_crash``, a cell runs on a recording ``PowerCutIO`` (no real fsync: the
model keeps durability), and after its crash it also recovers from the crash states a
power cut at that point could leave, at most four (:mod:`.powercut_states`): the cell's
id does not change, its outcome counts the states (``power_cut_states``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, cast

from botmesh.core.store import Store

from ..backends.base import BackendHarness
from ..backends.registry import resolve
from ..checker.history import check
from ..crash.world import DRAIN_MS, Journals, World
from .cells import POLICIES, Cell, MatrixResult, Oracle, Outcome, draw_cells
from ..crash.fs.recording_io import PowerCutIO
from .powercut_states import PowerCutStates, recording_io
from .scratch import scratch_dir
from .workloads import WORKLOADS, Workload, transient


def make_world(harness: BackendHarness, w: Workload, policy: str, seed: int) -> World:
    """The crash world a cell of workload ``w`` runs in, under ``policy``."""
    return World(
        harness,
        setup=w.setup,
        durability={"outbox": {"on_ambiguous": policy}},
        text_limit=w.text_limit,
        seed=seed,
    )


async def feed(world: World, messages: Iterable[tuple[str, str, str]]) -> None:
    """Deliver ``(chat, text, id)`` messages as the channel would, until a crash."""
    for chat_id, text, id in messages:
        if world.crashed:
            return
        await world.receive(chat_id, text, id=id)


async def play(world: World, w: Workload) -> None:
    """Feed the workload, letting time run between stages; stops at a crash."""
    await feed(world, w.inbound)
    if not world.crashed:
        await world.drain(DRAIN_MS)
    if w.answers and not world.crashed:
        await feed(world, w.answers)
        if not world.crashed:
            await world.drain(DRAIN_MS)


async def oracle(backend: str, workload: str, seed: int, workdir: str) -> Oracle:
    """A crash-free run: what the workload delivers, and the crash points it passes."""
    w = WORKLOADS[workload]
    harness = resolve(backend)(workdir)
    harness.reuse_storage()
    world = make_world(harness, w, "skip", seed)
    try:
        await world.start(crash=True)  # armed with nothing: records the points passed
        world.channel.fail_next(transient(), times=w.channel_failures)
        await play(world, w)
        assert world.crashable is not None and world.bot is not None and world.bot.durability is not None
        d = world.bot.durability
        inbox = {r.id: r.state for r in await d.inbox.list()}
        dead = len(await d.outbox.list(state="dead"))
        return Oracle([(m.chat_id, str(m.content.get("text"))) for m in world.channel.sent], inbox, dead,
                      list(world.crashable.history), set(world.crashable.raised))
    finally:
        await world.close()


class _StoreDown:
    """A store that is down: every call raises (the "store is down" of INB-5)."""

    def __getattr__(self, name: str) -> Any:
        async def down(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError(f"the store is down ({name})")

        return down


async def recover(world: World, w: Workload) -> Journals | None:
    """After a crash: a new bot, then the channel's redeliveries, drained. With
    ``store_down_at_restart`` the bot's store fails during the first sweep pass. Returns
    what the last drain returned: the journals as they are at the end, when it found
    everything settled (:meth:`World.drain`), else None."""
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
    await feed(world, w.inbound)
    settled = await world.drain(DRAIN_MS)
    if w.answers:
        await feed(world, w.answers)
        settled = await world.drain(DRAIN_MS)
    return settled


async def run_cell(cell: Cell, seed: int, truth: Oracle, workdir: str, *, measure_recovery: bool = False) -> Outcome:
    """Run one cell and check its history; for a file backend, also recover from the
    power-cut crash states of its crash point (module docstring). ``measure_recovery``:
    record the lines of the engine's recovery code run from the restart to the end of
    the drain (``Outcome.recovery_lines``; the ordinary recovery's only). ``workdir`` is
    the cell's scratch directory, thrown away by the caller: the harness is discarded at
    the end (:meth:`~botmesh_testkit.backends.base.BackendHarness.discard`), not closed."""
    w = WORKLOADS[cell.workload]
    started = time.perf_counter()
    harness = resolve(cell.backend)(workdir)
    harness.reuse_storage()
    io = recording_io(harness, workdir)
    world = make_world(harness, w, cell.policy, seed)
    try:
        await world.start(crash=True)
        cb = world.crashable
        assert cb is not None
        cb.arm(cell.when, cell.point, cell.nth)
        world.channel.fail_next(transient(), times=w.channel_failures)
        await play(world, w)
        return await finish_cell(world, cell, seed, truth, io, started, measure_recovery=measure_recovery)
    finally:
        await world.close(discard=True)


async def finish_cell(world: World, cell: Cell, seed: int, truth: Oracle, io: PowerCutIO | None, started: float, *,
                      measure_recovery: bool = False) -> Outcome:
    """The rest of a cell once :func:`play` returned (the crash fired, or the workload
    ended without it): the power-cut states, the recovery, the history check. The one
    copy :func:`run_cell` and a forked shared prefix (:mod:`.shared`) both run."""
    w = WORKLOADS[cell.workload]
    cb = world.crashable
    assert cb is not None
    crashed, crash_point, history = cb.crashed, cb.crash_point, list(cb.history)
    cuts: PowerCutStates | None = None
    if crashed and io is not None and cb.capabilities.survives_crash:  # the backend's own claim
        cuts = await PowerCutStates.capture(world, io, cell, seed)
    recovery_lines: frozenset[int] | None = None
    recovery_note: str | None = None
    settled: Journals | None = None  # the journals at the end of the recovery, when it read them
    if crashed and measure_recovery:
        from .coverage import measure

        with measure() as measured:
            settled = await recover(world, w)
        recovery_lines, recovery_note = measured.lines, measured.note
    elif crashed:
        settled = await recover(world, w)
    elif measure_recovery:
        recovery_lines = frozenset()
    outcome = Outcome(cell, crashed, crash_point, history=history,
                      deliveries=[(m.chat_id, str(m.content.get("text"))) for m in world.channel.sent],
                      recovery_lines=recovery_lines, recovery_note=recovery_note)
    await check(world, truth, outcome, journals=settled)
    if cuts is not None:
        await cuts.judge(w, truth, outcome, recover)
    outcome.seconds = time.perf_counter() - started
    return outcome


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
    outcomes: list[Outcome] = []
    policies = list(policies)
    for backend in backends:
        for workload in workloads:
            if only is not None and (only.backend != backend or only.workload != workload):
                continue
            with scratch_dir("botmesh-oracle-") as tmp:
                truth = await oracle(backend, workload, seed, tmp)
            cells = draw_cells(backend, workload, truth, policies, random_per_workload, seed)
            if only is not None:
                cells = [only]
            for cell in cells:
                with scratch_dir("botmesh-cell-") as tmp:
                    outcome = await run_cell(cell, seed, truth, tmp, measure_recovery=measure_recovery)
                outcomes.append(outcome)
                if progress is not None:
                    progress(outcome)
    return MatrixResult(seed, outcomes, time.perf_counter() - started)

