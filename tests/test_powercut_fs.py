"""The power-cut file system (``botmesh_testkit.crash.fs``, issue 11 items 1 and 2).

First the persistence model alone (pure Python, fast): each rule of what persists when,
each power-cut variant, the enumeration of crash states. Then the real FUSE mount: the
same rules seen by real processes, SQLite and FileDurability on it, injected errors,
held operations, and the clean-up of mounts left behind.

The mount tests need ``/dev/fuse`` and the right to mount. Without them they skip with
the reason — unless ``$BOTMESH_REQUIRE_SERVICES`` is set (as ``.ci/run`` sets it): then
they fail. No test sleeps: each waits on an answer of the server, a line of a child
process, or a process's exit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
import pytest

from botmesh.core.errors import JournalCorruptError
from botmesh.core.file_backend import FileDurability, FileKv
from botmesh_testkit.crash.fs import (
    PersistenceModel,
    load_tree,
    PowerCutFS,
    PowerCutIO,
    PowerCutMount,
    PowerCutError,
    PowerCutServerDied,
    PowerCutUnavailable,
    cleanup_stale_mounts,
    materialize,
    unavailable_reason,
)
from botmesh_testkit.crash.fs import mount as mount_module
from botmesh_testkit.kill.held import sweep_points

REQUIRE = bool(os.environ.get("BOTMESH_REQUIRE_SERVICES"))
CHILD_TIMEOUT = 120


# == the model ==================================================================================
def _model_with_dir() -> PersistenceModel:
    m = PersistenceModel()
    m.mkdir("d")
    m.fsync("")
    return m


def test_unsynced_data_is_dropped_by_a_power_cut() -> None:
    m = _model_with_dir()
    m.create("d/f")
    m.fsync("d")
    m.write("d/f", 0, b"hello")
    assert m.visible_state().files["d/f"] == b"hello"
    assert m.crash("drop").files["d/f"] == b""


def test_synced_data_is_kept() -> None:
    m = _model_with_dir()
    m.create("d/f")
    m.fsync("d")
    m.write("d/f", 0, b"hello")
    m.fsync("d/f")
    m.write("d/f", 5, b" world")
    assert m.crash("drop").files["d/f"] == b"hello"
    m.fdatasync("d/f")
    assert m.crash("drop").files["d/f"] == b"hello world"


def test_a_rename_without_a_directory_fsync_is_undone() -> None:
    m = _model_with_dir()
    m.add_durable_file("d/data", b"old")
    m.create("d/data.tmp")
    m.write("d/data.tmp", 0, b"new")
    m.fsync("d/data.tmp")
    m.rename("d/data.tmp", "d/data")
    assert m.visible_state().files == {"d/data": b"new"}
    assert m.crash("drop").files == {"d/data": b"old"}
    m.fsync("d")
    assert m.crash("drop").files == {"d/data": b"new"}


def test_an_fsynced_file_whose_directory_was_never_fsynced_disappears() -> None:
    m = _model_with_dir()
    m.create("d/f")
    m.write("d/f", 0, b"data")
    m.fsync("d/f")
    assert "d/f" not in m.crash("drop").files
    m.fsync("d")  # now the name persists, with the data fsynced before
    assert m.crash("drop").files["d/f"] == b"data"


def test_a_new_directory_needs_its_parent_fsynced() -> None:
    m = PersistenceModel()
    m.mkdir("a")
    m.create("a/f")
    m.fsync("a")  # the entry of f inside a persists, but a itself does not
    assert m.crash("drop").dirs == {}
    m.fsync("")
    assert set(m.crash("drop").files) == {"a/f"}


def test_a_cross_directory_rename_needs_both_directories_fsynced() -> None:
    m = PersistenceModel()
    for d in ("src", "dst"):
        m.mkdir(d)
    m.fsync("")
    m.create("src/x")
    m.fsync("src")
    m.rename("src/x", "dst/x")
    m.fsync("dst")
    assert set(m.crash("drop").files) == {"src/x"}  # not half-applied either
    m.fsync("src")
    assert set(m.crash("drop").files) == {"dst/x"}


def test_an_entry_change_waits_for_an_earlier_change_of_the_same_name() -> None:
    m = PersistenceModel()
    for d in ("a", "b"):
        m.mkdir(d)
    m.fsync("")
    m.add_durable_file("a/x", b"X")
    m.add_durable_file("a/y", b"Y")
    m.rename("a/x", "b/x")  # needs a and b
    m.rename("a/y", "a/x")  # needs a only, but the name a/x changed before
    m.fsync("a")
    assert m.crash("drop").files == {"a/x": b"X", "a/y": b"Y"}  # nothing lost, nothing half-done
    m.fsync("b")
    assert m.crash("drop").files == {"a/x": b"Y", "b/x": b"X"}


def test_a_size_change_persists_with_the_files_fsync_only() -> None:
    m = PersistenceModel()
    m.add_durable_file("f", b"0123456789")
    m.truncate("f", 4)
    m.fsync("")
    assert m.crash("drop").files["f"] == b"0123456789"
    m.fsync("f")
    assert m.crash("drop").files["f"] == b"0123"


def test_a_failed_fsync_loses_the_unsynced_data_for_good() -> None:
    m = PersistenceModel()
    m.add_durable_file("f", b"a")
    m.write("f", 1, b"b")
    assert m.fsync_failed("f") == 1
    m.fsync("f")  # succeeds now, but the pages were marked clean: b is not on disk
    assert m.crash("drop").files["f"] == b"a"
    assert m.lost_writes() == {m.lookup("f")}


def test_the_model_raises_what_the_os_would() -> None:
    m = PersistenceModel()
    m.mkdir("d")
    m.create("d/f")
    with pytest.raises(FileExistsError):
        m.create("d/f")
    with pytest.raises(FileNotFoundError):
        m.write("nope", 0, b"x")
    with pytest.raises(OSError) as info:
        m.rmdir("d")
    assert info.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        m.unlink("d")
    with pytest.raises(OSError) as info:
        m.rename("d", "d/inside")
    assert info.value.errno == errno.EINVAL


def test_a_torn_write_keeps_a_prefix_cut_at_a_sector_boundary() -> None:
    m = PersistenceModel()
    m.add_durable_file("log", b"")
    m.write("log", 0, b"a" * 100)
    m.write("log", 100, b"b" * 5000)  # crosses 512-byte boundaries at 512, 1024, ... 4608
    for seed in range(20):
        state = m.crash("torn", seed, sector=512)
        torn = state.torn
        assert torn is not None and torn.path == "log" and torn.sector == 512
        assert (torn.offset + torn.kept) % 512 == 0 and 0 < torn.kept < 5000
        data = state.files["log"]
        assert data == b"a" * 100 + b"b" * torn.kept  # the earlier write kept, a prefix of the last
    state = m.crash("torn", 3, sector=4096)
    assert state.torn is not None and state.torn.kept == 4096 - 100


def test_a_torn_cut_without_a_write_crossing_a_boundary_is_the_durable_state() -> None:
    m = PersistenceModel()
    m.add_durable_file("f", b"")
    m.write("f", 0, b"small")
    state = m.crash("torn", 1)
    assert state.torn is None and state.files["f"] == b""


def test_the_subset_variant_is_deterministic_per_seed() -> None:
    def history() -> PersistenceModel:
        m = PersistenceModel()
        m.add_durable_file("f", b"")
        for i in range(16):
            m.write("f", i * 10, bytes([65 + i]) * 10)
            m.create(f"n{i}")
        return m

    a, b = history(), history()
    for seed in (0, 1, "x/7"):
        assert a.crash("subset", seed).fingerprint() == b.crash("subset", seed).fingerprint()
    prints = {a.crash("subset", seed).fingerprint() for seed in range(10)}
    assert len(prints) > 5  # the seed really chooses
    state = a.crash("subset", 4)
    kept_names = sorted(int(p[1:]) for p in state.files if p.startswith("n"))
    assert kept_names == list(range(len(kept_names)))  # directory operations: a prefix


def test_the_enumeration_yields_every_prefix_of_the_unsynced_operations() -> None:
    m = PersistenceModel()
    m.add_durable_file("f", b"")
    m.write("f", 0, b"1")
    m.write("f", 1, b"2")
    m.create("g")
    m.write("f", 2, b"3")
    states = list(m.crash_states())
    assert [s.files["f"] for s in states] == [b"", b"1", b"12", b"12", b"123"]
    assert ["g" in s.files for s in states] == [False, False, False, True, True]
    assert [len(s.kept) for s in states] == [0, 1, 2, 3, 4]
    with_subsets = list(m.crash_states(subsets=8, seed=5))
    fingerprints = [s.fingerprint() for s in with_subsets]
    assert len(fingerprints) == len(set(fingerprints)) >= 5  # unique states only


def test_the_enumeration_can_tear_each_write() -> None:
    m = PersistenceModel()
    m.add_durable_file("f", b"")
    m.write("f", 0, b"x" * 2000)
    states = list(m.crash_states(torn=True))
    torn = [s for s in states if s.torn is not None]
    assert len(torn) == 1 and len(torn[0].files["f"]) % 512 == 0 and 0 < len(torn[0].files["f"]) < 2000


def test_the_model_forgets_inodes_nothing_refers_to() -> None:
    m = PersistenceModel()
    m.add_durable_file("snap", b"0")
    for i in range(200):  # the snapshot dance of a file journal
        m.create("snap.tmp")
        m.write("snap.tmp", 0, str(i).encode())
        m.fsync("snap.tmp")
        m.rename("snap.tmp", "snap")
        m.fsync("")
    assert m.inode_count() <= 3
    assert m.crash("drop").files == {"snap": b"199"}


def test_sync_all_makes_everything_durable() -> None:
    m = PersistenceModel()
    m.mkdir("d")
    m.create("d/f")
    m.write("d/f", 0, b"x")
    m.rename("d/f", "d/g")
    m.sync_all()
    assert m.unsynced_ops() == 0 and m.crash("drop").files == {"d/g": b"x"}


def test_a_state_restarts_as_a_model_and_materializes(tmp_path: Path) -> None:
    m = PersistenceModel()
    m.mkdir("d")
    m.create("d/f")
    m.write("d/f", 0, b"content")
    m.fsync("d/f")
    m.fsync("d")
    m.fsync("")
    state = m.crash("drop")
    again = PersistenceModel.from_state(state)
    assert again.crash("drop").fingerprint() == state.fingerprint() == again.visible_state().fingerprint()
    out = materialize(state, tmp_path / "img")
    assert (out / "d" / "f").read_bytes() == b"content"


# == the in-process variant ========================================================================
async def _keys_in(journal: Path) -> set[str]:
    """The keys a reopen of ``journal`` finds; none when it is refused as damaged (BACK-5:
    a crash state without fsync may leave a hole of zeros before a kept later append,
    which is a damaged complete line, not a torn final one)."""
    kv = FileKv(journal, append_log=True)
    try:
        await kv.open()
    except JournalCorruptError:
        return set()
    try:
        return {key for key, _ in await kv.scan("s", "sp", limit=1000)}
    finally:
        await kv.close()


async def _every_state_keeps(io: PowerCutIO, acked: set[str], out: Path, journal: str) -> tuple[int, set[str]]:
    """Reopen the journal in every crash state of the window; how many states there were
    and the acknowledged keys that some state lost."""
    lost: set[str] = set()
    states = list(io.crash_states(subsets=4, seed=1, torn=True))
    for i, state in enumerate(states):
        lost |= acked - await _keys_in(materialize(state, out / f"{len(acked)}-{i}") / journal)
    return len(states), lost


@pytest.mark.parametrize("append_log", [True, False], ids=["append_log", "snapshot"])
async def test_in_process_every_crash_state_keeps_what_an_fsyncing_journal_acknowledged(
        tmp_path: Path, append_log: bool) -> None:
    work = tmp_path / "work"
    work.mkdir()
    io = PowerCutIO(work)
    kv = FileKv(work / "journal.json", append_log=append_log, compact_every=3 if append_log else None,
                fsync=True, io=io)
    await kv.open()
    acked: set[str] = set()
    states = 0
    for i in range(7):
        await kv.put("s", "sp", f"k{i}", {"i": i}, expected_version=0)
        acked.add(f"k{i}")
        count, lost = await _every_state_keeps(io, acked, tmp_path / "states", "journal.json")
        states += count
        assert lost == set(), f"after put {i}: a crash state lost {sorted(lost)}"
    kv.abandon()
    assert states >= 7


@pytest.mark.parametrize("append_log", [True, False], ids=["append_log", "snapshot"])
async def test_in_process_a_journal_without_fsync_has_crash_states_that_lose_acknowledged_writes(
        tmp_path: Path, append_log: bool) -> None:
    work = tmp_path / "work"
    work.mkdir()
    io = PowerCutIO(work)
    kv = FileKv(work / "journal.json", append_log=append_log, fsync=False, io=io)
    await kv.open()
    for i in range(3):
        await kv.put("s", "sp", f"k{i}", {"i": i}, expected_version=0)
    _, lost = await _every_state_keeps(io, {"k0", "k1", "k2"}, tmp_path / "states", "journal.json")
    kv.abandon()
    assert lost == {"k0", "k1", "k2"}
    assert io.model.unsynced_bytes() > 0


def test_in_process_io_records_what_the_directory_holds(tmp_path: Path) -> None:
    io = PowerCutIO(tmp_path)
    io.write_atomic(str(tmp_path / "snap"), b"v1", fsync=True)
    fd = io.open_append(str(tmp_path / "log"), fsync=True)
    io.append(fd, b"line\n", fsync=False)
    io.truncate(fd, 2, fsync=False)
    io.close_fd(fd)
    io.remove(str(tmp_path / "gone"))  # missing: not an error, nothing recorded
    visible = io.model.visible_state()
    assert visible.files == {"snap": b"v1", "log": b"li"}
    assert {p: (tmp_path / p).read_bytes() for p in visible.files} == visible.files
    assert io.crash("drop").files == {"snap": b"v1", "log": b""}


def test_in_process_io_resolves_a_name_again_once_it_renamed_or_removed_it(tmp_path: Path) -> None:
    """PowerCutIO keeps each path's resolution (issue 16); a name it renames over or
    removes may name another file afterwards, and is resolved again. Here two names are
    links to a file outside the root (not recorded) until the io replaces one and
    removes the other: then they are files of the root, recorded as such."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a").write_bytes(b"outside a")
    (outside / "b").write_bytes(b"outside b")
    root = tmp_path / "root"
    root.mkdir()
    io = PowerCutIO(root)
    (root / "journal").symlink_to(outside / "a")  # made behind its back (it records no links)
    (root / "other").symlink_to(outside / "b")
    io.write_file(str(root / "journal"), b"through the link", fsync=True)  # outside: not recorded
    io.write_file(str(root / "other"), b"through the link", fsync=True)
    assert (outside / "a").read_bytes() == b"through the link"
    io.write_file(str(root / "tmp"), b"new", fsync=True)
    io.replace(str(root / "tmp"), str(root / "journal"))  # the link is replaced by a file of the root
    io.remove(str(root / "other"))
    io.write_file(str(root / "other"), b"own file", fsync=True)
    io.fsync_dir(str(root))
    files = io.model.visible_state().files
    assert files.get("journal") == b"new" and files.get("other") == b"own file", files
    assert "tmp" not in files
    assert io.crash("drop").files.get("journal") == b"new"


