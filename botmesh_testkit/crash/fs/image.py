"""Between the persistence model and a real directory: load a directory's tree into a
:class:`~.model.PersistenceModel` as its durable state (:func:`load_tree`), write a
:class:`~.state.CrashState` out to a new directory (:func:`materialize`, the in-process
variant reopens a backend on it), and make an existing directory hold exactly a crash
state while touching only what differs (:func:`rebuild`, the FUSE layer's power cut).

Only directories and regular files are supported; anything else (a symbolic link, a
socket, a FIFO) raises :class:`UnsupportedEntry` naming it.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .model import PersistenceModel
from .state import CrashState, NodeAttrs

__all__ = ["RebuildReport", "UnsupportedEntry", "load_tree", "materialize", "rebuild"]


class UnsupportedEntry(ValueError):
    """A tree holds an entry the power-cut file system cannot model."""


@dataclass(frozen=True)
class RebuildReport:
    """What :func:`rebuild` changed: files written (their content differed), files kept
    as they were, and entries removed or created."""

    written: int
    kept: int
    removed: int
    dirs_created: int


def _attrs(st: os.stat_result) -> NodeAttrs:
    return NodeAttrs(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


def load_tree(root: str | os.PathLike[str]) -> PersistenceModel:
    """A model whose durable state is the tree under ``root`` as it is now (contents read
    into memory; the model keeps durable data in memory)."""
    base = os.fspath(root)
    model = PersistenceModel(_attrs(os.stat(base)))
    for dirpath, dirnames, filenames in os.walk(base):
        rel = os.path.relpath(dirpath, base)
        prefix = "" if rel == "." else rel + "/"
        dirnames.sort()
        for name in dirnames:
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISDIR(st.st_mode):
                raise UnsupportedEntry(f"{os.path.join(dirpath, name)}: not a directory or regular file")
            model.add_durable_dir(prefix + name, _attrs(st))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                raise UnsupportedEntry(f"{full}: not a directory or regular file (symbolic links, sockets and "
                                       f"FIFOs are not supported on the power-cut file system)")
            with open(full, "rb") as f:
                model.add_durable_file(prefix + name, f.read(), _attrs(st))
    return model


def _set_attrs(path: str, attrs: NodeAttrs, st: os.stat_result | None = None) -> None:
    if st is None or stat.S_IMODE(st.st_mode) != attrs.mode:
        os.chmod(path, attrs.mode)
    if os.geteuid() == 0 and (st is None or (st.st_uid, st.st_gid) != (attrs.uid, attrs.gid)):
        os.chown(path, attrs.uid, attrs.gid)


def _write(path: str, data: bytes, attrs: NodeAttrs) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    _set_attrs(path, attrs)


def materialize(state: CrashState, directory: str | os.PathLike[str]) -> Path:
    """Write ``state`` into ``directory`` (created when missing; it must be empty) and
    return its path. Hard links of the state become hard links."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty (materialize writes a crash state into an empty directory)")
    rebuild(out, state, live={}, diverged=set())
    return out


def _scan(base: str) -> dict[str, bool]:
    """Relative path -> is a directory, for everything under ``base``."""
    out: dict[str, bool] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        rel = os.path.relpath(dirpath, base)
        prefix = "" if rel == "." else rel + "/"
        for name in dirnames:
            out[prefix + name] = True
        for name in filenames:
            out[prefix + name] = False
    return out


def rebuild(directory: str | os.PathLike[str], state: CrashState, *, live: dict[str, int],
            diverged: set[int]) -> RebuildReport:
    """Make ``directory`` hold exactly ``state``. ``live`` maps the paths the directory
    holds now to the model inodes they belong to, ``diverged`` is the set of inodes whose
    content on disk may differ from what the state keeps of them: a file at a path that
    names the same inode in both, and whose inode did not diverge, already has the right
    content and is left alone; everything else is written from the state."""
    base = os.fspath(directory)
    actual = _scan(base)
    removed = 0

    def keep_file(path: str) -> bool:
        ino = state.inodes.get(path)
        return (path in state.files and actual.get(path) is False and ino is not None
                and live.get(path) == ino and ino not in diverged)

    # Deepest first, so a directory is empty (of what is not kept) when it is removed.
    for path in sorted(actual, key=lambda p: p.count("/"), reverse=True):
        full = os.path.join(base, path)
        if actual[path]:
            if path not in state.dirs:
                shutil.rmtree(full)
                removed += 1
        elif not keep_file(path):
            os.unlink(full)
            removed += 1
    created = 0
    for path in sorted(state.dirs, key=lambda p: p.count("/")):
        full = os.path.join(base, path)
        st: os.stat_result | None
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            os.mkdir(full, 0o700)
            created += 1
            st = None
        _set_attrs(full, state.dirs[path], st)
    written = kept = 0
    placed: dict[int, str] = {}  # inode -> first path written for it (hard links)
    for path in sorted(state.files):
        full = os.path.join(base, path)
        ino = state.inodes.get(path)
        if keep_file(path):
            kept += 1
            if ino is not None:
                placed.setdefault(ino, full)
            continue
        if ino is not None and ino in placed:
            os.link(placed[ino], full)
            continue
        _write(full, state.files[path], state.file_attrs[path])
        written += 1
        if ino is not None:
            placed[ino] = full
    return RebuildReport(written, kept, removed, created)
