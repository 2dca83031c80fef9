"""Cells that share a prefix (issue 16, TEST-4): a cell run from a forked copy of one
shared crash-free run is the cell replayed — same crash point, history, deliveries,
verdict — on a correct backend and on a broken one; a harness that does not say it is
``forkable()`` (a third party's) replays its prefix; the matrix's work directories and the
pooled server tables keep a cell what it was."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from botmesh.core.kv_durability import KvDurability
from botmesh_testkit.backends import REGISTRY
from botmesh_testkit.backends.base import BackendHarness
from botmesh_testkit.backends.memory import MemoryHarness
from botmesh_testkit.matrix import Cell, Oracle, Outcome, draw_cells, oracle
from botmesh_testkit.matrix.scratch import WORK_ROOT_ENV, scratch_dir, work_root
from botmesh_testkit.matrix.shared import SharedPrefix, SharedPrefixes, forks, run_cells

spec = pytest.mark.spec
pytest_plugins = ["pytester"]

fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: the shared prefix needs it")


def seen(o: Outcome) -> tuple[Any, ...]:
    """Everything a cell's outcome says, but its real time."""
    return (o.cell, o.crashed, o.crash_point, o.history, o.deliveries, [(v.ids, v.message) for v in o.violations],
            o.ambiguous, o.recovery_lines, o.power_cut_states)


async def drawn(backend: str, workloads: list[str], random_count: int, seed: int) -> tuple[list[Cell], dict[Any, Oracle]]:
    cells: list[Cell] = []
    truths: dict[Any, Oracle] = {}
    for w in workloads:
        with scratch_dir("test-oracle-") as tmp:
            truths[(backend, w)] = await oracle(backend, w, seed, tmp)
        cells += draw_cells(backend, w, truths[(backend, w)], ("skip", "resend"), random_count, seed)
    return cells, truths


@fork_only
@spec("TEST-4", "GUAR-2", "GUAR-3", "GUAR-4", "GUAR-5")
async def test_a_shared_prefix_gives_every_cell_the_outcome_of_its_replay() -> None:
    """Every named and random cell of four workloads, both policies, on ``memory``: the
    outcomes from the forked copies equal the replayed ones field by field."""
    cells, truths = await drawn("memory", ["one-send", "three-sends", "flow", "store-down"], 6, 4)
    replayed = await run_cells(cells, 4, truths, share=False)
    shared = await run_cells(cells, 4, truths, share=True)
    assert [seen(o) for o in shared] == [seen(o) for o in replayed]
    assert all(o.crashed for o in shared) and not any(o.violations for o in shared)


@fork_only
@spec("TEST-4", "OUT-2", "GUAR-4")
async def test_a_planted_bug_is_caught_at_the_same_cells_with_the_same_report(monkeypatch: Any) -> None:
    """An outbox whose ``mark_sent`` acknowledges without writing: the shared prefix
    fails exactly the cells the replay fails, with the same violations and the same
    reproduce command."""

    async def forget(self: Any, scope: str, key: str, **kw: Any) -> bool:
        return True

    monkeypatch.setattr(KvDurability, "outbox_mark_sent", forget)
    cells, truths = await drawn("memory", ["one-send", "three-sends"], 4, 3)
    replayed = await run_cells(cells, 3, truths, share=False)
    shared = await run_cells(cells, 3, truths, share=True)
    failed = [o for o in replayed if o.violations]
    assert failed and any("OUT-2" in v.ids for o in failed for v in o.violations)
    assert [seen(o) for o in shared] == [seen(o) for o in replayed]
    assert [o.report(3) for o in shared if o.violations] == [o.report(3) for o in failed]


@fork_only
@spec("TEST-4")
async def test_recovery_coverage_measured_in_a_forked_copy_is_the_replayed_one() -> None:
    """``measure_recovery``: the lines of recovery code a forked cell reports are those of
    its replay (the tracer runs in the copy)."""
    cells, truths = await drawn("memory", ["one-send"], 0, 2)
    cells = [c for c in cells if c.policy == "skip"][:6]
    replayed = await run_cells(cells, 2, truths, share=False, measure_recovery=True)
    shared = await run_cells(cells, 2, truths, share=True, measure_recovery=True)
    assert [o.recovery_lines for o in shared] == [o.recovery_lines for o in replayed]
    assert any(o.recovery_lines for o in shared)


class ThirdPartyHarness(BackendHarness):
    """A third party's harness (the memory backend underneath) that knows nothing of
    ``forkable()``."""

    name = "third-party"

    def __init__(self, workdir: str | None = None) -> None:
        super().__init__(workdir)
        self.inner = MemoryHarness(self.workdir)

    async def open(self) -> Any:
        return await self.inner.open()

    async def reopen(self) -> Any:
        return await self.inner.reopen()


