"""The ``durability=`` setting of a bot, validated when the bot is built (CONF-1).

Every bad value raises :class:`~botmesh.core.errors.ConfigError` whose ``option`` names
the setting (``"durability.outbox.lease_ms"``) and whose message says what was given and
what is accepted. Unknown keys are refused too: a typo must not silently fall back to a
default.

Durations (:func:`parse_duration`): the grammar is exact (``"15s"``, ``"250ms"``,
``"7d"``; no spaces, ASCII digits only), numbers finite, and every duration between 0
and one year (:data:`MAX_DURATION_MS`); ``poll_ms`` at least 1 ms, both ``lease_ms`` at
least 20 ms (OUT-17). ``retention=0`` keeps records for ever.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from .backend import DurabilityBackend
from .errors import ConfigError
from .memory import MemoryDurability

ON_AMBIGUOUS: tuple[str, ...] = ("skip", "resend")
"""The values of ``durability.outbox.on_ambiguous`` (OUT-14), the default first."""

_UNITS = {"ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0, "d": 86_400_000.0}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)?", re.ASCII)

MAX_DURATION_MS = 365 * 86_400_000.0
"""The longest duration any option accepts: one year (issue 13). Longer ones are
mistakes (a lease or a poll period of years) or better said otherwise (``retention=0``
keeps records for ever)."""

POLL_MIN_MS = 1.0
"""The shortest ``durability.poll_ms``: a sweep period below a millisecond only burns CPU
on an idle bot."""

LEASE_MIN_MS = 20.0
"""The shortest ``inbox.lease_ms`` and ``outbox.lease_ms`` (OUT-17)."""


def parse_duration(value: Any, option: str, *, minimum: float = 0.0) -> float:
    """Milliseconds from ``"250ms"``, ``"15s"``, ``"5m"``, ``"2h"``, ``"7d"`` or a
    number of milliseconds (CONF-1).

    The grammar is exact: ASCII digits with an optional fraction (``"1.5s"``) and an
    optional unit (none: milliseconds) — no sign, no spaces, no exponent, no other
    digits (``"１５s"``). A number (``int`` or ``float``, not ``bool``) must be finite.
    Either way the duration lies between ``minimum`` and :data:`MAX_DURATION_MS` (one
    year). Anything else raises :class:`ConfigError` naming ``option`` and the value."""
    if isinstance(value, bool):
        raise ConfigError(f"{option}: expected a duration, got {value!r}", option=option, value=value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{option}: a duration must be finite, got {value!r}", option=option, value=value)
        return _bounded(value, value, option, minimum)
    if isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match:
            return _bounded(float(match.group(1)) * _UNITS[match.group(2) or "ms"], value, option, minimum)
    raise ConfigError(
        f"{option}: {_shown(value)} is not a duration (use e.g. '250ms', '15s', '5m', '2h', '7d' — digits and a unit, "
        "no spaces — or a number of milliseconds)",
        option=option,
        value=value,
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _bounded(ms: float, value: Any, option: str, minimum: float) -> float:
    """``ms`` (from ``value``) when it lies in ``[minimum, MAX_DURATION_MS]``; compared
    before any conversion, so that a huge ``int`` cannot overflow."""
    if ms < 0:
        raise ConfigError(f"{option}: a duration must be >= 0 ms, got {_shown(value)}", option=option, value=value)
    if ms < minimum:
        raise ConfigError(
            f"{option}: at least {minimum:g} ms, got {_shown(value)}", option=option, value=value
        )
    if not ms <= MAX_DURATION_MS:
        raise ConfigError(
            f"{option}: at most one year ({MAX_DURATION_MS:.0f} ms), got {_shown(value)}", option=option, value=value
        )
    return float(ms)


@dataclass(frozen=True)
class Backoff:
    """``min(cap_ms, base_ms * 2**(attempt-1))`` spread by ± ``jitter`` (RETRY-1)."""

    base_ms: float = 1000.0
    cap_ms: float = 60_000.0
    jitter: float = 0.2

    def delay(self, attempt: int, rand: float) -> float:
        """Delay before the attempt after failed attempt number ``attempt`` (1-based);
        ``rand`` in [0, 1) spreads it."""
        raw = min(self.cap_ms, self.base_ms * (2.0 ** max(0, attempt - 1)))
        return max(0.0, raw * (1.0 + self.jitter * (2.0 * rand - 1.0)))


@dataclass(frozen=True)
class InboxConfig:
    lease_ms: float = 60_000.0
    max_attempts: int = 5
    backoff: Backoff = field(default_factory=Backoff)
    media_refs: bool = True


@dataclass(frozen=True)
class OutboxConfig:
    retries: int = 5
    backoff: Backoff = field(default_factory=Backoff)
    inline_max_ms: float = 15_000.0
    on_ambiguous: str = "skip"
    on_diverged: str = "send"
    max_payload_bytes: int = 1024 * 1024
    lease_ms: float = 60_000.0


@dataclass(frozen=True)
class DurabilityConfig:
    """The validated ``durability=`` setting (see the CONF table of the spec)."""

    backend: DurabilityBackend
    instance_id: str | None = None
    fail_open: bool = False
    inbox: InboxConfig = field(default_factory=InboxConfig)
    outbox: OutboxConfig = field(default_factory=OutboxConfig)
    poll_ms: float = 1000.0
    retention_ms: float = 7 * 86_400_000.0


def _mapping(value: Any, option: str, allowed: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{option}: expected a dict, got {type(value).__name__}", option=option, value=value)
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(
            f"{option}: unknown option(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(allowed))}",
            option=f"{option}.{unknown[0]}",
            value=value[unknown[0]],
        )
    return value


def _int(value: Any, option: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{option}: expected an integer >= {minimum}, got {value!r}", option=option, value=value)
    return value


def _bool(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{option}: expected True or False, got {value!r}", option=option, value=value)
    return value


def _choice(value: Any, option: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(
            f"{option}: {value!r} is not one of {', '.join(map(repr, choices))}", option=option, value=value
        )
    return str(value)


def _backoff(value: Any, option: str, default: Backoff) -> Backoff:
    raw = _mapping(value, option, {"base_ms", "cap_ms", "jitter"})
    base = parse_duration(raw.get("base_ms", default.base_ms), f"{option}.base_ms")
    cap = parse_duration(raw.get("cap_ms", default.cap_ms), f"{option}.cap_ms")
    jitter = raw.get("jitter", default.jitter)
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 1:
        raise ConfigError(
            f"{option}.jitter: expected a number in [0, 1], got {jitter!r}", option=f"{option}.jitter", value=jitter
        )
    if cap < base:
        raise ConfigError(f"{option}.cap_ms ({cap} ms) is below base_ms ({base} ms)", option=f"{option}.cap_ms", value=cap)
    return Backoff(base, cap, float(jitter))


DURABILITY_OPTIONS = ("backend", "instance_id", "fail_open", "inbox", "outbox", "poll_ms", "retention")
"""The top-level keys of a bot's ``durability=`` setting (CONF)."""


