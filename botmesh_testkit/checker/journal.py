"""Acknowledged writes against what a reopened backend holds: the check of a power cut.

A write the backend acknowledged (its call returned) must still be there when the
backend is opened again on what the storage made durable — after a power cut, after a
failed write it reported as done. :func:`read_journal` takes the journals of one scope as
the backend answers now; :func:`lost_writes` compares the journals the backend had
acknowledged with those a reopened backend reads back, record by record and field by
field, and names each record missing or changed. Whatever the crash-matrix history check
or a redelivery would have hidden (a lost ``done`` whose message is simply processed
again, a lost inbound no reply depended on) shows here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botmesh.core.backend import DurabilityBackend

from .violation import Violation

__all__ = ["Journal", "lost_writes", "read_journal"]

LIMIT = 100_000
"""Records read per journal (far more than a matrix cell or an I/O-error run writes)."""


@dataclass(frozen=True)
class Journal:
    """The journals of one scope: inbox records by id, outbox records by key, each as
    its JSON form (``to_json()``)."""

    inbox: dict[str, dict[str, Any]]
    outbox: dict[str, dict[str, Any]]

    @property
    def records(self) -> int:
        return len(self.inbox) + len(self.outbox)


async def read_journal(backend: DurabilityBackend, scope: str) -> Journal:
    """The journals of ``scope`` as ``backend`` answers now."""
    inbox = {r.id: r.to_json() for r in await backend.inbox_list(scope, limit=LIMIT)}
    outbox = {r.key: r.to_json() for r in await backend.outbox_list(scope, limit=LIMIT)}
    return Journal(inbox, outbox)


def _changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    fields = sorted(set(before) | set(after))
    return ", ".join(f"{f} {before.get(f)!r} -> {after.get(f)!r}" for f in fields if before.get(f) != after.get(f))


def lost_writes(acknowledged: Journal, reopened: Journal, *, where: str, extra_ids: tuple[str, ...] = (),
                limit: int = 5) -> list[Violation]:
    """The acknowledged records that ``reopened`` lacks or holds changed (one violation
    per journal at most, naming up to ``limit`` records). A record ``reopened`` holds
    beyond them is not judged: a write that failed may still have landed, which the
    engine allows for (a redelivery finds the record). ``where`` says in words what was reopened ("the crash state ...");
    ``extra_ids`` are added to every violation's ids (``BACK-6`` for a file journal,
    ``INB-8`` after an I/O error).

    Ids: an inbound record lost or changed breaks INB-1 (journaled before any handler
    ran) and GUAR-1/GUAR-2 (the restart does not find what the crash left); a send's
    record OUT-1 (journaled before the provider was called, its state stored right after)
    and OUT-2/GUAR-4 (a send recorded ``sent`` goes out again)."""
    out: list[Violation] = []
    for name, before, after, ids in (
        ("inbound", acknowledged.inbox, reopened.inbox, ("INB-1", "GUAR-1", "GUAR-2")),
        ("send", acknowledged.outbox, reopened.outbox, ("OUT-1", "OUT-2", "GUAR-4")),
    ):
        problems: list[str] = []
        for key in sorted(before):
            if key not in after:
                problems.append(f"{key!r} (state {before[key].get('state')!r}) is missing")
            elif after[key] != before[key]:
                problems.append(f"{key!r} changed: {_changes(before[key], after[key])}")
        if problems:
            shown = "; ".join(problems[:limit]) + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")
            out.append(Violation((*ids, *extra_ids),
                                 f"{where}: {len(problems)} acknowledged {name} record(s) not as acknowledged: {shown}"))
    return out
