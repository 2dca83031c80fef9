"""The crash matrix and its checker (TEST-4): green on the built-in backends, red with the
violated ids on a broken one, deterministic for a seed."""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from botmesh.core.kv_durability import KvDurability
from botmesh_testkit.cli import main
from botmesh_testkit.checker import order_violations
from botmesh_testkit.matrix import POLICIES, Cell, Oracle, cells_for, draw_cells, random_cells, run_matrix
from botmesh_testkit.matrix.profiles import ProfileError, load_profile
from botmesh_testkit.backends import resolve
from botmesh_testkit.crash import World
from botmesh_testkit.matrix.workloads import WORKLOADS, transient
from conftest import collected_parts, shipped_scenario_files

spec = pytest.mark.spec
pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]


@spec("TEST-4", "GUAR-2", "GUAR-3", "GUAR-4", "GUAR-5")
@pytest.mark.parametrize("backend", ["memory", "file", "file+log", "sqlite"])
async def test_full_matrix_is_green(backend: str) -> None:
    """Every crash point of every workload under both policies, plus random cells."""
    result = await run_matrix([backend], list(WORKLOADS), random_per_workload=10, seed=11)
    assert len(result.outcomes) > 300
    assert all(o.crashed for o in result.outcomes if o.cell.point != "*"), "a dry-run point was not reached"
    assert not result.failed, "\n".join(o.report(11) for o in result.failed[:5])


@spec("TEST-4", "OUT-11", "OUT-12", "OUT-10")
def test_the_order_rule_holds_each_stream_and_only_that() -> None:
    """The checker's order rule: a chat's inline sends keep the crash-free run's order,
    and so do the parts of each enqueued send; an enqueued send may land before or after
    the inline replies (the sweep runs when it runs)."""
    want = [("c1", "p1"), ("c1", "reply"), ("c1", "p2"), ("c1", "reply 2"), ("c2", "x")]
    streams = {("c1", "p1"): "enqueued 'r'", ("c1", "p2"): "enqueued 'r'"}
    # the enqueued parts moved around the inline replies, each stream in order: no violation
    assert order_violations(want, [("c1", "reply"), ("c1", "reply 2"), ("c1", "p1"), ("c2", "x"), ("c1", "p2")],
                            streams) == []
    # a redelivered duplicate later on does not count: first deliveries decide
    assert order_violations(want, [("c1", "p1"), ("c1", "reply"), ("c1", "p2"), ("c1", "reply 2"), ("c1", "p1")],
                            streams) == []
    # the parts swapped: caught, naming the stream
    swapped = order_violations(want, [("c1", "p2"), ("c1", "p1"), ("c1", "reply"), ("c1", "reply 2")], streams)
    assert [v.ids for v in swapped] == [("OUT-12", "OUT-11")] and "the parts of enqueued 'r'" in swapped[0].message
    # the inline replies swapped: caught
    inline = order_violations(want, [("c1", "reply 2"), ("c1", "reply"), ("c1", "p1"), ("c1", "p2")], streams)
    assert len(inline) == 1 and "expected the order ['reply', 'reply 2']" in inline[0].message
    # without the streams every send of a chat is one stream: the first order is then a violation
    assert len(order_violations(want, [("c1", "reply"), ("c1", "reply 2"), ("c1", "p1"), ("c1", "p2")], {})) == 1


@spec("TEST-4", "OUT-2", "GUAR-4")
async def test_an_outbox_that_forgets_sent_is_caught(monkeypatch: Any) -> None:
    """A backend whose mark_sent acknowledges without writing: replays send again. The
    checker must name the broken guarantee and print a reproduce command."""

    async def forget(self: Any, scope: str, key: str, **kw: Any) -> bool:
        return True

    monkeypatch.setattr(KvDurability, "outbox_mark_sent", forget)
    result = await run_matrix(["memory"], ["one-send"], seed=3)
    assert result.failed
    text = result.failed[0].report(3)
    assert "OUT-2" in text and "botmesh-testkit run --backend memory --seed 3 --cell" in text


