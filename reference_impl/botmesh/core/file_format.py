"""The on-disk format of the file durability backend (:mod:`botmesh.core.file_backend`):
encoding and parsing the snapshot and the append log, and replaying the log onto the
snapshot's records. Pure functions over bytes; :class:`~botmesh.core.file_kv.FileKv`
does the I/O. A damaged file raises :class:`~botmesh.core.errors.JournalCorruptError`
(BACK-5; the rules are under "Reading" below). The module is over 800 lines on purpose:
the format's description, its writer and its reader (with every damage it refuses) stay
in one file, each rule beside the code that applies it.

Snapshot version 2, append log version 3 (written by this release; it reads snapshots of versions 1-2, logs of 1-3)
===================================================================================================================

Both files are ASCII text made of **framed lines**. A framed line is::

    <length> <crc32> <payload>\\n

``length`` is the payload's size in bytes (decimal, no leading zero), ``crc32`` the
CRC-32 of the payload (8 lowercase hex digits; ``zlib.crc32``, the polynomial of zlib,
PNG and Ethernet) and ``payload`` one JSON value with no newline in it (non-ASCII text
is escaped as ``\\uXXXX``). CRC-32 rather than CRC-32C: both detect every burst of up to
32 damaged bits and miss other damage with odds of 1 in 2**32, which is what damaged
files need (an attacker who can write the file can also recompute either); CRC-32 is in
the standard library and implemented in C there, CRC-32C would add a dependency.

``path`` — the **snapshot**. The first line is the header, then one line per record, then
a trailer with the record count and the CRC-32 of every byte before the trailer::

    {"format":"botmesh.file_kv","version":2,"log_seq":42,"records":2}
    [scope, space, key, version, due, expires, value]
    [scope, space, key, version, due, expires, value]
    {"end":2,"crc32":"89abcdef"}

(each line framed as above). ``log_seq`` is the sequence number of the last append-log
entry the snapshot includes. ``due``/``expires`` are ``null``, a finite JSON number, or
the strings ``"inf"`` / ``"-inf"``; ``value`` a JSON object. The snapshot is always
replaced by writing ``<path>.tmp`` and renaming it over ``path`` (atomic against a crash of
the process; against a power cut only with ``fsync``, which forces the data to disk before
the rename and the directory after it), so any damage to it is corruption: it has no torn
tail.

``<path>.log`` — the **append log** (only with ``append_log=True``, or a leftover of such
a run). The first line is the header ``{"format":"botmesh.file_kv.log","version":3}``,
then one line per **commit**: the writes of one group (:mod:`botmesh.core.group_commit`,
one write or several of different records that went to disk together), as a JSON array
of entries::

    [{"seq":43,"op":"put","scope":..,"space":..,"key":..,"version":3,"due":..,"expires":..,"value":{..}}]
    [{"seq":44,"op":"del","scope":..,"space":..,"key":..,"version":3},{"seq":45,"op":"put",..}]

``version`` is the version the put created, or the version the delete removed. ``seq``
grows by one per entry, across lines, and never restarts (it continues from
``log_seq``). Compaction truncates the log back to its header.

Why one line per commit (log version 3; version 2 had one line per entry): a commit is
appended by one write and forced by one fsync, and the pages of one unsynced write may
reach the disk in any order, so a power cut may keep a later page of it and lose an
earlier one. Damage of that kind can only ever fall in the log's *final line*, which
the reader trims as a torn write (below); with one line per entry the hole could come
before complete later entries of the same commit, which no reader may tell from damage
in the middle of the log — so version 2 had to cut a commit into writes at page
boundaries, each with its own fsync. A commit is also all or nothing at recovery.

``<path>.lock`` — the owner's pid; the owner also holds a ``flock`` on it while open.

The header's framing is the one thing every later version keeps: a file whose first line
is a framed header naming a ``version`` this release does not know is refused with code
``JOURNAL_VERSION_UNSUPPORTED`` naming that version. (So a release before log version 3
refuses a log this release left behind after a crash, and still reads the snapshot a
clean ``close()`` leaves, which has no log.)

Reading (BACK-5)
================

Everything is checked before anything is applied: lengths, checksums, the JSON shape of
every line, the record count and the file checksum of the snapshot, the sequence numbers
of the log. Any failure raises ``JournalCorruptError`` with ``file``, ``line`` (1-based)
and ``byte`` (offset where that line starts); nothing else escapes (a nesting deeper than
:data:`MAX_VALUE_DEPTH`, a number too large, ``NaN``, text that is not ASCII are damage
like any other). Codes: ``SNAPSHOT_CORRUPT``, ``APPEND_LOG_CORRUPT``,
``JOURNAL_VERSION_UNSUPPORTED`` (also given ``version``).

* **Torn write**: only the log's *final, incomplete* line — bytes after the last newline
  that never got their terminator, whether a prefix of the line or the zeros a power cut
  leaves — is a torn write: it is cut off and the rest replayed (that write never
  returned). When the bytes after the last newline start with a complete length and
  checksum and run *past* that length, the line reached its full size with a wrong
  terminator: that is damage, not a torn write.
* The same holds for a *final* line that reached its newline but has a **hole**: a run
  of NUL bytes from its start, or from a 512-byte sector boundary, up to a sector
  boundary. A power cut leaves that of an append that crossed a page boundary when the
  later page reached the disk and the earlier did not (XFS moves the size at the later
  page's I/O completion; ext4's ordered mode only orders newly allocated blocks, not
  the rewrite of the partly filled page before them). An fsync writes both pages, so
  such a line was never acknowledged: it is cut off like any torn write (BACK-5: a
  half-written *last* line is trimmed).
* A torn final line of log version 3 is a whole commit none of whose writes was
  acknowledged: all its entries are cut off together, however many pages it spans.
* **Every other complete line** (one ending in a newline) must have the right length and
  checksum and be a valid entry (log version 3: a commit, every entry of it valid),
  wherever it is, the last one included: a flipped bit in
  the last, acknowledged line is ``APPEND_LOG_CORRUPT``, not a torn write (one flipped bit
  never makes a hole: the line's first byte is a digit, and a run of two NULs needs two
  flips).
* **Sequence numbers**: entries follow each other by one; the first is at most
  ``log_seq + 1``; entries at or before ``log_seq`` (left by a crash between compaction's
  two steps) are skipped only after checking that the snapshot holds what they wrote, and
  they must reach ``log_seq`` — so a ``log_seq`` edited upwards, which would silently skip
  entries, is ``APPEND_LOG_CORRUPT``.

The one change a format of this kind cannot see: a log cut *exactly* at the end of a line
(or its last lines deleted) is a valid log of an earlier moment. Only an outside record of
how far the log went could tell, and the log exists so that no other file is written per
write.

Log version 2 (written by earlier releases): a migration
=========================================================

A version-2 log has the version-2 header and one framed line per entry (the entry
objects above, not in an array); it is read with the same rules, line by line. A log of
version 2 (or 1) found at open is folded into the snapshot and emptied to the
version-3 header by the open that read it, after everything was read, and a warning
names the file: this release never appends commits to a log of another version.

Version 1 (written by earlier releases): a migration
=====================================================

A version-1 snapshot is one JSON document ``{"format":"botmesh.file_kv","version":1,
"log_seq":..,"records":[[..], ..]}`` (scores as JSON numbers or ``Infinity``), a version-1
log one bare JSON entry per line, without header, lengths or checksums. They are read with
the same rules except the checksums, which they do not have (the same bounds on JSON;
``Infinity`` only as a score; a complete line that does not parse is corruption, only the
unterminated final line is torn). A journal read in version 1 is **rewritten in version 2
by the open that read it**, after everything was read and before ``open()`` returns (a new
snapshot with every record, then the log emptied to the version-2 header or removed), and
a warning names the file. A crash during that rewrite leaves a version-2 snapshot beside a
version-1 log whose entries it already holds, which opens like any interrupted compaction.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from itertools import compress
from operator import is_not as _is_not
from typing import Any, NoReturn, TypeGuard

from .errors import JournalCorruptError
from .spi import encode_checked

__all__ = [
    "FORMAT_VERSION",
    "LOG_FORMAT",
    "LOG_HEADER",
    "LOG_VERSION",
    "MAX_VALUE_DEPTH",
    "READABLE_LOG_VERSIONS",
    "READABLE_VERSIONS",
    "SNAPSHOT_FORMAT",
    "Entry",
    "LogEntry",
    "LogScan",
    "Records",
    "Snapshot",
    "Space",
    "encode_value",
    "frame",
    "is_int",
    "is_score",
    "log_commit",
    "log_entry",
    "parse_snapshot",
    "replay",
    "scan_log",
    "snapshot_buffer",
    "snapshot_bytes",
    "SnapshotLines",
    "ValueTexts",
]

SNAPSHOT_FORMAT = "botmesh.file_kv"
"""The ``format`` field of a snapshot's header."""
LOG_FORMAT = "botmesh.file_kv.log"
"""The ``format`` field of an append log's header."""
FORMAT_VERSION = 2
"""The snapshot's format version this release writes."""
READABLE_VERSIONS = (1, 2)
"""The snapshot format versions this release reads (version 1 is migrated at open)."""
LOG_VERSION = 3
"""The append log's format version this release writes (one line per commit)."""
READABLE_LOG_VERSIONS = (1, 2, 3)
"""The append log versions this release reads (1 and 2 are migrated at open)."""
MAX_VALUE_DEPTH = 128
"""How deep a stored value may nest (a flat object is depth 1). Deeper values are refused
by ``FileKv.put`` with ``ValueError``, and a line nesting deeper is damage: the reader
never recurses without bound."""
_MAX_INT = 2**63 - 1  # versions, sequence numbers, counts

