"""Group commit on the embedded backends (issue 16): concurrent writes of different tasks
share one append + fsync (FileKv) or one transaction (SQLiteKv), and nothing of the
compare-and-set contract gives: one winner per version, each write acknowledged only
once durable, a failed fsync or COMMIT failing the whole group with nothing of it
visible, and a power cut inside a group leaving a journal that opens with every
acknowledged write (BACK-4, BACK-5, BACK-6, BACK-7, REPL-1).

No test times anything: grouping is checked by counting fsyncs and COMMITs."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from botmesh.core.errors import BackendUnavailableError, VersionConflict
from botmesh.core.file_kv import FileKv
from botmesh.core.fileio import FileIO
from botmesh.core.group_commit import GroupCommit
from botmesh.core.spi import DurableKv
from botmesh.core.turns import others_runnable
from botmesh.sqlite_store import SQLiteKv, SQLiteStore
from botmesh_testkit.crash.fs import PowerCutIO
from botmesh_testkit.crash.fs.image import materialize

S, SP = "bot", "inbox"


class CountingIO(FileIO):
    """The real file system, counting appends (each one fsync'ed when the kv asks) and
    failing them with ``EIO`` after writing while ``fail`` is set (a failed fsync)."""

    def __init__(self) -> None:
        self.appends: list[int] = []  # log entries per append
        self.fail = False

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        self.appends.append(data.count(b'"seq":'))
        if self.fail:
            self._write_all(fd, data)  # the bytes reached the file, the fsync failed
            raise OSError(errno.EIO, "Input/output error (injected fsync failure)")
        super().append(fd, data, fsync=fsync)


class CommitCountingKv(SQLiteKv):
    """SQLiteKv whose connection counts the COMMITs it runs (sqlite3's trace callback)."""

    commits = 0

    def _connect(self) -> sqlite3.Connection:
        conn = super()._connect()

        def trace(statement: str) -> None:
            if statement.strip().upper() == "COMMIT":
                type(self).commits += 1

        conn.set_trace_callback(trace)
        return conn


def _kv(kind: str, tmp_path: Path, io: FileIO | None = None) -> DurableKv:
    if kind == "sqlite":
        return SQLiteKv(tmp_path / "bot.db")
    return FileKv(tmp_path / "journal.json", append_log=kind == "file+log", io=io)


KINDS = ["file", "file+log", "sqlite"]


# -- grouping happens ---------------------------------------------------------------------------------
@pytest.mark.spec("BACK-4", "BACK-6")
async def test_concurrent_writes_of_eight_tasks_share_one_append_and_fsync(tmp_path: Path) -> None:
    io = CountingIO()
    kv = FileKv(tmp_path / "journal.json", append_log=True, io=io)
    await kv.open()
    io.appends.clear()  # the header written at open
    versions = await asyncio.gather(*(kv.put(S, SP, f"chat-{i}", {"i": i}, expected_version=0) for i in range(8)))
    assert versions == [1] * 8
    assert io.appends == [8], "eight concurrent writes should go out as one append of eight entries"
    kv.abandon()  # as if the process died: only what is on file counts
    again = FileKv(tmp_path / "journal.json", append_log=True)
    await again.open()
    assert {k: v.value for k, v in await again.scan(S, SP)} == {f"chat-{i}": {"i": i} for i in range(8)}
    await again.close()


@pytest.mark.spec("BACK-1", "BACK-6")
async def test_concurrent_writes_of_eight_tasks_share_one_sqlite_commit(tmp_path: Path) -> None:
    kv = CommitCountingKv(tmp_path / "bot.db")
    await kv.open()
    CommitCountingKv.commits = 0
    await asyncio.gather(*(kv.put(S, SP, f"chat-{i}", {"i": i}, expected_version=0) for i in range(8)))
    assert CommitCountingKv.commits == 1
    await kv.close()
    other = SQLiteKv(tmp_path / "bot.db")
    assert len(await other.scan(S, SP)) == 8
    await other.close()


class TracingKv(SQLiteKv):
    """SQLiteKv whose connection records every statement it runs (sqlite3's trace
    callback), first word upper-cased: ``INSERT``, ``BEGIN``, ``COMMIT`` ..."""

    def _connect(self) -> sqlite3.Connection:
        conn = super()._connect()
        self.statements: list[str] = []
        conn.set_trace_callback(lambda statement: self.statements.append(statement.split()[0].upper()))
        return conn


@pytest.mark.spec("BACK-1", "BACK-7")
async def test_a_lone_sqlite_write_is_one_statement_and_a_lost_one_is_decided_in_a_transaction(tmp_path: Path) -> None:
    """Issue 16: a write with no other write to share its commit runs as one statement, its
    own transaction (the raw medium operation), not ``BEGIN IMMEDIATE`` + statement +
    ``COMMIT``; it is on file for another connection at once. A lone write that changes
    nothing (a lost compare-and-set, an ``INSERT`` of a key that exists) is run again in a
    transaction that reads the version it found: ``VersionConflict`` with that version,
    nothing written."""
    kv = TracingKv(tmp_path / "bot.db")
    await kv.open()
    kv.statements.clear()
    assert await kv.put(S, SP, "k", {"i": 1}, expected_version=0) == 1
    assert await kv.put(S, SP, "k", {"i": 2}, expected_version=1) == 2
    await kv.put(S, SP, "gone", {"i": 0}, expected_version=0)
    await kv.delete(S, SP, "gone", expected_version=1)
    assert kv.statements == ["INSERT", "UPDATE", "INSERT", "DELETE"]
    other = SQLiteKv(tmp_path / "bot.db")
    found = await other.get(S, SP, "k")
    assert found is not None and (found.value, found.version) == ({"i": 2}, 2)
    assert await other.get(S, SP, "gone") is None

    kv.statements.clear()
    with pytest.raises(VersionConflict) as lost:
        await kv.put(S, SP, "k", {"i": 9}, expected_version=1)
    assert lost.value.found == 2
    assert kv.statements == ["UPDATE", "BEGIN", "UPDATE", "SELECT", "ROLLBACK"]
    with pytest.raises(VersionConflict) as taken:
        await kv.put(S, SP, "k", {"i": 9}, expected_version=0)
    assert taken.value.found == 2
    with pytest.raises(VersionConflict) as missing:
        await kv.delete(S, SP, "never", expected_version=1)
    assert missing.value.found == 0
    found = await other.get(S, SP, "k")
    assert found is not None and (found.value, found.version) == ({"i": 2}, 2)
    await other.close()
    await kv.close()


class TracingStore(SQLiteStore):
    """SQLiteStore recording the first word of every statement its connection runs."""

    def _connection(self) -> sqlite3.Connection:
        fresh = self._conn is None
        conn = super()._connection()
        if fresh:
            self.statements: list[str] = []
            conn.set_trace_callback(lambda statement: self.statements.append(statement.split()[0].upper()))
        return conn


@pytest.mark.spec("BACK-1")
async def test_a_lone_store_write_is_one_statement_and_concurrent_ones_share_a_transaction(tmp_path: Path) -> None:
    """Issue 16: the store's lone write (a message-log entry, a value) is one statement,
    its own transaction; writes of several tasks at once still share one transaction."""
    store = TracingStore(tmp_path / "bot.db")
    await store.append_message({"chat_id": "c", "text": "hi"})
    store.statements.clear()
    await store.append_message({"chat_id": "c", "text": "again"})
    await store.set("ns", "k", {"v": 1})
    assert store.statements == ["INSERT", "INSERT"]
    store.statements.clear()
    await asyncio.gather(*(store.append_message({"chat_id": f"c{i}", "text": "x"}) for i in range(3)))
    assert store.statements == ["BEGIN", "INSERT", "INSERT", "INSERT", "COMMIT"]
    other = SQLiteStore(tmp_path / "bot.db")
    assert [m["text"] for m in await other.messages()] == ["hi", "again", "x", "x", "x"]
    assert await other.get("ns", "k") == {"v": 1}
    await other.close()
    await store.close()


@pytest.mark.spec("BACK-7")
async def test_a_lone_write_is_flushed_alone_and_sequential_writes_each_pay_their_own(tmp_path: Path) -> None:
    io = CountingIO()
    kv = FileKv(tmp_path / "journal.json", append_log=True, io=io)
    await kv.open()
    io.appends.clear()
    for i in range(3):
        await kv.put(S, SP, "k", {"i": i}, expected_version=i)
    assert io.appends == [1, 1, 1]
    await kv.close()


# -- compare-and-set stays one winner per version --------------------------------------------------
@pytest.mark.spec("BACK-7", "REPL-1")
@pytest.mark.parametrize("kind", KINDS)
async def test_concurrent_cas_on_one_key_has_exactly_one_winner_per_version(kind: str, tmp_path: Path) -> None:
    """Twelve tasks race on one key, each trying the version it last saw (a read, or
    the ``found`` of its last conflict) — so many tries land in one group with the
    same expected version. Every version is won by exactly one task, and the record
    ends at the number of wins with the last winner's value."""
    kv = _kv(kind, tmp_path)
    await kv.open()
    won: dict[int, list[int]] = {}
    last_value: dict[int, dict[str, Any]] = {}

    async def racer(n: int) -> None:
        seen = 0
        for attempt in range(15):
            if attempt % 3 == 0:
                current = await kv.get(S, SP, "contended")
                seen = 0 if current is None else current.version
            value = {"by": n, "try": attempt}
            try:
                version = await kv.put(S, SP, "contended", value, expected_version=seen)
            except VersionConflict as conflict:
                seen = conflict.found  # type: ignore[attr-defined]
                continue
            won.setdefault(version, []).append(n)
            last_value[version] = value
            seen = version

    await asyncio.gather(*(racer(n) for n in range(12)))
    final = await kv.get(S, SP, "contended")
    assert final is not None
    assert sorted(won) == list(range(1, final.version + 1)), "a version was skipped or won twice"
    assert all(len(winners) == 1 for winners in won.values()), {v: w for v, w in won.items() if len(w) > 1}
    assert final.value == last_value[final.version]
    await kv.close()


@pytest.mark.spec("BACK-7")
@pytest.mark.parametrize("kind", KINDS)
async def test_a_group_mixes_wins_and_conflicts_each_reported_to_its_own_writer(kind: str, tmp_path: Path) -> None:
    kv = _kv(kind, tmp_path)
    await kv.open()
    for i in range(4):
        await kv.put(S, SP, f"k{i}", {"v": 1}, expected_version=0)
    outcomes = await asyncio.gather(
        kv.put(S, SP, "k0", {"v": 2}, expected_version=1),   # wins
        kv.put(S, SP, "k1", {"v": 2}, expected_version=5),   # loses: found 1
        kv.delete(S, SP, "k2", expected_version=1),          # wins
        kv.delete(S, SP, "k3", expected_version=2),          # loses
        kv.put(S, SP, "k4", {"v": 1}, expected_version=0),   # wins: new
        return_exceptions=True,
    )
    assert outcomes[0] == 2 and outcomes[2] is None and outcomes[4] == 1
    assert isinstance(outcomes[1], VersionConflict) and isinstance(outcomes[3], VersionConflict)
    got = {k: (v.value, v.version) for k, v in await kv.scan(S, SP)}
    assert got == {"k0": ({"v": 2}, 2), "k1": ({"v": 1}, 1), "k3": ({"v": 1}, 1), "k4": ({"v": 1}, 1)}
    await kv.close()


# -- a failed flush fails the whole group ------------------------------------------------------------
@pytest.mark.spec("BACK-6", "BACK-7")
async def test_a_failed_fsync_fails_every_write_of_the_group_and_none_is_visible(tmp_path: Path) -> None:
    io = CountingIO()
    kv = FileKv(tmp_path / "journal.json", append_log=True, io=io)
    await kv.open()
    for i in range(6):
        await kv.put(S, SP, f"chat-{i}", {"old": i}, expected_version=0)
    size = os.path.getsize(kv.log_path)
    io.fail = True
    io.appends.clear()
    outcomes = await asyncio.gather(
        *(kv.put(S, SP, f"chat-{i}", {"new": i}, expected_version=1) for i in range(6)), return_exceptions=True
    )
    assert io.appends == [6], "the six writes should have been one group"
    assert all(isinstance(o, BackendUnavailableError) for o in outcomes), outcomes
    assert {k: (v.value, v.version) for k, v in await kv.scan(S, SP)} == {
        f"chat-{i}": ({"old": i}, 1) for i in range(6)
    }, "memory shows a write that failed"
    assert os.path.getsize(kv.log_path) == size, "the failed group was not cut from the log"
    io.fail = False
    assert await kv.put(S, SP, "chat-0", {"after": 0}, expected_version=1) == 2
    kv.abandon()
    again = FileKv(tmp_path / "journal.json", append_log=True)
    await again.open()
    got = {k: v.value for k, v in await again.scan(S, SP)}
    assert got == {"chat-0": {"after": 0}, **{f"chat-{i}": {"old": i} for i in range(1, 6)}}
    await again.close()


class _FailingCommits:
    """The sqlite3 connection, with every ``COMMIT`` failing as a disk I/O error while
    ``fail`` is set. A stand-in: a real failing COMMIT needs the FUSE layer, which the
    I/O-error loop of the ``powercuts`` part uses (tests/test_io_errors.py); here the
    point is what the kv does with the error for a whole group."""

    fail = False

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if self.fail and sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class FailingCommitKv(SQLiteKv):
    proxy: _FailingCommits

    def _connect(self) -> sqlite3.Connection:
        self.proxy = _FailingCommits(super()._connect())
        return self.proxy  # type: ignore[return-value]


@pytest.mark.spec("BACK-1", "BACK-7")
async def test_a_failed_sqlite_commit_fails_every_write_of_the_group_and_none_is_visible(tmp_path: Path) -> None:
    kv = FailingCommitKv(tmp_path / "bot.db")
    await kv.open()
    for i in range(5):
        await kv.put(S, SP, f"chat-{i}", {"old": i}, expected_version=0)
    kv.proxy.fail = True
    outcomes = await asyncio.gather(
        *(kv.put(S, SP, f"chat-{i}", {"new": i}, expected_version=1) for i in range(5)),
        kv.put(S, SP, "chat-new", {"new": True}, expected_version=0),
        return_exceptions=True,
    )
    assert all(isinstance(o, BackendUnavailableError) for o in outcomes), outcomes
    assert "group commit of 6 writes" in str(outcomes[0]) and str(tmp_path / "bot.db") in str(outcomes[0])
    kv.proxy.fail = False
    other = SQLiteKv(tmp_path / "bot.db")
    assert {k: (v.value, v.version) for k, v in await other.scan(S, SP)} == {
        f"chat-{i}": ({"old": i}, 1) for i in range(5)
    }
    assert await kv.put(S, SP, "chat-0", {"after": 0}, expected_version=1) == 2
    assert (await other.get(S, SP, "chat-0")) is not None
    await other.close()
    await kv.close()


# -- a power cut inside a group -------------------------------------------------------------------------
class CutDuringGroup(PowerCutIO):
    """Records like PowerCutIO; the first append of more than one line once ``armed`` is
    written but the power goes before its fsync: the crash states are taken then, and
    the append fails (the process is gone: no writer of the group may be acknowledged)."""

    armed = False
    states: list[Any]

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        if self.armed and data.count(b'"seq":') > 1:
            self.armed = False
            super().append(fd, data, fsync=False)
            self.states = list(self.crash_states(subsets=16, seed="group", torn=True))
            raise OSError(errno.EIO, "the power went (simulated)")
        super().append(fd, data, fsync=fsync)


@pytest.mark.spec("BACK-5", "BACK-6", "BACK-7")
async def test_a_power_cut_inside_a_group_acknowledges_nothing_and_every_crash_state_opens(tmp_path: Path) -> None:
    """Eight writes (updates, creates, a delete) are one group; the power goes between
    its append and its fsync. None is acknowledged; every crash state the model gives
    (each prefix, torn at a sector boundary, 16 seeded subsets) opens without
    ``JournalCorruptError``, holds every write acknowledged before, and holds each
    write of the group whole or not at all."""
    work = tmp_path / "work"
    work.mkdir()
    io = CutDuringGroup(work)
    kv = FileKv(work / "journal.json", append_log=True, io=io)
    await kv.open()
    acknowledged: dict[str, tuple[dict[str, Any], int]] = {}
    for i in range(6):
        # values big enough that the group's one write crosses sector boundaries
        value = {"old": i, "pad": "x" * 300}
        await kv.put(S, SP, f"chat-{i}", value, expected_version=0)
        acknowledged[f"chat-{i}"] = (value, 1)
    group: dict[str, tuple[dict[str, Any], int] | None] = {}
    calls = []
    for i in range(5):
        new = {"new": i, "pad": "y" * 300}
        group[f"chat-{i}"] = (new, 2)
        calls.append(kv.put(S, SP, f"chat-{i}", new, expected_version=1))
    group["chat-5"] = None
    calls.append(kv.delete(S, SP, "chat-5", expected_version=1))
    for i in (6, 7):
        group[f"fresh-{i}"] = ({"fresh": i}, 1)
        calls.append(kv.put(S, SP, f"fresh-{i}", {"fresh": i}, expected_version=0))
    io.armed = True
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, BackendUnavailableError) for o in outcomes), "a write of the cut group was acknowledged"
    kv.abandon()
    assert len(io.states) >= 3, "the model gave no crash states to check"
    torn = 0
    for n, state in enumerate(io.states):
        where = materialize(state, tmp_path / f"state-{n}")
        reopened = FileKv(where / "journal.json", append_log=True)
        await reopened.open()  # JournalCorruptError here: a crash state the journal refuses
        got = {k: (v.value, v.version) for k, v in await reopened.scan(S, SP)}
        await reopened.close()
        for key, before in acknowledged.items():
            after = group.get(key, before)
            assert got.get(key) in (before, after), f"state {n} ({state.text}): {key} is {got.get(key)}"
        for key in ("fresh-6", "fresh-7"):
            assert got.get(key) in (None, group[key]), f"state {n}: {key} is {got.get(key)}"
        torn += state.torn is not None
    assert torn, "no crash state tore the group's write: the test lost its point"


