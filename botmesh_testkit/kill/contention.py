"""Seeded workloads for :func:`~botmesh_testkit.kill.workers.run_workers`: what several
processes do at once on one backend to show a race between them, each returning plain
data — what it saw and what it wrote — that :mod:`botmesh_testkit.checker.contention`
judges. The conformance suite's ``multi_process`` items run them; so can the explore
part or a benchmark.

* :func:`cas_increments` (``DurableKv``): read-modify-write increments by
  compare-and-set on a few shared keys, in rounds lined up by barriers.
* :func:`journal_race` (durability backend): every worker journals the same inbound
  records and sends (create-if-absent, INB-4 / OUT-2).
* :func:`claim_rounds` (durability backend): every worker claims every record of one
  journal in each round (every earlier lease expired), then the holders heartbeat, the
  others try to take a live lease and the previous holders write with their stale
  token; at the end the holders settle.

Times are explicit numbers (``now`` is a parameter, nothing reads a clock), so each
round's expectations are exact whatever the interleaving. No workload asserts anything:
it records, and the checker decides.
"""

from __future__ import annotations

from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.errors import VersionConflict
from botmesh.core.records import InboxRecord, OutboxRecord

from .workers import Worker

__all__ = ["MAX_CAS_ATTEMPTS", "cas_increments", "claim_rounds", "journal_race", "owner_of"]

MAX_CAS_ATTEMPTS = 2_000
"""An increment that conflicts this often in a row is given up (and reported)."""


def owner_of(index: int) -> str:
    """The lease owner (``instance_id``) of worker ``index``."""
    return f"process-{index}"


# =========================================================================================
# DurableKv: compare-and-set increments
# =========================================================================================
async def cas_increments(w: Worker) -> dict[str, Any]:
    """``params``: ``scope``, ``space``, ``keys`` (each created beforehand with value
    ``{"count": 0}`` at version 1), ``increments`` (per worker), ``rounds``. Each increment
    picks a key with the worker's rng, then ``get`` and ``put(count + 1,
    expected_version=<the version read>)`` until a put wins. Returns ``wins`` (key,
    expected version, version the put returned, count written), ``seen`` (key, version
    of each ``get`` in order; 0 for a record that was not there), ``conflicts`` and
    ``given_up`` (increments abandoned after :data:`MAX_CAS_ATTEMPTS` conflicts)."""
    kv = w.kv
    if kv is None:
        raise TypeError("cas_increments needs a DurableKv (the target is not a kv nor a KvDurability)")
    p = w.params
    scope, space, keys = p["scope"], p["space"], list(p["keys"])
    increments, rounds = int(p["increments"]), max(1, int(p["rounds"]))
    wins: list[tuple[str, int, int, int]] = []
    seen: list[tuple[str, int]] = []
    conflicts = given_up = 0
    done = 0
    for r in range(rounds):
        await w.barrier()  # the workers start each round together: they contend, not take turns
        share = (increments - done) // (rounds - r)
        for _ in range(share):
            key = w.rng.choice(keys)
            for _attempt in range(MAX_CAS_ATTEMPTS):
                current = await kv.get(scope, space, key)
                if current is None:
                    seen.append((key, 0))
                    given_up += 1
                    break
                seen.append((key, current.version))
                count = current.value.get("count")
                written = (count if isinstance(count, int) else -1) + 1
                try:
                    version = await kv.put(scope, space, key, {"count": written, "by": w.index},
                                           expected_version=current.version)
                except VersionConflict:
                    conflicts += 1
                    continue
                wins.append((key, current.version, version, written))
                break
            else:
                given_up += 1
        done += share
    return {"wins": wins, "seen": seen, "conflicts": conflicts, "given_up": given_up}


# =========================================================================================
# Durability backend: journals and leases
# =========================================================================================
def _backend(w: Worker) -> DurabilityBackend:
    if w.backend is None:
        raise TypeError("this workload needs a durability backend (a KillSpec target)")
    return w.backend


async def journal_race(w: Worker) -> dict[str, Any]:
    """``params``: ``scope``, ``inbox`` and ``outbox`` — records as JSON
    (``InboxRecord.to_json()`` / ``OutboxRecord.to_json()``). Every worker journals
    every one of them (in its own seeded order) under its own owner
    (:func:`owner_of`). Returns ``inbox`` and ``outbox``: (id or key, created, owner of
    the record the call returned)."""
    b = _backend(w)
    p = w.params
    scope = p["scope"]
    items = [("inbox", rec) for rec in p["inbox"]] + [("outbox", rec) for rec in p["outbox"]]
    w.rng.shuffle(items)
    out: dict[str, list[tuple[str, bool, str | None]]] = {"inbox": [], "outbox": []}
    for kind, data in items:
        data = {**data, "owner": owner_of(w.index)}
        if kind == "inbox":
            got, created = await b.inbox_journal(scope, InboxRecord.from_json(data))
            out["inbox"].append((got.id, created, got.owner))
        else:
            sent, created = await b.outbox_journal(scope, OutboxRecord.from_json(data))
            out["outbox"].append((sent.key, created, sent.owner))
    return out