def parse_durability(value: Any) -> DurabilityConfig:
    """Validate the ``durability=`` setting of a bot. ``{}`` means a fresh
    ``MemoryDurability`` (ENABLE-2).

    What does not depend on the backend is validated once per setting of plain values
    (:func:`_settings`, kept in :data:`_PARSED`): a crash world builds a bot per
    incarnation from the same setting (issue 16). The backend is checked every time."""
    raw = _mapping(
        value,
        "durability",
        set(DURABILITY_OPTIONS),
    )
    backend = raw.get("backend")
    if backend is None:
        backend = MemoryDurability()
    elif not isinstance(backend, DurabilityBackend):
        raise ConfigError(
            f"durability.backend: expected a DurabilityBackend (e.g. FileDurability, store.durability()), "
            f"got {type(backend).__name__}",
            option="durability.backend",
            value=backend,
        )
    key = _plain_key({k: v for k, v in raw.items() if k != "backend"})
    settings = None if key is None else _PARSED.get(key)
    if settings is None:
        settings = _settings(raw)
        if key is not None:
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            _PARSED[key] = settings
    return DurabilityConfig(backend, *settings)


_PARSED: dict[Any, tuple[str | None, bool, InboxConfig, OutboxConfig, float, float]] = {}
"""Settings already validated (:func:`_plain_key` of the setting without its backend ->
what :func:`_settings` gave): the configs are frozen, so bots share them."""
_PARSED_MAX = 256


