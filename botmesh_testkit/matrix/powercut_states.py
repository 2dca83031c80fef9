"""Power-cut crash states in the crash matrix (issue 11, the in-process variant): for the
backends that do all their file I/O through ``botmesh.core.fileio`` (``file``,
``file+log``, and any harness whose :meth:`~botmesh_testkit.backends.base.BackendHarness.
use_file_io` accepts a ``FileIO``), a cell that crashes also asks what a **power cut** at
its crash point could have left on disk, and recovers from each of those states too.

How. The cell's backend runs on a :class:`~botmesh_testkit.crash.fs.PowerCutIO`: the real
directory, every operation also recorded in the persistence model
(:mod:`botmesh_testkit.crash.fs.model`), fsync included but not sent to the disk. At the
crash the model knows the *unsynced window* — the operations no fsync made durable yet —
and enumerates the states a power cut could leave (CrashMonkey / ALICE style,
:meth:`~botmesh_testkit.crash.fs.PersistenceModel.crash_states`): every prefix of the
window in the order the operations were made (none kept … all kept), each next write
torn at a 512-byte boundary, and :data:`SUBSETS` seeded subsets (writeback in any
order). The state with everything kept is what the ordinary in-process crash already
recovers from, and identical states count once. Of the rest at most
:data:`MAX_STATES_PER_CELL` are recovered: the first (nothing unsynced kept, the harshest)
always, the others drawn with a generator seeded by the run's seed and the cell's id, so
a cell always checks the same states.

Each state is written into a directory of its own and judged twice:

1. **reopened** — the backend opened on it must hold every record it had acknowledged
   when the crash came (:func:`~botmesh_testkit.checker.journal.lost_writes`, read from
   the live backend before anything else runs): a write that returned is durable
   (INB-1, OUT-1, GUAR-1, GUAR-2, GUAR-4, BACK-6); a state it cannot open at all is a
   journal that a power cut destroys (GUAR-1, GUAR-2, BACK-6; BACK-5 is only that it
   says so).
2. **recovered** — a copy of the cell's world at the crash (:meth:`World.fork
   <botmesh_testkit.crash.world.World.fork>`: channel, store, clock, events) restarts on
   it, gets the channel's redeliveries and drains, and the history check judges it
   against the oracle, as the ordinary recovery.

A violation of either names the state (``power cut at before outbox.mark_sent #1, crash
state 2 (the first 1 of 3 unsynced operations kept)``). Only for backends that claim
``survives_crash``: one that does not claim it owes nothing to a power cut.

How it shows: a cell stays one item with the same id (``BACKEND/WORKLOAD/POLICY/
WHEN:POINT#N``); its outcome counts the states recovered
(:attr:`~botmesh_testkit.matrix.cells.Outcome.power_cut_states`), its report says how many
and which failed, and the reproduce command of the cell reruns them all. With a correct
``fsync=True`` journal the window at a crash point is empty or nearly (a crash point lies
between whole backend operations, each of which fsyncs before it returns), so most cells
recover from no extra state and the smoke matrix costs about what it did; a journal that
acknowledges before its data is durable leaves a window at every point.
"""

from __future__ import annotations

import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..backends.base import BackendHarness
from ..backends.registry import resolve
from ..checker.history import check
from ..checker.journal import Journal, lost_writes, read_journal
from ..checker.violation import Violation
from ..crash.fs.image import materialize
from ..crash.fs.recording_io import PowerCutIO
from ..crash.fs.state import CrashState
from ..crash.world import World
from .cells import Cell, Oracle, Outcome
from .scratch import scratch_dir
from .workloads import Workload

__all__ = ["MAX_STATES_PER_CELL", "SUBSETS", "PowerCutStates", "choose", "recording_io"]

MAX_STATES_PER_CELL = 4
"""At most this many power-cut states are recovered per cell (beyond the ordinary
recovery), so that a journal with a long unsynced window costs at most five recoveries a
cell rather than one per operation it left unsynced."""

SUBSETS = 2
"""Seeded subset states (writeback in any order) asked of the model per cell, beside the
prefixes and torn writes."""

Recover = Callable[[World, Workload], Awaitable[object]]
"""How a cell recovers a world after its crash (:func:`botmesh_testkit.matrix.run.recover`)."""

IDS = ("BACK-6",)
"""Added to the ids of every power-cut violation: the file journal's durability rule."""


def recording_io(harness: BackendHarness, workdir: str) -> PowerCutIO | None:
    """A :class:`PowerCutIO` on ``workdir`` handed to ``harness`` (None when the harness
    does not do its file I/O through ``botmesh.core.fileio``). Call before it opens.
    A harness that keeps :meth:`BackendHarness.use_file_io`'s default (which refuses any
    ``FileIO``) is not handed one: no tree is read for it (issue 16, a cost per cell)."""
    if type(harness).use_file_io is BackendHarness.use_file_io:
        return None
    io = PowerCutIO(workdir)
    return io if harness.use_file_io(io) else None


