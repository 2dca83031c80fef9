"""Claims checked against real settings (the rules of
:mod:`botmesh_testkit.checker.claims`): a crash-surviving claim on settings that cannot
give it is refused naming the setting and its value — first the rules alone, then the
suite's claims item (:mod:`botmesh_testkit.conformance.claims`) run by the plugin as users
run it (pytester, a subprocess), on SQLite, file journals, PostgreSQL and Redis with the
settings for real (private Redis servers of the tests' own; the shared one is never
reconfigured)."""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

import pytest

from botmesh_testkit.checker.claims import settings_violations
from botmesh_testkit.conformance.claims import NOT_REPORTED
from botmesh_testkit.servers import redact_url, skips_allowed

pytest_plugins = ["pytester"]

spec = pytest.mark.spec


@spec("GUAR-1", "GUAR-2")
@pytest.mark.parametrize(("settings", "named"), [
    ({"kind": "sqlite", "synchronous": "1", "journal_mode": "wal"}, "synchronous=NORMAL"),
    ({"kind": "sqlite", "synchronous": "0", "journal_mode": "wal"}, "synchronous=OFF"),
    ({"kind": "sqlite", "synchronous": "2", "journal_mode": "memory"}, "journal_mode=memory"),
    ({"kind": "postgres", "fsync": "on", "synchronous_commit": "off", "full_page_writes": "on"}, "synchronous_commit=off"),
    ({"kind": "postgres", "fsync": "off", "synchronous_commit": "on", "full_page_writes": "on"}, "fsync=off"),
    ({"kind": "postgres", "fsync": "on", "synchronous_commit": "on", "full_page_writes": "off"}, "full_page_writes=off"),
    ({"kind": "redis", "appendonly": "yes", "appendfsync": "everysec"}, "appendfsync=everysec"),
    ({"kind": "redis", "appendonly": "no", "appendfsync": "always"}, "appendonly=no"),
    ({"kind": "file", "fsync": "False"}, "fsync=False"),
])
def test_settings_that_lose_acknowledged_writes_are_named(settings: dict[str, str], named: str) -> None:
    (violation,) = settings_violations(settings, backend="b")
    assert named in violation.message and "power cut" in violation.message
    assert "GUAR-1" in violation.ids


@spec("GUAR-1")
@pytest.mark.parametrize("settings", [
    {"kind": "sqlite", "synchronous": "2", "journal_mode": "wal"},
    {"kind": "sqlite", "synchronous": "3", "journal_mode": "delete"},
    {"kind": "postgres", "fsync": "on", "synchronous_commit": "local", "full_page_writes": "on"},
    {"kind": "postgres", "fsync": "on", "synchronous_commit": "remote_apply", "full_page_writes": "on"},
    {"kind": "redis", "appendonly": "yes", "appendfsync": "always"},
    {"kind": "file", "fsync": "True"},
    {"kind": "someone-elses"},
])
def test_durable_settings_and_unknown_kinds_pass(settings: dict[str, str]) -> None:
    assert settings_violations(settings) == []


def test_a_setting_that_could_not_be_read_is_a_violation() -> None:
    (violation,) = settings_violations({"kind": "redis", "appendonly": "yes"}, backend="b")
    assert "'appendfsync' could not be read" in violation.message


def test_why_a_setting_could_not_be_read_is_in_the_message() -> None:
    violations = settings_violations({"kind": "redis", "unreadable": "CONFIG GET refused: unknown command"}, backend="b")
    assert [v.message.split("'")[1] for v in violations] == ["appendonly", "appendfsync"]
    assert all("could not be read" in v.message and "CONFIG GET refused: unknown command" in v.message
               for v in violations)


# -- the claims check as users run it: the plugin, through pytester ----------------------------

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark", "--botmesh-parts=suite", "-k", "TestClaims", "-rs",
       "--botmesh-report=r.json")
"""The claims item alone (addressed as any suite item is: ``-k TestClaims``), with the
report to read the verdict from."""
BROKEN = ["GUAR-1", "GUAR-2", "INB-1", "OUT-1"]

