"""The delivery and order rules, in one copy: the crash matrix's history check
(:mod:`.history`) and the kill loops' judge (:mod:`.judge`) both apply them to what the
channel received, against what a crash-free run of the same workload delivered."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from botmesh.core.records import OutboxRecord

from .violation import Violation


def delivery_violation(policy: str, item: Any, want: int, got: int, amb: int, excused: int = 0) -> Violation | None:
    """The rule for one send ``item`` (a ``(chat, text)``) that the crash-free run
    delivered ``want`` times and this run ``got`` times, ``amb`` of its sends being
    accounted for by a ``durability:ambiguous`` event: exactly once, except in the
    ambiguity window of OUT-14 — with ``skip`` never more, with ``resend`` never less.
    ``excused``: sends the crash-free run made for inbounds this run legitimately put in
    the DLQ (INB-7). None when the rule holds."""
    if want == 0:
        return Violation(("OUT-5", "OUT-2"), f"{item} delivered {got}x, the crash-free run never sent it")
    if policy == "skip" and got > want:
        return Violation(("OUT-2", "OUT-14", "GUAR-4"), f"{item} delivered {got}x (duplicate under on_ambiguous=skip)")
    if policy == "skip" and got < want - amb - excused:
        return Violation(("GUAR-2", "OUT-1"), f"{item} delivered {got}x, expected {want} ({amb} ambiguous)")
    if policy == "resend" and got < want - excused:
        return Violation(("OUT-14", "GUAR-2"), f"{item} delivered {got}x, expected {want} "
                                               "(lost under on_ambiguous=resend)")
    if policy == "resend" and got > want + amb:
        return Violation(("OUT-2", "GUAR-4"), f"{item} delivered {got}x, only {amb} ambiguous "
                                              "send(s) account for duplicates")
    return None


def order_streams(outbox: Mapping[str, OutboxRecord]) -> dict[tuple[str, str], str]:
    """``(chat, text) -> stream`` for the sends of an enqueued record and its parts:
    ``"enqueued <first part's key>"`` (the parts linked by ``previous_part``). Texts not
    listed are inline sends (one stream per chat)."""
    streams: dict[tuple[str, str], str] = {}
    for rec in outbox.values():
        if rec.origin != "enqueue":
            continue
        root, seen = rec, {rec.key}
        while root.previous_part is not None and root.previous_part in outbox and root.previous_part not in seen:
            root = outbox[root.previous_part]
            seen.add(root.key)
        streams[(rec.chat_id, str(rec.content.get("text")))] = f"enqueued {root.key!r}"
    return streams


def order_violations(
    want: list[tuple[str, str]], got: list[tuple[str, str]], streams: dict[tuple[str, str], str]
) -> list[Violation]:
    """First deliveries keep the oracle's order within each ordered stream of a chat: its
    inline sends (a handler's replies in the order made, parts included), and each
    enqueued send's parts (``streams``, from :func:`order_streams`). An enqueued send is
    delivered by the sweep whenever it runs, so it has no order with respect to the
    inline replies (OUT-10): on a backend with real I/O the sweep may run while a handler
    journals its reply."""
    found: list[Violation] = []
    for chat in sorted({c for c, _ in want}):
        for stream in sorted({streams.get((chat, t), "inline") for c, t in want if c == chat}):
            want_order = [t for c, t in want if c == chat and streams.get((c, t), "inline") == stream]
            firsts: list[str] = []
            for c, t in got:
                if c == chat and t not in firsts and streams.get((c, t), "inline") == stream:
                    firsts.append(t)
            if [t for t in firsts if t in want_order] != [t for t in want_order if t in firsts]:
                where = "" if stream == "inline" else f" (the parts of {stream})"
                found.append(Violation(("OUT-12", "OUT-11"),
                                       f"chat {chat!r} got {firsts}{where}, expected the order {want_order}"))
    return found
