"""Power cuts below the driver: a file system that loses what was not made durable.

Two layers, one model:

* :mod:`.model` — :class:`PersistenceModel`, pure Python: which changes of a tree are
  durable and which only in the (simulated) page cache, and the :class:`CrashState` a
  power cut leaves. Used directly by the in-process variant, :class:`PowerCutIO`
  (:mod:`.recording_io`): a ``botmesh.core.fileio.FileIO`` that records what the backend
  does and enumerates the crash states of the unsynced window
  (:meth:`PersistenceModel.crash_states`); :func:`materialize` writes a state out to
  reopen the backend on it.
* :mod:`.mount` / :mod:`.fuse_server` — :class:`PowerCutFS`, a real pass-through FUSE
  file system (kernel FUSE, libfuse 3, the ``mfusepy`` binding: ``pip install
  'botmesh-testkit[powercuts]'``) in a child process, so C code (SQLite, LMDB,
  PostgreSQL, Redis) gets the same faults as Python code.

The model (the full rules in :mod:`.model`):

* file data — writes and size changes — persists only at ``fsync``/``fdatasync`` of
  that file, and that persists neither its name nor anything else;
* a create, mkdir, link, unlink, rmdir persists only at an ``fsync`` of the parent
  directory; a rename only once both directories were fsynced, and then whole;
* a failed ``fsync`` loses the file's unsynced data for good;
* a power cut keeps the durable state (``"drop"``), or also a seeded subset of the
  unsynced writes with a prefix of the unsynced directory operations (``"subset"``), or
  tears the last unsynced write of one file at a 512-byte or 4 KiB boundary
  (``"torn"``).

Stricter than ext4's data=ordered: no fsync of one file persists another's name or the
whole journal; nothing persists by itself after 5 or 30 s; no ``auto_da_alloc`` (a
rename can persist while the renamed file's data does not); a cross-directory rename
needs both directories fsynced; a size change needs the file's fsync. What passes here
is right on every POSIX file system; what fails here may happen to survive on ext4.

The control API (each call answered before it returns)::

    fs = PowerCutFS(tmp_path / "pc")                 # backing dir: tmp_path/pc/backing
    with fs.mount() as m:                            # m.path: the mount point (in /tmp)
        ...set up; m.sync()                          # everything so far durable
        ...run the backend's process on m.path, SIGKILL it...
        report = m.cut("drop" | "subset" | "torn", seed=7)   # mount shows the durable state
        m.fail("write", "*.wal", nth=2, errno=errno.EIO)      # the 2nd matching write fails once
        m.hold("rename", "*", nth=1); op = m.wait_held()       # a rename waits; kill its process,
        m.cut()                                                # then cut (or m.release(): it lands,
                                                               # or m.cancel(): it never does, no cut)
        m.hold("write|truncate|rename", "db/*", nth=5)         # several operations joined by |
        m.stats()                                              # ops, fsyncs, unsynced bytes, faults
        m.check()                                              # [] when model and mount agree

:class:`PowerCutUnavailable` says why a machine cannot mount (skip with its message);
:func:`unavailable_reason` tells without mounting, :func:`mount_refused_reason` by trying;
:class:`PowerCutServerDied` names a dead server (a harness failure, never the backend's);
:func:`cleanup_stale_mounts` unmounts what killed runs left behind (every mount does).
"""

from .faults import FAULT_OPS
from .image import RebuildReport, UnsupportedEntry, load_tree, materialize, rebuild
from .model import ROOT_INO, PersistenceModel, Target
from .mount import (
    REGISTRY_DIR,
    CutReport,
    HeldOp,
    PowerCutError,
    PowerCutFS,
    PowerCutMount,
    PowerCutServerDied,
    PowerCutStats,
    PowerCutUnavailable,
    cleanup_stale_mounts,
    mount_refused_reason,
    unavailable_reason,
)
from .recording_io import PowerCutIO
from .state import SECTOR_SIZES, CrashState, NodeAttrs, Seed, TornWrite, crash_modes

__all__ = [
    "FAULT_OPS", "REGISTRY_DIR", "ROOT_INO", "SECTOR_SIZES", "CrashState", "CutReport", "HeldOp", "NodeAttrs", "PersistenceModel",
    "PowerCutError", "PowerCutFS", "PowerCutIO", "PowerCutMount", "PowerCutServerDied", "PowerCutStats", "PowerCutUnavailable",
    "RebuildReport", "Seed", "Target", "TornWrite", "UnsupportedEntry", "cleanup_stale_mounts", "crash_modes",
    "load_tree", "materialize", "mount_refused_reason", "rebuild", "unavailable_reason",
]
