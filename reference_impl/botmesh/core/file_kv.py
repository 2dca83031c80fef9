"""``FileKv``: the :class:`~botmesh.core.spi.DurableKv` of the file durability backend,
kept in memory and persisted to files through :mod:`botmesh.core.fileio`. How it writes,
opens and locks is in the docstring of :mod:`botmesh.core.file_backend`; the format of
its files in :mod:`botmesh.core.file_format`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .errors import BackendUnavailableError, ConfigError, JournalLockedError, VersionConflict
from .file_format import (
    FORMAT_VERSION,
    LOG_HEADER,
    LOG_VERSION,
    Entry,
    Records,
    SnapshotLines,
    ValueTexts,
    encode_value,
    is_int,
    log_commit,
    log_entry,
    parse_snapshot,
    replay,
    scan_log,
    snapshot_buffer,
)
from .fileio import FileIO, default_io
from .group_commit import GroupCommit
from .inputs import check_delete, check_put, check_range, check_record, check_scan
from .memory import OwnedValuesKv
from .spi import Capabilities, IndexName, Versioned, check_index, check_json_object, index_entries

__all__ = ["DEFAULT_COMPACT_BYTES", "DEFAULT_COMPACT_EVERY", "FileKv"]

# The name users configure logging by: the module FileKv was defined in before the split.
logger = logging.getLogger("botmesh.core.file_backend")

DEFAULT_COMPACT_EVERY = 1000
"""Append-log entries after which the log is folded into the snapshot."""
DEFAULT_COMPACT_BYTES = 4 * 1024 * 1024
"""Append-log size (bytes) at which the log is folded into the snapshot."""

# Resolved paths of the journals open in this process (the same-process half of the
# BACK-table lock; the lock file only sees other processes).
_open_paths: set[str] = set()
_open_paths_guard = threading.Lock()


class _Change(NamedTuple):
    """One write of a group: ``entry`` None for a delete; ``version`` the version a put
    creates or a delete removes; ``encoded`` the value as ``encode_value`` returned it."""

    scope: str
    space: str
    key: str
    entry: Entry | None
    version: int
    encoded: str | None


class _SnapshotWriteFailed(Exception):
    """Internal: a snapshot rewrite failed. ``landed`` tells whether the new snapshot had
    already replaced the old one (only its directory fsync failed)."""

    def __init__(self, cause: OSError, landed: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.landed = landed


def _parse_pid(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        pid = int(text.strip())
    except ValueError:
        return None
    return pid if pid > 0 else None


class FileKv(OwnedValuesKv):
    """A :class:`~botmesh.core.spi.DurableKv` kept in memory and persisted to files
    (docstring of :mod:`botmesh.core.file_backend`). It behaves exactly like
    :class:`~botmesh.core.memory.MemoryKv` and survives a crash of the process; it
    serves one process only. It claims ``survives_crash`` only with ``fsync`` (the
    default): without it an acknowledged write survives a SIGKILL (it is in the
    operating system's cache) but not a power cut, so ``FileKv(fsync=False)`` claims
    nothing (its ``capabilities`` are all False).

    Options (each validated, a bad one raises :class:`~botmesh.core.errors.ConfigError`
    naming it):

    * ``path`` — the snapshot file: no NUL byte, not a directory (nor are ``<path>.log``,
      ``.lock``, ``.tmp``), in an existing directory where this process may create
      files, readable and writable when it exists
      (:func:`~botmesh.core.fileio.place_problem`).

    * ``append_log`` — append each write to ``<path>.log`` instead of rewriting the
      snapshot. Giving ``compact_every`` or ``compact_bytes`` turns it on as well.
    * ``compact_every`` (1000), ``compact_bytes`` (4 MiB) — when to fold the log into
      the snapshot.
    * ``fsync`` (True) — force each snapshot and each log append to disk (BACK-6);
      False gives up ``survives_crash`` (see above).
    * ``io`` — the :class:`~botmesh.core.fileio.FileIO` doing the OS calls (faults).

    Its arguments are checked as every built-in kv checks them
    (:mod:`botmesh.core.inputs`); besides, a value nesting deeper than
    :data:`~botmesh.core.file_format.MAX_VALUE_DEPTH` (128) levels raises ``ValueError``
    naming it (the reader refuses such lines as damage, so they are never written).
    Calls before :meth:`open` raise ``BackendUnavailableError``, as the contract says.

    Memory: every record's value, and — from the first snapshot written on — its line of
    the snapshot as well (JSON text), so that the next snapshot encodes only the records
    written since (:func:`~botmesh.core.file_format.snapshot_bytes`); the values written
    since are kept as the JSON text their write encoded too, which that snapshot takes
    instead of encoding them again.
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
            raise ConfigError(f"path must be a non-empty str or path, got {path!r}", option="path", value=path)
        if "\x00" in os.fspath(path):
            raise ConfigError(f"path must not contain a NUL byte, got {os.fspath(path)!r}", option="path", value=path)
        try:
            os.fsencode(path)  # a name the file system's encoding cannot express
        except UnicodeEncodeError as exc:
            raise ConfigError(f"path cannot be encoded as a file name ({exc.reason}): {os.fspath(path)!r}", option="path",
                              value=path) from None
        if not isinstance(append_log, bool):
            raise ConfigError(f"append_log must be True or False, got {append_log!r}", option="append_log")
        for option, given in (("compact_every", compact_every), ("compact_bytes", compact_bytes)):
            if given is not None and (not is_int(given) or given <= 0):
                raise ConfigError(f"{option} must be a positive int, got {given!r}", option=option)
        if fsync is not None and not isinstance(fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {fsync!r}", option="fsync")
        self._io: FileIO = default_io if io is None else io
        self._path: str = self._io.resolve(os.fspath(path))
        problem = self._io.unusable(self._path, (".log", ".lock", ".tmp"))
        if problem is not None:
            raise ConfigError(f"path: {problem}", option="path", value=path)
        self._log_path = self._path + ".log"
        self._lock_path = self._path + ".lock"
        self._append_log = append_log or compact_every is not None or compact_bytes is not None
        self._compact_every = DEFAULT_COMPACT_EVERY if compact_every is None else compact_every
        self._compact_bytes = DEFAULT_COMPACT_BYTES if compact_bytes is None else compact_bytes
        self._fsync = True if fsync is None else fsync
        if not self._fsync and type(self).capabilities is FileKv.capabilities:
            # Without fsync an acknowledged write is only in the OS cache: it survives the
            # process, not a power cut, and survives_crash promises both (issue 11). A
            # subclass that declares capabilities of its own answers for them.
            self.capabilities = Capabilities()

        self._records: Records = {}
        self._snapshot_lines: SnapshotLines = {}  # the last snapshot's lines (snapshot_bytes)
        self._value_texts: ValueTexts = {}  # the values written since, as encoded (snapshot_bytes)
        self._seq = 0  # seq of the last write committed (log_seq of a snapshot written now)
        self._log_fd: int | None = None
        self._log_entries = 0  # lines in the log file (those already folded included)
        self._log_bytes = 0  # its size: where the next append starts
        self._lock_fd: int | None = None
        self._is_open = False
        # Set when the file could not be put back into a known state after a failed
        # write: every call then fails until the journal is reopened from disk.
        self._broken: str | None = None
        # Concurrent writes share one append + fsync (or one snapshot): group commit.
        self._group: GroupCommit[_Change, int] = GroupCommit(self._commit)

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

    @property
    def fsync(self) -> bool:
        """Whether each write is forced to disk before it returns."""
        return self._fsync

    async def durability_settings(self) -> dict[str, str]:
        """``{"kind": "file", "fsync": ..., "append_log": ...}`` (``"True"``/``"False"``):
        the options this journal writes with (see
        :meth:`DurableKv.durability_settings <botmesh.core.spi.DurableKv.durability_settings>`).
        Open or not: they are fixed when the kv is built."""
        return {"kind": "file", "fsync": str(self._fsync), "append_log": str(self._append_log)}

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
            self._snapshot_lines = {}
            self._value_texts = {}
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
            self._snapshot_lines = {}
            self._value_texts = {}
            self._unregister()

    # -- DurableKv -------------------------------------------------------------------------
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """See :meth:`DurableKv.get`."""
        check_record(scope, space, key)
        self._check()
        entry = self._records.get((scope, space), {}).get(key)
        result = None if entry is None else Versioned(check_json_object(entry[0]), entry[1])
        await asyncio.sleep(0)
        return result

    async def put_owned(
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
        """See :meth:`~botmesh.core.memory.OwnedValuesKv.put_owned` (``put`` is this of a
        copy). The write is on file (and fsync'ed when ``fsync``) before it is applied
        in memory and acknowledged; concurrent writes share that appends and fsyncs
        (group commit, :mod:`botmesh.core.group_commit`)."""
        due_score, expires_score = check_put(scope, space, key, expected_version, due, expires)
        encoded = encode_value(value, f"{scope}/{space}/{key}")
        self._check()

        def prepare() -> _Change:
            self._check()
            current = self._records.get((scope, space), {}).get(key)
            current_version = 0 if current is None else current[1]
            if current_version != expected_version:
                raise VersionConflict.at(space, key, expected_version, current_version)
            entry: Entry = (value, expected_version + 1, due_score, expires_score)
            return _Change(scope, space, key, entry, expected_version + 1, encoded)

        return await self._write((scope, space, key), prepare)

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """See :meth:`DurableKv.delete`."""
        check_delete(scope, space, key, expected_version)
        self._check()

        def prepare() -> _Change:
            self._check()
            current = self._records.get((scope, space), {}).get(key)
            current_version = 0 if current is None else current[1]
            if current is None or current_version != expected_version:
                raise VersionConflict.at(space, key, expected_version, current_version)
            return _Change(scope, space, key, None, expected_version, None)

        await self._write((scope, space, key), prepare)

    async def _write(self, record: tuple[str, str, str], prepare: Callable[[], _Change]) -> int:
        """Check (``prepare``) and queue one change, then wait until its group is on file
        (:mod:`botmesh.core.group_commit`); a conflict is raised after one suspension
        point, as MemoryKv does."""
        try:
            return await self._group.submit(record, prepare)
        except VersionConflict:
            await asyncio.sleep(0)
            raise

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """See :meth:`DurableKv.range`."""
        upto = check_range(scope, space, upto)
        pos = 2 if check_index(index) == "due" else 3
        self._check()
        entries = index_entries(self._records.get((scope, space), {}).items(), pos, upto, limit)
        await asyncio.sleep(0)
        return entries

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """See :meth:`DurableKv.scan`."""
        after = check_scan(scope, space, after)
        self._check()
        records = self._records.get((scope, space), {})
        keys = sorted(k for k in records if after is None or k > after)[:limit]
        result = [(k, Versioned(check_json_object(records[k][0]), records[k][1])) for k in keys]
        await asyncio.sleep(0)
        return result

    # -- writing ---------------------------------------------------------------------------
    def _check(self) -> None:
        if not self._is_open:
            raise BackendUnavailableError(f"{self._path}: the file journal is not open", file=self._path)
        if self._broken is not None:
            raise BackendUnavailableError(f"{self._path}: {self._broken}; reopen the journal", file=self._path)

    def _commit(self, changes: list[_Change]) -> list[int]:
        """Write a group of changes to file in one go (one append and one fsync, or one
        snapshot), then apply them in memory; return their versions. Raises
        ``BackendUnavailableError`` for the whole group, memory unchanged."""
        self._check()
        if self._append_log:
            self._commit_to_log(changes)
        else:
            self._commit_to_snapshot(changes)
        return [change.version for change in changes]

    def _append_commit(self, changes: Sequence[_Change]) -> None:
        """Append ``changes`` to the log as one commit — entries numbered on from the last
        seq, as one line (:func:`~botmesh.core.file_format.log_commit`) — by one write
        and, with ``fsync``, one fsync; then count them and their bytes (memory is the
        caller's to update). The write's pages may reach the disk in any order before the
        fsync returns; whatever a power cut leaves of them is damage of the log's final
        line, which the reader trims as a torn write (log version 3,
        :mod:`botmesh.core.file_format`). On failure, what part of it reached the file is
        cut off again (or the next append would turn it into a damaged line in the middle
        of the log) and ``BackendUnavailableError`` is raised."""
        assert self._log_fd is not None
        seq = self._seq
        entries = []
        for scope, space, key, entry, version, encoded in changes:
            seq += 1
            entries.append(log_entry(seq, "put" if entry is not None else "del", scope, space, key, version, entry,
                                     encoded))
        data = log_commit(entries)
        try:
            self._io.append(self._log_fd, data, fsync=self._fsync)
        except OSError as exc:
            try:
                self._io.truncate(self._log_fd, self._log_bytes, fsync=self._fsync)
            except OSError as undo:
                self._broken = f"a failed append could not be undone ({undo})"
            raise BackendUnavailableError(
                f"{self._log_path}: cannot append to the log: {exc}", file=self._log_path
            ) from exc
        self._seq = seq
        self._log_entries += len(entries)
        self._log_bytes += len(data)

    def _compact_when_due(self) -> None:
        """Fold the log into the snapshot once it reached ``compact_every`` entries or
        ``compact_bytes`` bytes (BACK-4)."""
        if self._log_entries >= self._compact_every or self._log_bytes >= self._compact_bytes:
            self._compact()

    def _commit_to_log(self, changes: list[_Change]) -> None:
        self._append_commit(changes)
        texts = self._value_texts
        for c in changes:
            space_map = self._records.setdefault((c.scope, c.space), {})
            if c.entry is None:
                del space_map[c.key]
                texts.pop((c.scope, c.space, c.key), None)
            else:
                space_map[c.key] = c.entry
                texts[(c.scope, c.space, c.key)] = (c.entry, c.encoded)  # type: ignore[assignment]
        self._compact_when_due()

    def _commit_to_snapshot(self, changes: list[_Change]) -> None:
        # Build the next state beside the current one; it replaces it only once on file.
        records = dict(self._records)
        copied: set[tuple[str, str]] = set()
        for c in changes:
            if (c.scope, c.space) not in copied:
                records[(c.scope, c.space)] = dict(records.get((c.scope, c.space), {}))
                copied.add((c.scope, c.space))
            space_map = records[(c.scope, c.space)]
            if c.entry is None:
                del space_map[c.key]
            else:
                space_map[c.key] = c.entry
                self._value_texts[(c.scope, c.space, c.key)] = (c.entry, c.encoded)  # type: ignore[assignment]
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

    def _write_snapshot(self, records: Records, log_seq: int) -> None:
        """Replace the snapshot by a rename (BACK-6): atomic against a process crash, and
        against a power cut with ``fsync`` only (data forced before the rename, the
        directory after). Raises ``_SnapshotWriteFailed``."""
        data = snapshot_buffer(records, log_seq, self._snapshot_lines, self._value_texts)
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
        """Fold the log into the snapshot, then empty the log back to its header. The
        snapshot carries ``log_seq``, so stopping between the two steps loses and repeats
        nothing."""
        assert self._log_fd is not None
        try:
            self._write_snapshot(self._records, self._seq)
            self._io.truncate(self._log_fd, len(LOG_HEADER), fsync=self._fsync)
        except (_SnapshotWriteFailed, OSError) as exc:
            # The write that got us here is committed in the log; compaction is retried
            # at the next write.
            logger.warning("%s: compaction failed, retrying at the next write: %s", self._path, exc)
            return
        self._log_entries = 0
        self._log_bytes = len(LOG_HEADER)

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
        files (trim a torn final line, fold the log, migrate a version-1 journal) and
        install the state."""
        try:
            snapshot = self._io.read_bytes(self._path)
        except OSError as exc:
            raise BackendUnavailableError(f"{self._path}: cannot read the snapshot: {exc}", file=self._path) from exc
        records: Records
        if snapshot is None:
            records, log_seq, snapshot_version = {}, 0, FORMAT_VERSION
        else:
            parsed = parse_snapshot(snapshot, self._path)
            records, log_seq, snapshot_version = parsed.records, parsed.log_seq, parsed.version
        try:
            log = self._io.read_bytes(self._log_path)
        except OSError as exc:
            raise BackendUnavailableError(f"{self._log_path}: cannot read the log: {exc}", file=self._log_path) from exc
        seq = log_seq
        scan = None
        if log is not None:
            scan = scan_log(log, self._log_path)
            seq = replay(records, log_seq, scan.entries, self._log_path)
            if scan.good < len(log):
                logger.warning(
                    "%s: cut a torn final line or write at byte %d (%d bytes of an unfinished write)",
                    self._log_path,
                    scan.good,
                    len(log) - scan.good,
                )
        # A journal of an earlier format is rewritten in the current one (documented in
        # file_format: "Version 1 ... a migration", "Log version 2 ... a migration").
        log_version = None if scan is None else scan.version
        migrate = snapshot_version != FORMAT_VERSION or log_version not in (None, LOG_VERSION)
        # Everything read back: from here on files change.
        try:
            if migrate:
                logger.warning(
                    "%s: journal in format version %s, rewriting it in the current one (snapshot version %d, log "
                    "version %d)", self._path, snapshot_version if snapshot_version != FORMAT_VERSION else log_version,
                    FORMAT_VERSION, LOG_VERSION,
                )
                self._write_snapshot(records, seq)
            if self._append_log:
                entries = [] if scan is None else scan.entries
                # keep: how much of the log file stays. Entries all in the snapshot already
                # (a crash between compaction's two steps, or just migrated): finish that
                # compaction, so the log holds only entries that follow the snapshot.
                if migrate or (entries and entries[-1].seq <= log_seq):
                    entries = []
                    keep = 0 if scan is None or scan.version != LOG_VERSION else scan.header_end
                else:
                    keep = 0 if scan is None else scan.good
                if log is not None and keep < len(log):
                    self._io.truncate_path(self._log_path, keep, fsync=self._fsync)
                self._log_fd = self._io.open_append(self._log_path, fsync=self._fsync)
                if keep == 0:
                    self._io.append(self._log_fd, LOG_HEADER, fsync=self._fsync)
                    keep = len(LOG_HEADER)
                self._log_entries = len(entries)
                self._log_bytes = keep
            elif log is not None:
                # A leftover of an append-log run: fold it in, then drop it (BACK-4).
                if scan is not None and scan.entries and not migrate:
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
                    logger.warning(
                        "%s: taking over the lock left by process %d, which is no longer running", self._lock_path, holder
                    )
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
