"""The harness protocol: how the testkit opens a backend, "kills the process" holding it,
and opens it again as a restarted process would (TEST-3).

A harness gives a ``(backend, store)`` pair per incarnation. ``reopen()`` drops whatever
the previous incarnation held in memory (file handles, connections, in-process locks)
without a clean shutdown, then opens the same storage again; only what the backend
made durable survives. For the memory backend, the same objects are handed back (they
stand for storage that outlives the bot within this process).
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from botmesh.core.backend import DurabilityBackend
from botmesh.core.fileio import FileIO
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import Store

CAPABILITIES: tuple[str, ...] = tuple(f.name for f in fields(Capabilities))
"""The names of the capabilities a backend can claim (``survives_crash`` ...), from
:class:`~botmesh.core.spi.Capabilities`."""


@dataclass(frozen=True)
class KillSpec:
    """How a child process of :mod:`botmesh_testkit.kill` reaches a backend's storage:
    a small, picklable description (it is pickled into each child, which builds the
    backend from it). One subclass per kind: :class:`FileSpec`, :class:`SQLiteSpec`,
    :class:`PostgresSpec`, :class:`RedisSpec`, :class:`MemorySpec`, :class:`FactorySpec`.
    A harness gives the one of its storage (:meth:`BackendHarness.kill_spec`)."""

    kind: ClassVar[str] = ""
    """The kind's name, also the first element of the tuple form (:meth:`as_tuple`)."""

    @property
    def name(self) -> str:
        """A short name for reports: ``file+log``, ``sqlite``, ``factory:pkg.mod:make`` ..."""
        return self.kind

    def as_tuple(self) -> tuple[Any, ...]:
        """The tuple form the kill entry points also accept (``("sqlite", path)`` ...)."""
        return (self.kind, *(getattr(self, f.name) for f in fields(self)))


@dataclass(frozen=True)
class FileSpec(KillSpec):
    """:class:`~botmesh.core.file_backend.FileDurability` on the journal at ``path``."""

    path: str
    append_log: bool = False
    fsync: bool = True
    kind: ClassVar[str] = "file"

    @property
    def name(self) -> str:
        return "file+log" if self.append_log else "file"


@dataclass(frozen=True)
class SQLiteSpec(KillSpec):
    """``SQLiteStore(file=path)`` and its durability backend."""

    path: str
    kind: ClassVar[str] = "sqlite"


@dataclass(frozen=True)
class PostgresSpec(KillSpec):
    """:class:`~botmesh.postgres_store.PostgresDurability` on the server at ``url``, in
    the table ``<table_prefix>durable``."""

    url: str
    table_prefix: str = "botmesh_"
    kind: ClassVar[str] = "postgres"


@dataclass(frozen=True)
class RedisSpec(KillSpec):
    """:class:`~botmesh.redis_store.RedisDurability` on the server at ``url``, under the
    key prefix ``prefix``."""

    url: str
    prefix: str = "botmesh"
    kind: ClassVar[str] = "redis"


@dataclass(frozen=True)
class MemorySpec(KillSpec):
    """``MemoryDurability``: each child has its own, so nothing survives a kill."""

    kind: ClassVar[str] = "memory"


@dataclass(frozen=True)
class FactorySpec(KillSpec):
    """A third party's backend: ``target(*args)``, ``target`` a ``"pkg.module:function"``
    path or a callable (pickled into the child with dill), returning a
    ``DurabilityBackend``, a ``DurableKv`` or a ``botmesh_testkit.kill.Built`` (awaited
    when it returns an awaitable)."""

    target: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    kind: ClassVar[str] = "factory"

    @property
    def name(self) -> str:
        return f"factory:{callable_name(self.target)}"

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.kind, self.target, *self.args)


def callable_name(fn: Any) -> str:
    """``module:qualname`` of a function or class (a string is itself), else its repr."""
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if name and module else repr(fn)


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

    async def discard(self) -> None:
        """Release everything at the end of a test whose storage is thrown away right
        after (a crash-matrix cell's scratch directory): what :meth:`close` does, minus
        work that only serves to keep what is stored — a file journal's last fold into
        its snapshot (issue 16: a tenth of a ``file+log`` cell). The default is
        :meth:`close`; storage that outlives the harness (a server's pooled table) is
        given back by it as ever."""
        await self.close()

    def reuse_storage(self) -> bool:
        """Ask this harness, before it opens, to take its storage from a pool of storage
        that earlier harnesses of this process emptied, and to give it back emptied at
        :meth:`close`, instead of creating it and dropping it — for storage on a server,
        the DDL is most of what a short test costs. The crash matrix asks it of the
        harness of every cell and dry run. True when the harness does so (its storage is
        then as a new one: empty); False, the default, when it makes its storage as
        always."""
        return False

    def forkable(self) -> bool:
        """Whether a copy of the process made by ``os.fork()`` at any moment holds a
        private, identical copy of this harness's storage, which the original's later
        writes do not reach and the copy's writes do not disturb — storage in the
        process's memory only (no files, no server, no threads). True lets the crash
        matrix share a cell's prefix by forking (:mod:`botmesh_testkit.matrix.shared`);
        False, the default, replays it per cell."""
        return False

    def server_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the server holding the storage, for backends on a server
        (the fault suite puts a :class:`~botmesh_testkit.servers.faultproxy.FaultProxy` in
        front of it); None for local storage."""
        return None

    def via(self, host: str, port: int) -> BackendHarness:
        """A harness on the *same* storage whose backend reaches the server at
        ``host:port`` (a proxy) instead. Only for harnesses with a server address."""
        raise NotImplementedError(f"{type(self).__name__} has no server to reach another way")

    def kill_spec(self) -> KillSpec | None:
        """The same storage described for a child process of :mod:`botmesh_testkit.kill`,
        or None when a child cannot reach it (in-memory storage)."""
        return None

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        """When the backend is a :class:`~botmesh.core.kv_durability.KvDurability` over a
        ``DurableKv``: a zero-argument callable giving a new, unopened kv on this
        harness's storage (what the ``DurableKv`` conformance suite needs); else None."""
        return None

    def use_file_io(self, io: FileIO) -> bool:
        """Do every file-system call of this harness's storage through ``io`` (a
        :class:`botmesh.core.fileio.FileIO`) from the next :meth:`open` on, and say so
        (True); False, the default, when the backend does not do its file I/O through
        ``botmesh.core.fileio``. The crash matrix hands the file backends a recording
        ``FileIO`` here (``botmesh_testkit.crash.fs.PowerCutIO``) so that a cell can also
        reopen the crash states a power cut at its crash point could leave
        (:mod:`botmesh_testkit.matrix.powercut_states`). A harness of one's own built on
        ``FileKv``/``FileDurability`` passes ``io`` on to it to get those states too."""
        return False


HarnessFactory = Callable[[str | None], BackendHarness]
"""``factory(workdir)`` -> a harness on storage derived from ``workdir`` (None: a fresh
temporary directory)."""
