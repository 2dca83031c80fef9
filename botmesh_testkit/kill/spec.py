"""The backend of a child: its :class:`~botmesh_testkit.backends.base.KillSpec`, built
inside the child (and by the parent, to read the final journal once every child ended).

The entry points (:class:`~botmesh_testkit.kill.KillLoop`,
:class:`~botmesh_testkit.kill.Replicas`, the ``botmesh_kill_loop`` fixture,
:func:`build_backend`, :func:`read_journal`) take a ``KillSpec`` or, for compatibility,
its tuple form, converted by :func:`as_kill_spec` alone::

    ("file", path[, append_log[, fsync]])     ("sqlite", path)
    ("postgres", url[, table_prefix])         ("redis", url[, prefix])
    ("memory",)                               ("factory", "pkg.mod:fn" or callable, *args)

A backend *name* (``"sqlite"``, ``"postgres"``, ``"pkg.mod:factory"`` ...) becomes a spec
through its harness only (:func:`spec_for`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from botmesh.core.backend import DurabilityBackend
from botmesh.core.engine import derive_scope
from botmesh.core.records import InboxRecord, OutboxRecord

from ..backends.base import FactorySpec, FileSpec, KillSpec, MemorySpec, PostgresSpec, RedisSpec, SQLiteSpec
from ..backends.registry import resolve

_T = TypeVar("_T")

BackendSpec = KillSpec | tuple[Any, ...]
"""What the entry points accept: a :class:`KillSpec`, or its tuple form."""

SCOPE = derive_scope(None, None, "bot", "default")
"""The scope of the children's bots (default ``bot_id``/``connection_id``)."""


class HarnessError(RuntimeError):
    """The harness itself could not run (a child crashed with a traceback, could not be
    pickled, did not start, a spec names no backend): not a verdict on the backend."""


# the tuple forms: kind -> (spec class, fewest, most elements after the kind)
_TUPLE_FORMS: dict[str, tuple[type[KillSpec], int, int | None]] = {
    "file": (FileSpec, 1, 3),
    "sqlite": (SQLiteSpec, 1, 1),
    "postgres": (PostgresSpec, 1, 2),
    "redis": (RedisSpec, 1, 2),
    "memory": (MemorySpec, 0, 0),
    "factory": (FactorySpec, 1, None),
}


def as_kill_spec(spec: BackendSpec) -> KillSpec:
    """``spec`` as a :class:`KillSpec`: the one place the tuple form (kept for
    compatibility, see the module docstring) is read. Raises :class:`HarnessError` for a
    tuple that names no kind of backend or has the wrong number of elements."""
    if isinstance(spec, KillSpec):
        return spec
    if isinstance(spec, list):  # a list of the same elements was always accepted
        spec = tuple(spec)
    form = _TUPLE_FORMS.get(spec[0]) if isinstance(spec, tuple) and spec and isinstance(spec[0], str) else None
    if form is None:
        raise HarnessError(f"unknown backend spec {spec!r}: expected a KillSpec, or a tuple of file, sqlite, "
                           "postgres, redis, memory or factory")
    cls, fewest, most = form
    rest = spec[1:]
    if len(rest) < fewest or (most is not None and len(rest) > most):
        raise HarnessError(f"backend spec {spec!r}: {spec[0]!r} takes {fewest}"
                           f"{'' if most == fewest else f' to {most}' if most is not None else ' or more'} "
                           "element(s) after its kind")
    if cls is FactorySpec:
        return FactorySpec(rest[0], tuple(rest[1:]))
    if cls is FileSpec:
        return FileSpec(rest[0], *(bool(x) for x in rest[1:]))
    return cls(*rest)


def spec_for(backend: str, workdir: str) -> KillSpec:
    """The spec of backend ``backend`` (any name
    :func:`~botmesh_testkit.backends.registry.resolve` accepts) on storage derived from
    ``workdir``: its harness's :meth:`~botmesh_testkit.backends.base.BackendHarness.kill_spec`.
    ``ValueError`` when a child process cannot reach that storage (``memory``)."""
    spec = resolve(backend)(workdir).kill_spec()
    if spec is None:
        raise ValueError(f"backend {backend!r}: a child process cannot reach its storage")
    return spec


def spec_name(spec: BackendSpec) -> str:
    """A short name for reports: ``file+log``, ``sqlite``, ``factory:LazyKv`` ..."""
    return as_kill_spec(spec).name


