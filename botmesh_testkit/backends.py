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


class FactoryHarness(BackendHarness):
    """A third party's backend, named ``pkg.module:factory`` on the command line.

    ``factory()`` — or ``factory(workdir)`` when it takes one argument — returns a
    ``DurabilityBackend`` or a ``DurableKv`` (wrapped in ``KvDurability``). It is called
    once per incarnation and must return a *new* instance on the *same* storage: that is
    how a restart after a simulated death is modelled. ``workdir`` is a fresh directory
    per test or crash cell: storage derived from it (a file in it, a database or key
    prefix named after it) keeps cells apart. An instance with an ``abandon()``
    method has it called at the simulated death. The bot's store is a MemoryStore kept
    across restarts.
    """

    def __init__(self, spec: str, factory: Callable[..., Any], workdir: str | None = None) -> None:
        super().__init__(workdir)
        self.name = spec
        self.factory = factory
        self.current: Any = None
        self._caps: Capabilities | None = None

    @property
    def capabilities(self) -> Capabilities:
        return self._caps or Capabilities()

    async def _make(self) -> DurabilityBackend:
        import inspect

        from botmesh.core.spi import DurableKv, KvDurability

        try:
            takes_dir = len(inspect.signature(self.factory).parameters) == 1
        except (TypeError, ValueError):
            takes_dir = False
        made = self.factory(self.workdir) if takes_dir else self.factory()
        if inspect.isawaitable(made):
            made = await made
        self.current = made
        if isinstance(made, DurableKv):
            backend: DurabilityBackend = KvDurability(made, name=self.name)
        elif isinstance(made, DurabilityBackend):
            backend = made
        else:
            raise TypeError(f"backend factory {self.name!r} returned {type(made).__name__}; "
                            "expected a DurabilityBackend or a DurableKv")
        self._caps = backend.capabilities
        return backend

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.store = MemoryStore()
        return await self._make(), self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        abandon = getattr(self.current, "abandon", None)
        if callable(abandon):
            abandon()
        return await self._make(), self.store


class BackendSpecError(ValueError):
    """A ``--botmesh-backend`` value that names nothing usable."""


def resolve(spec: str) -> Callable[[str | None], BackendHarness]:
    """A harness factory for a built-in name or a ``pkg.module:factory`` path."""
    if spec in HARNESSES:
        return HARNESSES[spec]
    if ":" not in spec:
        raise BackendSpecError(f"{spec!r} is not a built-in backend ({', '.join(HARNESSES)}) "
                               "nor a 'pkg.module:factory' path")
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendSpecError(f"{spec!r}: cannot import module {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BackendSpecError(f"{spec!r}: module {module_name!r} has no callable {attr!r}")
    return lambda workdir: FactoryHarness(spec, factory, workdir)
