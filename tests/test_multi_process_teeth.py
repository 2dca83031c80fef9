"""The suite's ``multi_process`` items have teeth (issue 12, "real concurrency for real
claims"): a backend whose compare-and-set is atomic only within one process passes every
in-process concurrency test and fails the items that run real processes, naming the
violated ids; a backend that claims ``multi_process`` but refuses a second process fails
them too; the unmodified SQLite kv passes them through the same path.

As in ``test_kv_conformance_teeth.py`` and ``test_durability_teeth.py``, what a third
party would write goes into a fresh ``pytester`` directory — a module with their kvs
(the classes' source, copied from here) and factories, and a test module binding the
shipped mixins to them — and pytest runs it in a subprocess; the ``-rf`` summary is then
checked item by item.

The planted race: :class:`CheckThenWriteKv`'s ``put`` reads the version in one
statement, pauses 2 ms (the round trip of a slower store; no ``await``, so in one
process no other task runs in between) and then writes over whatever is there. Four
processes start each round together on three keys — more processes than keys, so at
least two pick the same key at once in every round — and each spends most of a put in
that window: a lost update shows in practically every round, and an item runs 4 rounds.
The test still reruns the subprocess (at most :data:`MAX_RUNS` times) until every
expected failure showed, so that even an extraordinarily lucky interleaving cannot make
it flaky; a correct backend's pass never depends on a race (the control). In the same
run, :class:`StaleWritesAccepted` (fenced writes that ignore their token, on SQLite)
fails the claim items with LEASE-2 whatever the interleaving: every record's round-1
token is stale once round 2 took it, and its holder writes with it.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import textwrap
import time
from typing import Any

import pytest
from botmesh.core.errors import VersionConflict
from botmesh.core.file_kv import FileKv
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import Capabilities
from botmesh.sqlite_store import SQLiteKv
from botmesh.sqlite_store._integrity import row_crc

pytest_plugins = ["pytester"]

MAX_RUNS = 3
"""How often the racy run may be repeated before a planted race counts as not caught."""


# --------------------------------------------------------------------------------------
# a third party's kvs (their source is copied into the pytester directory)
# --------------------------------------------------------------------------------------


class CheckThenWriteKv(SQLiteKv):
    """Bug: put() checks the version in one statement and writes in another (an upsert of
    ``expected_version + 1``), with a short pause between. Within one process nothing
    runs in between (no await), so every in-process test passes; another process's put
    lands in the window and is overwritten."""

    async def put(self, scope: str, space: str, key: str, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        with self._lock:
            found = self._version_of(self._connection(), scope, space, key)
        if found != expected_version:
            raise VersionConflict.at(space, key, expected_version, found)
        time.sleep(0.002)  # the planted window
        text = json.dumps(value)
        crc = row_crc(scope, space, key, text, expected_version + 1, due, expires)  # rows carry their checksum
        with self._lock:
            self._connection().execute(
                "INSERT OR REPLACE INTO durable (scope, space, key, value, version, due, expires, crc)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (scope, space, key, text, expected_version + 1, due, expires, crc),
            )
        return expected_version + 1


class StaleWritesAccepted(KvDurability):
    """Bug: the fenced writes ignore the token they are given (they use the record's
    current one): an expired owner's heartbeat, completion or send mark is applied."""

    async def _token(self, scope: str, journal: str, id: str, token: int) -> int:
        rec = await (self.inbox_get(scope, id) if journal == "inbox" else self.outbox_get(scope, id))
        return token if rec is None else rec.token

    async def inbox_heartbeat(self, scope: str, id: str, *, token: int, lease_until: float) -> bool:
        token = await self._token(scope, "inbox", id, token)
        return await super().inbox_heartbeat(scope, id, token=token, lease_until=lease_until)

    async def inbox_complete(self, scope: str, id: str, *, token: int, now: float, expires_at: float | None) -> bool:
        token = await self._token(scope, "inbox", id, token)
        return await super().inbox_complete(scope, id, token=token, now=now, expires_at=expires_at)

    async def outbox_heartbeat(self, scope: str, key: str, *, token: int, lease_until: float) -> bool:
        token = await self._token(scope, "outbox", key, token)
        return await super().outbox_heartbeat(scope, key, token=token, lease_until=lease_until)

    async def outbox_mark_sent(self, scope: str, key: str, *, token: int, message_id: str, now: float,
                               expires_at: float | None) -> bool:
        token = await self._token(scope, "outbox", key, token)
        return await super().outbox_mark_sent(scope, key, token=token, message_id=message_id, now=now,
                                              expires_at=expires_at)


class FileKvClaimingMultiProcess(FileKv):
    """Bug: a file journal (whose pid lock refuses a second live process) claims
    multi_process."""

    capabilities = Capabilities(survives_crash=True, multi_process=True)


_HEADER = '''\
"""A third party's kvs."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from botmesh.core.errors import VersionConflict
from botmesh.core.file_kv import FileKv
from botmesh.core.kv_durability import KvDurability
from botmesh.core.spi import Capabilities
from botmesh.sqlite_store import SQLiteKv
from botmesh.sqlite_store._integrity import row_crc
'''