@spec("TEST-4", "LEASE-2")
async def test_a_claim_that_ignores_leases_is_caught(monkeypatch: Any) -> None:
    """An inbox whose claim does nothing (a record never recovered) loses messages."""

    async def never(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(KvDurability, "inbox_claim", never)
    result = await run_matrix(["memory"], ["one-send"], seed=3)
    ids = {i for o in result.failed for v in o.violations for i in v.ids}
    assert "INB-3" in ids


@spec("TEST-4", "INB-5", "INB-3")
async def test_a_replay_given_up_after_a_store_failure_is_caught(monkeypatch: Any) -> None:
    """The ``store-down`` workload: the replays of the restarted bot's first sweep pass
    fail before their handlers. An engine that gives such a replay up (marks it done
    instead of retrying it, INB-5) loses the replies the handler never made: the
    checker must say so; the real engine passes the same cells. (An engine that merely
    forgets to retry is rescued by the lease expiring, LEASE-2: eventual delivery cannot
    tell the two apart, so that is not what this checks.)"""
    from botmesh.core.engine import DurabilityRuntime

    good = await run_matrix(["memory"], ["store-down"], seed=5)
    assert good.outcomes and not good.failed

    async def given_up(self: Any, record: Any, exc: BaseException) -> None:
        now = self._now()
        await self.backend.inbox_complete(self.scope, record.id, token=record.token, now=now,
                                          expires_at=self._expires(now))

    monkeypatch.setattr(DurabilityRuntime, "_inbox_failed", given_up)
    bad = await run_matrix(["memory"], ["store-down"], seed=5)
    ids = {i for o in bad.failed for v in o.violations for i in v.ids}
    assert bad.failed and "GUAR-2" in ids, [o.report(5) for o in bad.failed[:2]]


@spec("TEST-4")
async def test_same_seed_same_cells_same_outcome() -> None:
    a = await run_matrix(["memory"], ["three-sends"], random_per_workload=8, seed=99)
    b = await run_matrix(["memory"], ["three-sends"], random_per_workload=8, seed=99)
    assert [o.cell for o in a.outcomes] == [o.cell for o in b.outcomes]
    assert [(o.passed, o.crash_point, o.deliveries) for o in a.outcomes] == [
        (o.passed, o.crash_point, o.deliveries) for o in b.outcomes
    ]
    other = await run_matrix(["memory"], ["three-sends"], random_per_workload=8, seed=100)
    assert [o.cell for o in other.outcomes if o.cell.point == "*"] != [o.cell for o in a.outcomes if o.cell.point == "*"]


@spec("TEST-3", "TEST-4")
@pytest.mark.parametrize("backend", ["memory", "file"])
async def test_a_drain_hands_back_the_journals_it_found_settled(backend: str, tmp_path: Path) -> None:
    """``World.drain`` returns the journals its last look found settled (what the history
    check then judges instead of reading them again): equal to a fresh read; None when
    the time given ran out with a send still retrying."""
    w = WORKLOADS["three-sends"]
    world = World(resolve(backend)(str(tmp_path)), setup=w.setup)
    try:
        await world.start()
        world.channel.fail_next(transient(), times=8)  # past the inline budget: left to the sweep
        await world.receive("c1", "go", id="m1")
        assert await world.drain(1.0) is None  # a send still waits for its retry
        settled = await world.drain()
        assert settled is not None and world.bot is not None and world.bot.durability is not None
        d = world.bot.durability
        inbox, outbox = await d.inbox.list(), await d.outbox.list()
        assert [r.to_json() for r in settled[0]] == [r.to_json() for r in inbox] and inbox
        assert [r.to_json() for r in settled[1]] == [r.to_json() for r in outbox] and outbox
    finally:
        await world.close()


@spec("TEST-3", "TEST-4")
async def test_a_drain_of_settled_journals_lets_no_time_pass(tmp_path: Path) -> None:
    """Journals settled when the drain begins: it returns them at once, the virtual clock
    where it was and no sweep pass run (nothing is due in them); with a send still to be
    retried, time moves by the poll interval until it went out."""
    w = WORKLOADS["three-sends"]
    world = World(resolve("memory")(str(tmp_path)), setup=w.setup)
    try:
        bot = await world.start()
        assert bot.durability is not None
        poll = bot.durability.config.poll_ms
        await world.receive("c1", "go", id="m1")
        before = world.clock.now()
        passes: list[float] = []
        sweep = bot.durability.sweep

        async def counted() -> None:
            passes.append(world.clock.now())
            await sweep()

        bot.durability.sweep = counted  # type: ignore[method-assign]
        assert await world.drain() is not None
        assert (world.clock.now(), passes) == (before, [])
        world.channel.fail_next(transient(), times=8)  # past the inline budget: left to the sweep
        await world.receive("c1", "again", id="m2")
        started = world.clock.now()
        assert await world.drain() is not None
        assert passes and world.clock.now() > started and (world.clock.now() - started) % poll == 0
    finally:
        await world.close()


@spec("TEST-4")
@pytest.mark.parametrize("discard", [False, True])
async def test_a_discarded_world_leaves_its_file_journal_as_a_death_does(discard: bool, tmp_path: Path) -> None:
    """``World.close(discard=True)`` -- what a crash-matrix cell does, its directory thrown
    away next (issue 16) -- skips what only keeps the storage: the append log is not
    folded into the snapshot and the lock file names a process that is not running, as
    after a death; ``close()`` folds the log and removes the lock. Either way the journal
    opens again with what was acknowledged."""
    from botmesh.core.fileio import default_io

    w = WORKLOADS["one-send"]
    harness = resolve("file+log")(str(tmp_path))
    world = World(harness, setup=w.setup)
    await world.start()
    await world.receive("c1", "go", id="m1")
    assert await world.drain() is not None
    await world.close(discard=discard)
    log, lock = Path(harness.path + ".log"), Path(harness.path + ".lock")
    assert (log.exists(), lock.exists()) == (discard, discard)
    if discard:
        assert log.stat().st_size > 0 and not default_io.pid_alive(int(lock.read_text()))
    again = World(resolve("file+log")(str(tmp_path)), setup=w.setup)
    try:
        bot = await again.start()
        assert bot.durability is not None
        assert [(r.id, r.state) for r in await bot.durability.inbox.list()] == [("m1", "done")]
    finally:
        await again.close()


PROFILE = """description = "two workloads, random cells only matter here"
workloads = ["one-send", "three-sends"]
random_per_workload = 4
"""


def _random_ids(ids: list[str]) -> list[str]:
    return sorted(i.removeprefix("botmesh-matrix::") for i in ids if ":*#" in i)


@spec("TEST-4")
def test_one_seed_draws_the_same_cells_through_every_entry_point(tmp_path: Path, pytester: pytest.Pytester) -> None:
    """The plugin, the CLI, ``run_matrix`` and the benchmark draw their random cells
    through one function: for one seed they are the same cells (they differed between
    ``run_matrix`` and pytest)."""
    profile = tmp_path / "two.toml"
    profile.write_text(PROFILE, encoding="utf-8")
    seed = 8
    api = asyncio.run(run_matrix(["memory"], ["one-send", "three-sends"], random_per_workload=4, seed=seed))
    via_api = _random_ids([o.cell.id for o in api.outcomes])
    assert len(via_api) == 8
    plugin = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--co", "-q", "--botmesh-backend=memory",
                                           f"--botmesh-matrix={profile}", f"--botmesh-seed={seed}",
                                           "--botmesh-parts=matrix")
    assert _random_ids(plugin.stdout.lines) == via_api
    junit = tmp_path / "cli.xml"
    cli = subprocess.run([sys.executable, "-m", "botmesh_testkit.cli", "run", "--backend", "memory", "--matrix",
                          str(profile), "--seed", str(seed), "--parts", "matrix", "--junitxml", str(junit)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert _random_ids([c.get("name", "") for c in ET.parse(junit).getroot().iter("testcase")]) == via_api
    bench = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "crash_cells.py"), "--backends", "memory",
                            "--parts", "cells", "--profile", str(profile), "--seed", str(seed), "--list-cells"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert _random_ids(bench.stdout.splitlines()) == via_api


@spec("TEST-4")
def test_random_cells_are_distinct_for_every_seed() -> None:
    """Item ids must be unique (a duplicate made ``--botmesh-cell`` run one of two, and a
    JUnit file lose a name): over many seeds, no two random cells of a workload are equal,
    and a short history gives as many as it has, not repeats."""
    history = ["inbox.journal", "outbox.journal", "provider.send", "outbox.mark_sent", "inbox.complete"]
    for seed in range(300):
        cells = draw_cells("m", "one-send", Oracle([], {}, 0, history, set()), POLICIES, 25, seed)
        assert len({c.id for c in cells}) == len(cells), seed
        assert len([c for c in cells if c.point == "*"]) == 2 * 2 * len(history)  # the whole room: 20 < 25
    few = random_cells("m", "one-send", history[:1], 9, random.Random(1))
    assert sorted(c.id for c in few) == sorted({c.id for c in few}) and len(few) == 4


def test_cells_cover_every_point_both_ways() -> None:
    cells = cells_for("m", "one-send", ["inbox.journal", "outbox.journal", "inbox.journal"])
    assert len(cells) == 2 * 3 * 2
    assert Cell("m", "one-send", "skip", "after", "inbox.journal", 2) in cells
    assert Cell.parse(cells[0].id) == cells[0]


def test_the_builtin_profiles_load() -> None:
    assert load_profile("smoke").workloads and load_profile("full").workloads


def test_an_unknown_profile_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ProfileError, match="unknown matrix profile 'nope'; choose one of full, smoke"):
        load_profile("nope")


