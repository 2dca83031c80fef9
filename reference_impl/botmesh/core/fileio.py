"""Every operating-system call of the file durability backend, in one place.

:class:`botmesh.core.file_kv.FileKv` never calls ``open``/``os.*`` itself: it calls
the methods of a :class:`FileIO` object — :data:`default_io` unless the caller passes
``io=``. That makes this module the single seam where faults are injected (ARCHITECTURE
"File backends touch the OS in one module"): a test or ``botmesh_testkit`` subclasses
:class:`FileIO` and overrides one primitive to raise ``OSError(errno.ENOSPC, ...)`` on an
append, to write half a buffer and then fail (a torn write), to fail an ``fsync`` with
``EIO``, or to keep a record of unsynced data to drop at a simulated power cut. ::

    class FullDisk(FileIO):
        def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    kv = FileKv(path, append_log=True, io=FullDisk())

Contract of the methods:

* They raise ``OSError`` (or a subclass) and nothing else on an I/O failure; the backend
  translates that into :class:`~botmesh.core.errors.BackendUnavailableError`.
* They are synchronous. The backend calls them from its coroutines on purpose: the
  writes are short and local, and synchronous I/O keeps a run in virtual time
  deterministic (no thread pool deciding when a write lands).
* The composite helpers (:meth:`FileIO.write_atomic`) are built from the primitives via
  ``self``, so overriding a primitive also changes the composite. The backend replaces
  its snapshot with the primitives themselves (``write_file``, ``replace``,
  ``fsync_dir``) because it must know whether a failure came before or after the
  rename.

POSIX only: locks are pid files held with ``flock(2)``, and liveness is
``os.kill(pid, 0)``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys

__all__ = ["FileIO", "default_io", "place_problem"]


def place_problem(path: str, siblings: tuple[str, ...] = ()) -> str | None:
    """Why a store cannot keep its file at ``path`` — with ``siblings`` (suffixes of the
    files it creates beside it: ``".log"``, ``"-wal"`` ...) — or None: ``path`` or a
    sibling is a directory, its directory is missing, or this process may not create,
    rename and remove files in that directory or read and write an existing ``path``
    (``os.access``: also a read-only file system). Checked when a store is built, so that
    the error can name the option (issue 13); a place that becomes unusable later is
    an I/O error like any other."""
    for name in (path, *(path + suffix for suffix in siblings)):
        if os.path.isdir(name):
            return f"{name!r} is a directory, not a file"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"the directory of {path!r} does not exist ({parent!r})"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"files cannot be created in the directory {parent!r} (not writable by this process)"
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        return f"{path!r} is not readable and writable by this process"
    return None


class FileIO:
    """The real file system. Subclass and override a method to inject a fault."""

    # -- names --------------------------------------------------------------------------
    def resolve(self, path: str) -> str:
        """The absolute path of ``path`` with symbolic links resolved, so two spellings
        of one file are recognised as the same journal."""
        return os.path.realpath(path)

    def unusable(self, path: str, siblings: tuple[str, ...]) -> str | None:
        """Why a journal cannot live at ``path`` (:func:`place_problem`), or None."""
        return place_problem(path, siblings)

    # -- reading ------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes | None:
        """The whole content of ``path``, or ``None`` when it does not exist."""
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return os.path.exists(path)

    # -- whole-file writes --------------------------------------------------------------
    def write_file(self, path: str, data: bytes | bytearray, *, fsync: bool) -> None:
        """Create or truncate ``path`` and write ``data``; with ``fsync`` force it to disk
        before returning. The file backend hands its snapshot over as a ``bytearray``
        (built in place, not copied once more into ``bytes``); it is not changed later."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            self._write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` over ``dst`` (``os.replace``)."""
        os.replace(src, dst)

    def fsync_dir(self, directory: str) -> None:
        """Force the directory entry changes of ``directory`` (a rename, a new file) to
        disk; without it a renamed file may revert to the old one after a power cut."""
        fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, data: bytes, *, fsync: bool) -> None:
        """Replace ``path`` with ``data`` all at once: write ``<path>.tmp`` (the caller
        holds the journal's lock, so a fixed temporary name cannot collide and a leftover
        from a crash is simply overwritten), fsync it when ``fsync``, rename it over
        ``path``, then fsync the directory when ``fsync`` so the rename itself is durable.

        A failure before the rename leaves ``path`` as it was (the temporary file is
        removed on a best-effort basis); a failure of the final directory fsync leaves
        the new content in place, not yet known to be on disk.
        """
        tmp = path + ".tmp"
        try:
            self.write_file(tmp, data, fsync=fsync)
            self.replace(tmp, path)
        except OSError:
            try:
                self.remove(tmp)
            except OSError:
                pass  # the original error is the one worth reporting
            raise
        if fsync:
            self.fsync_dir(os.path.dirname(path) or ".")

    # -- append log -----------------------------------------------------------------------
    def open_append(self, path: str, *, fsync: bool) -> int:
        """Open (creating when missing) ``path`` for appending and return the descriptor.
        With ``fsync`` the directory is synced so a newly created file survives a power
        cut."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if fsync:
            try:
                self.fsync_dir(os.path.dirname(path) or ".")
            except OSError:
                os.close(fd)
                raise
        return fd

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        """Append all of ``data`` to the file open at ``fd`` (opened by
        :meth:`open_append`); with ``fsync`` force it to disk before returning. On a
        failure part of ``data`` may have been written: the caller truncates back."""
        self._write_all(fd, data)
        if fsync:
            os.fsync(fd)

    def truncate(self, fd: int, size: int, *, fsync: bool) -> None:
        """Cut the file open at ``fd`` to ``size`` bytes (appends then continue there)."""
        os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)

    def truncate_path(self, path: str, size: int, *, fsync: bool) -> None:
        """Cut the file at ``path`` to ``size`` bytes."""
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            self.truncate(fd, size, fsync=fsync)
        finally:
            os.close(fd)

    def close_fd(self, fd: int) -> None:
        """Close a descriptor returned by :meth:`open_append`."""
        os.close(fd)

    def remove(self, path: str) -> None:
        """Delete ``path``; a missing file is not an error."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # -- pid lock files -------------------------------------------------------------------
    # A lock is a file holding the owner's pid, and the owner also keeps an exclusive
    # flock(2) on it while open. The flock is what makes taking over a dead owner's lock
    # race-free (two processes cannot both hold it, and the kernel drops it when its
    # holder dies); the pid is what the backend checks and names in its errors.
    def lock_acquire(self, path: str) -> int | None:
        """Open (creating when missing) the lock file ``path`` and take an exclusive
        ``flock`` on it without waiting. Returns the descriptor that holds it, or
        ``None`` when another open file (another process) holds it. The descriptor keeps
        the lock until :meth:`lock_release` or :meth:`close_fd`."""
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            # The previous holder may have unlinked (or replaced) the file between our
            # open and our flock: then we hold a lock nobody else will ever look at.
            try:
                current = os.stat(path)
            except FileNotFoundError:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
            os.close(fd)
        raise OSError(errno.EAGAIN, "lock file keeps being replaced", path)

    def lock_write_pid(self, fd: int, pid: int, *, fsync: bool) -> None:
        """Make the lock file held at ``fd`` contain ``pid``. Written over the old content
        and then cut to its length, never truncated to zero first: on ext4 a file
        truncated to zero and rewritten is flushed to disk when it is closed
        (``auto_da_alloc``), which cost every open/close cycle ~5 ms even without fsync."""
        data = f"{pid}\n".encode()
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(data))
        if fsync:
            os.fsync(fd)

    def lock_release(self, fd: int, path: str) -> None:
        """Delete the lock file ``path`` (when it is still the file held at ``fd``) and
        close ``fd``, which drops the flock."""
        try:
            try:
                current = os.stat(path)
            except FileNotFoundError:
                return
            mine = os.fstat(fd)
            if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        finally:
            os.close(fd)

    def read_lock(self, path: str) -> str | None:
        """The text of the lock file ``path`` (normally a pid), or ``None`` when there is
        none."""
        data = self.read_bytes(path)
        return None if data is None else data.decode("utf-8", "replace")

    def write_lock(self, path: str, pid: int) -> None:
        """Overwrite the lock file ``path`` with ``pid``, holding no flock (the
        ``abandon()`` test hook leaves a lock behind like a dead process does)."""
        self.write_file(path, f"{pid}\n".encode(), fsync=False)

    # -- processes ------------------------------------------------------------------------
    def getpid(self) -> int:
        """This process's id."""
        return os.getpid()

    def pid_alive(self, pid: int) -> bool:
        """Whether a process with id ``pid`` exists (``os.kill(pid, 0)``). A process of
        another user counts as alive (``EPERM``)."""
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def dead_pid(self) -> int:
        """The id of a process that has exited (and been reaped): spawn ``/bin/true``,
        wait for it, return its pid. The kernel may reuse it one day, but not within the
        next few moments a test needs it."""
        program = ["/bin/true"] if os.path.exists("/bin/true") else [sys.executable, "-c", "pass"]
        child = subprocess.Popen(program, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        child.wait()
        return child.pid

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _write_all(fd: int, data: bytes | bytearray) -> None:
        # os.write may write less than asked (signals, pipes, quotas): loop until done.
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]


default_io = FileIO()
"""The :class:`FileIO` every backend uses unless given ``io=``."""
