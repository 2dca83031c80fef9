"""The on-disk format of the file durability backend (:mod:`botmesh.core.file_backend`):
encoding and parsing the snapshot and the append log, and replaying the log onto the
snapshot's records. Pure functions over bytes; :class:`~botmesh.core.file_kv.FileKv`
does the I/O. A damaged file raises :class:`~botmesh.core.errors.JournalCorruptError`
(its rules are under "Open" in :mod:`botmesh.core.file_backend`).

Files, for a journal opened at ``path``:

``path``
    The **snapshot**: one JSON document with every record and ``log_seq``, the sequence
    number of the last append-log entry it includes. Always replaced by writing
    ``<path>.tmp`` and renaming it over ``path``: atomic against a crash of the process;
    against a power cut only with ``fsync``, which forces the data to disk before the
    rename and the directory after it (without, the rename may land and the data not)::

        {"format":"botmesh.file_kv","version":1,"log_seq":42,"records":[
        [scope, space, key, version, due, expires, value],
        ...
        ]}

``<path>.log``
    The **append log** (only with ``append_log=True``, or a leftover of such a run): one
    JSON line per committed write, carrying everything needed to replay it::

        {"seq":43,"op":"put","scope":..,"space":..,"key":..,"version":3,"due":..,"expires":..,"value":{..}}
        {"seq":44,"op":"del","scope":..,"space":..,"key":..,"version":3}

    ``version`` is the version the put created, or the version the delete removed.
    ``seq`` grows by one per entry and never restarts (it continues from ``log_seq``).

``<path>.lock``
    The owner's pid; the owner also holds a ``flock`` on it while open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

from .errors import JournalCorruptError

__all__ = [
    "SNAPSHOT_FORMAT",
    "Entry",
    "LogEntry",
    "Records",
    "Space",
    "is_int",
    "is_score",
    "log_line",
    "parse_snapshot",
    "replay",
    "scan_log",
    "snapshot_bytes",
]

SNAPSHOT_FORMAT = "botmesh.file_kv"
"""The ``format`` field of a snapshot file."""
_SNAPSHOT_VERSION = 1

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


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_score(value: Any) -> bool:
    """Whether ``value`` can be an index score: None or a number (a bool is not)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _dumps(obj: Any) -> str:
    # allow_nan: scores may be ±inf (values were already checked by check_json_object,
    # which forbids NaN/inf inside them); Python's json reads Infinity back.
    return json.dumps(obj, separators=(",", ":"), allow_nan=True)


def snapshot_bytes(records: Records, log_seq: int) -> bytes:
    """The snapshot file for ``records``: one record per line, sorted, so the file is
    deterministic and readable."""
    rows: list[str] = []
    for scope, space in sorted(records):
        space_map = records[(scope, space)]
        for key in sorted(space_map):
            value, version, due, expires = space_map[key]
            rows.append(_dumps([scope, space, key, version, due, expires, value]))
    head = _dumps({"format": SNAPSHOT_FORMAT, "version": _SNAPSHOT_VERSION, "log_seq": log_seq})
    # Splice the records list into the header object by hand to get one line per record.
    body = head[:-1] + ',"records":[\n' + ",\n".join(rows) + ("\n" if rows else "") + "]}\n"
    return body.encode("ascii")


def log_line(seq: int, op: str, scope: str, space: str, key: str, version: int, entry: Entry | None) -> bytes:
    """One append-log line, newline included (json.dumps escapes every newline inside,
    so a line never spans two)."""
    obj: dict[str, Any] = {"seq": seq, "op": op, "scope": scope, "space": space, "key": key, "version": version}
    if entry is not None:
        obj["due"] = entry[2]
        obj["expires"] = entry[3]
        obj["value"] = entry[0]
    return (_dumps(obj) + "\n").encode("ascii")


def _corrupt_snapshot(path: str, reason: str) -> JournalCorruptError:
    return JournalCorruptError(
        f"{path}: the snapshot cannot be read back ({reason}); nothing was loaded — "
        "restore it from a copy or move it aside",
        code="SNAPSHOT_CORRUPT",
        file=path,
    )


def _corrupt_log(path: str, line: int, byte: int, reason: str) -> JournalCorruptError:
    return JournalCorruptError(
        f"{path}: damaged append-log entry at line {line} (byte {byte}): {reason}; the log "
        "was left as it is — restore it from a copy or move it aside",
        code="APPEND_LOG_CORRUPT",
        file=path,
        line=line,
        byte=byte,
    )


