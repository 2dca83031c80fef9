"""A third party's backend given as ``pkg.module:factory`` (or registered by name)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import Capabilities, DurableKv
from botmesh.core.store import MemoryStore, Store

from .base import BackendHarness, FactorySpec, HarnessFactory, KillSpec


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

    def _takes_workdir(self) -> bool:
        """Whether the factory takes the workdir (one parameter)."""
        try:
            return len(inspect.signature(self.factory).parameters) == 1
        except (TypeError, ValueError):
            return False

    def _call(self) -> Any:
        return self.factory(self.workdir) if self._takes_workdir() else self.factory()

    async def _make(self) -> DurabilityBackend:
        made = self._call()
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

    def kill_spec(self) -> KillSpec | None:
        target: Any = self.name if ":" in self.name else self.factory  # a registered name: the callable
        return FactorySpec(target, (self.workdir,) if self._takes_workdir() else ())

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        if inspect.iscoroutinefunction(self.factory):
            return None
        if not isinstance(self._call(), DurableKv):
            return None
        return self._call


def factory_harness(name: str, obj: Any) -> HarnessFactory:
    """A harness factory for ``obj``: a :class:`BackendHarness` subclass, or a backend
    factory (see :class:`FactoryHarness`)."""
    if isinstance(obj, type) and issubclass(obj, BackendHarness):
        def harness(workdir: str | None) -> BackendHarness:
            return obj(workdir)
    else:
        def harness(workdir: str | None) -> BackendHarness:
            return FactoryHarness(name, obj, workdir)
    harness.botmesh_factory = obj  # type: ignore[attr-defined]  # whose code it is (--botmesh-coverage measures it)
    return harness
