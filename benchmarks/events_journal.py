#!/usr/bin/env python3
"""``botmesh.events`` journals: raw journal operations and a bot on ``events_durability``,
beside the raw fsync rate of the same directory and ``FileDurability``, measured in the
same run (issue 15).

Part 1 — journal operations, one journal per row (``events`` = ``FileEventJournal``,
``shared`` = ``SharedFileEventJournal``; ``+log`` = ``append_log=True``; fsync on):

* ``appends/s``      — ``await j.append(...)`` one at a time;
* ``appends/s x8``   — 8 appends at a time (``asyncio.gather``): they share a write;
* ``claims/s``       — ``claim`` + ``complete`` of those records, one at a time;
* ``writes/op``      — file writes (snapshot rewrites or log appends: ``journal.writes``)
  per operation, sequential and x8.

Raw rates of the same directory, measured in the same run: (a) 200-byte appends each
followed by ``os.fsync``; (b) atomic replacements (``.tmp`` + fsync, rename, directory
fsync) of a 20 kB file.

Part 2 — a bot on ``events_durability`` (handler: ``await ctx.reply("ok")``): messages/s
and journal rewrites per message, fed sequentially and as 8 concurrent chats, beside
``FileDurability.open(path)`` (snapshot) and ``FileDurability.open(path, append_log=True)``
in the same run. Concurrent writes sharing a rewrite show as fewer rewrites per message
in the x8 column.

Usage::

    python benchmarks/events_journal.py [--ops N] [--messages N] [--against REF]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from botmesh.core import Bot, MemoryStore
from botmesh.core.file_backend import FileDurability
from botmesh.core.testing import MockProvider
from botmesh.events import FileEventJournal, SharedFileEventJournal, events_durability

import _against


def raw_fsync_appends(directory: str, n: int) -> float:
    path = os.path.join(directory, "raw.append")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    line = b"x" * 199 + b"\n"
    try:
        start = time.perf_counter()
        for _ in range(n):
            os.write(fd, line)
            os.fsync(fd)
        return n / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)


def raw_atomic_replaces(directory: str, n: int, size: int = 20_000) -> float:
    path = os.path.join(directory, "raw.snapshot")
    data = b"y" * size
    start = time.perf_counter()
    for _ in range(n):
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.replace(path + ".tmp", path)
        dfd = os.open(directory, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    rate = n / (time.perf_counter() - start)
    os.unlink(path)
    return rate


async def open_journal(kind: str, path: str) -> Any:
    log = kind.endswith("+log")
    if kind.startswith("shared"):
        return await SharedFileEventJournal.open(path, append_log=log)
    return await FileEventJournal.open(path, append_log=log)


async def journal_row(kind: str, directory: str, n: int) -> dict[str, float]:
    j = await open_journal(kind, os.path.join(directory, f"{kind}.journal"))
    w0 = j.writes
    start = time.perf_counter()
    for i in range(n):
        await j.append("bench", {"i": i})
    seq = n / (time.perf_counter() - start)
    seq_writes = (j.writes - w0) / n
    w0 = j.writes
    start = time.perf_counter()
    for k in range(n // 8):
        await asyncio.gather(*(j.append("bench8", {"i": k * 8 + i}) for i in range(8)))
    par = (n // 8 * 8) / (time.perf_counter() - start)
    par_writes = (j.writes - w0) / (n // 8 * 8)
    start = time.perf_counter()
    claimed = 0
    while claimed < n:
        rec = await j.claim("bench", 60_000)
        if rec is None:
            break
        assert rec.lease is not None
        await j.complete(rec.id, rec.lease.token)
        claimed += 1
    claims = claimed / (time.perf_counter() - start)
    await j.close()
    return {"seq": seq, "par": par, "claims": claims, "seq_writes": seq_writes, "par_writes": par_writes}


async def bot_row(kind: str, directory: str, n: int, concurrent: int) -> tuple[float, float | None]:
    """Messages/s and journal writes per message (None when not counted)."""
    path = os.path.join(directory, f"bot-{kind}-{concurrent}.journal")
    journal: Any = None
    if kind == "file":
        backend: Any = await FileDurability.open(path)
    elif kind == "file+log":
        backend = await FileDurability.open(path, append_log=True)
    else:
        journal = await open_journal(kind, path)
        backend = events_durability(journal=journal)
    provider = MockProvider()
    bot = Bot(provider, MemoryStore(), {"backend": backend, "instance_id": "bench"})

    @bot.otherwise
    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    await bot.start()
    for i in range(5):  # warm-up
        await provider.receive(f"w{i}", "hi", id=f"warm-{i}")
    w0 = journal.writes if journal is not None else 0
    start = time.perf_counter()
    for k in range(n // concurrent):
        await asyncio.gather(*(provider.receive(f"c{i}", "hi", id=f"m{k}-{i}") for i in range(concurrent)))
    elapsed = time.perf_counter() - start
    done = n // concurrent * concurrent
    writes = None if journal is None else (journal.writes - w0) / done
    await bot.stop()
    await backend.close()
    return done / elapsed, writes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200, help="journal operations per row (default 200)")
    parser.add_argument("--messages", type=int, default=96, help="bot messages per row (default 96)")
    parser.add_argument("--dir", default=None, help="directory to measure (default: a temporary one)")
    _against.add_options(parser)
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    directory = tempfile.mkdtemp(prefix="botmesh-events-bench-", dir=args.dir)
    try:
        fsyncs = raw_fsync_appends(directory, args.ops)
        replaces = raw_atomic_replaces(directory, args.ops // 2)
        print(f"directory: {directory}")
        print(f"raw (a) fsync'd 200-byte appends/s: {fsyncs:9.0f}")
        print(f"raw (b) atomic 20 kB replacements/s: {replaces:8.0f}")
        print()
        print(f"{'journal':<12} {'appends/s':>10} {'appends/s x8':>13} {'claims/s':>9} {'writes/op':>10} "
              f"{'writes/op x8':>13} {'appends/s / raw (a)':>20}")
        for kind in ("events", "events+log", "shared", "shared+log"):
            r = await journal_row(kind, directory, args.ops)
            figures.update({f"{kind}: appends/s": r["seq"], f"{kind}: appends/s x8": r["par"],
                            f"{kind}: claims/s": r["claims"], f"{kind}: writes/op x8": r["par_writes"]})
            print(f"{kind:<12} {r['seq']:10.0f} {r['par']:13.0f} {r['claims']:9.0f} {r['seq_writes']:10.2f} "
                  f"{r['par_writes']:13.2f} {r['seq'] / fsyncs:20.2f}")
        print()
        print(f"bot on the journal ({args.messages} messages; handler replies once)")
        print(f"{'backend':<12} {'msg/s':>8} {'rewrites/msg':>13} {'msg/s x8 chats':>15} {'rewrites/msg x8':>16}")
        for kind in ("file", "file+log", "events", "events+log", "shared", "shared+log"):
            seq, seq_w = await bot_row(kind, directory, args.messages, 1)
            par, par_w = await bot_row(kind, directory, args.messages, 8)
            figures.update({f"bot on {kind}: msg/s": seq, f"bot on {kind}: msg/s x8 chats": par})
            fmt = lambda w: "-" if w is None else f"{w:.2f}"  # noqa: E731
            print(f"{kind:<12} {seq:8.1f} {fmt(seq_w):>13} {par:15.1f} {fmt(par_w):>16}")
        print("\nrewrites/msg: journal writes (snapshot rewrites or log appends) per message; '-': FileDurability "
              "does not count them (one write per journal operation).")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures["raw (a) fsync'd appends/s"] = fsyncs
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    _against.emit(args, asyncio.run(main_async(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