def test_an_unknown_profile_key_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('workload = ["one-send"]\n', encoding="utf-8")
    with pytest.raises(ProfileError, match=r"unknown key\(s\) \['workload'\]; known: description, workloads, "):
        load_profile(str(bad))


@pytest.mark.parametrize(("line", "message"), [
    ("held_ops = -1", "held_ops must be an integer >= 0, got -1"),
    ("held_ops = true", "held_ops must be an integer >= 0, got True"),
    ("held_ops = 2.5", "held_ops must be an integer >= 0, got 2.5"),
    ('held_ops = "24"', "held_ops must be an integer >= 0, got '24'"),
])
def test_a_bad_held_ops_is_refused_naming_the_file_and_the_value(tmp_path: Path, line: str, message: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(f'workloads = ["one-send"]\n{line}\n', encoding="utf-8")
    with pytest.raises(ProfileError, match=re.escape(f"{bad}: {message}")):
        load_profile(str(bad))


def test_held_ops_is_read_from_the_profile_and_off_by_default(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('workloads = ["one-send"]\nheld_ops = 7\n', encoding="utf-8")
    assert load_profile(str(good)).held_ops == 7
    good.write_text('workloads = ["one-send"]\n', encoding="utf-8")
    assert load_profile(str(good)).held_ops == 0


def test_a_bad_cell_id_is_refused() -> None:
    with pytest.raises(ValueError, match="--cell 'x'"):
        Cell.parse("x")


def test_cli_points_lists_every_crash_point_with_its_ids(capsys: Any) -> None:
    assert main(["points"]) == 0
    out = capsys.readouterr().out
    assert "outbox.mark_sent" in out and "provider.send" in out and "GUAR-3" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--backend", "nosuch"], "--backend 'nosuch' is not a known backend"),
    (["run", "--matrix", "huge"], "unknown matrix profile 'huge'"),
])
def test_cli_refuses_bad_arguments_with_status_2(capsys: Any, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.spec("TEST-4")
def test_cli_run_goes_through_pytest_and_writes_junit(tmp_path: Path) -> None:
    """``botmesh-testkit run`` runs pytest with the plugin (suite, scenarios, matrix), in
    a configuration of its own, prints the plugin's summary, and writes JUnit XML."""
    junit = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "botmesh_testkit.cli", "run", "--backend", "memory", "--seed", "5",
           "--parts", "scenarios", "--junitxml", str(junit)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "botmesh durability report" in out.stdout and "seed 5" in out.stdout
    collected = collected_parts(out.stdout)["scenarios"]
    assert collected >= len(shipped_scenario_files())
    assert f"memory: scenarios {collected} passed, 0 failed" in out.stdout
    cases = ET.parse(junit).getroot().iter("testcase")
    assert len(list(cases)) == collected
    one = subprocess.run([sys.executable, "-m", "botmesh_testkit.cli", "run", "--seed", "5", "--cell",
                          "memory/split/resend/after:provider.send#2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "memory: matrix 1 passed, 0 failed" in one.stdout


SERVER_URLS = {
    "postgres": ("BOTMESH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    "redis": ("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0"),
}


@spec("TEST-4")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
async def test_a_server_backend_passes_the_same_points_in_every_dry_run(
    backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a server, the first sweep pass and the first message ran at once and the
    server's replies ordered their points (``inbox.purge`` before or after
    ``outbox.journal``): one seed drew other cells from run to run (four dry runs of
    three-sends gave three histories). The crash world runs a server backend's calls one
    at a time (``World.serial``): the same history in every run."""
    from botmesh_testkit.matrix import oracle

    env, url = SERVER_URLS[backend]
    monkeypatch.setenv(env, __import__("os").environ.get(env, url))
    for workload in ("three-sends", "raises"):
        histories = set()
        for run in range(4):
            workdir = tmp_path / f"{workload}-{run}"
            workdir.mkdir()
            truth = await oracle(backend, workload, 1, str(workdir))
            histories.add(tuple(truth.history))
        assert len(histories) == 1, f"TEST-4: {backend} {workload}: {len(histories)} different dry runs: {histories}"


@spec("TEST-1", "TEST-4")
async def test_serial_wrappers_run_one_call_at_a_time() -> None:
    """Two crashable wrappers given one lock never have two calls in the inner backends
    at once; without it the same two calls overlap."""
    from botmesh.core.memory import MemoryDurability
    from botmesh_testkit.crash import crashable

    inside = 0
    most = 0
    release = asyncio.Event()

    class Slow(MemoryDurability):  # type: ignore[misc]
        async def inbox_list(self, *args: Any, **kwargs: Any) -> Any:
            nonlocal inside, most
            inside += 1
            most = max(most, inside)
            try:
                await release.wait()
                return await super().inbox_list(*args, **kwargs)
            finally:
                inside -= 1

    async def overlap(lock: asyncio.Lock | None) -> int:
        nonlocal most
        most = 0
        release.clear()
        inner = Slow()
        a, b = crashable(inner, serial=lock), crashable(inner, serial=lock)
        calls = [asyncio.ensure_future(w.inbox_list("s")) for w in (a, b)]
        for _ in range(5):
            await asyncio.sleep(0)  # both calls get as far as they can
        release.set()
        await asyncio.gather(*calls)
        return most

    assert await overlap(None) == 2
    assert await overlap(asyncio.Lock()) == 1
