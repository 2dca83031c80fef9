"""botmesh.sqlite_store: a persistent store in one SQLite file, and the durability backend
that keeps the journals in the same file (BACK-1, table ``durable``).

* :class:`SQLiteStore` — a :class:`botmesh.core.store.Store` (values and message log).
* :meth:`SQLiteStore.durability` — a :class:`SQLiteDurability` on the same file.
* :class:`SQLiteKv` — the :class:`botmesh.core.spi.DurableKv` under it.

Only the standard library's :mod:`sqlite3` is used. The file runs in WAL mode with
``synchronous=FULL``: every acknowledged write survives a crash of the process and a power
cut. Several processes of one host may share the file (REPL-4); calls run synchronously
inside the coroutines (see :mod:`botmesh.sqlite_store.kv` for why).
"""

from .durability import SQLiteDurability
from .kv import SQLiteKv
from .store import SQLiteStore

__all__ = ["SQLiteDurability", "SQLiteKv", "SQLiteStore"]
