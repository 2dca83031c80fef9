"""Seeded damage to a backend's files, as storage hardware and file systems inflict it:
the ``corruption`` part (:mod:`botmesh_testkit.matrix.corruption`) applies one
:class:`Damage` to a copy of a backend's files between two incarnations.

Kinds (:data:`KINDS`):

* ``truncate`` — the file loses its tail (a new length drawn below the old one);
* ``bitflip`` — one bit of the file inverted;
* ``zero512`` / ``zero4096`` — one aligned 512-byte sector or 4 KiB page reads back as
  zeros (a lost or never-written page; the last one may be short);
* ``swap`` — two aligned blocks of 512 bytes (4 KiB in files of 16 KiB or more) trade
  places (a misdirected write); in a file shorter than two blocks, its two halves.

A drawn damage that would leave the bytes as they are (zeros over zeros, two equal
blocks) is drawn again, so every variant really differs from the original.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS: tuple[str, ...] = ("truncate", "bitflip", "zero512", "zero4096", "swap")
"""The kinds of damage, drawn in turn (variant ``n`` gets ``KINDS[n % len(KINDS)]``)."""


@dataclass(frozen=True)
class Damage:
    """One damage of one file: ``kind`` over bytes ``[start, end)`` (for ``swap``, the
    first block; ``other`` is the second one's start; for ``truncate``, ``start`` is the
    new length and ``end`` the old one; for ``bitflip``, ``bit`` is the bit of the byte
    at ``start``)."""

    file: str
    kind: str
    start: int
    end: int
    other: int = 0
    bit: int = 0

    @property
    def first_byte(self) -> int:
        """The first byte the damage touches (the new end of a truncated file)."""
        return min(self.start, self.other) if self.kind == "swap" else self.start

    def describe(self) -> str:
        """``bitflip of bot.db-wal at byte 4120 (bit 3)`` ..."""
        if self.kind == "truncate":
            return f"truncate {self.file} from {self.end} to {self.start} bytes"
        if self.kind == "bitflip":
            return f"bitflip of {self.file} at byte {self.start} (bit {self.bit})"
        if self.kind == "swap":
            size = self.end - self.start
            return f"swap of {self.file} blocks at bytes {self.start} and {self.other} ({size} bytes each)"
        return f"{self.kind} of {self.file} bytes {self.start}..{self.end}"

    def apply(self, data: bytes) -> bytes:
        """``data`` (the file's bytes) damaged."""
        if self.kind == "truncate":
            return data[: self.start]
        out = bytearray(data)
        if self.kind == "bitflip":
            out[self.start] ^= 1 << self.bit
        elif self.kind in ("zero512", "zero4096"):
            out[self.start:self.end] = bytes(self.end - self.start)
        elif self.kind == "swap":
            size = self.end - self.start
            a, b = bytes(out[self.start:self.end]), bytes(out[self.other:self.other + size])
            out[self.start:self.end], out[self.other:self.other + size] = b, a
        else:
            raise ValueError(f"unknown damage kind {self.kind!r}; known: {', '.join(KINDS)}")
        return bytes(out)


def draw(rng: random.Random, file: str, data: bytes, kind: str, *, tries: int = 20) -> Damage | None:
    """A damage of ``kind`` to ``file`` (whose bytes are ``data``) that changes them, or
    None when none can (an empty file, a file of equal blocks)."""
    if kind not in KINDS:
        raise ValueError(f"unknown damage kind {kind!r}; known: {', '.join(KINDS)}")
    size = len(data)
    if not size:
        return None
    for _ in range(tries):
        if kind == "truncate":
            damage = Damage(file, kind, rng.randrange(size), size)
        elif kind == "bitflip":
            damage = Damage(file, kind, rng.randrange(size), 0, bit=rng.randrange(8))
            damage = Damage(file, kind, damage.start, damage.start + 1, bit=damage.bit)
        elif kind in ("zero512", "zero4096"):
            page = 512 if kind == "zero512" else 4096
            start = rng.randrange((size + page - 1) // page) * page
            damage = Damage(file, kind, start, min(size, start + page))
        else:
            block = 4096 if size >= 4 * 4096 else 512
            if size >= 2 * block:
                a, b = rng.sample(range(size // block), 2)
                damage = Damage(file, kind, a * block, a * block + block, other=b * block)
            else:
                half = size // 2
                if not half:
                    return None
                damage = Damage(file, kind, 0, half, other=half)
        if damage.apply(data) != data:
            return damage
    return None
