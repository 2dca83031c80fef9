"""The SQLite harness: ``SQLiteStore(file).durability()``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import Store

from .base import BackendHarness, KillSpec, SQLiteSpec


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

    def kill_spec(self) -> KillSpec | None:
        return SQLiteSpec(self.path)

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        from botmesh.sqlite_store import SQLiteKv

        return lambda: SQLiteKv(self.path)
