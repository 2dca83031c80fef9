"""Tests of the file durability backend: ``botmesh.core.file_backend`` (FileKv,
FileDurability) over ``botmesh.core.fileio``.

Spec ids checked: the BACK table row of ``FileDurability`` (survives a crash; a lock file
rejects a second live process and a second ``open()`` in the same process), BACK-4
(append log, compaction, leftover log replayed), BACK-5 (damaged journals rejected at
open, torn last line trimmed, ``APPEND_LOG_CORRUPT`` with file/line/byte), BACK-6
(fsync) and BACK-7 (a backend is a ``DurableKv`` agreeing with ``MemoryKv``).

Async code runs through ``asyncio.run`` inside plain test functions. Nothing sleeps: a
child process reports readiness on a pipe.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REFERENCE_IMPL = Path(__file__).resolve().parent.parent / "reference_impl"
try:  # the package may not be installed when the tests run from a checkout
    import botmesh  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    sys.path.insert(0, str(REFERENCE_IMPL))

from botmesh.core.errors import (
    BackendUnavailableError,
    ConfigError,
    JournalCorruptError,
    JournalLockedError,
    VersionConflict,
)
from botmesh.core.file_backend import FileDurability, FileKv
from botmesh.core.fileio import FileIO, default_io
from botmesh.core.records import InboxRecord
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities, DurableKv, Versioned

T = TypeVar("T")
S = "scope-a"
INF = math.inf


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine to completion (there is no pytest-asyncio here)."""
    return asyncio.run(coro)


async def opened(path: Path | str, **options: Any) -> FileKv:
    """A FileKv on ``path``, opened."""
    kv = FileKv(path, **options)
    await kv.open()
    return kv


async def dump(kv: DurableKv, spaces: tuple[tuple[str, str], ...] = ((S, "inbox"), (S, "outbox"))) -> dict[str, Any]:
    """Everything a reader can see in ``spaces``: records with versions, both indexes."""
    result: dict[str, Any] = {}
    for scope, space in spaces:
        rows = await kv.scan(scope, space, limit=10_000)
        result[f"{scope}/{space}"] = {
            "records": [(key, found.value, found.version) for key, found in rows],
            "due": await kv.range(scope, space, "due", upto=INF, limit=10_000),
            "expires": await kv.range(scope, space, "expires", upto=INF, limit=10_000),
        }
    return result


def read_snapshot(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_bytes())
    return doc


def log_lines(path: Path) -> list[dict[str, Any]]:
    log = Path(str(path) + ".log")
    return [json.loads(line) for line in log.read_bytes().splitlines()]


def snapshot_text(log_seq: int, rows: list[list[Any]]) -> bytes:
    """A snapshot file in the documented format, written by hand."""
    return json.dumps({"format": "botmesh.file_kv", "version": 1, "log_seq": log_seq, "records": rows}).encode()


def put_line(
    seq: int, key: str, version: int, value: dict[str, Any], due: float | None = None, space: str = "inbox"
) -> bytes:
    """An append-log put entry written by hand."""
    entry = {
        "seq": seq,
        "op": "put",
        "scope": S,
        "space": space,
        "key": key,
        "version": version,
        "due": due,
        "expires": None,
        "value": value,
    }
    return (json.dumps(entry) + "\n").encode()


def del_line(seq: int, key: str, version: int, space: str = "inbox") -> bytes:
    """An append-log delete entry written by hand."""
    entry = {"seq": seq, "op": "del", "scope": S, "space": space, "key": key, "version": version}
    return (json.dumps(entry) + "\n").encode()


def files_of(directory: Path) -> dict[str, bytes]:
    """Name -> content of every file in ``directory``."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REFERENCE_IMPL), env.get("PYTHONPATH")]))
    return env


async def build_journal(path: Path) -> None:
    """A journal with both files: a snapshot holding ``base`` (log_seq 0) and a log with
    three puts (seq 1..3, keys k1..k3), left behind by a process that died."""
    kv = await opened(path)
    await kv.put(S, "inbox", "base", {"n": 0}, expected_version=0)
    await kv.close()
    kv = await opened(path, append_log=True)
    for i in (1, 2, 3):
        await kv.put(S, "inbox", f"k{i}", {"n": i}, expected_version=0, due=float(i))
    kv.abandon()


class FaultIO(FileIO):
    """A FileIO with one-shot faults, armed by a test after ``open()``."""

    def __init__(self) -> None:
        self.append_fault: OSError | None = None
        self.torn = False  # write half the line before failing the append
        self.truncate_fault: OSError | None = None
        self.write_file_fault: OSError | None = None
        self.fsync_dir_fault: OSError | None = None

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        if self.append_fault is not None:
            fault, self.append_fault = self.append_fault, None
            if self.torn:
                super().append(fd, data[: len(data) // 2], fsync=False)
            raise fault
        super().append(fd, data, fsync=fsync)

    def truncate(self, fd: int, size: int, *, fsync: bool) -> None:
        if self.truncate_fault is not None:
            fault, self.truncate_fault = self.truncate_fault, None
            raise fault
        super().truncate(fd, size, fsync=fsync)

    def write_file(self, path: str, data: bytes, *, fsync: bool) -> None:
        if self.write_file_fault is not None:
            fault, self.write_file_fault = self.write_file_fault, None
            raise fault
        super().write_file(path, data, fsync=fsync)

    def fsync_dir(self, directory: str) -> None:
        if self.fsync_dir_fault is not None:
            fault, self.fsync_dir_fault = self.fsync_dir_fault, None
            raise fault
        super().fsync_dir(directory)


class SpyIO(FileIO):
    """A FileIO recording the calls that decide durability."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def write_file(self, path: str, data: bytes, *, fsync: bool) -> None:
        self.calls.append(("write_file", (os.path.basename(path), fsync)))
        super().write_file(path, data, fsync=fsync)

    def replace(self, src: str, dst: str) -> None:
        self.calls.append(("replace", (os.path.basename(src), os.path.basename(dst))))
        super().replace(src, dst)

    def fsync_dir(self, directory: str) -> None:
        self.calls.append(("fsync_dir", None))
        super().fsync_dir(directory)

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        self.calls.append(("append", fsync))
        super().append(fd, data, fsync=fsync)


