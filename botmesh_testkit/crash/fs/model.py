"""The persistence model of the power-cut file system: which changes of a tree of files and
directories are **durable** (would survive a power cut) and which are only in the
(simulated) page cache. Pure Python: no file system, no OS call; the FUSE server
(:mod:`.fuse_server`) and the in-process variant feed it the operations they pass through
and ask it for the state a power cut leaves.

The model is inode-based, like a real file system: a file's data belongs to its inode, a
name belongs to its directory. Every operation is first *visible* (later operations and
readers see it) and *unsynced*; it becomes *durable* by these rules (CrashMonkey / ALICE /
LazyFS style):

1. **File data** — a ``write`` and a size change (``truncate``, also the one an ``O_TRUNC``
   open makes) — persists only at ``fsync`` or ``fdatasync`` *of that file* (of any of its
   names or open handles). Both persist the data and the size together; nothing else.
2. **Directory entries** — ``create``, ``mkdir``, ``link``, ``unlink``, ``rmdir`` —
   persist only at an ``fsync`` *of the parent directory*. A ``rename`` persists only once
   *both* directories (source and target; one, when they are the same) were fsynced after
   it, and then as a whole (a rename is never half-applied).
3. ``fsync`` of a file does **not** persist its directory entry: a file that was created,
   written and fsynced, in a directory that was never fsynced, is gone after a power cut
   (and an inode whose entry did persist keeps whatever of its data was fsynced).
4. Entries persist in order per name: an entry change cannot become durable while an
   earlier change of the same name in the same directory is not (a later ``rename b -> a``
   never persists while an earlier ``rename a -> elsewhere`` has not).
5. An ``fsync`` that failed (``EIO``, injected by the FUSE layer): the file's unsynced data
   is lost for good — it stays visible, but will not be durable even if a later ``fsync``
   succeeds (what Linux does since 4.13: the error is reported once and the pages are
   marked clean).
6. Modes, owners and timestamps are not modelled: they are applied at once and kept
   across a power cut. Symbolic links and extended attributes are not supported.

A power cut yields a :class:`CrashState` (every directory and file reachable from the
root, with its content), in one of three seeded variants (:meth:`PersistenceModel.crash`):

* ``"drop"`` — the durable state: every unsynced operation is lost.
* ``"subset"`` — writeback in any order: each unsynced data operation (write or size
  change) is kept or dropped independently (probability ½ each), and of the unsynced
  directory operations a *prefix* is kept (a metadata journal commits in order). A kept
  write past a dropped one leaves a hole of zeros, as delayed allocation does.
* ``"torn"`` — everything unsynced is dropped except in one file (chosen by the seed among
  those whose last unsynced write crosses a sector boundary): its earlier unsynced data
  operations are kept, and of its *last* unsynced write only a prefix persists, cut at a
  512-byte or 4 KiB boundary of the file (sector and boundary chosen by the seed; a disk
  writes a sector whole or not at all). With no write crossing a boundary the torn
  variant is the durable state (:attr:`CrashState.torn` is ``None``).

For the in-process variant :meth:`PersistenceModel.crash_states` enumerates the crash
states of the unsynced window: every prefix of the unsynced operations in the order they
were made (0 kept … all kept), optionally each write torn at a sector boundary, plus
``subsets`` seeded subsets; identical states are yielded once.

**Where this is stricter than ext4 (data=ordered, the default)**, so a backend that passes
here is right on ext4, XFS and btrfs alike, and one that fails may still happen to survive
on ext4:

* ext4 keeps one metadata journal: an ``fsync`` of *any* file commits every earlier
  create, rename and unlink of the whole file system, so fsyncing a new file also persists
  its name. Here only an ``fsync`` of the directory persists its entries (rule 3: the
  ALICE finding that POSIX does not promise more).
* ext4 commits the journal every 5 s and writes dirty data back after ~30 s on its own;
  here nothing becomes durable without an explicit ``fsync`` (``"subset"`` stands for the
  writeback that may have happened).
* ext4's ``auto_da_alloc`` forces the data of a file renamed over another (or truncated
  to zero and rewritten) to disk before the rename commits; here a rename without an
  ``fsync`` of the file can persist while the data does not (the empty-file-after-rename
  crash state, real on XFS and on ext4 with ``noauto_da_alloc``).
* A cross-directory rename needs an ``fsync`` of both directories (ext4: either).
* A size change persists only with an ``fsync`` of the file, not of its directory (ext4
  commits it with the journal).
* ``"subset"`` may keep a later append without an earlier one (a hole of zeros); ext4
  data=ordered only moves the size on disk once the data below it is written.
* Torn writes are no stricter: ext4 data=ordered overwrites data in place without a
  journal, so a multi-sector write can be torn there as well (the model tears only at
  sector boundaries, never inside a sector).

Paths are ``/``-separated and relative to the root (a leading ``/`` is ignored; ``""`` is
the root). Operations raise the ``OSError`` subclasses the OS would (``FileNotFoundError``,
``FileExistsError``, ``IsADirectoryError``, ``NotADirectoryError``, ``OSError(ENOTEMPTY)``)
and change nothing when they do. A *target* is a path or an inode number (what
:meth:`PersistenceModel.lookup` returns), so a caller holding an open file can keep
addressing it after it was renamed or unlinked.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from .state import DIR_ATTRS, FILE_ATTRS, SECTOR_SIZES, CrashState, NodeAttrs, Seed, TornWrite, crash_modes

__all__ = ["ROOT_INO", "PersistenceModel", "Target"]

ROOT_INO = 1
"""The inode number of the root directory."""

Target = str | int
"""A path (relative to the root) or an inode number (:meth:`PersistenceModel.lookup`)."""


@dataclass(frozen=True)
class _DataOp:
    """A write (``data`` set) or a size change (``data`` None, ``offset`` = new size)."""

    seq: int
    ino: int
    offset: int
    data: bytes | None


@dataclass
class _MetaOp:
    """A change of directory entries, applied as ``effects`` (directory inode, name, new
    target inode or None to remove), durable once every directory of ``needs`` was
    fsynced after it (``synced``) and no earlier change of one of its names is pending."""

    seq: int
    text: str
    effects: tuple[tuple[int, str, int | None], ...]
    needs: frozenset[int]
    synced: set[int] = field(default_factory=set)
    durable: bool = False

    @property
    def keys(self) -> set[tuple[int, str]]:
        return {(d, n) for d, n, _ in self.effects}


@dataclass
class _Inode:
    ino: int
    is_dir: bool
    attrs: NodeAttrs
    durable: bytearray = field(default_factory=bytearray)  # file content at the last fsync
    size: int = 0  # visible size (files)
    pending: list[_DataOp] = field(default_factory=list)
    diverged: bool = False  # visible content differs from durable + pending (a failed fsync)
    live_links: int = 0
    base_links: int = 0
    log_refs: int = 0
    handles: int = 0


def _split(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"'..' is not supported in model paths: {path!r}")
    return parts


def _apply_data(buf: bytearray, op: _DataOp, upto: int | None = None) -> None:
    """Apply one data operation to ``buf`` (of a write only the first ``upto`` bytes)."""
    if op.data is None:
        if op.offset < len(buf):
            del buf[op.offset:]
        else:
            buf.extend(bytes(op.offset - len(buf)))
        return
    data = op.data if upto is None else op.data[:upto]
    if not data:
        return
    if op.offset > len(buf):
        buf.extend(bytes(op.offset - len(buf)))
    buf[op.offset:op.offset + len(data)] = data


def _boundaries(op: _DataOp, sector: int) -> list[int]:
    """Offsets (relative to the write) of the ``sector`` boundaries strictly inside it."""
    assert op.data is not None
    first = (op.offset // sector + 1) * sector
    return [b - op.offset for b in range(first, op.offset + len(op.data), sector)]


class PersistenceModel:
    """The durable and the unsynced state of one tree (module docstring for the rules).

    Feed it every operation, in the order it happened; ask :meth:`crash` for what a power
    cut leaves, :meth:`crash_states` for every crash state of the unsynced window,
    :meth:`visible_state` for what a reader sees now. After a power cut, continue with
    ``PersistenceModel.from_state(state)``."""

    def __init__(self, root_attrs: NodeAttrs = DIR_ATTRS) -> None:
        self._seq = 0
        self._next_ino = ROOT_INO + 1
        root = _Inode(ROOT_INO, True, root_attrs, live_links=1, base_links=1)
        self._inodes: dict[int, _Inode] = {ROOT_INO: root}
        self._live: dict[int, dict[str, int]] = {ROOT_INO: {}}
        self._base: dict[int, dict[str, int]] = {ROOT_INO: {}}
        self._log: list[_MetaOp] = []

    # -- building a durable image ------------------------------------------------------------
    @classmethod
    def from_state(cls, state: CrashState, root_attrs: NodeAttrs = DIR_ATTRS) -> PersistenceModel:
        """A model whose durable (and visible) state is ``state``, nothing unsynced: the
        file system after a power cut. Hard links of ``state`` stay hard links."""
        model = cls(root_attrs)
        for path in sorted(state.dirs, key=lambda p: p.count("/")):
            model.add_durable_dir(path, state.dirs[path])
        made: dict[int, int] = {}  # inode in ``state`` -> inode here, so hard links stay links
        for path in sorted(state.files):
            old = state.inodes.get(path)
            if old is not None and old in made:
                model._durable_link(path, made[old])
                continue
            ino = model.add_durable_file(path, state.files[path], state.file_attrs.get(path, FILE_ATTRS))
            if old is not None:
                made[old] = ino
        return model

    def add_durable_dir(self, path: str, attrs: NodeAttrs = DIR_ATTRS) -> int:
        """Add a directory that is already on disk (durable); its parent must exist."""
        parent, name = self._parent_and_name(path)
        ino = self._new_inode(True, attrs)
        self._live[ino] = {}
        self._base[ino] = {}
        self._durable_set(parent, name, ino)
        return ino

    def add_durable_file(self, path: str, data: bytes = b"", attrs: NodeAttrs = FILE_ATTRS) -> int:
        """Add a file that is already on disk with ``data`` (durable)."""
        parent, name = self._parent_and_name(path)
        ino = self._new_inode(False, attrs)
        node = self._inodes[ino]
        node.durable = bytearray(data)
        node.size = len(data)
        self._durable_set(parent, name, ino)
        return ino

    def _durable_link(self, path: str, ino: int) -> None:
        parent, name = self._parent_and_name(path)
        self._durable_set(parent, name, ino)

    def _durable_set(self, parent: int, name: str, ino: int) -> None:
        if name in self._live[parent]:
            raise FileExistsError(errno.EEXIST, "File exists", name)
        self._live[parent][name] = ino
        self._base[parent][name] = ino
        self._inodes[ino].live_links += 1
        self._inodes[ino].base_links += 1

    # -- lookups -------------------------------------------------------------------------------
    def lookup(self, path: str) -> int | None:
        """The inode number ``path`` names now (visible state), or ``None``."""
        ino = ROOT_INO
        for part in _split(path):
            entries = self._live.get(ino)
            if entries is None or part not in entries:
                return None
            ino = entries[part]
        return ino

    def visible_paths(self) -> dict[str, int]:
        """Every path that exists now (visible state; the root not listed) -> its inode."""
        return {path: ino for path, ino, _ in self._walk(self._live)}

    def is_dir(self, target: Target) -> bool:
        """Whether ``target`` is a directory (it must exist)."""
        return self._inodes[self._ino(target)].is_dir

    def size(self, target: Target) -> int:
        """The visible size of file ``target``."""
        return self._file(target).size

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists now (visible state)."""
        return self.lookup(path) is not None

    def open_handle(self, target: Target) -> int:
        """Note that a handle is open on ``target`` (its inode is kept while unlinked);
        returns the inode number, to address it with from now on."""
        ino = self._ino(target)
        self._inodes[ino].handles += 1
        return ino

    def close_handle(self, ino: int) -> None:
        """The handle of :meth:`open_handle` was closed."""
        node = self._inodes.get(ino)
        if node is not None:
            node.handles -= 1
            self._maybe_free(ino)

    # -- data operations -------------------------------------------------------------------------
    def write(self, target: Target, offset: int, data: bytes | bytearray) -> None:
        """``pwrite(data, offset)`` on file ``target``: visible now, durable at its fsync."""
        if offset < 0:
            raise OSError(errno.EINVAL, "Invalid argument")
        node = self._file(target)
        if not data:
            return
        node.pending.append(_DataOp(self._next_seq(), node.ino, offset, bytes(data)))
        node.size = max(node.size, offset + len(data))

    def truncate(self, target: Target, size: int) -> None:
        """``ftruncate(size)`` of file ``target`` (a no-op when the size does not change)."""
        if size < 0:
            raise OSError(errno.EINVAL, "Invalid argument")
        node = self._file(target)
        if size == node.size:
            return
        node.pending.append(_DataOp(self._next_seq(), node.ino, size, None))
        node.size = size

    def fsync(self, target: Target) -> None:
        """``fsync``: of a file, its data and size become durable (not its name); of a
        directory, the changes of its entries (rule 2)."""
        ino = self._ino(target)
        node = self._inodes[ino]
        if node.is_dir:
            self._sync_dir(ino)
            return
        for op in node.pending:
            _apply_data(node.durable, op)
        node.pending.clear()

    def fdatasync(self, target: Target) -> None:
        """``fdatasync``: the same as :meth:`fsync` in this model (the size is part of the
        data; timestamps are not modelled)."""
        self.fsync(target)

    def fsync_failed(self, target: Target) -> int:
        """An ``fsync`` of file ``target`` failed: its unsynced data is lost for good
        (rule 5). Returns how many unsynced operations were lost."""
        node = self._file(target)
        lost = len(node.pending)
        if lost:
            node.pending.clear()
            node.diverged = True
        return lost

    def sync_all(self) -> None:
        """Make everything durable, as ``sync(2)`` would on a real disk: every file's data
        and every directory operation (a test's set-up, before the workload whose power
        cuts matter). Data a failed fsync lost stays lost."""
        for node in self._inodes.values():
            for op in node.pending:
                _apply_data(node.durable, op)
            node.pending.clear()
        for m in self._log:
            m.durable = True
        while self._log:
            self._fold(self._log.pop(0))

    # -- directory operations ---------------------------------------------------------------------
    def create(self, path: str, attrs: NodeAttrs = FILE_ATTRS) -> int:
        """Create an empty file at ``path`` (its name persists at an fsync of the parent)."""
        parent, name = self._parent_and_name(path)
        self._absent(parent, name, path)
        ino = self._new_inode(False, attrs)
        self._meta(f"create {path}", ((parent, name, ino),), {parent})
        return ino

    def mkdir(self, path: str, attrs: NodeAttrs = DIR_ATTRS) -> int:
        """Create a directory at ``path``."""
        parent, name = self._parent_and_name(path)
        self._absent(parent, name, path)
        ino = self._new_inode(True, attrs)
        self._live[ino] = {}
        self._base[ino] = {}
        self._meta(f"mkdir {path}", ((parent, name, ino),), {parent})
        return ino

    def link(self, src: str, dst: str) -> None:
        """A hard link ``dst`` to file ``src``."""
        ino = self._existing(src)
        if self._inodes[ino].is_dir:
            raise PermissionError(errno.EPERM, "Operation not permitted", src)
        parent, name = self._parent_and_name(dst)
        self._absent(parent, name, dst)
        self._meta(f"link {src} -> {dst}", ((parent, name, ino),), {parent})

    def unlink(self, path: str) -> None:
        """Remove the file name ``path``."""
        parent, name = self._parent_and_name(path)
        ino = self._live[parent].get(name)
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if self._inodes[ino].is_dir:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        self._meta(f"unlink {path}", ((parent, name, None),), {parent})

    def rmdir(self, path: str) -> None:
        """Remove the empty directory ``path``."""
        parent, name = self._parent_and_name(path)
        ino = self._live[parent].get(name)
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if not self._inodes[ino].is_dir:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        if self._live[ino]:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", path)
        self._meta(f"rmdir {path}", ((parent, name, None),), {parent})

    def rename(self, old: str, new: str) -> None:
        """``rename(old, new)``, replacing ``new`` when it exists (as ``rename(2)``)."""
        sp, sn = self._parent_and_name(old)
        ino = self._live[sp].get(sn)
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", old)
        dp, dn = self._parent_and_name(new)
        existing = self._live[dp].get(dn)
        if existing == ino:
            return  # two names of one inode: rename(2) does nothing
        node = self._inodes[ino]
        if node.is_dir and self._is_inside(dp, ino):
            raise OSError(errno.EINVAL, "Invalid argument", new)
        if existing is not None:
            other = self._inodes[existing]
            if other.is_dir and not node.is_dir:
                raise IsADirectoryError(errno.EISDIR, "Is a directory", new)
            if node.is_dir and not other.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", new)
            if other.is_dir and self._live[existing]:
                raise OSError(errno.ENOTEMPTY, "Directory not empty", new)
        self._meta(f"rename {old} -> {new}", ((sp, sn, None), (dp, dn, ino)), {sp, dp})

    # -- attributes (not crash-modelled) ----------------------------------------------------------
    def set_attrs(self, target: Target, *, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None) -> None:
        """Change mode bits / owner of ``target``: applied at once, kept across a cut."""
        node = self._inodes[self._ino(target)]
        a = node.attrs
        node.attrs = NodeAttrs(a.mode if mode is None else mode & 0o7777,
                               a.uid if uid is None else uid, a.gid if gid is None else gid)

    # -- what is unsynced -------------------------------------------------------------------------
    def unsynced_bytes(self) -> int:
        """Bytes written and not yet durable (sum over the unsynced writes)."""
        return sum(len(op.data) for node in self._inodes.values() for op in node.pending if op.data is not None)

    def unsynced_ops(self) -> int:
        """How many operations are not yet durable (data and directory operations)."""
        return sum(len(n.pending) for n in self._inodes.values()) + sum(1 for m in self._log if not m.durable)

    def unsynced(self) -> list[str]:
        """The unsynced operations in the order they were made, in words (for reports)."""
        items: list[tuple[int, str]] = [(m.seq, m.text) for m in self._log if not m.durable]
        names = self._live_names()
        for node in self._inodes.values():
            for op in node.pending:
                where = names.get(op.ino, f"inode {op.ino}")
                text = (f"truncate {where} to {op.offset}" if op.data is None
                        else f"write {where} [{op.offset}, {op.offset + len(op.data)})")
                items.append((op.seq, text))
        return [text for _, text in sorted(items)]

    def diverged(self) -> set[int]:
        """Inodes whose visible content differs from what a power cut could leave of
        them: those with unsynced data, or whose data was lost by a failed fsync."""
        return {n.ino for n in self._inodes.values() if n.pending or n.diverged}

    def lost_writes(self) -> set[int]:
        """Inodes whose unsynced data a failed fsync lost (rule 5): what a reader sees of
        them is not what the model can rebuild."""
        return {n.ino for n in self._inodes.values() if n.diverged}

    def inode_count(self) -> int:
        """Inodes the model still tracks (for tests of its bookkeeping)."""
        return len(self._inodes)

    # -- crash states --------------------------------------------------------------------------------
    def visible_state(self) -> CrashState:
        """What a reader sees now (every operation applied), as a :class:`CrashState`.
        Files whose data a failed fsync lost show their durable data plus what is
        unsynced, not what a reader sees (the FUSE layer's backing store has that)."""
        meta = [m for m in self._log]
        data = {n.ino: list(n.pending) for n in self._inodes.values() if n.pending}
        return self._state("visible", None, "every operation applied", meta, data, None, (), ())

    def crash(self, mode: str = "drop", seed: Seed = 0, *, sector: int | None = None) -> CrashState:
        """The state a power cut leaves, in variant ``mode`` (``"drop"``, ``"subset"``,
        ``"torn"``: module docstring), drawn from ``random.Random(seed)`` — the same seed
        and the same history give the same state. ``sector`` fixes the torn variant's
        boundary (512 or 4096; by default the seed picks one)."""
        if mode not in crash_modes():
            raise ValueError(f"unknown power-cut mode {mode!r}: one of {', '.join(crash_modes())}")
        if sector is not None and sector <= 0:
            raise ValueError(f"sector must be positive, got {sector!r}")
        rng = random.Random(seed)
        pending_meta = [m for m in self._log if not m.durable]
        durable_meta = [m for m in self._log if m.durable]
        all_data = sorted((op for n in self._inodes.values() for op in n.pending), key=lambda o: o.seq)
        if mode == "drop":
            return self._state("drop", seed, "every unsynced operation dropped", durable_meta, {}, None,
                               (), self._seqs(pending_meta, all_data))
        if mode == "subset":
            keep_meta = rng.randint(0, len(pending_meta))
            kept_data = [op for op in all_data if rng.random() < 0.5]
            data: dict[int, list[_DataOp]] = {}
            for op in kept_data:
                data.setdefault(op.ino, []).append(op)
            kept_meta = {m.seq for m in pending_meta[:keep_meta]}
            meta = [m for m in self._log if m.durable or m.seq in kept_meta]
            kept = tuple(sorted([*kept_meta, *(op.seq for op in kept_data)]))
            kept_set = set(kept)
            dropped = tuple(s for s in self._seqs(pending_meta, all_data) if s not in kept_set)
            text = (f"a subset of the unsynced operations kept: {keep_meta} of {len(pending_meta)} directory "
                    f"operations (a prefix), {len(kept_data)} of {len(all_data)} data operations")
            return self._state("subset", seed, text, meta, data, None, kept, dropped)
        return self._torn(rng, seed, sector, durable_meta, pending_meta, all_data)

    def crash_states(self, *, subsets: int = 0, seed: Seed = 0, torn: bool = False,
                     unique: bool = True) -> Iterator[CrashState]:
        """Every crash state of the unsynced window (the in-process variant): for each
        ``k`` from 0 to the number of unsynced operations, the state with the first ``k``
        of them kept (in the order they were made; ``k = 0`` is the durable state); with
        ``torn``, also each unsynced write torn at a 512-byte boundary (a seeded one) after
        the operations before it; then ``subsets`` seeded ``"subset"`` states (seeds
        ``f"{seed}/{i}"``). With ``unique`` a state equal to one already yielded (same
        :meth:`CrashState.fingerprint`) is skipped. The model must not change while the
        iterator is consumed."""
        pending_meta = [m for m in self._log if not m.durable]
        all_data = [op for n in self._inodes.values() for op in n.pending]
        window: list[_MetaOp | _DataOp] = sorted([*pending_meta, *all_data], key=lambda o: o.seq)
        seen: set[str] = set()
        rng = random.Random(f"{seed}/torn")

        def fresh(state: CrashState) -> bool:
            if not unique:
                return True
            fp = state.fingerprint()
            if fp in seen:
                return False
            seen.add(fp)
            return True

        for k in range(len(window) + 1):
            head = window[:k]
            state = self._window_state(head, None, f"the first {k} of {len(window)} unsynced operations kept", window)
            if fresh(state):
                yield state
            if torn and k < len(window):
                op = window[k]
                if isinstance(op, _DataOp) and op.data is not None:
                    cuts = _boundaries(op, SECTOR_SIZES[0])
                    if cuts:
                        cut = rng.choice(cuts)
                        state = self._window_state(head, (op, cut, SECTOR_SIZES[0]),
                                                   f"the first {k} of {len(window)} unsynced operations kept, "
                                                   f"then {cut} of the {len(op.data)} bytes of the next write",
                                                   window)
                        if fresh(state):
                            yield state
        for i in range(subsets):
            state = self.crash("subset", seed=f"{seed}/{i}")
            if fresh(state):
                yield state

    # -- internals: crash states ------------------------------------------------------------------
    @staticmethod
    def _seqs(meta: list[_MetaOp], data: list[_DataOp]) -> tuple[int, ...]:
        return tuple(sorted([m.seq for m in meta] + [op.seq for op in data]))

    def _window_state(self, head: list[_MetaOp | _DataOp], tear: tuple[_DataOp, int, int] | None,
                      text: str, window: list[_MetaOp | _DataOp]) -> CrashState:
        kept_meta = {id(m) for m in head if isinstance(m, _MetaOp)}
        meta = [m for m in self._log if m.durable or id(m) in kept_meta]
        data: dict[int, list[_DataOp]] = {}
        for op in head:
            if isinstance(op, _DataOp):
                data.setdefault(op.ino, []).append(op)
        torn_info: tuple[_DataOp, int, int] | None = None
        kept = [op.seq for op in head]
        if tear is not None:
            data.setdefault(tear[0].ino, []).append(tear[0])
            torn_info = tear
            kept.append(tear[0].seq)
        kept_set = set(kept)
        dropped = tuple(op.seq for op in window if op.seq not in kept_set)
        return self._state("prefix" if tear is None else "torn-prefix", None, text, meta, data, torn_info,
                           tuple(kept), dropped)

    def _torn(self, rng: random.Random, seed: Seed, sector: int | None, durable_meta: list[_MetaOp],
              pending_meta: list[_MetaOp], all_data: list[_DataOp]) -> CrashState:
        reachable = self._reachable(durable_meta)
        sizes = [sector] if sector is not None else [rng.choice(SECTOR_SIZES)]
        if sector is None:
            sizes += [s for s in SECTOR_SIZES if s != sizes[0]]
        everything = self._seqs(pending_meta, all_data)
        for size in sizes:
            candidates: list[tuple[str, _Inode, _DataOp]] = []
            for path, ino in sorted(reachable.items()):
                node = self._inodes[ino]
                writes = [op for op in node.pending if op.data is not None]
                if writes and _boundaries(writes[-1], size) and all(c[1] is not node for c in candidates):
                    candidates.append((path, node, writes[-1]))
            if not candidates:
                continue
            path, node, last = rng.choice(candidates)
            cut = rng.choice(_boundaries(last, size))
            before = [op for op in node.pending if op.seq < last.seq]
            assert last.data is not None
            kept = tuple(op.seq for op in [*before, last])
            dropped = tuple(s for s in everything if s not in kept)
            text = (f"the last unsynced write of {path} torn at a {size}-byte boundary: {cut} of its "
                    f"{len(last.data)} bytes at offset {last.offset} persisted, with the {len(before)} unsynced "
                    f"data operations of that file before it; everything else unsynced dropped")
            return self._state("torn", seed, text, durable_meta, {node.ino: [*before, last]},
                               (last, cut, size), kept, dropped, torn_path=path)
        return self._state("torn", seed, "no unsynced write crosses a sector boundary: every unsynced operation "
                           "dropped", durable_meta, {}, None, (), everything)

    def _reachable(self, meta: list[_MetaOp]) -> dict[str, int]:
        """Path -> inode of the files reachable with the durable base plus ``meta``."""
        ns = self._namespace(meta)
        out: dict[str, int] = {}
        for path, ino, is_dir in self._walk(ns):
            if not is_dir:
                out[path] = ino
        return out

    def _namespace(self, meta: list[_MetaOp]) -> dict[int, dict[str, int]]:
        ns = {d: dict(entries) for d, entries in self._base.items()}
        for m in meta:
            for d, name, target in m.effects:
                entries = ns.setdefault(d, {})
                if target is None:
                    entries.pop(name, None)
                else:
                    entries[name] = target
        return ns

    def _walk(self, ns: dict[int, dict[str, int]]) -> Iterator[tuple[str, int, bool]]:
        # A rename kept without an earlier one could in principle link a directory twice:
        # each directory is entered once, so the walk always ends.
        stack: list[tuple[str, int]] = [("", ROOT_INO)]
        entered = {ROOT_INO}
        while stack:
            prefix, d = stack.pop()
            for name in sorted(ns.get(d, {})):
                ino = ns[d][name]
                node = self._inodes.get(ino)
                if node is None:
                    continue
                path = f"{prefix}{name}"
                if node.is_dir:
                    if ino in entered:
                        continue
                    entered.add(ino)
                    yield path, ino, True
                    stack.append((path + "/", ino))
                else:
                    yield path, ino, False

    def _state(self, mode: str, seed: Seed | None, text: str, meta: list[_MetaOp],
               data: dict[int, list[_DataOp]], tear: tuple[_DataOp, int, int] | None,
               kept: tuple[int, ...], dropped: tuple[int, ...], torn_path: str | None = None) -> CrashState:
        ns = self._namespace(meta)
        dirs: dict[str, NodeAttrs] = {}
        files: dict[str, bytes] = {}
        fattrs: dict[str, NodeAttrs] = {}
        inodes: dict[str, int] = {}
        contents: dict[int, bytes] = {}
        for path, ino, is_dir in self._walk(ns):
            node = self._inodes[ino]
            inodes[path] = ino
            if is_dir:
                dirs[path] = node.attrs
                continue
            if ino not in contents:
                ops = data.get(ino, [])
                if not ops:
                    contents[ino] = bytes(node.durable)
                else:
                    buf = bytearray(node.durable)
                    for op in sorted(ops, key=lambda o: o.seq):
                        upto = tear[1] if tear is not None and op is tear[0] else None
                        _apply_data(buf, op, upto)
                    contents[ino] = bytes(buf)
            files[path] = contents[ino]
            fattrs[path] = node.attrs
        torn = None
        if tear is not None:
            op, cut, sector = tear
            assert op.data is not None
            where = torn_path or next((p for p, i in inodes.items() if i == op.ino), f"inode {op.ino}")
            torn = TornWrite(where, op.offset, len(op.data), cut, sector)
        return CrashState(mode, seed, text, dirs, files, fattrs, inodes, kept, dropped, torn)

    # -- internals: bookkeeping ----------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _new_inode(self, is_dir: bool, attrs: NodeAttrs) -> int:
        ino = self._next_ino
        self._next_ino += 1
        self._inodes[ino] = _Inode(ino, is_dir, attrs)
        return ino

    def _ino(self, target: Target) -> int:
        if isinstance(target, int):
            if target not in self._inodes:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", f"inode {target}")
            return target
        return self._existing(target)

    def _existing(self, path: str) -> int:
        ino = self.lookup(path)
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return ino

    def _file(self, target: Target) -> _Inode:
        node = self._inodes[self._ino(target)]
        if node.is_dir:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(target))
        return node

    def _parent_and_name(self, path: str) -> tuple[int, str]:
        parts = _split(path)
        if not parts:
            raise OSError(errno.EBUSY, "Device or resource busy (the root)", path)
        parent = self._existing("/".join(parts[:-1]))
        if not self._inodes[parent].is_dir:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        return parent, parts[-1]

    def _absent(self, parent: int, name: str, path: str) -> None:
        if name in self._live[parent]:
            raise FileExistsError(errno.EEXIST, "File exists", path)

    def _is_inside(self, d: int, ancestor: int) -> bool:
        """Whether directory ``d`` is ``ancestor`` or below it (visible state)."""
        parents = {child: parent for parent, entries in self._live.items() for child in entries.values()
                   if self._inodes[child].is_dir}
        seen: set[int] = set()
        while d not in seen:
            if d == ancestor:
                return True
            seen.add(d)
            if d == ROOT_INO or d not in parents:
                return False
            d = parents[d]
        return False

    def _live_names(self) -> dict[int, str]:
        return {ino: path for path, ino in self.visible_paths().items()}

    def _meta(self, text: str, effects: tuple[tuple[int, str, int | None], ...], needs: set[int]) -> None:
        op = _MetaOp(self._next_seq(), text, effects, frozenset(needs))
        for d, name, target in effects:
            old = self._live[d].pop(name, None)
            if target is not None:
                self._live[d][name] = target
                self._inodes[target].live_links += 1
                self._inodes[target].log_refs += 1
            if old is not None:
                self._inodes[old].live_links -= 1
                self._maybe_free(old)
        self._log.append(op)

    def _sync_dir(self, d: int) -> None:
        for m in self._log:
            if d in m.needs:
                m.synced.add(d)
        blocked: set[tuple[int, str]] = set()
        for m in self._log:
            if not m.durable and m.needs <= m.synced and not (m.keys & blocked):
                m.durable = True
            if not m.durable:
                blocked |= m.keys
        while self._log and self._log[0].durable:
            self._fold(self._log.pop(0))

    def _fold(self, m: _MetaOp) -> None:
        """Apply the durable operation ``m`` to the durable base namespace."""
        for d, name, target in m.effects:
            entries = self._base.setdefault(d, {})
            old = entries.pop(name, None)
            if target is not None:
                entries[name] = target
                node = self._inodes[target]
                node.base_links += 1
                node.log_refs -= 1
            if old is not None:
                self._inodes[old].base_links -= 1
                self._maybe_free(old)
        for _, _, target in m.effects:
            if target is not None:
                self._maybe_free(target)

    def _maybe_free(self, ino: int) -> None:
        """Forget an inode no name, no pending operation and no handle refers to (the
        temporary files of a long run would otherwise accumulate)."""
        node = self._inodes.get(ino)
        if node is None or ino == ROOT_INO:
            return
        if node.live_links or node.base_links or node.log_refs or node.handles:
            return
        if node.is_dir and (self._live.get(ino) or self._base.get(ino)):
            return
        del self._inodes[ino]
        self._live.pop(ino, None)
        self._base.pop(ino, None)