def choose(states: list[CrashState], visible: str, rng: random.Random, cap: int = MAX_STATES_PER_CELL) -> list[CrashState]:
    """The states to recover: those differing from ``visible`` (the fingerprint of what is
    on disk, which the ordinary recovery reads), at most ``cap`` — the first one always,
    the others drawn with ``rng`` — in the order the model gave them."""
    fresh = [s for s in states if s.fingerprint() != visible]
    if len(fresh) <= cap:
        return fresh
    picked = sorted(rng.sample(range(1, len(fresh)), cap - 1))
    return [fresh[0], *(fresh[i] for i in picked)]


@dataclass
class PowerCutStates:
    """What a crashed cell needs to recover from its power-cut states later: the states,
    the journals the backend had acknowledged, a copy of the world at the crash."""

    cell: Cell
    states: list[CrashState]
    window: int
    """Distinct crash states the model gave (the one on disk included)."""
    acknowledged: Journal | None
    """None: the live backend could not list its journals (judged by recovery alone), or
    there is no state to judge."""
    base: World | None
    """A copy of the world at the crash; None when there is no state to recover."""
    scope: str

    @classmethod
    async def capture(cls, world: World, io: PowerCutIO, cell: Cell, seed: int) -> PowerCutStates:
        """At the crash, before anything else runs: the candidate states, the acknowledged
        journals (from the live backend beneath the crash wrapper), a fork of the world."""
        assert world.crashable is not None and world.bot is not None and world.bot.durability is not None
        scope = world.bot.durability.scope
        if io.model.unsynced_ops() == 0:
            # Nothing unsynced (a correct journal at most crash points): the model's one
            # state is the durable one, which is what is on disk and what the ordinary
            # recovery reads, so none is left to recover — known without building the
            # states and their fingerprints, nor the fork (issue 16: ~0.2 ms a cell).
            return cls(cell, [], 1, None, None, scope)
        all_states = list(io.crash_states(subsets=SUBSETS, seed=f"{seed}/{cell.id}", torn=True))
        states = choose(all_states, io.model.visible_state().fingerprint(), random.Random(f"{seed}/{cell.id}/powercut"))
        acknowledged: Journal | None = None
        if states:
            try:
                acknowledged = await read_journal(world.crashable.inner, scope)
            except Exception:  # a backend that cannot even list what it holds: judged by recovery only
                acknowledged = None
        return cls(cell, states, len(all_states), acknowledged, world.fork(world.harness) if states else None, scope)

    async def judge(self, w: Workload, truth: Oracle, outcome: Outcome, recover: Recover) -> None:
        """Recover from each state (module docstring) with ``recover`` and add what broke
        to ``outcome``."""
        outcome.power_cut_states = len(self.states)
        outcome.power_cut_window = self.window
        if not self.states:
            return
        with scratch_dir("botmesh-powercut-states-") as tmp:
            for i, state in enumerate(self.states, 1):
                where = f"power cut at {outcome.crash_point}, crash state {i} ({state.description})"
                broken = await self._one(w, truth, state, os.path.join(tmp, str(i)), where, recover,
                                         outcome.crash_point)
                if broken:
                    outcome.power_cut_failed += 1
                    outcome.violations.extend(broken)

    async def _one(self, w: Workload, truth: Oracle, state: CrashState, directory: str, where: str,
                   recover: Recover, crash_point: str | None) -> list[Violation]:
        materialize(state, directory)
        harness = resolve(self.cell.backend)(directory)
        recording_io(harness, directory)  # no disk flushes for the state's recovery either
        try:
            backend, _ = await harness.open()
        except Exception as exc:
            await _close_quietly(harness)
            return [Violation(("GUAR-1", "GUAR-2", *IDS), f"{where}: the backend no longer opens: {exc!r}")]
        out: list[Violation] = []
        assert self.base is not None  # (made whenever there are states)
        world = self.base.fork(harness)
        try:
            if self.acknowledged is not None:
                try:
                    await backend.start()
                    out.extend(lost_writes(self.acknowledged, await read_journal(backend, self.scope), where=where,
                                           extra_ids=IDS))
                except Exception as exc:
                    out.append(Violation(("GUAR-1", "GUAR-2", *IDS), f"{where}: the reopened backend cannot list its "
                                                                     f"journals: {exc!r}"))
                    return out
            sub = Outcome(self.cell, True, crash_point)
            try:
                await recover(world, w)
            except Exception as exc:
                out.append(Violation(("GUAR-1", "GUAR-2", "INB-3", *IDS), f"{where}: recovery failed: {exc!r}"))
                return out
            sub.deliveries = [(m.chat_id, str(m.content.get("text"))) for m in world.channel.sent]
            await check(world, truth, sub)
            out.extend(Violation(v.ids, f"{where}, after recovery: {v.message}") for v in sub.violations)
            return out
        finally:
            await world.close(discard=True)  # the state's directory is removed after the judging


async def _close_quietly(harness: BackendHarness) -> None:
    try:
        await harness.close()
    except Exception:  # a backend that did not open has nothing to release
        pass
