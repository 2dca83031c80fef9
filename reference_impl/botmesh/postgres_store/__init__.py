"""botmesh.postgres_store: the PostgreSQL durability backend (BACK table, BACK-2).

* :class:`PostgresDurability` — ``PostgresDurability(pool=... | connection_string=...,
  table_prefix="botmesh_", logger=None)``: the journals in table
  ``{table_prefix}durable``, created idempotently at start; survives a crash; shared by
  processes and hosts (REPL-4); per-boot ``instance_id`` suffix (LEASE-3).
* :class:`PostgresKv` — the :class:`botmesh.core.spi.DurableKv` under it.

Needs psycopg 3 and psycopg-pool (``pip install 'botmesh-testkit[postgres]'``); every
call is async (``psycopg.AsyncConnection`` from a ``psycopg_pool.AsyncConnectionPool``).
The design — table layout, single-statement compare-and-set, concurrent creation under an
advisory lock, detection of connections dropped while idle — is described in
:mod:`botmesh.postgres_store.kv`.
"""

try:
    import psycopg  # noqa: F401
    import psycopg_pool  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "botmesh.postgres_store needs psycopg 3 and psycopg-pool: pip install 'botmesh-testkit[postgres]' "
        f"({exc})"
    ) from exc

from .durability import PostgresDurability
from .kv import PostgresKv

__all__ = ["PostgresDurability", "PostgresKv"]
