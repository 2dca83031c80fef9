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
from dataclasses import fields
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import Store

CAPABILITIES: tuple[str, ...] = tuple(f.name for f in fields(Capabilities))
"""The names of the capabilities a backend can claim (``survives_crash`` ...), from
:class:`~botmesh.core.spi.Capabilities`."""


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


HarnessFactory = Callable[[str | None], BackendHarness]
"""``factory(workdir)`` -> a harness on storage derived from ``workdir`` (None: a fresh
temporary directory)."""
