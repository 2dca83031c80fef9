"""I/O errors beneath the driver (INB-8, INB-2, INB-3): the I/O-error loop of the
``powercuts`` part fails every file-system operation of a short workload once, in turn,
on the FUSE file system; the bot must fail closed, lose nothing and apply nothing in
part. And the engine bug it found: a journal write failing while an inbound is settled
escaped ``Provider.deliver``."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require_fuse

from botmesh.core import Bot, MemoryDurability
from botmesh.core.errors import BackendUnavailableError
from botmesh_testkit.backends import MemoryHarness
from botmesh_testkit.crash import World

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")
PROFILE = 'description = "the I/O-error loop only"\nworkloads = ["one-send"]\nkills = 0\nio_errors = true\n'


class _CompleteFailsOnce(MemoryDurability):
    """The inbox's completion cannot be written, once."""

    failed = False

    async def inbox_complete(self, *args: Any, **kwargs: Any) -> bool:
        if not self.failed:
            self.failed = True
            raise BackendUnavailableError("disk I/O error (injected)")
        return await super().inbox_complete(*args, **kwargs)


@pytest.mark.spec("INB-2", "INB-3", "INB-8")
async def test_a_failed_settle_is_an_error_event_and_the_sweep_finishes_the_inbound() -> None:
    """Journaled, handled, and then its completion could not be written: deliver() still
    reports the event taken (it is in the journal), an ``error`` event says what
    failed, and after the lease the sweep finishes it — the reply sent once."""
    harness = MemoryHarness()
    harness.backend = _CompleteFailsOnce()

    async def opened() -> Any:
        return harness.backend, harness.store

    def setup(bot: Bot) -> None:
        @bot.when("hi")
        async def hi(ctx: Any) -> None:
            await ctx.reply("hello")

    from botmesh.core import MemoryStore

    harness.store = MemoryStore()
    harness.open = opened  # type: ignore[method-assign]
    world = World(harness, setup=setup)
    await world.start()
    assert await world.receive("c1", "hi", id="m1") is True
    assert [e["stage"] for e in world.named("error")] == ["inbox.settle"]
    await world.drain()
    assert world.channel.texts() == ["hello"]
    assert world.bot is not None and world.bot.durability is not None
    assert [r.state for r in await world.bot.durability.inbox.list()] == ["done"]
    await world.close()


@pytest.mark.spec("INB-8", "INB-2", "GUAR-1", "GUAR-2", "OUT-1")
def test_every_io_of_the_workload_failed_once_loses_nothing_on_the_embedded_backends(pytester: pytest.Pytester) -> None:
    require_fuse()
    pytester.makefile(".toml", io=PROFILE)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=file", "--botmesh-backend=file+log",
                                           "--botmesh-backend=sqlite", "--botmesh-parts=powercuts",
                                           "--botmesh-matrix=io.toml", "--botmesh-seed=2", "--botmesh-require-powercuts")
    out = result.stdout.str()
    assert result.ret == 0, out[-4000:]
    result.assert_outcomes(passed=3)
    for backend in ("file", "file+log", "sqlite"):
        result.stdout.fnmatch_lines([f"*I/O-error loop on {backend}: passed*",
                                     "*failed once each, in turn: *; faults that fired: *; outcomes that broke a "
                                     "guarantee: 0*"])


LEAKY_ENGINE = '''
from botmesh.core.engine import DurabilityRuntime
from botmesh.core.records import InboxRecord


async def admit(self, event):
    """The engine before the I/O-error loop found it: a journal write failing while the
    inbound is settled escapes deliver()."""
    now = self._now()
    record = InboxRecord(id=event.id, kind=event.kind, chat_id=event.chat_id, event=self._serialize_event(event),
                         state="leased", attempts=1, token=1, owner=self.instance_id, incarnation=self.incarnation,
                         lease_until=now + self.config.inbox.lease_ms, claimed_at=now, created_at=now, updated_at=now)
    try:
        stored, created = await self.backend.inbox_journal(self.scope, record)
    except Exception as exc:
        self.bot.forget_seen(event.id)
        await self.bot.emit("error", {"error": exc, "stage": "inbox.journal", "id": event.id})
        return False
    if created:
        await self._execute(stored, event)
    return True


DurabilityRuntime.admit = admit
'''