# -- the scheduler itself ----------------------------------------------------------------------------
@pytest.mark.spec("BACK-7")
async def test_a_cancelled_leader_still_settles_its_group() -> None:
    flushed: list[list[str]] = []

    def flush(items: list[str]) -> list[str]:
        flushed.append(list(items))
        return [item.upper() for item in items]

    group: GroupCommit[str, str] = GroupCommit(flush)
    leader = asyncio.ensure_future(group.submit("a", lambda: "a"))
    await asyncio.sleep(0)  # the leader is gathering now
    follower = asyncio.ensure_future(group.submit("b", lambda: "b"))
    leader.cancel()
    assert await follower == "B"
    with pytest.raises(asyncio.CancelledError):
        await leader
    # the cancelled leader's own write was flushed all the same (its outcome is unknown
    # to its caller, as for any write given up), and the follower was not left waiting
    assert [item for items in flushed for item in items] == ["a", "b"]


@pytest.mark.spec("BACK-7")
async def test_writes_of_one_key_never_share_a_group() -> None:
    flushed: list[list[str]] = []

    def flush(items: list[str]) -> list[str]:
        flushed.append(list(items))
        return items

    group: GroupCommit[str, str] = GroupCommit(flush)
    order: Callable[[str], Callable[[], str]] = lambda name: (lambda: name)  # noqa: E731
    await asyncio.gather(group.submit("k", order("1")), group.submit("k", order("2")), group.submit("j", order("3")))
    assert flushed == [["1", "3"], ["2"]]