@spec("TEST-4")
async def test_a_harness_that_is_not_forkable_replays_its_prefix() -> None:
    """A harness without ``forkable()`` (the default False) is not forked: its cells are
    replayed and pass, with the outcomes a plain replay gives; a shared prefix refuses
    it by name."""
    REGISTRY.add("third-party-nofork", ThirdPartyHarness)
    try:
        assert forks("memory") is (hasattr(os, "fork"))
        assert forks("third-party-nofork") is False
        cells, truths = await drawn("third-party-nofork", ["one-send"], 2, 6)
        replayed = await run_cells(cells, 6, truths, share=False)
        shared = await run_cells(cells, 6, truths, share=True)
        assert [seen(o) for o in shared] == [seen(o) for o in replayed]
        assert shared and all(o.crashed and not o.violations for o in shared)
        group = SharedPrefix([c for c in cells if c.policy == "skip"], 6, truths[("third-party-nofork", "one-send")])
        with pytest.raises(ValueError, match="third-party-nofork"):
            await group.build()
    finally:
        REGISTRY.clear()


@fork_only
@spec("TEST-4")
def test_the_items_copies_are_resumed_one_by_one_and_a_cell_outside_the_group_replays() -> None:
    """:class:`SharedPrefixes` (what the pytest items use): each cell's outcome equals its
    replay whichever order they are asked in; a cell its group's run never reached (an
    n past the history) is replayed and does not crash; ``close`` ends the copies."""
    import asyncio

    cells, truths = asyncio.run(drawn("memory", ["three-sends"], 0, 1))
    skip = [c for c in cells if c.policy == "skip"]
    beyond = Cell("memory", "three-sends", "skip", "before", "*", 999)
    group = [*skip, beyond]
    truth = truths[("memory", "three-sends")]
    replayed = asyncio.run(run_cells([*reversed(skip[:5]), beyond], 1, truths, share=False))
    prefixes = SharedPrefixes()
    try:
        got = [prefixes.outcome(c, 1, truth, group, 60.0) for c in [*reversed(skip[:5]), beyond]]
    finally:
        prefixes.close()
    assert [seen(o) for o in got] == [seen(o) for o in replayed]
    assert not got[-1].crashed


@fork_only
@spec("TEST-4", "OUT-2", "GUAR-4")
def test_the_plugin_with_a_shared_prefix_fails_the_same_cells(pytester: pytest.Pytester) -> None:
    """Through pytest: a planted bug (``mark_sent`` that stores nothing) fails the same
    cells with ``--botmesh-shared-prefix`` as without, and the failure still prints the
    command that reproduces the cell."""
    pytester.makeconftest(
        "from botmesh.core.kv_durability import KvDurability\n"
        "async def _forget(self, scope, key, **kw):\n"
        "    return True\n"
        "KvDurability.outbox_mark_sent = _forget\n")
    profile = pytester.path / "tiny.toml"
    profile.write_text('description = "tiny"\nworkloads = ["one-send"]\npolicies = ["skip", "resend"]\n'
                       "random_per_workload = 2\n", encoding="utf-8")
    args = ["-p", "no:cacheprovider", "-q", "-rf", "--botmesh-backend=memory", f"--botmesh-matrix={profile}",
            "--botmesh-seed=3", "--botmesh-parts=matrix"]
    plain = pytester.runpytest_subprocess(*args)
    shared = pytester.runpytest_subprocess(*args, "--botmesh-shared-prefix")

    def failed(result: pytest.RunResult) -> list[str]:
        return sorted(line.split(" - ")[0] for line in result.stdout.lines if line.startswith("FAILED "))

    assert failed(plain) and failed(shared) == failed(plain)
    assert plain.ret == shared.ret == 1
    reproduce = sorted(line.strip() for line in shared.stdout.lines if line.strip().startswith("reproduce:"))
    assert reproduce and reproduce == sorted(
        line.strip() for line in plain.stdout.lines if line.strip().startswith("reproduce:"))


@spec("TEST-4")
def test_the_work_root_is_the_environment_s_else_dev_shm(tmp_path: Path, monkeypatch: Any) -> None:
    """``$BOTMESH_MATRIX_TMPDIR`` chooses where cells' directories go; a value that is no
    directory is refused by name; unset, ``/dev/shm`` when writable."""
    monkeypatch.setenv(WORK_ROOT_ENV, str(tmp_path))
    with scratch_dir("x-") as d:
        assert Path(d).parent == tmp_path
    monkeypatch.setenv(WORK_ROOT_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=WORK_ROOT_ENV):
        work_root()
    monkeypatch.delenv(WORK_ROOT_ENV)
    shm_ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
    assert work_root() == ("/dev/shm" if shm_ok else None)