FACTORIES = '''
import os

from botmesh.core.file_backend import FileKv
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities
from botmesh.sqlite_store import SQLiteKv


class NormalSync(SQLiteKv):
    """Claims survives_crash (SQLiteKv's claim) on a connection that commits without
    syncing the WAL."""

    def _connect(self):
        conn = super()._connect()
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn


def sqlite_normal(workdir):
    return NormalSync(os.path.join(workdir, "bot.db"))


def sqlite_shipped(workdir):
    return SQLiteKv(os.path.join(workdir, "bot.db"))


class UnsyncedButClaims(FileKv):
    """fsync=False, and claims survives_crash nevertheless."""

    capabilities = Capabilities(survives_crash=True)


def file_unsynced_claims(workdir):
    return UnsyncedButClaims(os.path.join(workdir, "journal.json"), append_log=True, fsync=False)


def file_unsynced(workdir):
    return FileKv(os.path.join(workdir, "journal.json"), append_log=True, fsync=False)


class SilentClaims(MemoryKv):
    """Claims survives_crash and does not implement durability_settings()."""

    capabilities = Capabilities(survives_crash=True)


_SILENT = {}


def silent(workdir):
    return _SILENT.setdefault(workdir, SilentClaims())
'''


def _report_of(pytester: pytest.Pytester, name: str) -> dict[str, Any]:
    report = json.loads((pytester.path / "r.json").read_text(encoding="utf-8"))
    (entry,) = [b for b in report["backends"] if b["name"] == name]
    entry["run_verdict"] = report["verdict"]
    return entry  # type: ignore[no-any-return]


def _refused(pytester: pytest.Pytester, result: pytest.RunResult, name: str, named: str) -> None:
    """The run fails, naming the setting and its value; the backend is not certified and
    breaks exactly the ids a lost acknowledged write breaks."""
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert named in out and "power cut" in out, out[-3000:]
    entry = _report_of(pytester, name)
    assert entry["verdict"] == entry["run_verdict"] == "not certified"
    assert entry["parts"]["suite"] == {"passed": 0, "failed": 1, "skipped": 0}
    assert entry["broken"] == BROKEN and entry["verdict_reasons"][0] == f"1 item(s) failed, breaking {', '.join(BROKEN)}"


def _passes(pytester: pytest.Pytester, result: pytest.RunResult, name: str) -> None:
    """The claims item passed: nothing broken (the verdict is partial only because the
    other parts were not selected)."""
    assert result.ret == 0, result.stdout.str()[-3000:]
    entry = _report_of(pytester, name)
    assert entry["parts"]["suite"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert entry["broken"] == [] and set(BROKEN) <= set(entry["held"])
    assert entry["verdict"] == "partial" and all("not selected" in r for r in entry["verdict_reasons"])


def _need(what: str, present: bool) -> None:
    if not present:
        message = f"{what}: the claims tests need it (set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead)"
        if skips_allowed():
            pytest.skip(message)
        pytest.fail(message)


@spec("GUAR-1", "GUAR-2", "INB-1", "OUT-1", "TEST-4")
def test_sqlite_with_synchronous_normal_is_refused_and_the_shipped_sqlite_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=FACTORIES)
    refused = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:sqlite_normal")
    _refused(pytester, refused, "thirdparty:sqlite_normal", "synchronous=NORMAL")
    refused.stdout.fnmatch_lines(["*reported settings: sqlite: synchronous=NORMAL, journal_mode=wal*"])
    for name in ("sqlite", "thirdparty:sqlite_shipped"):
        _passes(pytester, pytester.runpytest_subprocess(*RUN, f"--botmesh-backend={name}"), name)


@spec("GUAR-1", "GUAR-2", "INB-1", "OUT-1", "TEST-4")
def test_a_file_journal_without_fsync_that_claims_survives_crash_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=FACTORIES)
    refused = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:file_unsynced_claims")
    _refused(pytester, refused, "thirdparty:file_unsynced_claims", "fsync=False")
    # the honest one claims nothing: the check is skipped naming the claim
    honest = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:file_unsynced")
    assert honest.ret == 0
    honest.stdout.fnmatch_lines(["SKIPPED * capability not claimed: survives_crash"])
    assert _report_of(pytester, "thirdparty:file_unsynced")["claims"]["survives_crash"] is False
    _passes(pytester, pytester.runpytest_subprocess(*RUN, "--botmesh-backend=file+log"), "file+log")