Entry = tuple[dict[str, Any], int, float | None, float | None]
"""One record: value, version, due, expires — the same tuple MemoryKv keeps."""
Space = dict[str, Entry]
"""The records of one ``(scope, space)`` by key."""
Records = dict[tuple[str, str], Space]
"""Every record of a journal, by ``(scope, space)``."""


@dataclass(frozen=True)
class LogEntry:
    """One parsed line of the append log."""

    seq: int
    op: str  # "put" | "del"
    scope: str
    space: str
    key: str
    version: int
    value: dict[str, Any] | None
    due: float | None
    expires: float | None
    line: int
    byte: int


@dataclass(frozen=True)
class Snapshot:
    """A parsed snapshot file."""

    records: Records
    log_seq: int
    version: int


@dataclass(frozen=True)
class LogScan:
    """A scanned append log. ``good`` is the length of its good prefix (where a torn final
    line starts, or the file's length); ``header_end`` where the entries start (0 for a
    version-1 log or a log without a complete header); ``version`` is None for a log with
    no complete line."""

    entries: list[LogEntry]
    good: int
    header_end: int
    version: int | None


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_score(value: Any) -> bool:
    """Whether ``value`` can be an index score: None or a number (a bool is not)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _counter(value: object, low: int) -> TypeGuard[int]:
    return is_int(value) and low <= value <= _MAX_INT


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------


# One reusable encoder for every line (spi.encode_checked): what is encoded is acyclic —
# values check_json_object copied, which forbids NaN/inf inside them, and scores that
# _score_out gives (±inf as strings).
_dumps = encode_checked
_INF = math.inf


def frame(payload: bytes) -> bytes:
    """``payload`` as one framed line: ``<length> <crc32> <payload>\\n``."""
    return b"%d %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


def _score_out(score: float | None) -> float | str | None:
    if score is None or -_INF < score < _INF:
        return score
    return "inf" if score > 0 else "-inf"


def encode_value(value: dict[str, Any], where: str) -> str:
    """``value`` as the JSON text the files store, or ``ValueError`` naming ``where`` when
    it nests deeper than :data:`MAX_VALUE_DEPTH` (the reader would refuse it)."""
    text = _dumps(value)
    if _too_deep(text, MAX_VALUE_DEPTH):
        raise ValueError(f"{where}: the value nests deeper than {MAX_VALUE_DEPTH} levels, which a file journal does not store")
    return text


_HEADER_START = '{"format":"' + SNAPSHOT_FORMAT + '","version":' + str(FORMAT_VERSION)


SnapshotLines = dict[tuple[str, str], tuple[dict[str, Entry], dict[str, bytes]]]
"""A snapshot's lines per ``(scope, space)``: the entries they were made from (key ->
entry) and the lines themselves (key -> framed line)."""


ValueTexts = dict[tuple[str, str, str], tuple[Entry, str]]  # values' JSON texts, each with its entry


def _record_line(scope: str, space: str, key: str, entry: Entry, texts: ValueTexts | None) -> bytes:
    """The framed snapshot line of one record (``texts``: see :func:`snapshot_bytes`)."""
    value, version, due, expires = entry
    if due is not None and not -_INF < due < _INF:
        due = _score_out(due)  # type: ignore[assignment]
    if expires is not None and not -_INF < expires < _INF:
        expires = _score_out(expires)  # type: ignore[assignment]
    # The value as check_json_object produced it: already known to be storable.
    known = texts.get((scope, space, key)) if texts else None
    if known is not None and known[0] is entry:
        head = _dumps([scope, space, key, version, due, expires])
        payload = (head[:-1] + "," + known[1] + "]").encode("ascii")
    else:
        payload = _dumps([scope, space, key, version, due, expires, value]).encode("ascii")
    return frame(payload)


def snapshot_bytes(
    records: Records, log_seq: int, lines: SnapshotLines | None = None, texts: ValueTexts | None = None
) -> bytes:
    """The snapshot file for ``records`` as ``bytes``: :func:`snapshot_buffer`'s content."""
    return bytes(snapshot_buffer(records, log_seq, lines, texts))


