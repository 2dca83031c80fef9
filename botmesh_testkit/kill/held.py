"""The held-operation sweep: a death *inside* a backend's multi-step write, at every one of
its writes, truncates and renames in turn.

The kill loops kill between whole operations (at a marker) or at a random delay; a backend
that rewrites its file in place (truncate, then write), or compacts a log (write a new
file, rename it over the old one, delete the old one), is rarely caught in the middle.
Here the power-cut file system (:mod:`botmesh_testkit.crash.fs`) *holds* the n-th
``write``, ``truncate`` or ``rename`` (:data:`HELD_OPS`) the bot's process makes on its
storage, the parent SIGKILLs that process while the operation waits, and then, drawn from
the seed for each point, either

* ``kill`` — only the process died: the held operation is cancelled (it never lands) and
  everything the process did before it stays, unsynced or not (the page cache of a machine
  that kept its power). This is the state an in-place rewrite gets wrong: truncated, not yet
  rewritten; or
* ``drop`` — the power went too: a ``drop`` power cut, the storage holds only what was made
  durable before the held operation.

Each point runs the same short workload (:data:`HELD_MESSAGES` messages, two replies each,
the kill loop's handler) on a fresh, empty storage directory, so point n is the n-th
operation of the workload from the backend's first open on. A first run without faults
(the *census*, on the mount too) counts the workload's operations: when there are at most
``points`` of them every one is a point, else ``points`` of them spread evenly from the
first to the last. After the death a new process starts on what is left, gets every
message not acknowledged again (the channel redelivers) and drains; the delivery ledger
and the journal are judged with the kill loop's rules (:func:`~botmesh_testkit.checker.judge.judge`)
against a run without kills on SQLite: an acknowledged message that was lost, a reply sent
twice or never, a record left unsettled — each a violation naming the ids it breaks and
the messages it concerns, under the point (operation, path, ``kill``/``drop``) it
followed.

The operation counts vary a little between runs (a lease renewed, a poll): a point past
the end of this run's workload is reported as not reached (the sweep stops there), never
as a failure. Server backends (PostgreSQL, Redis) are not swept: their storage is written
by the server's process, not the bot's (:mod:`.powercut_server` cuts their power at every
kill instead).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import KillSpec
from ..backends.registry import resolve
from ..checker.judge import KillOracle
from ..crash.fs.mount import HeldOp, PowerCutFS, PowerCutMount, PowerCutStats
from .loop import KillLoop
from .parent import Incarnation, Run
from .powercut import PowerCutHarnessError, harness_faults, storage_on_workdir
from .result import KillInfo, KillResult
from .spec import HarnessError

__all__ = ["AFTER", "HELD_MESSAGES", "HELD_OPS", "HeldPoint", "HeldSweepRun", "held_op_sweep", "sweep_points"]

HELD_OPS = "write|truncate|rename"
"""The operations a point holds (counted together: the n-th of any of them)."""

HELD_MESSAGES = 3
"""Messages of the sweep's workload (each answered with two replies)."""

SHOWN_POINTS = 3
SHOWN_VIOLATIONS = 8
"""How many failing points, and violations of each, a report lists in full."""

AFTER = ("kill", "drop")
"""What follows the death at a held operation (module docstring), drawn per point."""


def sweep_points(operations: int, points: int) -> list[int]:
    """The operation numbers to hold: every one of ``operations`` when there are at most
    ``points``, else ``points`` of them spread evenly from the first to the last."""
    if operations <= 0 or points <= 0:
        return []
    if operations <= points:
        return list(range(1, operations + 1))
    if points == 1:
        return [1]
    return sorted({1 + round(i * (operations - 1) / (points - 1)) for i in range(points)})


@dataclass
class HeldPoint:
    """One point of the sweep: the ``n``-th operation, the one held (``None``: the
    workload ended before it), what followed the death, and the judged run."""

    n: int
    after: str
    held: HeldOp | None
    result: KillResult | None
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.result is None or self.result.passed

    def describe(self) -> str:
        if self.n == 0:
            return "#0: the workload without any fault (the census run) already"
        if self.held is None:
            return f"#{self.n}: not reached"
        then = ("then a power cut (drop: only what was durable)" if self.after == "drop"
                else "then nothing more (the held operation never lands; the page cache keeps the rest)")
        return f"#{self.n} held {self.held.op} {self.held.path}, the process SIGKILLed, {then}"


