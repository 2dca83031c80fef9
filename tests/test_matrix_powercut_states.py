"""Power-cut crash states in the crash matrix (issue 11 item 2, BACK-6, GUAR-1, GUAR-2,
INB-1, OUT-1): for the file backends a crashed cell also reopens and recovers from the
crash states a power cut at its crash point could leave (``PowerCutIO``, no FUSE).

Teeth first, as users run it (pytester, ``--botmesh-backend=module:Harness``): a journal
that renames its new snapshot into place without fsyncing it, and one that acknowledges
an append before any fsync, each fail the matrix naming the ids and the state; the real
file journals with ``fsync=True`` pass the same profile having recovered from states of
their own. Then the pieces: which states a cell picks, the world fork each state
recovers in, and that a journal claiming no ``survives_crash`` is not judged by them.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from botmesh.core.testing import MockProvider
from botmesh_testkit.backends import FileHarness
from botmesh_testkit.backends.registry import HARNESSES
from botmesh_testkit.crash import World
from botmesh_testkit.crash.fs import PersistenceModel
from botmesh_testkit.matrix import run_matrix
from botmesh_testkit.matrix.powercut_states import MAX_STATES_PER_CELL, choose
from botmesh_testkit.matrix.run import make_world, play, recover
from botmesh_testkit.matrix.workloads import WORKLOADS

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")
PROFILE = ('description = "one-send, both policies, no loops"\nworkloads = ["one-send"]\n'
           'random_per_workload = 1\nkills = 0\n')

BUGGY = '''
"""Planted: file journals that acknowledge writes a power cut loses."""
import os

from botmesh.core.file_backend import FileDurability, FileKv
from botmesh.core.file_format import snapshot_bytes
from botmesh_testkit.backends.file import FileHarness


class RenameWithoutFsyncKv(FileKv):
    """Renames the new snapshot into place (and fsyncs the directory) without having
    fsynced the new file first."""

    def _write_snapshot(self, records, log_seq):
        tmp = self.path + ".tmp"
        self._io.write_file(tmp, snapshot_bytes(records, log_seq), fsync=False)
        self._io.replace(tmp, self.path)
        self._io.fsync_dir(os.path.dirname(self.path))


class AckBeforeFsyncKv(FileKv):
    """Appends each entry and acknowledges it before any fsync (the log is only made
    durable by the next compaction)."""

    def _commit_to_log(self, *args):
        self._fsync = False
        try:
            super()._commit_to_log(*args)
        finally:
            self._fsync = True


class RenameWithoutFsync(FileHarness):
    async def _open(self):
        kv = RenameWithoutFsyncKv(self.path, io=self.io)
        await kv.open()
        return FileDurability(kv)


class AckBeforeFsync(FileHarness):
    def __init__(self, workdir=None):
        super().__init__(workdir, append_log=True)

    async def _open(self):
        kv = AckBeforeFsyncKv(self.path, append_log=True, io=self.io)
        await kv.open()
        return FileDurability(kv)
'''

SUMMARY = re.compile(r"matrix power-cut states: (\d+) recovered in (\d+) crashed cells, besides each cell's own "
                     r"recovery \(at most \d+ a cell\); (\d+) broke a guarantee")


def _counts(out: str) -> list[tuple[int, int, int]]:
    return [(int(a), int(b), int(c)) for a, b, c in SUMMARY.findall(out)]


@pytest.mark.spec("BACK-6", "GUAR-1", "GUAR-2", "TEST-4")
def test_a_journal_renaming_an_unsynced_snapshot_into_place_fails_the_matrix(pytester: pytest.Pytester) -> None:
    """The snapshot's rename is durable, its data is not: the crash state a power cut
    leaves is an empty journal that no longer opens."""
    pytester.makepyfile(buggy_journals=BUGGY)
    pytester.makefile(".toml", pc=PROFILE)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=buggy_journals:RenameWithoutFsync",
                                           "--botmesh-parts=matrix", "--botmesh-matrix=pc.toml", "--botmesh-seed=3")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-4000:]
    result.stdout.fnmatch_lines([
        "*cell buggy_journals:RenameWithoutFsync/one-send/*: FAILED",
        "*violated [[]GUAR-1, GUAR-2, BACK-6[]] power cut at after inbox.journal #1, crash state 1 (the first 0 of * "
        "unsynced operations kept): the backend no longer opens: JournalCorruptError(*the snapshot cannot be read back*",
        "*power-cut states recovered: * broke a guarantee",
        "*reproduce: botmesh-testkit run --backend buggy_journals:RenameWithoutFsync --seed 3 --cell *",
    ])
    assert "BROKEN" in out and "BACK-6 in" in out
    [(states, cells, failed)] = _counts(out)
    assert 0 < failed <= states <= cells * MAX_STATES_PER_CELL


@pytest.mark.spec("BACK-6", "INB-1", "OUT-1", "GUAR-1", "GUAR-2", "TEST-4")
def test_a_journal_acknowledging_before_fsync_fails_the_matrix(pytester: pytest.Pytester) -> None:
    """Each append returns before it is durable: the crash state without it lacks a
    record the backend had acknowledged, which the reopened journal names."""
    pytester.makepyfile(buggy_journals=BUGGY)
    pytester.makefile(".toml", pc=PROFILE)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=buggy_journals:AckBeforeFsync",
                                           "--botmesh-parts=matrix", "--botmesh-matrix=pc.toml", "--botmesh-seed=3")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-4000:]
    result.stdout.fnmatch_lines([
        "*violated [[]INB-1, GUAR-1, GUAR-2, BACK-6[]] power cut at after inbox.journal #1, crash state 1 (the first "
        "0 of * unsynced operations kept): 1 acknowledged inbound record(s) not as acknowledged: 'm1' (state "
        "'leased') is missing",
    ])
    # a send recorded and then lost is named too (the outbox's ids)
    assert re.search(r"violated \[OUT-1, OUT-2, GUAR-4, BACK-6\] power cut at [^\n]*acknowledged send record", out), \
        out[-4000:]
    [(states, cells, failed)] = _counts(out)
    assert 0 < failed <= states


@pytest.mark.spec("BACK-6", "GUAR-1", "GUAR-2", "TEST-4")
def test_the_real_file_journals_pass_the_same_profile_recovering_from_states_of_their_own(
        pytester: pytest.Pytester) -> None:
    """``fsync=True``, both modes: every crash state of every crashed cell keeps what was
    acknowledged. The snapshot journal has states to recover from (its lock file's name
    is not durable before the first snapshot's directory fsync), so the check ran."""
    pytester.makefile(".toml", pc=PROFILE)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=file", "--botmesh-backend=file+log",
                                           "--botmesh-parts=matrix", "--botmesh-matrix=pc.toml", "--botmesh-seed=3")
    out = result.stdout.str()
    assert result.ret == 0, out[-4000:]
    counts = _counts(out)
    assert len(counts) == 2 and all(failed == 0 for _, _, failed in counts), counts
    file_states, file_cells, _ = counts[0]
    assert file_cells > 0 and file_states > 0, counts


