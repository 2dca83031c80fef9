"""The I/O-error loop (SQLite's ``ioerr.test`` is the model): every file-system
operation of a short workload fails once, in turn, beneath the backend's driver, and the
bot must fail closed and recover.

For a backend whose storage lives in its workdir, the workload runs once on the
power-cut file system (:mod:`botmesh_testkit.crash.fs`) to count the operations it makes
after the bot started; then, for each n, a fresh copy of the backend runs it with the
n-th operation failing with ``EIO``; right after the workload the process dies **and the
power goes** (a ``drop`` cut: the mount keeps what was made durable), and the backend
reopened there must hold every record it had acknowledged
(:func:`~botmesh_testkit.checker.journal.lost_writes`, INB-8: a backend that swallows a
failed write or fsync and reports success loses that write, which without the cut the
page cache would hide). Then it is restarted (the fault has cleared: it fires once) and
gets the channel's redeliveries, as in a crash-matrix cell. Judged with the matrix's
history check against a crash-free run (nothing admitted lost, every send exactly once
or accounted for as ambiguous, nothing unsettled, no part applied without the rest —
INB-8: a refused inbound is not dispatched and is redelivered), and the backend still
opens after it. A fault that reaches the bot is an ``error`` event; one the driver
absorbs (SQLite retries some reads and opens) is counted, not blamed: what matters is
that nothing it did was lost or applied in part, which the check sees.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from dataclasses import dataclass, field

from ..backends.registry import resolve
from ..checker.history import check
from ..checker.journal import Journal, lost_writes, read_journal
from ..checker.violation import Violation
from ..crash.world import World
from ..crash.fs.faults import FAULT_OPS
from ..crash.fs.mount import PowerCutFS, PowerCutMount
from .cells import Cell, Oracle, Outcome
from .run import make_world, oracle, play, recover
from .workloads import WORKLOADS

WORKLOAD = "one-send"
"""The workload each fault runs (one message, one reply: every journal write of a
message's life, few enough operations to fail each of them)."""


@dataclass
class IoErrorRun:
    """The loop's outcome: operations counted, faults that fired, the outcomes that
    broke a guarantee (with the operation number each one failed)."""

    backend: str
    operations: int
    fired: int
    surfaced: int = 0
    """Faults that fired and reached the bot as an ``error`` event (the others the
    driver absorbed, e.g. SQLite retrying a read: not a failure of the bot's)."""
    failed: list[tuple[int, Outcome]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failed

    def violated_ids(self) -> list[str]:
        return sorted({i for _, o in self.failed for v in o.violations for i in v.ids})

    def report(self) -> str:
        lines = [f"I/O-error loop on {self.backend}: {'passed' if self.passed else 'FAILED'} ({self.seconds:.1f} s)",
                 f"  operations of workload {WORKLOAD!r} failed once each, in turn: {self.operations}; "
                 f"faults that fired: {self.fired} ({self.surfaced} reported as an 'error' event, the others absorbed by "
                 f"the driver); outcomes that broke a guarantee: {len(self.failed)}"]
        for n, outcome in self.failed[:10]:
            lines.append(f"  operation #{n} failing with EIO:")
            lines.extend(f"    violated {v}" for v in outcome.violations)
            lines.append(f"    delivered: {outcome.deliveries}")
        if len(self.failed) > 10:
            lines.append(f"  ... and {len(self.failed) - 10} more")
        return "\n".join(lines)


def _operations(mount: PowerCutMount) -> int:
    ops = mount.stats().ops
    return sum(ops.get(op, 0) for op in FAULT_OPS)


async def _one(mount: PowerCutMount, backend: str, sub: str, truth: Oracle, seed: int, nth: int | None,
               policy: str) -> tuple[Outcome, int, bool, bool]:
    """Run the workload on a fresh backend under ``mount/sub``, the ``nth`` operation
    after the bot started failing (None: nothing fails). Returns the checked outcome, the
    operations counted, whether the fault fired and whether the bot reported an
    ``error``."""
    w = WORKLOADS[WORKLOAD]
    storage = mount.path / sub
    os.makedirs(storage, exist_ok=True)
    mount.sync()  # the set-up (this directory) is durable; the backend's own files are its business
    world = make_world(resolve(backend)(str(storage)), w, policy, seed)
    cell = Cell(backend, WORKLOAD, policy, "before", f"io#{nth or 0}", nth or 0)
    try:
        await world.start()
        before_ops, before_faults = _operations(mount), len(mount.stats().faults)
        if nth is not None:
            mount.fail("*", f"{sub}/*", nth=nth, errno=errno.EIO)
        raised: Exception | None = None
        try:
            await play(world, w)
        except Exception as exc:  # deliver() must refuse (False) or take the event, never raise
            raised = exc
        counted = _operations(mount) - before_ops
        mount.clear()
        fired = len(mount.stats().faults) > before_faults
        outcome = Outcome(cell, crashed=False, crash_point=None)
        surfaced = bool(world.named("error"))
        if raised is not None:
            outcome.violations.append(Violation(("INB-8", "INB-2"), f"operation #{nth} failing made Provider.deliver "
                                                                   f"raise {raised!r}: a channel adapter gets an "
                                                                   "exception instead of the refusal it can act on"))
        lost = await _power_cut(world, mount, nth)
        outcome.violations.extend(lost)
        if any(v.message.startswith(_NO_REOPEN) for v in lost):
            return outcome, counted, fired, surfaced
        try:
            await recover(world, w)
        except Exception as exc:  # the backend does not reopen on what the failed operation left
            outcome.violations.append(Violation(("INB-3", "GUAR-1"), f"after operation #{nth} failed, the backend "
                                                                    f"no longer opens: {exc!r}"))
            return outcome, counted, fired, surfaced
        outcome.deliveries = [(m.chat_id, str(m.content.get("text"))) for m in world.channel.sent]
        await check(world, truth, outcome)
        return outcome, counted, fired, surfaced
    finally:
        await world.close()


_NO_REOPEN = "after a power cut right after"


async def _power_cut(world: World, mount: PowerCutMount, nth: int | None) -> list[Violation]:
    """The process dies and the power goes right after the workload (the failed operation
    in it): the journals the backend had acknowledged are read from it first, then the
    mount keeps only what was made durable (a ``drop`` cut) and the backend is opened on
    that; every acknowledged record must be there (:func:`~..checker.journal.lost_writes`
    with INB-8: a failure the backend did not report loses the write). A backend that
    cannot list its journals after a failed write (it refuses everything until reopened)
    is judged by the recovery alone."""
    assert world.bot is not None and world.bot.durability is not None
    d = world.bot.durability
    scope, live = d.scope, d.backend
    await world.bot.abandon()
    try:
        acknowledged: Journal | None = await read_journal(live, scope)
    except Exception:  # refuses until reopened (a write it could not undo): nothing to compare
        acknowledged = None
    mount.cut("drop")
    what = f"operation #{nth} failed" if nth else "the workload"
    try:
        backend, _ = await world.harness.reopen()
        await backend.start()
        reopened = await read_journal(backend, scope)
    except Exception as exc:
        return [Violation(("INB-3", "GUAR-1", "INB-8"), f"{_NO_REOPEN} {what}, the backend no longer opens on what it "
                                                        f"had made durable: {exc!r}")]
    if acknowledged is None:
        return []
    return lost_writes(acknowledged, reopened, where=f"a power cut right after {what}", extra_ids=("INB-8",))


async def io_error_loop(backend: str, *, seed: int, workdir: str, policy: str = "skip") -> IoErrorRun | str:
    """Fail every operation of the workload once, in turn (see the module docstring).
    Returns the run, or why it does not apply (the storage is not under the workdir)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="botmesh-io-oracle-") as tmp:
        truth = await oracle(backend, WORKLOAD, seed, tmp)
    with PowerCutFS(os.path.join(workdir, "fs")).mount() as mount:
        dry, total, _, _ = await _one(mount, backend, "dry", truth, seed, None, policy)
        if not total:
            return (f"backend {backend}: the workload made no file-system operation under the workdir; its storage "
                    "is elsewhere")
        result = IoErrorRun(backend, total, 0)
        if not dry.passed:
            result.failed.append((0, dry))
        for nth in range(1, total + 1):
            outcome, _, fired, surfaced = await _one(mount, backend, f"io-{nth}", truth, seed, nth, policy)
            result.fired += fired
            result.surfaced += fired and surfaced
            if not outcome.passed:
                result.failed.append((nth, outcome))
    result.seconds = time.monotonic() - started
    return result