def _plain_key(value: Any) -> Any:
    """A hashable key telling plain values apart by type as well (``True`` is not ``1``,
    ``1`` is not ``1.0``): dicts item by item, in order, of ``str``, ``int``, ``float``,
    ``bool`` and ``None``; None for anything else (such a setting is validated every
    time)."""
    t = type(value)
    if t is dict:
        items = []
        for k, v in value.items():
            frozen = _plain_key(v)
            if type(k) is not str or frozen is None:
                return None
            items.append((k, frozen))
        return (dict, tuple(items))
    if t is str or t is int or t is float or t is bool or value is None:
        return (t, value)
    return None


def _settings(raw: dict[str, Any]) -> tuple[str | None, bool, InboxConfig, OutboxConfig, float, float]:
    """Everything of the setting ``raw`` but its backend, validated, in the order of the
    fields of :class:`DurabilityConfig`."""
    instance_id = raw.get("instance_id")
    if instance_id is not None and (not isinstance(instance_id, str) or not instance_id.strip()):
        raise ConfigError(
            f"durability.instance_id: expected a non-empty string, got {instance_id!r}",
            option="durability.instance_id", value=instance_id,
        )

    ib = _mapping(raw.get("inbox"), "durability.inbox", {"lease_ms", "max_attempts", "backoff", "media_refs"})
    inbox = InboxConfig(
        lease_ms=parse_duration(ib.get("lease_ms", "60s"), "durability.inbox.lease_ms", minimum=LEASE_MIN_MS),
        max_attempts=_int(ib.get("max_attempts", 5), "durability.inbox.max_attempts", 1),
        backoff=_backoff(ib.get("backoff"), "durability.inbox.backoff", Backoff()),
        media_refs=_bool(ib.get("media_refs", True), "durability.inbox.media_refs"),
    )

    ob = _mapping(
        raw.get("outbox"),
        "durability.outbox",
        {"retries", "backoff", "inline_max_ms", "on_ambiguous", "on_diverged", "max_payload_bytes", "lease_ms"},
    )
    outbox = OutboxConfig(
        retries=_int(ob.get("retries", 5), "durability.outbox.retries", 0),
        backoff=_backoff(ob.get("backoff"), "durability.outbox.backoff", inbox.backoff),
        inline_max_ms=parse_duration(ob.get("inline_max_ms", "15s"), "durability.outbox.inline_max_ms"),
        on_ambiguous=_choice(ob.get("on_ambiguous", "skip"), "durability.outbox.on_ambiguous", ON_AMBIGUOUS),
        on_diverged=_choice(ob.get("on_diverged", "send"), "durability.outbox.on_diverged", ("send", "skip")),
        max_payload_bytes=_int(ob.get("max_payload_bytes", 1024 * 1024), "durability.outbox.max_payload_bytes", 1),
        lease_ms=parse_duration(ob.get("lease_ms", "60s"), "durability.outbox.lease_ms", minimum=LEASE_MIN_MS),  # OUT-17
    )
    poll_ms = parse_duration(raw.get("poll_ms", "1s"), "durability.poll_ms", minimum=POLL_MIN_MS)
    fail_open = _bool(raw.get("fail_open", False), "durability.fail_open")
    retention_ms = parse_duration(raw.get("retention", "7d"), "durability.retention")
    return instance_id, fail_open, inbox, outbox, poll_ms, retention_ms
