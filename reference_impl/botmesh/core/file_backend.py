"""The file durability backend: :class:`FileDurability` over :class:`FileKv` (BACK table,
BACK-4, BACK-5, BACK-6).

Files, for a journal opened at ``path``:

``path``
    The **snapshot**: one JSON document with every record and ``log_seq``, the sequence
    number of the last append-log entry it includes. Always replaced atomically (written
    to ``<path>.tmp``, then renamed over ``path``)::

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

Writes (BACK-4, BACK-6):

* Without the append log every write rewrites the whole snapshot.
* With it each write appends one line (fsync'ed when ``fsync``) and the snapshot is
  rewritten — then the log truncated — every ``compact_every`` entries (1000) or when
  the log reaches ``compact_bytes`` (4 MiB). A crash between the rewrite and the
  truncation is harmless: replay skips entries whose ``seq <= log_seq``.
* ``fsync`` defaults to ``True`` in both modes (the spec only fixes the append log's
  default; we chose the safe one for the snapshot too): each snapshot is forced to disk
  before it replaces the previous one, and the directory after the rename. With
  ``fsync=False`` the rename is still atomic, but may sit in the OS cache through a
  power cut (a process crash loses nothing either way).
* A write reaches the file before it reaches memory: a write that raised
  ``BackendUnavailableError`` left memory unchanged and, when the file could be put back
  (a failed append is truncated away), the file too. When the file cannot be put back
  into a known state the journal refuses every later call until it is reopened.
* Compaction is housekeeping: when it fails the write that triggered it has already
  been committed to the log, so it is logged as a warning and retried at the next write.

Open (BACK-4, BACK-5): the snapshot is read, then a leftover log is replayed — always,
also without ``append_log`` (it is then folded into the snapshot and removed). Damage is
reported as :class:`~botmesh.core.errors.JournalCorruptError` naming the file, before
anything is applied or any file is touched:

* a snapshot that does not parse (truncated, garbage, wrong shape): ``code
  "SNAPSHOT_CORRUPT"``;
* a torn tail of the log — a last line without its newline, or lines that are not JSON
  with no readable entry after them — is cut off (the file is truncated to the end of the
  last good line) and the rest replayed: those writes never returned;
* a line that is not JSON followed by more entries, a JSON line that is not a valid
  entry, or an entry that does not apply (a version or sequence gap): ``code
  "APPEND_LOG_CORRUPT"`` with ``file``, ``line`` (1-based) and ``byte`` (offset of the
  start of that line), the log left as it is.

Locking (BACK table): ``<path>.lock`` rejects a second live process; a second ``open()``
of the same (resolved) path in this process is rejected until ``close()``. A lock whose
pid is dead is taken over.

All OS calls go through :mod:`botmesh.core.fileio` (``io=`` to inject faults). The I/O is
synchronous inside the coroutines on purpose: writes are short and local, and keeping
them synchronous keeps virtual-time test runs deterministic.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, TypeGuard

from .errors import (
    BackendUnavailableError,
    ConfigError,
    JournalCorruptError,
    JournalLockedError,
    VersionConflict,
)
from .fileio import FileIO, default_io
from .kv_durability import KvDurability
from .spi import Capabilities, DurableKv, IndexName, Versioned, check_index, check_json_object

__all__ = ["SNAPSHOT_FORMAT", "FileDurability", "FileKv"]

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "botmesh.file_kv"
"""The ``format`` field of a snapshot file."""
_SNAPSHOT_VERSION = 1

DEFAULT_COMPACT_EVERY = 1000
DEFAULT_COMPACT_BYTES = 4 * 1024 * 1024

# value, version, due, expires — the same tuple MemoryKv keeps.
_Entry = tuple[dict[str, Any], int, float | None, float | None]
_Space = dict[str, _Entry]
_Records = dict[tuple[str, str], _Space]

# Resolved paths of the journals open in this process (the same-process half of the
# BACK-table lock; the lock file only sees other processes).
_open_paths: set[str] = set()
_open_paths_guard = threading.Lock()


@dataclass(frozen=True)
class _LogEntry:
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


class _SnapshotWriteFailed(Exception):
    """Internal: a snapshot rewrite failed. ``landed`` tells whether the new snapshot had
    already replaced the old one (only its directory fsync failed)."""

    def __init__(self, cause: OSError, landed: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.landed = landed


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_score(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _score(value: Any, name: str) -> float | None:
    """A put's index score as stored (a float), or None."""
    if value is None:
        return None
    if not _is_score(value):
        raise TypeError(f"{name} must be a number or None, got {type(value).__name__}")
    return float(value)