async def test_in_process_io_keeps_the_resolutions_of_regular_files_it_renames(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: a snapshot-only journal renames ``journal.json.tmp`` over
    ``journal.json`` at every write; renaming a regular file changes what no path
    resolves to, so PowerCutIO resolves each name once, not twice per write (the
    links of the test above are still resolved again). The recorded state is the
    journal's."""
    work = tmp_path / "work"
    work.mkdir()
    io = PowerCutIO(work)
    kv = FileKv(work / "journal.json", fsync=True, io=io)
    await kv.open()
    await kv.put("s", "sp", "k", {"i": 0}, expected_version=0)
    resolved: list[str] = []
    real = os.path.realpath

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        resolved.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", counting)
    for i in range(1, 11):
        await kv.put("s", "sp", "k", {"i": i}, expected_version=i)
    monkeypatch.undo()
    assert resolved == [], f"ten writes resolved {len(resolved)} paths again: {sorted(set(resolved))}"
    snapshot = io.model.visible_state().files["journal.json"]
    assert snapshot == (work / "journal.json").read_bytes() and b'{"i":10}' in snapshot
    kv.abandon()


# == the FUSE mount ===============================================================================
def _unavailable(exc: BaseException | str) -> None:
    if REQUIRE:
        pytest.fail(f"the power-cut file system must work here ($BOTMESH_REQUIRE_SERVICES is set): {exc}")
    pytest.skip(f"power-cut file system unavailable: {exc}")


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Callable[..., PowerCutMount]]:
    """Mount a power-cut file system (``files``, ``prepare(backing)``: the durable
    content to start from)."""
    mounts: list[PowerCutMount] = []

    def mount(files: dict[str, bytes] | None = None, name: str = "pc",
              prepare: Callable[[Path], None] | None = None) -> PowerCutMount:
        fs = PowerCutFS(tmp_path / name)
        for rel, data in (files or {}).items():
            target = fs.backing / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if prepare is not None:
            fs.backing.mkdir(parents=True, exist_ok=True)
            prepare(fs.backing)
        try:
            m = fs.mount()
        except PowerCutUnavailable as exc:
            _unavailable(exc)
        mounts.append(m)
        return m

    yield mount
    for m in mounts:
        m.unmount()


