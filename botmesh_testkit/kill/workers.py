"""Real concurrency: N worker processes on one backend at once, started together behind a
barrier, each running a seeded workload, what each saw and wrote sent back to the parent
(issue 12, "real concurrency for real claims").

The conformance suite's items for ``multi_process`` (and anything else that must show a
race *between processes* — the explore part, a benchmark) run their workload here::

    from botmesh_testkit.kill.workers import Worker, run_workers

    async def increments(w: Worker) -> list[int]:      # module level: the child imports it
        ...                                              # w.kv / w.backend, w.rng, await w.barrier()
        return versions                                  # plain, picklable data

    run = run_workers(SQLiteSpec("/tmp/x.db"), increments, processes=4, seed=7, params={...})
    for outcome in run.outcomes: ...                     # value, or error + traceback, per worker

* **The target** each worker builds in its own process: a
  :class:`~botmesh_testkit.backends.base.KillSpec` (what a harness's ``kill_spec()`` gives,
  a third party's ``module:factory`` included) is built with
  :func:`~botmesh_testkit.kill.spec.build_backend` and started (``w.backend``; ``w.kv``
  is its ``DurableKv`` when it is a ``KvDurability``); a zero-argument callable (the kv
  suite's ``kv_factory``) gives a new, unopened ``DurableKv`` that the worker opens
  (``w.kv``; ``w.backend`` is None). Both are pickled with dill (closures by value,
  modules by reference): the child imports the modules they name, with the parent's
  ``sys.path`` appended to its own.
* **Start together**: every worker opens its backend first, then waits at the barrier;
  the workload starts when all have arrived. ``await w.barrier()`` inside a workload
  lines the workers up again (every worker must call it equally often). A worker that
  fails breaks the barrier, so the others fail at once instead of waiting.
* **Seeded**: ``w.rng`` is ``random.Random(f"{seed}/{index}")``. The interleaving of the
  processes is the operating system's, never the seed's: a check over the results must
  hold for *every* interleaving, and never depend on a race actually happening.
* **Results**: the workload's return value, pickled back through a pipe; an exception is
  sent back as its type, message, traceback and the stage it happened in (``load``,
  ``open``, ``workload``, ``close``), and the worker's exit code is kept.
* **Bounded**: after ``timeout`` seconds the workers still running are SIGKILLed and
  reported as ``timed_out``; every worker is gone (psutil) when :func:`run_workers`
  returns.

Processes start from the kill loops' ``multiprocess`` context (``forkserver`` by default,
the testkit and the built-in backends preloaded; never ``fork``), so a start costs a fork
of an idle server, not an interpreter start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import DurableKv

from ..backends.base import KillSpec
from .childproc import _child_pickler
from .parent import _gone, _mp_context
from .spec import HarnessError, build_backend

__all__ = ["Worker", "WorkerOutcome", "WorkerTarget", "Workload", "WorkersRun", "run_workers"]

WorkerTarget = KillSpec | Callable[[], DurableKv]
"""What each worker builds in its own process: a :class:`KillSpec` (a durability backend,
started), or a zero-argument callable giving a new, unopened ``DurableKv``."""


class Worker:
    """What a workload gets, inside its worker process."""

    def __init__(self, index: int, processes: int, seed: int, params: Any, barrier: Any, timeout: float) -> None:
        self.index = index
        """0-based number of this worker."""
        self.processes = processes
        """How many workers run the workload."""
        self.seed = seed
        self.params = params
        """The ``params`` given to :func:`run_workers` (the same for every worker)."""
        self.rng = random.Random(f"{seed}/{index}")
        """This worker's own seeded random numbers."""
        self.backend: DurabilityBackend | None = None
        """The started durability backend (a :class:`KillSpec` target), else None."""
        self.kv: DurableKv | None = None
        """The open ``DurableKv``: the callable target's, or the backend's own when it is a
        ``KvDurability``; else None."""
        self.store: Any = None
        self._barrier = barrier
        self._deadline = time.monotonic() + timeout

    @property
    def pid(self) -> int:
        return os.getpid()

    async def barrier(self) -> None:
        """Wait until every worker has called this as often; raises
        ``threading.BrokenBarrierError`` when a worker failed or the run timed out. The
        wait runs in a thread, so the worker's event loop (a pool's background tasks)
        keeps running."""
        left = max(0.1, self._deadline - time.monotonic())
        await asyncio.to_thread(self._barrier.wait, left)


