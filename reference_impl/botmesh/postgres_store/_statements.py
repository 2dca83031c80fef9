"""The SQL of :class:`~botmesh.postgres_store.PostgresKv` (kept apart so that the kv's
module stays about the kv; the table and the statements are described there)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

__all__ = ["Statements", "statements_for"]


class Statements:
    """The SQL of one kv, composed once with :mod:`psycopg.sql` for the qualified table and
    rendered to strings (the same string each call, so psycopg prepares it server-side
    after a few uses)."""

    def __init__(self, table: sql.Identifier, context: psycopg.AsyncConnection[Any]) -> None:
        def render(template: str, **names: sql.Composable) -> str:
            return sql.SQL(template).format(table=table, **names).as_string(context)

        where = "scope = %s AND space = %s AND key = %s"
        self.get = render(f"SELECT value::text, version FROM {{table}} WHERE {where}")
        # Each write is ONE statement (one round trip): the change in a data-modifying
        # CTE, then either its row (value NULL: written) or, when nothing was written,
        # the record as the statement's snapshot saw it (value and version), so that a
        # conflict needs no second statement (see "Atomicity" in the module docstring).
        found = (
            " SELECT w.version, NULL::text FROM w UNION ALL"
            " SELECT c.version, c.value::text FROM {table} c"
            " WHERE c.scope = %s AND c.space = %s AND c.key = %s AND NOT EXISTS (SELECT FROM w)"
        )
        self.insert = render(
            "WITH w AS (INSERT INTO {table} (scope, space, key, value, version, due, expires)"
            " VALUES (%s, %s, %s, %s::json, 1, %s, %s)"
            " ON CONFLICT (scope, space, key) DO NOTHING RETURNING version)" + found
        )
        self.update = render(
            "WITH w AS (UPDATE {table} SET value = %s::json, version = version + 1, due = %s, expires = %s"
            f" WHERE {where} AND version = %s RETURNING version)" + found
        )
        self.delete = render(f"WITH w AS (DELETE FROM {{table}} WHERE {where} AND version = %s RETURNING version)" + found)
        self.range: dict[tuple[str, bool], str] = {}
        for column in ("due", "expires"):
            for limited in (False, True):
                self.range[column, limited] = render(
                    "SELECT {column}, key FROM {table} WHERE scope = %s AND space = %s AND {column} <= %s"
                    " ORDER BY {column}, key" + (" LIMIT %s" if limited else ""),
                    column=sql.Identifier(column),
                )
        # two limited range reads in one statement (DurableKv.ranges: the sweep's read of
        # both journals' due indexes), each row tagged with its read
        self.ranges: dict[tuple[str, str], str] = {}
        for first in ("due", "expires"):
            for second in ("due", "expires"):
                self.ranges[first, second] = render(
                    "SELECT r, s, key FROM ("
                    "(SELECT 0 AS r, {first} AS s, key FROM {table} WHERE scope = %s AND space = %s AND {first} <= %s"
                    " ORDER BY {first}, key LIMIT %s) UNION ALL "
                    "(SELECT 1, {second}, key FROM {table} WHERE scope = %s AND space = %s AND {second} <= %s"
                    " ORDER BY {second}, key LIMIT %s)) AS both_reads ORDER BY r, s, key",
                    first=sql.Identifier(first), second=sql.Identifier(second),
                )
        self.scan: dict[tuple[bool, bool], str] = {}
        for after in (False, True):
            for limited in (False, True):
                self.scan[after, limited] = render(
                    "SELECT key, value::text, version FROM {table} WHERE scope = %s AND space = %s"
                    + (" AND key > %s" if after else "")
                    + " ORDER BY key"
                    + (" LIMIT %s" if limited else "")
                )


_MADE: dict[tuple[str, str, str], Statements] = {}
_MADE_MAX = 64
"""Statements composed so far, by ``(schema, table, client encoding)``: at most
:data:`_MADE_MAX`, the oldest dropped first."""


def statements_for(schema: str, table: str, context: psycopg.AsyncConnection[Any]) -> Statements:
    """The statements of table ``schema.table``, composed once per process for every kv
    on that table (the strings are the same each time: composing them again cost each
    opening a tenth of a millisecond); ``context`` is a connection whose client encoding
    quotes the names."""
    key = (schema, table, context.info.encoding)
    made = _MADE.get(key)
    if made is None:
        if len(_MADE) >= _MADE_MAX:
            del _MADE[next(iter(_MADE))]
        made = _MADE[key] = Statements(sql.Identifier(schema, table), context)
    return made