def snapshot_buffer(
    records: Records, log_seq: int, lines: SnapshotLines | None = None, texts: ValueTexts | None = None
) -> bytearray:
    """The snapshot file for ``records`` (version 2): header, one record per line sorted,
    trailer with the count and the checksum, so the file is deterministic and readable.
    ``lines``: the lines of the last snapshot made with it, per space with the entries
    they were made from (brought up to date in place: the lines of the records written
    since made anew, those of records deleted since dropped); a record whose entry is the
    very tuple a line was made from takes the line again — a line depends on the entry
    alone, and a write makes a new entry — so a fold or a snapshot-only write encodes
    only what was written since (issue 16), at the price of the text kept in memory.
    ``texts``: the values written since, as :func:`encode_value` gave them (the log line's
    text), each with its entry: a record whose entry is that very tuple takes its value's
    text instead of encoding the value again. Emptied once used (every entry it serves
    is then in ``lines``).

    The records whose line is taken again are found and put in order at C speed
    (``map``, ``operator.is_not``, ``itertools.compress``: no Python statement per such
    record): a fold used to walk every record in Python, ~2 us each, so that the fold of
    a journal of 20,000 records cost ~36 ms of CPU and a message's share of the folds
    grew with the journal (issue 16)."""
    parts: list[bytes] = [b""]  # the header goes first, once the count is known
    cache: SnapshotLines = {} if lines is None else lines
    for scope, space in sorted(records):
        space_map = records[(scope, space)]
        keys = sorted(space_map)
        made_from, space_lines = cache.get((scope, space)) or cache.setdefault((scope, space), ({}, {}))
        # The keys whose entry is not the very tuple their last line was made from.
        changed = list(compress(keys, map(_is_not, map(space_map.__getitem__, keys), map(made_from.get, keys))))
        for key in changed:
            entry = space_map[key]
            # The old line stops counting before the new one is made, and the new one
            # counts once it is in: an exception between the steps leaves no line
            # standing for an entry it was not made from.
            made_from.pop(key, None)
            space_lines[key] = _record_line(scope, space, key, entry, texts)
            made_from[key] = entry
        if len(space_lines) != len(keys):  # records deleted since
            for key in space_lines.keys() - space_map.keys():
                del space_lines[key]
                made_from.pop(key, None)
        parts.extend(map(space_lines.__getitem__, keys))
    if len(cache) != len(records):  # spaces gone
        for gone in cache.keys() - records.keys():
            del cache[gone]
    count = len(parts) - 1
    parts[0] = frame(f'{_HEADER_START},"log_seq":{log_seq},"records":{count}}}'.encode("ascii"))
    # One buffer, the trailer added in place (a bytes result would copy the whole file
    # once more to add it: ~50 ms for 200,000 records).
    data = bytearray().join(parts)
    data += frame(f'{{"end":{count},"crc32":"{zlib.crc32(data):08x}"}}'.encode("ascii"))
    if texts is not None:
        texts.clear()
    return data


