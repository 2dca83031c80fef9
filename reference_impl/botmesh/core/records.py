"""The records of the two journals. Backends store them as JSON objects
(:meth:`to_json`); unknown fields written by a newer version are kept on read."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from .spi import check_json_object

INBOX_STATES = ("leased", "pending", "done", "dead")
"""``leased``: being processed by ``owner`` until ``lease_until``; ``pending``: waiting
for a retry at ``next_at`` (or an operator replay); ``done``: settled; ``dead``: in the
DLQ."""

OUTBOX_STATES = ("pending", "sending", "failed", "sent", "dead", "unknown")
"""``pending``: journaled, not yet tried (enqueued, or a part waiting behind an earlier
one); ``sending``: a provider call is (or was, when the owner died) in flight under a
lease; ``failed``: the last attempt failed, retry at ``next_at``; ``sent``: the provider
answered with ``message_id``; ``dead``: in the DLQ; ``unknown``: ambiguous after a crash
and skipped (OUT-14)."""

R = TypeVar("R", bound="_Record")


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")


_SCALAR_TYPES = frozenset({"str", "int", "float", "bool", "None"})
_TEXT_TYPES, _TEXT_CLASSES = frozenset({"str", "None"}), frozenset({str, type(None)})
_NUMBER_TYPES, _NUMBER_CLASSES = frozenset({"int", "float", "bool", "None"}), frozenset({int, float, bool, type(None)})


def _scalar_fields(extra: dict[Any, Any]) -> dict[str, Any] | None:
    """``extra`` itself when its keys are ``str`` and its values JSON scalars (``str``,
    ``int``, ``bool``, ``None``, finite ``float``, exactly those types) — what
    :func:`~botmesh.core.spi.check_json_object` would give an equal copy of, and the
    caller copies the entries out of it —, else None (issue 16: a transition to done or
    sent adds ``expires_at`` as an extra field, and the copy of that one-entry dict cost
    more than this look)."""
    for key, value in extra.items():
        t = type(value)
        if type(key) is not str:
            return None
        if t is float:
            if value - value != 0.0:  # NaN or infinity
                return None
        elif t is not str and t is not int and t is not bool and value is not None:
            return None
    return extra


Getter = Callable[[dict[str, Any]], tuple[Any, ...]]


def _annotation(f: dataclasses.Field[Any]) -> set[str]:
    return {part.strip() for part in str(f.type).split("|")}


def _container_names(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` that may hold a container: every field but ``extra`` whose
    annotation is not made of scalar types alone (``str``, ``int``, ``float``, ``bool``,
    ``None``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra" and not _annotation(f) <= _SCALAR_TYPES)


def _getter(names: list[str]) -> Getter:
    """A function of a dict giving the tuple of its values under ``names``."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda data: tuple(data[name] for name in names)


def _private_plan(cls: type) -> tuple[Getter, Getter] | None:
    """What :meth:`_Record.private_json` checks at C speed: getters of the fields typed
    as text (``str``, ``None``) and of those typed as numbers (``int``, ``float``,
    ``bool``, ``None``); None when a scalar field is typed otherwise (then every
    ``private_json`` of the class is a full copy)."""
    texts: list[str] = []
    numbers: list[str] = []
    for f in dataclasses.fields(cls):
        parts = _annotation(f)
        if f.name == "extra" or not parts <= _SCALAR_TYPES:
            continue
        if parts <= _TEXT_TYPES:
            texts.append(f.name)
        elif parts <= _NUMBER_TYPES:
            numbers.append(f.name)
        else:
            return None
    return _getter(texts), _getter(numbers)