# ---------------------------------------------------------------------------------------
# Round trips, leftover log, compaction (BACK-4)
# ---------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-4")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
def test_round_trip_after_close_and_reopen(tmp_path: Path, append_log: bool) -> None:
    """BACK-4, BACK table: every committed write (puts, replacements, index moves,
    deletes) is there after close() and a reopen, with or without the append log; close()
    folds the log into the snapshot and removes the log and the lock."""
    path = tmp_path / "journal.json"

    async def main() -> None:
        kv = await opened(path, append_log=append_log)
        await kv.put(S, "inbox", "a", {"text": "héllo", "n": [1, 2]}, expected_version=0, due=5.0, expires=50.0)
        await kv.put(S, "inbox", "b", {"x": None}, expected_version=0, due=3.0)
        await kv.put(S, "inbox", "b", {"x": 1}, expected_version=1, due=None, expires=7.0)
        await kv.put(S, "outbox", "c", {}, expected_version=0, due=-INF)
        await kv.put(S, "outbox", "d", {"gone": True}, expected_version=0)
        await kv.delete(S, "outbox", "d", expected_version=1)
        before = await dump(kv)
        await kv.close()
        assert sorted(os.listdir(tmp_path)) == ["journal.json"]
        assert read_snapshot(path)["log_seq"] == (6 if append_log else 0)

        again = await opened(path, append_log=append_log)
        assert await dump(again) == before
        assert (await again.get(S, "inbox", "b")) == Versioned({"x": 1}, 2)
        await again.close()

    run(main())


@pytest.mark.spec("BACK-4")
def test_leftover_log_is_replayed_without_the_option(tmp_path: Path) -> None:
    """BACK-4: a leftover ``<path>.log`` is replayed at open even without append_log,
    then folded into the snapshot (log_seq recorded) and removed."""
    path = tmp_path / "j.json"

    async def main() -> None:
        kv = await opened(path, append_log=True)
        await kv.put(S, "inbox", "a", {"n": 1}, expected_version=0, due=1.0)
        await kv.put(S, "inbox", "a", {"n": 2}, expected_version=1, due=2.0)
        await kv.put(S, "inbox", "b", {"n": 3}, expected_version=0)
        await kv.delete(S, "inbox", "b", expected_version=1)
        expected = await dump(kv)
        kv.abandon()
        assert len(log_lines(path)) == 4
        assert not path.exists()  # no compaction happened: only the log holds the writes

        plain = await opened(path)
        assert await dump(plain) == expected
        assert not Path(str(path) + ".log").exists()
        assert read_snapshot(path)["log_seq"] == 4
        await plain.put(S, "inbox", "c", {}, expected_version=0)
        await plain.close()
        again = await opened(path)
        assert (await again.get(S, "inbox", "a")) == Versioned({"n": 2}, 2)
        assert (await again.get(S, "inbox", "c")) == Versioned({}, 1)
        await again.close()

    run(main())


@pytest.mark.spec("BACK-4")
def test_compaction_every_n_entries(tmp_path: Path) -> None:
    """BACK-4: with compact_every=5 the snapshot is rewritten (with log_seq) and the log
    emptied at every 5th entry; sequence numbers keep growing across compactions."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")

    async def main() -> None:
        kv = await opened(path, compact_every=5)
        assert kv.append_log  # compact_every alone turns the append log on
        for i in range(4):
            await kv.put(S, "inbox", f"k{i}", {"i": i}, expected_version=0)
        assert len(log_lines(path)) == 4 and not path.exists()
        await kv.put(S, "inbox", "k4", {"i": 4}, expected_version=0)
        assert log.read_bytes() == b""
        assert read_snapshot(path)["log_seq"] == 5
        assert len(read_snapshot(path)["records"]) == 5
        for i in range(5, 7):
            await kv.put(S, "inbox", f"k{i}", {"i": i}, expected_version=0)
        assert [line["seq"] for line in log_lines(path)] == [6, 7]
        expected = await dump(kv)
        kv.abandon()
        again = await opened(path, append_log=True)
        assert await dump(again) == expected
        await again.close()

    run(main())


@pytest.mark.spec("BACK-4")
def test_compaction_when_the_log_reaches_compact_bytes(tmp_path: Path) -> None:
    """BACK-4: with compact_bytes=1000 the log is folded as soon as it reaches 1000
    bytes, so it never stays that large; the snapshot records the log_seq folded."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")

    async def main() -> None:
        kv = await opened(path, compact_bytes=1000)
        sizes: list[int] = []
        for i in range(10):
            await kv.put(S, "inbox", f"k{i}", {"pad": "x" * 300}, expected_version=0)
            sizes.append(log.stat().st_size)
        # Each line is ~400 bytes: the third crosses 1000 and triggers a compaction.
        assert sizes[0] > 0 and sizes[1] > sizes[0]
        assert sizes[2] == 0
        assert max(sizes) < 1000
        assert read_snapshot(path)["log_seq"] == 9
        assert len(read_snapshot(path)["records"]) == 9
        await kv.close()

    run(main())


@pytest.mark.spec("BACK-4")
def test_default_compaction_every_1000_entries(tmp_path: Path) -> None:
    """BACK-4: the default is a compaction every 1000 entries."""
    path = tmp_path / "j.json"

    async def main() -> None:
        kv = await opened(path, append_log=True, fsync=False)
        for i in range(999):
            await kv.put(S, "inbox", "k", {"i": i}, expected_version=i)
        assert len(log_lines(path)) == 999 and not path.exists()
        await kv.put(S, "inbox", "k", {"i": 999}, expected_version=999)
        assert log_lines(path) == [] and read_snapshot(path)["log_seq"] == 1000
        await kv.close()

    run(main())


@pytest.mark.spec("BACK-4", "BACK-5")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
def test_crash_between_snapshot_rewrite_and_log_truncation(tmp_path: Path, append_log: bool) -> None:
    """BACK-4: a snapshot that already includes the first log entries (log_seq=3) next to
    the untruncated log (seq 1..5) — a crash between the two compaction steps — replays
    only seq 4 and 5, nothing twice; new writes continue at seq 6."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    path.write_bytes(
        snapshot_text(
            3,
            [
                [S, "inbox", "k1", 1, None, None, {"v": "k1.1"}],
                [S, "inbox", "k2", 2, 20.0, None, {"v": "k2.2"}],
            ],
        )
    )
    log.write_bytes(
        put_line(1, "k1", 1, {"v": "k1.1"})
        + put_line(2, "k2", 1, {"v": "k2.1"}, due=10.0)
        + put_line(3, "k2", 2, {"v": "k2.2"}, due=20.0)
        + put_line(4, "k3", 1, {"v": "k3.1"}, due=5.0)
        + del_line(5, "k1", 1)
    )

    async def main() -> None:
        kv = await opened(path, append_log=append_log)
        assert (await kv.scan(S, "inbox")) == [
            ("k2", Versioned({"v": "k2.2"}, 2)),
            ("k3", Versioned({"v": "k3.1"}, 1)),
        ]
        assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == [(5.0, "k3"), (20.0, "k2")]
        await kv.put(S, "inbox", "k4", {}, expected_version=0)
        if append_log:
            assert log_lines(path)[-1]["seq"] == 6
        else:
            assert not log.exists()
            assert read_snapshot(path)["log_seq"] == 5
        await kv.close()
        assert read_snapshot(path)["log_seq"] == (6 if append_log else 5)

    run(main())


@pytest.mark.spec("BACK-4")
def test_a_log_already_folded_is_emptied_at_open(tmp_path: Path) -> None:
    """BACK-4: when every log entry is already in the snapshot (the crash came after the
    snapshot rewrite, before the truncation), open() with the append log finishes the
    compaction: the log is emptied and new entries follow log_seq."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    path.write_bytes(snapshot_text(2, [[S, "inbox", "k1", 2, None, None, {"v": 2}]]))
    log.write_bytes(put_line(1, "k1", 1, {"v": 1}) + put_line(2, "k1", 2, {"v": 2}))

    async def main() -> None:
        kv = await opened(path, append_log=True)
        assert log.read_bytes() == b""
        assert await kv.get(S, "inbox", "k1") == Versioned({"v": 2}, 2)
        await kv.put(S, "inbox", "k1", {"v": 3}, expected_version=2)
        assert [line["seq"] for line in log_lines(path)] == [3]
        kv.abandon()
        again = await opened(path, append_log=True)
        assert await again.get(S, "inbox", "k1") == Versioned({"v": 3}, 3)
        await again.close()

    run(main())


