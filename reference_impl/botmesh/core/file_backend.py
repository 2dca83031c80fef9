"""The file durability backend: :class:`FileDurability` over :class:`FileKv` (BACK table,
BACK-4, BACK-5, BACK-6).

The files (a snapshot, an append log, a lock file) and their format are described in
:mod:`botmesh.core.file_format`; :class:`FileKv` is in :mod:`botmesh.core.file_kv`.

Writes (BACK-4, BACK-6):

* Without the append log every write rewrites the whole snapshot.
* With it each write appends one line (fsync'ed when ``fsync``) and the snapshot is
  rewritten — then the log truncated — every ``compact_every`` entries (1000) or when
  the log reaches ``compact_bytes`` (4 MiB). A crash between the rewrite and the
  truncation is harmless: replay skips entries whose ``seq <= log_seq``.
* ``fsync`` defaults to ``True`` in both modes (the spec only fixes the append log's
  default; we chose the safe one for the snapshot too): each snapshot is forced to disk
  before it replaces the previous one, and the directory after the rename, so the
  replacement is atomic across a power cut too. With ``fsync=False`` nothing is forced
  to disk: a crash of the *process* (SIGKILL included) still loses nothing, because the
  operating system's cache outlives it, but a **power cut** may lose every write since
  the OS last flushed — and, in snapshot mode, may keep the rename while losing the data
  renamed, leaving an empty or partial snapshot that no longer opens
  (``SNAPSHOT_CORRUPT``): the rename is atomic only against a process crash. So a
  journal opened with ``fsync=False`` does not claim ``survives_crash``.
* **Group commit**: writes made at the same moment by different tasks (different
  chats) share one append and one fsync — or one snapshot rewrite without the append
  log (:mod:`botmesh.core.group_commit`). Each is acknowledged only once that one fsync
  returned; a failed append or fsync fails every write of the group. Writes of one key
  never share a group: a compare-and-set waits for the key's write in flight to settle
  and is checked against durable state. A group is one line of the log (a *commit*,
  log version 3), appended by one write: the pages of an unsynced write may reach the
  disk in any order, and whatever a power cut leaves of them damages only the log's
  final line, which is trimmed at open as a torn write (BACK-5) — all of that group or
  none of it.
* A write reaches the file before it reaches memory: a write that raised
  ``BackendUnavailableError`` left memory unchanged and, when the file could be put back
  (a failed append is truncated away), the file too. When the file cannot be put back
  into a known state the journal refuses every later call until it is reopened.
* Compaction is housekeeping: when it fails the write that triggered it has already
  been committed to the log, so it is logged as a warning and retried at the next write.

Open (BACK-4, BACK-5): the snapshot is read, then a leftover log is replayed — always,
also without ``append_log`` (it is then folded into the snapshot and removed). Every line
of both files carries its length and a CRC-32, the snapshot its record count and a
checksum of the whole file (the format — snapshot version 2, log version 3 — and its reading rules are in
:mod:`botmesh.core.file_format`). Damage is reported as
:class:`~botmesh.core.errors.JournalCorruptError` naming the file, the line and the byte,
before anything is applied or any file is touched; nothing else escapes ``open()`` for
what a file contains:

* a snapshot that does not read back (cut, a bit flipped, a record missing or added, a
  wrong shape): ``code "SNAPSHOT_CORRUPT"``;
* only the log's **incomplete final line** — bytes after the last newline that never got
  their terminator — is a torn write: it is cut off (the file truncated to the end of the
  last complete line) and the rest replayed: that write never returned;
* a **complete** log line with a wrong length or checksum, that is not a valid entry, or
  that does not apply (a version or sequence gap, a ``log_seq`` claiming entries the
  snapshot does not hold) — in the middle or last: ``code "APPEND_LOG_CORRUPT"`` with
  ``file``, ``line`` (1-based) and ``byte`` (offset of the start of that line), the log
  left as it is;
* a file in a format version this release does not read: ``code
  "JOURNAL_VERSION_UNSUPPORTED"`` naming the version. A journal in version 1 (earlier
  releases: no checksums), or a log in version 2 (one line per entry), is read and
  rewritten in the current version by the open.

Locking (BACK table): ``<path>.lock`` rejects a second live process; a second ``open()``
of the same (resolved) path in this process is rejected until ``close()``. A lock whose
pid is dead is taken over.

All OS calls go through :mod:`botmesh.core.fileio` (``io=`` to inject faults). The I/O is
synchronous inside the coroutines on purpose: writes are short and local, and keeping
them synchronous keeps virtual-time test runs deterministic.
"""

from __future__ import annotations

import os

from .file_format import SNAPSHOT_FORMAT
from .file_kv import FileKv
from .fileio import FileIO
from .kv_durability import KvDurability

__all__ = ["SNAPSHOT_FORMAT", "FileDurability", "FileKv"]


class FileDurability(KvDurability):
    """The file durability backend (BACK table): journals in one file, surviving a crash,
    for one process. Open it with :meth:`open`; it stays open across bots until
    :meth:`close` (``start()``/``stop()`` of a bot do not close it).

    Its capabilities are its kv's: ``survives_crash`` with ``fsync`` (the default); with
    ``fsync=False`` none — such a journal survives a SIGKILL of the process but not a
    power cut (see "Writes" in the module docstring)."""

    def __init__(self, kv: FileKv, *, own_kv: bool = False, name: str | None = "file") -> None:
        super().__init__(kv, own_kv=own_kv, name=name)
        self._file_kv = kv
        self._put_owned = kv.owned_writes()  # records written as their private copies (see MemoryDurability)

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
        ``<path>.log``; ``fsync`` (default True) forces each write to disk (BACK-6;
        without it the journal survives a SIGKILL but not a power cut, and claims no
        ``survives_crash``); ``io`` replaces the OS layer (fault injection). Bad options raise
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