@dataclass
class _Record:
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # The field names of each record class, taken once (``dataclasses.fields`` per call
    # was a good part of a journal write's cost): class -> names, the same as a set, the
    # fields that may hold a container (:func:`_container_names`), and what
    # private_json checks (:func:`_private_plan`).
    _names: ClassVar[dict[type, tuple[tuple[str, ...], frozenset[str], tuple[str, ...],
                                      tuple[Getter, Getter] | None]]] = {}

    @classmethod
    def _fields(cls) -> tuple[tuple[str, ...], frozenset[str], tuple[str, ...], tuple[Getter, Getter] | None]:
        found = _Record._names.get(cls)
        if found is None:
            names = _field_names(cls)
            found = _Record._names[cls] = (names, frozenset(names), _container_names(cls), _private_plan(cls))
        return found

    @classmethod
    def json_copy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``data`` — what :meth:`to_json` of a record of this class returned —
        that shares no container with it, equal to what
        :func:`~botmesh.core.spi.check_json_object` gives for it: the top level copied
        as it is, each field that may hold a container (``event``, ``content``) through
        ``check_json_object``. The record's scalar fields (strings, numbers, ``None``)
        need no copy; a ``data`` with other keys (a record with ``extra`` fields), or a
        container field that is not a dict, is copied whole by ``check_json_object``.
        About a third of a full copy's cost (issue 16: the engine keeps such a copy of
        each record it wrote while it holds its lease)."""
        fields, _, containers, _ = _Record._names.get(cls) or cls._fields()
        if len(data) != len(fields):
            return check_json_object(data)
        out = data.copy()
        for name in containers:
            value = out[name]
            if type(value) is not dict:
                return check_json_object(data)
            out[name] = check_json_object(value)
        return out

    def to_json(self) -> dict[str, Any]:
        found = _Record._names.get(type(self))  # (a lookup, not a call, on the per-message path)
        fields = (found or self._fields())[0]
        data = self.__dict__.copy()
        extra = data.pop("extra", None)
        if len(data) != len(fields) or extra is None:  # an attribute added or removed: by name
            attrs = self.__dict__
            data = {name: attrs[name] for name in fields}
            extra = self.extra
        # else: the fields themselves, in their order (``__init__``, ``copy`` and
        # ``from_json`` keep it), without picking them one by one
        if extra:
            data.update(extra)
        return data

    def private_json(self, base: _Record | None = None) -> dict[str, Any]:
        """What ``check_json_object(self.to_json())`` gives — this record as a JSON object
        sharing no container with the record or anybody else, checked with the same
        errors — made for a kv that keeps the dict it is handed as it is
        (:meth:`~botmesh.core.memory.MemoryKv.put_owned`, issue 16), at a fraction of a
        full copy's cost. The scalar fields are checked at C speed: the fields typed as
        text hold ``str`` or ``None``; those typed as numbers hold ``int``, ``float``,
        ``bool`` or ``None``, and add up to a finite number (no NaN or infinity among
        them). The container fields (``event``, ``content``) and the ``extra`` fields
        are copied by ``check_json_object``. Anything else — a field holding another
        type, an attribute added or removed, a class with a field typed otherwise — takes
        the full copy, whose result (or error) is the one to give.

        ``base``: a record whose containers the caller owns (nobody else holds them) and
        gives up; a container field holding the very dict ``base`` holds there is taken
        as it is, without a copy (a transition's record keeps the ``event`` or
        ``content`` of the record it was made from)."""
        fields, _, containers, plan = _Record._names.get(type(self)) or self._fields()
        data = self.__dict__.copy()
        extra = data.pop("extra", None)
        if plan is None or len(data) != len(fields) or type(extra) is not dict:
            return check_json_object(self.to_json())
        texts, numbers = plan
        try:
            values = numbers(data)
            if not (_TEXT_CLASSES.issuperset(map(type, texts(data))) and _NUMBER_CLASSES.issuperset(map(type, values))):
                return check_json_object(self.to_json())
            total = sum(filter(None, values))  # (None, 0 and False left out)
        except (KeyError, OverflowError):  # a field missing; numbers too large to add up
            return check_json_object(self.to_json())
        if total - total != 0:  # a NaN or an infinity among them (or their sum too large)
            return check_json_object(self.to_json())
        given = None if base is None else base.__dict__
        for name in containers:
            value = data[name]
            if type(value) is not dict:
                return check_json_object(self.to_json())
            if given is None or given.get(name) is not value:
                data[name] = check_json_object(value)
        if extra:
            data.update(_scalar_fields(extra) or check_json_object(extra))
        return data

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any]) -> R:
        fields, names, _, _ = _Record._names.get(cls) or cls._fields()
        if len(data) == len(fields) and names.issuperset(data):
            # every field and nothing else (what to_json of a record without extra
            # gives): the values as they are, without __init__'s keyword matching
            record = object.__new__(cls)
            record.__dict__.update(data)
            record.extra = {}
            return record
        known = {}
        extra = {}
        for k, v in data.items():
            if k in names:
                known[k] = v
            else:
                extra[k] = v
        return cls(**known, extra=extra)

    def copy(self: R, **changes: Any) -> R:
        """A new record with ``changes`` (what ``dataclasses.replace`` does, nested
        values shared alike, without its per-call cost)."""
        names = (_Record._names.get(type(self)) or self._fields())[1]
        if not names.issuperset(changes):
            for name in changes:
                if name not in names and name != "extra":
                    raise TypeError(f"{type(self).__name__} has no field {name!r}")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


@dataclass
class InboxRecord(_Record):
    """One admitted inbound event (INB-1)."""

    id: str = ""
    kind: str = "message"
    chat_id: str = ""
    event: dict[str, Any] = field(default_factory=dict)
    state: str = "leased"
    attempts: int = 0
    """Charged executions: a claim charges one (INB-7)."""
    token: int = 0
    """Fencing token of the current lease; grows with every new lease (LEASE-2)."""
    owner: str | None = None
    incarnation: str | None = None
    lease_until: float | None = None
    claimed_at: float | None = None
    next_at: float | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None
    error: str | None = None


@dataclass
class OutboxRecord(_Record):
    """One send under an idempotency key (OUT-1)."""

    key: str = ""
    chat_id: str = ""
    content: dict[str, Any] = field(default_factory=dict)
    """The content as journaled (bytes as ``{"$bytes": base64}``, OUT-15), after the
    ``before("send")`` hooks."""
    fingerprint: str = ""
    """Hash of chat + content taken before the hooks (OUT-5)."""
    rule: str = "derived"
    """How the key was chosen (OUT-3): ``explicit``, ``derived`` or ``random``."""
    inbound_id: str | None = None
    previous_part: str | None = None
    """Key of the part that must be sent before this one (OUT-12)."""
    part: int = 1
    origin: str = "inline"
    """``inline`` (reply/send) or ``enqueue``: who runs the ``after("send")`` hooks."""
    state: str = "pending"
    attempts: int = 0
    """Provider calls claimed so far (OUT-7: at most ``retries + 1``)."""
    token: int = 0
    owner: str | None = None
    incarnation: str | None = None
    lease_until: float | None = None
    claimed_at: float | None = None
    next_at: float | None = None
    message_id: str | None = None
    error: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    sent_at: float | None = None
    seq: int = 0
