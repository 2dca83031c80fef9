"""``RedisHarness``: the testkit's harness for the Redis backend
(:class:`botmesh.redis_store.RedisDurability`).

Storage is one key prefix on one Redis server, derived from the workdir:
``"bm" + sha1(workdir)[:10]``. The same workdir therefore means the same storage (a
restarted "process" finds its journals), and the fresh workdir of every test or crash
cell keeps cells (and pytest-xdist workers) apart on a shared server.

* :meth:`~RedisHarness.open` — a :class:`RedisDurability` with a client of its own, and a
  :class:`~botmesh.core.store.MemoryStore` (it stands for a persistent store and is kept
  across restarts, like the other harnesses do).
* :meth:`~RedisHarness.reopen` — the process dies: its kv is abandoned (every later call
  of the dead incarnation fails) and its client's sockets are closed without any further
  command — nothing is "flushed", because a Redis client buffers nothing: only what the
  server acknowledged survives. Then a new :class:`RedisDurability` opens the same prefix.
* :meth:`~RedisHarness.close` — deletes every key of the prefix (``SCAN MATCH``), with
  the last incarnation's client when it is still there (the test is over: it is the
  harness's to use), and closes every client.

Lean connections for the crash matrix (:meth:`~RedisHarness.reuse_storage`, which the
matrix asks of every cell's harness): a cell opens a new client per incarnation, and with
redis-py 8 each new connection cost three round trips before its first command —
``HELLO 3`` (its default protocol), ``CLIENT MAINT_NOTIFICATIONS`` (RESP3 only) and the
pipelined ``CLIENT SETINFO`` of the library's name and version — beside the thirty-odd
commands of a cell. The matrix's incarnations connect with RESP2 (unless the URL names a
``protocol``) and send no ``CLIENT SETINFO`` (``client_options`` of
:class:`~botmesh.redis_store.RedisKv`): a connection's first call is its command alone.
The kv sends the same commands and reads the same values in both protocols (its tests
run both); the conformance suite runs on the URL as given, with redis-py's defaults.
Redis cells: 142-146 vs 120-135 per second (one process, alternating with the code
before).

Connections kept across incarnations (also only once the matrix asked
:meth:`~RedisHarness.reuse_storage`): the incarnations of a cell share one client, built
the way the kv builds its own (``RedisKv(client=...)``), so a restart does not open a
new TCP connection and build a new redis-py client each time (about 0.4 ms per
incarnation here, two or three incarnations per cell). Only what a dead process would
leave the server is kept: at :meth:`~RedisHarness.reopen`, every connection of the
shared client that is *checked out* — a command of the dead incarnation sent and its
reply not yet read, or about to be sent — is dropped, so its command may still run on
the server but its reply reaches nobody and the connection is never used again; only
connections that were idle in the pool (no command in flight, nothing unread) serve
the next incarnation. RESP2 connections carry no state the kv sets (no ``SELECT`` after
the URL's, no ``MULTI``/``WATCH``, no subscription), so an idle one is as good as a new
one. Redis cells: 118-128 vs 105-106 per second (three runs each), 0.90 of the client's
CPU instructions per cell (``benchmarks/crash_cells.py --callgrind``). A harness the
matrix did not ask gives each incarnation a client of its own, closed at its death, as
before.

Crash survival here is survival of the *client* process; the server keeps running. A
server crash needs AOF with ``appendfsync always`` (see :mod:`botmesh.redis_store.kv`).
Requires redis-py.

Event loops: the clients are asyncio clients, bound to the loop that first used them.
Close the harness on that loop (``World.close()`` does); a later ``close()`` on another
loop still deletes the keys (with a client of its own) but can no longer close the
sockets of a backend that was left open on a finished loop.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from botmesh.core.backend import DurabilityBackend
from botmesh.core.spi import Capabilities
from botmesh.core.store import MemoryStore, Store

from .base import BackendHarness, KillSpec, RedisSpec

DEFAULT_PORT = 6379

__all__ = ["DEFAULT_URL", "RedisHarness", "lean_client_options", "prefix_for"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def lean_client_options() -> dict[str, Any]:
    """``client_options`` for a connection without the handshake's round trips: RESP2 (no
    ``HELLO``), no ``CLIENT SETINFO`` (module docstring)."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # a redis-py before driver_info: None sends neither name nor version
        return {"protocol": 2, "lib_name": None, "lib_version": None}
    return {"protocol": 2, "driver_info": DriverInfo(name=None, lib_version=None)}


def prefix_for(workdir: str) -> str:
    """The key prefix of a workdir: ``"bm" + sha1(workdir)[:10]`` (deterministic)."""
    return "bm" + hashlib.sha1(workdir.encode("utf-8", "surrogatepass")).hexdigest()[:10]


