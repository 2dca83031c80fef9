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
from botmesh.core.spi import Capabilities, DurableKv, MemoryDurability, MemoryKv
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

    def server_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the server holding the storage, for backends on a server
        (the fault suite puts a :class:`~botmesh_testkit.faultproxy.FaultProxy` in
        front of it); None for local storage."""
        return None

    def via(self, host: str, port: int) -> BackendHarness:
        """A harness on the *same* storage whose backend reaches the server at
        ``host:port`` (a proxy) instead. Only for harnesses with a server address."""
        raise NotImplementedError(f"{type(self).__name__} has no server to reach another way")

    def kill_spec(self) -> tuple[Any, ...] | None:
        """The same storage described for a child process of
        :mod:`botmesh_testkit.kill` (``("sqlite", path)`` ...), or None when a child
        cannot reach it (in-memory storage)."""
        return None

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        """When the backend is a :class:`~botmesh.core.spi.KvDurability` over a
        ``DurableKv``: a zero-argument callable giving a new, unopened kv on this
        harness's storage (what the ``DurableKv`` conformance suite needs); else None."""
        return None


class MemoryHarness(BackendHarness):
    name = "memory"

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.backend = MemoryDurability()
        self.store = MemoryStore()
        return self.backend, self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        return self.backend, self.store

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        return MemoryKv


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

    def kill_spec(self) -> tuple[Any, ...] | None:
        return ("file", self.path, self.append_log, self.fsync)

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        from botmesh.core.file_backend import FileKv

        return lambda: FileKv(self.path + ".kv", append_log=self.append_log, fsync=self.fsync)


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

    def kill_spec(self) -> tuple[Any, ...] | None:
        return ("sqlite", self.path)

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        from botmesh.sqlite_store import SQLiteKv

        return lambda: SQLiteKv(self.path)


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

    def kill_spec(self) -> tuple[Any, ...] | None:
        target: Any = self.name if ":" in self.name else self.factory  # a registered name: the callable
        return ("factory", target, self.workdir) if self._takes_dir() else ("factory", target)

    def _takes_dir(self) -> bool:
        import inspect

        try:
            return len(inspect.signature(self.factory).parameters) == 1
        except (TypeError, ValueError):
            return False

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        import inspect

        from botmesh.core.spi import DurableKv

        try:
            takes_dir = len(inspect.signature(self.factory).parameters) == 1
        except (TypeError, ValueError):
            takes_dir = False
        if inspect.iscoroutinefunction(self.factory):
            return None
        made = self.factory(self.workdir) if takes_dir else self.factory()
        if not isinstance(made, DurableKv):
            return None
        return lambda: self.factory(self.workdir) if takes_dir else self.factory()


class BackendSpecError(ValueError):
    """A ``--botmesh-backend`` value that names nothing usable."""


ENTRY_POINT_GROUP = "botmesh_testkit.backends"
"""Installed distributions register backends by name in this entry-point group."""

HarnessFactory = Callable[[str | None], BackendHarness]


class BackendRegistry:
    """Backends added by name at run time (``pytest_botmesh_register_backends``), beside
    the built-in ones and the entry-point group."""

    def __init__(self) -> None:
        self._factories: dict[str, HarnessFactory] = {}

    def add(self, name: str, harness_factory: HarnessFactory) -> None:
        """``harness_factory(workdir)`` returns a :class:`BackendHarness`."""
        if not name or ":" in name or name in HARNESSES:
            raise BackendSpecError(f"cannot register backend name {name!r}: it must be non-empty, "
                                   f"without ':', and not a built-in ({', '.join(HARNESSES)})")
        if not callable(harness_factory):
            raise BackendSpecError(f"backend {name!r}: harness factory {harness_factory!r} is not callable")
        self._factories[name] = harness_factory

    def add_factory(self, name: str, factory: Callable[..., Any]) -> None:
        """A backend factory as for ``pkg.module:factory`` (see :class:`FactoryHarness`)."""
        self.add(name, _factory_harness(name, factory))

    def get(self, name: str) -> HarnessFactory | None:
        return self._factories.get(name)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def clear(self) -> None:
        self._factories.clear()


REGISTRY = BackendRegistry()
"""The process-wide registry that :func:`resolve` consults."""


def _factory_harness(name: str, obj: Any) -> HarnessFactory:
    if isinstance(obj, type) and issubclass(obj, BackendHarness):
        return lambda workdir: obj(workdir)
    return lambda workdir: FactoryHarness(name, obj, workdir)


def entry_point_backends() -> dict[str, Any]:
    """Entry points of the group ``botmesh_testkit.backends``, by name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_names() -> list[str]:
    """Every backend name :func:`resolve` accepts without a dotted path."""
    return [*HARNESSES, *SERVICE_BACKENDS, *REGISTRY.names(), *sorted(entry_point_backends())]


SERVICE_BACKENDS: dict[str, str] = {
    "postgres": "botmesh_testkit.harness_postgres:provisioned",
    "redis": "botmesh_testkit.harness_redis:provisioned",
}
"""Built-in backends on a server the plugin provisions (``botmesh_testkit.services``)."""


def resolve(spec: str) -> HarnessFactory:
    """A harness factory for a built-in name, a registered name (hook or entry point),
    or a ``pkg.module:factory`` path."""
    import importlib

    if spec in HARNESSES:
        return HARNESSES[spec]
    if spec in SERVICE_BACKENDS:
        module_name, _, attr = SERVICE_BACKENDS[spec].partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
        except ImportError as exc:
            raise BackendSpecError(f"{spec!r} needs its driver: pip install 'botmesh-testkit[{spec}]' ({exc})") from None
    registered = REGISTRY.get(spec)
    if registered is not None:
        return registered
    if ":" not in spec:
        eps = entry_point_backends()
        if spec in eps:
            try:
                obj = eps[spec].load()
            except Exception as exc:  # an installed plugin that does not import
                raise BackendSpecError(f"{spec!r}: entry point {eps[spec].value!r} of group "
                                       f"{ENTRY_POINT_GROUP!r} failed to load: {exc!r}") from None
            return _factory_harness(spec, obj)
        raise BackendSpecError(f"{spec!r} is not a known backend ({', '.join(known_names())}) "
                               "nor a 'pkg.module:factory' path")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendSpecError(f"{spec!r}: cannot import module {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BackendSpecError(f"{spec!r}: module {module_name!r} has no callable {attr!r}")
    return _factory_harness(spec, factory)