@spec("BACK-7", "TEST-4")
def test_a_backend_that_does_not_report_its_settings_is_skipped_saying_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=FACTORIES)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:silent")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"SKIPPED * {NOT_REPORTED}"])
    entry = _report_of(pytester, "thirdparty:silent")
    assert [s["reason"] for s in entry["skips"]] == [NOT_REPORTED]


def _postgres_url() -> str:
    return os.environ.get("BOTMESH_POSTGRES_URL") or "postgresql://postgres@127.0.0.1:5432/test"


@spec("GUAR-1", "GUAR-2", "INB-1", "OUT-1", "TEST-4", "BACK-2")
def test_postgres_with_synchronous_commit_off_is_refused(pytester: pytest.Pytester) -> None:
    """The URL's ``options`` set ``synchronous_commit=off`` for every session of the run:
    what the backend's own connections run with is what is judged."""
    pytest.importorskip("psycopg")
    from botmesh_testkit.servers.postgres import pg_probe

    base = _postgres_url()
    _need(f"a PostgreSQL server at {redact_url(base)}", pg_probe(base, 5.0) is None)
    url = base + ("&" if urlsplit(base).query else "?") + "options=-c%20synchronous_commit%3Doff"
    refused = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=postgres", f"--botmesh-postgres-url={url}")
    _refused(pytester, refused, "postgres", "synchronous_commit=off")


@spec("GUAR-1", "TEST-4", "BACK-2")
def test_the_provisioned_private_postgres_passes_the_claims_check(pytester: pytest.Pytester,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("psycopg")
    from botmesh_testkit.servers import find_postgres_bindir

    _need("PostgreSQL binaries (postgres, initdb)", find_postgres_bindir() is not None)
    monkeypatch.delenv("BOTMESH_POSTGRES_URL", raising=False)  # no URL: the plugin starts a private server
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=postgres", "--botmesh-require-services")
    _passes(pytester, result, "postgres")


@spec("GUAR-1", "GUAR-2", "INB-1", "OUT-1", "TEST-4", "BACK-3")
@pytest.mark.parametrize(("appendonly", "appendfsync", "extra", "named"), [
    (True, "everysec", (), "appendfsync=everysec"),
    (False, "always", (), "appendonly=no"),  # the shared server of the machine runs so
    (True, "always", ("--rename-command", "CONFIG", ""), "'appendonly' could not be read"),
], ids=["everysec", "no-aof", "config-renamed"])
def test_redis_without_aof_always_is_refused(pytester: pytest.Pytester, appendonly: bool, appendfsync: str,
                                            extra: tuple[str, ...], named: str) -> None:
    """A private server of the test's own with the setting (the shared one is never
    reconfigured): refused naming it. A server that refuses CONFIG (as managed services
    may) cannot be verified: refused too, saying why."""
    pytest.importorskip("redis")
    from botmesh_testkit.servers import PrivateRedis, find_redis_server

    _need("redis-server", find_redis_server() is not None)
    with PrivateRedis(appendonly=appendonly, appendfsync=appendfsync, extra_args=extra) as server:
        refused = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=redis", f"--botmesh-redis-url={server.url}")
    _refused(pytester, refused, "redis", named)
    if extra:
        refused.stdout.fnmatch_lines(["*CONFIG GET refused: *"])


@spec("GUAR-1", "TEST-4", "BACK-3")
def test_the_provisioned_private_redis_passes_the_claims_check(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("redis")
    from botmesh_testkit.servers import find_redis_server

    _need("redis-server", find_redis_server() is not None)
    monkeypatch.delenv("BOTMESH_REDIS_URL", raising=False)  # no URL: a private server, AOF always
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=redis", "--botmesh-require-services")
    _passes(pytester, result, "redis")