def log_entry(
    seq: int,
    op: str,
    scope: str,
    space: str,
    key: str,
    version: int,
    entry: Entry | None,
    encoded_value: str | None = None,
) -> str:
    """One append-log entry as JSON text (an element of a commit's line,
    :func:`log_commit`). ``encoded_value`` is the value as :func:`encode_value` returned
    it (computed from ``entry`` when not given).

    The text is what ``_dumps`` gives for the entry's object, composed here field by
    field with the encoder's own string escaping (a test holds them equal): one encoder
    call less per write."""
    head = (f'{{"seq":{int(seq)},"op":{_quote(op)},"scope":{_quote(scope)},"space":{_quote(space)},'
            f'"key":{_quote(key)},"version":{int(version)}')
    if entry is None:
        return head + "}"
    if encoded_value is None:
        encoded_value = encode_value(entry[0], f"{scope}/{space}/{key}")
    return f'{head},"due":{_score_text(entry[2])},"expires":{_score_text(entry[3])},"value":{encoded_value}}}'


# What the encoder writes for a string (ASCII, escaped) and for a score.
_quote = json.encoder.encode_basestring_ascii


def _score_text(score: float | None) -> str:
    """``_dumps(_score_out(score))`` without the encoder: ``null``, the number as the
    encoder writes it (``float.__repr__`` / ``int.__repr__``), or ``"inf"``/``"-inf"``."""
    if score is None:
        return "null"
    if type(score) is float:
        return float.__repr__(score) if -_INF < score < _INF else ('"inf"' if score > 0 else '"-inf"')
    return _dumps(_score_out(score))


def log_commit(entries: list[str]) -> bytes:
    """The framed log line (newline included) of one commit: ``entries``
    (:func:`log_entry` texts, one or more, in seq order) as a JSON array."""
    return frame(("[" + ",".join(entries) + "]").encode("ascii"))


LOG_HEADER = frame(('{"format":"' + LOG_FORMAT + '","version":' + str(LOG_VERSION) + "}").encode("ascii"))
"""The first line of every append log this release writes (version 3), framed."""
_LOG_HEADER_V2 = frame(('{"format":"' + LOG_FORMAT + '","version":2}').encode("ascii"))


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def _corrupt_snapshot(path: str, line: int, byte: int, reason: str) -> NoReturn:
    raise JournalCorruptError(
        f"{path}: the snapshot cannot be read back (line {line}, byte {byte}: {reason}); nothing was "
        "loaded and no file was changed — restore it from a copy or move it aside",
        code="SNAPSHOT_CORRUPT",
        file=path,
        line=line,
        byte=byte,
    )


def _corrupt_log(path: str, line: int, byte: int, reason: str) -> NoReturn:
    raise JournalCorruptError(
        f"{path}: damaged append-log entry at line {line} (byte {byte}): {reason}; the log "
        "was left as it is — restore it from a copy or move it aside",
        code="APPEND_LOG_CORRUPT",
        file=path,
        line=line,
        byte=byte,
    )


def _unsupported(path: str, version: object, what: str, readable: tuple[int, ...]) -> NoReturn:
    raise JournalCorruptError(
        f"{path}: {what} is in format version {version!r}, which this release of botmesh does not read "
        f"(it reads versions {', '.join(map(str, readable))}); it was probably written by a newer "
        "release — open it with that release. No file was changed",
        code="JOURNAL_VERSION_UNSUPPORTED",
        file=path,
        line=1,
        byte=0,
        version=version,
    )


