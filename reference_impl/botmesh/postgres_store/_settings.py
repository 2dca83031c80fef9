"""The server settings an acknowledged commit's survival of a power cut rests on, as
:meth:`PostgresKv.durability_settings <botmesh.postgres_store.PostgresKv.durability_settings>`
reads them (kept apart so that the kv's module stays about the kv)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

DURABILITY_SETTINGS = ("fsync", "synchronous_commit", "full_page_writes")
"""``fsync`` (WAL flushed at all), ``synchronous_commit`` (flushed before the commit is
acknowledged), ``full_page_writes`` (a page torn by a power cut can be repaired)."""


async def show_settings(conn: psycopg.AsyncConnection[Any]) -> dict[str, str]:
    """``SHOW`` of each of :data:`DURABILITY_SETTINGS` on ``conn``: the values of *this
    session* (a ``synchronous_commit`` set by the connection string's ``options``, the
    role or the database counts), as text."""
    found: dict[str, str] = {}
    for name in DURABILITY_SETTINGS:
        cursor = await conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name)))
        row = await cursor.fetchone()
        if row is not None:
            found[name] = str(row[0])
    return found
