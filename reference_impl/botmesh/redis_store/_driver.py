"""What every Redis client of the backend tells the server about itself, which other
client options it takes (:func:`check_client_options`, :func:`check_connection_options`),
and how the clients it builds from a URL send a command (:func:`direct_send`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

from redis.exceptions import ConnectionError as DriverConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as DriverTimeoutError

from ..core.errors import ConfigError


@functools.lru_cache(maxsize=1)
def driver_options() -> dict[str, Any]:
    """The client metadata redis-py sends with ``CLIENT SETINFO`` (its name and version),
    made once per process and shared by every client: left to redis-py, each new client
    looks the version up in the installed package metadata again (~0.5 ms of parsing),
    which a crash cell paid for every client it opened. The same values are sent. Empty
    (redis-py's own default) for a redis-py without ``driver_info``."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:
        return {}
    return {"driver_info": DriverInfo()}


class _DirectSend:
    """Mixed into the connection class of the clients the backend builds from a URL
    (:func:`direct_send`): ``send_packed_command`` without a task per command.

    redis-py sends every command of a connection that has a ``socket_timeout`` (the
    backend's always have one) through ``asyncio.wait_for``, which wraps the write in a
    task of its own and takes two more turns of the event loop: about 30 us of CPU of
    the ~120 us a command costs the client (issue 16; the client's CPU is what bounds a
    message on Redis and a crash cell). Here a command is handed to the transport at
    once when the connection is open, no health check can be due (no
    ``health_check_interval``) and nothing waits in the transport's write buffer; only
    when the transport could not send all of it at once is the drain awaited, with the
    socket timeout, and a failure of it turned into redis-py's own ``TimeoutError`` or
    ``ConnectionError`` after dropping the connection, as redis-py does. Any other case
    takes redis-py's own path. A transport that already lost its connection takes the
    bytes silently; reading the reply then fails with redis-py's ``ConnectionError`` —
    an error either way, and the command was not sent twice."""

    lean_send = False
    """Marks the connections of the clients the backend builds from a URL: the
    auto-pipeline sends a lone command or a batch on one of them by hand
    (:func:`botmesh.redis_store._pipeline._lean_send`). Every class :func:`direct_send`
    makes sets it: True when the connection class has ``can_read`` (redis-py 8); a
    class without it (redis-py before 8, which has only ``can_read_destructive``) takes
    redis-py's own path."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        conn: Any = self  # (a redis-py connection: its attributes are untyped there)
        writer = getattr(conn, "_writer", None)
        transport = None if writer is None else writer.transport
        if (writer is None or transport is None or type(command) is not list
                or getattr(conn, "health_check_interval", None) != 0 or not getattr(conn, "is_connected", False)
                or transport.is_closing() or transport.get_write_buffer_size()):
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        try:
            transport.writelines(command)
            if transport.get_write_buffer_size():
                await asyncio.wait_for(writer.drain(), getattr(conn, "socket_timeout", None))
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise DriverTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await conn.disconnect(nowait=True)
            raise DriverConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            await conn.disconnect(nowait=True)
            raise


_DIRECT: dict[type, type] = {}


def direct_send(connection_class: type) -> type:
    """``connection_class`` (a redis-py asyncio connection class) with
    :class:`_DirectSend` mixed in, made once per class."""
    made = _DIRECT.get(connection_class)
    if made is None:
        made = _DIRECT[connection_class] = type(connection_class.__name__, (_DirectSend, connection_class),
                                                {"__module__": __name__,
                                                 "lean_send": hasattr(connection_class, "can_read")})
    return made


_RETRYING_OPTIONS = ("retry", "retry_on_error", "retry_on_timeout", "cluster_error_retry_attempts")
"""redis-py client options that make a client resend commands: refused in ``client_options``."""


def check_client_options(options: Any) -> dict[str, Any]:
    """``client_options`` (see :class:`RedisKv`) as a dict; :class:`ConfigError` naming
    the option (and the key at fault) for a value that is not a mapping of names, or a
    name that would make the client resend commands."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"client_options: expected a mapping of redis-py client options, got {options!r}",
                          option="client_options", value=options)
    for key in options:
        if not isinstance(key, str):
            raise ConfigError(f"client_options: option names are strings, got {key!r}", option="client_options",
                              value=key)
        if key in _RETRYING_OPTIONS:
            raise ConfigError(
                f"client_options: {key!r} is not allowed: the kv's client never resends a command by itself "
                "(a resent write may apply twice; a landed compare-and-set replayed becomes a false conflict)",
                option="client_options", value=key)
    return dict(options)


def options_refused(exc: BaseException, extra: Mapping[str, Any], where: str) -> ConfigError:
    """The error of a client redis-py would not build with ``client_options`` given: an
    option it does not take (or a value it refuses) is as likely as ``where`` (the URL or
    the cluster)."""
    return ConfigError(f"client_options or {where}: redis-py refused them ({exc}): client_options {sorted(extra)}",
                       option="client_options", value=extra)


def check_connection_options(client: Any, extra: Mapping[str, Any]) -> None:
    """Build (without connecting) one connection object of ``client``: redis-py takes any
    keyword at the client's construction and refuses an unknown one only at its first
    connect. Once per kv, at its construction."""
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError, RedisError) as exc:
        raise options_refused(exc, extra, "the URL") from exc
