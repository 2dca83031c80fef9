#!/usr/bin/env python3
"""Group commit on the embedded backends: durable messages per second with 1 chat and
with 8 concurrent chats on the file append log and on SQLite, beside the raw rate of the
medium and beside the same bot with group commit switched off, all measured in one run.

What one "message" is: as in ``durable_throughput.py`` — one inbound event fed with
``await provider.receive(chat, "hi", id=unique)`` (``MockProvider``, real clock) to a bot
whose only handler does ``await ctx.reply("ok")``. With **C chats**, C asyncio tasks each
feed the messages of their own chat one at a time, all at once (as
``shared_backends.py`` does); msg/s = all timed messages / the wall time until the last
task is done. Every task first feeds ``WARMUP`` untimed messages.

Rows, per backend:

* ``file+log`` — ``FileDurability.open(path, append_log=True)`` (fsync on), store a
  ``MemoryStore``;
* ``sqlite``   — ``SQLiteStore(file).durability()``, the store being that ``SQLiteStore``
  (its message log goes to the same file, as in ``durable_throughput.py``);

each with 1 chat, with 8 chats, and with 8 chats and group commit off (the kv's and the
store's ``GroupCommit.max_items`` set to 1: every write flushed alone, as before issue 16
— the baseline of the same run).

Raw medium, measured in the same run, same directory, interleaved with the bot runs:
(a) ~200-byte appends each followed by ``os.fsync``; for context only, (b) the same line
written in place into a zero-filled file, each followed by ``os.fdatasync`` (what a
preallocated log could get: no size change to make durable); (c) single-row SQLite ``INSERT``
autocommits with WAL and ``synchronous=FULL``.

Medium operations per message: counted in the timed run itself — the log's fsync'ed
appends (file+log: one per group since log version 3, a group being one line; a release
before it cut a group into page-sized appends, one or more per group) or
the COMMITs of the kv and of the store (SQLite: the store's message-log writes are
grouped the same way, in their own transactions). ``medium
share`` = msg/s x ops/msg / raw ops/s: the share of the wall time the medium operations
alone would take at the raw rate (near 100 %: the medium is the bottleneck).
``writes/flush`` = journal writes per fsync (file+log) or per COMMIT of the kv (SQLite).

Usage::

    python benchmarks/group_commit.py [--messages N] [--chats C] [--repeat R] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from botmesh.core import Bot, MemoryStore
from botmesh.core.file_backend import FileDurability
from botmesh.core.fileio import FileIO
from botmesh.core.group_commit import GroupCommit
from botmesh.core.testing import MockProvider
from botmesh.sqlite_store import SQLiteStore

import _against

WARMUP = 5  # untimed messages per chat before the timed ones
LINE = (b"x" * 199) + b"\n"


@dataclass
class Run:
    messages: int
    seconds: float
    flushes: int
    journal_writes: int
    store_writes: int
    cpu: float  # process CPU seconds during the timed part

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


class CountingIO(FileIO):
    """The real file system, counting the log appends (each one fsync'ed): one per group
    (a release before log version 3 cut a group into more than one, at page boundaries,
    which ``--against`` such a release counts)."""

    def __init__(self) -> None:
        self.appends = 0

    def append(self, fd: int, data: bytes, *, fsync: bool) -> None:
        self.appends += 1
        super().append(fd, data, fsync=fsync)


def _group_of(backend: Any) -> GroupCommit[Any, Any]:
    kv = backend.file_kv if isinstance(backend, FileDurability) else backend.kv
    return kv._group  # type: ignore[no-any-return]


async def run_bot(kind: str, workdir: str, chats: int, per_chat: int, *, grouped: bool, tag: str) -> Run:
    os.makedirs(workdir, exist_ok=True)
    closers: list[Any] = []
    store: Any
    io: CountingIO | None = None
    if kind == "sqlite":
        store = SQLiteStore(os.path.join(workdir, "bot.sqlite3"))
        backend: Any = store.durability()
        closers.append(store.close)
    else:
        store = MemoryStore()
        io = CountingIO()
        backend = await FileDurability.open(os.path.join(workdir, "journal.json"), append_log=True, io=io)
        closers.append(backend.close)
    provider = MockProvider()
    bot = Bot(provider, store=store, durability={"backend": backend})
    errors: list[Any] = []
    bot.on("error", errors.append)

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    await bot.start()
    try:
        group = _group_of(backend)
        store_group: GroupCommit[Any, Any] | None = getattr(store, "_group", None)
        if not grouped:
            group.max_items = 1
            if store_group is not None:
                store_group.max_items = 1

        def store_commits() -> int:
            return 0 if store_group is None else store_group.groups

        async def feed(chat: int, first: int, count: int) -> None:
            for i in range(first, first + count):
                await provider.receive(f"chat-{chat}", "hi", id=f"{tag}c{chat}-m{i}")

        await asyncio.gather(*(feed(c, 0, WARMUP) for c in range(chats)))
        def flushes() -> int:  # fsyncs of the log (file+log) or COMMITs of the kv (sqlite)
            return io.appends if io is not None else group.groups

        flushes0, items0, store0 = flushes(), group.items, store_commits()
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(feed(c, WARMUP, per_chat) for c in range(chats)))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if errors:
            raise RuntimeError(f"{kind}: the bot reported errors: {errors[:3]!r}")
        expected = chats * (WARMUP + per_chat)
        if len(provider.sent) != expected:
            raise RuntimeError(f"{kind}: {len(provider.sent)} replies for {expected} messages")
        run = Run(chats * per_chat, elapsed, flushes() - flushes0, group.items - items0,
                  store_commits() - store0, cpu)
    finally:
        await bot.stop()
        for close in closers:
            await close()
    return run


def raw_append(path: str, n: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, LINE)
            os.fsync(fd)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.remove(path)


def raw_in_place(path: str, n: int) -> float:
    """(b): the same line written at its offset into a file already zero-filled and
    fsync'ed (untimed), each followed by ``os.fdatasync``: no size change and no block
    allocation to make durable, only the data — what a preallocated log could get from
    the same disk. Context only: no journal here writes so."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, bytes(n * len(LINE)))
        os.fsync(fd)
        t0 = time.perf_counter()
        for i in range(n):
            os.pwrite(fd, LINE, i * len(LINE))
            os.fdatasync(fd)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.remove(path)


def raw_sqlite(path: str, n: int) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        t0 = time.perf_counter()
        for _ in range(n):
            conn.execute("INSERT INTO t (v) VALUES (?)", ("v" * 200,))
        return n / (time.perf_counter() - t0)
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    now = _dt.datetime.now().astimezone()
    machine = (f"{platform.platform()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
               f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}")
    root = tempfile.mkdtemp(prefix="botmesh-bench-group-")
    total = args.messages
    variants = [("1 chat", 1, True), (f"{args.chats} chats", args.chats, True),
                (f"{args.chats} chats, group commit off", args.chats, False)]
    print("botmesh group commit: 1 chat vs concurrent chats on the embedded backends")
    print("=========================================================================")
    print(f"date:     {now.isoformat(timespec='seconds')}")
    print(f"machine:  {machine}")
    print(f"load:     {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the start")
    print(f"method:   {total} timed messages per run ({args.chats} chats: {total // args.chats} each), "
          f"{WARMUP} untimed per chat first; {args.repeat} rounds, each round = raw medium + every row "
          f"in turn, fresh files; best and median of the rounds")
    print()
    runs: dict[tuple[str, str], list[Run]] = {}
    raw: dict[str, list[float]] = {"file+log": [], "sqlite": []}
    in_place: list[float] = []
    started = time.perf_counter()
    try:
        for rnd in range(args.repeat):
            for kind in args.backends:
                where = os.path.join(root, f"raw-{kind}-{rnd}")
                raw[kind].append(raw_append(where, 4 * total) if kind == "file+log" else raw_sqlite(where, 4 * total))
                if kind == "file+log":
                    in_place.append(raw_in_place(where + "-in-place", 4 * total))
                for label, chats, grouped in variants:
                    workdir = os.path.join(root, f"{kind}-{rnd}-{chats}-{grouped}")
                    run = await run_bot(kind, workdir, chats, total // chats, grouped=grouped, tag=f"r{rnd}-")
                    shutil.rmtree(workdir, ignore_errors=True)
                    runs.setdefault((kind, label), []).append(run)
                    print(f"  round {rnd + 1}: {kind:<8} {label:<28} {fmt(run.rate):>7} msg/s, "
                          f"{run.journal_writes / max(1, run.flushes):.2f} writes/flush", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    rows: list[list[str]] = []
    result: dict[str, Any] = {"date": now.isoformat(timespec="seconds"), "machine": machine, "rows": {}, "raw": {}}
    for kind in args.backends:
        raw_best = max(raw[kind])
        result["raw"][kind] = {"best": raw_best, "median": statistics.median(raw[kind])}
        seq_best = max(r.rate for r in runs[(kind, "1 chat")])
        for label, _chats, _grouped in variants:
            rs = runs[(kind, label)]
            best = max(r.rate for r in rs)
            med = statistics.median(r.rate for r in rs)
            flushes = sum(r.flushes for r in rs)
            ops = (flushes + sum(r.store_writes for r in rs)) / sum(r.messages for r in rs)
            per_flush = sum(r.journal_writes for r in rs) / max(1, flushes)
            share = best * ops / raw_best
            cpu_us = 1e6 * sum(r.cpu for r in rs) / sum(r.messages for r in rs)
            cpu_share = statistics.median(r.cpu / r.seconds for r in rs)
            rows.append([kind, label, fmt(best), fmt(med), f"{best / seq_best:.2f}x", f"{per_flush:.2f}",
                         f"{ops:.2f}", fmt(raw_best), f"{100 * share:.0f}%", f"{cpu_us:,.0f}",
                         f"{100 * cpu_share:.0f}%"])
            result["rows"][f"{kind}/{label}"] = {"best": best, "median": med, "vs_1_chat": best / seq_best,
                                                  "writes_per_flush": per_flush, "ops_per_msg": ops,
                                                  "medium_share": share, "cpu_us_per_msg": cpu_us,
                                                  "client_cpu": cpu_share}
    medium = {"file+log": "(a) append+fsync", "sqlite": "(c) sqlite commit"}
    print(table(["backend", "chats", "msg/s best", "median", "vs 1 chat", "writes/flush", "ops/msg",
                 "raw ops/s", "medium share", "CPU us/msg", "client CPU"], rows))
    print()
    print("Raw medium (best; median) — " + "; ".join(
        f"{medium[k]}: {fmt(max(raw[k]))}; {fmt(statistics.median(raw[k]))} ops/s" for k in args.backends))
    if in_place:
        result["raw"]["file+log in place"] = {"best": max(in_place), "median": statistics.median(in_place)}
        print(f"For context, not a medium of these rows — (b) the same line in place in a zero-filled file + fdatasync: "
              f"{fmt(max(in_place))}; {fmt(statistics.median(in_place))} ops/s")
    print("vs 1 chat = best msg/s / best msg/s of the same backend with 1 chat (same run). ops/msg = medium ops per "
          "message\n(journal flushes + store commits, counted in the timed runs). medium share = msg/s x ops/msg / raw "
          "ops/s.\nCPU us/msg = CPU time of this process (bot, kv, fsync/commit system time) per message; client CPU = "
          "that CPU time / wall time\n(median): near 100% the one Python thread is the bottleneck, not the medium.")
    print(f"Total time {time.perf_counter() - started:.1f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    return result


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: per row msg/s, x 1 chat, medium share, writes per flush."""
    out: dict[str, Any] = {}
    for key, r in result["rows"].items():
        out[f"{key}: msg/s best"] = r["best"]
        if not key.endswith("1 chat"):
            out[f"{key}: x 1 chat"] = r["vs_1_chat"]
        out[f"{key}: % of the medium's limit"] = 100 * r["medium_share"]
        out[f"{key}: writes/flush"] = r["writes_per_flush"]
    for kind, r in result["raw"].items():
        out[f"raw {kind} medium: ops/s best"] = r["best"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400, help="timed messages per run (default 400)")
    parser.add_argument("--chats", type=int, default=8, help="concurrent chats of the concurrent rows (default 8)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--backends", nargs="+", default=["file+log", "sqlite"], choices=["file+log", "sqlite"])
    parser.add_argument("--json", help="also write the figures to this file")
    _against.add_options(parser)
    args = parser.parse_args(argv)
    if args.messages < args.chats or args.messages % args.chats:
        parser.error(f"--messages must be a multiple of --chats ({args.chats}), got {args.messages}")
    if args.against:
        return _against.compare(__file__, args, argv)
    result = asyncio.run(main_async(args))
    _against.emit(args, figures(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
