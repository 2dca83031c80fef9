"""``PostgresDurability``: the PostgreSQL durability backend (BACK table, BACK-2) —
:class:`~botmesh.core.kv_durability.KvDurability` over :class:`~botmesh.postgres_store.PostgresKv`.

It survives a crash (every acknowledged write is a committed single-statement
transaction on the server) and may be shared by any number of processes on any number of
hosts (REPL-4): claims are compare-and-set statements the server serialises, so they stay
exclusive across all of them. Its capabilities say ``shared=True``, so a bot without an
explicit ``instance_id`` gets the per-boot suffix of LEASE-3 (handled by the engine for
every shared backend).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from ..core.kv_durability import KvDurability
from ._config import (
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    DEFAULT_QUERY_TIMEOUT_S,
    DEFAULT_TABLE_PREFIX,
    DEFAULT_TIMEOUT_S,
)
from .kv import PostgresKv

__all__ = ["PostgresDurability"]


class PostgresDurability(KvDurability):
    """Journals in table ``{table_prefix}durable`` of a PostgreSQL database (BACK-2).

    ``PostgresDurability(pool=... | connection_string=..., table_prefix="botmesh_",
    logger=None)``:

    * ``connection_string`` — the backend creates its own
      :class:`psycopg_pool.AsyncConnectionPool` (``min_size`` .. ``max_size``
      connections) at ``start()`` and closes it at ``stop()``;
    * ``pool`` — an open ``AsyncConnectionPool`` that belongs to the caller: used, never
      opened nor closed here.

    ``start()`` creates the table and its indexes when they are missing — safely when
    several processes start at once. A connection the server dropped while idle (restart,
    failover, ``pg_terminate_backend``) is reported to ``logger.error`` (default
    ``logging.getLogger("botmesh.postgres")``) and replaced before the next query runs.
    A call that gets no answer within ``query_timeout`` seconds (default 30; ``None``: no
    limit) — a partitioned or frozen server — fails with ``BackendUnavailableError``
    instead of hanging; its connection is cut, reported and replaced. ``timeout`` bounds
    the wait for a connection from the pool. ``connection_class`` (optional) is the
    :class:`psycopg.AsyncConnection` subclass an own pool connects with.
    ``table_prefix`` must be 1 to 41 ASCII letters, digits or ``_`` not starting with a
    digit; ``schema`` (optional) places the table in that schema instead of the
    connection's ``search_path``. Bad options raise
    :class:`~botmesh.core.errors.ConfigError` naming the option. See
    :mod:`botmesh.postgres_store.kv` for the table and the SQL.
    """

    kv: PostgresKv

    def __init__(
        self,
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        connection_string: str | None = None,
        table_prefix: str = DEFAULT_TABLE_PREFIX,
        schema: str | None = None,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
        min_size: int = DEFAULT_MIN_SIZE,
        max_size: int = DEFAULT_MAX_SIZE,
        timeout: float = DEFAULT_TIMEOUT_S,
        query_timeout: float | None = DEFAULT_QUERY_TIMEOUT_S,
        connection_class: type[psycopg.AsyncConnection[Any]] | None = None,
        name: str = "postgres",
    ) -> None:
        kv = PostgresKv(
            pool=pool,
            connection_string=connection_string,
            table_prefix=table_prefix,
            schema=schema,
            logger=logger,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            query_timeout=query_timeout,
            connection_class=connection_class,
        )
        super().__init__(kv, own_kv=True, name=name)

    @property
    def table(self) -> str:
        """The journals' table, unqualified: ``{table_prefix}durable``."""
        return self.kv.table

    @property
    def owns_pool(self) -> bool:
        """True with ``connection_string`` (the pool is created at start, closed at stop)."""
        return self.kv.owns_pool

    def abandon(self, *, keep_idle: Callable[[Any], bool] | None = None) -> asyncio.Task[None] | None:
        """TEST ONLY: simulate the death of this process (see :meth:`PostgresKv.abandon`,
        and its ``keep_idle``)."""
        return self.kv.abandon(keep_idle=keep_idle)

    def __repr__(self) -> str:
        return f"PostgresDurability({self.kv!r}, name={self.name!r})"
