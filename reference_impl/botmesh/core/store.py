"""The bot's store: users, flow checkpoints and the message log (the subset of the
original store that durability needs). Values are JSON-compatible."""

from __future__ import annotations

import asyncio
import copy
import json
from abc import ABC, abstractmethod
from typing import Any

from .errors import BackendUnavailableError
from .spi import copy_plain_dict


class Store(ABC):
    """Where a bot keeps what outlives one message.

    * ``get``/``set``/``delete`` — JSON values under ``(namespace, key)``. The bot uses
      namespace ``"user"`` for ``ctx.user`` and ``"flow"`` for checkpoints of
      ``.persistent()`` flows (FLOW-1).
    * ``append_message``/``messages`` — the message log: one entry per message received
      or sent (``{"direction": "in"|"out", "chat_id", "content", "message_id", "at"}``).

    A store must not touch the durability journals (BACK-3); a store that also offers a
    durability backend (``SQLiteStore.durability()``) keeps the two apart.
    """

    async def open(self) -> None:
        """Acquire resources. Idempotent."""

    async def close(self) -> None:
        """Release resources. Idempotent."""

    @abstractmethod
    async def get(self, namespace: str, key: str) -> Any | None: ...

    @abstractmethod
    async def set(self, namespace: str, key: str, value: Any) -> None: ...

    @abstractmethod
    async def delete(self, namespace: str, key: str) -> None: ...

    @abstractmethod
    async def append_message(self, entry: dict[str, Any]) -> None: ...

    @abstractmethod
    async def messages(self, chat_id: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        """The log, oldest first, optionally for one chat."""


class MemoryStore(Store):
    """A store in memory. Sharing one instance between two bots in a test stands for a
    persistent store surviving a restart.

    ``fail_with`` (tests only): when set to an exception, every call raises it — the
    "store is down" of INB-5.
    """

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], str] = {}
        self._log: list[dict[str, Any]] = []
        self.fail_with: BaseException | None = None

    def _check(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with

    async def get(self, namespace: str, key: str) -> Any | None:
        self._check()
        raw = self._data.get((namespace, key))
        await asyncio.sleep(0)
        return None if raw is None else json.loads(raw)

    async def set(self, namespace: str, key: str, value: Any) -> None:
        self._check()
        try:
            self._data[(namespace, key)] = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise BackendUnavailableError(f"store value for {namespace}/{key} is not JSON: {exc}") from exc
        await asyncio.sleep(0)

    async def delete(self, namespace: str, key: str) -> None:
        self._check()
        self._data.pop((namespace, key), None)
        await asyncio.sleep(0)

    async def append_message(self, entry: dict[str, Any]) -> None:
        self._check()
        copied = copy_plain_dict(entry)  # the copy deepcopy makes, at a fraction of its cost
        self._log.append(copy.deepcopy(entry) if copied is None else copied)
        await asyncio.sleep(0)

    async def messages(self, chat_id: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        self._check()
        result = [copy.deepcopy(e) for e in self._log if chat_id is None or e.get("chat_id") == chat_id]
        return result[-limit:] if limit else result
