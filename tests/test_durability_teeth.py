"""The shipped durability-level conformance suite has teeth (BACK-7): bound to a
durability backend with one defect, it fails, naming the violated requirement id.

Each broken backend below is a :class:`~botmesh.core.kv_durability.KvDurability` over a
:class:`~botmesh.core.memory.MemoryKv` (or a broken kv) with one defect. What a third party
would write goes into a fresh ``pytester`` directory — a module with their backends (the
classes' source, copied from here) and one factory per backend, and a test module
binding :class:`DurabilityConformance` to each in three lines through
``resolve("third_party_backends:<factory>")`` — and pytest runs it in a subprocess. All
the broken backends run in one subprocess (one ``Test<Backend>`` class each); the short
summary (``-rf``, on a wide terminal) is then checked backend by backend: some test of
that class failed with a message starting with the violated requirement id. A control
run binds a correct backend (claiming ``survives_crash`` and ``multi_process``, so that
no test is skipped: the shipped SQLite kv under ``KvDurability``, since the
``multi_process`` tests run real processes on its storage) the same way and must pass
with exit code 0.

The ``spec`` marker is registered by an ini file (``pytester.makeini``), with
``--strict-markers`` and warnings as errors, because the pytester directory does not see
this project's ``pyproject.toml``.
"""

from __future__ import annotations

import asyncio
import fnmatch
import inspect
import textwrap
from typing import Any

import pytest
from botmesh.core.errors import VersionConflict
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities

pytest_plugins = ["pytester"]


# --------------------------------------------------------------------------------------
# broken backends (their source is copied into the pytester directory)
# --------------------------------------------------------------------------------------


def patch_record(kv: MemoryKv, scope: str, space: str, key: str, **changes: Any) -> None:
    """Overwrite fields of a stored record behind KvDurability's back (index entries
    kept): how the bugs below are planted."""
    value, version, due, expires = kv._space(scope, space)[key]
    kv._space(scope, space)[key] = ({**value, **changes}, version + 1, due, expires)


class NeverExpiringLease(KvDurability):
    """Bug: a lease never expires — a claim ignores lease_until and never takes a leased
    record from another owner (only the recovery claim of LEASE-4 works)."""

    async def inbox_claim(self, scope: str, id: str, **kw: Any) -> InboxRecord | None:
        current = await self.inbox_get(scope, id)
        if current is not None and current.state == "leased" and not (
            kw["recover"] and current.owner == kw["owner"] and current.incarnation != kw["incarnation"]
        ):
            return None
        return await super().inbox_claim(scope, id, **kw)

    async def outbox_claim(self, scope: str, key: str, **kw: Any) -> tuple[OutboxRecord, str] | None:
        current = await self.outbox_get(scope, key)
        if current is not None and current.state == "sending" and not (
            kw["recover"] and current.owner == kw["owner"] and current.incarnation != kw["incarnation"]
        ):
            return None
        return await super().outbox_claim(scope, key, **kw)


class FrozenToken(KvDurability):
    """Bug: the fencing token does not grow — a claim keeps the record's token."""

    async def inbox_claim(self, scope: str, id: str, **kw: Any) -> InboxRecord | None:
        before = await self.inbox_get(scope, id)
        got = await super().inbox_claim(scope, id, **kw)
        if got is None or before is None:
            return got
        patch_record(self.kv, scope, "inbox", id, token=before.token)  # type: ignore[arg-type]
        return got.copy(token=before.token)

    async def outbox_claim(self, scope: str, key: str, **kw: Any) -> tuple[OutboxRecord, str] | None:
        before = await self.outbox_get(scope, key)
        got = await super().outbox_claim(scope, key, **kw)
        if got is None or before is None:
            return got
        patch_record(self.kv, scope, "outbox", key, token=before.token)  # type: ignore[arg-type]
        return got[0].copy(token=before.token), got[1]


class StaleCompletionAccepted(KvDurability):
    """Bug: inbox_complete ignores the fencing token — an expired owner's completion is
    accepted."""

    async def inbox_complete(self, scope: str, id: str, *, token: int, now: float, expires_at: float | None) -> bool:
        current = await self.inbox_get(scope, id)
        if current is not None:
            token = current.token
        return await super().inbox_complete(scope, id, token=token, now=now, expires_at=expires_at)


