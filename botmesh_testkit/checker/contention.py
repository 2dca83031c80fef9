"""The verdicts on several processes' concurrent work on one backend: what the workloads
of :mod:`botmesh_testkit.kill.contention` reported (plain data, one result per worker),
and what the backend holds at the end, against the contract. Each check holds for every
interleaving of the processes — it never needs a race to have happened, and it catches
one that broke the contract whenever it did.

* :func:`check_cas_increments` — BACK-7, REPL-1: every successful compare-and-set is
  counted exactly once (no two wins on one version: no lost update), a version grows by
  exactly 1, the final count equals the number of wins, what each process read never
  goes back.
* :func:`check_journal_race` — INB-4, OUT-2, REPL-4: each record created by exactly one
  process, every other one answered with the stored record.
* :func:`check_claim_rounds` — REPL-1, LEASE-1, LEASE-2, REPL-3: one winner per record
  and round, fencing tokens that only grow, a live lease never taken, heartbeats of the
  holder kept, every write with a stale token refused, the final record the last
  holder's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .violation import Violation

__all__ = ["check_cas_increments", "check_claim_rounds", "check_journal_race", "first_failures", "headline"]

CAS_IDS = ("BACK-7", "REPL-1")


def first_failures(violations: list[Violation], limit: int = 8) -> str:
    """The first ``limit`` violations, one a line (and how many more)."""
    lines = [str(v) for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"... and {len(violations) - limit} more")
    return "\n".join(lines)


def headline(violations: list[Violation], what: str) -> str:
    """An assertion message: the first violation's ids, ``what`` was checked, the first
    violation on the same line (a one-line summary shows it), then the first few."""
    first = violations[0]
    return (f"{'/'.join(first.ids)}: {what}: {first.message} ({len(violations)} violation(s) in all)\n"
            f"{first_failures(violations)}")


def check_cas_increments(
    results: list[dict[str, Any]], final: dict[str, tuple[int, dict[str, Any]] | None], *, increments: int
) -> list[Violation]:
    """``results``: :func:`~botmesh_testkit.kill.contention.cas_increments` of each worker
    (index = worker); ``final``: key -> (version, value) read after every worker ended
    (None: the record is gone). Every key started as ``{"count": 0}`` at version 1. The
    violations of a key (two wins on one version, a final count that is not the number
    of wins) come first, then what single processes saw."""
    out: list[Violation] = []
    details: list[Violation] = []
    wins_by_key: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)  # worker, expected, version, count
    for index, res in enumerate(results):
        if res["given_up"]:
            details.append(Violation(CAS_IDS, f"process {index} gave up {res['given_up']} increment(s): a record vanished, "
                                          "or its CAS kept conflicting thousands of times in a row"))
        if len(res["wins"]) + res["given_up"] != increments:
            details.append(Violation(CAS_IDS, f"process {index} made {len(res['wins'])} increments of {increments}"))
        last_seen: dict[str, int] = {}
        last_won: dict[str, int] = {}
        for key, version in res["seen"]:
            if version == 0:
                details.append(Violation(CAS_IDS, f"process {index}: get({key!r}) found no record, which was never deleted"))
            elif version < last_seen.get(key, 0):
                details.append(Violation(CAS_IDS, f"process {index} read {key!r} at version {version} after it had read "
                                              f"version {last_seen[key]}: a version never goes back"))
            last_seen[key] = max(version, last_seen.get(key, 0))
        for key, expected, version, count in res["wins"]:
            wins_by_key[key].append((index, expected, version, count))
            if version != expected + 1:
                details.append(Violation(CAS_IDS, f"process {index}: put({key!r}, expected_version={expected}) returned "
                                              f"version {version}; a version grows by exactly 1 with every put"))
            if count != expected:
                details.append(Violation(CAS_IDS, f"process {index}: get({key!r}) returned count {count - 1} with version "
                                              f"{expected}; every version v holds count v - 1 (one increment per put)"))
            if version <= last_won.get(key, 0):
                details.append(Violation(CAS_IDS, f"process {index} won {key!r} at version {version} after it had won "
                                              f"version {last_won[key]}: versions strictly increase"))
            last_won[key] = max(version, last_won.get(key, 0))
    for key in sorted(set(final) | set(wins_by_key)):
        wins = wins_by_key.get(key, [])
        by_version: dict[int, list[int]] = defaultdict(list)
        for index, _, version, _ in wins:
            by_version[version].append(index)
        for version, who in sorted(by_version.items()):
            if len(who) > 1:
                out.append(Violation(CAS_IDS, f"{len(who)} puts on {key!r} with expected_version={version - 1} all won "
                                              f"(processes {sorted(who)}): exactly one CAS wins, the others raise "
                                              "VersionConflict; the others' updates are lost"))
        stored = final.get(key)
        if stored is None:
            out.append(Violation(CAS_IDS, f"{key!r} is gone after the run; it was only ever put"))
            continue
        version, value = stored
        if version != len(wins) + 1 or value.get("count") != len(wins):
            out.append(Violation(CAS_IDS, f"{key!r}: {len(wins)} successful CAS increments, but the record holds "
                                          f"count {value.get('count')!r} at version {version} (expected count "
                                          f"{len(wins)} at version {len(wins) + 1}): an update was lost or counted twice"))
        missing = sorted(set(range(2, version + 1)) - set(by_version))
        if missing:
            out.append(Violation(CAS_IDS, f"{key!r}: versions {missing[:10]} of {version} were written by no "
                                          "acknowledged put"))
    return out + details


def check_journal_race(results: list[dict[str, Any]], stored: dict[str, dict[str, str | None]],
                       owners: list[str]) -> list[Violation]:
    """``results``: :func:`~botmesh_testkit.kill.contention.journal_race` of each worker;
    ``stored``: ``{"inbox": {id: owner}, "outbox": {key: owner}}`` as read at the end
    (None: missing); ``owners``: each worker's owner, by index."""
    out: list[Violation] = []
    for kind, ids in (("inbox", "INB-4"), ("outbox", "OUT-2")):
        vio = (ids, "REPL-4")
        created: dict[str, list[int]] = defaultdict(list)
        answers: dict[str, list[tuple[int, str | None]]] = defaultdict(list)
        for index, res in enumerate(results):
            for id, was_created, owner in res[kind]:
                answers[id].append((index, owner))
                if was_created:
                    created[id].append(index)
        for id in sorted(set(answers) | set(stored[kind])):
            who = created.get(id, [])
            holder = stored[kind].get(id)
            if len(who) != 1:
                out.append(Violation(vio, f"{len(answers[id])} processes journaled {kind} {id!r} at once: exactly one "
                                          f"creates it, the others get the stored record; {len(who)} created it "
                                          f"(processes {who})"))
                continue
            if holder != owners[who[0]]:
                out.append(Violation(vio, f"{kind} {id!r} was created by process {who[0]}, but the stored record is "
                                          f"owned by {holder!r}: a later journal overwrote it"))
            for index, owner in answers[id]:
                if owner != holder:
                    out.append(Violation(vio, f"process {index} journaled {kind} {id!r} and was answered with a record "
                                              f"owned by {owner!r}; the stored one is {holder!r}'s"))
    return out


