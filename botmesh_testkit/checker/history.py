"""The crash matrix's history check: after a cell's crash and recovery, the final state
of the journals, the channel's deliveries and the events against the crash-free run of
the same workload (the oracle).

* no admitted inbound lost: every message ends as in the oracle (INB-2, INB-3, GUAR-1,
  GUAR-2);
* each send delivered exactly once, except in the ambiguity window of OUT-14
  (:func:`~.rules.delivery_violation`, GUAR-3, GUAR-4, OUT-2);
* nothing delivered that the oracle did not deliver (OUT-5), parts and replies in order
  (:func:`~.rules.order_violations`, OUT-11, OUT-12);
* no record left unsettled, nothing in a DLQ the oracle did not fill (OUT-7), and the
  metrics agree with the events (OPS-1, OPS-2).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..crash.world import Journals, World
from ..matrix.cells import Oracle, Outcome
from .rules import delivery_violation, order_streams, order_violations
from .violation import Violation


async def check(world: World, truth: Oracle, outcome: Outcome, *, journals: Journals | None = None) -> None:
    """The history checker: append every broken guarantee to ``outcome.violations``.
    ``journals``: the bot's journals as they are now, when the caller has just read them
    (what :meth:`World.drain` returned, nothing run since); else they are read here."""
    assert world.bot is not None and world.bot.durability is not None
    d = world.bot.durability
    policy = outcome.cell.policy
    v = outcome.violations
    if journals is None:
        journals = (await d.inbox.list(), await d.outbox.list())
    inbox: dict[str, Any] = {r.id: r for r in journals[0]}
    outbox: dict[str, Any] = {r.key: r for r in journals[1]}

    # inbound: nothing admitted is lost, everything settles as in the oracle
    for id, state in truth.inbox_states.items():
        rec = inbox.get(id)
        if rec is None:
            v.append(Violation(("GUAR-1", "INB-1"), f"inbound {id!r} has no record after its redelivery"))
        elif rec.state != state:
            ids = ("INB-3", "INB-7") if rec.state == "dead" else ("INB-2", "INB-3")
            v.append(Violation(ids, f"inbound {id!r} ended {rec.state!r}, expected {state!r}"))

    # sends: exactly once, except what an ambiguity event accounts for
    ambiguous_events = world.named("durability:ambiguous")
    ambiguous_texts: Counter[tuple[str, str]] = Counter()
    for event in {e["key"]: e for e in ambiguous_events}.values():
        outcome.ambiguous.append(event["key"])
        rec = outbox.get(event["key"])
        if rec is None:
            v.append(Violation(("OUT-14",), f"ambiguous key {event['key']!r} has no outbox record"))
            continue
        ambiguous_texts[(rec.chat_id, str(rec.content.get("text")))] += 1
    expected = Counter(truth.deliveries)
    delivered = Counter(outcome.deliveries)
    for item in sorted(set(expected) | set(delivered)):
        broken = delivery_violation(policy, item, expected[item], delivered[item], ambiguous_texts[item])
        if broken is not None:
            v.append(broken)

    # order of parts and sends per chat (OUT-11, OUT-12)
    v.extend(order_violations(truth.deliveries, outcome.deliveries, order_streams(outbox)))

    # every record settled; DLQ and metrics consistent
    unsettled = [k for k, r in outbox.items() if r.state not in ("sent", "unknown", "dead")]
    if unsettled:
        v.append(Violation(("OUT-7", "OUT-9"), f"outbox records never settled: {unsettled}"))
    dead = [k for k, r in outbox.items() if r.state == "dead"]
    if len(dead) > truth.outbox_dead:
        v.append(Violation(("OUT-7", "OUT-8"), f"outbox records in the DLQ that a crash-free run does not have: {dead}"))
    unknown = [k for k, r in outbox.items() if r.state == "unknown"]
    if policy == "resend" and unknown:
        v.append(Violation(("OUT-14",), f"records marked unknown under on_ambiguous=resend: {unknown}"))
    if policy == "skip" and len(unknown) > len(ambiguous_events):
        v.append(Violation(("OUT-14", "OPS-1"), f"unknown records {unknown} without a durability:ambiguous event"))
    # the metrics are the final incarnation's: compare with its own events (a dead
    # incarnation may have emitted an event for a key the next one resolves again)
    metrics = d.metrics()
    own = world.named("durability:ambiguous", incarnation=world.incarnations)
    if metrics["outbox_ambiguous"] != len(own):
        v.append(Violation(("OPS-2", "OUT-14"),
                           f"metrics outbox_ambiguous={metrics['outbox_ambiguous']} but {len(own)} ambiguous events"))
    own_dead = world.named("durability:dead", incarnation=world.incarnations)
    if metrics["inbound_dead"] + metrics["outbox_dead"] != len(own_dead):
        v.append(Violation(("OPS-2", "OPS-1"), f"dead counters {metrics['inbound_dead']}+{metrics['outbox_dead']} "
                           f"but {len(own_dead)} durability:dead events"))