@pytest.fixture
def pc(mounter: Callable[..., PowerCutMount]) -> PowerCutMount:
    """An empty power-cut mount."""
    return mounter()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, *, fsync: bool, flags: int = os.O_CREAT | os.O_WRONLY | os.O_TRUNC) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _sound(m: PowerCutMount) -> None:
    """The layer agrees with itself: what the mount shows is what the model tracks."""
    assert m.check() == []


def test_a_write_without_fsync_is_gone_after_a_cut(mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"f": b"old"})
    _write(m.path / "f", b"new content", fsync=False)
    assert (m.path / "f").read_bytes() == b"new content"
    _sound(m)
    report = m.cut()
    assert report.dropped >= 1 and report.unsynced_bytes == len(b"new content")
    assert (m.path / "f").read_bytes() == b"old"
    _sound(m)


def test_sync_makes_the_set_up_durable(pc: PowerCutMount) -> None:
    (pc.path / "d").mkdir()
    _write(pc.path / "d" / "f", b"set-up", fsync=False)
    pc.sync()
    assert pc.stats().unsynced_ops == 0
    pc.cut()
    assert (pc.path / "d" / "f").read_bytes() == b"set-up"


def test_a_write_with_fsync_is_kept(mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"f": b"old"})
    _write(m.path / "f", b"new content", fsync=True)
    m.cut()
    assert (m.path / "f").read_bytes() == b"new content"
    assert m.stats().fsyncs == 1


