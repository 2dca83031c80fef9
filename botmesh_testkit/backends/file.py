"""The FileDurability harness (``file`` and ``file+log``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.fileio import FileIO
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import MemoryStore, Store

from .base import BackendHarness, FileSpec, KillSpec


class WorkdirJournalHarness(BackendHarness):
    """A durability backend on a journal file in the workdir, opened by :meth:`_open`
    (through ``self.io`` when set); the bot's store is a MemoryStore kept across the
    restart (it stands for a persistent store). A restart abandons the old backend
    (as a dead process would) and opens the journal again."""

    backend: Any = None
    io: FileIO | None = None

    async def _open(self) -> Any:
        raise NotImplementedError

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.backend = await self._open()
        self.store = MemoryStore()
        return self.backend, self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        self.backend.abandon()
        self.backend = await self._open()
        return self.backend, self.store

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()
            self.backend = None

    async def discard(self) -> None:
        """The journal is left as a dead process leaves it (``abandon``: no fold, no
        compaction), its handles and lock released (see :meth:`BackendHarness.discard`)."""
        if self.backend is not None:
            self.backend.abandon()
            self.backend = None


class FileHarness(WorkdirJournalHarness):
    """``FileDurability`` (snapshot only, or with the append log); the bot's store is a
    MemoryStore kept across the restart (it stands for a persistent store)."""

    def __init__(self, workdir: str | None = None, *, append_log: bool = False, fsync: bool = True) -> None:
        super().__init__(workdir)
        self.append_log = append_log
        self.fsync = fsync
        self.name = "file+log" if append_log else "file"
        self.path = os.path.join(self.workdir, "journal.json")
        self.backend: Any = None
        self.io: FileIO | None = None
        """The :class:`~botmesh.core.fileio.FileIO` the journal is opened with (None: the
        real file system, ``botmesh.core.fileio.default_io``)."""

    @property
    def capabilities(self) -> Capabilities:
        # The backend's own claim: without fsync it survives a SIGKILL, not a power cut.
        return Capabilities(survives_crash=self.fsync)

    async def _open(self) -> Any:
        from botmesh.core.file_backend import FileDurability

        return await FileDurability.open(self.path, append_log=self.append_log, fsync=self.fsync, io=self.io)

    def use_file_io(self, io: FileIO) -> bool:
        """``FileDurability`` does all its file I/O through ``io`` (see
        :meth:`BackendHarness.use_file_io`)."""
        self.io = io
        return True

    def kill_spec(self) -> KillSpec | None:
        return FileSpec(self.path, self.append_log, self.fsync)

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        from botmesh.core.file_backend import FileKv

        return lambda: FileKv(self.path + ".kv", append_log=self.append_log, fsync=self.fsync)