# ---------------------------------------------------------------------------------------
# Bounded parsing
# ---------------------------------------------------------------------------------------

SECTOR = 512
"""The smallest unit a disk writes whole: a power cut's holes begin and end on it."""
_FRAME_HEAD = re.compile(rb"(0|[1-9][0-9]{0,11}) ([0-9a-f]{8}) ")
# A JSON string (skipped) or a bracket: what the nesting depth is counted over.
_DEPTH_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_QUOTE, _OPENERS = ord('"'), frozenset(b"[{")


def _too_deep(text: str | bytes, limit: int) -> bool:
    """Whether the JSON ``text`` nests deeper than ``limit``. Counting the openers is enough
    almost always (C speed); only text with more openers than ``limit`` is scanned, and
    the scan stops as soon as the limit is passed."""
    data = text.encode("ascii", "replace") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth = 0
    for match in _DEPTH_TOKENS.finditer(data):
        first = data[match.start()]
        if first == _QUOTE:
            continue
        if first in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _allow_infinity(name: str) -> Any:
    if name == "NaN":
        raise ValueError("NaN is not a JSON number")
    return math.inf if name == "Infinity" else -math.inf


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number {text[:40]} is out of range")
    return number


# Two decoders, built once (json.loads with arguments builds a decoder per
# call): NaN/Infinity refused (version 2) or Infinity allowed (version 1, for scores);
# every float checked for an overflow to inf (1e400).
_SCAN = {
    infinity: json.JSONDecoder(
        parse_constant=_allow_infinity if infinity else _refuse_constant, parse_float=_finite_float
    ).raw_decode
    for infinity in (False, True)
}


def _decode(payload: bytes, depth: int, *, infinity: bool = False) -> tuple[Any, str | None]:
    """The JSON value of ``payload``, or ``(None, reason)``. Bounded: ASCII only, nesting at
    most ``depth``, numbers finite (``Infinity`` only when ``infinity``), integers at most
    Python's 4300 digits; never raises."""
    if not payload.isascii():
        return None, "bytes that are not ASCII"
    if _too_deep(payload, depth):
        return None, f"JSON nested deeper than {depth} levels"
    text = payload.decode("ascii")
    try:
        value, end = _SCAN[infinity](text, 0)
    except (ValueError, RecursionError) as exc:  # ValueError includes JSONDecodeError
        return None, f"not valid JSON ({str(exc)[:120]})"
    if end != len(text) and text[end:].strip(" \t\r\n"):
        return None, "not valid JSON (data after the value)"
    return value, None


def _read_frame(data: bytes, pos: int) -> tuple[bytes | None, int, str | None]:
    """The framed line starting at ``pos``: ``(payload, next_pos, None)`` when it is
    complete and sound; ``(None, pos, None)`` when it is an incomplete final line (a torn
    write); ``(None, pos, reason)`` when it is damaged."""
    newline = data.find(b"\n", pos)
    if newline == -1:
        head = _FRAME_HEAD.match(data, pos)
        if head is not None and len(data) - head.end() > int(head.group(1)):
            return None, pos, "the line reached its length but has no newline at its end"
        return None, pos, None
    head = _FRAME_HEAD.match(data, pos, newline)
    if head is None:
        return None, pos, "no length and checksum at the start of the line"
    start = head.end()
    length = int(head.group(1))
    if start + length != newline:
        return None, pos, f"the line says {length} bytes but holds {newline - start}"
    payload = data[start:newline]
    if zlib.crc32(payload) != int(head.group(2), 16):
        return None, pos, "checksum mismatch"
    return payload, newline + 1, None


def _score_in(value: Any, infinity_as_number: bool) -> tuple[bool, float | None]:
    """A score as read: ``(ok, score)``. Version 2 stores ±inf as ``"inf"``/``"-inf"``;
    version 1 as JSON ``Infinity`` (decoded to a float)."""
    if value is None:
        return True, None
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not infinity_as_number):
            return False, None
        return True, value
    if is_int(value):  # version 1 only writes floats, but an int is a number all the same
        if abs(value) > 2**1023:
            return False, None
        return True, float(value)
    if not infinity_as_number and value in ("inf", "-inf"):
        return True, math.inf if value == "inf" else -math.inf
    return False, None