# == the pieces ===================================================================================
def _model_with_unsynced_writes(n: int) -> PersistenceModel:
    m = PersistenceModel()
    m.create("f")
    m.fsync("f")
    m.fsync("")
    ino = m.lookup("f")
    assert ino is not None
    for i in range(n):
        m.write(ino, i, b"x")
    return m


@pytest.mark.spec("TEST-4")
def test_a_cell_picks_the_harshest_state_and_a_seeded_few_others() -> None:
    """Eight unsynced writes give nine prefixes; the one on disk (everything kept) is
    the ordinary recovery's; of the eight others the durable state comes first, and
    the rest is drawn from the seed: same seed, same states."""
    m = _model_with_unsynced_writes(8)
    states = list(m.crash_states())
    visible = m.visible_state().fingerprint()
    assert len(states) == 9 and states[-1].fingerprint() == visible
    picked = choose(states, visible, random.Random("7/cell"))
    assert len(picked) == MAX_STATES_PER_CELL
    assert picked[0] is states[0] and all(s.fingerprint() != visible for s in picked)
    assert [s.description for s in picked] == [s.description for s in choose(states, visible, random.Random("7/cell"))]
    assert len({s.description for s in picked}) == MAX_STATES_PER_CELL
    # a short window: every state but the one on disk
    small = _model_with_unsynced_writes(2)
    assert len(choose(list(small.crash_states()), small.visible_state().fingerprint(), random.Random(0))) == 2


@pytest.mark.spec("TEST-3", "GUAR-2")
async def test_forks_of_a_crashed_world_recover_independently(tmp_path: Any) -> None:
    """Two forks of a world that died after the reply reached the channel: each
    recovers on its own copy of the journal, and neither changes the other nor the
    world they came from."""
    import shutil

    w = WORKLOADS["one-send"]
    (tmp_path / "live").mkdir()
    world = make_world(FileHarness(str(tmp_path / "live")), w, "skip", seed=1)
    await world.start(crash=True)
    assert world.crashable is not None
    world.crashable.arm("after", "provider.send", 1)
    await play(world, w)
    assert world.crashed and world.channel.texts() == ["a/reply 1"]
    forks: list[World] = []
    for name in ("one", "two"):
        shutil.copytree(tmp_path / "live", tmp_path / name)
        harness = FileHarness(str(tmp_path / name))
        await harness.open()
        forks.append(world.fork(harness))
    await recover(forks[0], w)
    # on_ambiguous=skip: the reply is not sent again, the restart reports it ambiguous (OUT-14)
    assert forks[0].channel.texts() == ["a/reply 1"]
    assert [e["key"] for e in forks[0].named("durability:ambiguous")] == ["m1:1"]
    assert forks[0].channel.sent[0].message_id == world.channel.sent[0].message_id
    assert forks[1].named("durability:ambiguous") == [] and world.named("durability:ambiguous") == []
    assert forks[1].incarnations == world.incarnations == 1 and forks[0].incarnations == 2
    await recover(forks[1], w)
    assert forks[1].channel.texts() == ["a/reply 1"] and len(forks[1].named("durability:ambiguous")) == 1
    assert world.channel.texts() == ["a/reply 1"] and world.named("durability:ambiguous") == []
    for f in forks:
        await f.close()
    await world.close()


