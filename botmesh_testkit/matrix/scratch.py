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
import tempfile

__all__ = ["WORK_ROOT_ENV", "scratch_dir", "work_root"]

WORK_ROOT_ENV = "BOTMESH_MATRIX_TMPDIR"
"""Environment variable naming the directory the crash matrix's work directories are made
in."""


def work_root() -> str | None:
    """``$BOTMESH_MATRIX_TMPDIR`` (which must be a directory), else ``/dev/shm`` when it is
    a writable directory, else None (``tempfile``'s default)."""
    given = os.environ.get(WORK_ROOT_ENV)
    if given:
        if not os.path.isdir(given):
            raise ValueError(f"{WORK_ROOT_ENV}={given!r} is not a directory")
        return given
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return None


def scratch_dir(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary work directory under :func:`work_root`, removed on exit."""
    return tempfile.TemporaryDirectory(prefix=prefix, dir=work_root())
