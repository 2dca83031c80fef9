"""Cells that share a prefix share its work (issue 16): the crash matrix's fast path.

Every cell of one ``(backend, workload, policy)`` runs the same code up to its crash
point: a cell armed at the k-th point passes exactly the points a crash-free run passes
before it, since an armed rule changes nothing until it fires. So instead of replaying
that prefix once per cell, :class:`SharedPrefix` runs the workload **once**, crash-free,
and at each crash point a cell of the group wants it ``os.fork()``\\ s the process: the
copy is paused there, the original goes on to the next point. Resumed, the copy dies at
that point exactly as the armed cell would (:meth:`CrashableBackend.die
<botmesh_testkit.crash.wrapper.CrashableBackend.die>`, at the place in ``enter``/``leave``
where an armed rule fires), and then runs the rest of the cell with the one copy of that
code, :func:`~botmesh_testkit.matrix.run.finish_cell`: what is left of the workload, the
restart, the redelivery, the drain and the history check. It sends its
:class:`~botmesh_testkit.matrix.cells.Outcome` back through a pipe and exits. A fork
copies *everything* — the bot's coroutines half-way through a call, the virtual clock's
timers, the channel, the random generators, the storage — so the forked cell is not a
model of the replayed one: it is the same computation, minus the replay.

Which backends. Only a harness whose storage is private to the process after a fork says
so (:meth:`BackendHarness.forkable <botmesh_testkit.backends.base.BackendHarness.
forkable>`: ``memory``, all in the process's memory). Storage in files or on a server is
shared by a fork, so those backends — and any third party's harness, which does not
override ``forkable()`` — replay the prefix per cell as before (:func:`~.run.run_cell`),
as does every cell on a platform without ``os.fork``. A cell whose crash point the shared
run never reached (it did not crash) is run by :func:`~.run.run_cell` too.

Two ways to use it: :func:`run_cells` runs a list of cells (a Python API; the CLI and the
benchmarks replay each cell with :func:`~.run.run_cell`), resuming each copy as soon as it
is forked; :class:`SharedPrefixes` serves the pytest items one cell at a time, keeping the
copies of the group paused until their item runs (with ``-n`` workers each worker resumes
only its own items' copies). Only with ``--botmesh-shared-prefix``: on the 2-CPU VM of
``benchmarks/README.md`` a fork costs more than a replayed memory cell (2026-12-07, the
294 smoke cells on memory through :func:`run_cells`: 2.6 s shared, 0.36 s replayed).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..backends.registry import resolve
from .cells import Cell, Oracle, Outcome
from .powercut_states import recording_io
from .scratch import scratch_dir
from .run import finish_cell, make_world, play, run_cell
from .workloads import WORKLOADS, transient

__all__ = ["SharedPrefix", "SharedPrefixError", "SharedPrefixes", "forks", "run_cells"]

MAX_GROUPS = 2
"""Groups whose paused copies :class:`SharedPrefixes` keeps at once per process; an older
group's copies are ended (a cell of it asked for later forks its group again)."""

_PARENT_FDS: set[int] = set()
"""The pipe ends this process holds to its paused copies: a new copy closes its
inherited duplicates at once, so that a copy sees the end of its command pipe when the
process that made it closes it (the OS process is what they belong to, hence a module
global)."""


def forks(backend: str) -> bool:
    """Whether cells of ``backend`` can share their prefix: ``os.fork`` exists and its
    harness says :meth:`~botmesh_testkit.backends.base.BackendHarness.forkable` (asked of
    a harness made and never opened)."""
    if not hasattr(os, "fork"):
        return False
    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        return bool(resolve(backend)(tmp).forkable())


class SharedPrefixError(RuntimeError):
    """A forked cell raised (the message is its traceback) or died without an answer."""