def test_a_file_created_and_fsynced_without_a_directory_fsync_is_gone(pc: PowerCutMount) -> None:
    _write(pc.path / "new", b"data", fsync=True)
    pc.cut()
    assert not (pc.path / "new").exists()
    _write(pc.path / "new", b"data", fsync=True)
    _fsync_dir(pc.path)
    pc.cut()
    assert (pc.path / "new").read_bytes() == b"data"


def test_a_rename_into_place_without_a_directory_fsync_brings_the_old_name_back(
        mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"data": b"old"})
    _write(m.path / "data.tmp", b"new", fsync=True)
    os.replace(m.path / "data.tmp", m.path / "data")
    assert (m.path / "data").read_bytes() == b"new"
    m.cut()
    assert sorted(os.listdir(m.path)) == ["data"] and (m.path / "data").read_bytes() == b"old"


def test_the_torn_and_subset_cuts_on_the_mount(mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"log": b""})
    with open(m.path / "log", "ab") as f:
        f.write(b"r" * 3000)
    report = m.cut("torn", seed=2, sector=512)
    assert report.torn is not None and report.torn.path == "log"
    data = (m.path / "log").read_bytes()
    assert len(data) == report.torn.kept and len(data) % 512 == 0 and 0 < len(data) < 3000
    with open(m.path / "log", "ab") as f:
        for _ in range(10):
            f.write(b"s" * 100)
            f.flush()
    assert m.cut("subset", seed=9).mode == "subset"
    _sound(m)


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    """A child process running ``code``; it prints a line when it is done and then waits
    for its stdin to close (or for SIGKILL)."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _done(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        _, err = child.communicate(timeout=CHILD_TIMEOUT)
        raise AssertionError(f"the child died: {child.returncode}\n{err}")
    return line.strip()


def _kill(child: subprocess.Popen[str]) -> None:
    child.kill()
    _reap(child)


def _reap(child: subprocess.Popen[str]) -> int:
    """Wait for the child and close its pipes."""
    child.communicate(timeout=CHILD_TIMEOUT)
    return child.returncode


SQLITE_CHILD = r"""
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
c.execute("PRAGMA synchronous=" + sys.argv[2])
c.execute("CREATE TABLE IF NOT EXISTS t(n INTEGER)")
for i in range(int(sys.argv[3])):
    c.execute("INSERT INTO t VALUES (?)", (i,))  # autocommit: each insert one transaction
