"""The storage engine of both event journals: :class:`JournalFile`, the project's
:class:`~botmesh.core.file_kv.FileKv` (its snapshot and append log in the checksummed
format of :mod:`botmesh.core.file_format`, its loading, torn-line trimming,
damage detection, compaction and pid lock) used as a store of records, plus what the
journals add: a **batch** of changes committed by one write (one snapshot rewrite, or
one append of one log line, a commit), a count of those writes, and, for the shared journal,
reloading what other processes wrote.

Nothing here is public: :mod:`botmesh.events.journal` is the API.
"""

from __future__ import annotations

import os
from typing import Any

from botmesh.core.file_format import Entry, Records, encode_value
from botmesh.core.file_kv import FileKv, _Change
from botmesh.core.fileio import FileIO

__all__ = ["Change", "JournalFile"]

Change = tuple[str, str, str, "Entry | None", int]
"""``(scope, space, key, entry, version)``: ``entry`` None deletes the record, whose
version was ``version``; otherwise ``version`` is ``entry``'s."""


class JournalFile(FileKv):
    """A :class:`FileKv` written in batches. ``lock`` keeps FileKv's pid lock file and
    in-process registration (``FileEventJournal(lock=True)``, EVENTS-3); without it (and
    always for ``shared``) neither is taken — the shared journal serialises its writers
    with its own mutex and reloads before each batch (:meth:`reload`)."""

    def __init__(self, path: str | os.PathLike[str], *, lock: bool, shared: bool, append_log: bool,
                 compact_every: int | None, compact_bytes: int | None, fsync: bool | None,
                 io: FileIO | None) -> None:
        # FileKv turns the log on when given a compaction option: pass them only with it.
        super().__init__(path, append_log=append_log, compact_every=compact_every if append_log else None,
                         compact_bytes=compact_bytes if append_log else None, fsync=fsync, io=io)
        self._locking = lock and not shared
        self._shared = shared
        self.writes = 0
        """Batches written since open: snapshot rewrites plus log appends (benchmarks)."""

    @property
    def records(self) -> Records:
        """The committed records (do not mutate: build changes and :meth:`commit`)."""
        return self._records

    @property
    def io(self) -> FileIO:
        return self._io

    # -- locking: only with lock=True --------------------------------------------------
    def _register(self) -> None:
        if self._locking:
            super()._register()

    def _unregister(self) -> None:
        if self._locking:
            super()._unregister()

    def _take_lock_file(self) -> None:
        if self._locking:
            super()._take_lock_file()

    def _release_lock_file(self) -> None:
        if self._locking:
            super()._release_lock_file()

    # -- batches -----------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise ``BackendUnavailableError`` when closed or broken."""
        self._check()

    def commit(self, changes: list[Change]) -> None:
        """Write ``changes`` with one write (a snapshot rewrite, or one append of one log
        line: a commit), then apply them in memory — FileKv's own commit of a group
        (``FileKv._commit``). On ``BackendUnavailableError`` memory is unchanged (and the
        file too when it could be put back)."""
        if not changes:
            return
        self._check()  # before encoding: a closed or broken journal says so first
        self._commit([_Change(scope, space, key, entry, version,
                              None if entry is None else encode_value(entry[0], f"{scope}/{space}/{key}"))
                      for scope, space, key, entry, version in changes])
        self.writes += 1

    # -- the shared journal --------------------------------------------------------------
    def reload(self) -> None:
        """Read the files again (another process wrote them); the caller holds the
        mutex. Raises ``JournalCorruptError`` / ``BackendUnavailableError`` like open."""
        self._check()
        if self._log_fd is not None:
            self._close_quietly(self._log_fd)
            self._log_fd = None
        self._load()

    async def close(self) -> None:
        """As :meth:`FileKv.close`; the shared journal does not fold the log (other
        processes may be using it; it is compacted by size and replayed at every open)."""
        if self._shared and self._is_open:
            self._is_open = False
            if self._log_fd is not None:
                self._close_quietly(self._log_fd)
                self._log_fd = None
            return
        await super().close()

    def abandon(self) -> None:
        """TEST ONLY: as :meth:`FileKv.abandon` (behave as if this process died)."""
        if self._shared or not self._locking:
            if self._is_open:
                self._is_open = False
                if self._log_fd is not None:
                    self._close_quietly(self._log_fd)
                    self._log_fd = None
            return
        super().abandon()

    def describe(self) -> dict[str, Any]:
        return {"path": self._path, "append_log": self._append_log, "fsync": self._fsync}