# ---------------------------------------------------------------------------------------
# Damaged journals (BACK-5)
# ---------------------------------------------------------------------------------------


def _truncate_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


SNAPSHOT_DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": _truncate_half,
    "empty": lambda data: b"",
    "garbage": lambda data: b"\x00\x01not json",
    "not-an-object": lambda data: b"[]",
    "other-format": lambda data: data.replace(b"botmesh.file_kv", b"something.else"),
    "malformed-record": lambda data: data.replace(b'"base",1,', b'"base","one",'),
    "duplicate-record": lambda data: data.replace(
        b'{"n":0}]', b'{"n":0}],\n["scope-a","inbox","base",1,null,null,{"n":0}]'
    ),
}


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("damage", list(SNAPSHOT_DAMAGE), ids=list(SNAPSHOT_DAMAGE))
def test_damaged_snapshot_is_rejected_untouched(tmp_path: Path, damage: str) -> None:
    """BACK-5: a snapshot that cannot be read back raises JournalCorruptError with code
    SNAPSHOT_CORRUPT naming the file; no file is changed (the leftover log neither), the
    lock is released, and a repaired journal opens."""
    path = tmp_path / "j.json"
    run(build_journal(path))
    good = path.read_bytes()
    path.write_bytes(SNAPSHOT_DAMAGE[damage](good))
    before = files_of(tmp_path)
    del before["j.json.lock"]  # the dead owner's lock: the failed open took it over

    async def main() -> None:
        with pytest.raises(JournalCorruptError) as caught:
            await opened(path, append_log=True)
        assert caught.value.code == "SNAPSHOT_CORRUPT"
        assert caught.value.file == str(path.resolve())  # type: ignore[attr-defined]
        assert str(path.resolve()) in str(caught.value)
        assert files_of(tmp_path) == before
        path.write_bytes(good)
        kv = await opened(path)  # the lock was not left behind
        assert [key for key, _ in await kv.scan(S, "inbox")] == ["base", "k1", "k2", "k3"]
        await kv.close()

    run(main())


TORN_TAILS: dict[str, bytes] = {
    "no-newline": b'{"seq":4,"op":"put","scope":"scope-a","spa',
    "unparseable-with-newline": b'{"seq":4,"op":"pu\n',
    "zeros": b"\x00" * 37,
    "complete-entry-without-newline": put_line(4, "k4", 1, {"n": 4}).rstrip(b"\n"),
    "unreadable-lines-only": b"garbage\n\x00\x00\n{",
}


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("append_log", [True, False], ids=["append-log", "snapshot"])
@pytest.mark.parametrize("tail", list(TORN_TAILS), ids=list(TORN_TAILS))
def test_half_written_last_line_is_trimmed(tmp_path: Path, tail: str, append_log: bool) -> None:
    """BACK-5: a half-written last log line (no newline, or unreadable with nothing
    readable after it) is cut off — the log truncated to the end of the last good line —
    and the rest replayed. Without append_log the log is then folded and removed."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    good_log = log.read_bytes()
    log.write_bytes(good_log + TORN_TAILS[tail])

    async def main() -> None:
        kv = await opened(path, append_log=append_log)
        assert [key for key, _ in await kv.scan(S, "inbox")] == ["base", "k1", "k2", "k3"]
        if append_log:
            assert log.read_bytes() == good_log
            await kv.put(S, "inbox", "k4", {"n": 4}, expected_version=0)
            assert [line["seq"] for line in log_lines(path)] == [1, 2, 3, 4]
        else:
            assert not log.exists()
            assert read_snapshot(path)["log_seq"] == 3
        await kv.close()
        again = await opened(path)
        assert len(await again.scan(S, "inbox")) == (5 if append_log else 4)
        await again.close()

    run(main())


def _replace_line(log: bytes, index: int, new: bytes | None) -> bytes:
    lines = log.splitlines(keepends=True)
    if new is None:
        del lines[index]
    else:
        lines[index] = new
    return b"".join(lines)


def _edit_entry(log: bytes, index: int, **changes: Any) -> bytes:
    lines = log.splitlines(keepends=True)
    entry = json.loads(lines[index])
    entry.update(changes)
    lines[index] = (json.dumps(entry) + "\n").encode()
    return b"".join(lines)


# name -> (how to damage the 3-line log, expected line, index of the line whose start is the byte)
LOG_DAMAGE: dict[str, tuple[Callable[[bytes], bytes], int]] = {
    "garbage-middle-line": (lambda log: _replace_line(log, 1, b"{garbage\n"), 2),
    "zeros-middle-line": (lambda log: _replace_line(log, 1, b"\x00\x00\x00\n"), 2),
    "torn-first-line-then-entries": (lambda log: _replace_line(log, 0, b'{"seq":1,"op\n'), 1),
    "not-an-entry-last-line": (lambda log: _edit_entry(log, 2, op="zap"), 3),
    "not-an-entry-middle": (lambda log: _replace_line(log, 1, b"[1, 2]\n"), 2),
    "version-gap": (lambda log: _edit_entry(log, 2, version=5), 3),
    "delete-of-absent-key": (lambda log: _replace_line(log, 2, del_line(3, "nope", 1)), 3),
    "sequence-gap": (lambda log: _replace_line(log, 1, None), 2),
    "sequence-starts-after-snapshot": (
        lambda log: _edit_entry(_edit_entry(_edit_entry(log, 0, seq=7), 1, seq=8), 2, seq=9),
        1,
    ),
}


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("append_log", [True, False], ids=["append-log", "snapshot"])
@pytest.mark.parametrize("damage", list(LOG_DAMAGE), ids=list(LOG_DAMAGE))
def test_damaged_log_entry_is_append_log_corrupt(tmp_path: Path, damage: str, append_log: bool) -> None:
    """BACK-5: a bad line in the middle followed by more entries, or an entry that is
    not valid or does not apply, makes open() raise code APPEND_LOG_CORRUPT with file,
    line (1-based) and byte (start of that line); both files stay byte-for-byte as they
    were and nothing is applied (the journal can be opened once repaired)."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    good_log = log.read_bytes()
    mutate, line = LOG_DAMAGE[damage]
    bad_log = mutate(good_log)
    log.write_bytes(bad_log)
    byte = sum(len(part) for part in bad_log.splitlines(keepends=True)[: line - 1])
    before = files_of(tmp_path)
    del before["j.json.lock"]

    async def main() -> None:
        with pytest.raises(JournalCorruptError) as caught:
            await opened(path, append_log=append_log)
        error = caught.value
        assert error.code == "APPEND_LOG_CORRUPT"
        assert error.file == str(log.resolve())  # type: ignore[attr-defined]
        assert error.line == line  # type: ignore[attr-defined]
        assert error.byte == byte  # type: ignore[attr-defined]
        assert str(log.resolve()) in str(error) and f"line {line}" in str(error)
        assert files_of(tmp_path) == before
        log.write_bytes(good_log)
        kv = await opened(path)
        assert len(await kv.scan(S, "inbox")) == 4
        await kv.close()

    run(main())


