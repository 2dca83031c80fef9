"""The SQLite harness: ``SQLiteStore(file).durability()``.

With :meth:`SQLiteHarness.reuse_storage` (asked by the crash matrix) a harness whose file
does not exist yet starts from a copy of this process's *template*: a database that an
``SQLiteStore`` and its durability backend created (the schema, ``user_version``) and
closed, so nothing of it is left in a write-ahead log. The store and the backend then find
their schema there instead of creating it: the same database a first open makes, without
its DDL, and without a log that the next connection's integrity check must read
(``botmesh.sqlite_store._integrity.check_wal``) — together a fifth of a crash cell.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import Store

from .base import BackendHarness, KillSpec, SQLiteSpec


_TEMPLATE: list[str] = []
"""The path of this process's template database (see the module docstring)."""


async def _template() -> str | None:
    """The template database, made on first use (None when closing left a log beside it,
    so that it is not the plain file a copy needs)."""
    if _TEMPLATE and os.path.exists(_TEMPLATE[0]):
        return _TEMPLATE[0]
    from botmesh.sqlite_store import SQLiteStore

    folder = tempfile.mkdtemp(prefix="botmesh-sqlite-template-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "bot.db")
    store = SQLiteStore(file=path)
    await store.open()
    try:
        backend = store.durability()
        await backend.start()
        await backend.stop()
    finally:
        await store.close()
    if any(os.path.exists(path + suffix) for suffix in ("-wal", "-shm", "-journal")):
        return None
    _TEMPLATE[:] = [path]
    return path


class SQLiteHarness(BackendHarness):
    """``SQLiteStore(file).durability()``; the store is the same SQLite file."""

    name = "sqlite"

    def __init__(self, workdir: str | None = None) -> None:
        super().__init__(workdir)
        self.path = os.path.join(self.workdir, "bot.db")
        self.stores: list[Any] = []
        self._reuse = False

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(survives_crash=True, multi_process=True)

    def reuse_storage(self) -> bool:
        """A new database starts as a copy of the process's template (module docstring)."""
        self._reuse = True
        return True

    async def open(self) -> tuple[DurabilityBackend, Store]:
        from botmesh.sqlite_store import SQLiteStore

        if self._reuse and not os.path.exists(self.path):
            template = await _template()
            if template is not None:
                shutil.copyfile(template, self.path)
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