@dataclass
class _Copy:
    """The parent's side of a paused copy."""

    pid: int
    command: int  # write end: b"go" resumes it, closing it unwritten ends it
    result: int  # read end: the pickled answer, then end of file


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _close(fd: int) -> None:
    _PARENT_FDS.discard(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class SharedPrefix:
    """One crash-free run of ``(backend, workload, policy)`` that forks a paused copy of
    the process at the crash point of each cell of ``cells`` (module docstring).
    ``eager``: resume each copy as soon as it is made and keep its outcome
    (:attr:`outcomes`); else keep it paused (:attr:`copies`) until :meth:`resume`."""

    def __init__(self, cells: Iterable[Cell], seed: int, truth: Oracle, *, measure_recovery: bool = False,
                 eager: bool = False) -> None:
        self.cells = list(cells)
        keys = {(c.backend, c.workload, c.policy) for c in self.cells}
        if len(keys) != 1:
            raise ValueError(f"SharedPrefix: the cells must share backend, workload and policy, got {sorted(keys)}")
        (self.backend, self.workload, self.policy), = keys
        self.seed = seed
        self.truth = truth
        self.measure_recovery = measure_recovery
        self.eager = eager
        self.copies: dict[Cell, _Copy] = {}
        self.outcomes: dict[Cell, Outcome] = {}
        self._wanted: dict[tuple[str, str, int], list[Cell]] = {}
        for c in self.cells:
            self._wanted.setdefault((c.when, c.point, c.nth), []).append(c)
        self._cb: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeout: asyncio.Timeout | None = None
        self._resumed: tuple[Cell, int, float] | None = None  # in a resumed copy: its cell, answer pipe, start

    # -- the parent ------------------------------------------------------------------------------
    async def build(self, budget: float | None = None) -> None:
        """Run the prefix once, forking at each wanted point; within ``budget`` real
        seconds (a copy resumed later is not bound by it)."""
        try:
            self._loop = asyncio.get_running_loop()
            async with asyncio.timeout(budget) as tm:
                self._timeout = tm
                await self._run()
        except BaseException:
            self.discard()
            raise

    async def _run(self) -> None:
        w = WORKLOADS[self.workload]
        with scratch_dir("botmesh-prefix-") as tmp:
            harness = resolve(self.backend)(tmp)
            io = recording_io(harness, tmp)
            world = make_world(harness, w, self.policy, self.seed)
            if io is not None or not harness.forkable():
                raise ValueError(f"SharedPrefix: the harness of {self.backend!r} does not allow forking (forks())")
            try:
                await world.start(crash=True)
                cb = world.crashable
                assert cb is not None
                self._cb = cb
                cb.at_point = self._at_point
                world.channel.fail_next(transient(), times=w.channel_failures)
                try:
                    await play(world, w)
                except BaseException as exc:
                    if self._resumed is not None:
                        self._answer(("error", "".join(traceback.format_exception(exc))))
                    raise
                if self._resumed is not None:
                    cell, _, started = self._resumed
                    try:
                        outcome = await finish_cell(world, cell, self.seed, self.truth, io, started,
                                                    measure_recovery=self.measure_recovery)
                        answer: tuple[str, Any] = ("ok", outcome)
                    except BaseException as exc:
                        answer = ("error", "".join(traceback.format_exception(exc)))
                    self._answer(answer)
            finally:
                if self._resumed is not None:  # a copy never returns into its parent's code
                    os._exit(70)
                if self._cb is not None:
                    self._cb.at_point = None
                await world.close()

    def _at_point(self, when: str, op: str, nth: int, total: int) -> None:
        for cell in (*self._wanted.get((when, op, nth), ()), *self._wanted.get((when, "*", total), ())):
            if cell in self.copies or cell in self.outcomes:
                continue
            copy = self._fork(cell)
            if copy is None:  # this is the copy, resumed: die here, as the armed cell does
                self._cb.die(when, op, nth)
                return
            self.copies[cell] = copy
            if self.eager:
                self.outcomes[cell] = self.resume(cell)

    def _fork(self, cell: Cell) -> _Copy | None:
        command_r, command_w = os.pipe()
        result_r, result_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for fd in list(_PARENT_FDS):  # the parent's ends to its other copies
                    _close(fd)
                os.close(command_w)
                os.close(result_r)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                chunks = []
                while chunk := os.read(command_r, 16):
                    chunks.append(chunk)
                os.close(command_r)
                if b"".join(chunks) != b"go":
                    os._exit(0)  # ended unused
                # asyncio keeps the running loop per process id: this process's is the copy's
                asyncio._set_running_loop(self._loop)
                if self._timeout is not None:  # the prefix's budget is the parent's, not this copy's
                    self._timeout.reschedule(None)
                self._resumed = (cell, result_w, time.perf_counter())
            except BaseException:
                os._exit(71)
            return None
        os.close(command_r)
        os.close(result_w)
        _PARENT_FDS.update((command_w, result_r))
        return _Copy(pid, command_w, result_r)

    def _answer(self, answer: tuple[str, Any]) -> None:
        """In a resumed copy: send the answer and exit."""
        assert self._resumed is not None
        try:
            try:
                data = pickle.dumps(answer)
            except Exception as exc:
                data = pickle.dumps(("error", f"the outcome cannot be pickled: {exc!r}"))
            _write_all(self._resumed[1], data)
        finally:
            os._exit(0)

    def resume(self, cell: Cell, timeout: float | None = None) -> Outcome:
        """Resume ``cell``'s paused copy and return its outcome (``TimeoutError`` after
        ``timeout`` real seconds: the copy is killed). Raises ``KeyError`` when the shared
        run made no copy for it (its point was not reached: run it with ``run_cell``)."""
        copy = self.copies.pop(cell)
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: list[bytes] = []
        try:
            _write_all(copy.command, b"go")
            _close(copy.command)
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([copy.result], [], [], left)
                if not ready:
                    os.kill(copy.pid, signal.SIGKILL)
                    raise TimeoutError(f"cell {cell.id} did not finish within {timeout:g} s")
                chunk = os.read(copy.result, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            _close(copy.command)
            _close(copy.result)
            _reap(copy.pid)
        if not chunks:
            raise SharedPrefixError(f"cell {cell.id}: its forked copy died without an answer")
        status, payload = pickle.loads(b"".join(chunks))
        if status != "ok":
            raise SharedPrefixError(f"cell {cell.id} raised in its forked copy:\n{payload}")
        assert isinstance(payload, Outcome)
        return payload

    def discard(self) -> None:
        """End every copy still paused."""
        copies, self.copies = self.copies, {}
        for copy in copies.values():
            _close(copy.command)
            _close(copy.result)
        for copy in copies.values():
            _reap(copy.pid)


async def run_cells(cells: Iterable[Cell], seed: int, truths: dict[tuple[str, str], Oracle], *,
                    measure_recovery: bool = False, share: bool = True,
                    progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run ``cells`` (``truths``: the oracle per ``(backend, workload)``) and return their
    outcomes in the same order; ``progress`` is called with each, in that order.
    ``share``: cells of one ``(backend, workload, policy)`` share their prefix (module
    docstring) where the harness allows it; else each replays it (:func:`run_cell`). The
    outcomes are the same either way."""
    cells = list(cells)
    done: dict[Cell, Outcome] = {}
    if share:
        groups: dict[tuple[str, str, str], list[Cell]] = {}
        forking = {b: forks(b) for b in {c.backend for c in cells}}
        for c in cells:
            if forking[c.backend]:
                groups.setdefault((c.backend, c.workload, c.policy), []).append(c)
        for (backend, workload, _), members in groups.items():
            group = SharedPrefix(members, seed, truths[(backend, workload)], measure_recovery=measure_recovery,
                                 eager=True)
            await group.build()
            done.update(group.outcomes)
    outcomes = []
    for c in cells:
        outcome = done.get(c)
        if outcome is None:
            with scratch_dir("botmesh-cell-") as tmp:
                outcome = await run_cell(c, seed, truths[(c.backend, c.workload)], tmp,
                                         measure_recovery=measure_recovery)
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    return outcomes


class SharedPrefixes:
    """The pytest items' shared prefixes in one process: :meth:`outcome` runs one cell,
    from a paused copy of its group's shared run when the harness allows it (the group
    is built when the first of its cells asks), else by replay."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str, str, int, bool], SharedPrefix] = {}
        self._ran: set[tuple[Cell, int]] = set()
        self._forks: dict[str, bool] = {}  # backend -> forks(backend)

    def outcome(self, cell: Cell, seed: int, truth: Oracle, group: Iterable[Cell], budget: float | None, *,
                measure_recovery: bool = False) -> Outcome:
        """``cell``'s outcome; ``group``: the cells of its ``(backend, workload,
        policy)`` (those not run yet in this process get a copy when the group is
        built). Raises ``TimeoutError`` past ``budget`` real seconds."""
        self._ran.add((cell, seed))
        shared = None
        if cell.backend not in self._forks:
            self._forks[cell.backend] = forks(cell.backend)
        if self._forks[cell.backend]:
            key = (cell.backend, cell.workload, cell.policy, seed, measure_recovery)
            shared = self._groups.get(key)
            if shared is None or cell not in shared.copies:
                if shared is not None:
                    shared.discard()
                    del self._groups[key]
                while len(self._groups) >= MAX_GROUPS:
                    self._groups.pop(next(iter(self._groups))).discard()
                wanted = [c for c in group if (c, seed) not in self._ran or c == cell]
                shared = SharedPrefix(wanted, seed, truth, measure_recovery=measure_recovery)
                asyncio.run(shared.build(budget))
                self._groups[key] = shared
        if shared is not None and cell in shared.copies:
            return shared.resume(cell, budget)
        with scratch_dir("botmesh-cell-") as tmp:
            return asyncio.run(asyncio.wait_for(run_cell(cell, seed, truth, tmp,
                                                         measure_recovery=measure_recovery), budget))

    def close(self) -> None:
        """End every paused copy (end of the session)."""
        for shared in self._groups.values():
            shared.discard()
        self._groups.clear()
