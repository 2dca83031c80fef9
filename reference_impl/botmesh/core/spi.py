"""The service-provider interface for durability backends (BACK-7): the contract only.

A third party writes a backend by implementing :class:`DurableKv` — a small
compare-and-set key-value store with two ordered indexes — and wrapping it in
:class:`~botmesh.core.kv_durability.KvDurability`, which turns it into a complete
durability backend (inbox and outbox journals, leases with fencing tokens, retention).
The docstrings of :class:`DurableKv` are the contract; this module holds it with its
vocabulary (:class:`Capabilities`, :class:`Versioned`, the index names, the errors a kv
raises). ``botmesh_testkit``'s conformance suite checks every sentence of it against
:class:`~botmesh.core.memory.MemoryKv`, the reference the other backends are compared
with step by step.

Data model
----------
Records live at ``(scope, space, key)``:

* ``scope`` — the bot's namespace (SCOPE-1). Two scopes never see each other's records,
  index entries or versions (SCOPE-2).
* ``space`` — ``"inbox"`` or ``"outbox"`` (a backend must accept any short
  identifier-like string).
* ``key`` — a non-empty string up to 512 characters, valid Unicode (no lone
  surrogate) and without U+0000.

Arguments outside the contract — a key that is not such a string, a scope or space
that is not a non-empty string of that kind, an index score that is NaN or not a
number, an ``expected_version`` that is not an ``int`` from 0 — are refused with
:class:`~botmesh.core.errors.InvalidKeyError` /
:class:`~botmesh.core.errors.InvalidArgumentError` (both ``ValueError``) before the
storage sees them, nothing changed; the checks every built-in kv makes are in
:mod:`botmesh.core.inputs`. A value outside the contract raises ``TypeError`` or
``ValueError`` (:func:`check_json_object`), nothing changed.

A record's value is a JSON object (a ``dict`` whose contents ``json.dumps`` accepts)
nesting at most 128 levels (a flat object is one level): a backend must store every
such value, and may refuse a deeper one with ``ValueError`` (the file journal does:
its reader never recurses without bound); the backend stores and returns it unchanged (a copy: mutating a returned value never
changes what is stored). Each record has a **version**, an integer that is 1 when the
record is created and grows by exactly 1 with every successful ``put``.

Each record may have an entry in each of two **ordered indexes**, ``"due"`` and
``"expires"``, with a float score (milliseconds since the epoch). ``put`` sets both
(``None`` removes the entry); ``delete`` removes both. ``range`` lists entries whose
score is ``<= upto`` in ascending ``(score, key)`` order.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import BackendUnavailableError, VersionConflict
from .spi_types import INDEXES, Capabilities, IndexName, Versioned, check_index

__all__ = [
    "INDEXES",
    "BackendUnavailableError",
    "Capabilities",
    "DurableKv",
    "IndexName",
    "VersionConflict",
    "Versioned",
    "check_index",
    "check_json_object",
    "encode_checked",
    "encode_json_object",
]


class DurableKv(ABC):
    """Compare-and-set key-value storage with two ordered indexes, scoped.

    Contract (every method):

    * It is a coroutine; it may be called concurrently from many tasks. Each ``put`` and
      ``delete`` is atomic: concurrent CAS calls on one key with the same
      ``expected_version`` have exactly one winner; the others raise
      :class:`~botmesh.core.errors.VersionConflict`.
    * A write that returned is durable to the degree ``capabilities.survives_crash``
      claims.
    * Errors of the underlying driver are raised as
      :class:`~botmesh.core.errors.BackendUnavailableError` (never the driver's type). A
      write that raised ``BackendUnavailableError`` may or may not have been applied; the
      caller re-reads by key (that is why all writes are CAS: replaying one is harmless).
      No other exception escapes for any input: arguments outside the contract raise
      ``InvalidKeyError``/``InvalidArgumentError`` (or, for a value, ``TypeError`` /
      ``ValueError``) and change nothing (see the module docstring).
    * Calls after :meth:`close` raise ``BackendUnavailableError`` (until :meth:`open`
      again). Before the first :meth:`open` a kv may either raise it or open lazily
      (``MemoryKv`` and ``SQLiteKv`` open lazily, ``PostgresKv`` raises); callers open
      first — :class:`~botmesh.core.kv_durability.KvDurability` does at ``start()`` —
      so nothing depends on which. The conformance suite checks the part after
      ``close()``.
    """

    capabilities: Capabilities = Capabilities()

    async def open(self) -> None:
        """Acquire resources (files, pools). Idempotent."""

    async def close(self) -> None:
        """Release resources. Idempotent. Later calls raise ``BackendUnavailableError``."""

    async def durability_settings(self) -> dict[str, str] | None:
        """Optional: the settings this kv's durability rests on, read **live** from the
        connection or configuration it really uses — not from what it was asked for —
        so that a ``survives_crash`` claim can be checked against them without a power
        cut. ``None`` (the default) means "not reported": nothing is claimed about the
        settings, and the claim is left to tests that kill the process or cut the power.

        The mapping has a ``"kind"`` naming the storage (``"sqlite"``, ``"postgres"``,
        ``"redis"``, ``"file"``, or a name of a third party's own) and one entry per
        setting, its value as text, named as the storage names it:

        * ``sqlite`` — ``synchronous`` (``PRAGMA synchronous`` of the kv's own
          connection, as ``OFF``/``NORMAL``/``FULL``/``EXTRA``), ``journal_mode``;
        * ``postgres`` — ``fsync``, ``synchronous_commit``, ``full_page_writes``
          (``SHOW`` on a connection of the kv's pool);
        * ``redis`` — ``appendonly``, ``appendfsync`` (``CONFIG GET``);
        * ``file`` — ``fsync``, ``append_log`` (``True``/``False``).

        A setting that could not be read is left out (and ``"unreadable"`` may say why):
        a checker then reports that it could not verify it. Raises
        ``BackendUnavailableError`` when the storage cannot be reached at all. Calling
        it is not a write and changes nothing."""
        return None

    @abstractmethod
    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """The record at ``(scope, space, key)`` with its version, or ``None``."""

    @abstractmethod
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
        """Compare-and-set. ``expected_version=0`` creates the record and fails when it
        exists; ``expected_version=n > 0`` replaces version ``n`` and fails when the
        current version is another or the record is absent. On success the index entries
        become exactly ``due`` / ``expires`` (``None``: no entry) and the new version
        (``expected_version + 1``) is returned. On failure nothing changes and
        ``VersionConflict`` is raised; its ``found`` is the version found (0: absent)
        and a kv may also give ``current``, the record found, when it learns it in the
        same server round trip (optional: ``None`` means "not reported" unless
        ``found == 0``; see :class:`~botmesh.core.errors.VersionConflict`)."""

    @abstractmethod
    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """Remove the record at version ``expected_version`` and its index entries.
        Raises ``VersionConflict`` when absent or at another version (with ``found`` and
        optionally ``current``, as :meth:`put`)."""

    @abstractmethod
    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """Up to ``limit`` entries ``(score, key)`` of ``index`` with ``score <= upto``,
        ascending by ``(score, key)``. ``upto`` may be ``float('inf')``. An ``index`` other
        than ``"due"`` and ``"expires"`` raises ``ValueError``."""

    async def ranges(
        self, scope: str, reads: Sequence[tuple[str, IndexName]], *, upto: float, limit: int
    ) -> list[list[tuple[float, str]]]:
        """Optional: several :meth:`range` reads of one scope with the same ``upto`` and
        ``limit`` — ``reads`` is a sequence of ``(space, index)`` — answered together,
        one list per read, in the order of ``reads``. Each list is exactly what
        :meth:`range` would return for its read at some instant during the call; the
        reads need not see one snapshot together. Each read's arguments are checked and
        refused as :meth:`range` refuses them (reads change nothing, so a refusal after
        some were read leaves nothing half done).

        The engine's sweep reads both journals' due indexes this way at every pass
        (:meth:`botmesh.core.kv_durability.KvDurability.due`): a kv on a server answers
        them in one round trip (``PostgresKv``: one statement; ``RedisKv``: one
        script), so an idle bot asks its server once per ``poll_ms`` instead of
        twice. The default calls :meth:`range` for each read in turn, which is what a
        kv without a cheaper way should do. The conformance suite checks that the
        lists agree with :meth:`range`."""
        return [await self.range(scope, space, index, upto=upto, limit=limit) for space, index in reads]

    @abstractmethod
    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """Up to ``limit`` records with key ``> after`` (all when ``after`` is None),
        ascending by key (code-point order)."""


_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
"""``json.dumps(value, allow_nan=False, separators=(",", ":"))`` without building an
encoder per call."""


# JSONEncoder.encode builds its C encoder anew at every call, with a dict of the objects
# being encoded to detect cycles. A value check_json_object returned is acyclic by
# construction (a fresh copy), so one C encoder without that dict serves every call:
# the same text, ~1 us less per value (issue 16). Without the C accelerator (another
# Python), the encoder's own encode.
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)  # not in the module's type stubs
_C_ENCODE = None if _c_make_encoder is None else _c_make_encoder(
    None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False
)


def encode_checked(value: Any) -> str:
    """``json.dumps(value, allow_nan=False, separators=(",", ":"))`` for a value known to
    be acyclic — what :func:`check_json_object` returned, or lists of such values and
    scalars: no cycle check is made (a cycle would recurse until ``RecursionError``)."""
    if _C_ENCODE is None:
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))


def encode_json_object(value: Any, encoder: json.JSONEncoder = _ENCODER) -> str:
    """``value`` encoded as compact JSON text, raising ``TypeError`` when it is not a
    JSON object (``ValueError`` for NaN/infinity and for nesting too deep to encode):
    the one encoding a kv needs to store a value it must not alias. Decoding the text
    gives what :func:`check_json_object` returns. ``encoder``: another
    ``json.JSONEncoder(allow_nan=False, ...)`` for a kv that stores its text otherwise
    spaced (the SQLite kv)."""
    if not isinstance(value, dict):
        raise TypeError(f"a DurableKv value must be a dict, got {type(value).__name__}")
    try:
        return encoder.encode(value)
    except RecursionError:
        raise ValueError("a DurableKv value nested too deeply to be stored as JSON") from None


class _NotPlain(Exception):
    """Raised inside :func:`_copy_dict` for a value its fast copy does not cover."""


_PLAIN_DEPTH = 100
"""Containers nested deeper than this are copied through JSON (which also refuses a
cycle, seen here as endless nesting)."""


def _copy_dict(value: dict[str, Any], depth: int) -> dict[str, Any]:
    if depth > _PLAIN_DEPTH:
        raise _NotPlain
    out = value.copy()  # the scalars as they are; the containers replaced below
    for k, v in value.items():
        if type(k) is not str:
            raise _NotPlain
        t = type(v)
        if t is str or v is None or t is int or t is bool:
            continue
        if t is float:
            if v - v != 0.0:  # NaN or infinity
                raise _NotPlain
        elif t is dict:
            out[k] = _copy_dict(v, depth + 1)
        elif t is list:
            out[k] = _copy_list(v, depth + 1)
        else:
            raise _NotPlain
    return out


def _copy_list(value: list[Any], depth: int) -> list[Any]:
    if depth > _PLAIN_DEPTH:
        raise _NotPlain
    out: list[Any] = []
    for v in value:
        t = type(v)
        if t is str or t is int or v is None or t is bool:
            out.append(v)
        elif t is float:
            if v - v != 0.0:
                raise _NotPlain
            out.append(v)
        elif t is dict:
            out.append(_copy_dict(v, depth + 1))
        elif t is list:
            out.append(_copy_list(v, depth + 1))
        else:
            raise _NotPlain
    return out


def copy_plain_dict(value: dict[str, Any]) -> dict[str, Any] | None:
    """A deep copy of ``value`` when it is a *plain* JSON object (see
    :func:`check_json_object`: exactly ``dict``/``list`` containers with ``str`` keys,
    ``str``, ``int``, ``bool``, ``None`` and finite ``float``, at most 100 levels deep),
    copied container by container; None when it is not one."""
    if type(value) is dict:
        try:
            return _copy_dict(value, 1)
        except _NotPlain:
            pass
    return None


def index_entries(
    entries: Iterable[tuple[str, tuple[Any, Any, float | None, float | None]]], pos: int, upto: float, limit: int
) -> list[tuple[float, str]]:
    """:meth:`DurableKv.range`'s answer for a kv that keeps its records in memory as
    ``key -> (value, version, due, expires)``: the ``(score, key)`` of the index at
    ``pos`` of each entry (2: ``due``, 3: ``expires``) up to ``upto``, in ascending
    order, cut to ``limit`` (MemoryKv, FileKv and the event journals' kv)."""
    found = sorted((entry[pos], key) for key, entry in entries if entry[pos] is not None and entry[pos] <= upto)  # type: ignore[operator]
    return [(float(score), key) for score, key in found[:limit]]  # type: ignore[arg-type]


def check_json_object(value: Any) -> dict[str, Any]:
    """Deep-copy ``value`` as a JSON round trip would (``json.loads`` of
    :func:`encode_json_object`), raising ``TypeError`` when it is not a JSON object
    (``ValueError`` for NaN/infinity and for nesting too deep to encode). Backends use it
    so that what they store is what they return, shared with nobody.

    A *plain* value — ``dict``/``list`` (exactly those types, ``str`` keys) of ``str``,
    ``int``, ``bool``, ``None`` and finite ``float``, at most 100 levels deep — is copied
    structurally, which gives the same result as the round trip at a fraction of its cost
    (issue 16: a journal write's copies were a large part of a message's cost). Anything
    else (a tuple, a subclass, a non-``str`` key, NaN, deeper nesting, a cycle) takes the
    JSON round trip itself, so its conversions and errors are exactly JSON's."""
    if type(value) is dict:
        try:
            return _copy_dict(value, 1)
        except _NotPlain:
            pass
    result: dict[str, Any] = json.loads(encode_json_object(value))
    return result
