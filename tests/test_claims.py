"""Claims checked against real settings (the rules of
:mod:`botmesh_testkit.checker.claims`): a crash-surviving claim on settings that cannot
give it is refused naming the setting and its value."""

from __future__ import annotations

import pytest

from botmesh_testkit.checker.claims import settings_violations

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