class RedisHarness(BackendHarness):
    """Opens :class:`~botmesh.redis_store.RedisDurability` on the server at ``url`` under
    the prefix of ``workdir`` (see the module docstring)."""

    name = "redis"

    def __init__(self, workdir: str | None = None, *, url: str, run_prefix: str = "") -> None:
        super().__init__(workdir)
        self.url = url
        self.prefix = run_prefix + prefix_for(self.workdir)
        self.backend: Any = None
        self.store: Store | None = None
        self.backends: list[Any] = []
        self.client_options: dict[str, Any] | None = None
        """``client_options`` of every incarnation's kv (None: redis-py's defaults)."""
        self._shared: Any = None
        """Matrix mode: the client every incarnation's kv is given (module docstring)."""

    @classmethod
    def from_env(cls, workdir: str | None = None) -> RedisHarness:
        """A harness on the server of ``BOTMESH_REDIS_URL`` (default
        ``redis://127.0.0.1:6379/0``) — what a registry entry such as
        ``HARNESSES["redis"] = RedisHarness.from_env`` needs."""
        return cls(workdir, url=os.environ.get("BOTMESH_REDIS_URL", DEFAULT_URL))

    @property
    def capabilities(self) -> Capabilities:
        from botmesh.redis_store import RedisKv

        return RedisKv.capabilities

    def _new_backend(self) -> Any:
        from botmesh.redis_store import RedisDurability

        if self.client_options is None:
            backend = RedisDurability(url=self.url, prefix=self.prefix)
        else:
            if self._shared is None:
                from botmesh.redis_store.kv import client_from_url

                self._shared = client_from_url(self.url, self.client_options)
            backend = RedisDurability(client=self._shared, prefix=self.prefix)
        self.backends.append(backend)
        self.backend = backend
        return backend

    def reuse_storage(self) -> bool:
        """Asked by the crash matrix: the incarnations connect lean from now on (module
        docstring). False: the keys are made and deleted as always (a prefix per
        workdir costs nothing to make)."""
        self.client_options = lean_client_options()
        return False

    async def open(self) -> tuple[DurabilityBackend, Store]:
        self.store = MemoryStore()
        return self._new_backend(), self.store

    async def reopen(self) -> tuple[DurabilityBackend, Store]:
        if self.backend is not None:
            drop = self.backend.kv.abandon()
            if drop is not None:
                await drop  # the dead process's sockets are gone before the new one starts
            if self._shared is not None:
                await _drop_checked_out(self._shared)
        if self.store is None:
            self.store = MemoryStore()
        return self._new_backend(), self.store

    def server_address(self) -> tuple[str, int] | None:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORT

    def via(self, host: str, port: int) -> RedisHarness:
        twin = RedisHarness(self.workdir, url=_with_address(self.url, host, port))
        twin.prefix = self.prefix
        return twin

    def kill_spec(self) -> KillSpec | None:
        return RedisSpec(self.url, self.prefix)

    def kv_factory(self) -> Any:
        from botmesh.redis_store import RedisKv

        return lambda: RedisKv(url=self.url, prefix=self.prefix)

    async def delete_keys(self, client: Any = None) -> int:
        """Delete every key of this harness's prefix; the number deleted. ``client``: a
        ``redis.asyncio.Redis`` on the harness's server to do it with (left open), else
        one of its own (closed after)."""
        from botmesh.redis_store import key_pattern

        own = client is None
        if own:
            client = self._cleaning_client()
        deleted = 0
        try:
            batch: list[bytes] = []
            async for key in client.scan_iter(match=key_pattern(self.prefix), count=500):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += await client.delete(*batch)
                    batch.clear()
            if batch:
                deleted += await client.delete(*batch)
        finally:
            if own:
                await client.aclose()
        return deleted

    def _cleaning_client(self) -> Any:
        from botmesh.redis_store._driver import driver_options
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), retry_on_error=[], **driver_options())

    def _last_client(self) -> Any:
        """The client of the last incarnation's kv while it is still there (not abandoned
        nor closed) and a plain ``Redis`` on this harness's server, else None: the end of
        a test deletes the keys with it instead of connecting once more."""
        from redis.asyncio import Redis

        kv = getattr(self.backend, "kv", None)
        if kv is None or kv.prefix != self.prefix:
            return None
        client = kv.client
        return client if isinstance(client, Redis) else None

    async def close(self) -> None:
        """Delete the prefix's keys — on the last incarnation's client when it is still
        there (its connection already made), else on a client of its own — then close
        every incarnation's client."""
        try:
            await self.delete_keys(self._last_client())
        finally:
            for backend in self.backends:
                await backend.kv.close()
            self.backends.clear()
            self.backend = None
            shared, self._shared = self._shared, None
            if shared is not None:
                await shared.aclose()


async def _drop_checked_out(client: Any) -> None:
    """Disconnect every connection of ``client``'s pool that is checked out: a dead
    incarnation's command may be in flight on it (module docstring). The idle ones stay.
    (redis-py keeps them in ``_in_use_connections``; should that name change, nothing is
    found to drop — then the matrix must not share clients: the harness tests check
    that a checked-out connection is dropped.)"""
    for connection in list(getattr(client.connection_pool, "_in_use_connections", ())):
        await connection.disconnect(nowait=True)


def provisioned(workdir: str | None = None) -> RedisHarness:
    """The harness of the built-in backend name ``redis``: a prefix per workdir, under the
    run's own prefix, on the server the pytest plugin provisioned
    (``$BOTMESH_REDIS_URL`` and ``$BOTMESH_REDIS_PREFIX``; :mod:`botmesh_testkit.servers`)."""
    from ..servers import REDIS_PREFIX_ENV, REDIS_URL_ENV

    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        raise RuntimeError(f"backend 'redis' needs a server: set {REDIS_URL_ENV}, or run it through pytest "
                           "(the plugin provisions one: --botmesh-redis-url, else a private server)")
    run_prefix = os.environ.get(REDIS_PREFIX_ENV, "")
    return RedisHarness(workdir, url=url, run_prefix=f"{run_prefix}_" if run_prefix else "")


def _with_address(url: str, host: str, port: int) -> str:
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth + '@' if auth else ''}{host}:{port}"))
