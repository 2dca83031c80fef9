"""botmesh.redis_store: the Redis durability backend (BACK table, BACK-3, REPL-4).

* :class:`RedisDurability` — ``RedisDurability(client=... | url=... | cluster=...,
  prefix="botmesh", logger=None)``, a :class:`~botmesh.core.kv_durability.KvDurability`.
* :class:`RedisKv` — the :class:`~botmesh.core.spi.DurableKv` under it: every write is
  one Lua script (compare-and-set of the record and both ordered indexes, atomic in
  the server); keys under ``<prefix>:{durable:<space>:<scope>}`` so that one scope's
  journal sits in one Redis Cluster slot.

Requires redis-py (``pip install 'botmesh-testkit[redis]'``), asyncio API. Design notes
(key layout, scope encoding, why no client may retry a write, what ``survives_crash``
needs from the server) are in :mod:`botmesh.redis_store.kv`.
"""

from .durability import RedisDurability
from .kv import RedisKv, check_prefix, client_retries, key_pattern, scope_keys

__all__ = ["RedisDurability", "RedisKv", "check_prefix", "client_retries", "key_pattern", "scope_keys"]
