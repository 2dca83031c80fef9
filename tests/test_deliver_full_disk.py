"""``Provider.deliver`` never raises for a journal failure (INB-8, issue 13): it returns
False when the inbound could not be journaled (the channel redelivers, and the
redelivery is processed), True once it was — whatever fails afterwards is an ``error``
event and the sweep finishes the record (INB-2, INB-3).

* On the power-cut file system (real FUSE, beneath SQLite's C code and the file
  backend's OS calls): a **full disk** — every write, create and fsync failing with
  ``ENOSPC`` until space is freed — while a message arrives; then ``ENOSPC`` at each
  write and fsync of a message's life, one at a time. File, file+log and SQLite.
* Without FUSE: the same full disk through ``botmesh.core.fileio`` (the
  ``FullDisk`` of its docstring), and journal writes of a third party's backend
  raising its own exception (an ``OSError``, a ``RuntimeError``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from botmesh.core import Bot, InboundEvent, MemoryDurability
from botmesh.core.file_backend import FileDurability
from botmesh.core.fileio import FileIO
from conftest import require_fuse

from botmesh_testkit.backends import HARNESSES, BackendHarness
from botmesh_testkit.crash import World
from botmesh_testkit.crash.fs import PowerCutFS, PowerCutMount

FULL_OPS = ("write", "create", "fsync")
"""What fails on a full disk: data written, a new file, an fsync flushing delayed
allocations."""


def _setup(bot: Bot) -> None:
    @bot.when("hi")
    async def hi(ctx: Any) -> None:
        await ctx.reply("hello")


async def _deliver(w: World, id: str) -> Any:
    """What ``deliver`` returned, or the exception it raised (the failure under test)."""
    assert w.bot is not None
    try:
        return await w.drive(w.bot.provider.deliver(InboundEvent(id=id, chat_id="c1", text="hi")))
    except Exception as exc:  # noqa: BLE001 - returned for the assertion to name it
        return exc


async def _settled_once(w: World, id: str) -> None:
    """After the disk has space again: the channel redelivers until the bot takes the
    event, the bot settles it, and the reply went out exactly once — or, when the failure
    left the send in flight, is accounted for as ambiguous.

    A file journal whose failed append could not be undone (the truncation's fsync
    failed too) refuses every call until it is reopened (``FileKv``'s rule: the log may
    end in a partial line). When the redeliveries keep being refused, the bot is
    restarted once, as an operator would, and the channel redelivers again."""
    for attempt in range(6):
        if attempt == 3:
            await w.restart()
        taken = await _deliver(w, id)
        assert taken is True or taken is False, f"deliver() raised {taken!r} after the disk was freed"
        if taken:
            break
    else:
        raise AssertionError(f"{id}: still refused after the disk was freed and the bot restarted")
    await w.drain()
    d = w.bot.durability if w.bot is not None else None
    assert d is not None
    record = await d.backend.inbox_get(d.scope, id)
    assert record is not None and record.state == "done", f"{id}: {record!r}"
    sent = w.channel.texts().count("hello")
    ambiguous = [e for e in w.named("durability:ambiguous") if e["key"].startswith(f"{id}:")]
    assert sent == 1 or (sent == 0 and ambiguous), f"{id}: the reply went out {sent} times (ambiguous: {ambiguous})"


def _fill(m: PowerCutMount, sub: str, count: int = 400) -> None:
    """A full disk under ``sub``: the next ``count`` writes, creates and fsyncs there
    fail with ENOSPC (each rule fires once, on the next matching operation)."""
    for op in FULL_OPS:
        for _ in range(count):
            m.fail(op, f"{sub}/*", nth=1, errno=errno.ENOSPC)


@pytest.fixture
def mount(tmp_path: Path) -> Any:
    require_fuse()
    with PowerCutFS(tmp_path / "fs").mount() as m:
        yield m


def _world(m: PowerCutMount, backend: str, sub: str) -> World:
    storage = m.path / sub
    os.makedirs(storage)
    harness: BackendHarness = HARNESSES[backend](str(storage))
    return World(harness, setup=_setup)


@pytest.mark.spec("INB-8", "INB-2", "INB-3", "GUAR-1")
@pytest.mark.parametrize("backend", ["file", "file+log", "sqlite", "events", "events-shared+log"])
async def test_a_message_arriving_on_a_full_disk_is_refused_and_taken_once_space_is_back(
        mount: PowerCutMount, backend: str) -> None:
    """INB-8: with the disk full, ``deliver`` returns False (never raises), an ``error``
    event names the journal write that failed, nothing is dispatched; once space is
    freed the redelivery is processed and answered once."""
    w = _world(mount, backend, "full")
    try:
        await w.start()
        await w.clock.settle()
        _fill(mount, "full")
        taken = await _deliver(w, "m1")
        fired = len(mount.stats().faults)
        mount.clear()
        assert fired > 0, "no ENOSPC fired: the journal write did not reach the disk"
        assert taken is False, f"deliver() on a full disk: {taken!r} (must return False, never raise)"
        assert [e["stage"] for e in w.named("error")][:1] == ["inbox.journal"], w.named("error")
        assert w.channel.texts() == []
        await _settled_once(w, "m1")
    finally:
        await w.close()


@pytest.mark.spec("INB-8", "INB-2", "INB-3", "OUT-1")
@pytest.mark.parametrize("backend", ["file", "file+log", "sqlite", "events", "events-shared+log"])
async def test_enospc_at_each_write_of_a_message_never_makes_deliver_raise(mount: PowerCutMount, backend: str) -> None:
    """INB-8, INB-2: ``ENOSPC`` at the n-th write or fsync of a message's life, for every
    n: ``deliver`` returns True or False, never raises; then the message is settled and
    answered once (or accounted for as ambiguous)."""
    tried = 0
    for op in ("write", "fsync"):
        for nth in range(1, 200):
            sub = f"{op}-{nth}"
            w = _world(mount, backend, sub)
            try:
                await w.start()
                await w.clock.settle()  # the first sweep pass is done: the n-th operation is the message's
                before = len(mount.stats().faults)
                mount.fail(op, f"{sub}/*", nth=nth, errno=errno.ENOSPC)
                taken = await _deliver(w, "m1")
                await w.drain()
                fired = len(mount.stats().faults) > before
                mount.clear()
                assert taken is True or taken is False, f"{op} #{nth} failing with ENOSPC made deliver() raise {taken!r}"
                if not fired:
                    break  # the message's life has fewer such operations: all were tried
                tried += 1
                await _settled_once(w, "m1")
            finally:
                await w.close()
    assert tried >= 2, f"only {tried} operations were failed: the workload did not reach the disk"


class _FullDisk(FileIO):
    """The file backend's OS layer on a disk that fills up and is freed again."""

    full = False

    def _check(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def write_file(self, path: str, data: bytes, *, fsync: bool) -> None:
        self._check()
        super().write_file(path, data, fsync=fsync)

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        self._check()
        super().append(fd, data, fsync=fsync)


class _InjectedHarness(BackendHarness):
    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.backend = backend
        from botmesh.core import MemoryStore

        self.store = MemoryStore()

    async def open(self) -> Any:
        return self.backend, self.store

    async def reopen(self) -> Any:
        return self.backend, self.store

    async def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            await close()


@pytest.mark.spec("INB-8", "INB-3")
@pytest.mark.parametrize("append_log", [False, True], ids=["file", "file+log"])
async def test_a_full_disk_through_fileio_is_a_refusal_not_an_exception(tmp_path: Path, append_log: bool) -> None:
    """INB-8 without FUSE: the file backend's writes failing with ENOSPC (the
    ``FullDisk`` of :mod:`botmesh.core.fileio`) make ``deliver`` return False; freed,
    the redelivery is processed once."""
    io = _FullDisk()
    backend = await FileDurability.open(tmp_path / "j.json", append_log=append_log, io=io)
    w = World(_InjectedHarness(backend), setup=_setup)
    try:
        await w.start()
        io.full = True
        assert await _deliver(w, "m1") is False
        assert [e["stage"] for e in w.named("error")] == ["inbox.journal"]
        io.full = False
        await _settled_once(w, "m1")
    finally:
        await w.close()


class _ThirdPartyFailure(MemoryDurability):
    """A backend whose journal writes raise its own exceptions while ``failing``."""

    failing: BaseException | None = None

    async def inbox_journal(self, *args: Any, **kwargs: Any) -> Any:
        if self.failing is not None:
            raise self.failing
        return await super().inbox_journal(*args, **kwargs)


@pytest.mark.spec("INB-8")
@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("driver bug")],
                         ids=["OSError", "RuntimeError"])
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
async def test_a_journal_write_raising_any_exception_is_a_refusal(error: BaseException, fail_open: bool) -> None:
    """INB-8: whatever a backend's journal write raises — not only the project's
    errors — ``deliver`` returns False (fail closed, nothing dispatched) or, with
    ``fail_open``, True with the handler run without a journal record."""
    backend = _ThirdPartyFailure()
    w = World(_InjectedHarness(backend), setup=_setup, durability={"fail_open": fail_open})
    try:
        await w.start()
        backend.failing = error
        taken = await _deliver(w, "m1")
        assert taken is fail_open, f"deliver() returned {taken!r}"
        assert [e["error"] for e in w.named("error")] == [error]
        assert w.channel.texts() == (["hello"] if fail_open else [])
        backend.failing = None
        if not fail_open:
            await _settled_once(w, "m1")
    finally:
        await w.close()
