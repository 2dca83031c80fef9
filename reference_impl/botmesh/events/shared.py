"""``SharedFileEventJournal``: the event journal several processes of one host share
(EVENTS-4, EVENTS-5). How it locks (an exclusive ``flock`` on ``<path>.mutex``, a
generation number in that file telling the others to reload, a shared ``flock`` on
``<path>.lock`` against a ``FileEventJournal(lock=True)``) is in the docstring of
:mod:`botmesh.events.journal`, with everything both journals share."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import fcntl
import math
import os
import time

from botmesh.core.errors import BackendUnavailableError, ConfigError, JournalLockedError
from botmesh.core.fileio import FileIO

from ._file import JournalFile
from .journal import _check_options, _Journal

__all__ = ["SharedFileEventJournal"]


class SharedFileEventJournal(_Journal):
    """An event journal in one file shared by several processes of one host (module
    docstring; not on NFS or any network file system: ``flock`` and rename atomicity
    are only guaranteed locally). Open it with :meth:`open`."""

    multi_process = True

    def __init__(self, file: JournalFile, *, stale_lock_ms: float, heartbeat_ms: float) -> None:
        super().__init__(file)
        self.stale_lock_ms = stale_lock_ms
        self.heartbeat_ms = heartbeat_ms
        self.mutex_path = file.path + ".mutex"
        self._mutex_fd: int | None = None
        self._shared_lock_fd: int | None = None
        self._generation: int | None = None  # the mutex's generation our memory reflects
        self._held_generation = 0

    @classmethod
    async def open(cls, path: str | os.PathLike[str], *, stale_lock_ms: float = 30_000,
                   heartbeat_ms: float | None = None, append_log: bool = False, fsync: bool = True,
                   compact_every: int = 1000, compact_bytes: int = 4 * 1024 * 1024,
                   io: FileIO | None = None) -> SharedFileEventJournal:
        """Open the shared journal at ``path`` (creating it). ``stale_lock_ms``: how long
        an operation waits for a live holder of the mutex before failing
        (``BackendUnavailableError``; a dead holder's mutex is free at once).
        ``heartbeat_ms`` (default ``stale_lock_ms / 3``): accepted and checked, unused
        (the kernel lock needs no heartbeat; module docstring). The other options as
        :meth:`FileEventJournal.open`. Raises ``JournalLockedError`` when a live
        ``FileEventJournal(lock=True)`` holds the file."""
        for option, given in (("stale_lock_ms", stale_lock_ms), ("heartbeat_ms", heartbeat_ms)):
            if given is None and option == "heartbeat_ms":
                continue
            if isinstance(given, bool) or not isinstance(given, (int, float)) or not math.isfinite(given) or given <= 0:
                raise ConfigError(f"{option} must be a positive number of milliseconds, got {given!r}", option=option)
        beat = stale_lock_ms / 3 if heartbeat_ms is None else heartbeat_ms
        if beat >= stale_lock_ms:
            raise ConfigError(f"heartbeat_ms ({beat!r}) must be below stale_lock_ms ({stale_lock_ms!r})",
                              option="heartbeat_ms")
        _check_options(append_log, compact_every, compact_bytes, fsync)
        file = JournalFile(path, lock=False, shared=True, append_log=append_log, compact_every=compact_every,
                           compact_bytes=compact_bytes, fsync=fsync, io=io)
        journal = cls(file, stale_lock_ms=float(stale_lock_ms), heartbeat_ms=float(beat))
        journal._open_locks()
        try:
            await journal._acquire()
            try:
                journal._refuse_exclusive_owner()
                before = journal._signature()
                await file.open()
                if journal._signature() != before:
                    journal._held_generation += 1
                    journal._write_mutex(journal._held_generation)
                journal._generation = journal._held_generation
            finally:
                journal._release()
        except OSError as exc:
            journal._close_extra()
            raise BackendUnavailableError(f"{journal.path}: cannot open: {exc}", file=journal.path) from exc
        except BaseException:
            journal._close_extra()
            raise
        return journal

    # -- the mutex --------------------------------------------------------------------
    def _open_locks(self) -> None:
        lock_path = self.path + ".lock"
        try:
            self._mutex_fd = os.open(self.mutex_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._close_extra()
            raise BackendUnavailableError(f"{self.path}: cannot open its lock files: {exc}", file=self.path) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._close_extra()
            raise self._locked_error() from None
        self._shared_lock_fd = fd

    def _locked_error(self) -> JournalLockedError:
        lock_path = self.path + ".lock"
        try:
            with open(lock_path, encoding="utf-8", errors="replace") as f:
                text = f.read().strip()
        except OSError:
            text = ""
        pid = int(text) if text.isdigit() else None
        return JournalLockedError(
            f"{self.path} is held by a FileEventJournal opened with lock=True"
            + (f" in live process {pid}" if pid is not None else "")
            + f" (lock file {lock_path}): a SharedFileEventJournal does not write beside it",
            file=lock_path, pid=pid)

    def _refuse_exclusive_owner(self) -> None:
        """Raise ``JournalLockedError`` when a live process holds ``<path>.lock``
        exclusively (EVENTS-4)."""
        try:
            fd = os.open(self.path + ".lock", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BackendUnavailableError(f"{self.path}.lock: cannot read: {exc}", file=self.path + ".lock") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._locked_error() from None
        finally:
            os.close(fd)  # drops the probe's lock; our long-lived one stays

    def _read_mutex(self) -> tuple[int | None, int | None]:
        assert self._mutex_fd is not None
        raw = os.pread(self._mutex_fd, 64, 0).decode("ascii", "replace").split()
        gen = int(raw[0]) if len(raw) >= 1 and raw[0].isdigit() else None
        pid = int(raw[1]) if len(raw) >= 2 and raw[1].isdigit() else None
        return gen, pid

    def _write_mutex(self, generation: int) -> None:
        assert self._mutex_fd is not None
        data = f"{generation} {os.getpid()}\n".encode("ascii")
        os.pwrite(self._mutex_fd, data, 0)
        os.ftruncate(self._mutex_fd, len(data))

    async def _acquire(self) -> None:
        if self._mutex_fd is None:
            raise BackendUnavailableError(f"{self.path}: the event journal is closed", file=self.path)
        waited_since: float | None = None
        delay = 0.001
        while True:
            try:
                fcntl.flock(self._mutex_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    raise BackendUnavailableError(f"{self.mutex_path}: cannot lock: {exc}", file=self.mutex_path) from exc
                continue
            now = time.monotonic()
            if waited_since is None:
                waited_since = now
            elif (now - waited_since) * 1000 >= self.stale_lock_ms:
                _, pid = self._read_mutex()
                raise BackendUnavailableError(
                    f"{self.mutex_path}: held by live process {pid if pid is not None else '(unknown pid)'} for more than "
                    f"stale_lock_ms={self.stale_lock_ms:g} ms; a live holder is never broken (a dead one's lock is "
                    "released by the kernel at once)", file=self.mutex_path, pid=pid)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        try:
            gen, _ = self._read_mutex()
            self._held_generation = gen if gen is not None else 0
            if gen is None:
                self._generation = None  # unreadable: reload to be sure
            self._write_mutex(self._held_generation)  # names the holder
        except OSError as exc:
            self._release()
            raise BackendUnavailableError(f"{self.mutex_path}: cannot read or write: {exc}", file=self.mutex_path) from exc

    def _release(self) -> None:
        if self._mutex_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._mutex_fd, fcntl.LOCK_UN)

    def _before_batch(self) -> None:
        self._refuse_exclusive_owner()
        if self._generation is None or self._generation != self._held_generation:
            self._generation = None
            before = self._signature()
            self._file.reload()
            if self._signature() != before:
                # The load itself changed the files (a torn line trimmed, a leftover log
                # folded, an interrupted compaction finished): the others must reload.
                self._held_generation += 1
                self._write_mutex(self._held_generation)
            self._generation = self._held_generation

    def _signature(self) -> tuple[tuple[int, int] | None, ...]:
        out: builtins.list[tuple[int, int] | None] = []
        for name in (self.path, self.path + ".log"):
            try:
                st = os.stat(name)
            except FileNotFoundError:
                out.append(None)
            else:
                out.append((st.st_ino, st.st_size))
        return tuple(out)

    def _before_write(self) -> None:
        # Announce the change before making it: a writer that dies half-way still makes
        # the others reload.
        self._held_generation += 1
        self._generation = None  # until the write is known to have landed
        self._write_mutex(self._held_generation)

    def _after_write(self) -> None:
        self._generation = self._held_generation

    def _close_extra(self) -> None:
        for name in ("_mutex_fd", "_shared_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                with contextlib.suppress(OSError):
                    os.close(fd)