@dataclass
class Built:
    """A backend built from a spec: the durability backend, the bot's store, and what to
    call when done (close files, pools)."""

    backend: DurabilityBackend
    store: Any
    close: Callable[[], Awaitable[None]] | None = None


def _import(target: str) -> Any:
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"factory {target!r}: expected 'pkg.module:function'")
    return getattr(importlib.import_module(module), attr)


async def build_backend(spec: BackendSpec) -> Built:
    """Build the backend a spec describes. A :class:`FactorySpec` calls
    ``target(*args)`` (awaited when it returns an awaitable), which returns a
    ``DurabilityBackend``, a ``DurableKv`` (wrapped in ``KvDurability``) or a
    :class:`Built`. PostgreSQL and Redis are imported only when asked for."""
    from botmesh.core.kv_durability import KvDurability
    from botmesh.core.memory import MemoryDurability
    from botmesh.core.spi import DurableKv
    from botmesh.core.store import MemoryStore

    spec = as_kill_spec(spec)
    if isinstance(spec, MemorySpec):
        return Built(MemoryDurability(), MemoryStore())
    if isinstance(spec, FileSpec):
        from botmesh.core.file_backend import FileDurability

        fd = await FileDurability.open(spec.path, append_log=spec.append_log, fsync=spec.fsync)
        return Built(fd, MemoryStore(), fd.close)
    if isinstance(spec, SQLiteSpec):
        from botmesh.sqlite_store import SQLiteStore

        store = SQLiteStore(file=spec.path)
        await store.open()
        return Built(store.durability(), store, store.close)
    if isinstance(spec, PostgresSpec):
        try:
            from botmesh.postgres_store import PostgresDurability
        except ImportError as exc:  # its driver is an optional extra
            raise HarnessError(f"backend spec {spec!r}: botmesh.postgres_store is not available ({exc})") from None
        return Built(_construct(PostgresDurability, spec.url, ("connection_string", "url", "dsn"),
                                table_prefix=spec.table_prefix), MemoryStore())
    if isinstance(spec, RedisSpec):
        try:
            from botmesh.redis_store import RedisDurability
        except ImportError as exc:  # its driver is an optional extra
            raise HarnessError(f"backend spec {spec!r}: botmesh.redis_store is not available ({exc})") from None
        return Built(_construct(RedisDurability, spec.url, ("url",), prefix=spec.prefix), MemoryStore())
    if isinstance(spec, FactorySpec):
        fn = _import(spec.target) if isinstance(spec.target, str) else spec.target
        made = fn(*spec.args)
        if asyncio.iscoroutine(made) or isinstance(made, Awaitable):
            made = await made
        if isinstance(made, Built):
            return made
        if isinstance(made, DurableKv):
            return Built(KvDurability(made, own_kv=True, name=getattr(fn, "__name__", "factory")), MemoryStore())
        if isinstance(made, DurabilityBackend):
            close = getattr(made, "close", None)
            return Built(made, MemoryStore(), close if callable(close) else None)
        raise HarnessError(f"backend factory {spec.target!r} returned {type(made).__name__}; expected a "
                           "DurabilityBackend, a DurableKv or a kill.Built")
    raise HarnessError(f"unknown backend spec {spec!r}")


def _construct(cls: Any, url: str, url_names: tuple[str, ...], **kwargs: Any) -> Any:
    """``cls(<url>, **kwargs)`` with the url passed under the first of ``url_names`` the
    constructor accepts (keyword-only constructors), else positionally."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    for name in url_names:
        if name in params:
            return cls(**{name: url}, **kwargs)
    return cls(url, **kwargs)


async def read_journal(spec: BackendSpec, scope: str = SCOPE) -> tuple[list[InboxRecord], list[OutboxRecord]]:
    """Every inbox and outbox record of ``scope`` as stored (no child may hold the
    backend: call it after the last child stopped or died)."""
    built = await build_backend(spec)
    try:
        await built.backend.start()
        try:
            inbox = list(await built.backend.inbox_list(scope, limit=1_000_000))
            outbox = list(await built.backend.outbox_list(scope, limit=1_000_000))
        finally:
            await built.backend.stop()
    finally:
        if built.close is not None:
            await built.close()
    return inbox, outbox


def run_sync(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion from synchronous code, also when this thread already
    runs an event loop (an async test calling :meth:`KillLoop.run`): then in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="botmesh-kill-journal")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return cast(_T, box.get("value"))