class ForgetsSent(KvDurability):
    """Bug: the outbox forgets ``sent`` — outbox_mark_sent returns True without
    writing."""

    async def outbox_mark_sent(self, scope: str, key: str, **kw: Any) -> bool:
        return True


class LosesMessageId(KvDurability):
    """Bug: outbox_mark_sent records state sent but loses the provider's message id."""

    async def outbox_mark_sent(
        self, scope: str, key: str, *, token: int, message_id: str, now: float, expires_at: float | None
    ) -> bool:
        return await super().outbox_mark_sent(scope, key, token=token, message_id=None, now=now, expires_at=expires_at)  # type: ignore[arg-type]


class ReversedDue(KvDurability):
    """Bug: an index out of order — ``*_due`` lists the latest first."""

    async def inbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return list(reversed(await super().inbox_due(scope, upto=upto, limit=limit)))

    async def outbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return list(reversed(await super().outbox_due(scope, upto=upto, limit=limit)))


class DueIgnoresUpto(KvDurability):
    """Bug: ``*_due`` lists records not yet due (it ignores ``upto``)."""

    async def inbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return await super().inbox_due(scope, upto=float("inf"), limit=limit)

    async def outbox_due(self, scope: str, *, upto: float, limit: int) -> list[str]:
        return await super().outbox_due(scope, upto=float("inf"), limit=limit)


class SwappedDue(KvDurability):
    """Bug: the sweep's read of both journals (``due``) hands back the outbox's keys as
    the inbox's and the other way round; ``inbox_due`` and ``outbox_due`` are right."""

    async def due(self, scope: str, *, upto: float, limit: int) -> tuple[list[str], list[str]]:
        inbox, outbox = await super().due(scope, upto=upto, limit=limit)
        return outbox, inbox


class ScopeLeakKv(MemoryKv):
    """Bug: the scope is ignored — every scope shares one set of records."""

    def _space(self, scope: str, space: str) -> Any:
        return super()._space("", space)


class ForgetfulKv(MemoryKv):
    """Bug: claims survives_crash, but each instance (each incarnation) starts empty —
    the writes are lost at a restart."""

    capabilities = Capabilities(survives_crash=True)


class PurgeTooMuch(KvDurability):
    """Bug: purge deletes done/sent records that have not expired yet."""

    async def inbox_purge(self, scope: str, *, now: float, limit: int) -> int:
        return await super().inbox_purge(scope, now=float("inf"), limit=limit)

    async def outbox_purge(self, scope: str, *, now: float, limit: int) -> int:
        return await super().outbox_purge(scope, now=float("inf"), limit=limit)


class JournalOverwrites(KvDurability):
    """Bug: journaling an existing id/key overwrites the stored record (a redelivery
    replaces it) instead of returning it."""

    async def inbox_journal(self, scope: str, record: InboxRecord) -> tuple[InboxRecord, bool]:
        found = await self.kv.get(scope, "inbox", record.id)
        if found is None:
            return await super().inbox_journal(scope, record)
        await self.kv.put(scope, "inbox", record.id, record.to_json(), expected_version=found.version, due=record.lease_until)
        return record, False

    async def outbox_journal(self, scope: str, record: OutboxRecord) -> tuple[OutboxRecord, bool]:
        found = await self.kv.get(scope, "outbox", record.key)
        if found is None:
            return await super().outbox_journal(scope, record)
        due = record.lease_until if record.state == "sending" else record.next_at
        await self.kv.put(scope, "outbox", record.key, record.to_json(), expected_version=found.version, due=due)
        return record, False


class ShorteningHeartbeat(KvDurability):
    """Bug: a heartbeat sets lease_until as given, also when that shortens the
    lease."""

    async def inbox_heartbeat(self, scope: str, id: str, *, token: int, lease_until: float) -> bool:
        def change(r: InboxRecord) -> InboxRecord | None:
            return None if r.state != "leased" or r.token != token else r.copy(lease_until=lease_until)

        return await self._in_tx(scope, id, change) is not None

    async def outbox_heartbeat(self, scope: str, key: str, *, token: int, lease_until: float) -> bool:
        def change(r: OutboxRecord) -> OutboxRecord | None:
            return None if r.state != "sending" or r.token != token else r.copy(lease_until=lease_until)

        return await self._out_tx(scope, key, change) is not None