@spec("TEST-4")
def test_a_scratch_dir_is_removed_with_what_it_holds(tmp_path: Path, monkeypatch: Any) -> None:
    """A cell's directory goes on exit, empty (one ``rmdir``) or holding a tree of files,
    and also when the block raised; a directory already removed is no error."""
    monkeypatch.setenv(WORK_ROOT_ENV, str(tmp_path))
    with scratch_dir("empty-") as empty:
        assert Path(empty).is_dir() and Path(empty).parent == tmp_path
    with pytest.raises(RuntimeError), scratch_dir("full-") as full:
        (Path(full) / "a" / "b").mkdir(parents=True)
        (Path(full) / "a" / "b" / "journal").write_text("x")
        (Path(full) / "top").write_text("y")
        raise RuntimeError("the cell failed")
    with scratch_dir("gone-") as gone:
        os.rmdir(gone)
    assert not Path(empty).exists() and not Path(full).exists() and list(tmp_path.iterdir()) == []


def test_a_harness_reuses_no_storage_unless_it_says_so(tmp_path: Path) -> None:
    """The default of ``reuse_storage()`` and ``forkable()`` is no: a third party's harness
    keeps making its storage as before."""
    h = ThirdPartyHarness(str(tmp_path))
    assert h.reuse_storage() is False and h.forkable() is False
    assert MemoryHarness(str(tmp_path)).forkable() is True


def test_power_cut_io_reuses_one_dead_pid_while_no_process_has_it(tmp_path: Path, monkeypatch: Any) -> None:
    """``PowerCutIO.dead_pid`` (asked at every simulated death of a file backend): the
    pid of an exited process, the same one while it stays free, a new one once a live
    process has it."""
    from botmesh_testkit.crash.fs.recording_io import PowerCutIO

    io = PowerCutIO(tmp_path)
    first = io.dead_pid()
    assert not io.pid_alive(first)
    assert io.dead_pid() == first
    monkeypatch.setattr(PowerCutIO, "pid_alive", lambda self, pid: pid == first)
    second = io.dead_pid()
    assert second != first


@spec("TEST-4", "GUAR-2", "GUAR-4")
async def test_sqlite_cells_from_the_template_database_are_the_cells_from_a_new_one(monkeypatch: Any) -> None:
    """SQLite's ``reuse_storage()`` (a new database copied from the process's template):
    the cells of two workloads give the outcomes they give on a database created by the
    first open, and that database holds the schema the first open makes."""
    import sqlite3

    from botmesh_testkit.backends.sqlite import SQLiteHarness

    cells, truths = await drawn("sqlite", ["one-send", "enqueue"], 2, 5)
    templated = await run_cells(cells, 5, truths, share=False)
    monkeypatch.setattr(SQLiteHarness, "reuse_storage", lambda self: False)
    created = await run_cells(cells, 5, truths, share=False)
    assert [seen(o) for o in templated] == [seen(o) for o in created]
    assert templated and all(o.crashed and not o.violations for o in templated)
    monkeypatch.undo()

    def schema(path: str) -> list[Any]:
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
            return [*rows, conn.execute("PRAGMA user_version").fetchone(), conn.execute("PRAGMA journal_mode").fetchone()]

    shapes = []
    for reuse in (True, False):
        with scratch_dir("test-template-") as tmp:
            h = SQLiteHarness(tmp)
            if reuse:
                assert h.reuse_storage() is True
            backend, _ = await h.open()
            await backend.start()
            await h.close()
            shapes.append(schema(h.path))
    assert shapes[0] == shapes[1] and shapes[0][0]


@spec("TEST-4")
async def test_a_pooled_postgres_table_is_empty_when_the_next_harness_takes_it(tmp_path: Path) -> None:
    """PostgreSQL's ``reuse_storage()``: the table a closed harness gives back is the one
    the next harness takes, empty; ``release_pooled_tables`` drops it."""
    psycopg = pytest.importorskip("psycopg")
    from psycopg import sql

    from botmesh_testkit.backends.postgres import PostgresHarness, release_pooled_tables

    url = os.environ.get("BOTMESH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

    def rows(prefix: str) -> int | None:
        with psycopg.connect(url, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass(%s)", (f"{prefix}durable",)).fetchone()[0] is None:
                return None
            return int(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
                sql.Identifier(f"{prefix}durable"))).fetchone()[0])

    first = PostgresHarness(str(tmp_path / "a"), url=url)
    assert first.reuse_storage() is True
    backend, _ = await first.open()
    await backend.start()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {} (scope, space, key, value, version) VALUES "
                             "('s', 'inbox', 'k', '{{}}', 1)").format(sql.Identifier(f"{first.table_prefix}durable")))
    assert rows(first.table_prefix) == 1
    await first.close()
    second = PostgresHarness(str(tmp_path / "b"), url=url)
    second.reuse_storage()
    backend, _ = await second.open()
    await backend.start()
    assert second.table_prefix == first.table_prefix and rows(second.table_prefix) == 0
    await second.close()
    release_pooled_tables()
    assert rows(first.table_prefix) is None
