"""Validation of the options of :class:`~botmesh.postgres_store.PostgresDurability` and
:class:`~botmesh.postgres_store.PostgresKv`.

Every bad value raises :class:`~botmesh.core.errors.ConfigError` whose ``option`` names
the constructor argument at fault and whose ``value`` is the value given (except for
``connection_string``, whose text may carry a password and is never copied into an
error).

Identifiers (``table_prefix``, ``schema``) are restricted to ASCII letters, digits and
``_``, starting with a letter or ``_``: nothing a caller gives can reach SQL unquoted,
and the names stay short enough for PostgreSQL's 63-byte identifier limit once the
suffixes (``durable``, ``durable_expires``) are added. They are still composed with
:class:`psycopg.sql.Identifier` (quoted, case kept) everywhere.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from ..core.errors import ConfigError

TABLE_PREFIX_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")
"""What ``table_prefix`` must match in full: 1 to 41 characters (the longest derived name,
``<prefix>durable_expires``, then stays within 63 bytes)."""

SCHEMA_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
"""What ``schema`` must match in full."""

DEFAULT_TABLE_PREFIX = "botmesh_"
DEFAULT_LOGGER_NAME = "botmesh.postgres"
DEFAULT_MIN_SIZE = 1
DEFAULT_MAX_SIZE = 10
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_QUERY_TIMEOUT_S = 30.0


def check_table_prefix(table_prefix: Any) -> str:
    """``table_prefix``: a ``str`` matching :data:`TABLE_PREFIX_PATTERN` in full."""
    if not isinstance(table_prefix, str) or TABLE_PREFIX_PATTERN.fullmatch(table_prefix) is None:
        raise ConfigError(
            "option 'table_prefix' must be a str of 1 to 41 ASCII letters, digits or '_', not starting "
            f"with a digit (it names the table '<table_prefix>durable'); got {table_prefix!r}",
            option="table_prefix",
            value=table_prefix,
        )
    return table_prefix


def check_schema(schema: Any) -> str | None:
    """``schema``: None (the connection's ``search_path`` decides) or an identifier
    matching :data:`SCHEMA_PATTERN` in full."""
    if schema is None:
        return None
    if not isinstance(schema, str) or SCHEMA_PATTERN.fullmatch(schema) is None:
        raise ConfigError(
            "option 'schema' must be None or a str of 1 to 63 ASCII letters, digits or '_', not starting "
            f"with a digit; got {schema!r}",
            option="schema",
            value=schema,
        )
    return schema


def check_source(pool: Any, connection_string: Any) -> None:
    """Exactly one of ``pool`` (a :class:`psycopg_pool.AsyncConnectionPool`) and
    ``connection_string`` (a non-empty ``str`` libpq accepts: URL or ``key=value``)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict
    from psycopg_pool import AsyncConnectionPool

    if (pool is None) == (connection_string is None):
        given = "both" if pool is not None else "neither"
        raise ConfigError(
            f"give exactly one of 'pool' (an AsyncConnectionPool you own) and 'connection_string' "
            f"(a pool is created, and closed at stop); got {given}",
            option="pool" if pool is not None else "connection_string",
            value=None,
        )
    if pool is not None and not isinstance(pool, AsyncConnectionPool):
        raise ConfigError(
            f"option 'pool' must be a psycopg_pool.AsyncConnectionPool, got {type(pool).__name__}",
            option="pool",
            value=pool,
        )
    if connection_string is not None:
        if not isinstance(connection_string, str) or not connection_string.strip():
            got = "an empty str" if isinstance(connection_string, str) else type(connection_string).__name__
            raise ConfigError(
                "option 'connection_string' must be a non-empty str (a postgresql:// URL or libpq "
                f"key=value string), got {got}",
                option="connection_string",
                value=None if isinstance(connection_string, str) else type(connection_string).__name__,
            )
        try:
            conninfo_to_dict(connection_string)
        except ProgrammingError as exc:
            # psycopg's message names the syntax problem, not the password.
            raise ConfigError(
                f"option 'connection_string' is not a valid libpq connection string: {exc}",
                option="connection_string",
                value=None,
            ) from None


def check_connection_class(connection_class: Any, pool: Any) -> Any:
    """``connection_class``: None (psycopg-pool's default), or a subclass of
    :class:`psycopg.AsyncConnection` the kv's own pool makes its connections with; only
    with ``connection_string`` (an injected pool has its own)."""
    from psycopg import AsyncConnection

    if connection_class is None:
        return None
    if not isinstance(connection_class, type) or not issubclass(connection_class, AsyncConnection):
        raise ConfigError(
            "option 'connection_class' must be None or a subclass of psycopg.AsyncConnection, "
            f"got {connection_class!r}",
            option="connection_class",
            value=connection_class,
        )
    if pool is not None:
        raise ConfigError(
            "option 'connection_class' applies to the pool the kv creates (connection_string), "
            "not to an injected pool: give the pool its connection_class instead",
            option="connection_class",
            value=connection_class,
        )
    return connection_class


def check_pool_sizes(min_size: Any, max_size: Any) -> tuple[int, int]:
    """``min_size`` (int >= 0) and ``max_size`` (int >= max(1, min_size)) of an own pool."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ConfigError(f"option 'min_size' must be an int >= 0, got {min_size!r}", option="min_size", value=min_size)
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < max(1, min_size):
        raise ConfigError(
            f"option 'max_size' must be an int >= 1 and >= min_size ({min_size}), got {max_size!r}",
            option="max_size",
            value=max_size,
        )
    return min_size, max_size


def _is_seconds(value: Any) -> bool:
    """A finite number > 0 (``bool`` is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_timeout(timeout: Any) -> float:
    """``timeout``: seconds (a finite number > 0)."""
    if not _is_seconds(timeout):
        raise ConfigError(
            f"option 'timeout' must be a finite number of seconds > 0, got {timeout!r}", option="timeout", value=timeout
        )
    return float(timeout)


def check_query_timeout(query_timeout: Any) -> float | None:
    """``query_timeout``: None (wait for the server as long as it takes) or seconds (a
    finite number > 0)."""
    if query_timeout is None:
        return None
    if not _is_seconds(query_timeout):
        raise ConfigError(
            f"option 'query_timeout' must be None or a finite number of seconds > 0, got {query_timeout!r}",
            option="query_timeout",
            value=query_timeout,
        )
    return float(query_timeout)


def check_logger(logger: Any) -> logging.Logger | logging.LoggerAdapter[Any]:
    """``logger``: None (``logging.getLogger("botmesh.postgres")``), a
    :class:`logging.Logger` or a :class:`logging.LoggerAdapter`."""
    if logger is None:
        return logging.getLogger(DEFAULT_LOGGER_NAME)
    if not isinstance(logger, (logging.Logger, logging.LoggerAdapter)):
        raise ConfigError(
            f"option 'logger' must be a logging.Logger (or LoggerAdapter), got {type(logger).__name__}",
            option="logger",
            value=logger,
        )
    return logger
