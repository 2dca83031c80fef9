"""Backend harnesses: how the testkit opens a backend, "kills the process" holding it,
and opens it again as a restarted process would (TEST-3).

A harness gives a ``(backend, store)`` pair per incarnation. ``reopen()`` drops whatever
the previous incarnation held in memory (file handles, connections, in-process locks)
without a clean shutdown, then opens the same storage again; only what the backend
made durable survives. For the memory backend, the same objects are handed back (they
stand for storage that outlives the bot within this process).
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import Capabilities, MemoryDurability
from botmesh.core.store import MemoryStore, Store


class BackendHarness(ABC):
    """Opens one backend for a test and reopens it after a simulated death."""

    name: str = "backend"

    def __init__(self, workdir: str | None = None) -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="botmesh-")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities()

    @abstractmethod
    async def open(self) -> tuple[DurabilityBackend, Store]:
        """The first incarnation's backend and store."""

    @abstractmethod
    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        """Simulate the death of the process holding the backend and open it again."""

    async def close(self) -> None:
        """Release everything (end of test)."""


class MemoryHarness(BackendHarness):
    name = "memory"

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.backend = MemoryDurability()
        self.store = MemoryStore()
        return self.backend, self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        return self.backend, self.store


class FileHarness(BackendHarness):
    """``FileDurability`` (snapshot only, or with the append log); the bot's store is a
    MemoryStore kept across the restart (it stands for a persistent store)."""

    def __init__(self, workdir: str | None = None, *, append_log: bool = False, fsync: bool = True) -> None:
        super().__init__(workdir)
        self.append_log = append_log
        self.fsync = fsync
        self.name = "file+log" if append_log else "file"
        self.path = os.path.join(self.workdir, "journal.json")
        self.backend: Any = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(survives_crash=True)

    async def _open(self) -> Any:
        from botmesh.core.file_backend import FileDurability

        return await FileDurability.open(self.path, append_log=self.append_log, fsync=self.fsync)

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


class SQLiteHarness(BackendHarness):
    """``SQLiteStore(file).durability()``; the store is the same SQLite file."""

    name = "sqlite"

    def __init__(self, workdir: str | None = None) -> None:
        super().__init__(workdir)
        self.path = os.path.join(self.workdir, "bot.db")
        self.stores: list[Any] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(survives_crash=True, multi_process=True)

    async def open(self) -> tuple[DurabilityBackend, Store]:
        from botmesh.sqlite_store import SQLiteStore

        store = SQLiteStore(file=self.path)
        await store.open()
        self.stores.append(store)
        backend = store.durability()
        self.backends = [backend]
        return backend, store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        # A dead process's connections vanish; committed transactions stay in the file.
        await self.close()
        return await self.open()

    async def close(self) -> None:
        for backend in getattr(self, "backends", []):
            await backend.stop()
        for store in self.stores:
            await store.close()
        self.stores.clear()
        self.backends = []


HARNESSES: dict[str, Callable[[str | None], BackendHarness]] = {
    "memory": MemoryHarness,
    "file": lambda d: FileHarness(d),
    "file+log": lambda d: FileHarness(d, append_log=True),
    "sqlite": SQLiteHarness,
}
"""The built-in backends by name."""