Workload = Callable[[Worker], Awaitable[Any]]
"""``async def workload(worker) -> result``: defined at module level (or a closure dill
can pickle); its result must be picklable."""


@dataclass
class WorkerOutcome:
    """What became of one worker."""

    index: int
    pid: int | None = None
    value: Any = None
    """The workload's return value (when ``ok``)."""
    error: str | None = None
    """``"<stage>: <Type>: <message>"`` when the worker failed (``load``: its
    configuration could not be unpickled; ``open``: its backend could not be built or
    opened; ``workload``; ``close``), or what else ended it (timed out, died)."""
    traceback: str | None = None
    exitcode: int | None = None
    timed_out: bool = False
    done: bool = field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done


@dataclass
class WorkersRun:
    """The outcomes of one :func:`run_workers`, in worker order, and how long it took."""

    outcomes: list[WorkerOutcome]
    seconds: float

    @property
    def failures(self) -> list[WorkerOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def values(self) -> list[Any]:
        """Every worker's result, in worker order (only meaningful when no worker failed)."""
        return [o.value for o in self.outcomes]

    def first_error(self) -> str:
        """The first failed worker's error, on one line (empty when none failed)."""
        for o in self.failures:
            return f"worker {o.index}: {o.error if o.error is not None else 'ended without a result'}"
        return ""

    def describe_failures(self, tail: int = 12) -> str:
        """The failed workers, one paragraph each, with the end of their traceback."""
        out = []
        for o in self.failures:
            tb = "".join((o.traceback or "").splitlines(keepends=True)[-tail:])
            first = o.error if o.error is not None else "ended without a result"
            out.append(f"worker {o.index} (pid {o.pid}, exit code {o.exitcode}): {first}" + (f"\n{tb}" if tb else ""))
        return "\n".join(out)


@dataclass
class _Config:
    """Everything one worker needs; pickled with dill into it."""

    index: int
    processes: int
    seed: int
    target: Any
    workload: Any
    params: Any
    timeout: float


def _dumps(cfg: _Config) -> bytes:
    """Pickle a worker's configuration as the kill loops pickle a child's: dill, closures by
    value with only the globals they use, every module by reference."""
    import io

    buf = io.BytesIO()
    _child_pickler()(buf, recurse=True).dump(cfg)
    return buf.getvalue()


def run_workers(
    target: WorkerTarget,
    workload: Workload,
    *,
    processes: int = 4,
    seed: int = 0,
    params: Any = None,
    timeout: float = 60.0,
    start_method: str = "forkserver",
) -> WorkersRun:
    """Run ``workload`` in ``processes`` worker processes on ``target`` at once (see the
    module docstring) and return what each one reported. Synchronous: from async code,
    ``await asyncio.to_thread(run_workers, ...)``. Raises :class:`HarnessError` when the
    harness itself cannot run (the target or workload cannot be pickled, a process cannot
    start); a worker's own failure is in its :class:`WorkerOutcome`, never raised."""
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes!r}")
    ctx = _mp_context(start_method)
    barrier = ctx.Barrier(processes)
    blobs = []
    for index in range(processes):
        try:
            blobs.append(_dumps(_Config(index, processes, seed, target, workload, params, timeout)))
        except Exception as exc:
            raise HarnessError(
                f"cannot pickle the workers' configuration: {type(exc).__name__}: {exc} (the target "
                f"{target!r} and the workload {getattr(workload, '__qualname__', workload)!r} must be picklable "
                "with dill: a KillSpec, a module-level function, or a closure over picklable values)"
            ) from exc
    started = time.monotonic()
    deadline = started + timeout
    outcomes = [WorkerOutcome(i) for i in range(processes)]
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        for index, blob in enumerate(blobs):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, args=(blob, child_conn, barrier, list(sys.path)),
                               name=f"botmesh-worker-{index}", daemon=True)
            try:
                proc.start()
            except Exception as exc:
                raise HarnessError(f"cannot start worker {index}: {type(exc).__name__}: {exc}") from exc
            finally:
                child_conn.close()
            outcomes[index].pid = proc.pid
            procs.append(proc)
            conns.append(parent_conn)
        _collect(procs, conns, outcomes, barrier, deadline, timeout)
    finally:
        _reap(procs, outcomes, barrier)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()
    return WorkersRun(outcomes, time.monotonic() - started)