@pytest.mark.spec("INB-8", "INB-2")
def test_an_engine_whose_deliver_raises_on_an_io_error_is_caught(pytester: pytest.Pytester) -> None:
    """The bug the loop found, planted again: the loop fails naming INB-8 and the
    operation, with a rerun command."""
    require_fuse()
    pytester.makefile(".toml", io=PROFILE)
    pytester.makeconftest(LEAKY_ENGINE)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=sqlite", "--botmesh-parts=powercuts",
                                           "--botmesh-matrix=io.toml", "--botmesh-seed=2", "--botmesh-require-powercuts")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-4000:]
    result.stdout.fnmatch_lines(["*I/O-error loop on sqlite: FAILED*", "*operation #* failing with EIO:*",
                                 "*violated [[]INB-8, INB-2[]] operation #* failing made Provider.deliver raise *",
                                 "*rerun: pytest --botmesh-backend=sqlite*io-errors*"])


SWALLOWING = '''
"""Planted: file journals that catch the OSError of a failed write and report success."""
import os

from botmesh.core.file_backend import FileKv
from botmesh.core.fileio import FileIO


class FsyncErrorsIgnored(FileIO):
    """Writes, then fsyncs; an fsync that fails is taken for done (the "fsyncgate" bug)."""

    def append(self, fd, data, *, fsync):
        self._write_all(fd, data)
        if fsync:
            try:
                os.fsync(fd)
            except OSError:
                pass


class WriteErrorsIgnored(FileIO):
    """Every write primitive that fails is taken for done."""

    def _quietly(self, name, *args, **kwargs):
        try:
            getattr(super(), name)(*args, **kwargs)
        except OSError:
            pass

    def write_file(self, path, data, *, fsync):
        self._quietly("write_file", path, data, fsync=fsync)

    def replace(self, src, dst):
        self._quietly("replace", src, dst)

    def fsync_dir(self, directory):
        self._quietly("fsync_dir", directory)


def fsync_errors_ignored(workdir):
    return FileKv(os.path.join(workdir, "journal.json"), append_log=True, io=FsyncErrorsIgnored())


def write_errors_ignored(workdir):
    return FileKv(os.path.join(workdir, "journal.json"), io=WriteErrorsIgnored())
'''


@pytest.mark.spec("INB-8", "INB-1", "GUAR-1", "GUAR-2")
def test_a_journal_that_swallows_a_failed_write_or_fsync_is_caught(pytester: pytest.Pytester) -> None:
    """A kv that catches the ``OSError`` and reports the write done: the engine
    dispatches as if it were durable, and the power cut that follows each run of the loop
    shows what it lost — a log whose failed fsync left a hole no longer opens, a snapshot
    whose failed rewrite was taken for done comes back older than acknowledged. (Without
    the cut the page cache hides the first: the loop passed it before it cut.)"""
    require_fuse()
    pytester.makefile(".toml", io=PROFILE)
    pytester.makepyfile(swallowing=SWALLOWING)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=swallowing:fsync_errors_ignored",
                                           "--botmesh-backend=swallowing:write_errors_ignored",
                                           "--botmesh-parts=powercuts", "--botmesh-matrix=io.toml", "--botmesh-seed=2",
                                           "--botmesh-require-powercuts")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-4000:]
    result.stdout.fnmatch_lines([
        "*I/O-error loop on swallowing:fsync_errors_ignored: FAILED*",
        "*violated [[]INB-3, GUAR-1, INB-8[]] after a power cut right after operation #* failed, the backend no longer "
        "opens on what it had made durable: JournalCorruptError(*journal.json.log: damaged append-log entry*",
    ])
    result.stdout.fnmatch_lines([
        "*I/O-error loop on swallowing:write_errors_ignored: FAILED*",
        "*violated [[]INB-1, GUAR-1, GUAR-2, INB-8[]] a power cut right after operation #* failed: 1 acknowledged "
        "inbound record(s) not as acknowledged: 'm1' changed: *state 'done' -> 'leased'*",
    ])
    assert out.count("INB-8 in 1 item(s)") == 2 and out.count("verdict: not certified") == 2, out[-3000:]