print(c.execute("PRAGMA journal_mode").fetchone()[0], c.execute("PRAGMA synchronous").fetchone()[0],
      c.execute("SELECT count(*) FROM t").fetchone()[0], flush=True)
sys.stdin.read()
"""


def _sqlite_rows(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT count(*) FROM t").fetchone()[0])
    finally:
        conn.close()


def _sqlite_run(m: PowerCutMount, synchronous: str, rows: int) -> str:
    child = _child(SQLITE_CHILD, str(m.path / "db.sqlite"), synchronous, str(rows))
    try:
        return _done(child)
    finally:
        _kill(child)  # the power cut kills the process


def test_sqlite_wal_synchronous_full_keeps_every_committed_row(pc: PowerCutMount) -> None:
    assert _sqlite_run(pc, "FULL", 50) == "wal 2 50"
    stats = pc.stats()
    assert stats.fdatasyncs + stats.fsyncs >= 50 and stats.internal_errors == ()
    pc.cut()
    assert _sqlite_rows(pc.path / "db.sqlite") == 50
    _sound(pc)


def test_sqlite_synchronous_off_loses_committed_rows_at_a_power_cut(pc: PowerCutMount) -> None:
    """The fact the power-cut part rests on: a kill loop cannot see this, a power cut can."""
    assert _sqlite_run(pc, "FULL", 10) == "wal 2 10"
    # Acknowledged (the process saw its 50 rows) and in the page cache. Not read back from
    # here: the last connection to close checkpoints, which would fsync them.
    assert _sqlite_run(pc, "OFF", 40) == "wal 0 50"
    assert pc.stats().unsynced_bytes > 0
    pc.cut()
    assert _sqlite_rows(pc.path / "db.sqlite") == 10


async def _file_durability(path: Path, *, fsync: bool, append_log: bool, puts: int) -> None:
    d = await FileDurability.open(path, append_log=append_log, fsync=fsync)
    for i in range(puts):
        await d.file_kv.put("s", "sp", f"k{i}", {"i": i}, expected_version=0)
    d.abandon()  # the process dies: no close, no compaction


async def _file_keys(path: Path) -> list[str]:
    d = await FileDurability.open(path, append_log=True)
    try:
        found = await d.file_kv.scan("s", "sp", limit=1000)
        return sorted(key for key, _ in found)
    finally:
        await d.close()


@pytest.mark.parametrize("append_log", [True, False], ids=["append_log", "snapshot"])
async def test_file_durability_without_fsync_loses_acknowledged_writes(pc: PowerCutMount, append_log: bool) -> None:
    journal = pc.path / "journal.json"
    await _file_durability(journal, fsync=False, append_log=append_log, puts=5)
    pc.cut()
    assert await _file_keys(journal) == []


@pytest.mark.parametrize("append_log", [True, False], ids=["append_log", "snapshot"])
async def test_file_durability_with_fsync_keeps_acknowledged_writes(pc: PowerCutMount, append_log: bool) -> None:
    journal = pc.path / "journal.json"
    await _file_durability(journal, fsync=True, append_log=append_log, puts=5)
    pc.cut()
    assert await _file_keys(journal) == [f"k{i}" for i in range(5)]
    _sound(pc)


def test_an_injected_eio_on_the_second_write_reaches_the_writer(pc: PowerCutMount) -> None:
    pc.fail("write", "log", nth=2, errno=errno.EIO)
    fd = os.open(pc.path / "log", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"a")
        with pytest.raises(OSError) as info:
            os.write(fd, b"b")
        assert info.value.errno == errno.EIO
        os.write(fd, b"c")  # once only
    finally:
        os.close(fd)
    assert (pc.path / "log").read_bytes() == b"ac"
    faults = pc.stats().faults
    assert len(faults) == 1 and faults[0]["op"] == "write" and faults[0]["errno"] == "EIO"
    _sound(pc)


def test_an_injected_enospc_and_a_failed_fsync(mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"f": b"durable"})
    m.fail("open", "other", errno=errno.ENOSPC)
    with pytest.raises(OSError) as info:
        _write(m.path / "other", b"x", fsync=False)
    assert info.value.errno == errno.ENOSPC
    m.fail("fsync", "f")
    fd = os.open(m.path / "f", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b" lost")
        with pytest.raises(OSError) as info:
            os.fsync(fd)
        assert info.value.errno == errno.EIO
        os.fsync(fd)  # succeeds, but the data the failed one covered is not durable
    finally:
        os.close(fd)
    m.cut()
    assert (m.path / "f").read_bytes() == b"durable"


RENAME_CHILD = r"""
import os, sys
d = sys.argv[1]
fd = os.open(os.path.join(d, "data.tmp"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, b"new"); os.fsync(fd); os.close(fd)
os.replace(os.path.join(d, "data.tmp"), os.path.join(d, "data"))  # held here
dfd = os.open(d, os.O_RDONLY); os.fsync(dfd); os.close(dfd)
print("renamed", flush=True)
sys.stdin.read()
"""


def test_a_process_killed_inside_a_held_rename_then_a_cut(mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"data": b"old"})
    rule = m.hold("rename", "data*")
    child = _child(RENAME_CHILD, str(m.path))
    held = m.wait_held()
    assert (held.rule, held.op, held.path, held.pid) == (rule, "rename", "data.tmp", child.pid)
    child.kill()  # it dies once its rename is answered
    m.cut()
    assert _reap(child) == -signal.SIGKILL
    assert sorted(os.listdir(m.path)) == ["data"] and (m.path / "data").read_bytes() == b"old"
    _sound(m)


def test_a_released_rename_runs_though_its_process_was_killed(mounter: Callable[..., PowerCutMount]) -> None:
    m = mounter({"data": b"old"})
    m.hold("rename", "data*")
    child = _child(RENAME_CHILD, str(m.path))
    m.wait_held()
    child.kill()
    assert m.release() == 1
    assert _reap(child) == -signal.SIGKILL
    assert (m.path / "data").read_bytes() == b"new"  # it ran, but its directory fsync never did
    m.cut()
    assert (m.path / "data").read_bytes() == b"old"


REWRITE_CHILD = r"""
import os, sys
d = sys.argv[1]
with open(os.path.join(d, "data"), "wb") as f:  # truncated by the open: not a held operation
    f.write(b"new")                             # held here
    f.flush(); os.fsync(f.fileno())
print("rewritten", flush=True)
sys.stdin.read()
"""


def test_a_cancelled_held_write_never_lands_and_what_came_before_it_stays(
        mounter: Callable[..., PowerCutMount]) -> None:
    """The held-operation sweep's process death: the rewrite's truncate stays (the page
    cache), its write never lands; a power cut afterwards brings the durable old
    content back (the truncate was never fsynced)."""
    m = mounter({"data": b"old"})
    rule = m.hold("write|truncate|rename", "data*")
    child = _child(REWRITE_CHILD, str(m.path))
    held = m.wait_held()
    assert (held.rule, held.op, held.path) == (rule, "write", "data")
    child.kill()
    assert m.cancel(rule) == 1
    assert _reap(child) == -signal.SIGKILL
    assert (m.path / "data").read_bytes() == b""
    assert m.poll_held() is None and m.stats().rules == 0
    m.cut()
    assert (m.path / "data").read_bytes() == b"old"
    _sound(m)


def test_a_rule_over_several_operations_counts_them_together(pc: PowerCutMount) -> None:
    (pc.path / "a").write_bytes(b"1")           # write #1
    rule = pc.hold("write|rename", "*", nth=2)
    child = _child(RENAME_CHILD, str(pc.path))  # a write (#1 counted from the rule), then a rename (#2)
    held = pc.wait_held()
    assert (held.rule, held.op, held.path) == (rule, "rename", "data.tmp")
    assert pc.release(rule) == 1
    _done(child)
    _kill(child)
    with pytest.raises(ValueError, match="unknown operation 'write[|]chmod'"):
        pc.hold("write|chmod")


@pytest.mark.parametrize(("operations", "points", "expected"), [
    (5, 24, [1, 2, 3, 4, 5]),           # fewer operations than points: every one
    (24, 24, list(range(1, 25))),
    (305, 5, [1, 77, 153, 229, 305]),   # more: spread from the first to the last
    (305, 1, [1]),
    (0, 24, []),
    (10, 0, []),
])
def test_the_sweep_holds_every_operation_or_spreads_them_from_first_to_last(
        operations: int, points: int, expected: list[int]) -> None:
    assert sweep_points(operations, points) == expected


def _wait_exit(pid: int) -> None:
    """Wait for a process that is not our child to exit (a pidfd turns readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], CHILD_TIMEOUT)
        assert ready, f"process {pid} did not exit within {CHILD_TIMEOUT} s"
    finally:
        os.close(fd)