class RacyClaims(KvDurability):
    """Bug: claims are not exclusive under concurrency — every transition reads the
    record, awaits (an I/O round trip), then writes over whatever version is current
    instead of compare-and-set on the version it read."""

    async def _transition(self, scope: str, space: str, key: str, cls: Any, change: Any) -> Any:
        current = await self.kv.get(scope, space, key)
        if current is None:
            return None
        new = change(cls.from_json(current.value))
        if new is None:
            return None
        await asyncio.sleep(0)
        due, expires = self._indexes(new)
        while True:  # last write wins
            latest = await self.kv.get(scope, space, key)
            try:
                await self.kv.put(
                    scope, space, key, new.to_json(), expected_version=latest.version if latest else 0,
                    due=due, expires=expires,
                )
                return new
            except VersionConflict:
                continue


# name -> (factory source, [(test name glob, requirement id the message starts with)])
BROKEN: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "NeverExpiringLease": (
        "NeverExpiringLease(MemoryKv())",
        [("test_lease2_an_expired_lease_is_taken_over_with_a_larger_token*", "LEASE-2")],
    ),
    "FrozenToken": (
        "FrozenToken(MemoryKv())",
        [("test_lease2_an_expired_lease_is_taken_over_with_a_larger_token*", "LEASE-2"),
         ("test_lease2_inbox_tokens_grow_across_every_claim", "LEASE-2"),
         ("test_lease2_outbox_tokens_grow_across_every_claim", "LEASE-2")],
    ),
    "StaleCompletionAccepted": (
        "StaleCompletionAccepted(MemoryKv())",
        [("test_lease2_a_stale_token_is_refused_and_changes_nothing[[]inbox[]]", "LEASE-2")],
    ),
    "ForgetsSent": (
        "ForgetsSent(MemoryKv())",
        [("test_out1_mark_sent_stores_the_message_id", "OUT-1")],
    ),
    "LosesMessageId": (
        "LosesMessageId(MemoryKv())",
        [("test_out1_mark_sent_stores_the_message_id", "OUT-1")],
    ),
    "ReversedDue": (
        "ReversedDue(MemoryKv())",
        [("test_inb3_unfinished_records_are_due_earliest_first", "INB-3"),
         ("test_out7_due_sends_are_listed_earliest_first", "OUT-7")],
    ),
    "DueIgnoresUpto": (
        "DueIgnoresUpto(MemoryKv())",
        [("test_inb3_unfinished_records_are_due_earliest_first", "INB-3"),
         ("test_inb5_retry_later_makes_the_record_pending_until_next_at", "INB-5"),
         ("test_out7_a_failed_send_is_retried_at_next_at", "OUT-7"),
         ("test_lease1_heartbeat_extends_the_lease_and_never_shortens_it*", "LEASE-1")],
    ),
    "SwappedDue": (
        "SwappedDue(MemoryKv())",
        [("test_out7_a_sweep_pass_reads_both_journals_as_their_own_due_reads_do", "INB-3")],
    ),
    "ScopeLeak": (
        "KvDurability(ScopeLeakKv())",
        [("test_scope2_inbox_scopes_never_see_each_other", "SCOPE-2"),
         ("test_scope2_outbox_scopes_never_see_each_other", "SCOPE-2")],
    ),
    "LostWritesAfterRestart": (
        "ForgetfulKv()",
        [("test_inb3_acknowledged_inbox_writes_survive_a_crash", "INB-3"),
         ("test_out2_acknowledged_outbox_writes_survive_a_crash", "OUT-2")],
    ),
    "PurgeTooMuch": (
        "PurgeTooMuch(MemoryKv())",
        [("test_ops3_inbox_purge_removes_only_expired_done_records", "OPS-3"),
         ("test_ops3_outbox_purge_removes_only_expired_sent_records", "OPS-3")],
    ),
    "JournalOverwrites": (
        "JournalOverwrites(MemoryKv())",
        [("test_inb4_journal_of_an_existing_id_returns_the_stored_record", "INB-4"),
         ("test_out2_journal_of_an_existing_key_returns_the_stored_record", "OUT-2")],
    ),
    "ShorteningHeartbeat": (
        "ShorteningHeartbeat(MemoryKv())",
        [("test_lease1_heartbeat_extends_the_lease_and_never_shortens_it*", "LEASE-1")],
    ),
    "RacyClaims": (
        "RacyClaims(MemoryKv())",
        [("test_repl1_concurrent_claims_have_exactly_one_winner*", "REPL-1")],
    ),
}