def parse_snapshot(data: bytes, path: str) -> tuple[Records, int]:
    """Records and ``log_seq`` of a snapshot file, or ``JournalCorruptError``."""
    try:
        doc = json.loads(data)
    except ValueError as exc:  # includes UnicodeDecodeError
        raise _corrupt_snapshot(path, f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
        raise _corrupt_snapshot(path, f"not a {SNAPSHOT_FORMAT} snapshot")
    if doc.get("version") != _SNAPSHOT_VERSION:
        raise _corrupt_snapshot(path, f"unsupported snapshot version {doc.get('version')!r}")
    log_seq = doc.get("log_seq")
    rows = doc.get("records")
    if not is_int(log_seq) or log_seq < 0 or not isinstance(rows, list):
        raise _corrupt_snapshot(path, "bad log_seq or records")
    records: Records = {}
    for i, row in enumerate(rows):
        if not (
            isinstance(row, list)
            and len(row) == 7
            and all(isinstance(part, str) for part in row[:3])
            and is_int(row[3])
            and row[3] >= 1
            and is_score(row[4])
            and is_score(row[5])
            and isinstance(row[6], dict)
        ):
            raise _corrupt_snapshot(path, f"record #{i + 1} is malformed")
        scope, space, key, version, due, expires, value = row
        space_map = records.setdefault((scope, space), {})
        if key in space_map:
            raise _corrupt_snapshot(path, f"record #{i + 1} ({space}/{key}) appears twice")
        space_map[key] = (
            value,
            version,
            None if due is None else float(due),
            None if expires is None else float(expires),
        )
    return records, log_seq


def _parse_entry(obj: Any, line: int, byte: int) -> LogEntry | None:
    """A log entry from a decoded JSON line, or None when it is not a valid one."""
    if not isinstance(obj, dict):
        return None
    seq, op, version = obj.get("seq"), obj.get("op"), obj.get("version")
    scope, space, key = obj.get("scope"), obj.get("space"), obj.get("key")
    if not (is_int(seq) and seq >= 1 and is_int(version) and version >= 1):
        return None
    if not (isinstance(scope, str) and isinstance(space, str) and isinstance(key, str)):
        return None
    if op == "del":
        return LogEntry(seq, op, scope, space, key, version, None, None, None, line, byte)
    if op != "put":
        return None
    value, due, expires = obj.get("value"), obj.get("due"), obj.get("expires")
    if not (isinstance(value, dict) and is_score(due) and is_score(expires)):
        return None
    return LogEntry(
        seq,
        op,
        scope,
        space,
        key,
        version,
        value,
        None if due is None else float(due),
        None if expires is None else float(expires),
        line,
        byte,
    )


def scan_log(data: bytes, path: str) -> tuple[list[LogEntry], int]:
    """The entries of a log file and the length of its good prefix (where a torn tail
    starts, or ``len(data)``). Raises ``APPEND_LOG_CORRUPT`` for damage that is not a
    torn tail."""
    entries: list[LogEntry] = []
    first_bad: tuple[int, int] | None = None  # (line, byte) of the first unreadable line
    pos = 0
    line = 0
    while pos < len(data):
        line += 1
        newline = data.find(b"\n", pos)
        end = len(data) if newline == -1 else newline
        obj: Any = None
        readable = False
        if newline != -1:  # a line without its newline was never completely written
            try:
                obj = json.loads(data[pos:end])
                readable = True
            except ValueError:
                readable = False
        if not readable:
            if first_bad is None:
                first_bad = (line, pos)
        else:
            if first_bad is not None:
                # An unreadable line with a readable one after it is not a torn tail:
                # cutting there would silently drop the later entries.
                raise _corrupt_log(path, first_bad[0], first_bad[1], "unreadable line followed by more entries")
            entry = _parse_entry(obj, line, pos)
            if entry is None:
                # Valid JSON that is not an entry: damage, not a crash mid-write.
                raise _corrupt_log(path, line, pos, "not a valid log entry")
            entries.append(entry)
        pos = end + 1
    return entries, (len(data) if first_bad is None else first_bad[1])


def replay(records: Records, log_seq: int, entries: list[LogEntry], path: str) -> int:
    """Apply ``entries`` with ``seq > log_seq`` to ``records`` (a private copy being
    built at open). Returns the last seq seen. Raises ``APPEND_LOG_CORRUPT`` when an
    entry does not follow on."""
    last: int | None = None
    for e in entries:
        if last is None:
            if e.seq > log_seq + 1:
                raise _corrupt_log(
                    path, e.line, e.byte, f"seq {e.seq} but the snapshot ends at log_seq {log_seq}: entries are missing"
                )
        elif e.seq != last + 1:
            raise _corrupt_log(path, e.line, e.byte, f"seq {e.seq} does not follow seq {last}")
        last = e.seq
        if e.seq <= log_seq:
            continue  # already folded into the snapshot (crash before the log was truncated)
        space_map = records.setdefault((e.scope, e.space), {})
        current = space_map.get(e.key)
        found = 0 if current is None else current[1]
        if e.op == "put":
            if found != e.version - 1:
                raise _corrupt_log(
                    path, e.line, e.byte, f"put of {e.space}/{e.key} version {e.version} over version {found}"
                )
            assert e.value is not None
            space_map[e.key] = (e.value, e.version, e.due, e.expires)
        else:
            if current is None or found != e.version:
                raise _corrupt_log(
                    path, e.line, e.byte, f"delete of {e.space}/{e.key} version {e.version}, found {found}"
                )
            del space_map[e.key]
    return log_seq if last is None else max(last, log_seq)
