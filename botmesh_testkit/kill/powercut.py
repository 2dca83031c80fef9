"""The power-cut loop: the kill loop with the backend's storage on the power-cut file
system (:mod:`botmesh_testkit.crash.fs`) and a power cut at every kill.

SIGKILL alone leaves the operating system's page cache intact, so a backend that never
calls ``fsync`` survives every kill loop. Here each kill is followed by a power cut
before the next incarnation starts: the mount then shows only what the backend made
durable. The cuts rotate through the three variants of the model, each seeded — drop
every unsynced change, keep a random subset of them, tear the last unsynced write — and
the delivery ledger (outside the mount) and the journals are judged with the kill
loop's rules (:func:`botmesh_testkit.checker.judge.judge`).

Applies to backends whose storage lives in the harness's workdir (``file``,
``file+log``, ``sqlite``, a factory taking the workdir): :func:`storage_on_workdir`.
Backends on a server (PostgreSQL, Redis) need a private server whose data directory is
on the mount: :mod:`.powercut_server` (:func:`~.powercut_server.power_cut_server_loop`).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..backends.base import FactorySpec, FileSpec, KillSpec, SQLiteSpec
from ..backends.registry import resolve
from ..crash.fs.mount import PowerCutError, PowerCutFS, PowerCutMount, PowerCutStats
from .loop import KillLoop
from .result import KillResult

CUT_MODES = ("drop", "subset", "torn")
"""The variants a loop rotates through, one per kill."""


def storage_on_workdir(spec: KillSpec | None, workdir: str) -> bool:
    """Whether a backend's storage lives under ``workdir`` (so a file system mounted
    there holds it)."""
    if isinstance(spec, (FileSpec, SQLiteSpec)):
        return os.path.abspath(spec.path).startswith(os.path.abspath(workdir) + os.sep)
    if isinstance(spec, FactorySpec):
        return any(isinstance(a, str) and os.path.abspath(a) == os.path.abspath(workdir) for a in spec.args)
    return False


class PowerCutHarnessError(PowerCutError):
    """The power-cut file system itself failed (its server died, its model disagreed
    with the mount): a fault of the harness, never of the backend under test."""


@dataclass
class PowerCutRun:
    """A power-cut loop's result: the kill loop's, the cuts made and what they dropped,
    and the file system's counters."""

    result: KillResult
    cuts: list[str]
    dropped_ops: int
    stats: PowerCutStats

    @property
    def passed(self) -> bool:
        return self.result.passed

    def report(self) -> str:
        lines = self.result.report().splitlines()
        lines.insert(1, f"  power cuts: {len(self.cuts)} ({', '.join(f'{m} {self.cuts.count(m)}' for m in CUT_MODES)}); "
                        f"{self.dropped_ops} unsynced operation(s) lost in all; fsyncs seen: {self.stats.fsyncs} "
                        f"(+{self.stats.fdatasyncs} fdatasync, {self.stats.dir_fsyncs} of directories)")
        return "\n".join(lines)


def power_cut_loop(backend: str, *, cuts: int, messages: int, seed: int, policy: str, workdir: str,
                   start_method: str = "forkserver") -> PowerCutRun | str:
    """Run ``cuts`` kills, each followed by a power cut, of a bot on ``backend`` whose
    storage is on a fresh power-cut mount under ``workdir``. Returns the run, or the
    reason it does not apply (the storage is not under the workdir). Raises
    :class:`~botmesh_testkit.crash.fs.mount.PowerCutUnavailable` when nothing can be
    mounted and :class:`PowerCutHarnessError` when the file system fails."""
    fs = PowerCutFS(os.path.join(workdir, "fs"))
    with fs.mount() as mount:
        with harness_faults(mount, "the power-cut loop ran"):
            return _power_cut_loop(mount, backend, cuts=cuts, messages=messages, seed=seed, policy=policy,
                                   workdir=workdir, start_method=start_method)


@contextmanager
def harness_faults(mount: PowerCutMount, doing: str) -> Iterator[None]:
    """Turn whatever goes wrong while the FUSE server is dead (a child that crashed on
    ``ENOTCONN``, a request to the server, an ``OSError`` of the harness on the mount)
    into :class:`PowerCutHarnessError` naming the server's death, and a failure of the
    layer itself (:class:`PowerCutError`) into one too: neither is the backend's."""
    try:
        yield
        died = mount.server_died(doing)
    except PowerCutHarnessError:
        raise
    except Exception as exc:
        died = mount.server_died(doing)
        if died is not None:
            raise PowerCutHarnessError(str(died)) from exc
        if isinstance(exc, PowerCutError):
            raise PowerCutHarnessError(f"the power-cut file system failed while {doing}: {exc}") from exc
        raise
    if died is not None:
        raise PowerCutHarnessError(str(died))


def _power_cut_loop(mount: PowerCutMount, backend: str, *, cuts: int, messages: int, seed: int, policy: str,
                    workdir: str, start_method: str) -> PowerCutRun | str:
    storage = str(mount.path / "storage")
    os.makedirs(storage, exist_ok=True)
    mount.sync()  # the directory the harness is given exists for good: the testkit's, not the bot's
    # the spec only: opening the backend here would write through the mount from this process
    spec = resolve(backend)(storage).kill_spec()
    if spec is None or not storage_on_workdir(spec, storage):
        return f"backend {backend}: its storage is not under the workdir (a power cut of the mount would not reach it)"
    rng = random.Random(f"{seed}/{backend}/{policy}/powercuts")
    made: list[str] = []
    dropped = [0]

    def cut(n: int) -> str:
        mode = CUT_MODES[(n - 1) % len(CUT_MODES)]
        try:
            report = mount.cut(mode, seed=rng.randrange(2**31))
        except PowerCutError as exc:
            raise PowerCutHarnessError(f"the power-cut file system failed at cut {n}: {exc}") from exc
        made.append(mode)
        dropped[0] += report.dropped
        return f"power cut ({mode}): {report.dropped} of {report.unsynced_ops} unsynced operation(s) lost"

    loop = KillLoop(spec, kills=cuts, messages=messages, seed=seed, on_ambiguous=policy,
                    workdir=os.path.join(workdir, "loop"), after_kill=cut, label="power-cut loop",
                    start_method=start_method)
    result = loop.run()
    stats = mount.stats()
    problems = [*stats.internal_errors, *stats.model_errors, *mount.check()]
    if problems:
        raise PowerCutHarnessError(f"the power-cut file system disagrees with itself: {problems[:5]}")
    if not stats.ops.get("write"):
        return (f"backend {backend}: nothing was written under the workdir during the loop; its storage is "
                "elsewhere, a power cut of the mount does not reach it")
    return PowerCutRun(result, made, dropped[0], stats)


def probe_claims(backend: str) -> bool:
    """Whether ``backend`` claims ``survives_crash`` (opened on a scratch directory, off
    the mount)."""
    with tempfile.TemporaryDirectory(prefix="botmesh-powercut-probe-") as tmp:
        harness = resolve(backend)(tmp)

        async def caps() -> bool:
            try:
                await harness.open()
                return bool(harness.capabilities.survives_crash)
            finally:
                await harness.close()

        return asyncio.run(caps())