def check_claim_rounds(
    results: list[dict[str, Any]], final: dict[str, dict[str, Any] | None], *, journal: str, ids: list[str],
    rounds: int, owners: list[str], lease_until: dict[int, float], settled_state: str,
) -> list[Violation]:
    """``results``: :func:`~botmesh_testkit.kill.contention.claim_rounds` of each worker;
    ``final``: id -> the record (as JSON) read at the end; ``lease_until``: round -> the
    ``lease_until`` a claim in that round must set; ``settled_state``: ``done`` or
    ``sent``. The violations come causes first: two claims of one record, a write with
    a stale token accepted, a live lease taken, then fencing tokens and expired leases
    nobody could take (often the consequence of the former), heartbeats, the final
    records, and the details of a claim's answer."""
    double: list[Violation] = []
    stale: list[Violation] = []
    live: list[Violation] = []
    fencing: list[Violation] = []
    rest: list[Violation] = []
    details: list[Violation] = []
    winners: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)  # (round, id) -> [(worker, token)]
    for index, res in enumerate(results):
        for r, id, token, owner, until in res["claims"]:
            if token is None:
                continue
            winners[(r, id)].append((index, token))
            if owner != owners[index] or until != lease_until[r]:
                details.append(Violation(("LEASE-1",), f"round {r}: process {index}'s claim of {journal} {id!r} returned "
                                                       f"owner {owner!r}, lease_until {until!r}; expected "
                                                       f"{owners[index]!r} until {lease_until[r]!r}"))
    last: dict[str, tuple[int, int]] = {}
    for id in ids:
        previous = 1  # the journaled record's token
        for r in range(1, rounds + 1):
            won = winners.get((r, id), [])
            if not won:
                fencing.append(Violation(("LEASE-2", "REPL-1"), f"round {r}: {journal} {id!r}'s lease had expired, yet "
                                                                f"none of {len(results)} processes could claim it"))
                continue
            if len(won) > 1:
                double.append(Violation(("REPL-1", "LEASE-2"),
                                        f"round {r}: {len(won)} processes claimed {journal} {id!r} at once "
                                        f"(processes {[i for i, _ in won]}, tokens {[t for _, t in won]}): two "
                                        "replicas never claim the same record"))
            for index, token in won:
                if token <= previous:
                    fencing.append(Violation(("LEASE-2",), f"round {r}: process {index} claimed {journal} {id!r} with "
                                                           f"fencing token {token}, not larger than the previous "
                                                           f"{previous}: tokens only grow"))
            previous = max([previous, *(t for _, t in won)])
            last[id] = won[0]
    for index, res in enumerate(results):
        for r, id, op, token, ok in res["stale"]:
            if ok:
                when = "after the records were settled" if r > rounds else f"in round {r}"
                stale.append(Violation(("LEASE-2", "REPL-1"), f"{when}: process {index}'s {journal} {op} of {id!r} "
                                                              f"with the stale token {token} was accepted; an expired "
                                                              "owner's writes are refused"))
        for r, id, token in res["live_claims"]:
            if token is not None and winners.get((r, id)):
                live.append(Violation(("REPL-1", "LEASE-1"), f"round {r}: process {index} took {journal} {id!r} (token "
                                                             f"{token}) while another process's lease on it was live"))
        for r, id, token, ok in res["heartbeats"]:
            if not ok:
                rest.append(Violation(("LEASE-1", "REPL-3"), f"round {r}: the heartbeat of process {index}, holder of "
                                                             f"{journal} {id!r} (token {token}), was refused"))
        for id, token, ok in res["settled"]:
            if not ok:
                rest.append(Violation(("LEASE-2",), f"process {index}, the last holder of {journal} {id!r} (token "
                                                    f"{token}), could not settle it"))
    for id in ids:
        rec = final.get(id)
        if id not in last:
            continue
        index, token = last[id]
        if rec is None:
            rest.append(Violation(("REPL-1",), f"{journal} {id!r} is gone after the run"))
        elif (rec.get("state"), rec.get("token"), rec.get("owner")) != (settled_state, token, owners[index]):
            rest.append(Violation(("LEASE-2", "REPL-1"),
                                  f"{journal} {id!r} ends as state {rec.get('state')!r}, token {rec.get('token')!r}, "
                                  f"owner {rec.get('owner')!r}; its last holder was {owners[index]!r} with token "
                                  f"{token}, which settled it ({settled_state!r})"))
    return double + stale + live + fencing + rest + details