async def _claim(b: DurabilityBackend, kind: str, scope: str, id: str, owner: str, now: float,
                 lease_ms: float) -> Any:
    if kind == "inbox":
        return await b.inbox_claim(scope, id, owner=owner, incarnation=f"{owner}/1", now=now, lease_ms=lease_ms,
                                   recover=False)
    got = await b.outbox_claim(scope, id, owner=owner, incarnation=f"{owner}/1", now=now, lease_ms=lease_ms,
                               recover=False)
    return None if got is None else got[0]


async def _heartbeat(b: DurabilityBackend, kind: str, scope: str, id: str, token: int, lease_until: float) -> bool:
    if kind == "inbox":
        return await b.inbox_heartbeat(scope, id, token=token, lease_until=lease_until)
    return await b.outbox_heartbeat(scope, id, token=token, lease_until=lease_until)


async def _settle(b: DurabilityBackend, kind: str, scope: str, id: str, token: int, now: float, by: str) -> bool:
    if kind == "inbox":
        return await b.inbox_complete(scope, id, token=token, now=now, expires_at=None)
    return await b.outbox_mark_sent(scope, id, token=token, message_id=f"sent-by-{by}", now=now, expires_at=None)


def round_time(t0: float, lease_ms: float, r: int) -> float:
    """``now`` of claim round ``r`` (1-based): far enough after the previous round that
    every lease taken then — also one extended by a heartbeat to ``now + 2 * lease_ms`` —
    has expired."""
    return t0 + r * 4 * lease_ms


async def claim_rounds(w: Worker) -> dict[str, Any]:
    """``params``: ``scope``, ``journal`` (``"inbox"`` or ``"outbox"``), ``ids`` (records
    journaled beforehand, leased until before round 1), ``rounds``, ``t0``, ``lease_ms``.

    Round ``r`` (``now`` = :func:`round_time`): barrier; the worker claims every record
    (its own seeded order) for ``lease_ms``; barrier; then it heartbeats each record it
    won to ``now + 2 * lease_ms``, tries to claim each record it did not win at ``now +
    lease_ms / 2`` (a live lease), and writes with the token of each record it held
    from an earlier round and lost (a heartbeat and a settle with the stale token);
    barrier. After the last round: each worker settles what it holds, and writes once
    more with every stale token it has. Returns ``claims`` (round, id, token, owner,
    lease_until of the record the claim returned; token None when refused),
    ``heartbeats`` (round, id, token, result), ``live_claims`` (round, id, token or
    None), ``stale`` (round, id, operation, stale token, result) and ``settled`` (id,
    token, result)."""
    b = _backend(w)
    p = w.params
    scope, kind, ids = p["scope"], p["journal"], list(p["ids"])
    rounds, t0, lease_ms = int(p["rounds"]), float(p["t0"]), float(p["lease_ms"])
    me = owner_of(w.index)
    held: dict[str, int] = {}  # id -> token of the lease this worker took most recently
    claims: list[tuple[int, str, int | None, str | None, float | None]] = []
    heartbeats: list[tuple[int, str, int, bool]] = []
    live_claims: list[tuple[int, str, int | None]] = []
    stale: list[tuple[int, str, str, int, bool]] = []
    settled: list[tuple[str, int, bool]] = []
    for r in range(1, rounds + 1):
        now = round_time(t0, lease_ms, r)
        await w.barrier()
        order = ids[:]
        w.rng.shuffle(order)
        won: dict[str, int] = {}
        for id in order:
            got = await _claim(b, kind, scope, id, me, now, lease_ms)
            claims.append((r, id, None if got is None else got.token, None if got is None else got.owner,
                           None if got is None else got.lease_until))
            if got is not None:
                won[id] = got.token
        await w.barrier()
        for id in order:
            if id in won:
                ok = await _heartbeat(b, kind, scope, id, won[id], now + 2 * lease_ms)
                heartbeats.append((r, id, won[id], ok))
                continue
            got = await _claim(b, kind, scope, id, me, now + lease_ms / 2, lease_ms)
            live_claims.append((r, id, None if got is None else got.token))
            if got is not None:  # a live lease was taken (reported): hold it like any claim
                won[id] = got.token
            if id in held:
                token = held[id]
                ok = await _heartbeat(b, kind, scope, id, token, now + 3 * lease_ms)
                stale.append((r, id, "heartbeat", token, ok))
                ok = await _settle(b, kind, scope, id, token, now + 1, me)
                stale.append((r, id, "settle", token, ok))
        stale_now = {id: token for id, token in held.items() if id not in won}
        held = {**{id: t for id, t in held.items() if id not in stale_now}, **won}
        await w.barrier()
    end = round_time(t0, lease_ms, rounds) + lease_ms / 4
    await w.barrier()
    for id in ids:
        if id in held:
            ok = await _settle(b, kind, scope, id, held[id], end, me)
            settled.append((id, held[id], ok))
    await w.barrier()
    # every token this worker ever won on a record and no longer holds is stale now
    for _, id, won_token, _, _ in claims:
        if won_token is not None and held.get(id) != won_token:
            ok = await _settle(b, kind, scope, id, won_token, end + 1, me)
            stale.append((rounds + 1, id, "settle", won_token, ok))
    return {"claims": claims, "heartbeats": heartbeats, "live_claims": live_claims, "stale": stale,
            "settled": settled}
