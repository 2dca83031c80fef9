"""``botmesh.events``: an app's event journal in a file, usable as the bot's durability
backend (EVENTS-1 to EVENTS-6, REPL-4).

* :class:`EventRecord`, :class:`Lease` — the records (:mod:`.records`);
* :class:`FileEventJournal` — one process (``lock=True``: a pid lock);
  :class:`SharedFileEventJournal` — several processes of one host (a kernel mutex);
  both :class:`LeasedEventJournal` (:mod:`.journal` describes storage, group commit and
  locking);
* :class:`EventWorker` — processes the app's own records (never the bot's);
* :func:`events_durability` — the journal as a durability backend (:mod:`.durability`).
"""

from .durability import EventJournalKv, EventsDurability, events_durability
from .journal import FileEventJournal
from .shared import SharedFileEventJournal
from .records import (
    ANY_CHANNEL,
    BOT_CHANNEL,
    BOT_EVENT_TYPES,
    STATES,
    EventJournalError,
    EventRecord,
    Lease,
    LeasedEventJournal,
)
from .worker import EventWorker

__all__ = [
    "ANY_CHANNEL",
    "BOT_CHANNEL",
    "BOT_EVENT_TYPES",
    "STATES",
    "EventJournalError",
    "EventJournalKv",
    "EventRecord",
    "EventWorker",
    "EventsDurability",
    "FileEventJournal",
    "Lease",
    "LeasedEventJournal",
    "SharedFileEventJournal",
    "events_durability",
]
