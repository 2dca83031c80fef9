"""What :meth:`PostgresKv.abandon <botmesh.postgres_store.PostgresKv.abandon>` (TEST
ONLY: the simulated death of the process) does to the kv's own pool, kept apart so that
the kv's module stays about the kv: its connections dropped at once, the idle ones
optionally handed to the caller first, and the pool's tasks stopped in the background."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg_pool import AsyncConnectionPool

Conn = psycopg.AsyncConnection[Any]
Pool = AsyncConnectionPool[Any]

ABANDONED: set[asyncio.Task[None]] = set()
"""Pools of abandoned kvs being closed in the background."""


def drop_connections(connections: weakref.WeakSet[Conn]) -> None:
    """Close every connection of ``connections`` at once, without a round trip or the event
    loop (libpq ``PQfinish``): what the death of the process does to them."""
    for conn in list(connections):
        with contextlib.suppress(Exception):
            if not conn.closed:
                conn.pgconn.finish()
    connections.clear()


def session_idle(pgconn: Any) -> bool:
    """Whether the libpq connection ``pgconn`` is connected and its session has no
    transaction open: a session another incarnation may take over."""
    return bool(pgconn.status == ConnStatus.OK and pgconn.transaction_status == TransactionStatus.IDLE)


def hand_over_idle(pool: Pool, connections: weakref.WeakSet[Conn], keep: Callable[[Conn], bool]) -> None:
    """Offer ``keep`` each connection lying idle in ``pool`` — returned to it, so no call
    of the kv is using it, and its session has no transaction open — and take each one it
    accepts out of the pool and out of ``connections``: neither the death
    (:func:`drop_connections`) nor the pool's close will end it; it belongs to the
    caller. A connection checked out of the pool (a call in flight, or a transaction
    open) is never offered.

    The pool's idle connections are psycopg-pool's internal queue; a psycopg-pool
    without it (another version) offers none, and every connection dies as before."""
    idle = getattr(pool, "_pool", None)
    if not isinstance(idle, collections.deque):
        return
    for conn in list(idle):
        if not conn.closed and session_idle(conn.pgconn) and keep(conn):
            idle.remove(conn)
            connections.discard(conn)


async def close_pool_quietly(pool: Pool) -> None:
    with contextlib.suppress(Exception):
        await pool.close(timeout=1.0)


async def finish_abandoned() -> None:
    """Wait until the pools of kvs abandoned on this event loop are closed."""
    loop = asyncio.get_running_loop()
    for task in [t for t in ABANDONED if t.get_loop().is_closed()]:
        ABANDONED.discard(task)
    pending = [t for t in ABANDONED if t.get_loop() is loop and not t.done()]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
