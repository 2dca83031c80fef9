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
import zlib
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


# An independent codec of the documented format (botmesh.core.file_format, version 2):
# tests write and read journal files with it, not with the code under test.


def frame(payload: bytes) -> bytes:
    """One framed line: ``<length> <crc32 hex> <payload>\\n``."""
    return b"%d %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


def unframe(data: bytes) -> list[bytes]:
    """The payloads of a file of framed lines, each checked (length and checksum)."""
    payloads = []
    for line in data.split(b"\n")[:-1]:
        length, crc, payload = line.split(b" ", 2)
        assert int(length) == len(payload) and int(crc, 16) == zlib.crc32(payload), line
        payloads.append(payload)
    assert data.endswith(b"\n") or data == b""
    return payloads


def _js(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


LOG_HEADER = frame(b'{"format":"botmesh.file_kv.log","version":3}')
LOG_HEADER_V2 = frame(b'{"format":"botmesh.file_kv.log","version":2}')


def read_snapshot(path: Path) -> dict[str, Any]:
    """The header fields of a snapshot plus its ``records`` (rows as lists), the record
    count and the trailer checked."""
    data = path.read_bytes()
    payloads = unframe(data)
    doc: dict[str, Any] = json.loads(payloads[0])
    assert doc["format"] == "botmesh.file_kv" and doc["version"] == 2
    rows = [json.loads(p) for p in payloads[1:-1]]
    trailer = json.loads(payloads[-1])
    assert doc["records"] == trailer["end"] == len(rows)
    assert trailer["crc32"] == f"{zlib.crc32(data[: len(data) - len(frame(payloads[-1]))]):08x}"
    doc["records"] = rows
    return doc


def log_lines(path: Path) -> list[dict[str, Any]]:
    """The entries of ``<path>.log`` (its header checked and left out)."""
    log = Path(str(path) + ".log")
    data = log.read_bytes()
    assert data.startswith(LOG_HEADER), data[:80]
    return [entry for p in unframe(data)[1:] for entry in json.loads(p)]


def _score(score: float | None) -> float | str | None:
    return score if score is None or math.isfinite(score) else ("inf" if score > 0 else "-inf")


def snapshot_text(log_seq: int, rows: list[list[Any]]) -> bytes:
    """A snapshot file in the documented format (version 2), written by hand."""
    body = frame(_js({"format": "botmesh.file_kv", "version": 2, "log_seq": log_seq, "records": len(rows)}))
    for scope, space, key, version, due, expires, value in rows:
        body += frame(_js([scope, space, key, version, _score(due), _score(expires), value]))
    return body + frame(_js({"end": len(rows), "crc32": f"{zlib.crc32(body):08x}"}))


def put_entry(
    seq: int, key: str, version: int, value: dict[str, Any], due: float | None = None, space: str = "inbox"
) -> dict[str, Any]:
    return {
        "seq": seq,
        "op": "put",
        "scope": S,
        "space": space,
        "key": key,
        "version": version,
        "due": _score(due),
        "expires": None,
        "value": value,
    }


def put_line(
    seq: int, key: str, version: int, value: dict[str, Any], due: float | None = None, space: str = "inbox"
) -> bytes:
    """An append-log commit of one put entry, written by hand (log version 3: a framed
    JSON array of entries)."""
    return commit_line(put_entry(seq, key, version, value, due, space))


def del_entry(seq: int, key: str, version: int, space: str = "inbox") -> dict[str, Any]:
    return {"seq": seq, "op": "del", "scope": S, "space": space, "key": key, "version": version}


def del_line(seq: int, key: str, version: int, space: str = "inbox") -> bytes:
    """An append-log commit of one delete entry, written by hand (log version 3)."""
    return commit_line(del_entry(seq, key, version, space))


def commit_line(*entries: dict[str, Any]) -> bytes:
    """An append-log commit of several entries, written by hand (log version 3)."""
    return frame(_js(list(entries)))


def put_line_v2(
    seq: int, key: str, version: int, value: dict[str, Any], due: float | None = None, space: str = "inbox"
) -> bytes:
    """A log-version-2 line (earlier releases: one framed entry per line, no array)."""
    return frame(_js(put_entry(seq, key, version, value, due, space)))


# Version 1 (the format of earlier releases: one JSON snapshot document, bare JSON log
# lines), written by hand for the migration tests.


def snapshot_text_v1(log_seq: int, rows: list[list[Any]]) -> bytes:
    return json.dumps({"format": "botmesh.file_kv", "version": 1, "log_seq": log_seq, "records": rows}).encode()


def put_line_v1(
    seq: int, key: str, version: int, value: dict[str, Any], due: float | None = None, space: str = "inbox"
) -> bytes:
    entry = put_entry(seq, key, version, value, None, space)
    entry["due"] = due
    return (json.dumps(entry) + "\n").encode()


def del_line_v1(seq: int, key: str, version: int, space: str = "inbox") -> bytes:
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
    emptied back to its header at every 5th entry; sequence numbers keep growing across
    compactions."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")

    async def main() -> None:
        kv = await opened(path, compact_every=5)
        assert kv.append_log  # compact_every alone turns the append log on
        for i in range(4):
            await kv.put(S, "inbox", f"k{i}", {"i": i}, expected_version=0)
        assert len(log_lines(path)) == 4 and not path.exists()
        await kv.put(S, "inbox", "k4", {"i": 4}, expected_version=0)
        assert log.read_bytes() == LOG_HEADER
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
        # Each line is ~400 bytes: the third crosses 1000 and triggers a compaction,
        # which leaves the log's header only.
        assert sizes[0] > len(LOG_HEADER) and sizes[1] > sizes[0]
        assert sizes[2] == len(LOG_HEADER)
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
        LOG_HEADER
        + put_line(1, "k1", 1, {"v": "k1.1"})
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
    compaction: the log is emptied back to its header and new entries follow log_seq."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    path.write_bytes(snapshot_text(2, [[S, "inbox", "k1", 2, None, None, {"v": 2}]]))
    log.write_bytes(LOG_HEADER + put_line(1, "k1", 1, {"v": 1}) + put_line(2, "k1", 2, {"v": 2}))

    async def main() -> None:
        kv = await opened(path, append_log=True)
        assert log.read_bytes() == LOG_HEADER
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


def _flip(data: bytes, at: int, bit: int = 0) -> bytes:
    return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1 :]