def test_a_dead_server_is_named_as_such(pc: PowerCutMount) -> None:
    os.kill(pc.server_pid, signal.SIGKILL)
    _wait_exit(pc.server_pid)
    with pytest.raises(PowerCutServerDied) as info:
        pc.stats()
    message = str(info.value)
    assert "killed by SIGKILL" in message and "not of the backend" in message
    pc.unmount()
    assert not mount_module._is_mounted(str(pc.path))


OWNER = r"""
import sys
from botmesh_testkit.crash.fs import PowerCutFS
m = PowerCutFS(sys.argv[1]).mount()
print(m.path, m.server_pid, flush=True)
sys.stdin.read()
"""


def test_a_mount_left_by_a_killed_run_is_cleaned_at_the_next_mount(
        tmp_path: Path, mounter: Callable[..., PowerCutMount]) -> None:
    if (reason := unavailable_reason()) is not None:
        _unavailable(reason)
    owner = _child(OWNER, str(tmp_path / "killed"))
    path, server = _done(owner).split()
    os.kill(int(server), signal.SIGKILL)  # the whole run dies: its FUSE server first...
    _wait_exit(int(server))
    _kill(owner)  # ...then the test process
    # Left behind ("Transport endpoint is not connected") — unless another xdist worker's
    # mount has cleaned it up already, which is the same mechanism at work.
    mounter()  # the next run's first mount cleans it up
    assert not mount_module._is_mounted(path) and not os.path.exists(path)
    assert path not in cleanup_stale_mounts()