@pytest.mark.spec("TEST-2")
async def test_a_copied_channel_numbers_on_and_fails_on_its_own() -> None:
    channel = MockProvider()
    await channel.send("c1", {"text": "one"})
    channel.fail_next(RuntimeError("down"), times=1)
    clone = channel.copy()
    with pytest.raises(RuntimeError):
        await clone.send("c1", {"text": "two"})
    assert await clone.send("c1", {"text": "two"}) == "mock-2"
    with pytest.raises(RuntimeError):  # the original's pending failure is its own
        await channel.send("c1", {"text": "other"})
    assert await channel.send("c1", {"text": "other"}) == "mock-2"
    assert channel.texts() == ["one", "other"] and clone.texts() == ["one", "two"]


@pytest.mark.spec("BACK-6", "TEST-4")
async def test_a_journal_claiming_no_survives_crash_is_not_judged_by_power_cuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsync=False`` claims no ``survives_crash``: it owes nothing to a power cut, so
    its cells recover from no crash state and pass (every one of its windows would lose
    acknowledged writes)."""
    monkeypatch.setitem(HARNESSES, "file-unsynced", lambda d: FileHarness(d, fsync=False))
    result = await run_matrix(["file-unsynced"], ["one-send"], policies=["skip"], seed=2)
    assert result.outcomes and not result.failed
    assert all(o.power_cut_states is None for o in result.outcomes)
    synced = await run_matrix(["file"], ["one-send"], policies=["skip"], seed=2)
    assert all(o.power_cut_states is not None for o in synced.outcomes if o.crashed)


@pytest.mark.spec("BACK-6", "TEST-4")
async def test_a_cell_with_nothing_unsynced_skips_the_states_and_their_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash point with nothing unsynced (the real journal at most points) has no state
    to recover: the cell learns it from the model's window alone, and forks no world for
    it (issue 16). Over every cell of a real journal and of one acknowledging before its
    fsync (windows at every point), the states a cell recovers are exactly those of
    every crash state the model gives minus the one on disk, and a world is forked only
    for a cell that has some."""
    import botmesh_testkit.matrix.powercut_states as pcs

    planted: dict[str, Any] = {}
    exec(compile(BUGGY, "planted_journals", "exec"), planted)  # noqa: S102 - the module text above
    monkeypatch.setitem(HARNESSES, "file+log-ack-early", planted["AckBeforeFsync"])
    captured = pcs.PowerCutStates.capture.__func__  # type: ignore[attr-defined]
    seen: list[tuple[int, int]] = []  # per crashed cell: (unsynced operations, states)

    async def compared(cls: Any, world: World, io: Any, cell: Any, seed: int) -> Any:
        every = list(io.crash_states(subsets=pcs.SUBSETS, seed=f"{seed}/{cell.id}", torn=True))
        expected = choose(every, io.model.visible_state().fingerprint(), random.Random(f"{seed}/{cell.id}/powercut"))
        forks_before = len(forks)
        got = await captured(cls, world, io, cell, seed)
        assert [s.fingerprint() for s in got.states] == [s.fingerprint() for s in expected], cell.id
        assert got.window == len(every), cell.id
        assert len(forks) - forks_before == (1 if got.states else 0), cell.id
        seen.append((io.model.unsynced_ops(), len(got.states)))
        return got

    forks: list[World] = []
    real_fork = World.fork

    def counted_fork(self: World, harness: Any) -> World:
        forks.append(self)
        return real_fork(self, harness)

    monkeypatch.setattr(pcs.PowerCutStates, "capture", classmethod(compared))
    monkeypatch.setattr(World, "fork", counted_fork)
    result = await run_matrix(["file+log", "file+log-ack-early"], ["one-send"], policies=["skip"], seed=4)
    assert result.failed and all(o.cell.backend == "file+log-ack-early" for o in result.failed)  # caught, as before
    assert any(n == 0 for n, _ in seen) and any(n > 0 and states > 0 for n, states in seen), seen