@dataclass
class HeldSweepRun:
    """The sweep's outcome: the census's count, every point, the file system's counters."""

    backend: str
    policy: str
    seed: int
    operations: int
    wanted: int
    points: list[HeldPoint]
    stats: PowerCutStats
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.points)

    @property
    def violated_ids(self) -> set[str]:
        return {i for p in self.points if p.result is not None for i in p.result.violated_ids}

    @property
    def failed(self) -> list[HeldPoint]:
        return [p for p in self.points if not p.passed]

    def report(self) -> str:
        reached = [p for p in self.points if p.held is not None]
        after = {a: sum(1 for p in reached if p.after == a) for a in AFTER}
        verdict = ("passed" if self.passed else "FAILED without any fault (the census run)"
                   if any(p.n == 0 for p in self.points) else f"FAILED at {len(self.failed)} of {len(reached)} point(s)")
        spread = ("every one" if len(self.points) >= self.operations else
                  f"{len(self.points)} spread over them")
        lines = [
            f"held-operation sweep on {self.backend}, on_ambiguous={self.policy}, seed {self.seed}: {verdict} "
            f"({self.seconds:.1f} s)",
            f"  held operations: {len(reached)} (of held_ops = {self.wanted}); the workload ({HELD_MESSAGES} messages) "
            f"made {self.operations} {HELD_OPS.replace('|', '/')} operation(s): {spread}; after the death: "
            f"{after['kill']} process death(s) only, {after['drop']} power cut(s) (drop)",
        ]
        ops: dict[str, int] = {}
        for p in reached:
            assert p.held is not None
            ops[p.held.op] = ops.get(p.held.op, 0) + 1
        if ops:
            lines.append("  held: " + ", ".join(f"{op} {c}" for op, c in sorted(ops.items())))
        lines.extend(f"  note: {n}" for n in self.notes)
        # an acknowledged message lost (GUAR-1) first: the worst a point can show
        failed = sorted(self.failed, key=lambda p: ("GUAR-1" not in _ids(p), p.n))
        for p in failed[:SHOWN_POINTS]:
            assert p.result is not None
            lines.append(f"  point {p.describe()}: FAILED")
            violations = p.result.violations
            lines.extend(f"    violated {v}" for v in violations[:SHOWN_VIOLATIONS])
            if len(violations) > SHOWN_VIOLATIONS:
                lines.append(f"    ... and {len(violations) - SHOWN_VIOLATIONS} more violation(s)")
        if len(failed) > SHOWN_POINTS:
            lines.append(f"  ... and {len(failed) - SHOWN_POINTS} more failing point(s): "
                         + "; ".join(f"#{p.n} ({p.after}) {', '.join(sorted(_ids(p)))}"
                                     for p in sorted(failed[SHOWN_POINTS:], key=lambda p: p.n)))
        if not self.passed:
            lines.append(f"  violated ids: {', '.join(sorted(self.violated_ids))}")
        return "\n".join(lines)


def _ids(point: HeldPoint) -> set[str]:
    return point.result.violated_ids if point.result is not None else set()