def test_a_server_whose_owner_died_unmounts_itself(tmp_path: Path) -> None:
    if (reason := unavailable_reason()) is not None:
        _unavailable(reason)
    owner = _child(OWNER, str(tmp_path / "orphan"))
    path, server = _done(owner).split()
    _kill(owner)  # its control socket closes
    _wait_exit(int(server))
    assert not mount_module._is_mounted(path)


def test_without_dev_fuse_the_reason_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == "/dev/fuse" else real_exists(p))
    reason = unavailable_reason()
    assert reason is not None and "/dev/fuse" in reason
    with pytest.raises(PowerCutUnavailable, match="no /dev/fuse"):
        PowerCutFS(tmp_path).mount()


def test_the_control_api_refuses_bad_requests(pc: PowerCutMount) -> None:
    with pytest.raises(ValueError, match="unknown operation"):
        pc.fail("chmod")
    with pytest.raises(ValueError, match="unknown power-cut mode"):
        pc.cut("melt")
    with pytest.raises(TimeoutError):
        pc.wait_held(timeout=0.05)
    assert pc.stats().cuts == 0


def test_a_workload_leaves_model_and_mount_in_agreement(pc: PowerCutMount) -> None:
    (pc.path / "sub").mkdir()
    _write(pc.path / "sub" / "a", b"1" * 10000, fsync=False)
    os.truncate(pc.path / "sub" / "a", 77)
    os.link(pc.path / "sub" / "a", pc.path / "b")
    os.rename(pc.path / "b", pc.path / "sub" / "c")
    os.unlink(pc.path / "sub" / "a")
    with open(pc.path / "sub" / "c", "r+b") as f:
        f.seek(5000)
        f.write(b"z")
    _sound(pc)
    assert pc.unsynced()[:2] == ["mkdir sub", "create sub/a"]
    assert pc.stats().unsynced_ops == len(pc.unsynced())
    report = pc.cut()
    assert report.files == 0 and os.listdir(pc.path) == []
    _sound(pc)


