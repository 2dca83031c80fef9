"""Where the crash matrix makes its work directories (issue 16).

A cell's backend files (``file``, ``file+log``, ``sqlite`` ...), its dry run's and its
power-cut states' go in a temporary directory under :func:`work_root`: ``/dev/shm`` when
there is one (RAM: a cell's fsyncs and directory creations cost next to nothing), else the
system's temporary directory; ``$BOTMESH_MATRIX_TMPDIR`` chooses another. The matrix never
needs the disk: its crashes are in-process deaths (what a dead process leaves is what the
kernel holds, disk or RAM alike) and the power-cut states are the persistence model's
(:mod:`botmesh_testkit.matrix.powercut_states`, whose ``PowerCutIO`` sends no fsync to the
disk anyway). Real power loss is the ``powercuts`` part's, on its own FUSE mount.
"""

from __future__ import annotations

import os
import shutil
import tempfile

__all__ = ["WORK_ROOT_ENV", "ScratchDir", "scratch_dir", "work_root"]

WORK_ROOT_ENV = "BOTMESH_MATRIX_TMPDIR"
"""Environment variable naming the directory the crash matrix's work directories are made
in."""


_SHM = "/dev/shm"
_shm_ok: bool | None = None  # whether /dev/shm is a writable directory: looked at once per process


def work_root() -> str | None:
    """``$BOTMESH_MATRIX_TMPDIR`` (which must be a directory), else ``/dev/shm`` when it is
    a writable directory, else None (``tempfile``'s default)."""
    global _shm_ok
    given = os.environ.get(WORK_ROOT_ENV)
    if given:
        if not os.path.isdir(given):
            raise ValueError(f"{WORK_ROOT_ENV}={given!r} is not a directory")
        return given
    if _shm_ok is None:
        _shm_ok = os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK)
    return _SHM if _shm_ok else None


class ScratchDir:
    """``with ScratchDir(prefix, root) as path``: a new directory made by
    ``tempfile.mkdtemp`` under ``root``, removed with everything in it on exit (or by
    :meth:`cleanup`). An empty one (a cell of a backend that writes no file: ``memory``,
    the servers) is removed with one ``rmdir``, without ``tempfile.TemporaryDirectory``'s
    finalizer and tree walk (issue 16: a cost per cell)."""

    def __init__(self, prefix: str, root: str | None) -> None:
        self.name = tempfile.mkdtemp(prefix=prefix, dir=root)

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        try:
            os.rmdir(self.name)
        except FileNotFoundError:
            pass
        except OSError:  # not empty
            shutil.rmtree(self.name)


def scratch_dir(prefix: str) -> ScratchDir:
    """A temporary work directory under :func:`work_root`, removed on exit."""
    return ScratchDir(prefix, work_root())