_FACTORIES = '''
def make_racy(workdir):
    return CheckThenWriteKv(os.path.join(workdir, "racy.db"))


def make_stale(workdir):
    return StaleWritesAccepted(SQLiteKv(os.path.join(workdir, "stale.db")))


def make_file(workdir):
    return FileKvClaimingMultiProcess(os.path.join(workdir, "journal.json"))


def make_sqlite(workdir):
    return SQLiteKv(os.path.join(workdir, "good.db"))


def make_memory(workdir):
    from botmesh.core.memory import MemoryKv
    return MemoryKv()
'''

_TESTS = '''\
import pytest
from botmesh_testkit.backends import resolve
from botmesh_testkit.backends.factory import FactoryHarness
from botmesh_testkit.conformance.durability import LeaseTests, MultiProcessTests
from botmesh_testkit.conformance.kv import ConcurrencyTests
from botmesh_testkit.conformance.kv.multi_process import MultiProcessKvTests

import third_party_kvs


class _Kv(MultiProcessKvTests, ConcurrencyTests):
    pass


class _Backend(MultiProcessTests, LeaseTests):
    pass


class NoSpecHarness(FactoryHarness):
    """A harness of one's own that gives no kill_spec()."""

    def kill_spec(self):
        return None

'''

_NOSPEC = '''\
class TestNospecBackend(MultiProcessTests):
    @pytest.fixture
    def botmesh_harness_factory(self):
        return lambda workdir: NoSpecHarness("sqlite-kv", third_party_kvs.make_sqlite, workdir)
'''


def _bindings(names: list[str]) -> str:
    """A kv-level and a durability-level class per kv; ``memory`` only with the
    multi-process mixins (a new MemoryKv per call is no storage the other tests could
    reopen); ``nospec``: the SQLite kv behind a harness without ``kill_spec()``;
    ``stale``: the durability backend that accepts stale writes."""
    out = [_TESTS]
    for name in names:
        if name == "nospec":
            out.append(_NOSPEC)
            continue
        if name == "stale":  # a durability backend, no kv of its own to bind
            out.append("class TestStaleBackend(MultiProcessTests):\n    @pytest.fixture\n"
                       "    def botmesh_harness_factory(self):\n        return resolve('third_party_kvs:make_stale')\n")
            continue
        cls = name.capitalize()
        kv_base, backend_base = ("MultiProcessKvTests", "MultiProcessTests") if name == "memory" else ("_Kv", "_Backend")
        out.append(f"class Test{cls}Kv(_Kv if {kv_base!r} == '_Kv' else MultiProcessKvTests):\n"
                   f"    make = staticmethod(third_party_kvs.make_{name})\n\n"
                   f"    @pytest.fixture\n    def kv_factory(self, tmp_path):\n"
                   f"        make, workdir = type(self).make, str(tmp_path)\n        return lambda: make(workdir)\n")
        out.append(f"class Test{cls}Backend({backend_base}):\n    name = {name!r}\n\n"
                   f"    @pytest.fixture\n    def botmesh_harness_factory(self):\n"
                   f"        return resolve('third_party_kvs:make_{name}')\n")
    return "\n\n".join(out)


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, names: list[str],
         report: str = "-rfEs") -> tuple[pytest.RunResult, str]:
    pytester.makeini(textwrap.dedent("""\
        [pytest]
        addopts = --strict-markers
        markers =
            spec(*ids): the spec requirement ids a test checks
        filterwarnings =
            error
        """))
    planted = (CheckThenWriteKv, StaleWritesAccepted, FileKvClaimingMultiProcess)
    parts = [_HEADER, *(inspect.getsource(cls) for cls in planted), _FACTORIES]
    pytester.makepyfile(third_party_kvs="\n\n".join(parts))
    pytester.makepyfile(test_third_party=_bindings(names))
    monkeypatch.setenv("COLUMNS", "1000")  # the -rf summary keeps each message's start
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "-q", report, "--tb=line")
    return result, result.stdout.str()


def _missed(lines: list[str], expected: list[tuple[str, str, str]]) -> list[str]:
    """The expected outcomes (class, test glob, id glob or "PASSED") not in the output."""
    missed = []
    for cls, test, spec_id in expected:
        if spec_id == "PASSED":
            failed = f"FAILED test_third_party.py::{cls}::{test}*"
            if any(fnmatch.fnmatchcase(line, failed) for line in lines):
                missed.append(f"{cls}::{test} failed, but must pass")
            continue
        pattern = f"FAILED test_third_party.py::{cls}::{test} - AssertionError: {spec_id}"
        if not any(fnmatch.fnmatchcase(line, pattern) for line in lines):
            missed.append(f"no line matching {pattern!r}")
    return missed


CAS = "test_back7_cas_from_several_processes_loses_no_update"
JOURNALS = "test_repl4_journals_from_several_processes_create_each_record_once"
CLAIMS = "test_repl1_claims_from_several_processes_are_exclusive_and_fenced"

