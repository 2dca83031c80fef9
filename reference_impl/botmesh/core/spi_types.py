"""Plain types of the SPI, kept apart so that the backend interface and the SPI can
both import them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

IndexName = Literal["due", "expires"]
INDEXES: tuple[IndexName, ...] = ("due", "expires")


def check_index(index: Any) -> IndexName:
    """``index`` when it names one of :data:`INDEXES`; ``ValueError`` naming it otherwise
    (a misspelt name must not silently read the other index)."""
    for name in INDEXES:
        if index == name:
            return name
    raise ValueError(f"index must be one of {', '.join(map(repr, INDEXES))}; got {index!r}")


class Versioned(NamedTuple):
    """A stored value and its version."""

    value: dict[str, Any]
    version: int


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims. The conformance suite holds a backend to exactly these
    claims, and a skipped test names the claim that was not made.

    * ``survives_crash`` — an acknowledged write is still there after the process dies
      *or the machine loses power* (and is reopened on the same path / server): it was
      on stable storage before it was acknowledged. Surviving a SIGKILL alone is not
      enough — the operating system's page cache outlives the process, not a power cut.
      The settings such a claim rests on may be reported by ``durability_settings()``
      (see :class:`~botmesh.core.spi.DurableKv`), and are then checked against it.
    * ``multi_process`` — several processes of one host may use it at once; claims stay
      exclusive across them. The default ``instance_id`` then gets a per-boot suffix
      (LEASE-3), as on a shared backend: two processes of one host never share it.
    * ``multi_host`` — several hosts may use it at once.
    * ``shared`` — it is a server other processes reach (PostgreSQL, Redis): the default
      ``instance_id`` then gets a per-boot suffix (LEASE-3).
    """

    survives_crash: bool = False
    multi_process: bool = False
    multi_host: bool = False
    shared: bool = False
