"""One wrapper mechanism for every backend the testkit stands between the engine and a
real backend: the crash injector (:class:`~botmesh_testkit.crash.wrapper.CrashableBackend`)
and the kill loops' progress markers both subclass :class:`InterceptedBackend`.

Each write operation of the interface (a crash point of :mod:`.points`) is wrapped as
``before_write`` -> the inner call -> ``after_write`` (or ``write_failed`` when it
raised); each read operation and the lifecycle calls pass ``before_read`` first.

``serial``: an ``asyncio.Lock`` every operation (hooks and inner call) runs under, one
at a time, shared by every wrapper given the same lock. On a backend on a server the
order in which concurrent calls (a sweep pass beside a message) complete is the
network's, so the points a run passes came in another order from run to run; one call
at a time, that order is the program's: a crash world on a server backend
(:class:`~botmesh_testkit.crash.world.World`) draws and replays the same cells for the
same seed. A call never waits inside another one here, so the lock cannot deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from botmesh.core.backend import DurabilityBackend

from .points import READS, WRITES


class InterceptedBackend(DurabilityBackend):
    """Passes every operation to ``inner``; subclasses override the hooks."""

    def __init__(self, inner: DurabilityBackend, name: str | None = None, *, serial: asyncio.Lock | None = None) -> None:
        self.inner = inner
        self.name = name or inner.name
        self.capabilities = inner.capabilities
        self.serial = serial

    def before_write(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called before write ``op``; what it returns is handed to the other hooks."""
        return None

    def after_write(self, op: str, token: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Called after write ``op`` returned ``result``."""

    def write_failed(self, op: str, token: Any, exc: Exception) -> None:
        """Called when write ``op`` raised ``exc`` (it is raised on afterwards)."""

    def before_read(self) -> None:
        """Called before every read operation, ``start()`` and ``stop()``."""

    async def start(self) -> None:
        async with self.serial or contextlib.nullcontext():
            self.before_read()
            await self.inner.start()

    async def stop(self) -> None:
        async with self.serial or contextlib.nullcontext():
            self.before_read()
            await self.inner.stop()

    async def durability_settings(self) -> dict[str, str] | None:
        # Not an operation of the journals (no crash point): what the inner backend reports.
        return await self.inner.durability_settings()


def _write(op: str, method: str) -> Any:
    # the lock taken by hand, not with ``async with``: without one (``serial`` None, an
    # embedded backend) no context manager is entered per call (issue 16)
    async def call(self: InterceptedBackend, *args: Any, **kwargs: Any) -> Any:
        serial = self.serial
        if serial is not None:
            await serial.acquire()
        try:
            token = self.before_write(op, args, kwargs)
            try:
                result = await getattr(self.inner, method)(*args, **kwargs)
            except Exception as exc:
                self.write_failed(op, token, exc)
                raise
            self.after_write(op, token, args, kwargs, result)
            return result
        finally:
            if serial is not None:
                serial.release()

    call.__name__ = method
    call.__doc__ = f"Write operation {op!r} around ``inner.{method}``."
    return call


def _read(method: str) -> Any:
    async def call(self: InterceptedBackend, *args: Any, **kwargs: Any) -> Any:
        serial = self.serial
        if serial is None:
            self.before_read()
            return await getattr(self.inner, method)(*args, **kwargs)
        async with serial:
            self.before_read()
            return await getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = method
    return call


for _op, _method in WRITES.items():
    setattr(InterceptedBackend, _method, _write(_op, _method))
for _method in READS.values():
    setattr(InterceptedBackend, _method, _read(_method))
# the operations are installed by setattr above, which mypy cannot see: building a
# subclass needs a `type: ignore[abstract]`
InterceptedBackend.__abstractmethods__ = frozenset()
