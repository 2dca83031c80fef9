"""The checks of :mod:`botmesh_testkit.checker.contention` on results written by hand:
a clean history passes, and each way a backend can break the contract between
processes is reported with its ids (the suite items feed them what real processes
saw; ``test_multi_process_teeth.py`` shows them catching real races)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from botmesh_testkit.checker.contention import (
    check_cas_increments,
    check_claim_rounds,
    check_journal_race,
    headline,
)

# --------------------------------------------------------------------------------------
# CAS increments: two processes, one key; process 0 wins versions 2 and 4, process 1 wins 3
# --------------------------------------------------------------------------------------


def cas_clean() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    results = [
        {"wins": [("k", 1, 2, 1), ("k", 3, 4, 3)], "seen": [("k", 1), ("k", 2), ("k", 3)], "conflicts": 1, "given_up": 0},
        {"wins": [("k", 2, 3, 2), ("k", 4, 5, 4)], "seen": [("k", 1), ("k", 2), ("k", 4)], "conflicts": 1, "given_up": 0},
    ]
    return results, {"k": (5, {"count": 4})}


def test_a_clean_cas_history_passes() -> None:
    results, final = cas_clean()
    assert check_cas_increments(results, final, increments=2) == []


@pytest.mark.spec("BACK-7", "REPL-1")
@pytest.mark.parametrize("case, expected", [
    ("double-win", "2 puts on 'k' with expected_version=3 all won (processes [0, 1])"),
    ("version-jump", "returned version 6; a version grows by exactly 1"),
    ("count-lost", "4 successful CAS increments, but the record holds count 3 at version 5"),
    ("read-goes-back", "read 'k' at version 1 after it had read version 3"),
    ("given-up", "process 1 gave up 1 increment(s)"),
    ("gone", "'k' is gone after the run"),
    ("stale-value", "get('k') returned count 0 with version 3"),
])
def test_each_cas_violation_is_reported(case: str, expected: str) -> None:
    results, final = cas_clean()
    r0, r1 = results
    if case == "double-win":  # process 1 also "won" version 4 with expected 3: process 0's update lost
        r1["wins"][1] = ("k", 3, 4, 3)
        final["k"] = (4, {"count": 3})
    elif case == "version-jump":
        r1["wins"][1] = ("k", 4, 6, 4)
    elif case == "count-lost":
        final["k"] = (5, {"count": 3})
    elif case == "read-goes-back":
        r0["seen"].append(("k", 1))
    elif case == "given-up":
        r1["given_up"] = 1
        r1["wins"].pop()
    elif case == "gone":
        final["k"] = None
    elif case == "stale-value":
        r1["wins"][0] = ("k", 3, 4, 1)  # wrote count 1 on version 3: it had read count 0
    found = check_cas_increments(results, final, increments=2)
    assert found and all(v.ids == ("BACK-7", "REPL-1") for v in found)
    assert any(expected in v.message for v in found), [str(v) for v in found]
    assert headline(found, "what").startswith("BACK-7/REPL-1: what: ")


# --------------------------------------------------------------------------------------
# journal race: two processes, one inbound id and one outbox key
# --------------------------------------------------------------------------------------
OWNERS = ["process-0", "process-1"]


def journal_clean() -> tuple[list[dict[str, Any]], dict[str, dict[str, str | None]]]:
    results = [
        {"inbox": [("m", True, "process-0")], "outbox": [("k", False, "process-1")]},
        {"inbox": [("m", False, "process-0")], "outbox": [("k", True, "process-1")]},
    ]
    return results, {"inbox": {"m": "process-0"}, "outbox": {"k": "process-1"}}


def test_a_clean_journal_race_passes() -> None:
    assert check_journal_race(*journal_clean(), OWNERS) == []


@pytest.mark.spec("INB-4", "OUT-2", "REPL-4")
@pytest.mark.parametrize("case, ids, expected", [
    ("both-created", ("INB-4", "REPL-4"), "2 created it (processes [0, 1])"),
    ("none-created", ("OUT-2", "REPL-4"), "0 created it"),
    ("overwritten", ("INB-4", "REPL-4"), "created by process 0, but the stored record is owned by 'process-1'"),
    ("own-record", ("OUT-2", "REPL-4"), "process 0 journaled outbox 'k' and was answered with a record owned by 'process-0'"),
])
def test_each_journal_violation_is_reported(case: str, ids: tuple[str, ...], expected: str) -> None:
    results, stored = journal_clean()
    if case == "both-created":
        results[1]["inbox"][0] = ("m", True, "process-1")
    elif case == "none-created":
        results[1]["outbox"][0] = ("k", False, "process-1")
    elif case == "overwritten":
        stored["inbox"]["m"] = "process-1"
    elif case == "own-record":
        results[0]["outbox"][0] = ("k", False, "process-0")
    found = check_journal_race(results, stored, OWNERS)
    assert any(v.ids == ids and expected in v.message for v in found), [str(v) for v in found]


# --------------------------------------------------------------------------------------
# claim rounds: two processes, one record, two rounds; process 0 wins round 1 (token 2),
# process 1 round 2 (token 3) and settles it
# --------------------------------------------------------------------------------------
UNTIL = {1: 100.0, 2: 200.0}


def claims_clean() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    p0 = {"claims": [(1, "r", 2, "process-0", 100.0), (2, "r", None, None, None)],
          "heartbeats": [(1, "r", 2, True)], "live_claims": [(2, "r", None)],
          "stale": [(2, "r", "heartbeat", 2, False), (2, "r", "settle", 2, False), (3, "r", "settle", 2, False)],
          "settled": []}
    p1 = {"claims": [(1, "r", None, None, None), (2, "r", 3, "process-1", 200.0)],
          "heartbeats": [(2, "r", 3, True)], "live_claims": [(1, "r", None)], "stale": [],
          "settled": [("r", 3, True)]}
    return [p0, p1], {"r": {"state": "done", "token": 3, "owner": "process-1"}}


def _claims(results: list[dict[str, Any]], final: dict[str, Any]) -> list[Any]:
    return check_claim_rounds(results, final, journal="inbox", ids=["r"], rounds=2, owners=OWNERS, lease_until=UNTIL,
                              settled_state="done")


def test_a_clean_claim_history_passes() -> None:
    assert _claims(*claims_clean()) == []


@pytest.mark.spec("REPL-1", "LEASE-1", "LEASE-2", "REPL-3")
@pytest.mark.parametrize("case, ids, expected", [
    ("double", ("REPL-1", "LEASE-2"), "round 2: 2 processes claimed inbox 'r' at once"),
    ("nobody", ("LEASE-2", "REPL-1"), "round 2: inbox 'r''s lease had expired, yet none of 2 processes could claim it"),
    ("token-frozen", ("LEASE-2",), "claimed inbox 'r' with fencing token 2, not larger than the previous 2"),
    ("live-taken", ("REPL-1", "LEASE-1"), "round 2: process 0 took inbox 'r' (token 4) while another process's lease"),
    ("stale-accepted", ("LEASE-2", "REPL-1"), "in round 2: process 0's inbox settle of 'r' with the stale token 2 was accepted"),
    ("late-stale", ("LEASE-2", "REPL-1"), "after the records were settled: process 0's inbox settle"),
    ("heartbeat-refused", ("LEASE-1", "REPL-3"), "the heartbeat of process 1, holder of inbox 'r' (token 3), was refused"),
    ("settle-refused", ("LEASE-2",), "process 1, the last holder of inbox 'r' (token 3), could not settle it"),
    ("final-wrong", ("LEASE-2", "REPL-1"), "ends as state 'done', token 2, owner 'process-0'"),
    ("final-gone", ("REPL-1",), "inbox 'r' is gone after the run"),
    ("wrong-lease", ("LEASE-1",), "returned owner 'process-1', lease_until 150.0"),
])
def test_each_claim_violation_is_reported(case: str, ids: tuple[str, ...], expected: str) -> None:
    results, final = claims_clean()
    p0, p1 = results
    if case == "double":
        p0["claims"][1] = (2, "r", 4, "process-0", 200.0)
    elif case == "nobody":
        p1["claims"][1] = (2, "r", None, None, None)
    elif case == "token-frozen":
        p1["claims"][1] = (2, "r", 2, "process-1", 200.0)
        final["r"]["token"] = 2
    elif case == "live-taken":
        p0["live_claims"][0] = (2, "r", 4)
    elif case == "stale-accepted":
        p0["stale"][1] = (2, "r", "settle", 2, True)
    elif case == "late-stale":
        p0["stale"][2] = (3, "r", "settle", 2, True)
    elif case == "heartbeat-refused":
        p1["heartbeats"][0] = (2, "r", 3, False)
    elif case == "settle-refused":
        p1["settled"][0] = ("r", 3, False)
    elif case == "final-wrong":
        final["r"] = {"state": "done", "token": 2, "owner": "process-0"}
    elif case == "final-gone":
        final["r"] = None
    elif case == "wrong-lease":
        p1["claims"][1] = (2, "r", 3, "process-1", 150.0)
    found = _claims(results, final)
    assert any(v.ids == ids and expected in v.message for v in found), [str(v) for v in found]


def test_claim_violations_come_causes_first() -> None:
    """A stale write accepted comes before the expired lease nobody could take that it
    caused; two claims of one record before both."""
    results, final = claims_clean()
    both = copy.deepcopy(results)
    both[0]["stale"][1] = (2, "r", "settle", 2, True)
    both[1]["claims"][1] = (2, "r", None, None, None)
    found = _claims(both, final)
    assert [v.ids for v in found][:2] == [("LEASE-2", "REPL-1"), ("LEASE-2", "REPL-1")]
    assert "stale token" in found[0].message and "none of 2" in found[1].message
    both[0]["claims"][0] = (1, "r", 2, "process-0", 100.0)
    both[1]["claims"][0] = (1, "r", 2, "process-1", 100.0)
    assert _claims(both, final)[0].ids == ("REPL-1", "LEASE-2")