# ---------------------------------------------------------------------------------------
# Locking (BACK table)
# ---------------------------------------------------------------------------------------


@pytest.mark.spec("BACK")
def test_second_open_in_the_same_process_is_refused_until_close(tmp_path: Path) -> None:
    """BACK table: a second open() of the same file in this process — also spelled
    differently or through a symlink — raises JournalLockedError until close(); then it
    opens. open() of one object twice is idempotent."""
    path = tmp_path / "j.json"
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(path)

    async def main() -> None:
        first = await FileDurability.open(path)
        await first.file_kv.open()  # idempotent
        for spelling in (path, tmp_path / "sub" / ".." / "j.json", tmp_path / "link.json"):
            with pytest.raises(JournalLockedError) as caught:
                await FileDurability.open(spelling)
            assert str(path.resolve()) in str(caught.value)
            assert "already open in this process" in str(caught.value)
            assert caught.value.pid == os.getpid()  # type: ignore[attr-defined]
        with pytest.raises(JournalLockedError):
            await opened(path, append_log=True)
        await first.close()
        await first.close()  # idempotent
        assert not Path(str(path) + ".lock").exists()
        second = await FileDurability.open(path)
        await second.close()

    run(main())


CHILD_HOLDER = """
import asyncio, os, sys
from botmesh.core.file_backend import FileKv

async def main():
    kv = FileKv(sys.argv[1], append_log=True)
    await kv.open()
    await kv.put("scope-a", "inbox", "from-child", {"pid": os.getpid()}, expected_version=0)
    print("ready", flush=True)
    sys.stdin.read()  # hold the journal until killed

asyncio.run(main())
"""