class _PointLoop(KillLoop):
    """One point: the workload on fresh storage, its ``nth`` operation held, the process
    killed there, ``after`` applied, a new process drains, judged (:class:`KillLoop`'s
    rules). ``nth=None``: the census (no hold, no kill; counts the operations)."""

    def __init__(self, spec: KillSpec, *, mount: PowerCutMount, sub: str, nth: int | None, after: str,
                 cut_seed: int, **kwargs: Any) -> None:
        # a generous cycle: a point not reached in time is skipped (noted), not failed
        super().__init__(spec, kills=1, label="held-operation sweep", cycle_timeout=60.0, **kwargs)
        self.mount = mount
        self.sub = sub
        self.nth = nth
        self.after = after
        self.cut_seed = cut_seed
        self.held: HeldOp | None = None
        self.operations = 0
        self.cut_note = ""
        self.oracle_used: KillOracle | None = None

    def reproduce(self) -> str:
        return (f"the held-operation sweep's point #{self.nth} (seed {self.seed}): rerun the powercuts part with "
                "the command below")

    def _ops(self) -> int:
        counts = self.mount.stats().ops
        return sum(counts.get(op, 0) for op in HELD_OPS.split("|"))

    def _oracle(self) -> KillOracle | None:
        self.oracle_used = super()._oracle()
        return self.oracle_used

    def _main(self, spec: KillSpec, oracle: KillOracle | None, started: float) -> KillResult:
        run = self._new_run(spec, "run")
        run.add_messages(self.messages)
        notes: list[str] = []
        if self.nth is None:  # the census
            before = self._ops()
            inc, problem = self._settle(run, None, deadline=time.monotonic() + self.drain_timeout)
            if problem or inc is None:
                raise HarnessError(f"the held-operation sweep's run without faults did not settle: {problem}")
            run.stop(inc)
            self.operations = self._ops() - before
            return self._conclude(run, spec, oracle, [], notes, started, 0.0, None, None)
        rule = self.mount.hold(HELD_OPS, f"{self.sub}/*", nth=self.nth)
        inc = self._start(run, None)
        held = self._until_held(run, inc)
        kills: list[KillInfo] = []
        if held is None:
            self.mount.release(rule)  # drops the rule (or lets an operation held just now go on)
            if inc.alive:
                run.stop(inc)
            self._crashed(inc)  # a clean stop ended "stopped"; only a crash of its own raises
            return self._conclude(run, spec, oracle, kills, notes, started, 0.0, None, None)
        self.held = held
        point = f"held {held.op} {held.path} (operation #{self.nth})"
        inc.killed_at = time.monotonic()
        try:
            os.kill(inc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # it dies only once its held operation is answered
        if self.after == "drop":
            report = self.mount.cut("drop", seed=self.cut_seed)
            self.cut_note = (f"power cut (drop): {report.dropped} of {report.unsynced_ops} unsynced operation(s) "
                             "lost")
        else:
            self.mount.cancel(rule)
            self.cut_note = "process death only: the held operation never landed, the rest stayed"
        run.kill(inc, point)
        info = KillInfo(inc.n, "held", f"{point}; {self.cut_note}", f"operation #{self.nth}")
        kills.append(info)
        return self._conclude(run, spec, oracle, kills, notes, started, time.monotonic() - started,
                              inc.killed_at, info)

    def _until_held(self, run: Run, inc: Incarnation) -> HeldOp | None:
        """Feed the workload and wait until the rule holds an operation (returned), or the
        workload settled, or the child died by itself, or the cycle's time ran out
        (``None``)."""
        deadline = inc.started + self.cycle_timeout
        fed = False
        next_status = 0.0
        while True:
            run.pump(0.01)
            held = self.mount.poll_held()
            if held is not None:
                return held
            if not inc.alive or time.monotonic() > deadline:
                return None
            if inc.ready_at is not None and not fed:
                run.feed(inc, run.unacked())
                fed = True
            if fed and run.nacked:
                run.refeed_nacked(inc)
            if fed and not run.unacked() and not inc.stop_requested and time.monotonic() >= next_status:
                next_status = time.monotonic() + 0.05
                status = run.request(inc, "status", timeout=0.5)
                if status is not None and status.get("settled") and not run.unacked():
                    # settled: the clean stop (the backend closed) is the workload's last part
                    inc.stop_requested = True
                    run.send(inc, ("stop",))


def _unstartable(point: _PointLoop, exc: HarnessError) -> KillResult:
    """A point whose next process could not start on what the death left."""
    from ..checker.judge import Accounting
    from ..checker.violation import Violation

    tail = str(exc)[-1200:]
    return KillResult(
        backend=point.spec.name, policy=point.policy, seed=point.seed, params=dict(point._kw), kills=[],
        self_deaths=0, incarnations=len(point.runs[-1].incarnations) if point.runs else 0, messages=0, acked=0,
        feeds=0, deliveries=0, distinct_keys=0, inbox_states={}, outbox_states={},
        violations=[Violation(("GUAR-1", "INB-3", "OUT-1"), f"the backend does not start on what the death left of "
                                                             f"its storage: {tail}")],
        accounting=Accounting(), seconds=0.0, kill_phase_seconds=0.0, reproduce=point.reproduce(), label=point.label)


def held_op_sweep(backend: str, *, points: int, seed: int, policy: str, workdir: str,
                  messages: int = HELD_MESSAGES, start_method: str = "forkserver") -> HeldSweepRun | str:
    """Sweep up to ``points`` held operations of ``backend``'s workload (module
    docstring), each on fresh storage on one power-cut mount under ``workdir``. Returns
    the sweep, or the reason it does not apply (the storage is not under the workdir).
    Raises :class:`~botmesh_testkit.crash.fs.mount.PowerCutUnavailable` when nothing can
    be mounted, :class:`~.powercut.PowerCutHarnessError` when the file system fails (its
    server died: named, never blamed on the backend) and
    :class:`~botmesh_testkit.kill.spec.HarnessError` when a child cannot run at all."""
    started = time.monotonic()
    fs = PowerCutFS(os.path.join(workdir, "fs"))
    with fs.mount() as mount, harness_faults(mount, "the held-operation sweep ran"):
        return _sweep(mount, backend, points=points, seed=seed, policy=policy, workdir=workdir, messages=messages,
                      start_method=start_method, started=started)


def _sweep(mount: PowerCutMount, backend: str, *, points: int, seed: int, policy: str, workdir: str, messages: int,
           start_method: str, started: float) -> HeldSweepRun | str:
    def storage(sub: str) -> str:
        path = mount.path / sub
        path.mkdir()
        mount.sync()  # the directory the harness hands over is the testkit's: durable
        return str(path)

    def loop(sub: str, nth: int | None, after: str, oracle: bool | KillOracle) -> _PointLoop:
        spec = resolve(backend)(storage(sub)).kill_spec()
        assert spec is not None
        return _PointLoop(spec, mount=mount, sub=sub, nth=nth, after=after, cut_seed=rng.randrange(2**31),
                          messages=messages, seed=seed, on_ambiguous=policy, oracle=oracle,
                          workdir=os.path.join(workdir, "points", sub), start_method=start_method)

    probe = resolve(backend)(str(mount.path / "probe")).kill_spec()
    if probe is None or not storage_on_workdir(probe, str(mount.path / "probe")):
        return f"backend {backend}: its storage is not under the workdir (a held operation there would not be its)"
    rng = random.Random(f"{seed}/{backend}/{policy}/held-ops")
    census = loop("census", None, "none", True)
    first = census.run()
    run = HeldSweepRun(backend, policy, seed, census.operations, points, [], mount.stats(), 0.0)
    if not first.passed:  # the backend fails the workload without any fault: nothing to sweep
        run.points.append(HeldPoint(0, "none", None, first, "the run without faults (the census)"))
        run.seconds = time.monotonic() - started
        return run
    oracle = census.oracle_used
    if not census.operations:
        return (f"backend {backend}: its workload made no {HELD_OPS.replace('|', '/')} operation under the workdir; "
                "its storage is elsewhere")
    for n in sweep_points(census.operations, points):
        after = rng.choice(AFTER)
        point = loop(f"p{n}", n, after, oracle if oracle is not None else True)
        try:
            result = point.run()
        except HarnessError as exc:
            died = mount.server_died(f"the held-operation sweep's point #{n} ran")
            if died is not None or point.held is None:
                raise
            # a child that dies at once on what the death left: the backend cannot open it
            result = _unstartable(point, exc)
        if point.held is None:
            run.points.append(HeldPoint(n, after, None, None))
            run.notes.append(f"operation #{n} not reached: this time the workload ended before it "
                             f"(the census counted {census.operations}); the sweep stops there")
            break
        run.points.append(HeldPoint(n, after, point.held, result, point.cut_note))
    run.stats = mount.stats()
    problems = [*run.stats.internal_errors, *run.stats.model_errors, *mount.check()]
    if problems:
        raise PowerCutHarnessError(f"the power-cut file system disagrees with itself: {problems[:5]}")
    run.seconds = time.monotonic() - started
    return run
