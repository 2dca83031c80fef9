"""Auto-pipelining for :class:`~botmesh.redis_store.RedisKv` (issue 16): commands that
concurrent callers issue while the kv waits for the server go out together, as ONE
pipeline (one write, one round trip), instead of one connection and one round trip each.

How: a call made while nothing is in flight is sent at once, on its own (a lone caller
— one chat — costs what it cost before: one command, one round trip, no extra task). A
call made while a round trip is in flight joins a queue; when the round trip ends, a
flusher task sends everything queued as one non-transactional pipeline, hands each
caller its reply (or its own error), and repeats while more calls queued meanwhile. So
with several chats at once, their independent commands share round trips. Each command
is still one ``EVALSHA`` / ``HGET`` executed atomically by the server on its own:
batching changes how many round trips carry them, never what one does (no ``MULTI``;
one command's error is its caller's alone).

Errors: a connection lost while a batch is in flight fails every command of that batch
with that error — each of them may or may not have run, exactly the "outcome unknown" of
a single command, which :class:`~botmesh.core.kv_durability.KvDurability` resolves by
reading the record back. A ``NOSCRIPT`` reply (the server lost its script cache, e.g.
after a restart) means that command did not run: the scripts are loaded again and those
commands sent once more — the only resend, as with redis-py's own ``Script`` objects.

On a client the kv built itself (:func:`_lean_connection`), a lone call and a batch are
sent on a connection of the client's pool taken by hand, not through redis-py's
``execute_command`` or its pipelines (issue 16): see :func:`_lean_send`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.connection import ConnectionPool
from redis.exceptions import ConnectionError as DriverConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as DriverTimeoutError

__all__ = ["AutoPipeline"]

_Entry = tuple[tuple[Any, ...], "asyncio.Future[Any]"]


def _lean_connection(client: Redis) -> Any:
    """An idle, connected connection of ``client``'s pool, checked out of the pool as
    the pool's own ``get_connection`` does (moved to its in-use set), for
    :func:`_lean_send`; None — redis-py's ``execute_command`` or pipeline then sends it —
    unless ``client`` is one the kv built from a URL (its connection class made by
    :func:`~botmesh.redis_store._driver.direct_send`) with redis-py's plain
    ``ConnectionPool``, no single connection of its own, no credential provider (whose
    re-authentication redis-py runs when a connection goes back to the pool) and an
    idle connection open. (It reaches into the pool's ``_available_connections`` and
    ``_in_use_connections``, as the testkit's matrix harness does; should those names
    change, nothing is taken and every command takes redis-py's own path.)"""
    pool = client.connection_pool
    if type(pool) is not ConnectionPool or client.connection is not None:
        return None
    available = getattr(pool, "_available_connections", None)
    in_use = getattr(pool, "_in_use_connections", None)
    if not available or in_use is None or pool.connection_kwargs.get("credential_provider") is not None:
        return None
    connection = available[-1]
    if not getattr(connection, "lean_send", False) or not connection.is_connected:
        return None
    available.pop()
    in_use.add(connection)
    return connection


async def _lean_send(client: Redis, connection: Any, commands: list[tuple[Any, ...]]) -> list[Any] | None:
    """Send ``commands`` (``execute_command`` arguments each) on ``connection`` (from
    :func:`_lean_connection`) in one write and read their replies — each the reply as
    ``execute_command`` gives it (the client's response callback applied), or the
    ``ResponseError`` the server answered for it, as a non-transactional pipeline
    executed with ``raise_on_error=False`` gives them — then give the connection back
    to the pool. None when the connection failed the pool's check: nothing was sent.

    redis-py 8's ``execute_command`` wraps every command in its retry machinery, its
    observability hooks (awaited even when no metrics are collected), a lock around
    taking the connection from the pool and another around giving it back, and an
    event dispatched at the release (its pipelines alike): measured on this project's
    VM, 174-242 us of client CPU per ``HGET`` against 119-139 us sent this way. What is
    kept of it: the pool's check of a connection before use, redis-py's own packing,
    ``send_packed_command`` and ``read_response`` (the socket timeouts; a connection
    whose read failed or was cancelled midway is disconnected, so none goes back to the
    pool with a reply unread), the client's response callbacks, and a connection
    redis-py marked for reconnection disconnected on its way back. What is not:
    redis-py's metrics of the commands and the pool (its OpenTelemetry observability,
    off unless configured), which do not count these commands.

    A connection that fails the pool's check — the server closed it while it was idle
    (an idle timeout, a restart, ``CLIENT KILL``), or it holds bytes nobody asked for —
    is disconnected and given back (the caller then sends through redis-py, which
    connects it again). redis-py 8's own check lets such a connection through when its
    maintenance notifications are on, the RESP3 default: the command then fails with
    "Connection closed by server", which the kv reports as ``BackendUnavailableError``;
    here it goes out on the new connection. Nothing had been sent: nothing is sent
    twice."""
    pool = client.connection_pool
    try:
        try:
            dirty = await connection.can_read()
        except (DriverConnectionError, DriverTimeoutError, OSError):
            dirty = True
        if dirty:
            await connection.disconnect()
            return None
        if len(commands) == 1:
            await connection.send_command(*commands[0])
        else:
            await connection.send_packed_command(connection.pack_commands(commands))
        replies: list[Any] = []
        callbacks = client.response_callbacks
        for command in commands:
            try:
                reply = await connection.read_response()
            except ResponseError as exc:  # the server's answer to this command: the others are read on
                replies.append(exc)
                continue
            callback = callbacks.get(command[0])
            replies.append(reply if callback is None else callback(reply))
        return replies
    finally:
        pool._in_use_connections.discard(connection)
        reconnect = getattr(connection, "should_reconnect", None)
        if reconnect is not None and reconnect():
            await connection.disconnect()
        pool._available_connections.append(connection)


class AutoPipeline:
    """The queue and flusher of one kv. ``client()`` gives the live client (it raises
    when the kv is closed: every queued caller then gets that error); ``script(sha)``
    gives the source of a script by its SHA1 (for a reload after ``NOSCRIPT``)."""

    def __init__(self, client: Callable[[], Redis], script: Callable[[bytes | str], str | None]) -> None:
        self._client = client
        self._script = script
        self._queue: list[_Entry] = []
        self._busy = False  # a round trip is in flight (a lone call, or a flusher's batch)
        self._flusher: asyncio.Task[None] | None = None

    async def call(self, *command: Any) -> Any:
        """Send ``command`` (``execute_command`` arguments): at once when nothing is in
        flight, else with the next batch. Its reply, or its error (a driver error, as
        redis-py raises it)."""
        if self._busy:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queue.append((command, future))
            return await future
        self._busy = True
        try:
            client = self._client()
            send = cast(Callable[..., Awaitable[Any]], client.execute_command)  # untyped in redis-py
            try:
                connection = _lean_connection(client)
                replies = None if connection is None else await _lean_send(client, connection, [command])
                if replies is None:
                    return await send(*command)
                if isinstance(replies[0], ResponseError):
                    raise replies[0]
                return replies[0]
            except NoScriptError:  # it did not run: load the script, send it again
                source = self._script(command[1]) if command[0] == "EVALSHA" else None
                if source is None:
                    raise
                await client.script_load(source)
                return await send(*command)
        finally:
            self._release()

    def _release(self) -> None:
        """The round trip in flight ended: send what queued meanwhile, or go idle."""
        if self._queue:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        else:
            self._busy = False

    async def _flush(self) -> None:
        try:
            await self._flush_queue()
        finally:
            self._busy = False
            if self._queue:  # queued after the last batch's round trip, as the flusher ended
                self._busy = True
                self._release()

    async def _flush_queue(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            batch = [(command, future) for command, future in batch if not future.done()]  # cancelled callers
            if not batch:
                continue
            try:
                client = self._client()
                connection = _lean_connection(client)
                results = None if connection is None else await _lean_send(client, connection, [c for c, _ in batch])
                if results is None:
                    pipe = client.pipeline(transaction=False)
                    for command, _ in batch:
                        pipe.execute_command(*command)
                    results = await pipe.execute(raise_on_error=False)
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - each caller gets it and translates it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            again: list[_Entry] = []
            for (command, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, NoScriptError):
                    again.append((command, future))
                elif isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            if again:
                await self._reload(again)

    async def _reload(self, entries: list[_Entry]) -> None:
        """Load the scripts that ``NOSCRIPT`` named and queue those commands again (they
        did not run); a script unknown here, or a failed load, fails them."""
        try:
            client = self._client()
            for sha in {command[1] for command, _ in entries}:
                source = self._script(sha)
                if source is None:
                    raise NoScriptError(f"NOSCRIPT: no script with SHA1 {sha!r} is known to this kv")
                await client.script_load(source)
        except asyncio.CancelledError:
            for _, future in entries:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each caller gets it and translates it
            for _, future in entries:
                if not future.done():
                    future.set_exception(exc)
            return
        self._queue[:0] = entries
