"""Damage SQLite accepts silently, refused by the SQLite backend (issue 13, BACK-5):
a flipped bit inside a value (row checksums), a damaged frame of the write-ahead log
before its last transaction (the log checked at open), a schema version this release
does not know; and the migration of a version-1 file. Each test first shows what SQLite
alone does with the same bytes, so it fails if the backend stops checking."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from botmesh.core.errors import JournalCorruptError
from botmesh.sqlite_store import SQLiteKv
from botmesh.sqlite_store._db import SCHEMA_VERSION
from botmesh.sqlite_store._integrity import row_crc

SCOPE, SPACE = "s", "inbox"
HEADER, FRAME = 32, 24 + 4096


def put_all(kv: SQLiteKv, values: dict[str, str]) -> None:
    async def body() -> None:
        await kv.open()
        for key, text in values.items():
            await kv.put(SCOPE, SPACE, key, {"text": text}, expected_version=0)

    asyncio.run(body())


def read_all(path: Path) -> dict[str, Any]:
    async def body() -> dict[str, Any]:
        kv = SQLiteKv(path)
        try:
            return {k: v.value for k, v in await kv.scan(SCOPE, SPACE, limit=100)}
        finally:
            await kv.close()

    return asyncio.run(body())


def flip(path: Path, at: int, bit: int = 1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= bit
    path.write_bytes(bytes(data))


@pytest.mark.spec("BACK-5")
def test_a_flipped_bit_inside_a_value_is_refused_not_returned(tmp_path: Path) -> None:
    db = tmp_path / "bot.db"
    kv = SQLiteKv(db)
    put_all(kv, {"a": "hello 1", "b": "hello 2"})
    asyncio.run(kv.close())  # the last connection: checkpointed into the database file
    data = db.read_bytes()
    flip(db, data.index(b"hello 2") + 4)  # 'o' -> 'n'
    with sqlite3.connect(db) as raw:  # SQLite alone: the structure is intact, the value altered
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert json.loads(raw.execute("SELECT value FROM durable WHERE key = 'b'").fetchone()[0]) == {"text": "helln 2"}
    with pytest.raises(JournalCorruptError) as info:
        read_all(db)
    assert info.value.code == "ROW_CHECKSUM" and info.value.details["file"] == str(db)
    assert "'s'/'inbox'/'b'" in str(info.value) and str(db) in str(info.value)

    async def get_a() -> Any:  # an undamaged record is still read
        kv = SQLiteKv(db)
        try:
            return await kv.get(SCOPE, SPACE, "a")
        finally:
            await kv.close()

    assert asyncio.run(get_a()).value == {"text": "hello 1"}


def crash_image(tmp_path: Path, batches: list[dict[str, str]]) -> Path:
    """Commit each batch as one transaction per key, the kv left open (as a crash leaves
    it), and copy the database and its log (not the -shm) to ``image/``."""
    db = tmp_path / "live" / "bot.db"
    db.parent.mkdir()
    kv = SQLiteKv(db)
    for batch in batches:
        put_all(kv, batch)
    image = tmp_path / "image"
    image.mkdir()
    for suffix in ("", "-wal"):
        shutil.copy(str(db) + suffix, str(image / "bot.db") + suffix)
    asyncio.run(kv.close())
    return image / "bot.db"


def frames(wal: Path) -> list[tuple[int, int]]:
    """``(page, commit)`` of each frame of a log."""
    data = wal.read_bytes()
    out = []
    for at in range(HEADER, len(data) - FRAME + 1, FRAME):
        out.append((int.from_bytes(data[at:at + 4], "big"), int.from_bytes(data[at + 4:at + 8], "big")))
    return out


def sqlite_alone(db: Path) -> set[str]:
    with sqlite3.connect(db) as raw:
        return {row[0] for row in raw.execute("SELECT key FROM durable")}


@pytest.mark.spec("BACK-5")
def test_a_damaged_log_frame_before_the_last_transaction_is_refused(tmp_path: Path) -> None:
    db = crash_image(tmp_path, [{f"k{i}": f"value {i}" for i in range(6)}])
    wal = Path(str(db) + "-wal")
    log = frames(wal)
    commits = [n for n, (_, commit) in enumerate(log, 1) if commit]
    assert len(commits) >= 6, log  # the schema, then one transaction per key
    target = commits[2]  # the commit frame of an early put: later ones follow it
    flip(wal, HEADER + (target - 1) * FRAME + 24 + 100)
    damaged = tmp_path / "damaged"
    shutil.copytree(db.parent, damaged)
    assert len(sqlite_alone(damaged / "bot.db")) < 6  # SQLite alone drops the later transactions
    with pytest.raises(JournalCorruptError) as info:
        read_all(db)
    assert info.value.code == "WAL_CORRUPT"
    assert info.value.details["file"] == str(wal) and info.value.details["frame"] == target
    assert f"frame {target}" in str(info.value)


@pytest.mark.spec("BACK-5")
def test_a_damaged_frame_of_the_last_transaction_drops_it_as_a_power_cut_would(tmp_path: Path) -> None:
    """The last transaction's frames are what a power cut during its commit tears: SQLite
    drops it and the backend opens on the transactions before it (documented)."""
    db = crash_image(tmp_path, [{f"k{i}": f"value {i}" for i in range(4)}])
    wal = Path(str(db) + "-wal")
    last = len(frames(wal))
    flip(wal, HEADER + (last - 1) * FRAME + 24 + 7)
    assert set(read_all(db)) == {"k0", "k1", "k2"}


@pytest.mark.spec("BACK-5")
def test_a_damaged_log_header_before_committed_frames_is_refused(tmp_path: Path) -> None:
    db = crash_image(tmp_path, [{f"k{i}": f"value {i}" for i in range(3)}])
    wal = Path(str(db) + "-wal")
    wal.write_bytes(bytes(HEADER) + wal.read_bytes()[HEADER:])
    with pytest.raises(JournalCorruptError) as info:
        read_all(db)
    assert info.value.code == "WAL_CORRUPT" and "the log's header" in str(info.value)


@pytest.mark.spec("BACK-5")
def test_a_version_1_file_is_migrated_and_a_newer_version_refused(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as raw:  # what release 1 wrote: no crc column, user_version 1
        raw.execute("CREATE TABLE durable (scope TEXT NOT NULL, space TEXT NOT NULL, key TEXT NOT NULL, "
                    "value TEXT NOT NULL, version INTEGER NOT NULL, due REAL, expires REAL, "
                    "PRIMARY KEY (scope, space, key)) WITHOUT ROWID")
        raw.execute("INSERT INTO durable VALUES ('s', 'inbox', 'old', '{\"text\": \"kept\"}', 3, 12.5, NULL)")
        raw.execute("PRAGMA user_version = 1")
    assert read_all(db) == {"old": {"text": "kept"}}
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        crc = raw.execute("SELECT crc FROM durable").fetchone()[0]
    assert crc == row_crc("s", "inbox", "old", '{"text": "kept"}', 3, 12.5, None)
    with sqlite3.connect(db) as raw:
        raw.execute("PRAGMA user_version = 7")
    with pytest.raises(JournalCorruptError) as info:
        read_all(db)
    assert info.value.code == "JOURNAL_VERSION_UNSUPPORTED" and info.value.details["version"] == 7
    assert "schema version 7" in str(info.value) and str(db) in str(info.value)


@pytest.mark.spec("BACK-5", "BACK-6")
def test_a_last_transaction_with_a_frame_lost_in_a_power_cut_opens_without_it(tmp_path: Path) -> None:
    """A power cut during the last commit may keep its commit frame and lose an earlier
    frame of it (a hole of zeros, the writes were not synced yet): that is no damage of
    acknowledged data, the bot must start; SQLite drops the transaction."""
    db = crash_image(tmp_path, [{f"k{i}": f"value {i}" for i in range(4)}])
    wal = Path(str(db) + "-wal")
    log = frames(wal)
    commits = [n for n, (_, commit) in enumerate(log, 1) if commit]
    first_of_last = commits[-2] + 1
    assert commits[-1] > first_of_last, log  # the last transaction has more than its commit frame
    data = bytearray(wal.read_bytes())
    at = HEADER + (first_of_last - 1) * FRAME
    data[at:at + FRAME] = bytes(FRAME)
    wal.write_bytes(bytes(data))
    assert set(read_all(db)) == {"k0", "k1", "k2"}


@pytest.mark.spec("REPL-4", "BACK-5")
def test_opening_the_journals_keeps_the_locks_of_this_process_other_connections(tmp_path: Path) -> None:
    """The write-ahead-log check at open reads the page size from the connection, never
    by opening the database file: closing that file would drop every POSIX lock of the
    process on it, the shared lock of its live connections too, and another process
    closing its last connection would then delete the log under them (found by
    explore's bursts of real processes, issue 12: "database disk image is malformed" at
    the second burst). A process holds the journals open, opens them a second time, and
    two bursts of 4 processes journal beside it: every record is there, the file whole."""
    from botmesh_testkit.backends.base import SQLiteSpec
    from botmesh_testkit.conformance.durability.records import inbound, outbound
    from botmesh_testkit.kill.contention import journal_race
    from botmesh_testkit.kill.workers import run_workers

    path = str(tmp_path / "bot.db")

    async def body() -> None:
        held = SQLiteKv(path)
        await held.open()
        second = SQLiteKv(path)  # an open in a process that already holds the file (the check runs again)
        await second.open()
        try:
            for burst in range(2):
                ids = ["r0", "r1", "r2"]
                params = {"scope": f"s{burst}", "inbox": [inbound(i).to_json() for i in ids],
                          "outbox": [outbound(i).to_json() for i in ids]}
                run = await asyncio.to_thread(run_workers, SQLiteSpec(path), journal_race, processes=4, seed=burst,
                                              params=params, timeout=45)
                assert not run.failures, run.describe_failures()
                for i in ids:
                    assert await held.get(f"s{burst}", "inbox", i) is not None, (burst, i)
        finally:
            await second.close()
            await held.close()

    asyncio.run(body())
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


@pytest.mark.spec("BACK-6")
def test_the_row_checksum_is_the_one_files_written_by_earlier_releases_carry() -> None:
    """Issue 16 rewrote how ``row_crc`` builds its text: a file written before must
    still check. The checksum, as schema version 2 defines it: CRC-32 of the fields, each
    prefixed by its length and ``:`` (version, due and expires in their ``repr``), then
    of the value's UTF-8 — here from drawn fields, multi-byte and lone surrogates
    included, and the checksums the release before (98ec059) computed for two rows."""
    import zlib

    from hypothesis import given, settings
    from hypothesis import strategies as st

    def v2_checksum(fields: tuple[str, ...], value: str) -> int:
        head = "".join(f"{len(f)}:{f}" for f in fields).encode("utf-8", "surrogatepass")
        return zlib.crc32(value.encode("utf-8", "surrogatepass"), zlib.crc32(head))

    text = st.text(alphabet=st.sampled_from(["a", ":", "1", "\u00e9", "\U0001f642", "\ud800", " "]), max_size=8)
    scores = st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-3, 3))

    @settings(max_examples=300, deadline=None, database=None)
    @given(scope=text, space=text, key=text, value=text, version=st.integers(1, 10**12), due=scores,
           expires=scores)
    def same(scope: str, space: str, key: str, value: str, version: int, due: Any, expires: Any) -> None:
        fields = (scope, space, key, repr(version), repr(due), repr(expires))
        assert row_crc(scope, space, key, value, version, due, expires) == v2_checksum(fields, value)

    same()
    assert row_crc("s", "inbox", "old", '{"text": "kept"}', 3, 12.5, None) == 3424305364
    assert row_crc("-/-/bot/default", "outbox", "m4:1", '{"k":"\u00e9"}', 2, None, 1797157415148.9824) == 3383250734
