"""``RedisDurability``: the Redis durability backend (BACK table, BACK-3, REPL-4):
:class:`~botmesh.core.kv_durability.KvDurability` over :class:`~botmesh.redis_store.kv.RedisKv`.

``RedisDurability(client=... | url=... | cluster=..., prefix="botmesh", logger=None)``

* exactly one of ``client`` / ``url`` / ``cluster`` (a
  :class:`~botmesh.core.errors.ConfigError` otherwise);
* with ``url`` or ``cluster`` the backend builds its own client (without automatic
  retries) and closes it at ``stop()``; ``start()`` after ``stop()`` builds a new one;
* an injected ``client`` belongs to its owner: ``stop()`` never closes it. It must not
  retry commands by itself (see :mod:`botmesh.redis_store.kv`);
* ``prefix`` is validated (:func:`~botmesh.redis_store.kv.check_prefix`); the journals
  live under ``<prefix>:{durable:inbox:<scope>}`` and ``<prefix>:{durable:outbox:<scope>}``
  (BACK-3) and nothing else is touched (no store keys);
* driver errors are reported to ``logger.error`` and raised as
  ``BackendUnavailableError``;
* ``auto_pipeline`` (default True): concurrent journal calls (several chats at once) share
  round trips as one pipeline (see :class:`~botmesh.redis_store.kv.RedisKv`).

It is shared across processes and hosts (REPL-4): claims are compare-and-set scripts run
inside the server, so they stay exclusive and fencing tokens hold everywhere the server
is reachable. ``capabilities.shared`` is set, so a bot without an explicit
``instance_id`` gets a per-boot suffix (LEASE-3, done by the engine for every shared
backend). ``survives_crash`` holds only when the server runs with AOF and
``appendfsync always``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..core.kv_durability import KvDurability
from .kv import DEFAULT_PREFIX, ClusterSpec, RedisClient, RedisKv


class RedisDurability(KvDurability):
    """:class:`~botmesh.core.kv_durability.KvDurability` over a :class:`RedisKv` (see the module
    docstring). ``start()`` opens the kv, ``stop()`` closes it (and an own client). The
    connection arguments (``client``/``url``/``cluster``, ``prefix``, ``auto_pipeline``,
    ``client_options``) are :class:`RedisKv`'s."""

    kv: RedisKv

    def __init__(
        self,
        *,
        client: RedisClient | None = None,
        url: str | None = None,
        cluster: ClusterSpec | None = None,
        prefix: str = DEFAULT_PREFIX,
        logger: logging.Logger | None = None,
        name: str | None = "redis",
        auto_pipeline: bool = True,
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        kv = RedisKv(client=client, url=url, cluster=cluster, prefix=prefix, logger=logger, auto_pipeline=auto_pipeline,
                     client_options=client_options)
        super().__init__(kv, own_kv=True, name=name)

    @property
    def prefix(self) -> str:
        """The key prefix of the journals."""
        return self.kv.prefix

    @property
    def owns_client(self) -> bool:
        """Whether ``stop()`` closes the client (built from ``url``/``cluster``)."""
        return self.kv.owns_client

    def abandon(self) -> None:
        """Drop the backend as a dead process would (for recovery tests): later calls
        fail, an own client's connections are closed without a word to the server."""
        self.kv.abandon()

    def __repr__(self) -> str:
        return f"RedisDurability(prefix={self.kv.prefix!r}, name={self.name!r})"