_CLASSES: list[Any] = [
    NeverExpiringLease, FrozenToken, StaleCompletionAccepted, ForgetsSent, LosesMessageId, ReversedDue,
    DueIgnoresUpto, SwappedDue, ScopeLeakKv, ForgetfulKv, PurgeTooMuch, JournalOverwrites, ShorteningHeartbeat, RacyClaims,
]

_HEADER = '''\
"""A third party's durability backends: fourteen broken ones and a correct one."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from botmesh.core.errors import VersionConflict
from botmesh.core.records import InboxRecord, OutboxRecord
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities
'''

_GOOD_FACTORY = '''
def make_Good(workdir):
    """A new backend on the storage of ``workdir`` at each call (one per incarnation): a
    file that other processes open too (the multi_process tests run real ones)."""
    import os

    from botmesh.sqlite_store import SQLiteKv

    return KvDurability(SQLiteKv(os.path.join(workdir, "good.db")))
'''


def _backends_module() -> str:
    parts = [_HEADER, inspect.getsource(patch_record)]
    parts += [inspect.getsource(cls) for cls in _CLASSES]
    for name, (make, _) in BROKEN.items():
        parts.append(f"def make_{name}(workdir):\n    return {make}\n")
    parts.append(_GOOD_FACTORY)
    return "\n\n".join(parts)


def _test_module(names: list[str]) -> str:
    classes = [
        textwrap.dedent(
            f"""\
            class Test{name}(DurabilityConformance):
                @pytest.fixture
                def botmesh_harness_factory(self):
                    return resolve("third_party_backends:make_{name}")
            """
        )
        for name in names
    ]
    header = (
        "import pytest\n"
        "from botmesh_testkit.backends import resolve\n"
        "from botmesh_testkit.conformance.durability import DurabilityConformance\n\n\n"
    )
    return header + "\n\n".join(classes)


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, names: list[str]) -> tuple[pytest.RunResult, str]:
    """Write the third party's backends and a test module binding the shipped suite to
    each of ``names``, as a third party would, and run pytest on them in a subprocess."""
    pytester.makeini(
        textwrap.dedent(
            """\
            [pytest]
            addopts = --strict-markers
            markers =
                spec(*ids): the spec requirement ids a test checks
            filterwarnings =
                error
            """
        )
    )
    pytester.makepyfile(third_party_backends=_backends_module())
    pytester.makepyfile(test_third_party=_test_module(names))
    monkeypatch.setenv("COLUMNS", "1000")  # the -rf summary keeps each message's start
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "-q", "-rfEs", "--tb=line")
    return result, result.stdout.str()


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-7")
def test_every_broken_backend_is_caught_naming_the_violated_requirement(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BACK-7: each of the fourteen broken backends fails the shipped suite, and the
    failure of the test aimed at its defect starts with the violated requirement id."""
    names = list(BROKEN)
    result, out = _run(pytester, monkeypatch, names)
    assert result.ret == 1, f"the suite must fail against the broken backends (exit code 1):\n{out}"
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) == 0, f"no test may error (only fail):\n{out}"
    lines = result.outlines
    missed: list[str] = []
    for name in names:
        for test, spec_id in BROKEN[name][1]:
            # the message starts with the id (alone, or first of "ID/OTHER-ID:")
            pattern = f"FAILED test_third_party.py::Test{name}::{test} - AssertionError: {spec_id}[:/]*"
            if not any(fnmatch.fnmatchcase(line, pattern) for line in lines):
                missed.append(f"{name}: no line matching {pattern!r}")
        failed = [line for line in lines if line.startswith(f"FAILED test_third_party.py::Test{name}::")]
        assert failed, f"the broken backend {name} passed the whole suite:\n{out}"
    assert not missed, "broken backends not caught with the expected requirement id:\n" + "\n".join(missed) + f"\n{out}"


@pytest.mark.spec("BACK-7")
def test_control_a_correct_backend_passes_through_the_same_path(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BACK-7: a correct backend bound the same way passes with exit code 0; it claims
    survives_crash and multi_process, so nothing is skipped."""
    result, out = _run(pytester, monkeypatch, ["Good"])
    assert result.ret == 0, f"a correct backend must pass the shipped suite:\n{out}"
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 50 and not outcomes.get("skipped"), outcomes