@pytest.mark.spec("BACK-7")
async def test_a_lone_writer_with_nothing_else_runnable_is_flushed_without_a_loop_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 16: the leader gathers other writers only while a loop turn could bring one.
    With nothing else runnable the turn would only resume it — the loop's ``select`` is
    not called at all between the submit and its result."""
    flushed: list[list[str]] = []

    def flush(items: list[str]) -> list[str]:
        flushed.append(list(items))
        return items

    group: GroupCommit[str, str] = GroupCommit(flush)
    loop = asyncio.get_running_loop()
    selects: list[object] = []
    real_select = loop._selector.select  # type: ignore[attr-defined]

    def counting_select(timeout: float | None = None) -> object:
        selects.append(timeout)
        return real_select(timeout)

    monkeypatch.setattr(loop._selector, "select", counting_select)  # type: ignore[attr-defined]
    assert await group.submit("a", lambda: "a") == "a"
    assert selects == [], "the lone writer took loop turns before its flush"
    assert flushed == [["a"]]


@pytest.mark.spec("BACK-7")
async def test_a_lone_writer_gets_its_own_result_or_error_from_its_group_of_one() -> None:
    """The lone writer's group (flushed at once, issue 16) settles as any group: its own
    result, its own failure (an exception instance in the results), the flush's error,
    and a flush that returns the wrong number of results is an error; only flushed
    groups are counted."""
    outcomes: list[Any] = []

    def flush(items: list[str]) -> list[Any]:
        outcome = outcomes.pop(0)
        if isinstance(outcome, OSError):
            raise outcome
        return outcome  # type: ignore[no-any-return]

    group: GroupCommit[str, Any] = GroupCommit(flush)
    outcomes[:] = [["done"], [VersionConflict.at("inbox", "a", 0, 1)], OSError(errno.EIO, "disk"), ["x", "y"]]
    assert await group.submit("a", lambda: "a") == "done"
    with pytest.raises(VersionConflict):
        await group.submit("a", lambda: "a")
    with pytest.raises(OSError, match="disk"):
        await group.submit("a", lambda: "a")
    with pytest.raises(RuntimeError, match="2 results for 1 item"):
        await group.submit("a", lambda: "a")
    assert (group.groups, group.items) == (2, 2)
    assert outcomes == []


@pytest.mark.spec("BACK-7")
async def test_a_timer_due_now_or_a_ready_callback_counts_as_something_else_runnable() -> None:
    loop = asyncio.get_running_loop()
    assert others_runnable() is False
    later = loop.call_later(3600, lambda: None)
    assert others_runnable() is False, "a timer due in an hour is not runnable now"
    due = loop.call_at(loop.time(), lambda: None)
    assert others_runnable() is True
    due.cancel()
    later.cancel()
    soon = loop.call_soon(lambda: None)
    assert others_runnable() is True
    soon.cancel()


# -- the same on the FUSE power-cut file system ----------------------------------------------------------
@pytest.mark.spec("BACK-5", "BACK-6", "BACK-7")
@pytest.mark.parametrize("mode", ["subset", "torn", "drop"])
async def test_power_cuts_during_a_groups_fsync_on_the_fuse_layer_lose_nothing_acknowledged(
    mode: str, tmp_path: Path
) -> None:
    """On the FUSE power-cut file system (where the kernel splits a write at page
    boundaries, so a group's one write may reach the disk in pieces): eight writes of
    ~600 bytes each form one group, its fsync is held, the power is cut (``mode``, 6
    seeds in turn), the held fsync fails. Nothing of the group is acknowledged; the
    journal reopens every time with every acknowledged write, and each write of the
    group whole or not at all — also when the cut kept a later page of the append
    without an earlier one (a hole of zeros: the group is one line of the log, so such
    a hole only ever damages the final line, a torn write)."""
    import threading

    from conftest import require_fuse

    from botmesh_testkit.crash.fs import PowerCutFS, PowerCutUnavailable

    class DiesAtTheCut(FileIO):
        """The real OS calls, until the power is cut: then this process is dead in the
        story, and the kv's undo of its failed append (a truncate) never happens."""

        dead = False

        def truncate(self, fd: int, size: int, *, fsync: bool) -> None:
            if self.dead:
                raise OSError(errno.EIO, "the process died with the power")
            super().truncate(fd, size, fsync=fsync)

    require_fuse()
    io = DiesAtTheCut()
    try:
        mount = PowerCutFS(tmp_path / "fs").mount()
    except PowerCutUnavailable as exc:
        pytest.skip(f"no power-cut file system: {exc}")
    try:
        path = mount.path / "journal.json"
        kv = FileKv(path, append_log=True, io=io)
        await kv.open()
        acknowledged: dict[str, tuple[dict[str, Any], int]] = {}
        all_holes: list[int] = []
        for round_ in range(6):
            for i in range(8):  # acknowledged writes: each its own group, synced
                key = f"chat-{i}"
                version = acknowledged.get(key, ({}, 0))[1]
                value = {"round": round_, "pad": "a" * 600}
                assert await kv.put(S, SP, key, value, expected_version=version) == version + 1
                acknowledged[key] = (value, version + 1)
            rule = mount.hold("fsync", "journal.json.log")
            def cut(round_: int = round_) -> None:
                mount.wait_held()
                io.dead = True
                mount.cut(mode, seed=round_)
                all_holes.append((path.parent / "journal.json.log").read_bytes().count(b"\0"))

            cutter = threading.Thread(target=cut)
            cutter.start()
            group = {f"chat-{i}": {"round": round_, "group": True, "pad": "b" * 600} for i in range(8)}
            outcomes = await asyncio.gather(
                *(kv.put(S, SP, k, v, expected_version=acknowledged[k][1]) for k, v in group.items()),
                return_exceptions=True,
            )
            cutter.join()
            mount.release(rule)
            assert all(isinstance(o, BackendUnavailableError) for o in outcomes), f"round {round_}: {outcomes}"
            kv.abandon()
            io.dead = False
            kv = FileKv(path, append_log=True, io=io)
            await kv.open()  # JournalCorruptError here: a hole in the never-acknowledged group refused
            got = {k: (v.value, v.version) for k, v in await kv.scan(S, SP)}
            for key, (value, version) in acknowledged.items():
                assert got[key] in ((value, version), (group[key], version + 1)), f"round {round_}: {key}"
                acknowledged[key] = got[key]  # a write of the cut group may have landed whole
        await kv.close()
        if mode == "subset":  # the point of the test: holes before complete lines of the group
            assert any(all_holes), "no subset cut left a hole in the group's write"
    finally:
        mount.unmount()


# -- a group is one line: one write, one fsync -------------------------------------------------------
class RecordingIO(CountingIO):
    """CountingIO that also records where each append started and how long it was."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[int, int]] = []

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        self.spans.append((os.fstat(fd).st_size, len(data)))
        super().append(fd, data, fsync=fsync)


@pytest.mark.spec("BACK-4", "BACK-5", "BACK-6")
async def test_a_group_spanning_many_pages_goes_out_as_one_line_by_one_write(tmp_path: Path) -> None:
    """Sixteen concurrent writes of ~900 bytes each (a group spanning four 4 KiB pages
    of the log) are one append — one write, one fsync — of one log line (log version 3,
    a commit); the journal reopens with all sixteen."""
    io = RecordingIO()
    kv = FileKv(tmp_path / "journal.json", append_log=True, io=io)
    await kv.open()
    io.spans.clear()
    io.appends.clear()
    await asyncio.gather(*(kv.put(S, SP, f"k{i}", {"pad": "p" * 900}, expected_version=0) for i in range(16)))
    assert io.appends == [16], io.appends
    ((offset, length),) = io.spans
    data = (tmp_path / "journal.json.log").read_bytes()
    assert length > 3 * 4096 and data[offset:].count(b"\n") == 1 and data.endswith(b"\n")
    kv.abandon()
    again = FileKv(tmp_path / "journal.json", append_log=True)
    await again.open()
    assert len(await again.scan(S, SP)) == 16
    await again.close()


def _commits(first_seq: int, count: int, per_commit: int, pad: int) -> list[bytes]:
    from botmesh.core.file_format import log_commit, log_entry

    lines, seq = [], first_seq
    for _ in range(count):
        entries = []
        for _ in range(per_commit):
            entries.append(log_entry(seq, "put", S, SP, f"k{seq}", 1, ({"n": "x" * pad}, 1, None, None)))
            seq += 1
        lines.append(log_commit(entries))
    return lines


@pytest.mark.spec("BACK-5")
def test_a_hole_in_the_final_commit_cuts_that_whole_commit_and_a_hole_before_it_is_corruption() -> None:
    """What one line per commit buys: a power cut that keeps some pages of a group's one
    unsynced write and loses others (sector-aligned zeros anywhere in it, the rest of it
    complete) damages the log's final line only, which is trimmed as a torn write — all
    of that commit's entries, none of the earlier ones. The same hole before complete
    later lines is refused (BACK-5: a bad line followed by more entries)."""
    from botmesh.core.errors import JournalCorruptError
    from botmesh.core.file_format import LOG_HEADER, SECTOR, scan_log

    earlier = _commits(1, 6, 1, 200)
    final = _commits(7, 1, 12, 700)[0]  # one commit of 12 entries, ~9 KiB
    data = LOG_HEADER + b"".join(earlier) + final
    start = len(data) - len(final)
    first_sector = (start // SECTOR + 1) * SECTOR
    holes = [(start, first_sector)]  # the write's first (partly filled) page lost
    holes += [(b, b + SECTOR) for b in range(first_sector, len(data) - SECTOR, 8 * SECTOR)]  # later pages
    assert len(holes) >= 3
    for a, b in holes:
        scan = scan_log(data[:a] + b"\0" * (b - a) + data[b:], "j.log")
        assert [e.seq for e in scan.entries] == list(range(1, 7)) and scan.good == start, (a, b)
    # the same hole in the commit before the final one is damage in the middle
    before = start - len(earlier[-1])
    sector = (before // SECTOR + 1) * SECTOR
    assert before < sector < start
    with pytest.raises(JournalCorruptError) as info:
        scan_log(data[:sector] + b"\0" * SECTOR + data[sector + SECTOR:], "j.log")
    assert info.value.code == "APPEND_LOG_CORRUPT" and info.value.line == 7  # type: ignore[attr-defined]


# -- a crash of the bot inside a group (crashable) -------------------------------------------------------
@pytest.mark.spec("TEST-1", "TEST-3", "INB-1", "GUAR-2")
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("backend", ["file+log", "sqlite"])
async def test_a_crash_inside_a_group_loses_no_acknowledged_inbound(backend: str, when: str, tmp_path: Path) -> None:
    """Eight chats deliver at once, so their ``inbox.journal`` writes form one group; the
    bot dies before / right after the 4th of them. The engine runs a handler only once
    its inbound's journal write was acknowledged: after the restart every inbound whose
    handler started in the dead incarnation is answered."""
    from botmesh.core.provider import InboundEvent
    from botmesh_testkit.backends import resolve
    from botmesh_testkit.crash import World

    handled: list[str] = []

    def setup(bot: Any) -> None:
        async def answer(ctx: Any) -> None:
            handled.append(ctx.text)
            await ctx.reply(f"ok {ctx.text}")

        bot.otherwise(answer)

    world = World(resolve(backend)(str(tmp_path)), setup=setup)
    bot = await world.start(crash=True)
    assert world.crashable is not None
    inner = world.crashable.inner
    group = (inner.file_kv if backend == "file+log" else inner.kv)._group  # type: ignore[attr-defined]
    flushes, items = group.groups, group.items
    world.crashable.arm(when, "inbox.journal", 4)
    events = [InboundEvent(id=f"m{i}", chat_id=f"c{i}", text=f"m{i}") for i in range(8)]
    await world.drive(asyncio.gather(*(bot.provider.deliver(e) for e in events), return_exceptions=True))
    assert world.crashed
    assert group.items - items > group.groups - flushes >= 1, "the inbox writes did not share a flush"
    taken = list(handled)
    assert len(taken) == (3 if when == "before" else 7), taken  # the 4th died; after it, the group's others landed
    await world.restart()
    await world.drain()
    answered = set(world.channel.texts())
    assert {f"ok {m}" for m in taken} <= answered, f"acknowledged {taken}, answered {sorted(answered)}"
    await world.close()
