"""The in-memory backend: :class:`MemoryKv`, the reference
:class:`~botmesh.core.spi.DurableKv` (the oracle the conformance suite compares every
other kv with), and :class:`MemoryDurability`, the :class:`KvDurability` over it that
``durability={}`` means (ENABLE-2)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import BackendUnavailableError, VersionConflict
from .inputs import check_delete, check_put, check_range, check_record, check_scan
from .kv_durability import KvDurability
from .spi import Capabilities, DurableKv, IndexName, Versioned, check_index, check_json_object, index_entries
from .turns import suspension_point as _suspension_point

__all__ = ["MemoryDurability", "MemoryKv", "OwnedValuesKv"]


class OwnedValuesKv(DurableKv):
    """A :class:`DurableKv` that keeps the values written to it as dicts in memory
    (:class:`MemoryKv`; :class:`~botmesh.core.file_kv.FileKv` beside its file): its
    ``put`` checks the arguments, then hands :meth:`put_owned` a private copy of the
    value (:func:`~botmesh.core.spi.check_json_object`, which is also the check that it
    is a JSON object)."""

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        """See :meth:`DurableKv.put`: :meth:`put_owned` of a copy of ``value``."""
        check_put(scope, space, key, expected_version, due, expires)  # (the arguments' errors before the value's)
        return await self.put_owned(scope, space, key, check_json_object(value), expected_version=expected_version,
                                    due=due, expires=expires)

    @abstractmethod
    async def put_owned(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        """:meth:`put`, keeping ``value`` itself instead of a copy: the caller hands it
        over — a JSON object that :func:`~botmesh.core.spi.check_json_object` would copy
        unchanged (``str`` keys; ``dict``, ``list``, ``str``, ``int``, ``bool``, ``None``
        and finite ``float`` values), no container of which anybody else holds, which
        nobody changes afterwards (reads still return copies). Not part of the
        :class:`DurableKv` SPI: :class:`MemoryDurability` and
        :class:`~botmesh.core.file_backend.FileDurability` write their records this way,
        as :meth:`~botmesh.core.records._Record.private_json` makes them (issue 16: the
        kv's copy of each write was the largest single cost of a message)."""

    def owned_writes(self) -> Callable[..., Awaitable[int]] | None:
        """:meth:`put_owned`, for a writer whose values are private copies, when this
        kv's ``put`` is :meth:`put_owned` of a copy (its class keeps
        :meth:`OwnedValuesKv.put`); None when the class overrides ``put``, whose every
        write must then go through it (the planted bugs of the teeth tests do)."""
        return self.put_owned if type(self).put is OwnedValuesKv.put else None


class MemoryKv(OwnedValuesKv):
    """The in-memory reference :class:`DurableKv`: the oracle the conformance suite
    compares other backends against. Nothing survives the process. Its arguments are
    checked as every built-in kv checks them (:mod:`botmesh.core.inputs`).

    A value is stored as a private copy made by ``put`` with
    :func:`~botmesh.core.spi.check_json_object` (which is also the check that it is a
    JSON object: the copy is what a JSON round trip gives) — or handed over whole with
    :meth:`put_owned` — and every read returns a fresh copy of it: what is stored never
    aliases a caller's dict."""

    capabilities = Capabilities()

    def __init__(self) -> None:
        # (scope, space) -> key -> (value, a copy nobody else holds; version, due, expires)
        self._data: dict[tuple[str, str], dict[str, tuple[dict[str, Any], int, float | None, float | None]]] = {}
        self._closed = False

    async def open(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True

    def _check(self) -> None:
        if self._closed:
            raise BackendUnavailableError("MemoryKv is closed")

    def _space(self, scope: str, space: str) -> dict[str, tuple[dict[str, Any], int, float | None, float | None]]:
        return self._data.setdefault((scope, space), {})

    # Each method completes without awaiting anything in between its read and its write,
    # so it is atomic with respect to other tasks; the final suspension point keeps it a
    # real one like any I/O-backed implementation (_suspension_point).
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        check_record(scope, space, key)
        self._check()
        entry = self._space(scope, space).get(key)
        result = None if entry is None else Versioned(check_json_object(entry[0]), entry[1])
        await _suspension_point()
        return result

    async def put_owned(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        """See :meth:`OwnedValuesKv.put_owned`."""
        due, expires = check_put(scope, space, key, expected_version, due, expires)
        if self._closed:  # self._check(), without its call on the per-message path (issue 16)
            self._check()
        records = self._data.get((scope, space)) or self._space(scope, space)
        current = records.get(key)
        current_version = 0 if current is None else current[1]
        if current_version != expected_version:
            await _suspension_point()
            raise VersionConflict.at(space, key, expected_version, current_version)
        records[key] = (value, expected_version + 1, due, expires)
        await _suspension_point()
        return expected_version + 1

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        check_delete(scope, space, key, expected_version)
        self._check()
        records = self._space(scope, space)
        current = records.get(key)
        current_version = 0 if current is None else current[1]
        if current is None or current_version != expected_version:
            await _suspension_point()
            raise VersionConflict.at(space, key, expected_version, current_version)
        del records[key]
        await _suspension_point()

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        upto = check_range(scope, space, upto)
        pos = 2 if check_index(index) == "due" else 3
        self._check()
        entries = index_entries(self._space(scope, space).items(), pos, upto, limit)
        await _suspension_point()
        return entries

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        after = check_scan(scope, space, after)
        self._check()
        records = self._space(scope, space)
        keys = sorted(k for k in records if after is None or k > after)[:limit]
        result = [(k, Versioned(check_json_object(records[k][0]), records[k][1])) for k in keys]
        await _suspension_point()
        return result


class MemoryDurability(KvDurability):
    """The in-memory backend (what ``durability={}`` means, ENABLE-2): retries, backoff
    and the DLQ, nothing survives the process."""

    def __init__(self, kv: MemoryKv | None = None) -> None:
        """Over ``kv``, a new :class:`MemoryKv` by default (several instances over one
        kv stand for processes sharing a store). Records are written with
        :meth:`MemoryKv.put_owned` — no copy but the one
        :meth:`~botmesh.core.records._Record.private_json` makes (see
        ``KvDurability._put_owned``) — unless the kv's class overrides ``put``: then
        with its ``put``, whatever it does (:meth:`OwnedValuesKv.owned_writes`)."""
        kv = MemoryKv() if kv is None else kv
        super().__init__(kv, own_kv=False, name="memory")
        self._put_owned = kv.owned_writes()