def _snapshot_rows(data: bytes) -> tuple[int, list[list[Any]]]:
    """log_seq and rows of a version-2 snapshot, read with the test codec."""
    payloads = unframe(data)
    rows = [json.loads(p) for p in payloads[1:-1]]
    for row in rows:  # back to the scores snapshot_text takes
        row[4:6] = [math.inf if x == "inf" else -math.inf if x == "-inf" else x for x in row[4:6]]
    return json.loads(payloads[0])["log_seq"], rows


def _reframed_header(data: bytes, **changes: Any) -> bytes:
    """The snapshot with its header edited, every checksum recomputed: only the reader's
    checks of the content can catch it."""
    payloads = unframe(data)
    header = json.loads(payloads[0])
    header.update(changes)
    body = frame(_js(header)) + b"".join(frame(p) for p in payloads[1:-1])
    trailer = json.loads(payloads[-1])
    trailer["crc32"] = f"{zlib.crc32(body):08x}"
    return body + frame(_js(trailer))


def _with_rows(data: bytes, edit: Callable[[list[list[Any]]], list[list[Any]]]) -> bytes:
    log_seq, rows = _snapshot_rows(data)
    return snapshot_text(log_seq, edit(rows))


def _delete_line(data: bytes, index: int) -> bytes:
    lines = data.splitlines(keepends=True)
    del lines[index]
    return b"".join(lines)


# name -> how to damage the snapshot of build_journal (header, row "base", trailer). Each
# must be refused as SNAPSHOT_CORRUPT; the ones marked "reframed" keep every length and
# checksum right, so only the checks of the content catch them.
SNAPSHOT_DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": _truncate_half,
    "truncated-before-trailer": lambda data: b"".join(data.splitlines(keepends=True)[:2]),
    "empty": lambda data: b"",
    "garbage": lambda data: b"\x00\x01not json",
    "not-an-object": lambda data: b"[]",
    "bit-flip-in-record": lambda data: _flip(data, data.index(b'"base"') + 2),
    "bit-flip-in-log_seq": lambda data: _flip(data, data.index(b'"log_seq":0') + 10),
    "record-line-deleted": lambda data: _delete_line(data, 1),
    "data-after-trailer": lambda data: data + frame(b"{}"),
    "other-format": lambda data: data.replace(b"botmesh.file_kv", b"something.else"),
    "other-format-reframed": lambda data: _reframed_header(data, format="something.else"),
    "count-edited-reframed": lambda data: _reframed_header(data, records=2),
    "extra-header-field-reframed": lambda data: _reframed_header(data, extra=1),
    "malformed-record-reframed": lambda data: _with_rows(data, lambda rows: [[*r[:3], "one", *r[4:]] for r in rows]),
    "duplicate-record-reframed": lambda data: _with_rows(data, lambda rows: rows + rows),
    "nan-due-reframed": lambda data: _reframed_record(data, b'["scope-a","inbox","base",1,NaN,null,{"n":0}]'),
    "huge-number-due-reframed": lambda data: _reframed_record(
        data, b'["scope-a","inbox","base",1,1' + b"0" * 400 + b',null,{"n":0}]'
    ),
    "deep-nesting-reframed": lambda data: _reframed_record(data, b"[" * 100_000),
    "infinity-in-value-reframed": lambda data: _reframed_record(data, b'["scope-a","inbox","base",1,null,null,{"n":1e400}]'),
    "not-ascii-reframed": lambda data: _reframed_record(data, b'["scope-a","inbox","b\xed\xa0\x80se",1,null,null,{}]'),
}


def _reframed_record(data: bytes, payload: bytes) -> bytes:
    """The snapshot with its (only) record line replaced by ``payload``, framed, and the
    file checksum recomputed."""
    payloads = unframe(data)
    body = frame(payloads[0]) + frame(payload)
    return body + frame(_js({"end": 1, "crc32": f"{zlib.crc32(body):08x}"}))


def assert_points_at_a_line(error: JournalCorruptError, data: bytes) -> None:
    """``line`` and ``byte`` of ``error`` name the same line of ``data``: byte is where the
    line starts (0 or just after a newline) and line counts the newlines before it."""
    line, byte = error.line, error.byte  # type: ignore[attr-defined]
    assert isinstance(line, int) and isinstance(byte, int) and line >= 1
    assert 0 <= byte <= len(data) and (byte == 0 or data[byte - 1 : byte] == b"\n"), (line, byte)
    assert data[:byte].count(b"\n") == line - 1, (line, byte)
    if error.code != "JOURNAL_VERSION_UNSUPPORTED":  # that one names the version instead
        assert f"line {line}" in str(error) and f"byte {byte}" in str(error)


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("damage", list(SNAPSHOT_DAMAGE), ids=list(SNAPSHOT_DAMAGE))
def test_damaged_snapshot_is_rejected_untouched(tmp_path: Path, damage: str) -> None:
    """BACK-5: a snapshot that cannot be read back — cut, bit-flipped, a line deleted, or,
    with every checksum right, a wrong count, shape, NaN, a 400-digit or infinite number,
    100,000 ``[``, bytes that are not ASCII — raises JournalCorruptError with code
    SNAPSHOT_CORRUPT naming the file, the line and the byte; no file is changed (the
    leftover log neither), the lock is released, and a repaired journal opens."""
    path = tmp_path / "j.json"
    run(build_journal(path))
    good = path.read_bytes()
    bad = SNAPSHOT_DAMAGE[damage](good)
    assert bad != good
    path.write_bytes(bad)
    before = files_of(tmp_path)
    del before["j.json.lock"]  # the dead owner's lock: the failed open took it over

    async def main() -> None:
        with pytest.raises(JournalCorruptError) as caught:
            await opened(path, append_log=True)
        assert caught.value.code == "SNAPSHOT_CORRUPT"
        assert caught.value.file == str(path.resolve())  # type: ignore[attr-defined]
        assert str(path.resolve()) in str(caught.value)
        assert_points_at_a_line(caught.value, bad)
        assert files_of(tmp_path) == before
        path.write_bytes(good)
        kv = await opened(path)  # the lock was not left behind
        assert [key for key, _ in await kv.scan(S, "inbox")] == ["base", "k1", "k2", "k3"]
        await kv.close()

    run(main())


