"""The kill loops' judge: the history checker of a real-process run
(:mod:`botmesh_testkit.kill`). It reads the evidence — the messages fed and acknowledged,
the final journals, the delivery ledger, the events and markers of every incarnation,
and optionally a run without harness kills (the :class:`KillOracle`) — and returns the
broken guarantees with their requirement ids, and how each duplicate and each loss was
accounted for (:class:`Accounting`).

Per send against the run without kills it applies the crash matrix's rule
(:func:`~.rules.delivery_violation`); the rest is what only a real run shows: per outbox
key, the ledger against the outbox record; inbound messages in the DLQ only after
``max_attempts`` unfinished executions (INB-7, from the markers of the incarnations that
died); the sends of one handler in order; fencing tokens that only grow (LEASE-2); and
metrics that agree with the events (OPS-2).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from botmesh.core.content import legacy_part_key, part_key, split_text
from botmesh.core.records import InboxRecord, OutboxRecord

from .rules import delivery_violation
from .violation import Violation

if TYPE_CHECKING:  # the evidence types; botmesh_testkit.kill imports this module
    from ..kill.parent import Delivery, Event, Incarnation, Mark


@dataclass
class KillOracle:
    """What a run without harness kills does (children that kill themselves still die):
    deliveries per (chat, text), the final state of each inbound, and the pace."""

    deliveries: Counter[tuple[str, str]]
    inbox_states: dict[str, str]
    markers_per_message: float
    ms_per_message: float
    self_deaths: int = 0
    by_inbound: dict[str, Counter[tuple[str, str]]] = field(default_factory=dict)
    """Deliveries per inbound id (from keys ``<id>:<n>``): what an inbound that the run
    legitimately put in the DLQ (INB-7) may have left unsent."""


@dataclass
class Accounting:
    """How every duplicate and every loss was accounted for."""

    duplicates: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)
    dead_inbound: list[str] = field(default_factory=list)
    duplicate_count: int = 0
    loss_count: int = 0


def unfinished_charged(markers: Iterable[Mark]) -> set[str]:
    """The inbound ids one incarnation may have been charged an execution of (journaled
    or claimed it, or was inside that write: it may have landed) and had not finished
    (completed, killed or put back) by its last marker: the executions its death leaves
    unfinished (INB-7), as an upper bound."""
    charged: set[str] = set()
    finished: set[str] = set()
    open_writes: dict[tuple[str, str], int] = defaultdict(int)
    for m in markers:
        if m.op not in ("inbox.journal", "inbox.claim", "inbox.complete", "inbox.kill", "inbox.retry_later"):
            continue
        key = (m.op, str(m.ident))
        if m.when == "before":
            open_writes[key] += 1
        elif m.when in ("after", "raised"):
            open_writes[key] -= 1
            info = m.info or {}
            if m.when == "after" and m.op == "inbox.journal" and info.get("created"):
                charged.add(str(m.ident))
            if m.when == "after" and m.op == "inbox.claim" and info.get("claimed") is not None:
                charged.add(str(m.ident))
            if m.when == "after" and m.op in ("inbox.complete", "inbox.kill", "inbox.retry_later") and info.get("ok"):
                finished.add(str(m.ident))
    for (op, ident), n in open_writes.items():
        if n > 0 and op in ("inbox.journal", "inbox.claim"):
            charged.add(ident)  # died inside the write: it may have landed
    return charged - finished


def charged_deaths(incarnations: Iterable[Incarnation]) -> dict[str, int]:
    """Per inbound id, how many incarnations may have been charged an execution of it
    (journaled or claimed it, or died inside that write) and died before completing it:
    an upper bound of the unfinished charged executions of INB-7."""
    deaths: Counter[str] = Counter()
    for inc in incarnations:
        if inc.died:
            deaths.update(unfinished_charged(inc.markers))
    return dict(deaths)


def _ambiguous_items(orec: OutboxRecord, out_by_key: dict[str, OutboxRecord],
                     text_limit: int | None) -> list[tuple[str, str]]:
    """The ``(chat, text)`` sends an ambiguous record stands for. Usually its own text.
    But a record journaled whole and claimed before its split landed (the process died
    in between; the engine splits a claimed record after the claim, OUT-13) is left
    ``unknown`` under ``skip`` with its whole text, never split: what it stands for is
    the first part, plus every later part that was never journaled as a record of its
    own (those are never sent; the ones that were journaled are sent and judged by
    their own records)."""
    text = str(orec.content.get("text"))
    parts = split_text(text, text_limit) if text_limit is not None and len(text) > text_limit else [text]
    items = [(orec.chat_id, parts[0])]
    if orec.part == 1:
        for i, part in enumerate(parts[1:], 2):
            if part_key(orec.key, i) not in out_by_key and legacy_part_key(orec.key, i) not in out_by_key:
                items.append((orec.chat_id, part))
    return items


def judge(
    *,
    policy: str,
    max_attempts: int,
    messages: dict[str, tuple[str, str]],
    acked: Iterable[str],
    inbox: list[InboxRecord],
    outbox: list[OutboxRecord],
    ledger: list[Delivery],
    events: list[Event],
    incarnations: list[Incarnation],
    oracle: KillOracle | None = None,
    fail_rate: float = 0.0,
    text_limit: int | None = None,
) -> tuple[list[Violation], Accounting]:
    """The history checker of a real-process run. Pure: it reads the evidence — the
    messages fed and acknowledged, the final journals (read after the last child
    ended), the delivery ledger, the events and markers of every incarnation, and
    optionally a run without harness kills (the oracle) — and returns the violations
    (with requirement ids, as :func:`botmesh_testkit.checker.history.check`) and how each
    duplicate and loss was accounted for. ``text_limit``: the channel's, when it split
    long texts (OUT-12, OUT-13) — see :func:`_ambiguous_items`."""
    v: list[Violation] = []
    acc = Accounting()
    acked = set(acked)
    in_by_id = {r.id: r for r in inbox}
    out_by_key = {r.key: r for r in outbox}

    # -- inbound: admitted means journaled; everything ends done, or dead by the rules --
    deaths = charged_deaths(incarnations)
    excused: Counter[tuple[str, str]] = Counter()
    for id in messages:
        rec = in_by_id.get(id)
        want = oracle.inbox_states.get(id) if oracle is not None else None
        if id not in acked:
            v.append(Violation(("INB-1", "INB-8"), f"inbound {id!r} was never acknowledged (journaled) by any incarnation"))
            continue
        if rec is None:
            v.append(Violation(("GUAR-1", "INB-1"), f"inbound {id!r} was acknowledged but has no inbox record: "
                                                    "an acknowledged journal write was lost"))
        elif rec.state == "dead":
            charged = deaths.get(id, 0)
            if want == "dead" or charged >= max_attempts:
                unsent = oracle.by_inbound.get(id, Counter()) if oracle is not None and want != "dead" else Counter()
                excused.update(unsent)
                acc.dead_inbound.append(f"{id}: in the DLQ after {charged} unfinished execution(s) "
                                        f"(max_attempts {max_attempts}, INB-7): {rec.error}"
                                        + (f"; sends it may have left unmade: {sum(unsent.values())}" if unsent else ""))
            else:
                v.append(Violation(("INB-7", "INB-3"), f"inbound {id!r} is in the DLQ after at most {charged} "
                                                       f"unfinished execution(s), max_attempts is {max_attempts} "
                                                       f"(error {rec.error!r})"))
        elif rec.state != "done":
            v.append(Violation(("INB-3", "INB-2"), f"inbound {id!r} ended {rec.state!r}: never settled"))
        elif want == "dead":
            v.append(Violation(("INB-7", "GUAR-7"), f"inbound {id!r} is done, but it kills every execution: "
                                                    "a run without kills puts it in the DLQ"))

    # -- sends, per key: the ledger against the outbox ----------------------------------
    by_key: dict[str | None, list[Delivery]] = defaultdict(list)
    for d in ledger:
        by_key[d.key].append(d)
    amb_events: dict[str, list[int]] = defaultdict(list)
    for e in events:
        if e.name == "durability:ambiguous":
            amb_events[str(e.payload.get("key"))].append(e.n)
    for d in by_key.get(None, []):
        v.append(Violation(("OUT-1",), f"{(d.chat, d.text)} reached the channel (incarnation {d.n}) while no "
                                       "journaled send was in flight for that chat"))
    for key, ds in by_key.items():
        if key is None:
            continue
        orec = out_by_key.get(key)
        if orec is None:
            v.append(Violation(("OUT-1", "GUAR-2"), f"{key!r} reached the channel {len(ds)}x (incarnations "
                                                    f"{[d.n for d in ds]}) but the outbox has no record of it"))
    for key, orec in out_by_key.items():
        ds = by_key.get(key, [])
        got = len(ds)
        amb = amb_events.get(key, [])
        where = f"incarnations {[d.n for d in ds]}"
        if amb:
            acc.ambiguous.append(f"{key}: ambiguous in incarnation(s) {amb}, delivered {got}x, ended {orec.state}")
        if orec.state in ("pending", "sending", "failed"):
            v.append(Violation(("OUT-7", "OUT-9"), f"outbox {key!r} never settled (state {orec.state!r})"))
        elif orec.state == "dead":
            if not fail_rate:
                v.append(Violation(("OUT-7", "OUT-8"), f"outbox {key!r} is in the DLQ although the channel never "
                                                       f"refused a send: {orec.error}"))
        elif orec.state == "sent" and got == 0:
            v.append(Violation(("OUT-1", "GUAR-4"), f"outbox {key!r} is recorded sent but never reached the channel"))
        elif orec.state == "unknown":
            if policy == "resend":
                v.append(Violation(("OUT-14",), f"outbox {key!r} marked unknown under on_ambiguous=resend"))
            elif not amb:
                v.append(Violation(("OUT-14", "OPS-1"), f"outbox {key!r} is unknown without a durability:ambiguous event"))
            elif got == 0:
                acc.losses.append(f"{key} ({orec.chat_id}, {orec.content.get('text')!r}): never delivered; outbox "
                                  f"unknown after durability:ambiguous in incarnation(s) {amb} (OUT-14 skip)")
                acc.loss_count += 1
        if got > 1:
            acc.duplicate_count += got - 1
            if policy == "skip":
                v.append(Violation(("OUT-2", "OUT-14", "GUAR-4"), f"{key!r} delivered {got}x ({where}) under "
                                                                  "on_ambiguous=skip"))
            elif got - 1 > len(amb):
                v.append(Violation(("OUT-2", "GUAR-4"), f"{key!r} delivered {got}x ({where}), only {len(amb)} "
                                                        "durability:ambiguous event(s) account for duplicates"))
            else:
                acc.duplicates.append(f"{key} delivered {got}x ({where}): resent after durability:ambiguous in "
                                      f"incarnation(s) {amb} (OUT-14 resend)")

    # -- sends of one handler keep their order (OUT-11): <id>:1 before <id>:2 ... ------
    firsts: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for key, ds in by_key.items():
        if key is None or ":" not in key:
            continue
        base, _, nth = key.rpartition(":")
        if nth.isdigit():
            firsts[base].append((ds[0].t, int(nth), key))
    for base, items in firsts.items():
        by_time = [k for _, _, k in sorted(items)]
        by_number = [k for _, _, k in sorted(items, key=lambda x: x[1])]
        if by_time != by_number:
            v.append(Violation(("OUT-11",), f"sends of inbound {base!r} reached the channel in the order {by_time}"))

    # -- against the run without kills (the matrix's oracle rules) ----------------------
    if oracle is not None:
        # several deaths may make one key ambiguous several times (once per incarnation
        # that resolved it): each may add a duplicate under resend, but a key loses at
        # most its one delivery under skip
        delivered = Counter((d.chat, d.text) for d in ledger)
        amb_keys: Counter[tuple[str, str]] = Counter()
        amb_times: Counter[tuple[str, str]] = Counter()
        for key in set(amb_events) | {k for k, r in out_by_key.items() if r.state == "unknown"}:
            orec = out_by_key.get(key)
            if orec is not None:
                for item in _ambiguous_items(orec, out_by_key, text_limit):
                    amb_keys[item] += 1
                    amb_times[item] += max(1, len(set(amb_events.get(key, []))))
        for item in sorted(set(oracle.deliveries) | set(delivered)):
            amb_n = amb_times[item] if policy == "resend" else amb_keys[item]
            broken = delivery_violation(policy, item, oracle.deliveries[item], delivered[item], amb_n, excused[item])
            if broken is not None:
                v.append(broken)

    # -- fencing: every new lease a larger token; no completion under a superseded one --
    claims: dict[tuple[str, str], list[tuple[float, int, int]]] = defaultdict(list)
    for inc in incarnations:
        for m in inc.markers:
            info = m.info or {}
            if m.when != "after":
                continue
            space = m.op.split(".")[0]
            if m.op.endswith(".claim") and info.get("claimed") is not None:
                claims[(space, str(m.ident))].append((m.t, int(info["claimed"]), inc.n))
            elif m.op.endswith(".journal") and info.get("created") and info.get("state") in ("leased", "sending"):
                claims[(space, str(m.ident))].append((m.t, int(info["token"]), inc.n))
    for (space, ident), cs in claims.items():
        tokens = [t for _, t, _ in cs]
        if len(set(tokens)) != len(tokens):
            dup = sorted(t for t, c in Counter(tokens).items() if c > 1)
            v.append(Violation(("REPL-1", "LEASE-2"), f"{space} {ident!r}: fencing token(s) {dup} handed out twice "
                                                      f"(claims by incarnations {[n for _, _, n in cs]})"))
    for inc in incarnations:
        starts: dict[tuple[str, str, int], float] = {}
        for m in inc.markers:
            info = m.info or {}
            if m.op in ("inbox.complete", "outbox.mark_sent") and "token" in info:
                space = m.op.split(".")[0]
                k = (space, str(m.ident), int(info["token"]))
                if m.when == "before":
                    starts[k] = m.t
                elif m.when == "after" and info.get("ok") and k in starts:
                    newer = [n for t, tok, n in claims.get(k[:2], []) if tok > k[2] and t < starts[k]]
                    if newer:
                        v.append(Violation(("LEASE-2",), f"{m.op} {m.ident!r} accepted under token {k[2]} from "
                                                         f"incarnation {inc.n} after incarnation(s) {newer} took a "
                                                         "newer lease"))

    # -- metrics agree with the events of each cleanly stopped incarnation (OPS-2) -------
    for inc in incarnations:
        if inc.end != "stopped" or inc.metrics is None:
            continue
        own = [e for e in events if e.n == inc.n]
        amb_n = sum(1 for e in own if e.name == "durability:ambiguous")
        dead = sum(1 for e in own if e.name == "durability:dead")
        if inc.metrics.get("outbox_ambiguous", 0) != amb_n:
            v.append(Violation(("OPS-2", "OUT-14"), f"incarnation {inc.n}: metrics outbox_ambiguous="
                                                    f"{inc.metrics.get('outbox_ambiguous')} but {amb_n} ambiguous events"))
        if inc.metrics.get("inbound_dead", 0) + inc.metrics.get("outbox_dead", 0) != dead:
            v.append(Violation(("OPS-2", "OPS-1"), f"incarnation {inc.n}: dead counters {inc.metrics.get('inbound_dead')}"
                                                   f"+{inc.metrics.get('outbox_dead')} but {dead} durability:dead events"))
    return v, acc