def _collect(procs: list[Any], conns: list[Any], outcomes: list[WorkerOutcome], barrier: Any, deadline: float,
             timeout: float) -> None:
    """Read each worker's report until all reported or ended, or the deadline."""
    from multiprocess.connection import wait

    pending = set(range(len(procs)))
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = wait([conns[i] for i in pending], left)
        for i in list(pending):
            if conns[i] not in ready:
                continue
            out = outcomes[i]
            try:
                msg = conns[i].recv()
            except (EOFError, OSError):
                out.error = out.error or "the worker ended without a result (it died, or was killed)"
                pending.discard(i)
                barrier.abort()  # the others must not wait for it
                continue
            except Exception as exc:  # the result cannot be unpickled here
                out.error = f"result: its value cannot be read back: {type(exc).__name__}: {exc}"
                pending.discard(i)
                continue
            if msg[0] == "result":
                out.value = msg[1]
                out.done = True
            else:
                _, stage, summary, tb = msg
                out.error = f"{stage}: {summary}"
                out.traceback = tb
                barrier.abort()
            pending.discard(i)
    for i in pending:
        outcomes[i].timed_out = True
        outcomes[i].error = f"did not finish within {timeout:g} s (killed)"
    if pending:
        barrier.abort()


def _reap(procs: list[Any], outcomes: list[WorkerOutcome], barrier: Any) -> None:
    """Kill whatever still runs, join every worker and make sure it is gone."""
    for index, proc in enumerate(procs):
        out = outcomes[index]
        proc.join(0.0 if out.timed_out else 5.0)  # one that reported is on its way out
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(10.0)
        outcomes[index].exitcode = proc.exitcode
        if proc.pid is not None:
            limit = time.monotonic() + 5
            while not _gone(proc.pid, None) and time.monotonic() < limit:
                time.sleep(0.01)


# =========================================================================================
# Inside the worker
# =========================================================================================
def _worker_main(blob: bytes, conn: Any, barrier: Any, sys_path: list[str]) -> None:
    """The worker's main: load the configuration, run the workload on a fresh event
    loop, send back its result or its error, exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in a terminal is for the parent
    for entry in sys_path:  # modules a test's sys.path makes importable (a third party's)
        if entry not in sys.path:
            sys.path.append(entry)
    stage = ["load"]
    try:
        import dill

        cfg: _Config = dill.loads(blob)
        value = asyncio.run(_worker_async(cfg, barrier, stage))
        try:
            conn.send(("result", value))
        except Exception as exc:
            stage[0] = "result"
            raise TypeError(f"the workload's result cannot be pickled: {exc}") from exc
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        with contextlib.suppress(Exception):
            conn.send(("error", stage[0], f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(0)


async def _worker_async(cfg: _Config, barrier: Any, stage: list[str]) -> Any:
    w = Worker(cfg.index, cfg.processes, cfg.seed, cfg.params, barrier, cfg.timeout)
    close: Callable[[], Awaitable[None]] | None = None
    stage[0] = "open"
    if isinstance(cfg.target, KillSpec):
        built = await build_backend(cfg.target)
        await built.backend.start()
        w.backend, w.store = built.backend, built.store
        inner = getattr(built.backend, "kv", None)
        w.kv = inner if isinstance(inner, DurableKv) else None

        async def close_backend() -> None:
            await built.backend.stop()
            if built.close is not None:
                await built.close()

        close = close_backend
    else:
        kv = cfg.target()
        if not isinstance(kv, DurableKv):
            raise TypeError(f"the kv factory returned {type(kv).__name__}, not a DurableKv")
        await kv.open()
        w.kv = kv
        close = kv.close
    try:
        await w.barrier()  # every worker has its backend open: start together
        stage[0] = "workload"
        value = await cfg.workload(w)
    except BaseException:
        with contextlib.suppress(Exception):
            await close()
        raise
    stage[0] = "close"
    await close()
    return value