def _random_workload(root: Path, rng: random.Random, steps: int) -> None:
    """Random file-system operations through ``root`` (the mount), each one valid."""
    files: list[str] = []
    dirs = [""]
    for _ in range(steps):
        action = rng.choice(["create", "write", "write", "truncate", "rename", "unlink", "mkdir", "fsync",
                             "fsyncdir"])
        if action in ("mkdir", "create"):
            parent = rng.choice(dirs)
            name = f"{parent}/n{rng.randrange(10**6)}".lstrip("/")
            if action == "mkdir":
                os.mkdir(root / name)
                dirs.append(name)
            else:
                _write(root / name, os.urandom(rng.randrange(0, 9000)), fsync=rng.random() < 0.3)
                files.append(name)
            continue
        if action == "fsyncdir":
            _fsync_dir(root / rng.choice(dirs))
            continue
        if not files:
            continue
        target = rng.choice(files)
        if action == "write":
            with open(root / target, "r+b") as f:
                f.seek(rng.randrange(0, 10000))
                f.write(os.urandom(rng.randrange(1, 6000)))
        elif action == "truncate":
            os.truncate(root / target, rng.randrange(0, 12000))
        elif action == "fsync":
            fd = os.open(root / target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        elif action == "rename":
            new = f"{rng.choice(dirs)}/r{rng.randrange(10**6)}".lstrip("/")
            os.rename(root / target, root / new)
            files[files.index(target)] = new
        elif action == "unlink":
            os.unlink(root / target)
            files.remove(target)


def test_random_workloads_and_cuts_keep_mount_and_model_in_agreement(pc: PowerCutMount) -> None:
    rng = random.Random(11)
    for round_ in range(6):
        _random_workload(pc.path, rng, 40)
        _sound(pc)
        mode = ("drop", "subset", "torn")[round_ % 3]
        report = pc.cut(mode, seed=round_)
        on_mount = load_tree(pc.path).visible_state()
        assert on_mount.fingerprint() == report.fingerprint, f"round {round_} ({mode}): the mount is not the crash state"
        assert (len(on_mount.files), len(on_mount.dirs)) == (report.files, report.dirs)
        _sound(pc)


SQLITE_CYCLE = r"""
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA journal_mode=WAL"); c.execute("PRAGMA synchronous=FULL")
c.execute("CREATE TABLE IF NOT EXISTS t(n INTEGER PRIMARY KEY, pad BLOB)")
start = c.execute("SELECT count(*) FROM t").fetchone()[0]
for i in range(start, start + 30):
    c.execute("INSERT INTO t VALUES (?, randomblob(3000))", (i,))
print(start + 30, flush=True)
sys.stdin.read()
"""


def test_sqlite_full_survives_every_kind_of_cut(pc: PowerCutMount) -> None:
    """SQLite is built for reordered and torn writes: with synchronous=FULL no variant of
    the model may lose a committed row or damage the database (a model that produced
    impossible disk states would show here)."""
    db = pc.path / "db.sqlite"
    for cycle in range(6):
        child = _child(SQLITE_CYCLE, str(db))
        try:
            acked = int(_done(child))
        finally:
            _kill(child)
        pc.cut(("drop", "subset", "torn")[cycle % 3], seed=cycle)
        conn = sqlite3.connect(db)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == acked
        finally:
            conn.close()


LOCKER = r"""
import fcntl, os, sqlite3, sys
d = sys.argv[1]
fd = os.open(os.path.join(d, "lock"), os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
fcntl.lockf(fd, fcntl.LOCK_EX, 1, 100)
c = sqlite3.connect(os.path.join(d, "db.sqlite"), isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
c.execute("CREATE TABLE t(n)")
c.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(7)])
print("locked", flush=True)
sys.stdin.read()
"""


def test_locks_and_sqlite_shared_memory_work_between_processes(pc: PowerCutMount) -> None:
    child = _child(LOCKER, str(pc.path))
    try:
        assert _done(child) == "locked"
        fd = os.open(pc.path / "lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(OSError):
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 100)
        finally:
            os.close(fd)
        # The child keeps its connection open: this one reads its commits through the
        # WAL index in the mmapped -shm file, shared between the two processes.
        conn = sqlite3.connect(pc.path / "db.sqlite")
        try:
            assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 7
        finally:
            conn.close()
    finally:
        _kill(child)


def test_other_users_get_their_own_files_and_the_usual_permissions(mounter: Callable[..., PowerCutMount]) -> None:
    """What a PostgreSQL server running as its own user on the mount needs."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the mount serves other users only when mounted by root (allow_other)")
    nobody = 65534
    m = mounter({"own/.keep": b""}, prepare=lambda backing: os.chown(backing / "own", nobody, nobody))
    script = "printf x > own/f && mkdir own/d && stat -c '%u %g' own/f own/d && ! touch not-mine 2>/dev/null"
    done = subprocess.run(["/bin/sh", "-c", script], cwd=m.path, user=nobody, group=nobody, capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(nobody)] * 4
    _sound(m)
    m.cut()  # owners are kept across a power cut
    assert os.stat(m.path / "own").st_uid == nobody


def test_a_tree_the_layer_cannot_model_is_refused_by_name(tmp_path: Path) -> None:
    if (reason := unavailable_reason()) is not None:
        _unavailable(reason)
    fs = PowerCutFS(tmp_path / "pc")
    fs.backing.mkdir(parents=True)
    (fs.backing / "link").symlink_to("elsewhere")
    with pytest.raises(PowerCutError, match="link: not a directory or regular file"):
        fs.mount()
    assert not any(p.startswith(str(tmp_path)) for p in mount_module._our_mounts())


def test_the_mount_point_is_a_fresh_directory_in_the_temporary_directory(pc: PowerCutMount) -> None:
    assert pc.path.parent == Path(tempfile.gettempdir()) and pc.path.name.startswith("botmesh-powercut-mnt-")
    assert mount_module._is_mounted(str(pc.path))