def _storable(value: Any) -> bool:
    """Whether a value read from a version-1 file is one ``check_json_object`` accepts
    (no ±inf inside: version 1 decodes ``Infinity`` everywhere)."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError):
        return False
    return True


def _row_to_entry(row: Any, v1: bool) -> tuple[tuple[str, str, str], Entry] | str:
    if not (isinstance(row, list) and len(row) == 7):
        return "not a record (a list of 7)"
    scope, space, key, version, due, expires, value = row
    if not (isinstance(scope, str) and isinstance(space, str) and isinstance(key, str)):
        return "scope, space and key must be strings"
    if not _counter(version, 1):
        return f"bad version {str(version)[:40]}"
    ok_due, due_score = _score_in(due, v1)
    ok_exp, exp_score = _score_in(expires, v1)
    if not (ok_due and ok_exp):
        return "bad due or expires"
    if not isinstance(value, dict) or (v1 and not _storable(value)):
        return "the value is not a JSON object"
    return (scope, space, key), (value, version, due_score, exp_score)


# ---------------------------------------------------------------------------------------
# Snapshot
# ---------------------------------------------------------------------------------------

_SNAPSHOT_KEYS = frozenset({"format", "version", "log_seq", "records"})


def _check_header(
    obj: Any, fmt: str, path: str, what: str, keys: frozenset[str], readable: tuple[int, ...]
) -> str | None:
    """Refuse a header of another format (reason returned) or of an unknown version
    (raised); None when it is a framed header (version 2 or later) of a version in
    ``readable`` with exactly ``keys``."""
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        return f"not a {fmt} header"
    version = obj.get("version")
    if not is_int(version) or version < 2 or version not in readable:
        if is_int(version) and version > max(readable):
            _unsupported(path, version, what, readable)
        return f"bad version {str(version)[:40]} in a framed header"
    if set(obj) != keys:
        return "unexpected fields in the header"
    return None


def parse_snapshot(data: bytes, path: str) -> Snapshot:
    """The records and ``log_seq`` of a snapshot file (version 2, or 1), or
    ``JournalCorruptError``."""
    if data[:1] == b"{":
        return _parse_snapshot_v1(data, path)
    payload, pos, reason = _read_frame(data, 0)
    if payload is None:
        if reason is None and data[:1].isdigit():
            reason = "the header line is cut short"
        _corrupt_snapshot(path, 1, 0, reason or f"not a {SNAPSHOT_FORMAT} snapshot")
    header, reason = _decode(payload, 2)
    if reason is None:
        reason = _check_header(header, SNAPSHOT_FORMAT, path, "the snapshot", _SNAPSHOT_KEYS, READABLE_VERSIONS)
    if reason is not None:
        _corrupt_snapshot(path, 1, 0, reason)
    log_seq, count = header["log_seq"], header["records"]
    if not (_counter(log_seq, 0) and _counter(count, 0)):
        _corrupt_snapshot(path, 1, 0, "bad log_seq or record count in the header")
    records: Records = {}
    line = 1
    depth = MAX_VALUE_DEPTH + 1
    for _ in range(count):
        line += 1
        start = pos
        payload, pos, reason = _read_frame(data, pos)
        if payload is None:
            _corrupt_snapshot(path, line, start, reason or "the file ends before its last record")
        row, reason = _decode(payload, depth)
        parsed = _row_to_entry(row, v1=False) if reason is None else reason
        if isinstance(parsed, str):
            _corrupt_snapshot(path, line, start, parsed)
        (scope, space, key), entry = parsed
        space_map = records.get((scope, space))
        if space_map is None:
            space_map = records[(scope, space)] = {}
        if key in space_map:
            _corrupt_snapshot(path, line, start, f"record {space}/{key} appears twice")
        space_map[key] = entry
    line += 1
    start = pos
    payload, pos, reason = _read_frame(data, pos)
    if payload is None:
        _corrupt_snapshot(path, line, start, reason or f"the file ends before its trailer (the header says {count} records)")
    trailer, reason = _decode(payload, 1)
    if reason is None and not (
        isinstance(trailer, dict) and set(trailer) == {"end", "crc32"} and isinstance(trailer["crc32"], str)
    ):
        reason = f"not the trailer the header's {count} records lead to"
    if reason is not None:
        _corrupt_snapshot(path, line, start, reason)
    if not _counter(trailer["end"], 0) or trailer["end"] != count:
        _corrupt_snapshot(path, line, start, f"the trailer says {str(trailer['end'])[:40]} records, the header {count}")
    if trailer["crc32"] != f"{zlib.crc32(memoryview(data)[:start]):08x}":
        _corrupt_snapshot(path, line, start, "the file's checksum does not match (lines were changed, moved or replaced)")
    if pos != len(data):
        _corrupt_snapshot(path, line + 1, pos, "data after the trailer")
    return Snapshot(records, log_seq, FORMAT_VERSION)


def _parse_snapshot_v1(data: bytes, path: str) -> Snapshot:
    """A version-1 snapshot (one JSON document, no checksums): read for the migration."""
    # depth: the document, its records list, a row, then the value.
    doc, reason = _decode(data, MAX_VALUE_DEPTH + 3, infinity=True)
    if reason is not None:
        _corrupt_snapshot(path, 1, 0, reason)
    if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
        _corrupt_snapshot(path, 1, 0, f"not a {SNAPSHOT_FORMAT} snapshot")
    version = doc.get("version")
    if not is_int(version) or version != 1:
        if is_int(version) and version > FORMAT_VERSION:
            _unsupported(path, version, "the snapshot", READABLE_VERSIONS)
        _corrupt_snapshot(path, 1, 0, f"unsupported snapshot version {str(version)[:40]}")
    if set(doc) != _SNAPSHOT_KEYS:
        _corrupt_snapshot(path, 1, 0, "unexpected fields in a version-1 snapshot")
    log_seq = doc["log_seq"]
    rows = doc["records"]
    if not _counter(log_seq, 0) or not isinstance(rows, list):
        _corrupt_snapshot(path, 1, 0, "bad log_seq or records")
    records: Records = {}
    for i, row in enumerate(rows):
        parsed = _row_to_entry(row, v1=True)
        if isinstance(parsed, str):
            _corrupt_snapshot(path, 1, 0, f"record #{i + 1} is malformed: {parsed}")
        (scope, space, key), entry = parsed
        space_map = records.setdefault((scope, space), {})
        if key in space_map:
            _corrupt_snapshot(path, 1, 0, f"record #{i + 1} ({space}/{key}) appears twice")
        space_map[key] = entry
    return Snapshot(records, log_seq, 1)


# ---------------------------------------------------------------------------------------
# Append log
# ---------------------------------------------------------------------------------------

_PUT_KEYS = frozenset({"seq", "op", "scope", "space", "key", "version", "due", "expires", "value"})
_DEL_KEYS = frozenset({"seq", "op", "scope", "space", "key", "version"})
_LOG_KEYS = frozenset({"format", "version"})


def _parse_entry(obj: Any, line: int, byte: int, v1: bool) -> LogEntry | str:
    """A log entry from a decoded JSON line, or the reason it is not a valid one."""
    if not isinstance(obj, dict):
        return "not a log entry (a JSON object)"
    seq, op, version = obj.get("seq"), obj.get("op"), obj.get("version")
    scope, space, key = obj.get("scope"), obj.get("space"), obj.get("key")
    if op not in ("put", "del") or set(obj) != (_PUT_KEYS if op == "put" else _DEL_KEYS):
        return "not a log entry (op and fields)"
    if not (_counter(seq, 1) and _counter(version, 1)):
        return "bad seq or version"
    if not (isinstance(scope, str) and isinstance(space, str) and isinstance(key, str)):
        return "scope, space and key must be strings"
    if op == "del":
        return LogEntry(seq, op, scope, space, key, version, None, None, None, line, byte)
    value = obj["value"]
    ok_due, due = _score_in(obj["due"], v1)
    ok_exp, expires = _score_in(obj["expires"], v1)
    if not (ok_due and ok_exp):
        return "bad due or expires"
    if not isinstance(value, dict) or (v1 and not _storable(value)):
        return "the value is not a JSON object"
    return LogEntry(seq, op, scope, space, key, version, value, due, expires, line, byte)


def _lost_sectors(data: bytes, start: int) -> bool:
    """Whether the line at ``start`` is the log's *final* line and holds a run of NUL
    bytes that begins at the line's start or at a sector boundary and ends at one (512
    bytes): the shape a power cut leaves of an append that crossed a page boundary when
    the later page reached the disk and the earlier one did not (XFS sets the size at
    the later page's I/O completion; ext4's ordered mode orders only newly allocated
    blocks, not the rewrite of the partly filled page before them). That line was never
    fsynced — an fsync would have written both pages — so it was never acknowledged.

    When the line's length and checksum survived (the hole is after them), the length
    must end the line exactly at the file's end: a hole that swallowed the newlines of
    later, complete lines (a lost page in the middle of acknowledged data, which the
    corruption part makes) is damage, not a torn write. When they did not survive, the
    hole must start at the line's start (the append's first line, as a lost first page
    leaves it)."""
    newline = data.find(b"\n", start)
    if newline != len(data) - 1:
        return False
    head = _FRAME_HEAD.match(data, start, newline)
    if head is not None and head.end() + int(head.group(1)) != newline:
        return False
    pos = start
    while True:
        a = data.find(b"\0", pos, newline)
        if a == -1:
            return False
        b = a
        while b < newline and data[b] == 0:
            b += 1
        if (a == start or (head is not None and a >= head.end() and a % SECTOR == 0)) and b % SECTOR == 0:
            return True
        pos = b


def scan_log(data: bytes, path: str) -> LogScan:
    """The entries of a log file (version 3, 2 or 1) and the length of its good prefix.
    Raises ``APPEND_LOG_CORRUPT`` for damage that is not a torn final line."""
    if data[:1] == b"{":
        return _scan_log_v1(data, path)
    payload, pos, reason = _read_frame(data, 0)
    if payload is None:
        if reason is not None:
            _corrupt_log(path, 1, 0, reason)
        return LogScan([], 0, 0, None)  # a torn header: no entry was ever written after it
    head = data[:pos]
    if head == LOG_HEADER:
        version = LOG_VERSION
    elif head == _LOG_HEADER_V2:
        version = 2
    else:
        header, reason = _decode(payload, 1)
        if reason is None:
            reason = _check_header(
                header, LOG_FORMAT, path, "the append log", _LOG_KEYS, READABLE_LOG_VERSIONS
            ) or "not the log header"
        _corrupt_log(path, 1, 0, reason)
    header_end = pos
    entries: list[LogEntry] = []
    line = 1
    # a commit's line is one level deeper than an entry's: the array around its entries
    depth = MAX_VALUE_DEPTH + (2 if version == LOG_VERSION else 1)
    while pos < len(data):
        line += 1
        start = pos
        payload, pos, reason = _read_frame(data, pos)
        if payload is None:
            if reason is not None and not _lost_sectors(data, start):
                _corrupt_log(path, line, start, reason)
            return LogScan(entries, start, header_end, version)  # torn final line
        obj, reason = _decode(payload, depth)
        if reason is not None:
            _corrupt_log(path, line, start, reason)
        if version == 2:
            objs = [obj]
        elif isinstance(obj, list) and obj:
            objs = obj
        else:
            _corrupt_log(path, line, start, "not a commit (a JSON array of one or more log entries)")
        for n, item in enumerate(objs, 1):
            entry = _parse_entry(item, line, start, v1=False)
            if isinstance(entry, str):
                _corrupt_log(path, line, start, entry if version == 2 else f"entry {n} of the commit: {entry}")
            entries.append(entry)
    return LogScan(entries, len(data), header_end, version)


def _scan_log_v1(data: bytes, path: str) -> LogScan:
    """A version-1 log (bare JSON lines): read for the migration, with the rules of
    version 2 except the checksums."""
    entries: list[LogEntry] = []
    pos = 0
    line = 0
    while pos < len(data):
        line += 1
        newline = data.find(b"\n", pos)
        if newline == -1:
            return LogScan(entries, pos, 0, 1)  # torn final line
        obj, reason = _decode(data[pos:newline], MAX_VALUE_DEPTH + 1, infinity=True)
        entry = _parse_entry(obj, line, pos, v1=True) if reason is None else reason
        if isinstance(entry, str):
            _corrupt_log(path, line, pos, entry)
        entries.append(entry)
        pos = newline + 1
    return LogScan(entries, len(data), 0, 1)


def replay(records: Records, log_seq: int, entries: list[LogEntry], path: str) -> int:
    """Apply ``entries`` with ``seq > log_seq`` to ``records`` (a private copy being
    built at open) and return the last seq. Entries at or before ``log_seq`` are checked
    against the snapshot, which must hold what they wrote. Raises ``APPEND_LOG_CORRUPT``
    when an entry does not follow on."""
    if not entries:
        return log_seq
    first, last_entry = entries[0], entries[-1]
    if first.seq > log_seq + 1:
        _corrupt_log(
            path, first.line, first.byte, f"seq {first.seq} but the snapshot ends at log_seq {log_seq}: entries are missing"
        )
    if first.seq <= log_seq and last_entry.seq < log_seq:
        _corrupt_log(
            path,
            last_entry.line,
            last_entry.byte,
            f"the log ends at seq {last_entry.seq}, before the snapshot's log_seq {log_seq}: entries are missing",
        )
    folded: dict[tuple[str, str, str], LogEntry] = {}
    checked = first.seq > log_seq
    last = first.seq - 1
    for e in entries:
        if e.seq != last + 1:
            _corrupt_log(path, e.line, e.byte, f"seq {e.seq} does not follow seq {last}")
        last = e.seq
        if e.seq <= log_seq:
            # Already folded into the snapshot (a crash between compaction's two steps).
            folded[(e.scope, e.space, e.key)] = e
            continue
        if not checked:
            _check_folded(records, folded, log_seq, path)
            checked = True
        space_map = records.setdefault((e.scope, e.space), {})
        current = space_map.get(e.key)
        found = 0 if current is None else current[1]
        if e.op == "put":
            if found != e.version - 1:
                _corrupt_log(path, e.line, e.byte, f"put of {e.space}/{e.key} version {e.version} over version {found}")
            assert e.value is not None
            space_map[e.key] = (e.value, e.version, e.due, e.expires)
        else:
            if current is None or found != e.version:
                _corrupt_log(path, e.line, e.byte, f"delete of {e.space}/{e.key} version {e.version}, found {found}")
            del space_map[e.key]
    if not checked:
        _check_folded(records, folded, log_seq, path)
    return max(last, log_seq)


def _check_folded(
    records: Records, folded: dict[tuple[str, str, str], LogEntry], log_seq: int, path: str
) -> None:
    """The snapshot must hold what the last folded entry of each key wrote: otherwise
    ``log_seq`` claims entries the snapshot never received."""
    for (scope, space, key), e in folded.items():
        held = records.get((scope, space), {}).get(key)
        if e.op == "put":
            good = held is not None and held == (e.value, e.version, e.due, e.expires)
        else:
            good = held is None
        if not good:
            _corrupt_log(
                path,
                e.line,
                e.byte,
                f"seq {e.seq} ({e.op} of {space}/{key} version {e.version}) is at or before the snapshot's log_seq "
                f"{log_seq}, but the snapshot does not hold what it wrote",
            )
