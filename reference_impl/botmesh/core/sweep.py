"""The machinery of the engine's background sweep that is not recovery logic itself:
the replay task, the purge schedule (OPS-3) and the default ``instance_id`` (LEASE-3).
:class:`~botmesh.core.engine.DurabilityRuntime` drives them; what a replay or a delivery
*does* stays in the engine.

Choices where the spec is silent (also in the README):

* **Replays never block sends.** The sweep hands each due inbound record to the replay
  task (:class:`Replays`) and goes on to the due sends; a replayed handler that takes
  minutes delays neither a due send nor the next pass. The replays themselves run one at
  a time, in due order, on purpose: when a replay kills the process, only the record in
  flight is charged an execution, so INB-7 sends the record that kills (and only that
  one) to the DLQ — concurrent replays would charge every record in flight with it, and
  dead-letter innocent messages alongside a poisonous one. It also keeps each chat's
  records in order (a flow's answers).
* **Purging keeps up.** Expired records are deleted in batches of :data:`PURGE_BATCH`
  per journal, up to :data:`PURGE_BATCHES_PER_PASS` batches per pass; a journal that has
  more is purged again at the next pass instead of the next purge period.
* **LEASE-3 on SQLite.** A backend that several live processes may use at once —
  ``shared`` (PostgreSQL, Redis) or ``multi_process`` (SQLite) — gives the default
  ``instance_id`` a per-boot suffix, rather than refusing a second process.
"""

from __future__ import annotations

import collections
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .backend import DurabilityBackend
from .spi_types import Capabilities

PURGE_BATCH = 500
"""Records a purge deletes per journal and call (OPS-3)."""

PURGE_BATCHES_PER_PASS = 8
"""Purge calls per journal in one pass: up to 4000 records a journal per ``poll_ms``
when behind."""

PURGE_PERIOD_MS = 60_000.0
"""Purging is a write: once a minute (or once per retention, when shorter) is plenty for
a retention measured in days, unless a journal is behind."""


def default_instance_id(bot_id: str, connection_id: str, capabilities: Capabilities) -> str:
    """LEASE-3: ``<hostname>/<bot_id>/<connection_id>``, plus a per-boot suffix (8 hex
    digits, new for every runtime) on a backend that several live processes may use at
    once: a shared one (PostgreSQL, Redis) and one of several processes of a host
    (``multi_process``: SQLite). Two processes with the default id then never take each
    other's leases (LEASE-5); a restart, under a new suffix, waits for the old leases to
    expire instead of taking them back at once (LEASE-4 needs an explicit, stable
    ``instance_id``). A single-process backend (memory, file — whose pid lock refuses a
    second process) keeps the plain id."""
    base = f"{socket.gethostname()}/{bot_id}/{connection_id}"
    if capabilities.shared or capabilities.multi_process:
        return f"{base}/{uuid.uuid4().hex[:8]}"
    return base


Replay = Callable[[str, bool], Awaitable[None]]
"""``replay(id, recover)``: claim and run one due inbound record (in ``clock.busy()``)."""

Failed = Callable[[str, bool, Exception], Awaitable[None]]
"""``failed(id, recover, error)``: a replay raised."""


class Replays:
    """The due inbound records the sweep handed on, replayed one at a time in the order
    they were handed on, by one task (started when there is work, ended when there is
    none).

    ``spawn`` starts a task the runtime owns (and cancels when it stops or dies);
    ``replay`` claims and runs a record; ``failed`` reports a replay that raised (the
    next record is replayed all the same).
    """

    def __init__(self, spawn: Callable[[Awaitable[Any]], object], replay: Replay, failed: Failed) -> None:
        self._spawn = spawn
        self._replay = replay
        self._failed = failed
        self._queue: collections.deque[tuple[str, bool]] = collections.deque()
        self._ids: set[str] = set()

    def reset(self) -> None:
        """Forget the queue (a new start: the old task is gone)."""
        self._queue = collections.deque()
        self._ids = set()

    def __contains__(self, id: object) -> bool:
        """True while ``id`` is queued or being replayed here."""
        return id in self._ids

    def add(self, id: str, *, recover: bool) -> None:
        """Queue ``id`` behind the records handed on before it."""
        self._ids.add(id)
        self._queue.append((id, recover))
        if len(self._queue) == 1:
            self._spawn(self._run(self._queue, self._ids))

    async def _run(self, queue: collections.deque[tuple[str, bool]], ids: set[str]) -> None:
        # the queue and the set of this start: a reset() gives a new task new ones
        try:
            while queue:
                id, recover = queue[0]
                try:
                    await self._replay(id, recover)
                except Exception as exc:
                    await self._failed(id, recover, exc)
                queue.popleft()
                ids.discard(id)
        finally:
            ids.difference_update(i for i, _ in queue)
            queue.clear()


PurgeFailed = Callable[[str, Exception], Awaitable[None]]
"""``failed(journal, error)``: a purge call raised."""


class Purger:
    """OPS-3: when (and how much) the sweep purges. :meth:`run` is called at every pass
    and purges when the period has come."""

    def __init__(self, failed: PurgeFailed) -> None:
        self.next_at = 0.0
        self._failed = failed

    async def run(self, backend: DurabilityBackend, scope: str, now: Callable[[], float], retention_ms: float) -> None:
        """Delete the ``done``/``sent`` records past their retention, in batches; a
        journal with more than one pass deletes is purged again at the next pass. A
        purge call that raises is reported through ``failed`` (the other journal is
        purged all the same)."""
        if retention_ms <= 0 or now() < self.next_at:
            return
        self.next_at = now() + min(PURGE_PERIOD_MS, retention_ms)
        behind = False
        for name, purge in (("inbox", backend.inbox_purge), ("outbox", backend.outbox_purge)):
            try:
                for _ in range(PURGE_BATCHES_PER_PASS):
                    if await purge(scope, now=now(), limit=PURGE_BATCH) < PURGE_BATCH:
                        break
                else:
                    behind = True
            except Exception as exc:
                await self._failed(name, exc)
        if behind:
            self.next_at = now()
