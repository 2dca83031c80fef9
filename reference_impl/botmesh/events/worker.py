"""``EventWorker``: processes an app's own records of an event journal.

It claims records **without a channel** only (EVENTS-1: a claim without a channel never
takes the bot's records, which live in channel ``"botwa:durable"``), keeps its lease alive
with heartbeats while the handler runs, and completes the record — or fails it, with a
retry after ``retry_ms`` until ``max_attempts`` claims were spent, then ``dead``. Every
call is checked against the lease's fencing token: a worker whose lease was taken by
another (it stalled past ``lease_ms``) changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .journal import wall_ms
from .records import EventRecord, LeasedEventJournal, check_lease_ms

__all__ = ["EventWorker"]

logger = logging.getLogger("botmesh.events")

Handler = Callable[[EventRecord], Awaitable[Any]]


class EventWorker:
    """``EventWorker(journal, handler, owner=..., lease_ms=...)``. :meth:`run_once`
    processes one record (True when there was one); :meth:`run` loops until :meth:`stop`.

    * ``owner`` — the lease owner (default ``"<host pid>/<random>"``);
    * ``lease_ms`` (30 000) — the lease; a heartbeat extends it every ``lease_ms / 3``;
    * ``retry_ms`` (1 000) — a failed record is claimable again after it;
    * ``max_attempts`` (5) — a record that failed on its last attempt goes ``dead``;
    * ``idle_ms`` (200) — :meth:`run` sleeps this long when there is nothing to claim.
    """

    def __init__(self, journal: LeasedEventJournal, handler: Handler, *, owner: str | None = None,
                 lease_ms: float = 30_000, retry_ms: float = 1_000, max_attempts: int = 5, idle_ms: float = 200) -> None:
        if not isinstance(journal, LeasedEventJournal):
            raise TypeError(f"journal must be a LeasedEventJournal, got {type(journal).__name__}")
        if not callable(handler):
            raise TypeError(f"handler must be an async callable, got {handler!r}")
        self.journal = journal
        self.handler = handler
        self.owner = owner or f"{os.uname().nodename}:{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.lease_ms = check_lease_ms(lease_ms)
        self.retry_ms = check_lease_ms(retry_ms)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int from 1, got {max_attempts!r}")
        self.max_attempts = max_attempts
        self.idle_ms = check_lease_ms(idle_ms)
        self._stopping = asyncio.Event()
        self.processed = 0
        self.failed = 0

    async def run_once(self) -> bool:
        """Claim one record without a channel and process it. False when none was
        claimable."""
        rec = await self.journal.claim(self.owner, self.lease_ms, channel=None)
        if rec is None:
            return False
        assert rec.lease is not None
        token = rec.lease.token
        beat = asyncio.get_running_loop().create_task(self._heartbeat(rec.id, token))
        try:
            await self.handler(rec)
        except Exception as exc:  # the handler's failure is the record's, not the worker's
            self.failed += 1
            dead = rec.attempts >= self.max_attempts
            logger.warning("event %s failed (attempt %d%s): %r", rec.id, rec.attempts, ", dead" if dead else "", exc)
            await self.journal.fail(rec.id, token, repr(exc), retry_at=None if dead else wall_ms() + self.retry_ms,
                                    dead=dead)
            return True
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        if not await self.journal.complete(rec.id, token):
            logger.warning("event %s: the lease was lost before completion (another worker took it)", rec.id)
        else:
            self.processed += 1
        return True

    async def _heartbeat(self, id: str, token: int) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            if not await self.journal.heartbeat(id, token, self.lease_ms):
                return

    async def run(self) -> None:
        """Process records until :meth:`stop`."""
        self._stopping.clear()
        while not self._stopping.is_set():
            if not await self.run_once():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.idle_ms / 1000)

    def stop(self) -> None:
        """Make :meth:`run` return after the record in hand."""
        self._stopping.set()
