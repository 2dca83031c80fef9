"""The ``botmesh.events`` harnesses: ``events`` (a ``FileEventJournal`` opened with
``lock=True``), ``events-shared`` and ``events-shared+log`` (a ``SharedFileEventJournal``,
snapshot only or with the append log), each wrapped by ``events_durability`` (EVENTS-1 to
EVENTS-6). Child processes (kill loops, power cuts, the multi-process suite) build the
same backend from a :class:`~botmesh_testkit.backends.base.FactorySpec` naming
:func:`child_backend` and the workdir."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from botmesh.core.fileio import FileIO
from botmesh.core.spi import Capabilities, DurableKv

from .base import FactorySpec, KillSpec
from .file import WorkdirJournalHarness

MODES: dict[str, tuple[bool, bool]] = {
    "events": (False, False),
    "events-shared": (True, False),
    "events-shared+log": (True, True),
}
"""Backend name -> (shared, append_log)."""

JOURNAL_FILE = "events.journal"
"""The journal's file name in the harness's workdir."""


async def _open_journal(path: str, name: str, io: FileIO | None = None) -> Any:
    from botmesh.events import FileEventJournal, SharedFileEventJournal

    shared, append_log = MODES[name]
    if shared:
        return await SharedFileEventJournal.open(path, append_log=append_log, io=io)
    return await FileEventJournal.open(path, lock=True, io=io)


async def child_backend(workdir: str, name: str) -> Any:
    """The backend of ``name`` on the journal in ``workdir``, for a child process (an
    ``EventsDurability``: the child's ``build_backend`` gives it a MemoryStore and calls
    its ``close()``, which closes the journal)."""
    from botmesh.events import events_durability

    return events_durability(journal=await _open_journal(os.path.join(workdir, JOURNAL_FILE), name))


class EventsHarness(WorkdirJournalHarness):
    """``events_durability`` over a journal in the workdir; the bot's store is a
    MemoryStore kept across the restart (it stands for a persistent store)."""

    def __init__(self, workdir: str | None = None, *, name: str = "events") -> None:
        super().__init__(workdir)
        if name not in MODES:
            raise ValueError(f"unknown events backend {name!r} (one of {', '.join(MODES)})")
        self.name = name
        self.shared, self.append_log = MODES[name]
        self.path = os.path.join(self.workdir, JOURNAL_FILE)
        self.backend: Any = None
        self.io: FileIO | None = None

    @property
    def capabilities(self) -> Capabilities:
        # fsync=True always; the shared journals serve several processes of one host.
        return Capabilities(survives_crash=True, multi_process=self.shared)

    async def _open(self) -> Any:
        from botmesh.events import events_durability

        return events_durability(journal=await _open_journal(self.path, self.name, self.io))

    def use_file_io(self, io: FileIO) -> bool:
        """The journals do all their data I/O through ``io`` (the shared journal's mutex
        and lock probes excepted: they hold no data)."""
        self.io = io
        return True

    def kill_spec(self) -> KillSpec | None:
        return FactorySpec("botmesh_testkit.backends.events:child_backend", (self.workdir, self.name))

    def kv_factory(self) -> Callable[[], DurableKv] | None:
        from botmesh.events import EventJournalKv

        path, shared, append_log = self.path + ".kv", self.shared, self.append_log
        return lambda: EventJournalKv.on_file(path, shared=shared, append_log=append_log)
