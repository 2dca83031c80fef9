"""Group commit: concurrent writes of one embedded store share one durable flush.

Used by the file journal (:class:`~botmesh.core.file_kv.FileKv`: the group's lines in
one append and one ``fsync`` per 4 KiB page of log, not one per write), the SQLite kv
(:class:`~botmesh.sqlite_store.SQLiteKv`: one transaction, one ``COMMIT``) and the SQLite
store's writes
(:class:`~botmesh.sqlite_store.SQLiteStore`: its own transaction, one ``COMMIT``).
Without it every write of every chat pays its own fsync; with it the writes that are
ready at the same moment — typically one per chat being served — pay one between them.

How a write goes (:meth:`GroupCommit.submit`):

1. **Per key, one write at a time.** A write whose key already has a write in flight
   waits until that one has settled (landed or failed), so a compare-and-set is always
   checked against *durable* state: two writers of one key never both win, and no
   writer is told "conflict" because of a write that then failed.
2. **Check and enqueue, atomically.** ``prepare()`` runs with no suspension point before
   the item joins the open group: the caller checks its version there (the file kv) or
   just builds its item (SQLite checks inside the transaction). An exception from
   ``prepare()`` (a ``VersionConflict``) is raised to the caller and nothing is queued.
3. **The first writer of a group leads it.** It lets the event loop run
   (``asyncio.sleep(0)``) for as long as each turn brings new writers — other chats
   reaching their own write — up to :attr:`GroupCommit.max_items`, then closes the
   group and calls ``flush(items)`` once. It takes no turn when nothing else could run
   (:func:`~botmesh.core.turns.others_runnable`): a lone writer — nothing queued,
   nothing else runnable — is flushed at once, as a group of one. A write that arrives
   after the group closed joins the next one.
4. **Settled together.** ``flush`` returns one result per item (an exception instance
   for an item that failed on its own, e.g. a lost compare-and-set); each writer's
   ``submit`` returns or raises its own only after ``flush`` returned, i.e. after the
   group is durable. When ``flush`` raises, **every** item of the group gets that error:
   no write of a failed group is acknowledged, and the backend's ``flush`` leaves its
   in-memory state without any of them.

``flush`` is synchronous and runs on the event loop's thread, like every other I/O of
these two backends (docstrings of :mod:`botmesh.core.fileio` and
:mod:`botmesh.sqlite_store.kv`): a run in virtual time stays deterministic — which
writes form a group depends only on the order tasks run in, never on how long an fsync
took — and a lone writer pays no thread hand-over. The price: the loop is blocked during
the flush, so a group gathers the writers that are ready *before* it is flushed, not
those that would have come during the fsync.

Cancellation: a leader cancelled while gathering still flushes its group (its own item
included) before the ``CancelledError`` goes on, so the other writers are never left
waiting; a cancelled follower's item is flushed all the same (its outcome is then
unknown to it, as for any write whose caller gave up).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from .turns import others_runnable

__all__ = ["DEFAULT_MAX_ITEMS", "GroupCommit"]

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_MAX_ITEMS = 256
"""The most writes one group takes (a bound on one flush's size and latency)."""


class _Group(Generic[T, R]):
    __slots__ = ("done", "futures", "items", "keys")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: list[T] = []
        self.futures: list[asyncio.Future[R]] = []
        self.keys: list[Hashable] = []
        self.done: asyncio.Future[None] = loop.create_future()


class GroupCommit(Generic[T, R]):
    """Batches concurrent writes into one call of ``flush`` (module docstring).

    ``flush(items)`` must make every item durable at once and return one result per item
    in order (an exception *instance* for an item that failed alone), or raise to fail
    them all. ``max_items`` bounds a group."""

    def __init__(self, flush: Callable[[list[T]], Sequence[R | BaseException]], *,
                 max_items: int = DEFAULT_MAX_ITEMS) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items!r}")
        self._flush = flush
        self.max_items = max_items
        self._open: _Group[T, R] | None = None  # the group writers join now
        self._inflight: dict[Hashable, asyncio.Future[None]] = {}  # key -> its group's `done`
        self.groups = 0
        """Groups flushed so far (for tests and benchmarks)."""
        self.items = 0
        """Items flushed so far."""

    async def submit(self, key: Hashable, prepare: Callable[[], T]) -> R:
        """Queue the item ``prepare()`` builds for ``key`` (after any write of ``key`` in
        flight has settled) and return its result once its group is durable; raise its
        own error, or the group's."""
        while (busy := self._inflight.get(key)) is not None:
            await asyncio.wait([busy])
        item = prepare()  # may raise: then nothing is queued
        if not self._inflight and not others_runnable():
            # Nothing queued and nothing else could run: the group would be this item
            # alone, flushed at once (see _lead) — flushed here without its bookkeeping.
            return self._flush_alone(item)
        loop = asyncio.get_running_loop()
        group = self._open
        lead = group is None
        if group is None:
            group = self._open = _Group(loop)
        future: asyncio.Future[R] = loop.create_future()
        group.items.append(item)
        group.futures.append(future)
        group.keys.append(key)
        self._inflight[key] = group.done
        if lead:
            try:
                await self._lead(group)
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: the caller gets its cancellation instead
                raise
        elif len(group.items) >= self.max_items and self._open is group:
            self._open = None  # full: the next writer starts a new group
        return await future

    async def _lead(self, group: _Group[T, R]) -> None:
        try:
            # Gather: let the loop run while each turn brings new writers.
            # Only while a turn could bring one (turns.others_runnable): a lone writer
            # with nothing else runnable is flushed at once, without a loop turn.
            while len(group.items) < self.max_items and self._open is group and others_runnable():
                before = len(group.items)
                await asyncio.sleep(0)
                if len(group.items) == before:
                    break
        finally:
            if self._open is group:
                self._open = None
            self._settle(group)

    def _flushed(self, items: list[T]) -> Sequence[R | BaseException]:
        """``flush(items)``: its results, one per item (else ``RuntimeError``), counted."""
        results = self._flush(items)
        if len(results) != len(items):
            raise RuntimeError(f"group commit: flush returned {len(results)} results for {len(items)} items")
        self.groups += 1
        self.items += len(items)
        return results

    def _flush_alone(self, item: T) -> R:
        """A group of ``item`` alone, flushed now: its result, or its error raised."""
        result = self._flushed([item])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _settle(self, group: _Group[T, R]) -> None:
        try:
            try:
                results = self._flushed(group.items)
            except BaseException as exc:  # every write of the group fails with it
                for future in group.futures:
                    if not future.done():
                        future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            for future, result in zip(group.futures, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        finally:
            for key in group.keys:
                if self._inflight.get(key) is group.done:
                    del self._inflight[key]
            group.done.set_result(None)