def _check_name(value: Any, name: str) -> None:
    # The files store scope/space/key as JSON strings; anything else could not be read
    # back as the same value.
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def _dumps(obj: Any) -> str:
    # allow_nan: scores may be ±inf (values were already checked by check_json_object,
    # which forbids NaN/inf inside them); Python's json reads Infinity back.
    return json.dumps(obj, separators=(",", ":"), allow_nan=True)


def _snapshot_bytes(records: _Records, log_seq: int) -> bytes:
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


def _log_line(seq: int, op: str, scope: str, space: str, key: str, version: int, entry: _Entry | None) -> bytes:
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


def _parse_snapshot(data: bytes, path: str) -> tuple[_Records, int]:
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
    if not _is_int(log_seq) or log_seq < 0 or not isinstance(rows, list):
        raise _corrupt_snapshot(path, "bad log_seq or records")
    records: _Records = {}
    for i, row in enumerate(rows):
        if not (
            isinstance(row, list)
            and len(row) == 7
            and all(isinstance(part, str) for part in row[:3])
            and _is_int(row[3])
            and row[3] >= 1
            and _is_score(row[4])
            and _is_score(row[5])
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


def _parse_entry(obj: Any, line: int, byte: int) -> _LogEntry | None:
    """A log entry from a decoded JSON line, or None when it is not a valid one."""
    if not isinstance(obj, dict):
        return None
    seq, op, version = obj.get("seq"), obj.get("op"), obj.get("version")
    scope, space, key = obj.get("scope"), obj.get("space"), obj.get("key")
    if not (_is_int(seq) and seq >= 1 and _is_int(version) and version >= 1):
        return None
    if not (isinstance(scope, str) and isinstance(space, str) and isinstance(key, str)):
        return None
    if op == "del":
        return _LogEntry(seq, op, scope, space, key, version, None, None, None, line, byte)
    if op != "put":
        return None
    value, due, expires = obj.get("value"), obj.get("due"), obj.get("expires")
    if not (isinstance(value, dict) and _is_score(due) and _is_score(expires)):
        return None
    return _LogEntry(
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


def _scan_log(data: bytes, path: str) -> tuple[list[_LogEntry], int]:
    """The entries of a log file and the length of its good prefix (where a torn tail
    starts, or ``len(data)``). Raises ``APPEND_LOG_CORRUPT`` for damage that is not a
    torn tail."""
    entries: list[_LogEntry] = []
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


def _replay(records: _Records, log_seq: int, entries: list[_LogEntry], path: str) -> int:
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


def _parse_pid(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        pid = int(text.strip())
    except ValueError:
        return None
    return pid if pid > 0 else None


class FileKv(DurableKv):
    """A :class:`~botmesh.core.spi.DurableKv` kept in memory and persisted to files
    (module docstring). It behaves exactly like :class:`~botmesh.core.memory.MemoryKv`
    and survives a crash of the process; it serves one process only.

    Options (each validated, a bad one raises :class:`~botmesh.core.errors.ConfigError`
    naming it):

    * ``append_log`` — append each write to ``<path>.log`` instead of rewriting the
      snapshot. Giving ``compact_every`` or ``compact_bytes`` turns it on as well.
    * ``compact_every`` (1000), ``compact_bytes`` (4 MiB) — when to fold the log into
      the snapshot.
    * ``fsync`` (True) — force each snapshot and each log append to disk (BACK-6).
    * ``io`` — the :class:`~botmesh.core.fileio.FileIO` doing the OS calls (faults).

    Differences from ``MemoryKv`` only for inputs it would not be able to store:
    ``scope``/``space``/``key`` must be ``str`` and index scores numbers (``TypeError``).
    Calls before :meth:`open` raise ``BackendUnavailableError``, as the contract says.
    """

    capabilities = Capabilities(survives_crash=True, multi_process=False, multi_host=False, shared=False)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append_log: bool = False,
        compact_every: int | None = None,
        compact_bytes: int | None = None,
        fsync: bool | None = None,
        io: FileIO | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path):
            raise ConfigError(f"path must be a non-empty str or path, got {path!r}", option="path")
        if not isinstance(append_log, bool):
            raise ConfigError(f"append_log must be True or False, got {append_log!r}", option="append_log")
        for option, given in (("compact_every", compact_every), ("compact_bytes", compact_bytes)):
            if given is not None and (not _is_int(given) or given <= 0):
                raise ConfigError(f"{option} must be a positive int, got {given!r}", option=option)
        if fsync is not None and not isinstance(fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {fsync!r}", option="fsync")
        self._io: FileIO = default_io if io is None else io
        self._path: str = self._io.resolve(os.fspath(path))
        self._log_path = self._path + ".log"
        self._lock_path = self._path + ".lock"
        self._append_log = append_log or compact_every is not None or compact_bytes is not None
        self._compact_every = DEFAULT_COMPACT_EVERY if compact_every is None else compact_every
        self._compact_bytes = DEFAULT_COMPACT_BYTES if compact_bytes is None else compact_bytes
        self._fsync = True if fsync is None else fsync

        self._records: _Records = {}
        self._seq = 0  # seq of the last write committed (log_seq of a snapshot written now)
        self._log_fd: int | None = None
        self._log_entries = 0  # lines in the log file (those already folded included)
        self._log_bytes = 0  # its size: where the next append starts
        self._lock_fd: int | None = None
        self._is_open = False
        # Set when the file could not be put back into a known state after a failed
        # write: every call then fails until the journal is reopened from disk.
        self._broken: str | None = None
        # No await happens between a write's version check and its commit, so writes are
        # already atomic between tasks; the lock keeps them so if that ever changes.
        self._write_lock = asyncio.Lock()

    # -- public properties ---------------------------------------------------------------
    @property
    def path(self) -> str:
        """The snapshot file (absolute, symbolic links resolved)."""
        return self._path

    @property
    def log_path(self) -> str:
        """The append log, ``<path>.log``."""
        return self._log_path

    @property
    def lock_path(self) -> str:
        """The lock file, ``<path>.lock``."""
        return self._lock_path

    @property
    def append_log(self) -> bool:
        """Whether writes go to the append log."""
        return self._append_log

    @property
    def is_open(self) -> bool:
        """Whether the journal is open in this object."""
        return self._is_open

    # -- lifecycle -------------------------------------------------------------------------
    async def open(self) -> None:
        """Take the lock, load the snapshot, replay a leftover log (BACK-4, BACK-5).
        Idempotent. Raises ``JournalLockedError``, ``JournalCorruptError`` (nothing
        loaded, no file touched) or ``BackendUnavailableError``."""
        if self._is_open:
            return
        self._register()
        try:
            self._take_lock_file()
            try:
                self._load()
            except BaseException:
                self._release_lock_file()
                raise
        except BaseException:
            self._unregister()
            raise
        self._broken = None
        self._is_open = True

    async def close(self) -> None:
        """Fold the log into the snapshot, remove the log and the lock. Idempotent; later
        calls raise ``BackendUnavailableError``. A fold that fails is logged, not raised:
        the log stays and is replayed at the next open, so nothing is lost."""
        if not self._is_open:
            return
        self._is_open = False
        try:
            if self._log_fd is not None and self._broken is None:
                self._fold_and_remove_log()
        finally:
            if self._log_fd is not None:
                self._close_quietly(self._log_fd)
                self._log_fd = None
            self._release_lock_file()
            self._unregister()

    def abandon(self) -> None:
        """TEST ONLY: behave as if this process had died now. Drops the in-process
        registration and the file handles without compacting or writing anything, and
        leaves the lock file on disk naming a pid that is not alive, so the next
        ``open()`` exercises the dead-owner takeover. Whatever was acknowledged is on
        disk already; nothing else is."""
        if not self._is_open:
            return
        self._is_open = False
        try:
            if self._log_fd is not None:
                self._close_quietly(self._log_fd)
                self._log_fd = None
            if self._lock_fd is not None:
                # Closing drops the flock, as the kernel does for a dead process.
                self._close_quietly(self._lock_fd)
                self._lock_fd = None
                self._io.write_lock(self._lock_path, self._io.dead_pid())
        finally:
            self._unregister()

    # -- DurableKv -------------------------------------------------------------------------
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """See :meth:`DurableKv.get`."""
        self._check()
        entry = self._records.get((scope, space), {}).get(key)
        result = None if entry is None else Versioned(copy.deepcopy(entry[0]), entry[1])
        await asyncio.sleep(0)
        return result

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        """See :meth:`DurableKv.put`. The write is on file (and fsync'ed when ``fsync``)
        before it is applied in memory and acknowledged."""
        self._check()
        stored = check_json_object(value)
        _check_name(scope, "scope")
        _check_name(space, "space")
        _check_name(key, "key")
        due_score = _score(due, "due")
        expires_score = _score(expires, "expires")
        async with self._write_lock:
            self._check()
            current = self._records.get((scope, space), {}).get(key)
            current_version = 0 if current is None else current[1]
            conflict: VersionConflict | None
            if current_version != expected_version:
                conflict = VersionConflict.at(space, key, expected_version, current_version)
            else:
                conflict = None
                entry: _Entry = (stored, expected_version + 1, due_score, expires_score)
                self._commit(scope, space, key, entry, expected_version + 1)
        await asyncio.sleep(0)
        if conflict is not None:
            raise conflict
        return expected_version + 1

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """See :meth:`DurableKv.delete`."""
        self._check()
        async with self._write_lock:
            self._check()
            current = self._records.get((scope, space), {}).get(key)
            current_version = 0 if current is None else current[1]
            conflict: VersionConflict | None
            if current is None or current_version != expected_version:
                conflict = VersionConflict.at(space, key, expected_version, current_version)
            else:
                conflict = None
                self._commit(scope, space, key, None, expected_version)
        await asyncio.sleep(0)
        if conflict is not None:
            raise conflict

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """See :meth:`DurableKv.range`."""
        self._check()
        pos = 2 if check_index(index) == "due" else 3
        entries = sorted(
            (entry[pos], key)
            for key, entry in self._records.get((scope, space), {}).items()
            if entry[pos] is not None and entry[pos] <= upto  # type: ignore[operator]
        )
        await asyncio.sleep(0)
        return [(float(score), key) for score, key in entries[:limit]]  # type: ignore[arg-type]

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """See :meth:`DurableKv.scan`."""
        self._check()
        records = self._records.get((scope, space), {})
        keys = sorted(k for k in records if after is None or k > after)[:limit]
        result = [(k, Versioned(copy.deepcopy(records[k][0]), records[k][1])) for k in keys]
        await asyncio.sleep(0)
        return result

    # -- writing ---------------------------------------------------------------------------
    def _check(self) -> None:
        if not self._is_open:
            raise BackendUnavailableError(f"{self._path}: the file journal is not open", file=self._path)
        if self._broken is not None:
            raise BackendUnavailableError(f"{self._path}: {self._broken}; reopen the journal", file=self._path)

    def _commit(self, scope: str, space: str, key: str, entry: _Entry | None, version: int) -> None:
        """Write one change (``entry`` None: delete) to file, then apply it in memory."""
        if self._append_log:
            self._commit_to_log(scope, space, key, entry, version)
        else:
            self._commit_to_snapshot(scope, space, key, entry)

    def _commit_to_log(self, scope: str, space: str, key: str, entry: _Entry | None, version: int) -> None:
        assert self._log_fd is not None
        seq = self._seq + 1
        data = _log_line(seq, "put" if entry is not None else "del", scope, space, key, version, entry)
        try:
            self._io.append(self._log_fd, data, fsync=self._fsync)
        except OSError as exc:
            # Part of the line may be in the file: cut it off, or the next append would
            # turn it into a damaged line in the middle of the log.
            try:
                self._io.truncate(self._log_fd, self._log_bytes, fsync=self._fsync)
            except OSError as undo:
                self._broken = f"a failed append could not be undone ({undo})"
            raise BackendUnavailableError(
                f"{self._log_path}: cannot append to the log: {exc}", file=self._log_path
            ) from exc
        self._seq = seq
        self._log_entries += 1
        self._log_bytes += len(data)
        space_map = self._records.setdefault((scope, space), {})
        if entry is None:
            del space_map[key]
        else:
            space_map[key] = entry
        if self._log_entries >= self._compact_every or self._log_bytes >= self._compact_bytes:
            self._compact()

    def _commit_to_snapshot(self, scope: str, space: str, key: str, entry: _Entry | None) -> None:
        # Build the next state beside the current one; it replaces it only once on file.
        records = dict(self._records)
        space_map = dict(records.get((scope, space), {}))
        if entry is None:
            del space_map[key]
        else:
            space_map[key] = entry
        records[(scope, space)] = space_map
        try:
            self._write_snapshot(records, self._seq)
        except _SnapshotWriteFailed as failed:
            if failed.landed:
                # The new snapshot is in place but not known to be on disk, and memory
                # does not have it: refuse further calls until a reopen reads the truth.
                self._broken = f"a snapshot write could not be confirmed ({failed.cause})"
            raise BackendUnavailableError(
                f"{self._path}: cannot write the snapshot: {failed.cause}", file=self._path
            ) from failed.cause
        self._records = records

    def _write_snapshot(self, records: _Records, log_seq: int) -> None:
        """Replace the snapshot atomically (BACK-6). Raises ``_SnapshotWriteFailed``."""
        data = _snapshot_bytes(records, log_seq)
        tmp = self._path + ".tmp"
        try:
            self._io.write_file(tmp, data, fsync=self._fsync)
            self._io.replace(tmp, self._path)
        except OSError as exc:
            try:
                self._io.remove(tmp)
            except OSError:
                pass  # the write's own error is the one to report
            raise _SnapshotWriteFailed(exc, landed=False) from exc
        if self._fsync:
            try:
                self._io.fsync_dir(os.path.dirname(self._path))
            except OSError as exc:
                raise _SnapshotWriteFailed(exc, landed=True) from exc

    def _compact(self) -> None:
        """Fold the log into the snapshot, then empty the log. The snapshot carries
        ``log_seq``, so stopping between the two steps loses and repeats nothing."""
        assert self._log_fd is not None
        try:
            self._write_snapshot(self._records, self._seq)
            self._io.truncate(self._log_fd, 0, fsync=self._fsync)
        except (_SnapshotWriteFailed, OSError) as exc:
            # The write that got us here is committed in the log; compaction is retried
            # at the next write.
            logger.warning("%s: compaction failed, retrying at the next write: %s", self._path, exc)
            return
        self._log_entries = 0
        self._log_bytes = 0

    def _fold_and_remove_log(self) -> None:
        """At close: fold the log into the snapshot and delete it (BACK-4)."""
        try:
            if self._log_entries > 0:
                self._write_snapshot(self._records, self._seq)
            self._io.remove(self._log_path)
        except (_SnapshotWriteFailed, OSError) as exc:
            logger.warning(
                "%s: could not fold the log at close (it will be replayed at the next open): %s", self._path, exc
            )

    # -- loading ---------------------------------------------------------------------------
    def _load(self) -> None:
        """Read the snapshot and the log, validate everything, and only then touch the
        files (trim a torn tail, or fold the log) and install the state."""
        try:
            snapshot = self._io.read_bytes(self._path)
        except OSError as exc:
            raise BackendUnavailableError(f"{self._path}: cannot read the snapshot: {exc}", file=self._path) from exc
        records: _Records
        if snapshot is None:
            records, log_seq = {}, 0
        else:
            records, log_seq = _parse_snapshot(snapshot, self._path)
        try:
            log = self._io.read_bytes(self._log_path)
        except OSError as exc:
            raise BackendUnavailableError(f"{self._log_path}: cannot read the log: {exc}", file=self._log_path) from exc
        entries: list[_LogEntry] = []
        good = 0
        seq = log_seq
        if log is not None:
            entries, good = _scan_log(log, self._log_path)
            seq = _replay(records, log_seq, entries, self._log_path)
            if good < len(log):
                logger.warning(
                    "%s: cut a torn last entry at byte %d (%d bytes of an unfinished write)",
                    self._log_path,
                    good,
                    len(log) - good,
                )
        # Everything read back: from here on files change.
        try:
            if self._append_log:
                if entries and entries[-1].seq <= log_seq:
                    # Every entry is already in the snapshot (a crash between compaction's
                    # two steps): finish that compaction, so the log holds only the
                    # entries that follow log_seq.
                    entries, good = [], 0
                if log is not None and good < len(log):
                    self._io.truncate_path(self._log_path, good, fsync=self._fsync)
                self._log_fd = self._io.open_append(self._log_path, fsync=self._fsync)
                self._log_entries = len(entries)
                self._log_bytes = good
            elif log is not None:
                # A leftover of an append-log run: fold it in, then drop it (BACK-4).
                if entries:
                    self._write_snapshot(records, seq)
                self._io.remove(self._log_path)
        except _SnapshotWriteFailed as failed:
            raise BackendUnavailableError(
                f"{self._path}: cannot fold the leftover log into the snapshot: {failed.cause}", file=self._path
            ) from failed.cause
        except OSError as exc:
            if self._log_fd is not None:
                self._close_quietly(self._log_fd)
                self._log_fd = None
            raise BackendUnavailableError(f"{self._log_path}: cannot open the log: {exc}", file=self._log_path) from exc
        self._records = records
        self._seq = seq

    # -- locking ---------------------------------------------------------------------------
    def _register(self) -> None:
        with _open_paths_guard:
            if self._path in _open_paths:
                raise JournalLockedError(
                    f"{self._path} is already open in this process; close() it before opening it again",
                    file=self._lock_path,
                    pid=self._io.getpid(),
                )
            _open_paths.add(self._path)

    def _unregister(self) -> None:
        with _open_paths_guard:
            _open_paths.discard(self._path)

    def _take_lock_file(self) -> None:
        me = self._io.getpid()
        try:
            fd = self._io.lock_acquire(self._lock_path)
            if fd is None:
                holder = _parse_pid(self._io.read_lock(self._lock_path))
                raise JournalLockedError(
                    f"{self._path} is open in another live process"
                    + (f" (pid {holder})" if holder is not None else "")
                    + f": lock file {self._lock_path}",
                    file=self._lock_path,
                    pid=holder,
                )
            try:
                holder = _parse_pid(self._io.read_lock(self._lock_path))
                # A pid is trusted even without its flock (another implementation may
                # only write pids); our own pid here is a leftover of an earlier process
                # that had it, since this process has not registered the path.
                if holder is not None and holder != me and self._io.pid_alive(holder):
                    raise JournalLockedError(
                        f"{self._path} is open in another live process (pid {holder}): lock file {self._lock_path}",
                        file=self._lock_path,
                        pid=holder,
                    )
                if holder is not None and holder != me:
                    logger.warning("%s: taking over the lock of dead process %d", self._lock_path, holder)
                self._io.lock_write_pid(fd, me, fsync=self._fsync)
            except BaseException:
                self._close_quietly(fd)
                raise
        except OSError as exc:
            raise BackendUnavailableError(
                f"{self._lock_path}: cannot take the lock: {exc}", file=self._lock_path
            ) from exc
        self._lock_fd = fd

    def _release_lock_file(self) -> None:
        if self._lock_fd is None:
            return
        fd, self._lock_fd = self._lock_fd, None
        try:
            self._io.lock_release(fd, self._lock_path)
        except OSError as exc:
            # The flock went with the descriptor; a lock file left behind names this
            # process, which the next opener treats as dead once we exit.
            logger.warning("%s: could not remove the lock file: %s", self._lock_path, exc)

    def _close_quietly(self, fd: int) -> None:
        try:
            self._io.close_fd(fd)
        except OSError:
            pass  # closing is best effort: the descriptor is gone either way


class FileDurability(KvDurability):
    """The file durability backend (BACK table): journals in one file, surviving a crash,
    for one process. Open it with :meth:`open`; it stays open across bots until
    :meth:`close` (``start()``/``stop()`` of a bot do not close it)."""

    def __init__(self, kv: FileKv, *, own_kv: bool = False, name: str | None = "file") -> None:
        super().__init__(kv, own_kv=own_kv, name=name)
        self._file_kv = kv

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        append_log: bool = False,
        compact_every: int | None = None,
        compact_bytes: int | None = None,
        fsync: bool | None = None,
        io: FileIO | None = None,
    ) -> FileDurability:
        """Open (creating when missing) the journal at ``path`` (BACK-4). ``append_log``
        — or giving ``compact_every`` / ``compact_bytes`` — appends each write to
        ``<path>.log``; ``fsync`` (default True) forces each write to disk (BACK-6);
        ``io`` replaces the OS layer (fault injection). Bad options raise
        ``ConfigError`` naming the option; a locked journal ``JournalLockedError``; a
        damaged one ``JournalCorruptError`` (BACK-5)."""
        kv = FileKv(
            path, append_log=append_log, compact_every=compact_every, compact_bytes=compact_bytes, fsync=fsync, io=io
        )
        await kv.open()
        return cls(kv, own_kv=False, name="file")

    @property
    def path(self) -> str:
        """The snapshot file (absolute)."""
        return self._file_kv.path

    @property
    def file_kv(self) -> FileKv:
        """The underlying :class:`FileKv`."""
        return self._file_kv

    async def close(self) -> None:
        """Fold the log into the snapshot and release the lock. Idempotent."""
        await self._file_kv.close()

    def abandon(self) -> None:
        """TEST ONLY: simulate the death of this process (see :meth:`FileKv.abandon`)."""
        self._file_kv.abandon()
