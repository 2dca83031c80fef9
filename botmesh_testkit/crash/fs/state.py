"""The data a power cut leaves, as the persistence model (:mod:`.model`) computes it: a
:class:`CrashState` (every directory and file reachable from the root, with content and
attributes), the :class:`TornWrite` a torn variant cut short, and the names of the
variants. Pure data: writing a state out to a directory is :mod:`.image`'s job."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["DIR_ATTRS", "FILE_ATTRS", "SECTOR_SIZES", "CrashState", "NodeAttrs", "Seed", "TornWrite", "crash_modes"]

SECTOR_SIZES: tuple[int, ...] = (512, 4096)
"""The boundaries a torn write is cut at: a 512-byte sector, a 4 KiB page/sector."""

Seed = int | str
"""What a power cut's random choices are drawn from (``random.Random(seed)``)."""


def crash_modes() -> tuple[str, ...]:
    """The power-cut variants :meth:`PersistenceModel.crash` knows."""
    return ("drop", "subset", "torn")


@dataclass(frozen=True)
class NodeAttrs:
    """Mode bits (permissions only), owner and group of a file or directory."""

    mode: int
    uid: int = 0
    gid: int = 0


DIR_ATTRS = NodeAttrs(0o755)
"""The attributes a directory gets when none are given."""

FILE_ATTRS = NodeAttrs(0o644)
"""The attributes a file gets when none are given."""


@dataclass(frozen=True)
class TornWrite:
    """The write a ``"torn"`` crash state cut short: at ``offset`` of ``path``,
    ``length`` bytes asked, the first ``kept`` of them persisted (``kept`` is a multiple
    of nothing in particular: the cut is at a multiple of ``sector`` of the *file*)."""

    path: str
    offset: int
    length: int
    kept: int
    sector: int


@dataclass(frozen=True)
class CrashState:
    """What a power cut leaves: every directory and file reachable from the root.

    ``dirs`` and ``files`` map paths (relative, ``/``-separated; the root itself is not
    listed) to attributes and content; ``inodes`` maps every path to the model's inode
    number (hard links share one). ``kept`` and ``dropped`` are the sequence numbers of
    the unsynced operations the state kept and lost; ``description`` says it in words."""

    mode: str
    seed: Seed | None
    description: str
    dirs: dict[str, NodeAttrs]
    files: dict[str, bytes]
    file_attrs: dict[str, NodeAttrs]
    inodes: dict[str, int]
    kept: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    torn: TornWrite | None = None

    def fingerprint(self) -> str:
        """A digest of the tree (names, kinds, contents; not attributes, not inode
        numbers): equal for two states a reader could not tell apart."""
        h = hashlib.blake2b(digest_size=16)
        for path in sorted(self.dirs):
            h.update(b"d\0" + path.encode("utf-8", "surrogateescape") + b"\0")
        for path in sorted(self.files):
            data = self.files[path]
            h.update(b"f\0" + path.encode("utf-8", "surrogateescape") + b"\0" + len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()