TORN_TAILS: dict[str, bytes] = {
    "prefix-of-an-entry": put_line(4, "k4", 1, {"n": 4})[:30],
    "prefix-of-the-length": b"15",
    "unframed-prefix": b'{"seq":4,"op":"put","scope":"scope-a","spa',
    "zeros": b"\x00" * 37,
    "complete-entry-without-newline": put_line(4, "k4", 1, {"n": 4}).rstrip(b"\n"),
}


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("append_log", [True, False], ids=["append-log", "snapshot"])
@pytest.mark.parametrize("tail", list(TORN_TAILS), ids=list(TORN_TAILS))
def test_half_written_last_line_is_trimmed(tmp_path: Path, tail: str, append_log: bool) -> None:
    """BACK-5: an incomplete final log line — bytes after the last newline that never got
    their terminator: a prefix of an entry, the zeros a power cut leaves — is a torn write:
    it is cut off (the log truncated to the end of the last complete line) and the rest
    replayed. Without append_log the log is then folded and removed."""
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


def _holed(log: bytes, line: bytes, end_offset: int = 0) -> bytes:
    """``log`` + ``line`` with the line's bytes zeroed from its start up to the first
    512-byte boundary of the file inside it (moved by ``end_offset``): what a power cut
    leaves of an append crossing a page boundary when only the later page was written."""
    start = len(log)
    boundary = (start // 512 + 1) * 512 + end_offset
    assert start < boundary < start + len(line) - 1
    data = log + line
    return data[:start] + b"\x00" * (boundary - start) + data[boundary:]


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("append_log", [True, False], ids=["append-log", "snapshot"])
def test_a_final_line_with_a_power_cut_hole_is_trimmed(tmp_path: Path, append_log: bool) -> None:
    """BACK-5: a final line that reached its newline, but whose start is zeros up to a
    sector boundary (the power-cut file system's subset cut of a held fsync made this
    of a real FileKv: the write split at the page boundary, only the later page kept),
    was never fsynced, so never acknowledged: it is trimmed like a torn write."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    good_log = log.read_bytes()
    log.write_bytes(_holed(good_log, put_line(4, "k4", 1, {"n": "x" * 1200})))

    async def main() -> None:
        kv = await opened(path, append_log=append_log)
        assert [key for key, _ in await kv.scan(S, "inbox")] == ["base", "k1", "k2", "k3"]
        if append_log:
            assert log.read_bytes() == good_log
        else:
            assert not log.exists()
        await kv.close()

    run(main())


@pytest.mark.spec("BACK-5")
def test_a_lost_page_swallowing_complete_acknowledged_lines_is_corruption(tmp_path: Path) -> None:
    """BACK-5: a page of zeros that starts inside one line (after its length and
    checksum) and runs over the newlines of the complete, acknowledged lines after it,
    into the last one, leaves one "final line" with a sector-aligned hole — but its length says it ended
    long before the file does: damage, refused, not trimmed as a torn write (trimming
    silently dropped three acknowledged records: the corruption part found it)."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    good_log = log.read_bytes()
    lines = [put_line(4 + i, f"k{4 + i}", 1, {"n": str(i) * 700}) for i in range(4)]
    data = good_log + b"".join(lines)
    first_end = len(good_log) + len(lines[0])
    hole = (len(good_log) // 512 + 1) * 512  # a sector boundary inside the first new line
    assert len(good_log) + 40 < hole < first_end
    last_start = len(data) - len(lines[-1])
    end = (last_start // 512 + 1) * 512  # ends inside the last line: its newline is the only one left after the hole
    assert first_end < last_start < end < len(data) - 1
    log.write_bytes(data[:hole] + b"\x00" * (end - hole) + data[end:])

    async def main() -> None:
        with pytest.raises(JournalCorruptError) as refused:
            await opened(path, append_log=True)
        assert refused.value.code == "APPEND_LOG_CORRUPT"

    run(main())
    assert log.read_bytes()[:hole] == data[:hole]  # nothing cut off by the refused open


def _replace_line(log: bytes, index: int, new: bytes | None) -> bytes:
    lines = log.splitlines(keepends=True)
    if new is None:
        del lines[index]
    else:
        lines[index] = new
    return b"".join(lines)


def _edit_entry(log: bytes, index: int, **changes: Any) -> bytes:
    """The log with the (first) entry of commit line ``index`` edited and framed again
    (right checksum)."""
    lines = log.splitlines(keepends=True)
    commit = json.loads(unframe(lines[index])[0])
    commit[0].update(changes)
    lines[index] = frame(_js(commit))
    return b"".join(lines)


def _unwrap(log: bytes, index: int) -> bytes:
    """The log with commit line ``index`` written as log version 2 wrote an entry: the
    entry object itself, not in an array (right checksum)."""
    lines = log.splitlines(keepends=True)
    (entry,) = json.loads(unframe(lines[index])[0])
    lines[index] = frame(_js(entry))
    return b"".join(lines)


def _edit_payload(log: bytes, index: int, old: bytes, new: bytes) -> bytes:
    """The log with ``old`` replaced by ``new`` in the payload of line ``index``, framed
    again (right checksum)."""
    lines = log.splitlines(keepends=True)
    payload = unframe(lines[index])[0]
    assert old in payload
    lines[index] = frame(payload.replace(old, new))
    return b"".join(lines)


def _swap_lines(log: bytes, a: int, b: int) -> bytes:
    lines = log.splitlines(keepends=True)
    lines[a], lines[b] = lines[b], lines[a]
    return b"".join(lines)


def _line_start(log: bytes, index: int) -> int:
    return sum(len(part) for part in log.splitlines(keepends=True)[:index])


# name -> (how to damage the log of build_journal — line 1 the header, lines 2..4 the
# entries seq 1..3 —, the line expected in the error). Every one is APPEND_LOG_CORRUPT:
# damage to a complete line, the last one included, is never taken for a torn write.
LOG_DAMAGE: dict[str, tuple[Callable[[bytes], bytes], int]] = {
    "garbage-middle-line": (lambda log: _replace_line(log, 2, b"{garbage\n"), 3),
    "zeros-middle-line": (lambda log: _replace_line(log, 2, b"\x00\x00\x00\n"), 3),
    "torn-first-line-then-entries": (lambda log: _replace_line(log, 1, b'{"seq":1,"op\n'), 2),
    "unframed-entry": (lambda log: _replace_line(log, 2, unframe(log.splitlines(keepends=True)[2])[0] + b"\n"), 3),
    "bit-flip-in-last-line": (lambda log: _flip(log, _line_start(log, 3) + 40, 3), 4),
    "bit-flip-in-length": (lambda log: _flip(log, _line_start(log, 2), 0), 3),
    "bit-flip-in-checksum": (lambda log: _flip(log, _line_start(log, 3) + 4, 1), 4),
    "last-newline-replaced": (lambda log: log[:-1] + b" ", 4),
    "bit-flip-in-header": (lambda log: _flip(log, 20, 2), 1),
    "header-version-a-string": (
        lambda log: _replace_line(log, 0, frame(b'{"format":"botmesh.file_kv.log","version":"2"}')),
        1,
    ),
    "not-an-entry-last-line": (lambda log: _edit_entry(log, 3, op="zap"), 4),
    "extra-field": (lambda log: _edit_entry(log, 3, extra=True), 4),
    "not-an-entry-middle": (lambda log: _replace_line(log, 2, frame(b"[1,2]")), 3),
    "entry-not-in-a-commit": (lambda log: _unwrap(log, 2), 3),
    "last-entry-not-in-a-commit": (lambda log: _unwrap(log, 3), 4),
    "empty-commit": (lambda log: _replace_line(log, 2, frame(b"[]")), 3),
    "nan-due": (lambda log: _edit_payload(log, 3, b'"due":3.0', b'"due":NaN'), 4),
    "400-digit-due": (lambda log: _edit_payload(log, 3, b'"due":3.0', b'"due":3' + b"0" * 400), 4),
    "infinite-due": (lambda log: _edit_payload(log, 3, b'"due":3.0', b'"due":1e400'), 4),
    "deep-nesting": (lambda log: _replace_line(log, 2, frame(b"[" * 100_000)), 3),
    "not-ascii": (lambda log: _edit_payload(log, 2, b'"k2"', b'"k\xc3\xa9"'), 3),
    "version-gap": (lambda log: _edit_entry(log, 3, version=5), 4),
    "delete-of-absent-key": (lambda log: _replace_line(log, 3, del_line(3, "nope", 1)), 4),
    "sequence-gap": (lambda log: _replace_line(log, 2, None), 3),
    "duplicate-last-line": (lambda log: log + log.splitlines(keepends=True)[3], 5),
    "swapped-lines": (lambda log: _swap_lines(log, 2, 3), 3),
    "sequence-starts-after-snapshot": (
        lambda log: _edit_entry(_edit_entry(_edit_entry(log, 1, seq=7), 2, seq=8), 3, seq=9),
        2,
    ),
    "unparseable-complete-last-line": (lambda log: log + b'{"seq":4,"op":"pu\n', 5),
    "unreadable-lines-then-a-torn-one": (lambda log: log + b"garbage\n\x00\x00\n{", 5),
    "complete-frame-then-garbage-without-newline": (lambda log: log + put_line(4, "k4", 1, {}).rstrip(b"\n") + b"xx", 5),
    # a hole that does not end on a sector boundary is not what a power cut leaves
    "nul-run-in-last-line-off-the-sector": (lambda log: _holed(log, put_line(4, "k4", 1, {"n": "x" * 1200}), -1), 5),
    # a power-cut hole with an entry after it: that entry's fsync would have filled it
    "sector-hole-then-an-entry": (
        lambda log: _holed(log, put_line(4, "k4", 1, {"n": "x" * 1200})) + put_line(5, "k5", 1, {"n": 5}),
        5,
    ),
}


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("append_log", [True, False], ids=["append-log", "snapshot"])
@pytest.mark.parametrize("damage", list(LOG_DAMAGE), ids=list(LOG_DAMAGE))
def test_damaged_log_entry_is_append_log_corrupt(tmp_path: Path, damage: str, append_log: bool) -> None:
    """BACK-5: a complete log line (one ending in its newline) with a wrong length or
    checksum, that is not a valid entry or does not apply (a version or sequence gap) —
    in the middle or last — makes open() raise code APPEND_LOG_CORRUPT with file, line
    (1-based) and byte (start of that line); both files stay byte-for-byte as they were
    and nothing is applied (the journal can be opened once repaired)."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    good_log = log.read_bytes()
    mutate, line = LOG_DAMAGE[damage]
    bad_log = mutate(good_log)
    log.write_bytes(bad_log)
    byte = _line_start(bad_log, line - 1)
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


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("log_seq", [1, 2, 3, 9], ids=lambda n: f"log_seq={n}")
def test_log_seq_edited_upwards_is_corruption_not_skipped_entries(tmp_path: Path, log_seq: int) -> None:
    """BACK-5 (issue 13): a snapshot whose log_seq was raised — every checksum recomputed,
    so only the sequence check can tell — beside the log seq 1..3 would skip entries the
    snapshot never received. Entries at or before log_seq are skipped only when the
    snapshot holds what they wrote, and they must reach log_seq: otherwise
    APPEND_LOG_CORRUPT naming the log, and no file changes."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    path.write_bytes(_reframed_header(path.read_bytes(), log_seq=log_seq))
    before = files_of(tmp_path)
    del before["j.json.lock"]

    async def main() -> None:
        for append_log in (False, True):
            with pytest.raises(JournalCorruptError) as caught:
                await opened(path, append_log=append_log)
            assert caught.value.code == "APPEND_LOG_CORRUPT"
            assert caught.value.file == str(log.resolve())  # type: ignore[attr-defined]
            assert_points_at_a_line(caught.value, log.read_bytes())
            assert files_of(tmp_path) == before

    run(main())


@pytest.mark.spec("BACK-5")
def test_a_snapshot_that_holds_the_folded_entries_skips_them(tmp_path: Path) -> None:
    """BACK-4, BACK-5: the legitimate counterpart of the test above — a crash between
    compaction's two steps leaves a snapshot at log_seq 3 that holds what entries 1..3
    wrote (the last write of each key) beside the untruncated log, plus entries appended
    after a compaction whose truncation failed: the folded entries are checked and
    skipped, the later ones applied."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    log.write_bytes(
        LOG_HEADER
        + put_line(1, "k1", 1, {"v": 1})
        + put_line(2, "gone", 1, {})
        + del_line(3, "gone", 1)
        + put_line(4, "k1", 2, {"v": 2}, due=1.0)
    )

    async def main() -> None:
        # The snapshot still holds "gone", which seq 3 deleted: it did not receive seq 3.
        path.write_bytes(snapshot_text(3, [[S, "inbox", "gone", 1, None, None, {}], [S, "inbox", "k1", 1, None, None, {"v": 1}]]))
        with pytest.raises(JournalCorruptError) as caught:
            await opened(path)
        assert caught.value.line == 4 and "log_seq 3" in str(caught.value)  # type: ignore[attr-defined]
        # It holds k1 at version 2: written by seq 4, not by the folded seq 1.
        path.write_bytes(snapshot_text(3, [[S, "inbox", "k1", 2, 1.0, None, {"v": 2}]]))
        with pytest.raises(JournalCorruptError) as caught:
            await opened(path)
        assert caught.value.line == 2  # type: ignore[attr-defined]
        path.write_bytes(snapshot_text(3, [[S, "inbox", "k1", 1, None, None, {"v": 1}]]))
        kv = await opened(path, append_log=True)
        assert await kv.scan(S, "inbox") == [("k1", Versioned({"v": 2}, 2))]
        assert await kv.range(S, "inbox", "due", upto=INF, limit=10) == [(1.0, "k1")]
        await kv.put(S, "inbox", "k2", {}, expected_version=0)
        assert [e["seq"] for e in log_lines(path)] == [1, 2, 3, 4, 5]
        await kv.close()

    run(main())


# ---------------------------------------------------------------------------------------
# Format versions: version 1 migrated, unknown versions refused (issue 13)
# ---------------------------------------------------------------------------------------


def _v1_journal(path: Path) -> dict[str, Any]:
    """A journal as the previous release wrote it (version 1): a snapshot at log_seq 2 and
    a log that continues it with seq 3..5, ±inf scores, non-ASCII text; returns what it
    holds."""
    log = Path(str(path) + ".log")
    path.write_bytes(
        snapshot_text_v1(
            2,
            [
                [S, "inbox", "a", 2, -INF, None, {"t": "héllo ☃"}],
                [S, "outbox", "o", 1, 5.0, INF, {"n": [1, {"x": None}]}],
            ],
        )
    )
    log.write_bytes(
        put_line_v1(3, "b", 1, {"n": 3}, due=INF)
        + put_line_v1(4, "a", 3, {"t": "again"}, due=2.5)
        + del_line_v1(5, "o", 1, space="outbox")
    )
    return {
        f"{S}/inbox": {
            "records": [("a", {"t": "again"}, 3), ("b", {"n": 3}, 1)],
            "due": [(2.5, "a"), (INF, "b")],
            "expires": [],
        },
        f"{S}/outbox": {"records": [], "due": [], "expires": []},
    }


@pytest.mark.spec("BACK-4", "BACK-5")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
def test_a_version_1_journal_is_migrated_at_open(
    tmp_path: Path, append_log: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 13: a journal of the previous release (version 1: no header, no checksums)
    opens with exactly its records and is rewritten in version 2 by that open — a
    version-2 snapshot holding everything, the log emptied to its header or removed —
    with a warning naming the file; it then reopens as a version-2 journal."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    expected = _v1_journal(path)

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="botmesh.core.file_backend"):
            kv = await opened(path, append_log=append_log)
        assert "format version 1" in caplog.text and str(path.resolve()) in caplog.text
        assert await dump(kv) == expected
        assert read_snapshot(path)["log_seq"] == 5
        if append_log:
            assert log.read_bytes() == LOG_HEADER
            await kv.put(S, "inbox", "c", {}, expected_version=0)
            assert [e["seq"] for e in log_lines(path)] == [6]
            kv.abandon()
        else:
            assert not log.exists()
            await kv.close()
        again = await opened(path)
        found = await dump(again)
        assert found[f"{S}/inbox"]["records"][:2] == expected[f"{S}/inbox"]["records"]
        await again.close()

    run(main())


@pytest.mark.spec("BACK-4", "BACK-5")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
@pytest.mark.parametrize("tail", ["whole", "torn-final-line", "folded-already"])
def test_a_version_2_log_is_folded_and_restarted_in_version_3_at_open(
    tmp_path: Path, append_log: bool, tail: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 16: a log of the release before (log version 2: one framed entry per line,
    no array), left by a crash, opens with exactly its entries — a torn final line cut,
    entries the snapshot already holds skipped — and that open folds it into the
    snapshot and restarts the log in version 3 (or removes it), with a warning naming
    the file: nothing is ever appended to a version-2 log, whose reader would take a
    commit line for damage."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    path.write_bytes(snapshot_text(2, [[S, "inbox", "a", 2, None, None, {"n": "a2"}]]))
    lines = [put_line_v2(1, "a", 1, {"n": "a1"}), put_line_v2(2, "a", 2, {"n": "a2"})]
    if tail != "folded-already":
        lines += [put_line_v2(3, "b", 1, {"n": "b1"}, due=4.0), put_line_v2(4, "a", 3, {"n": "a3"})]
    data = LOG_HEADER_V2 + b"".join(lines)
    if tail == "torn-final-line":
        data += put_line_v2(5, "c", 1, {"n": "c1"})[:25]
    log.write_bytes(data)
    if tail == "folded-already":
        want = [("a", {"n": "a2"}, 2)]
    else:
        want = [("a", {"n": "a3"}, 3), ("b", {"n": "b1"}, 1)]
    last_seq = 2 if tail == "folded-already" else 4

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="botmesh.core.file_backend"):
            kv = await opened(path, append_log=append_log)
        assert "format version 2" in caplog.text and str(path.resolve()) in caplog.text
        assert (await dump(kv))[f"{S}/inbox"]["records"] == want
        assert read_snapshot(path)["log_seq"] == last_seq
        if append_log:
            assert log.read_bytes() == LOG_HEADER
            await kv.put(S, "inbox", "c", {"n": "c"}, expected_version=0)
            assert [e["seq"] for e in log_lines(path)] == [last_seq + 1]
            kv.abandon()  # a crash: the next open replays the version-3 log
        else:
            assert not log.exists()
            await kv.close()
        again = await opened(path, append_log=append_log)
        got = (await dump(again))[f"{S}/inbox"]["records"]
        assert got == sorted(want + ([("c", {"n": "c"}, 1)] if append_log else []))
        await again.close()

    run(main())


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
def test_a_damaged_version_1_journal_is_refused_untouched(tmp_path: Path, append_log: bool) -> None:
    """Issue 13: version 1 is read with the rules of version 2 except the checksums it
    does not have: a complete log line that does not parse — also the last one — is
    APPEND_LOG_CORRUPT (only the unterminated final line is torn), and the bounds hold
    (NaN, 400 digits, 100,000 ``[``, an infinite value): JournalCorruptError, nothing
    migrated, no file changed."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    _v1_journal(path)
    good_snapshot, good_log = path.read_bytes(), log.read_bytes()
    last = good_log.splitlines(keepends=True)[-1]
    bad_logs = {
        "unparseable-last-line": good_log + b'{"seq":6,"op":"pu\n',
        "nan-due": good_log + put_line_v1(6, "z", 1, {}).replace(b'"due": null', b'"due": NaN'),
        "400-digit-due": good_log + put_line_v1(6, "z", 1, {}).replace(b'"due": null', b'"due": 1' + b"0" * 400),
        "deep-nesting": good_log + b"[" * 100_000 + b"\n",
        "infinity-in-value": good_log + put_line_v1(6, "z", 1, {}).replace(b'"value": {}', b'"value": {"x": Infinity}'),
        "invalid-utf-8": good_log.replace(b'"again"', b'"ag\xffin"'),
        "utf-8-surrogate": good_log.replace(b'"again"', b'"ag\xed\xa0\x80in"'),
        "torn-line-then-an-entry": good_log[: -len(last)] + last[:20] + b"\n" + last,
    }
    bad_snapshots = {
        "deep-nesting": b'{"format":"botmesh.file_kv","version":1,"log_seq":0,"records":' + b"[" * 100_000,
        "nan-due": good_snapshot.replace(b"5.0", b"NaN"),
        "extra-field": good_snapshot.replace(b'"log_seq"', b'"x":1,"log_seq"'),
        "future-version-unframed": good_snapshot.replace(b'"version": 1', b'"version": 9'),
    }

    async def main() -> None:
        cases = [(log, name, bad) for name, bad in bad_logs.items()]
        cases += [(path, name, bad) for name, bad in bad_snapshots.items()]
        for target, name, bad in cases:
            path.write_bytes(good_snapshot)
            log.write_bytes(good_log)
            target.write_bytes(bad)
            before = files_of(tmp_path)
            with pytest.raises(JournalCorruptError) as caught:
                await opened(path, append_log=append_log)
            assert caught.value.file == str(target.resolve()), name  # type: ignore[attr-defined]
            assert_points_at_a_line(caught.value, bad)
            assert files_of(tmp_path) == before, name
        # and the torn final line of a version-1 log is cut, the rest migrated
        path.write_bytes(good_snapshot)
        log.write_bytes(good_log + b'{"seq":6,"op":"put","sco')
        kv = await opened(path, append_log=append_log)
        assert [k for k, _ in await kv.scan(S, "inbox")] == ["a", "b"]
        await kv.close()

    run(main())


@pytest.mark.spec("BACK-5")
@pytest.mark.parametrize("which", ["snapshot", "log"])
def test_an_unknown_future_version_is_refused_naming_it(tmp_path: Path, which: str) -> None:
    """Issue 13: a file whose framed header names a format version this release does not
    know is refused — JournalCorruptError code JOURNAL_VERSION_UNSUPPORTED, ``version``
    and the message naming it — before anything is read or changed."""
    path = tmp_path / "j.json"
    log = Path(str(path) + ".log")
    run(build_journal(path))
    if which == "snapshot":
        path.write_bytes(_reframed_header(path.read_bytes(), version=3, more="a field of version 3"))
    else:
        log.write_bytes(frame(b'{"format":"botmesh.file_kv.log","version":7}') + b"\x00binary entries of v7\n")
    before = files_of(tmp_path)
    del before["j.json.lock"]
    target = path if which == "snapshot" else log
    version = 3 if which == "snapshot" else 7

    async def main() -> None:
        for append_log in (False, True):
            with pytest.raises(JournalCorruptError) as caught:
                await opened(path, append_log=append_log)
            error = caught.value
            assert error.code == "JOURNAL_VERSION_UNSUPPORTED"
            assert error.version == version  # type: ignore[attr-defined]
            assert error.file == str(target.resolve())  # type: ignore[attr-defined]
            assert f"format version {version}" in str(error) and "newer release" in str(error)
            assert (error.line, error.byte) == (1, 0)  # type: ignore[attr-defined]
            assert files_of(tmp_path) == before

    run(main())


@pytest.mark.spec("BACK-7")
@pytest.mark.parametrize("append_log", [False, True], ids=["snapshot", "append-log"])
def test_put_refuses_what_the_files_would_not_read_back(tmp_path: Path, append_log: bool) -> None:
    """Issue 13: the reader's bounds are the writer's: a NaN score, an int score too large
    for a float and a value nested deeper than 128 levels raise ValueError naming them
    before anything is written; 128 levels are stored and read back."""
    path = tmp_path / "j.json"

    def nested(depth: int) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for _ in range(depth - 1):
            value = {"d": value}
        return value

    async def main() -> None:
        kv = await opened(path, append_log=append_log)
        before = files_of(tmp_path)
        with pytest.raises(ValueError, match="due must not be NaN"):
            await kv.put(S, "inbox", "k", {}, expected_version=0, due=math.nan)
        with pytest.raises(ValueError, match="expires is out of the range of a float"):
            await kv.put(S, "inbox", "k", {}, expected_version=0, expires=10**400)
        with pytest.raises(ValueError, match=f"{S}/inbox/deep: the value nests deeper than 128"):
            await kv.put(S, "inbox", "deep", nested(129), expected_version=0)
        assert files_of(tmp_path) == before
        assert await kv.get(S, "inbox", "k") is None
        await kv.put(S, "inbox", "deep", nested(128), expected_version=0, due=10**300)
        kv.abandon()
        again = await opened(path)
        assert await again.get(S, "inbox", "deep") == Versioned(nested(128), 1)
        assert await again.range(S, "inbox", "due", upto=INF, limit=1) == [(1e300, "deep")]
        await again.close()

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
        # The log's header (written when the log is created at open), then the put.
        assert appends == [expect, expect] and writes == [("log.json.tmp", expect)]
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


@pytest.mark.spec("BACK-6")
def test_a_snapshot_made_from_the_last_ones_lines_is_the_same_file() -> None:
    """Issue 16: a snapshot takes again the line of every record whose entry is the very
    one the last snapshot wrote, instead of encoding its value again. The file is the same
    byte for byte as one made from nothing, after a record changed (a new entry under the
    same key and version order), another was deleted and a third added; the lines kept are
    the new snapshot's only."""
    from botmesh.core.file_format import SnapshotLines, parse_snapshot, snapshot_bytes

    kept: dict[str, Any] = {"a": ({"x": 1}, 1, None, None), "b": ({"y": [1.5, "z"], "n": None}, 2, 5.0, INF)}
    records: dict[tuple[str, str], dict[str, Any]] = {(S, "inbox"): kept}
    lines: SnapshotLines = {}
    first = snapshot_bytes(records, 3, lines)
    assert first == snapshot_bytes(records, 3)
    assert set(lines) == {(S, "inbox")} and set(lines[(S, "inbox")][1]) == {"a", "b"}
    line_b = lines[(S, "inbox")][1]["b"]
    changed = {(S, "inbox"): {"a": ({"x": 2}, 1, None, None), "b": kept["b"]},
               (S, "outbox"): {"k": ({"t": "\u00e9"}, 1, None, -INF)}}
    second = snapshot_bytes(changed, 4, lines)
    assert second == snapshot_bytes(changed, 4)  # "a" at the same version, another value: encoded anew
    assert parse_snapshot(second, "x").records == changed
    assert lines[(S, "inbox")][1]["b"] is line_b, "the line of the unchanged record is taken again"
    assert set(lines) == {(S, "inbox"), (S, "outbox")} and set(lines[(S, "outbox")][1]) == {"k"}
    assert lines[(S, "outbox")][0]["k"] is changed[(S, "outbox")]["k"]
    third = {(S, "outbox"): dict(changed[(S, "outbox")])}  # the inbox space gone, "k" unchanged
    assert snapshot_bytes(third, 5, lines) == snapshot_bytes(third, 5)
    assert set(lines) == {(S, "outbox")}, "the lines kept are the new snapshot's only"


@pytest.mark.spec("BACK-6")
@settings(max_examples=200, deadline=None, database=None)
@given(steps=st.lists(st.lists(st.tuples(st.sampled_from(["inbox", "outbox"]), st.sampled_from("abcdef"),
                                         st.sampled_from(["put", "same", "equal", "del"]), st.integers(0, 3)),
                               max_size=8), min_size=1, max_size=6))
def test_snapshots_made_one_after_another_from_kept_lines_are_the_files_made_from_nothing(
    steps: list[list[tuple[str, str, str, int]]],
) -> None:
    """Issue 16: a run of snapshots sharing one ``lines`` cache, the records changed
    between them by drawn writes — a new entry, the very same entry again, an *equal*
    but other tuple (which must be encoded anew, a line serves only the tuple it was made
    from), a delete — gives at each step exactly the file made from nothing; and the
    lines kept always serve the records of the last snapshot only."""
    from botmesh.core.file_format import SnapshotLines, parse_snapshot, snapshot_bytes

    records: dict[tuple[str, str], dict[str, Any]] = {}
    lines: SnapshotLines = {}
    for seq, writes in enumerate(steps, start=1):
        for space, key, op, n in writes:
            space_map = records.setdefault((S, space), {})
            if op == "del":
                space_map.pop(key, None)
            elif op == "same" and key in space_map:
                space_map[key] = space_map[key]
            elif op == "equal" and key in space_map:
                space_map[key] = tuple(space_map[key])
            else:
                space_map[key] = ({"n": n, "k": key}, n + 1, float(n), None)
        made = snapshot_bytes(records, seq, lines)
        assert made == snapshot_bytes(records, seq)
        assert parse_snapshot(made, "x").records == {k: v for k, v in records.items() if v}  # (no empty space)
        assert {(sc, sp, k) for (sc, sp), (_, kept) in lines.items() for k in kept} == {
            (sc, sp, k) for (sc, sp), m in records.items() for k in m}


_TEXT_STRINGS = st.text(alphabet=st.sampled_from(["a", "\u00e9", "\U0001f642", '"', "\\", "\n", "\x1f", "/", " "]),
                        max_size=10)
_JSON = st.recursive(
    st.one_of(_TEXT_STRINGS, st.integers(-10**20, 10**20), st.booleans(), st.none(),
              st.floats(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT_STRINGS, inner, max_size=4)),
    max_leaves=12,
)
_SCORES = st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-5, 5))


@pytest.mark.spec("BACK-6")
@settings(max_examples=300, deadline=None, database=None)
@given(rows=st.lists(st.tuples(_TEXT_STRINGS, st.dictionaries(_TEXT_STRINGS, _JSON, max_size=4),
                               st.integers(1, 10**6), _SCORES, _SCORES), max_size=5, unique_by=lambda r: r[0]))
def test_a_snapshot_taking_the_values_texts_of_their_writes_is_the_same_file(
    rows: list[tuple[str, dict[str, Any], int, Any, Any]],
) -> None:
    """Issue 16: a snapshot takes a value's JSON text as its write encoded it (the log
    line's) instead of encoding the value again. For drawn keys, values (multi-byte,
    escaped and control characters, big integers, floats) and scores (infinite ones
    included), the file is the one made from nothing, byte for byte, and the texts
    are used up."""
    from botmesh.core.file_format import ValueTexts, encode_value, snapshot_bytes

    space = {key: (value, version, due, expires) for key, value, version, due, expires in rows}
    records = {(S, "inbox"): space}
    texts: ValueTexts = {(S, "inbox", key): (entry, encode_value(entry[0], key)) for key, entry in space.items()}
    assert snapshot_bytes(records, 7, {}, texts) == snapshot_bytes(records, 7)
    assert texts == {}


@pytest.mark.spec("BACK-6")
def test_a_snapshot_that_failed_to_encode_leaves_the_kept_lines_true() -> None:
    """A record whose value cannot be encoded (here a set) makes the snapshot raise; the
    next snapshot made with the same kept lines, of records that changed again (back to
    the very entry of the first snapshot, and a delete), is still the file made from
    nothing."""
    from botmesh.core.file_format import SnapshotLines, snapshot_bytes

    first = ({"x": 1}, 1, None, None)
    records: dict[tuple[str, str], dict[str, Any]] = {(S, "inbox"): {"a": first, "b": ({"y": 2}, 1, None, None)}}
    lines: SnapshotLines = {}
    snapshot_bytes(records, 1, lines)
    records[(S, "inbox")]["a"] = ({"x": {1, 2}}, 2, None, None)
    records[(S, "inbox")]["c"] = ({"z": 3}, 1, None, None)
    with pytest.raises(TypeError):
        snapshot_bytes(records, 2, lines)
    records[(S, "inbox")]["a"] = first
    del records[(S, "inbox")]["b"]
    assert snapshot_bytes(records, 3, lines) == snapshot_bytes(records, 3)


def _reference_entry(seq: int, op: str, scope: str, space: str, key: str, version: int, entry: Any) -> str:
    """A log entry as ``json.dumps`` writes its object (the format's definition)."""
    obj: dict[str, Any] = {"seq": seq, "op": op, "scope": scope, "space": space, "key": key, "version": version}
    if entry is not None:
        obj.update(due=_score(entry[2]), expires=_score(entry[3]), value=entry[0])
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


@pytest.mark.spec("BACK-4", "BACK-5")
@settings(max_examples=400, deadline=None, database=None)
@given(seq=st.integers(1, 2**63 - 1), version=st.integers(1, 2**63 - 1), scope=_TEXT_STRINGS, space=_TEXT_STRINGS,
       key=_TEXT_STRINGS, value=st.dictionaries(_TEXT_STRINGS, _JSON, max_size=4), due=_SCORES, expires=_SCORES,
       delete=st.booleans())
def test_a_log_entry_is_the_json_of_its_object(
    seq: int, version: int, scope: str, space: str, key: str, value: dict[str, Any], due: Any, expires: Any,
    delete: bool,
) -> None:
    """Issue 16: ``log_entry`` composes an entry's text field by field (one encoder call
    less per write); for drawn fields — strings with multi-byte, escaped and control
    characters, 63-bit counters, scores finite, infinite, integral or None — it is
    exactly ``json.dumps`` of the entry's object, and the reader gives the entry back."""
    from botmesh.core.file_format import LOG_HEADER as HEADER
    from botmesh.core.file_format import log_commit, log_entry, scan_log

    entry = None if delete else (value, version, due, expires)
    text = log_entry(seq, "del" if delete else "put", scope, space, key, version, entry)
    assert text == _reference_entry(seq, "del" if delete else "put", scope, space, key, version, entry)
    (read,) = scan_log(HEADER + log_commit([text]), "j.log").entries
    assert (read.seq, read.scope, read.space, read.key, read.version) == (seq, scope, space, key, version)
    if not delete:
        assert (read.value, read.due, read.expires) == (value, due, expires)


@pytest.mark.spec("BACK-6")
def test_a_values_text_serves_only_the_very_entry_it_was_encoded_for() -> None:
    """A text kept for an earlier entry of the record (another tuple, even one equal to
    the present entry) is not taken: the value is encoded from the entry."""
    from botmesh.core.file_format import ValueTexts, snapshot_bytes

    entry = ({"x": 1}, 2, None, None)
    records = {(S, "inbox"): {"a": entry}}
    texts: ValueTexts = {(S, "inbox", "a"): (({"x": 1}, 2, None, None), '{"x":"stale"}')}
    data = snapshot_bytes(records, 1, {}, texts)
    assert b"stale" not in data and data == snapshot_bytes(records, 1)
    texts = {(S, "inbox", "a"): (entry, '{"x":"taken"}')}
    assert b'{"x":"taken"}' in snapshot_bytes(records, 1, {}, texts), "the text of the very entry is taken"


@pytest.mark.spec("BACK-6")
@settings(max_examples=300, deadline=None, database=None)
@given(value=_JSON)
def test_the_files_encoder_writes_what_the_json_module_writes(value: Any) -> None:
    """The one reusable C encoder the file format (and the Redis kv) encode checked
    values with gives the text ``json.dumps`` gives with the format's options, and so
    does its fallback without the C accelerator."""
    from botmesh.core import file_format, spi

    expected = json.dumps(value, separators=(",", ":"), allow_nan=False)
    assert file_format._dumps(value) == expected
    c_encode = spi._C_ENCODE
    try:
        spi._C_ENCODE = None
        assert file_format._dumps(value) == expected
    finally:
        spi._C_ENCODE = c_encode


@pytest.mark.parametrize("append_log", [False, True])
@pytest.mark.spec("BACK-6", "BACK-4")
def test_the_snapshot_on_file_is_the_one_its_records_make(tmp_path: Path, append_log: bool) -> None:
    """Snapshot-only writes (each rewrites the snapshot) and folds of the log (every 3
    entries here, and at close) reuse the lines of records not written since: what is on
    file is still exactly the snapshot of the kv's records made from nothing, and a reopen
    reads them back."""
    from botmesh.core.file_format import snapshot_bytes

    path = tmp_path / "j.json"

    async def main() -> None:
        kv = FileKv(str(path), append_log=True, compact_every=3) if append_log else FileKv(str(path))
        await kv.open()
        writes: list[Callable[[], Awaitable[Any]]] = [
            *(lambda i=i: kv.put(S, "inbox", f"k{i}", {"i": i, "deep": {"l": [i, "x"]}}, expected_version=0,
                                 due=float(i)) for i in range(7)),
            lambda: kv.put(S, "inbox", "k2", {"i": 20}, expected_version=1),
            lambda: kv.delete(S, "inbox", "k4", expected_version=1),
            lambda: kv.put(S, "outbox", "o", {"t": "ok"}, expected_version=0, expires=INF),
            lambda: kv.put(S, "inbox", "k5", {"i": 50}, expected_version=1),
        ]
        for write in writes:
            await write()
            if not append_log:
                assert path.read_bytes() == snapshot_bytes(kv._records, kv._seq)
        records = {k: dict(v) for k, v in kv._records.items()}
        seq = kv._seq
        await kv.close()
        assert path.read_bytes() == snapshot_bytes(records, seq)
        again = FileKv(str(path), append_log=append_log)
        await again.open()
        assert again._records == records
        await again.close()

    run(main())
