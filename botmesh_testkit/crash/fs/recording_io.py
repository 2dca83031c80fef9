"""The in-process power-cut variant: :class:`PowerCutIO`, a
:class:`botmesh.core.fileio.FileIO` that does every operation on the real directory and
records it in a :class:`~.model.PersistenceModel`, so that at a simulated power cut the
crash states of the unsynced window can be enumerated (every prefix, torn writes, seeded
subsets: :meth:`PowerCutIO.crash_states`) and each one reopened (:func:`~.image.
materialize` it into a fresh directory and open the backend there). Fast and without
FUSE, for backends that do all their file I/O through ``botmesh.core.fileio``
(``FileKv`` / ``FileDurability``)::

    io = PowerCutIO(workdir)
    kv = FileKv(os.path.join(workdir, "journal.json"), append_log=True, io=io)
    ...writes; then, as if the power went now:
    for i, state in enumerate(io.crash_states(subsets=8, torn=True)):
        reopened = FileKv(materialize(state, tmp / str(i)) / "journal.json")

Only paths under ``root`` are recorded (the tree there when the object is made counts as
durable). ``fsync`` calls are *not* passed to the disk — durability is the model's — so a
run costs no disk flush. An operation is recorded once the OS call succeeded; a subclass
that injects a fault by raising before calling ``super()`` records nothing, as it should.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

from botmesh.core.fileio import FileIO

from .image import load_tree
from .model import PersistenceModel
from .state import CrashState, Seed

__all__ = ["PowerCutIO"]

_DEAD_PID: list[int] = []
"""The exited process :meth:`PowerCutIO.dead_pid` last spawned (one per OS process)."""


class PowerCutIO(FileIO):
    """The real file system under ``root``, recorded in :attr:`model` (module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, model: PersistenceModel | None = None) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.model: PersistenceModel = model if model is not None else load_tree(self.root)
        """What is durable and what is not, of the tree under :attr:`root`."""
        self._fds: dict[int, int] = {}  # descriptor -> model inode (append logs, locks)
        self._rels: dict[str, str | None] = {}  # path as given -> _rel's answer (see _rel)

    def dead_pid(self) -> int:
        """The id of a process that has exited, as :meth:`FileIO.dead_pid
        <botmesh.core.fileio.FileIO.dead_pid>` gives — but one spawned process serves
        every call of this OS process while no live process has its id (checked with
        :meth:`pid_alive` each time; else a new one is spawned): a simulated death
        (``FileKv.abandon``) asks for one per restart, and a spawn costs milliseconds, more
        than the rest of a crash-matrix cell's restart. What the caller sees is the same:
        a pid no process holds."""
        if _DEAD_PID and not self.pid_alive(_DEAD_PID[0]):
            return _DEAD_PID[0]
        pid = super().dead_pid()
        _DEAD_PID[:] = [pid]
        return pid

    # -- crash states ----------------------------------------------------------------------------
    def crash(self, mode: str = "drop", seed: Seed = 0, *, sector: int | None = None) -> CrashState:
        """The state a power cut now would leave (:meth:`PersistenceModel.crash`)."""
        return self.model.crash(mode, seed, sector=sector)

    def crash_states(self, *, subsets: int = 0, seed: Seed = 0, torn: bool = False) -> Iterator[CrashState]:
        """Every crash state of the unsynced window (:meth:`PersistenceModel.crash_states`)."""
        return self.model.crash_states(subsets=subsets, seed=seed, torn=torn)

    # -- helpers -----------------------------------------------------------------------------------
    def _rel(self, path: str) -> str | None:
        """``path`` relative to the root, or ``None`` when it is outside (not recorded).

        Resolved with ``os.path.realpath`` once per spelling of a path and kept (issue 16:
        a crash cell of a file journal resolved the same few paths about 13 times, 3 % of
        a ``file+log`` cell's instructions and 9 % of a ``file`` cell's). Only symbolic
        links make a path string resolve to another place, so a kept answer is dropped
        when this object renames or removes a symbolic link at that path
        (:meth:`replace`, :meth:`remove`); renaming or removing a regular file keeps
        them. A symbolic link made or changed under the root by other means while this
        object is in use is not seen — nothing that records through it does that."""
        try:
            return self._rels[path]
        except KeyError:
            pass
        real = os.path.realpath(path)
        if real == self.root:
            rel: str | None = ""
        elif real.startswith(self.root + os.sep):
            rel = real[len(self.root) + 1:]
        else:
            rel = None
        self._rels[path] = rel
        return rel

    def _ino_for(self, rel: str) -> int:
        """The inode of ``rel``, created in the model when the OS just created the file."""
        ino = self.model.lookup(rel)
        return self.model.create(rel) if ino is None else ino

    def _track(self, fd: int, path: str) -> None:
        rel = self._rel(path)
        if rel is not None:
            self._fds[fd] = self.model.open_handle(self._ino_for(rel))

    def _forget(self, fd: int) -> None:
        ino = self._fds.pop(fd, None)
        if ino is not None:
            self.model.close_handle(ino)

    # -- whole-file writes ---------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | bytearray, *, fsync: bool) -> None:
        """See :meth:`FileIO.write_file`; the fsync is the model's."""
        super().write_file(path, data, fsync=False)
        rel = self._rel(path)
        if rel is not None:
            ino = self._ino_for(rel)
            self.model.truncate(ino, 0)
            self.model.write(ino, 0, data)
            if fsync:
                self.model.fsync(ino)

    def replace(self, src: str, dst: str) -> None:
        """See :meth:`FileIO.replace`. The kept resolutions of ``src`` and ``dst`` stay
        unless one of them is a symbolic link (a rename of regular files changes what no
        path string resolves to; one ``lstat`` each instead of resolving both again at
        the next write: issue 16, a ``file`` cell renames at every write)."""
        links = os.path.islink(src) or os.path.islink(dst)
        super().replace(src, dst)
        if links:
            self._rels.pop(src, None)
            self._rels.pop(dst, None)
        rs, rd = self._rel(src), self._rel(dst)
        if rs is not None and rd is not None:
            self.model.rename(rs, rd)

    def fsync_dir(self, directory: str) -> None:
        """See :meth:`FileIO.fsync_dir`: made durable in the model, not on the disk."""
        if not os.path.isdir(directory):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", directory)
        rel = self._rel(directory)
        if rel is not None:
            self.model.fsync(rel)

    # -- append log --------------------------------------------------------------------------------------
    def open_append(self, path: str, *, fsync: bool) -> int:
        """See :meth:`FileIO.open_append` (the create is recorded before the directory
        fsync that makes it durable)."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._track(fd, path)
        if fsync:
            try:
                self.fsync_dir(os.path.dirname(path) or ".")
            except OSError:
                self.close_fd(fd)
                raise
        return fd

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        """See :meth:`FileIO.append`."""
        offset = os.fstat(fd).st_size
        self._write_all(fd, data)
        ino = self._fds.get(fd)
        if ino is not None:
            self.model.write(ino, offset, data)
            if fsync:
                self.model.fsync(ino)

    def truncate(self, fd: int, size: int, *, fsync: bool) -> None:
        """See :meth:`FileIO.truncate`."""
        os.ftruncate(fd, size)
        ino = self._fds.get(fd)
        if ino is not None:
            self.model.truncate(ino, size)
            if fsync:
                self.model.fsync(ino)

    def truncate_path(self, path: str, size: int, *, fsync: bool) -> None:
        """See :meth:`FileIO.truncate_path`."""
        os.truncate(path, size)
        rel = self._rel(path)
        ino = None if rel is None else self.model.lookup(rel)
        if ino is not None:
            self.model.truncate(ino, size)
            if fsync:
                self.model.fsync(ino)

    def close_fd(self, fd: int) -> None:
        """See :meth:`FileIO.close_fd`."""
        self._forget(fd)
        os.close(fd)

    def remove(self, path: str) -> None:
        """See :meth:`FileIO.remove`."""
        rel = self._rel(path)
        existed = os.path.lexists(path)
        link = existed and os.path.islink(path)
        super().remove(path)
        if link:
            self._rels.pop(path, None)
        if rel is not None and existed and self.model.lookup(rel) is not None:
            self.model.unlink(rel)

    # -- pid lock files ----------------------------------------------------------------------------------
    def lock_acquire(self, path: str) -> int | None:
        """See :meth:`FileIO.lock_acquire`."""
        fd = super().lock_acquire(path)
        if fd is not None:
            self._track(fd, path)
        return fd

    def lock_write_pid(self, fd: int, pid: int, *, fsync: bool) -> None:
        """See :meth:`FileIO.lock_write_pid`."""
        data = f"{pid}\n".encode()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        self._write_all(fd, data)
        ino = self._fds.get(fd)
        if ino is not None:
            self.model.truncate(ino, 0)
            self.model.write(ino, 0, data)
            if fsync:
                self.model.fsync(ino)

    def lock_release(self, fd: int, path: str) -> None:
        """See :meth:`FileIO.lock_release`."""
        try:
            try:
                current = os.stat(path)
            except FileNotFoundError:
                return
            mine = os.fstat(fd)
            if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                self.remove(path)
        finally:
            self.close_fd(fd)
