"""Claims checked against real settings: a backend that claims ``survives_crash`` on
settings that cannot give it is refused with the setting and its value named, without a
kill or a power cut — what a user pointing the plugin at a managed server gets.

A backend reports what it really runs with through ``durability_settings()`` (see
:meth:`botmesh.core.backend.DurabilityBackend.durability_settings`): a mapping with a
``"kind"`` (``"sqlite"``, ``"postgres"``, ``"redis"``, ``"file"``) and the values read
from its live connection or configuration (a setting it could not read left out, with
``"unreadable"`` saying why). :func:`settings_violations` holds them to the rules below;
a kind it does not know is not judged.

* SQLite: ``PRAGMA synchronous`` must be ``FULL`` (2) or ``EXTRA`` (3) — with WAL,
  ``NORMAL`` commits without syncing the log, so a power cut loses acknowledged
  transactions; ``journal_mode`` must not be ``OFF`` or ``MEMORY``.
* PostgreSQL: ``fsync`` ``on``; ``synchronous_commit`` not ``off`` (``local``, ``on``,
  ``remote_write`` and ``remote_apply`` all flush the local WAL before acknowledging);
  ``full_page_writes`` ``on`` (else a torn page after a power cut cannot be repaired).
* Redis: ``appendonly`` ``yes`` and ``appendfsync`` ``always`` (``everysec`` loses up to a
  second of acknowledged writes, ``no`` leaves it to the OS).
* File journals: ``fsync`` true.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .violation import Violation

IDS = ("GUAR-1", "GUAR-2", "INB-1", "OUT-1")
"""What a backend that loses acknowledged writes at a power cut breaks: an admitted
inbound or a journaled send is gone after the restart."""

Rule = tuple[str, Callable[[str], bool], str]
"""``(setting, acceptable(value), what is required)``."""

_SYNC_NAMES = {"0": "OFF", "1": "NORMAL", "2": "FULL", "3": "EXTRA"}

RULES: dict[str, tuple[Rule, ...]] = {
    "sqlite": (
        ("synchronous", lambda v: v.upper() in ("FULL", "EXTRA"), "FULL or EXTRA"),
        ("journal_mode", lambda v: v.lower() not in ("off", "memory"), "not OFF or MEMORY"),
    ),
    "postgres": (
        ("fsync", lambda v: v.lower() == "on", "on"),
        ("synchronous_commit", lambda v: v.lower() != "off", "local, on, remote_write or remote_apply"),
        ("full_page_writes", lambda v: v.lower() == "on", "on"),
    ),
    "redis": (
        ("appendonly", lambda v: v.lower() == "yes", "yes"),
        ("appendfsync", lambda v: v.lower() == "always", "always"),
    ),
    "file": (
        ("fsync", lambda v: v.lower() == "true", "true"),
    ),
}
"""Per kind of backend, the settings a crash-surviving backend needs."""


def settings_violations(settings: Mapping[str, object], *, backend: str = "the backend") -> list[Violation]:
    """The rules of :data:`RULES` that ``settings`` break (empty when it holds them, or
    when its kind is not known). A setting the rules need and ``settings`` lacks is a
    violation too: the claim cannot be verified."""
    kind = str(settings.get("kind", ""))
    why = f"; {settings['unreadable']}" if settings.get("unreadable") else ""
    found: list[Violation] = []
    for name, acceptable, required in RULES.get(kind, ()):
        if name not in settings:
            found.append(Violation(IDS, f"{backend} claims survives_crash, but its {kind} setting {name!r} could "
                                        f"not be read: that acknowledged writes survive a power cut cannot be "
                                        f"verified (required: {required}{why})"))
            continue
        value = str(settings[name])
        if kind == "sqlite" and name == "synchronous":
            value = _SYNC_NAMES.get(value, value).upper()  # PRAGMA synchronous answers a number
        if not acceptable(value):
            found.append(Violation(IDS, f"{backend} claims survives_crash on {kind} with {name}={value}: "
                                        f"acknowledged writes are lost at a power cut (required: {name} {required})"))
    return found
