"""Bad paths given to the file backend and to SQLite (issue 13): a NUL byte, a directory
where a file is expected (the file itself, or where one of its companions goes), a
missing directory, a directory this process may not create files in, an existing file
it may not write: each refused when the store is built with ``ConfigError`` naming the
option (``path`` of ``FileKv``/``FileDurability.open``, ``file`` of ``SQLiteStore``/
``SQLiteKv``) and the path, nothing created and nothing already there changed.

The unwritable places need a process without root's override of permissions: run as
root, those cases run in a forked child that became the ``nobody`` user (uid 65534)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botmesh.core import ConfigError
from botmesh.core.file_backend import FileDurability, FileKv
from botmesh.sqlite_store import SQLiteKv, SQLiteStore

NOBODY = 65534

BUILDERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    # name: (option named, build the store on the path)
    "FileKv": ("path", lambda p: FileKv(p)),
    "FileKv+log": ("path", lambda p: FileKv(p, append_log=True)),
    "FileDurability.open": ("path", lambda p: asyncio.run(FileDurability.open(p))),
    "SQLiteStore": ("file", lambda p: SQLiteStore(p)),
    "SQLiteKv": ("file", lambda p: SQLiteKv(p)),
}


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` with its content (None for a directory)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _refused(builder: str, path: str, root: Path, *, why: str) -> ConfigError:
    option, build = BUILDERS[builder]
    before = _tree(root)
    with pytest.raises(ConfigError) as info:
        build(path)
    assert info.value.option == option, f"{builder}({path!r}): the error names {info.value.option!r}"
    message = str(info.value)
    assert option in message and why in message, message
    assert os.path.basename(path.replace("\x00", "")) in message.replace("\\x00", ""), message
    assert _tree(root) == before, f"{builder}({path!r}) created or changed files"
    return info.value


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """A directory holding a journal and an SQLite file that already have data."""

    async def make() -> None:
        fd = await FileDurability.open(tmp_path / "kept.json")
        await fd.kv.put("s", "inbox", "k", {"v": 1}, expected_version=0)
        await fd.close()
        kv = SQLiteKv(tmp_path / "kept.db")
        await kv.put("s", "inbox", "k", {"v": 1}, expected_version=0)
        await kv.close()

    asyncio.run(make())
    return tmp_path


def _companion(builder: str) -> str:
    return ".log" if builder.startswith("File") else "-wal"


@pytest.mark.spec("BACK-4", "BACK-1")
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_nul_byte_is_refused_naming_the_option(builder: str, journal: Path) -> None:
    """A path with a NUL byte: ConfigError naming the option, not ``ValueError:
    embedded null byte``."""
    error = _refused(builder, str(journal / "bad\x00name.json"), journal, why="NUL")
    assert error.details["value"] == str(journal / "bad\x00name.json")


@pytest.mark.spec("BACK-4", "BACK-1")
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_directory_is_refused_naming_the_option(builder: str, journal: Path) -> None:
    """A directory where the file is expected."""
    (journal / "adir").mkdir()
    _refused(builder, str(journal / "adir"), journal, why="directory")


@pytest.mark.spec("BACK-4", "BACK-1")
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_directory_where_a_companion_file_goes_is_refused(builder: str, journal: Path) -> None:
    """A directory where the append log / lock (file backend) or the WAL (SQLite) will be
    created: refused at once rather than at the first write."""
    (journal / f"new{_companion(builder)}").mkdir()
    _refused(builder, str(journal / "new"), journal, why="directory")


@pytest.mark.spec("BACK-4", "BACK-1")
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_missing_directory_is_refused_naming_the_option(builder: str, journal: Path) -> None:
    _refused(builder, str(journal / "missing" / "j.json"), journal, why="does not exist")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory outside pytest's private tmp tree, which ``nobody`` can reach."""
    path = Path(tempfile.mkdtemp(prefix="botmesh-paths-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for p in [path, *path.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(path)


def _build(builder: str, path: str) -> dict[str, Any]:
    try:
        BUILDERS[builder][1](path)
    except ConfigError as exc:
        return {"option": exc.option, "message": str(exc)}
    return {"option": None, "message": "accepted"}


def _build_unprivileged(builder: str, path: str) -> dict[str, Any]:
    """Build the store on ``path`` in a process without root's override of file
    permissions (this one, or — run as root — a forked child that became ``nobody``);
    what it raised."""
    if os.geteuid() != 0:
        return _build(builder, path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, build, report, leave without running pytest's exit code
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(_build(builder, path)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, f"the unprivileged child failed (status {status})"
    result: dict[str, Any] = json.loads(data)
    return result


@pytest.mark.spec("BACK-4", "BACK-1")
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_directory_the_process_cannot_write_is_refused_naming_the_option(builder: str, shared_dir: Path) -> None:
    """A directory where this process may not create files: refused when the store is
    built, naming the option — and accepted by the same process in a writable one."""
    locked = shared_dir / "locked"
    locked.mkdir()
    (locked / "kept.json").write_bytes(b"untouched")
    locked.chmod(0o555)
    before = _tree(shared_dir)
    got = _build_unprivileged(builder, str(locked / "j.json"))
    assert got["option"] == BUILDERS[builder][0] and "not writable" in got["message"], got
    assert "locked" in got["message"], got
    assert _tree(shared_dir) == before
    open_dir = shared_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    assert _build_unprivileged(builder, str(open_dir / "j.json")) == {"option": None, "message": "accepted"}


@pytest.mark.spec("BACK-4", "BACK-1")
@pytest.mark.parametrize("builder", BUILDERS)
def test_an_existing_file_the_process_cannot_write_is_refused_and_left_as_it_is(builder: str, shared_dir: Path) -> None:
    """An existing journal or database file this process may read but not write:
    refused naming the option, its bytes unchanged."""
    writable = shared_dir / "w"
    writable.mkdir()
    writable.chmod(0o777)
    target = writable / "readonly"
    target.write_bytes(b"not ours to change")
    target.chmod(0o444)
    got = _build_unprivileged(builder, str(target))
    assert got["option"] == BUILDERS[builder][0] and "not readable and writable" in got["message"], got
    assert target.read_bytes() == b"not ours to change"
    assert sorted(os.listdir(writable)) == ["readonly"]


@pytest.mark.spec("BACK-4")
def test_the_data_beside_a_refused_path_still_opens_unchanged(journal: Path) -> None:
    """After every refusal above, the journal and the database already there open with
    their record."""
    for builder in BUILDERS:
        for bad in ("x\x00y", "missing/j.json"):
            with pytest.raises(ConfigError):
                BUILDERS[builder][1](str(journal / bad))

    async def check() -> None:
        fd = await FileDurability.open(journal / "kept.json")
        assert (await fd.kv.get("s", "inbox", "k")) is not None
        await fd.close()
        kv = SQLiteKv(journal / "kept.db")
        got = await kv.get("s", "inbox", "k")
        assert got is not None and got.value == {"v": 1}
        await kv.close()

    asyncio.run(check())
