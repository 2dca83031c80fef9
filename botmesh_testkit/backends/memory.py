"""The memory backend's harness: the same objects across a "restart" (they stand for
storage that outlives the bot within this process)."""

from __future__ import annotations

from collections.abc import Callable

from botmesh.core.backend import DurabilityBackend
from botmesh.core.memory import MemoryDurability, MemoryKv
from botmesh.core.spi import DurableKv
from botmesh.core.store import MemoryStore, Store

from .base import BackendHarness


class MemoryHarness(BackendHarness):
    name = "memory"

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.backend = MemoryDurability()
        self.store = MemoryStore()
        return self.backend, self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        return self.backend, self.store

    def forkable(self) -> bool:
        """All its storage is objects of this process (see
        :meth:`BackendHarness.forkable`)."""
        return True

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        return MemoryKv