RACY: list[tuple[str, str, str]] = [
    # between processes: caught, naming the ids
    ("TestRacyKv", CAS, "BACK-7/REPL-1:*all won*"),
    ("TestRacyBackend", JOURNALS, "INB-4/REPL-4:*created it*"),
    ("TestRacyBackend", f"{CLAIMS}[[]inbox[]]", "REPL-1/LEASE-2:*claimed*at once*"),
    ("TestRacyBackend", f"{CLAIMS}[[]outbox[]]", "REPL-1/LEASE-2:*claimed*at once*"),
    # within one process the same kv passes every concurrency test: the gap the items close
    ("TestRacyKv", "test_concurrent_cas_on_one_key_has_exactly_one_winner", "PASSED"),
    ("TestRacyKv", "test_concurrent_read_modify_write_loses_no_update", "PASSED"),
    ("TestRacyBackend", "test_repl1_concurrent_claims_have_exactly_one_winner*", "PASSED"),
    ("TestRacyBackend", "test_repl4_two_processes_on_one_storage_claim_exclusively", "PASSED"),
    # fencing that ignores the token: the lost lease's writes land
    ("TestStaleBackend", f"{CLAIMS}[[]inbox[]]", "LEASE-2/REPL-1:*inbox * of*with the stale token*was accepted*"),
    ("TestStaleBackend", f"{CLAIMS}[[]outbox[]]", "LEASE-2/REPL-1:*outbox * of*with the stale token*was accepted*"),
]

REFUSING: list[tuple[str, str, str]] = [
    ("TestFileKv", CAS, "REPL-4:*JournalLockedError*"),
    ("TestFileBackend", JOURNALS, "REPL-4:*JournalLockedError*"),
    ("TestFileBackend", f"{CLAIMS}[[]inbox[]]", "REPL-4:*JournalLockedError*"),
    # a harness that claims multi_process and gives no kill_spec(): the claim cannot be checked
    ("TestNospecBackend", JOURNALS, "REPL-4:*no kill_spec()*"),
    ("TestNospecBackend", f"{CLAIMS}[[]outbox[]]", "REPL-4:*no kill_spec()*"),
]


@pytest.mark.spec("BACK-7", "REPL-1", "REPL-4", "INB-4", "LEASE-2")
def test_a_cas_atomic_only_within_one_process_fails_the_multi_process_items(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BACK-7, REPL-1, REPL-4, INB-4, LEASE-2: a SQLite kv that claims multi_process and
    checks the version and writes in two steps passes the in-process concurrency tests
    of both suites and fails each multi-process item with the violated ids: lost CAS
    updates (BACK-7/REPL-1), a record created by two processes (INB-4/REPL-4), one
    record claimed by two processes at once (REPL-1/LEASE-2). Rerun at most MAX_RUNS
    times until every one showed. In the same run, a backend whose fenced writes
    ignore the token fails the claim items with LEASE-2 (the lost lease's writes
    accepted)."""
    missed: list[str] = []
    out = ""
    for _ in range(MAX_RUNS):
        result, out = _run(pytester, monkeypatch, ["racy", "stale"])
        assert result.ret == 1, f"the multi-process items must fail against the racy kv (exit code 1):\n{out}"
        assert result.parseoutcomes().get("errors", 0) == 0, f"no test may error (only fail):\n{out}"
        missed = _missed(result.outlines, RACY)
        if not missed:
            break
    assert not missed, "the planted race was not caught as expected:\n" + "\n".join(missed) + f"\n{out}"


@pytest.mark.spec("REPL-4")
def test_a_kv_that_refuses_a_second_process_cannot_claim_multi_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """REPL-4: the shipped file journal refuses a second live process (its pid lock), so
    it does not claim multi_process; a copy of it that does claim it fails every
    multi-process item, naming REPL-4 and the refusal (JournalLockedError) of the
    other processes. A harness that claims multi_process but gives no kill_spec() (the
    SQLite kv behind it) fails them too: the claim cannot be checked."""
    result, out = _run(pytester, monkeypatch, ["file", "nospec"])
    assert result.ret == 1, out
    missed = _missed(result.outlines, REFUSING)
    assert not missed, "\n".join(missed) + f"\n{out}"


@pytest.mark.spec("BACK-7", "REPL-1", "REPL-4")
def test_control_the_sqlite_kv_passes_the_same_items_and_memory_skips_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unmodified SQLite kv, bound the same way, passes every multi-process item;
    a MemoryKv (no multi_process claim) has them skipped, naming the claim."""
    result, out = _run(pytester, monkeypatch, ["sqlite", "memory"], report="-rA")
    assert result.ret == 0, out
    for cls, test in (("TestSqliteKv", CAS), ("TestSqliteBackend", JOURNALS), ("TestSqliteBackend", f"{CLAIMS}[[]inbox[]]"),
                      ("TestSqliteBackend", f"{CLAIMS}[[]outbox[]]")):
        assert any(fnmatch.fnmatchcase(line, f"PASSED test_third_party.py::{cls}::{test}") for line in result.outlines), (
            f"{cls}::{test} did not pass:\n{out}")
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert skipped and all("capability not claimed: multi_process" in line for line in skipped), out
    # memory: the kv item, the three durability items (claims per journal) and the in-process one
    assert result.parseoutcomes().get("skipped") == 5, out