@pytest.mark.spec("BACK")
def test_a_live_process_holding_the_journal_refuses_open_then_dies(tmp_path: Path) -> None:
    """BACK table, survives a crash: while a real child process has the journal open,
    open() raises JournalLockedError naming its pid and the lock file (which is left
    as it is); after the child is SIGKILLed its lock is taken over and its acknowledged
    write is there."""
    path = tmp_path / "j.json"
    lock = Path(str(path) + ".lock")
    with subprocess.Popen(
        [sys.executable, "-c", CHILD_HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"
            lock_before = lock.read_bytes()
            assert lock_before == f"{child.pid}\n".encode()

            with pytest.raises(JournalLockedError) as caught:
                run(opened(path))
            assert caught.value.pid == child.pid  # type: ignore[attr-defined]
            assert caught.value.file == str(lock.resolve())  # type: ignore[attr-defined]
            assert str(child.pid) in str(caught.value) and str(lock.resolve()) in str(caught.value)
            assert lock.read_bytes() == lock_before
        finally:
            child.kill()
            child.wait()

    async def main() -> None:
        kv = await opened(path)
        assert lock.read_bytes() == f"{os.getpid()}\n".encode()
        found = await kv.get(S, "inbox", "from-child")
        assert found == Versioned({"pid": child.pid}, 1)
        await kv.close()

    run(main())


@pytest.mark.spec("BACK")
def test_a_lock_file_naming_a_live_pid_is_respected(tmp_path: Path) -> None:
    """BACK table: a lock file whose pid is a live process is refused even when that
    process holds no flock (e.g. another implementation wrote it); once the process is
    gone the lock is taken over."""
    path = tmp_path / "j.json"
    lock = Path(str(path) + ".lock")
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as child:
        try:
            lock.write_text(f"{child.pid}\n")
            with pytest.raises(JournalLockedError) as caught:
                run(opened(path))
            assert caught.value.pid == child.pid  # type: ignore[attr-defined]
            assert lock.read_text() == f"{child.pid}\n"
        finally:
            child.kill()
            child.wait()
    kv = run(opened(path))
    run(kv.close())


@pytest.mark.spec("BACK")
@pytest.mark.parametrize("content", ["dead-pid", "garbage", "empty"])
def test_a_stale_lock_is_taken_over(tmp_path: Path, content: str) -> None:
    """BACK table: a lock left by a dead pid (or naming no pid) is taken over: open()
    succeeds and the lock names this process; close() removes it."""
    path = tmp_path / "j.json"
    lock = Path(str(path) + ".lock")
    text = {"dead-pid": f"{default_io.dead_pid()}\n", "garbage": "not a pid", "empty": ""}[content]
    lock.write_text(text)

    async def main() -> None:
        kv = await opened(path)
        assert lock.read_text() == f"{os.getpid()}\n"
        await kv.close()
        assert not lock.exists()

    run(main())


@pytest.mark.spec("BACK", "BACK-4")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
def test_abandon_then_reopen_sees_every_acknowledged_write(tmp_path: Path, append_log: bool) -> None:
    """BACK table (survives a crash): after abandon() — the in-process stand-in for the
    process dying: no compaction, no flush, a lock naming a dead pid left behind — a new
    open() takes the lock over and sees every write that returned."""
    path = tmp_path / "j.json"
    lock = Path(str(path) + ".lock")

    async def main() -> None:
        d = await FileDurability.open(path, append_log=append_log, compact_every=7 if append_log else None)
        kv = d.kv
        for i in range(20):
            await kv.put(S, "inbox", f"k{i % 6}", {"i": i}, expected_version=i // 6, due=float(i))
        await kv.delete(S, "inbox", "k0", expected_version=4)
        expected = await dump(kv)
        d.abandon()
        d.abandon()  # idempotent
        dead = int(lock.read_text())
        assert dead != os.getpid() and not default_io.pid_alive(dead)
        with pytest.raises(BackendUnavailableError):
            await kv.get(S, "inbox", "k1")

        again = await FileDurability.open(path, append_log=append_log)
        assert await dump(again.kv) == expected
        await again.close()

    run(main())


# ---------------------------------------------------------------------------------------
# Injected I/O faults, fsync (BACK-5, BACK-6, DurableKv contract)
# ---------------------------------------------------------------------------------------


@pytest.mark.spec("BACK", "BACK-5")
@pytest.mark.parametrize("torn", [False, True], ids=["enospc", "torn-write"])
def test_failed_append_raises_and_leaves_nothing_behind(tmp_path: Path, torn: bool) -> None:
    """A failed append (ENOSPC; or EIO after half the line was written) raises
    BackendUnavailableError naming the log; memory is unchanged, the partial line is cut
    off, the journal keeps working, and a reopen does not see the failed write."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    io = FaultIO()

    async def main() -> None:
        kv = await opened(path, append_log=True, io=io)
        await kv.put(S, "inbox", "a", {"n": 1}, expected_version=0, due=1.0)
        size = log.stat().st_size
        io.append_fault = OSError(errno.EIO if torn else errno.ENOSPC, "injected")
        io.torn = torn
        with pytest.raises(BackendUnavailableError) as caught:
            await kv.put(S, "inbox", "a", {"n": 2}, expected_version=1, due=2.0)
        assert caught.value.file == str(log.resolve())  # type: ignore[attr-defined]
        assert str(log.resolve()) in str(caught.value)
        assert log.stat().st_size == size
        assert (await kv.get(S, "inbox", "a")) == Versioned({"n": 1}, 1)
        assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == [(1.0, "a")]
        await kv.put(S, "inbox", "b", {"n": 3}, expected_version=0)
        kv.abandon()

        again = await opened(path, append_log=True)
        assert (await again.get(S, "inbox", "a")) == Versioned({"n": 1}, 1)
        assert (await again.get(S, "inbox", "b")) == Versioned({"n": 3}, 1)
        await again.close()

    run(main())


@pytest.mark.spec("BACK-5")
def test_a_failed_append_that_cannot_be_undone_stops_the_journal(tmp_path: Path) -> None:
    """When a torn append cannot be truncated away, every later call raises
    BackendUnavailableError (writing after the torn line would corrupt the middle of the
    log); a reopen trims the torn tail and sees only acknowledged writes."""
    path = tmp_path / "j.json"
    io = FaultIO()

    async def main() -> None:
        kv = await opened(path, append_log=True, io=io)
        await kv.put(S, "inbox", "a", {"n": 1}, expected_version=0)
        io.append_fault, io.torn = OSError(errno.EIO, "injected"), True
        io.truncate_fault = OSError(errno.EIO, "injected too")
        with pytest.raises(BackendUnavailableError):
            await kv.put(S, "inbox", "b", {}, expected_version=0)
        with pytest.raises(BackendUnavailableError, match="reopen"):
            await kv.put(S, "inbox", "c", {}, expected_version=0)
        with pytest.raises(BackendUnavailableError):
            await kv.get(S, "inbox", "a")
        await kv.close()  # releases the lock without folding a log in an unknown state

        again = await opened(path)
        assert [key for key, _ in await again.scan(S, "inbox")] == ["a"]
        await again.close()

    run(main())


@pytest.mark.spec("BACK-6")
def test_failed_snapshot_write_raises_and_leaves_the_file(tmp_path: Path) -> None:
    """Snapshot mode: a failed snapshot write (ENOSPC) raises BackendUnavailableError
    naming the file; the snapshot and memory are unchanged, no temporary is left."""
    path = tmp_path / "j.json"
    io = FaultIO()

    async def main() -> None:
        kv = await opened(path, io=io)
        await kv.put(S, "inbox", "a", {"n": 1}, expected_version=0)
        before = files_of(tmp_path)
        io.write_file_fault = OSError(errno.ENOSPC, "injected")
        with pytest.raises(BackendUnavailableError) as caught:
            await kv.delete(S, "inbox", "a", expected_version=1)
        assert caught.value.file == str(path.resolve())  # type: ignore[attr-defined]
        assert files_of(tmp_path) == before
        assert (await kv.get(S, "inbox", "a")) == Versioned({"n": 1}, 1)
        await kv.close()
        again = await opened(path)
        assert (await again.get(S, "inbox", "a")) == Versioned({"n": 1}, 1)
        await again.close()

    run(main())


@pytest.mark.spec("BACK-6")
def test_unconfirmed_snapshot_rename_stops_the_journal_until_reopen(tmp_path: Path) -> None:
    """Snapshot mode: when the directory fsync after the rename fails, the new snapshot
    is in place but memory does not have it; the journal refuses every call until a
    reopen, which reads what is on disk."""
    path = tmp_path / "j.json"
    io = FaultIO()

    async def main() -> None:
        kv = await opened(path, io=io)
        io.fsync_dir_fault = OSError(errno.EIO, "injected")
        with pytest.raises(BackendUnavailableError):
            await kv.put(S, "inbox", "a", {"n": 1}, expected_version=0)
        with pytest.raises(BackendUnavailableError):
            await kv.get(S, "inbox", "a")
        await kv.close()
        again = await opened(path)
        assert (await again.get(S, "inbox", "a")) == Versioned({"n": 1}, 1)
        await again.close()

    run(main())


@pytest.mark.spec("BACK-4")
def test_failed_compaction_is_retried_and_loses_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """BACK-4: a compaction that fails does not fail the write that triggered it (that
    write is already in the log): a warning is logged and the next write compacts."""
    path = tmp_path / "j.json"
    io = FaultIO()

    async def main() -> None:
        kv = await opened(path, compact_every=2, io=io)
        await kv.put(S, "inbox", "a", {}, expected_version=0)
        io.write_file_fault = OSError(errno.ENOSPC, "injected")
        with caplog.at_level(logging.WARNING, logger="botmesh.core.file_backend"):
            assert await kv.put(S, "inbox", "b", {}, expected_version=0) == 1
        assert "compaction failed" in caplog.text
        assert len(log_lines(path)) == 2 and not path.exists()
        await kv.put(S, "inbox", "c", {}, expected_version=0)
        assert log_lines(path) == [] and read_snapshot(path)["log_seq"] == 3
        kv.abandon()
        again = await opened(path)
        assert [key for key, _ in await again.scan(S, "inbox")] == ["a", "b", "c"]
        await again.close()

    run(main())


@pytest.mark.spec("BACK-6")
@pytest.mark.parametrize("fsync", [None, True, False], ids=["default", "on", "off"])
def test_fsync_forces_snapshots_and_appends_to_disk(tmp_path: Path, fsync: bool | None) -> None:
    """BACK-6: with fsync (the default, for the append log and for snapshots) each
    snapshot is fsync'ed before it replaces the previous one and the directory after the
    rename, and each append is fsync'ed; with fsync=False none is, the rename is still
    used."""
    expect = fsync is not False

    async def main() -> None:
        spy = SpyIO()
        kv = await opened(tmp_path / "snap.json", fsync=fsync, io=spy)
        await kv.put(S, "inbox", "a", {}, expected_version=0)
        await kv.close()
        expected_calls: list[tuple[str, Any]] = [
            ("write_file", ("snap.json.tmp", expect)),
            ("replace", ("snap.json.tmp", "snap.json")),
        ]
        if expect:
            expected_calls.append(("fsync_dir", None))
        assert spy.calls == expected_calls

        spy = SpyIO()
        kv = await opened(tmp_path / "log.json", fsync=fsync, append_log=True, io=spy)
        await kv.put(S, "inbox", "a", {}, expected_version=0)
        await kv.close()
        appends = [args for name, args in spy.calls if name == "append"]
        writes = [args for name, args in spy.calls if name == "write_file"]
        assert appends == [expect] and writes == [("log.json.tmp", expect)]
        assert (("fsync_dir", None) in spy.calls) == expect

    run(main())


# ---------------------------------------------------------------------------------------
# Options, FileDurability
# ---------------------------------------------------------------------------------------

BAD_OPTIONS: list[tuple[str, Any]] = [
    ("compact_every", 0),
    ("compact_every", -5),
    ("compact_every", 1.5),
    ("compact_every", True),
    ("compact_every", "10"),
    ("compact_bytes", 0),
    ("compact_bytes", 2.0),
    ("fsync", "yes"),
    ("fsync", 1),
    ("append_log", 1),
    ("append_log", None),
    ("path", 123),
    ("path", ""),
]


@pytest.mark.spec("BACK-4", "BACK-6")
@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS, ids=[f"{o}={v!r}" for o, v in BAD_OPTIONS])
def test_a_bad_option_raises_config_error_naming_it(tmp_path: Path, option: str, value: Any) -> None:
    """A bad option of FileDurability.open raises ConfigError naming the option, and no
    file is created."""
    kwargs: dict[str, Any] = {option: value}
    path = kwargs.pop("path", tmp_path / "j.json")
    with pytest.raises(ConfigError) as caught:
        run(FileDurability.open(path, **kwargs))
    assert caught.value.option == option  # type: ignore[attr-defined]
    assert option in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.spec("BACK", "BACK-4", "BACK-7")
def test_file_durability_is_a_kv_durability_that_survives_reopen(tmp_path: Path) -> None:
    """BACK table, BACK-7: FileDurability.open returns a KvDurability over a FileKv that
    claims to survive a crash (and nothing else), stays open across start()/stop(), and
    keeps journaled records across close() and a reopen; compact_every turns on the log."""
    path = tmp_path / "j.json"

    async def main() -> None:
        d = await FileDurability.open(path, compact_every=50)
        assert isinstance(d, KvDurability) and isinstance(d.kv, FileKv)
        assert d.name == "file" and d.own_kv is False
        assert d.capabilities == Capabilities(survives_crash=True, multi_process=False, multi_host=False, shared=False)
        assert d.path == str(path.resolve())
        assert Path(str(path) + ".log").exists()
        await d.start()
        record = InboxRecord(id="m1", chat_id="c1", state="pending", created_at=1.0, updated_at=1.0)
        stored, created = await d.inbox_journal(S, record)
        assert created
        await d.stop()  # the bot stopping does not close the journal
        assert (await d.inbox_get(S, "m1")) == stored
        await d.close()
        with pytest.raises(BackendUnavailableError):
            await d.inbox_get(S, "m1")

        again = await FileDurability.open(path)
        assert (await again.inbox_get(S, "m1")) == stored
        assert (await again.inbox_journal(S, record))[1] is False  # INB-4: recognised
        await again.close()

    run(main())


# ---------------------------------------------------------------------------------------
# FileKv agrees with MemoryKv (BACK-7)
# ---------------------------------------------------------------------------------------

KV_KINDS = ["memory", "file", "file-log"]


@pytest.fixture(params=KV_KINDS)
def kv(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """An open DurableKv of each kind: the MemoryKv reference, FileKv rewriting the
    snapshot, FileKv with an append log compacted every 3 entries."""
    store: DurableKv
    if request.param == "memory":
        store = MemoryKv()
    elif request.param == "file":
        store = FileKv(tmp_path / "j.json")
    else:
        store = FileKv(tmp_path / "j.json", compact_every=3)
    run(store.open())
    yield store
    run(store.close())


def kv_test(body: Callable[[DurableKv], Awaitable[None]]) -> Callable[[DurableKv], None]:
    """Turn ``async def body(kv)`` into a sync test taking the ``kv`` fixture."""

    def test(kv: DurableKv) -> None:
        async def main() -> None:
            await body(kv)

        run(main())

    test.__name__ = body.__name__
    test.__doc__ = body.__doc__
    return test


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_compare_and_set(kv: DurableKv) -> None:
    """BACK-7: versions start at 1 and grow by 1; expected_version=0 only creates; a
    wrong version raises VersionConflict and changes nothing."""
    assert await kv.put(S, "inbox", "k", {"v": 1}, expected_version=0, due=1.0) == 1
    with pytest.raises(VersionConflict):
        await kv.put(S, "inbox", "k", {"v": "again"}, expected_version=0)
    assert await kv.put(S, "inbox", "k", {"v": 2}, expected_version=1, due=2.0) == 2
    for wrong in (1, 3, -1):
        with pytest.raises(VersionConflict) as caught:
            await kv.put(S, "inbox", "k", {"v": "wrong"}, expected_version=wrong, due=9.0)
        assert caught.value.found == 2  # type: ignore[attr-defined]
    with pytest.raises(VersionConflict):
        await kv.put(S, "inbox", "absent", {}, expected_version=1)
    assert await kv.get(S, "inbox", "k") == Versioned({"v": 2}, 2)
    assert await kv.get(S, "inbox", "absent") is None
    assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == [(2.0, "k")]


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_delete(kv: DurableKv) -> None:
    """BACK-7: delete needs the exact version, removes the record and both index
    entries; a deleted key can be created again at version 1."""
    await kv.put(S, "inbox", "k", {}, expected_version=0, due=1.0, expires=2.0)
    await kv.put(S, "inbox", "k", {}, expected_version=1, due=1.0, expires=2.0)
    for wrong in (0, 1, 3):
        with pytest.raises(VersionConflict):
            await kv.delete(S, "inbox", "k", expected_version=wrong)
    with pytest.raises(VersionConflict):
        await kv.delete(S, "inbox", "absent", expected_version=0)
    await kv.delete(S, "inbox", "k", expected_version=2)
    assert await kv.get(S, "inbox", "k") is None
    assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == []
    assert await kv.range(S, "inbox", "expires", upto=INF, limit=10) == []
    with pytest.raises(VersionConflict):
        await kv.delete(S, "inbox", "k", expected_version=2)
    assert await kv.put(S, "inbox", "k", {}, expected_version=0) == 1


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_index_order_and_moves(kv: DurableKv) -> None:
    """BACK-7: range lists score <= upto ascending by (score, key); a put moves an entry
    (or drops it with None) in each index independently."""
    await kv.put(S, "inbox", "a", {}, expected_version=0, due=5, expires=1.0)
    await kv.put(S, "inbox", "c", {}, expected_version=0, due=3.0)
    await kv.put(S, "inbox", "b", {}, expected_version=0, due=3.0, expires=1.0)
    assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == [(3.0, "b"), (3.0, "c"), (5.0, "a")]
    assert await kv.range(S, "inbox", "due", upto=4.999, limit=10) == [(3.0, "b"), (3.0, "c")]
    assert await kv.range(S, "inbox", "due", upto=5.0, limit=10) == [(3.0, "b"), (3.0, "c"), (5.0, "a")]
    assert await kv.range(S, "inbox", "expires", upto=INF, limit=10) == [(1.0, "a"), (1.0, "b")]
    await kv.put(S, "inbox", "b", {}, expected_version=1, due=10.0, expires=None)
    await kv.put(S, "inbox", "c", {}, expected_version=1, due=None, expires=0.5)
    assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == [(5.0, "a"), (10.0, "b")]
    assert await kv.range(S, "inbox", "expires", upto=INF, limit=10) == [(0.5, "c"), (1.0, "a")]
    assert await kv.range(S, "inbox", "due", upto=-1.0, limit=10) == []
    result = await kv.range(S, "inbox", "due", upto=INF, limit=10)
    assert all(type(score) is float for score, _ in result)


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_range_limit(kv: DurableKv) -> None:
    """BACK-7: range returns at most ``limit`` entries, the lowest ones."""
    for i, key in enumerate(["e", "d", "c", "b", "a"]):
        await kv.put(S, "outbox", key, {}, expected_version=0, due=float(i % 2))
    assert await kv.range(S, "outbox", "due", upto=INF, limit=2) == [(0.0, "a"), (0.0, "c")]
    assert await kv.range(S, "outbox", "due", upto=INF, limit=0) == []
    assert len(await kv.range(S, "outbox", "due", upto=INF, limit=100)) == 5


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_scan_order(kv: DurableKv) -> None:
    """BACK-7: scan lists keys > after in code-point order, at most ``limit``."""
    for key in ["b", "a", "B", "é", "aa", "😀", "a b"]:
        await kv.put(S, "inbox", key, {"k": key}, expected_version=0)
    everything = await kv.scan(S, "inbox")
    assert [key for key, _ in everything] == ["B", "a", "a b", "aa", "b", "é", "😀"]
    assert everything[3] == ("aa", Versioned({"k": "aa"}, 1))
    assert [key for key, _ in await kv.scan(S, "inbox", after="a")] == ["a b", "aa", "b", "é", "😀"]
    assert [key for key, _ in await kv.scan(S, "inbox", after="a", limit=2)] == ["a b", "aa"]
    assert await kv.scan(S, "inbox", after="😀") == []
    assert await kv.scan(S, "empty-space") == []


@pytest.mark.spec("BACK-7", "SCOPE-2")
@kv_test
async def test_kv_scope_isolation(kv: DurableKv) -> None:
    """BACK-7, SCOPE-2: records, versions and index entries of one (scope, space) are
    invisible to the others."""
    await kv.put("s1", "inbox", "k", {"who": "s1/inbox"}, expected_version=0, due=1.0)
    await kv.put("s1", "inbox", "k", {"who": "s1/inbox"}, expected_version=1, due=1.0)
    await kv.put("s2", "inbox", "k", {"who": "s2/inbox"}, expected_version=0, due=2.0)
    await kv.put("s1", "outbox", "k", {"who": "s1/outbox"}, expected_version=0, expires=3.0)
    assert await kv.get("s1", "inbox", "k") == Versioned({"who": "s1/inbox"}, 2)
    assert await kv.get("s2", "inbox", "k") == Versioned({"who": "s2/inbox"}, 1)
    assert await kv.get("s2", "outbox", "k") is None
    assert await kv.range("s2", "inbox", "due", upto=INF, limit=10) == [(2.0, "k")]
    assert await kv.range("s1", "outbox", "due", upto=INF, limit=10) == []
    assert [k for k, _ in await kv.scan("s2", "inbox")] == ["k"]
    await kv.delete("s2", "inbox", "k", expected_version=1)
    assert await kv.get("s1", "inbox", "k") == Versioned({"who": "s1/inbox"}, 2)


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_values_are_copies(kv: DurableKv) -> None:
    """BACK-7: a stored value is a copy: mutating what was passed in or what came back
    changes nothing stored; a value that is not a JSON object is refused."""
    value: dict[str, Any] = {"list": [1], "nested": {"x": 1}}
    await kv.put(S, "inbox", "k", value, expected_version=0)
    value["list"].append(2)
    got = await kv.get(S, "inbox", "k")
    assert got is not None
    got.value["nested"]["x"] = 99
    scanned = await kv.scan(S, "inbox")
    scanned[0][1].value["list"].append(3)
    assert await kv.get(S, "inbox", "k") == Versioned({"list": [1], "nested": {"x": 1}}, 1)
    with pytest.raises(TypeError):
        await kv.put(S, "inbox", "bad", ["not", "a", "dict"], expected_version=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await kv.put(S, "inbox", "bad", {"nan": math.nan}, expected_version=0)
    assert await kv.get(S, "inbox", "bad") is None


@pytest.mark.spec("BACK-7")
@kv_test
async def test_kv_concurrent_cas_has_one_winner(kv: DurableKv) -> None:
    """BACK-7: concurrent puts on one key with the same expected_version: exactly one
    wins, the others raise VersionConflict."""
    await kv.put(S, "inbox", "k", {"n": 0}, expected_version=0)
    results = await asyncio.gather(
        *(kv.put(S, "inbox", "k", {"n": i}, expected_version=1) for i in range(10)), return_exceptions=True
    )
    assert sum(1 for r in results if r == 2) == 1
    assert sum(1 for r in results if isinstance(r, VersionConflict)) == 9


@pytest.mark.spec("BACK-7")
def test_kv_calls_after_close_raise(tmp_path: Path) -> None:
    """BACK-7: after close() every call raises BackendUnavailableError (MemoryKv and
    FileKv alike); FileKv also before open()."""

    async def main() -> None:
        for store in (MemoryKv(), FileKv(tmp_path / "j.json")):
            await store.open()
            await store.close()
            with pytest.raises(BackendUnavailableError):
                await store.get(S, "inbox", "k")
            with pytest.raises(BackendUnavailableError):
                await store.put(S, "inbox", "k", {}, expected_version=0)
        with pytest.raises(BackendUnavailableError):
            await FileKv(tmp_path / "other.json").scan(S, "inbox")

    run(main())


# A random walk of operations applied to MemoryKv and FileKv side by side; FileKv is also
# closed/reopened and abandoned/reopened at random points, which must change nothing.
_keys = st.sampled_from(["a", "b", "c"])
_spaces = st.sampled_from([(S, "inbox"), (S, "outbox"), ("scope-b", "inbox")])
_scores = st.sampled_from([None, 0.0, 1.0, 1.0, 2.5, -INF, INF])
_ops = st.one_of(
    st.tuples(st.just("put"), _spaces, _keys, st.integers(0, 3), st.integers(0, 9), _scores, _scores),
    st.tuples(st.just("delete"), _spaces, _keys, st.integers(0, 3)),
    st.tuples(st.just("get"), _spaces, _keys),
    st.tuples(st.just("range"), _spaces, st.sampled_from(["due", "expires"]), _scores, st.integers(0, 4)),
    st.tuples(st.just("scan"), _spaces, st.sampled_from([None, "a", "b"]), st.integers(0, 4)),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("abandon")),
)


async def _apply(kv: DurableKv, op: tuple[Any, ...]) -> Any:
    name, (scope, space), *args = op
    try:
        if name == "put":
            key, expected, n, due, expires = args
            return await kv.put(scope, space, key, {"n": n}, expected_version=expected, due=due, expires=expires)
        if name == "delete":
            key, expected = args
            return await kv.delete(scope, space, key, expected_version=expected)
        if name == "get":
            return await kv.get(scope, space, args[0])
        if name == "range":
            index, upto, limit = args
            return await kv.range(scope, space, index, upto=INF if upto is None else upto, limit=limit)
        after, limit = args
        return await kv.scan(scope, space, after=after, limit=limit)
    except VersionConflict as exc:
        return ("conflict", exc.found)  # type: ignore[attr-defined]


@pytest.mark.spec("BACK-7", "BACK-4", "BACK")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_ops, max_size=40))
def test_file_kv_agrees_with_memory_kv_step_by_step(append_log: bool, ops: list[tuple[Any, ...]]) -> None:
    """BACK-7: every operation of a random walk returns the same on FileKv as on the
    MemoryKv reference (conflicts included), also across close/reopen and
    abandon/reopen (BACK table: survives a crash), and the final states are equal."""

    async def main(directory: str) -> None:
        path = os.path.join(directory, "j.json")
        memory = MemoryKv()
        options: dict[str, Any] = {"compact_every": 3} if append_log else {}
        file = await opened(path, **options)
        try:
            for op in ops:
                if op[0] == "reopen":
                    await file.close()
                    file = await opened(path, **options)
                elif op[0] == "abandon":
                    file.abandon()
                    file = await opened(path, **options)
                else:
                    assert await _apply(file, op) == await _apply(memory, op), op
            spaces = ((S, "inbox"), (S, "outbox"), ("scope-b", "inbox"))
            assert await dump(file, spaces) == await dump(memory, spaces)
        finally:
            await file.close()
        reopened = await opened(path)
        assert await dump(reopened, spaces) == await dump(memory, spaces)
        await reopened.close()

    with tempfile.TemporaryDirectory() as directory:
        run(main(directory))


@pytest.mark.spec("BACK-6", "BACK-7", "GUAR-1")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append_log"])
def test_without_fsync_a_journal_claims_no_survives_crash(tmp_path: Path, append_log: bool) -> None:
    """Issue 11, item 5: ``fsync=False`` survives a SIGKILL (the OS cache outlives the
    process) but not a power cut, so neither FileKv nor FileDurability built so claims
    ``survives_crash``; with fsync (the default) they do. ``durability_settings()``
    reports the options written with, open or not; the harness claims what the backend
    does."""
    from botmesh_testkit.backends.file import FileHarness

    async def main() -> None:
        unsynced = FileKv(tmp_path / "a.json", append_log=append_log, fsync=False)
        assert unsynced.capabilities == Capabilities()
        assert await unsynced.durability_settings() == {"kind": "file", "fsync": "False",
                                                        "append_log": str(append_log)}
        d = await FileDurability.open(tmp_path / "b.json", append_log=append_log, fsync=False)
        assert d.capabilities == Capabilities() and not d.file_kv.fsync
        assert await d.durability_settings() == {"kind": "file", "fsync": "False", "append_log": str(append_log)}
        await d.close()
        synced = await FileDurability.open(tmp_path / "c.json", append_log=append_log)
        assert synced.capabilities.survives_crash and synced.file_kv.fsync
        assert await synced.durability_settings() == {"kind": "file", "fsync": "True", "append_log": str(append_log)}
        await synced.close()
        assert FileKv(tmp_path / "d.json").capabilities.survives_crash  # the class's claim, untouched
        assert FileKv.capabilities.survives_crash
        assert not FileHarness(str(tmp_path), append_log=append_log, fsync=False).capabilities.survives_crash
        assert FileHarness(str(tmp_path), append_log=append_log).capabilities.survives_crash

    run(main())


@pytest.mark.spec("BACK-7")
def test_a_subclass_declaring_its_own_capabilities_keeps_them_and_the_settings_tell(tmp_path: Path) -> None:
    """A subclass that declares capabilities answers for them (they are kept with
    fsync=False); the settings it reports still say ``fsync=False``, which is what the
    claims check refuses. The settings reach a crashable wrapper and the reference kv
    reports none."""
    from botmesh_testkit.crash import crashable

    class Claims(FileKv):
        capabilities = Capabilities(survives_crash=True)

    async def main() -> None:
        kv = Claims(tmp_path / "j.json", fsync=False)
        assert kv.capabilities.survives_crash
        backend = crashable(KvDurability(kv))
        assert backend.capabilities.survives_crash
        assert (await backend.durability_settings()) == {"kind": "file", "fsync": "False", "append_log": "False"}
        assert await MemoryKv().durability_settings() is None
        assert await KvDurability(MemoryKv()).durability_settings() is None

    run(main())
