"""The kill spec of a backend (:class:`~botmesh_testkit.backends.base.KillSpec`): what the
harnesses give, what the tuple form becomes, and that it crosses to a child (pickled).
No child is started here."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from botmesh_testkit.backends import FileHarness, SQLiteHarness
from botmesh_testkit.backends.base import FactorySpec, FileSpec, MemorySpec, PostgresSpec, RedisSpec, SQLiteSpec
from botmesh_testkit.kill import HarnessError, as_kill_spec, spec_for


def test_the_tuple_form_becomes_a_kill_spec() -> None:
    assert as_kill_spec(("file", "j.json")) == FileSpec("j.json")
    assert as_kill_spec(("file", "j.json", 1, 0)) == FileSpec("j.json", append_log=True, fsync=False)
    assert as_kill_spec(["sqlite", "b.db"]) == SQLiteSpec("b.db")
    assert as_kill_spec(("postgres", "postgresql://h/db")) == PostgresSpec("postgresql://h/db", "botmesh_")
    assert as_kill_spec(("redis", "redis://h/0", "p")) == RedisSpec("redis://h/0", "p")
    assert as_kill_spec(("memory",)) == MemorySpec()
    assert as_kill_spec(("factory", "pkg.mod:make", "a", 2)) == FactorySpec("pkg.mod:make", ("a", 2))
    spec = SQLiteSpec("b.db")
    assert as_kill_spec(spec) is spec
    for spec in (FileSpec("j", True), SQLiteSpec("b"), PostgresSpec("u", "t_"), RedisSpec("u", "p"), MemorySpec(),
                 FactorySpec("m:f", (1,))):
        assert as_kill_spec(spec.as_tuple()) == spec


@pytest.mark.parametrize("bad", [("nosuch", "x"), (), ("sqlite",), ("sqlite", "a", "b"), ("memory", "x")])
def test_a_tuple_that_names_no_backend_is_refused(bad: tuple[object, ...]) -> None:
    with pytest.raises(HarnessError, match="backend spec"):
        as_kill_spec(bad)


def test_a_backend_name_gets_its_harness_storage(tmp_path: Path) -> None:
    assert spec_for("sqlite", str(tmp_path)) == SQLiteHarness(str(tmp_path)).kill_spec() == SQLiteSpec(
        str(tmp_path / "bot.db"))
    assert spec_for("file+log", str(tmp_path)) == FileHarness(str(tmp_path), append_log=True).kill_spec()
    assert spec_for("file+log", str(tmp_path)).name == "file+log"
    with pytest.raises(ValueError, match="cannot reach its storage"):
        spec_for("memory", str(tmp_path))


def test_a_kill_spec_is_picklable(tmp_path: Path) -> None:
    for spec in (spec_for("file", str(tmp_path)), spec_for("sqlite", str(tmp_path)), PostgresSpec("u", "t_"),
                 RedisSpec("u", "p"), MemorySpec(), FactorySpec("m:f", (str(tmp_path),))):
        assert pickle.loads(pickle.dumps(spec)) == spec
