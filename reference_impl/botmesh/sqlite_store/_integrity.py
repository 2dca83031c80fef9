"""Damage the SQLite engine would accept silently, found at open (issue 13, BACK-5).

SQLite checks the structure of its b-trees when it reads them, but not the bytes of a
value, and it drops the frames of a write-ahead log from the first one whose checksum
fails, by design: a frame torn by a power cut belongs to a transaction that never
committed. Three checks close the gap for the journals (table ``durable``):

**Row checksums.** Every row of ``durable`` carries ``crc``, the CRC-32 of its scope,
space, key, value, version, due and expires (:func:`row_crc`), written with the row and
checked on every read: a bit flipped inside a value is refused
(:class:`~botmesh.core.errors.JournalCorruptError`, ``code="ROW_CHECKSUM"``, naming the
file and the record) rather than returned. Schema version 2 added the column; a version-1
file is migrated when first opened (the column added and filled, in the open's
transaction). Cost: about what decoding the value's JSON costs, per row written or read
(9 µs against 7 µs for a 300-byte value, measured on two busy cores).

**The table's integrity at open.** ``PRAGMA integrity_check(durable)`` runs when the
journals' connection opens: the b-trees of the table and its two indexes, and that every
index entry matches its row (a damaged index would hide a due record from ``range``).
Measured: about 30 ms per 10,000 records, 0.36 s per 100,000 (SQLite 3.40, one core);
journals are purged as they settle, so this is paid once per start on a few thousand
rows. The store's tables are not checked (not the journals').

**The write-ahead log at open** (:func:`check_wal`). With ``synchronous=FULL`` every
commit syncs its frames before it returns, and the next transaction's frames are written
only after that, so a frame failing its checksum *before the last transaction* of the
log can only be damage of committed, acknowledged data; SQLite would open on the frames
before it and silently lose every later transaction. It is refused
(``code="WAL_CORRUPT"``, naming the ``-wal`` file, the frame and its byte). A damaged
frame *within the last transaction* is what a power cut during that commit leaves (its
frames were not yet synced, some may be stale or missing): SQLite's own behaviour —
the transaction dropped — is kept, as it must be for a bot to start after a power cut;
were that commit acknowledged, its loss is the one the format cannot tell from a torn
write (as a journal file truncated at a record boundary). Likewise a log that merely
ends early (truncated) opens on what is left. The check reads the log under the write
lock (``BEGIN IMMEDIATE``), so no other process appends to or resets it meanwhile; it
costs a read of the log and its checksums, about 0.2 s for a log of 4 MiB (the size at
which SQLite checkpoints by default), a few ms for the usual few hundred KiB.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from typing import Any

from ..core.errors import JournalCorruptError

_MAGIC = (0x377F0682, 0x377F0683)
"""WAL header magic: little-endian checksums, big-endian checksums."""
_HEADER = 32
_FRAME_HEADER = 24
_MASK = 0xFFFFFFFF


def row_crc(scope: str, space: str, key: str, value: str, version: int, due: float | None,
            expires: float | None) -> int:
    """The checksum of one row of ``durable``: CRC-32 of its fields, each prefixed by its
    length (floats in their exact round-trip form), so no two rows share an encoding."""
    v, d, e = repr(version), repr(due), repr(expires)
    head = f"{len(scope)}:{scope}{len(space)}:{space}{len(key)}:{key}{len(v)}:{v}{len(d)}:{d}{len(e)}:{e}"
    crc = zlib.crc32(head.encode("utf-8", "surrogatepass"))
    return zlib.crc32(value.encode("utf-8", "surrogatepass"), crc)


def check_row(file: str, row: tuple[Any, ...]) -> None:
    """Raise :class:`JournalCorruptError` when ``row`` — ``(scope, space, key, value,
    version, due, expires, crc)`` — does not match its checksum."""
    scope, space, key, value, version, due, expires, crc = row
    try:
        ok = crc == row_crc(scope, space, key, value, version, due, expires)
    except (TypeError, ValueError, UnicodeError):  # a column of the wrong type: damage too
        ok = False
    if not ok:
        raise JournalCorruptError(
            f"SQLite {file!r}: record {scope!r}/{space!r}/{key!r} does not match its checksum (the file is damaged; "
            "restore it from a backup)", code="ROW_CHECKSUM", file=file, scope=scope, space=space, key=key)


def _checksum(data: bytes, s1: int, s2: int, big: bool) -> tuple[int, int]:
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    it = iter(words)
    for x0, x1 in zip(it, it, strict=True):
        s1 = (s1 + x0 + s2) & _MASK
        s2 = (s2 + x1 + s1) & _MASK
    return s1, s2


def check_wal(file: str, page_size: int | None = None) -> None:
    """Refuse a write-ahead log of ``file`` in which a frame fails its checksum before
    the log's last transaction (see the module docstring). Nothing to check when there is
    no ``-wal`` file, or no committed frame of the log's current generation after the
    damage.

    ``page_size``: the database's page size as an open connection reports it (``PRAGMA
    page_size``); give it whenever this process may hold a connection to ``file``. Read
    from the file instead, the open and close of the database file would drop every
    POSIX lock this process holds on it (``fcntl`` locks belong to the process and go
    with *any* close of the file), among them the shared lock of its live connections:
    another process closing its last connection would then take itself for the last
    one, checkpoint and delete the log under them — a file "malformed" at the next
    write (found by explore's bursts of real processes, issue 12). Only the log itself
    (never locked by SQLite) is read then; a log whose header was torn when it was
    restarted still reads database pages from the file (a rare path, at an open after a
    power cut)."""
    wal = file + "-wal"
    try:
        with open(wal, "rb") as f:
            data = f.read()
    except OSError:
        return  # none, or one SQLite itself reports it cannot read
    if len(data) < _HEADER:
        return
    log = _Log(data, page_size if page_size is not None else _database_page_size(file))
    if log.page_size is None:
        return  # not a frame layout this check can follow (SQLite ignores such a log)
    first_bad, previous = log.first_bad()
    if first_bad is None:
        return
    # frames of this log's generation after the damage (its salts: a stale or zeroed frame
    # has others). SQLite writes a frame's header whole, in one write of its own, so the
    # page number and commit mark of a header with the log's salts hold even where the
    # frame's checksum no longer chains (its predecessor damaged)
    ours = [i for i in range(max(first_bad + 1, 1), log.count + 1) if log.frame(i)[2:4] == log.salts]
    commits = [i for i in ours if log.frame(i)[1]]
    if not commits:
        return  # the log ends in a torn or stale tail: SQLite's recovery is right
    last = commits[-1]
    if first_bad == 0 and log.in_database(file, [i for i in ours if log.trusted(i)]):
        return  # a header torn when the log was restarted: its old frames are all in the database already
    reason = ""
    damaged = log.frame(first_bad) if first_bad else None
    if len(commits) > 1 or (damaged is not None and damaged[1] and damaged[2:4] == log.salts):
        reason = "committed transactions follow it"
    else:
        # one transaction writes a page once: a page twice in what would be the last
        # transaction means two transactions, the earlier one committed and synced
        pages = [log.frame(i)[0] for i in range(previous + 1, last + 1) if log.frame(i)[2:4] == log.salts]
        if len(set(pages)) < len(pages):
            reason = f"the frames from {previous + 1} to {last} belong to more than one transaction (a page repeats)"
    if not reason:
        return  # within the last transaction: what a power cut during that commit leaves
    byte = 0 if first_bad == 0 else _HEADER + (first_bad - 1) * log.size
    where = "the log's header" if first_bad == 0 else f"frame {first_bad} (byte {byte})"
    raise JournalCorruptError(
        f"SQLite {file!r}: the write-ahead log {os.path.basename(wal)!r} is damaged at {where} and {reason}: SQLite "
        f"would drop committed transactions (up to frame {last}) without an error; refusing to open (restore the "
        "file and its -wal from a backup)", code="WAL_CORRUPT", file=wal, frame=first_bad, byte=byte)


def _valid_page_size(size: int) -> bool:
    return 512 <= size <= 65536 and not size & (size - 1)


def _database_page_size(file: str) -> int | None:
    """The page size in the database file's header (None: unreadable)."""
    try:
        with open(file, "rb") as f:
            header = f.read(18)
    except OSError:
        return None
    if len(header) < 18 or not header.startswith(b"SQLite format 3\x00"):
        return None
    size = int.from_bytes(header[16:18], "big")
    return 65536 if size == 1 else size


class _Log:
    """A write-ahead log's bytes, read as SQLite's file format documents them."""

    def __init__(self, data: bytes, fallback_page_size: int | None) -> None:
        self.data = data
        magic, _, page_size, _, salt1, salt2, ck1, ck2 = struct.unpack(">8I", data[:_HEADER])
        # a damaged header: the checksums in this machine's byte order, the database's page size
        self.big = magic == _MAGIC[1] if magic in _MAGIC else sys.byteorder == "big"
        if not _valid_page_size(page_size):
            page_size = fallback_page_size or 0
        self.page_size: int | None = page_size if _valid_page_size(page_size) else None
        if self.page_size is None:
            return
        self.size = _FRAME_HEADER + page_size
        self.count = (len(data) - _HEADER) // self.size
        self.header_ok = magic in _MAGIC and _checksum(data[:24], 0, 0, self.big) == (ck1, ck2)
        self.header_ck = (ck1, ck2)
        self.salts: tuple[int, ...] = (salt1, salt2)
        if not self.header_ok:  # the salts of the frames that chain to each other and commit
            chained = [i for i in range(2, self.count + 1) if self.frame(i)[1] and self.frame(i)[2:4] ==
                       self.frame(i - 1)[2:4] and self._verifies(i, self.frame(i - 1)[4:6], self.frame(i)[2:4])]
            if chained:
                self.salts = self.frame(chained[-1])[2:4]

    def frame(self, i: int) -> tuple[int, ...]:
        """``(page, commit, salt1, salt2, ck1, ck2)`` of frame ``i`` (1-based)."""
        at = _HEADER + (i - 1) * self.size
        return struct.unpack(">6I", self.data[at:at + _FRAME_HEADER])

    def _sum(self, i: int, seed: tuple[int, int]) -> tuple[int, int]:
        at = _HEADER + (i - 1) * self.size
        got = _checksum(self.data[at:at + 8], *seed, self.big)
        return _checksum(self.data[at + _FRAME_HEADER:at + self.size], *got, self.big)

    def _verifies(self, i: int, seed: tuple[int, ...], salts: tuple[int, ...]) -> bool:
        header = self.frame(i)
        return header[2:4] == salts and self._sum(i, (seed[0], seed[1])) == header[4:6]

    def trusted(self, i: int) -> bool:
        """Frame ``i`` is of this log and chains to the stored checksum before it."""
        seed = self.header_ck if i == 1 else self.frame(i - 1)[4:6]
        return self._verifies(i, seed, self.salts)

    def first_bad(self) -> tuple[int | None, int]:
        """The first frame SQLite's recovery rejects (0: the header; None: none) and the
        last commit frame before it."""
        if not self.header_ok:
            return 0, 0
        seed, previous = self.header_ck, 0
        for i in range(1, self.count + 1):
            header = self.frame(i)
            got = self._sum(i, seed)
            if header[2:4] != self.salts or got != header[4:6]:
                return i, previous
            seed = got
            if header[1]:
                previous = i
        return None, previous

    def in_database(self, file: str, frames: list[int]) -> bool:
        """Whether the last image of every page in ``frames`` equals that page of the
        database file (the frames were checkpointed before the log was restarted)."""
        assert self.page_size is not None
        latest = {self.frame(i)[0]: i for i in frames}
        try:
            with open(file, "rb") as f:
                for page, i in latest.items():
                    f.seek((page - 1) * self.page_size)
                    at = _HEADER + (i - 1) * self.size + _FRAME_HEADER
                    if f.read(self.page_size) != self.data[at:at + self.page_size]:
                        return False
        except OSError:
            return False
        return True
