"""``SQLiteDurability``: the durability backend of :class:`~botmesh.sqlite_store.SQLiteStore`
(``SQLiteStore(...).durability()``, BACK table): :class:`~botmesh.core.kv_durability.KvDurability`
over :class:`~botmesh.sqlite_store.SQLiteKv`, journals in table ``durable`` (BACK-1).

It survives a crash (WAL, ``synchronous=FULL``) and may be shared by processes of one host
that open the same file (REPL-4); not across hosts (SQLite over a network file system
gives no working locks). Because of that sharing (``capabilities.multi_process``) a bot
without an explicit ``instance_id`` gets a per-boot suffix on it, as on PostgreSQL and
Redis (LEASE-3): two processes on one file never take each other's leases."""

from __future__ import annotations

from ..core.kv_durability import KvDurability
from .kv import SQLiteKv


class SQLiteDurability(KvDurability):
    """:class:`~botmesh.core.kv_durability.KvDurability` over an :class:`SQLiteKv`.

    With ``own_kv`` (default) ``start()`` opens the kv's connection and ``stop()`` closes
    it; the store's own connection is never touched. Usually built by
    :meth:`SQLiteStore.durability() <botmesh.sqlite_store.SQLiteStore.durability>`.
    """

    kv: SQLiteKv

    def __init__(self, kv: SQLiteKv, *, own_kv: bool = True, name: str | None = "sqlite") -> None:
        super().__init__(kv, own_kv=own_kv, name=name)

    @property
    def file(self) -> str:
        """The SQLite file holding the journals."""
        return self.kv.file

    def __repr__(self) -> str:
        return f"SQLiteDurability({self.kv.file!r}, name={self.name!r})"
