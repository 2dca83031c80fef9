#!/usr/bin/env python3
"""Durable message throughput of botmesh, beside the raw rate of the storage medium.

What one "message" is: one inbound event fed with ``await provider.receive(chat, text,
id=unique)`` (sequentially, one at a time, real clock) to a bot whose only handler does
``await ctx.reply("ok")`` — so one inbound journal entry and one outbox send each.

Rows (bot configurations):

* ``no durability``   — the same bot without ``durability=`` (the runtime's own cost);
* ``memory``          — ``durability={}`` (MemoryDurability);
* ``file snapshot``   — ``FileDurability.open(path)``, fsync on (every write rewrites the
  snapshot atomically);
* ``file log+fsync``  — ``FileDurability.open(path, append_log=True)`` (fsync on);
* ``file log nofsync``— ``FileDurability.open(path, append_log=True, fsync=False)``;
* ``sqlite``          — ``SQLiteStore(file).durability()`` with the store being that
  ``SQLiteStore`` (so the message log also goes to the file).

Raw medium rates, measured in the same run, in the same temporary directory:

* (a)  fsync'd appends/s: append a ~200-byte line to a file + ``os.fsync``;
* (a') plain appends/s: the same without fsync (the medium of ``fsync=False``);
* (b)  atomic snapshot writes/s: write ``<f>.tmp`` + fsync, ``os.replace``, fsync of the
  directory, for a file the size the snapshot-only journal reached;
* (c)  SQLite commits/s: single-row ``INSERT`` autocommits, WAL + ``synchronous=FULL``.

Writes per message: a separate short run per durable backend wrapped in
``botmesh_testkit.crash.crashable``; ``len(history)`` (write operations that reached the
backend, "provider.send" excluded) divided by the number of messages. The sweep's
``inbox.purge``/``outbox.purge`` calls happen once per sweep pass (every ``poll_ms``),
not per message, so they are counted apart.

Usage::

    python benchmarks/durable_throughput.py [--messages N] [--json PATH]

Only the standard library and botmesh are used.
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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from botmesh.core import Bot, MemoryDurability, MemoryStore
from botmesh.core.file_backend import FileDurability
from botmesh.core.testing import MockProvider
from botmesh.sqlite_store import SQLiteStore
from botmesh_testkit.crash import PROVIDER_SEND, crashable

import _against

PURGE_OPS = ("inbox.purge", "outbox.purge")
WARMUP = 10  # messages fed before the timed loop of every repetition (not timed)


# --------------------------------------------------------------------------------------
# bot configurations
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    fast: bool  # no disk sync on the path: use the larger message count
    medium: str | None  # key of the raw measurement it is compared with
    store_on_medium: bool = False  # the store's writes hit the same medium (SQLite)


CONFIGS = [
    Config("none", "no durability", True, None),
    Config("memory", "memory", True, None),
    Config("file-snapshot", "file snapshot, fsync", False, "snapshot"),
    Config("file-log", "file append_log, fsync", False, "fsync"),
    Config("file-log-nofsync", "file append_log, no fsync", False, "append"),
    Config("sqlite", "sqlite (WAL, sync=FULL)", False, "sqlite", store_on_medium=True),
]


def counting(store_cls: type) -> type:
    """A subclass of ``store_cls`` that counts its write calls (set/delete/append_message)."""

    class Counting(store_cls):  # type: ignore[misc, valid-type]
        store_writes = 0

        async def set(self, *a: Any, **k: Any) -> None:
            self.store_writes += 1
            await super().set(*a, **k)

        async def delete(self, *a: Any, **k: Any) -> None:
            self.store_writes += 1
            await super().delete(*a, **k)

        async def append_message(self, *a: Any, **k: Any) -> None:
            self.store_writes += 1
            await super().append_message(*a, **k)

    Counting.__name__ = f"Counting{store_cls.__name__}"
    return Counting


@dataclass
class Setup:
    store: Any
    backend: Any  # what goes to durability={"backend": ...} (None: no durability / {})
    closers: list[Any] = field(default_factory=list)  # async callables run after bot.stop()
    snapshot_path: str | None = None


async def make_setup(cfg: Config, workdir: str, *, wrap: bool, count_store: bool) -> Setup:
    """Fresh store and backend for one run, in its own files under ``workdir``."""
    os.makedirs(workdir, exist_ok=True)
    if cfg.key == "sqlite":
        store_cls = counting(SQLiteStore) if count_store else SQLiteStore
        store = store_cls(os.path.join(workdir, "bot.sqlite3"))
        backend: Any = store.durability()
        setup = Setup(store, backend)
        setup.closers.append(store.close)
    else:
        store_cls = counting(MemoryStore) if count_store else MemoryStore
        store = store_cls()
        backend = None
        snapshot = None
        if cfg.key == "memory":
            backend = MemoryDurability() if wrap else None  # None -> durability={}
        elif cfg.key.startswith("file"):
            snapshot = os.path.join(workdir, "journal.json")
            backend = await FileDurability.open(
                snapshot,
                append_log=cfg.key != "file-snapshot",
                fsync=cfg.key != "file-log-nofsync",
            )
        setup = Setup(store, backend, snapshot_path=snapshot)
        if isinstance(backend, FileDurability):
            setup.closers.append(backend.close)  # FileDurability outlives bot.stop()
    if wrap and setup.backend is not None:
        setup.backend = crashable(setup.backend)
    return setup


def make_bot(cfg: Config, setup: Setup) -> tuple[Bot, MockProvider, list[Any]]:
    provider = MockProvider()
    if cfg.key == "none":
        bot = Bot(provider, store=setup.store)
    elif setup.backend is None:
        bot = Bot(provider, store=setup.store, durability={})
    else:
        bot = Bot(provider, store=setup.store, durability={"backend": setup.backend})
    errors: list[Any] = []
    bot.on("error", errors.append)

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    return bot, provider, errors


@dataclass
class RunResult:
    seconds: float
    messages: int
    snapshot_bytes: int | None = None
    history: list[str] | None = None
    store_writes: int | None = None


async def run_bot(cfg: Config, workdir: str, messages: int, *, wrap: bool = False, tag: str = "") -> RunResult:
    """Start a bot, feed ``WARMUP`` untimed then ``messages`` timed messages, stop it."""
    setup = await make_setup(cfg, workdir, wrap=wrap, count_store=wrap)
    bot, provider, errors = make_bot(cfg, setup)
    await bot.start()
    try:
        for i in range(WARMUP):
            await provider.receive("chat-1", "hi", id=f"{tag}warm-{i}")
        history_start = len(setup.backend.history) if wrap and setup.backend is not None else 0
        store_start = getattr(setup.store, "store_writes", 0)
        t0 = time.perf_counter()
        for i in range(messages):
            await provider.receive("chat-1", "hi", id=f"{tag}msg-{i}")
        elapsed = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"{cfg.label}: the bot reported errors: {errors[:3]!r}")
        if len(provider.sent) != WARMUP + messages:
            raise RuntimeError(f"{cfg.label}: {len(provider.sent)} replies for {WARMUP + messages} messages")
        snapshot_bytes = None
        if setup.snapshot_path is not None and os.path.exists(setup.snapshot_path):
            snapshot_bytes = os.path.getsize(setup.snapshot_path)
        history = None
        if wrap and setup.backend is not None:
            history = [op for op in setup.backend.history[history_start:] if op != PROVIDER_SEND]
        store_writes = getattr(setup.store, "store_writes", 0) - store_start if wrap else None
    finally:
        await bot.stop()
        for close in setup.closers:
            await close()
    return RunResult(elapsed, messages, snapshot_bytes, history, store_writes)


# --------------------------------------------------------------------------------------
# raw medium
# --------------------------------------------------------------------------------------

LINE = (b"x" * 199) + b"\n"  # a ~200-byte log line


def raw_append(path: str, n: int, *, fsync: bool) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, LINE)
            if fsync:
                os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(path)


def raw_snapshot(path: str, n: int, size: int) -> float:
    """``n`` atomic replacements of ``path`` by ``size`` bytes, the way the snapshot-only
    file journal writes (tmp + fsync, rename, fsync of the directory)."""
    data = (b"y" * 127 + b"\n") * (size // 128) + b"z" * (size % 128)
    tmp = path + ".tmp"
    directory = os.path.dirname(path)
    t0 = time.perf_counter()
    for _ in range(n):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return elapsed


def raw_sqlite(path: str, n: int) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        value = "v" * 200
        t0 = time.perf_counter()
        for _ in range(n):
            conn.execute("INSERT INTO t (v) VALUES (?)", (value,))  # autocommit: one commit each
        return time.perf_counter() - t0
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)


RAW_LABELS = {
    "fsync": "(a) append+fsync",
    "append": "(a') append, no fsync",
    "snapshot": "(b) atomic snapshot",
    "sqlite": "(c) sqlite commit",
}


# --------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------


def rates(runs: list[tuple[int, float]]) -> tuple[float, float, list[float]]:
    per = [n / s for n, s in runs]
    return max(per), statistics.median(per), per


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def fmt_size(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = []
        for cell, w, a in zip(cells, widths, align, strict=True):
            out.append(cell.ljust(w) if a == "l" else cell.rjust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    n_slow = args.messages
    n_fast = args.fast_messages if args.fast_messages is not None else 10 * n_slow
    reps = args.repeat
    configs = [c for c in CONFIGS if not args.only or c.key in args.only]
    now = _dt.datetime.now().astimezone()
    machine = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "?",
        "cpu_count": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "sqlite": sqlite3.sqlite_version,
    }
    root = tempfile.mkdtemp(prefix="botmesh-bench-")
    out = sys.stdout
    print("botmesh durable throughput", file=out)
    print("==========================", file=out)
    print("One message = one inbound event (provider.receive, sequential, real clock) + one reply", file=out)
    print("(handler: await ctx.reply('ok')). Raw medium rates measured in the same run, same dir.", file=out)
    print(f"date:     {now.isoformat(timespec='seconds')}", file=out)
    print(f"machine:  {machine['platform']}, {machine['cpu_count']} CPUs, {machine['python']}, "
          f"SQLite {machine['sqlite']}", file=out)
    print(f"temp dir: {root}", file=out)
    print(f"method:   best of {reps} repetitions (median also shown); {n_slow} timed messages per "
          f"repetition for disk rows, {n_fast} for no-durability/memory; {WARMUP} untimed warm-up "
          f"messages first; fresh files per repetition", file=out)
    print(file=out)
    out.flush()

    results: dict[str, Any] = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine,
        "method": f"best of {reps}",
        "params": {"messages": n_slow, "fast_messages": n_fast, "repeat": reps, "warmup": WARMUP,
                   "count_messages": args.count_messages},
        "raw": {},
        "rows": {},
    }
    started = time.perf_counter()
    try:
        # -- bot runs ---------------------------------------------------------------------
        bot_runs: dict[str, list[tuple[int, float]]] = {}
        snapshot_size = 0
        for cfg in configs:
            n = n_fast if cfg.fast else n_slow
            runs = []
            for rep in range(reps):
                res = await run_bot(cfg, os.path.join(root, f"{cfg.key}-{rep}"), n, tag=f"r{rep}-")
                runs.append((res.messages, res.seconds))
                if cfg.key == "file-snapshot" and res.snapshot_bytes:
                    snapshot_size = max(snapshot_size, res.snapshot_bytes)
                shutil.rmtree(os.path.join(root, f"{cfg.key}-{rep}"), ignore_errors=True)
            bot_runs[cfg.key] = runs
            best, med, _ = rates(runs)
            print(f"  ran {cfg.label:<28} best {fmt_rate(best):>8} msg/s", file=out)
            out.flush()

        # -- writes per message (crashable history) -------------------------------------
        counts: dict[str, dict[str, Any]] = {}
        for cfg in configs:
            if cfg.key == "none":
                continue
            res = await run_bot(cfg, os.path.join(root, f"count-{cfg.key}"), args.count_messages,
                                wrap=True, tag="count-")
            shutil.rmtree(os.path.join(root, f"count-{cfg.key}"), ignore_errors=True)
            assert res.history is not None and res.store_writes is not None
            per_op = Counter(res.history)
            purges = sum(per_op.pop(op, 0) for op in PURGE_OPS)
            journal = sum(per_op.values())
            counts[cfg.key] = {
                "messages": res.messages,
                "history": len(res.history),
                "journal_writes": journal,
                "purge_calls": purges,
                "writes_per_msg": journal / res.messages,
                "history_per_msg": len(res.history) / res.messages,
                "per_op": {op: k / res.messages for op, k in sorted(per_op.items())},
                "store_writes_per_msg": res.store_writes / res.messages,
            }

        # -- raw medium -----------------------------------------------------------------
        needed = {c.medium for c in configs if c.medium}
        raw_n = {
            "fsync": 4 * n_slow,
            "append": 40 * n_slow,
            "snapshot": max(50, n_slow // 2),
            "sqlite": 4 * n_slow,
        }
        if "snapshot" in needed and not snapshot_size:
            snapshot_size = 64 * 1024
        raw: dict[str, dict[str, Any]] = {}
        for medium in ("fsync", "append", "snapshot", "sqlite"):
            if medium not in needed:
                continue
            runs = []
            for rep in range(reps):
                path = os.path.join(root, f"raw-{medium}-{rep}")
                n = raw_n[medium]
                if medium == "fsync":
                    s = raw_append(path, n, fsync=True)
                elif medium == "append":
                    s = raw_append(path, n, fsync=False)
                elif medium == "snapshot":
                    s = raw_snapshot(path, n, snapshot_size)
                else:
                    s = raw_sqlite(path + ".sqlite3", n)
                runs.append((n, s))
            best, med, per = rates(runs)
            raw[medium] = {"label": RAW_LABELS[medium], "ops": raw_n[medium], "best": best, "median": med,
                           "all": per}
            if medium == "snapshot":
                raw[medium]["bytes"] = snapshot_size
        results["raw"] = raw
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = time.perf_counter() - started

    # -- report -----------------------------------------------------------------------
    baseline = rates(bot_runs["none"])[0] if "none" in bot_runs else None
    rows = []
    for cfg in configs:
        best, med, per = rates(bot_runs[cfg.key])
        c = counts.get(cfg.key)
        row: dict[str, Any] = {"label": cfg.label, "messages": bot_runs[cfg.key][0][0], "best": best,
                               "median": med, "all": per, "us_per_msg": 1e6 / best}
        if baseline:
            row["vs_no_durability"] = best / baseline
        if c is not None:
            row.update(counts=c)
        if cfg.medium and cfg.medium in raw:
            r = raw[cfg.medium]
            ops = None
            if c is not None:
                ops = c["writes_per_msg"] + (c["store_writes_per_msg"] if cfg.store_on_medium else 0.0)
            row["medium"] = r["label"]
            row["raw_ops_per_s"] = r["best"]
            row["ratio"] = best / r["best"]
            row["medium_ops_per_msg"] = ops
            if ops:
                row["medium_share"] = row["ratio"] * ops
        rows.append((cfg, row))
        results["rows"][cfg.key] = row

    print(file=out)
    print("Throughput (msg/s = messages per second, one inbound + one reply each)", file=out)
    headers = ["backend", "msg/s best", "median", "us/msg", "writes/msg", "medium", "raw ops/s",
               "ratio", "ops/msg", "medium share"]
    lines = []
    for cfg, row in rows:
        c = row.get("counts")
        lines.append([
            cfg.label,
            fmt_rate(row["best"]),
            fmt_rate(row["median"]),
            f"{1e6 / row['best']:,.0f}",
            f"{c['writes_per_msg']:.2f}" if c else "0",
            row.get("medium", "-"),
            fmt_rate(row.get("raw_ops_per_s")),
            f"{row['ratio']:.3f}" if "ratio" in row else "-",
            f"{row['medium_ops_per_msg']:.1f}" if row.get("medium_ops_per_msg") is not None else "-",
            f"{row['medium_share']:.0%}" if "medium_share" in row else "-",
        ])
    print(table(headers, lines, "lrrrrlrrrr"), file=out)
    print(file=out)
    raw_lines = []
    for medium, r in raw.items():
        detail = f"{r['ops']} ops"
        if medium == "snapshot":
            detail += f" of {fmt_size(r['bytes'])}"
        raw_lines.append([r["label"], fmt_rate(r["best"]), fmt_rate(r["median"]), detail])
    if raw_lines:
        print(f"Raw medium (best of {reps}; median)", file=out)
        print(table(["medium", "ops/s best", "median", "per repetition"], raw_lines, "lrrl"), file=out)
        print(file=out)
    w_lines = []
    for cfg, row in rows:
        c = row.get("counts")
        if not c:
            continue
        ops = ", ".join(f"{op} {v:.2f}" for op, v in c["per_op"].items())
        w_lines.append([cfg.label, f"{c['writes_per_msg']:.1f} writes/msg", str(c["purge_calls"]),
                        f"{c['store_writes_per_msg']:.1f}", ops])
    if w_lines:
        print(f"Journal writes per message (crashable history, {args.count_messages} messages after "
              f"{WARMUP} warm-up; sweep purges apart)", file=out)
        print(table(["backend", "journal", "purge calls", "store writes/msg", "per op (per msg)"], w_lines,
                    "lrrrl"), file=out)
        print(file=out)
    if "file-snapshot" in bot_runs and "snapshot" in raw:
        print("Note: without the append log every write rewrites (and re-serializes) the whole journal, so the",
              file=out)
        print(f"snapshot row's rate falls as the journal grows; it reached {fmt_size(raw['snapshot']['bytes'])} "
              f"after {n_slow + WARMUP} messages and (b) is measured at", file=out)
        print("that final size (earlier writes were smaller).", file=out)
    if "file-log" in bot_runs or "file-log-nofsync" in bot_runs:
        print("Note: the append_log rows also fold the log into the snapshot every 1000 entries (~250 messages);",
              file=out)
        print("that rewrite is inside the timing but not in ops/msg.", file=out)
    print("Columns: us/msg = 1e6 / best msg/s. writes/msg = journal write ops per message (table below).",
          file=out)
    print("ratio = msg/s / raw ops/s of the medium. ops/msg = medium operations one message needs (journal", file=out)
    print("writes, + store writes for SQLite, whose message log is in the same file). medium share = ratio x", file=out)
    print("ops/msg = fraction of the wall time the raw medium ops alone would take; near 100% the medium", file=out)
    print("is the bottleneck, far below it the time goes to the code.", file=out)
    print(f"Total time {total:.1f} s.", file=out)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=300,
                   help="timed messages per repetition for the disk rows (default 300)")
    p.add_argument("--fast-messages", type=int, default=None,
                   help="timed messages per repetition for no-durability and memory (default 10 x --messages)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions per row; the best is reported (default 3)")
    p.add_argument("--count-messages", type=int, default=100,
                   help="messages of the crashable run that counts writes per message (default 100)")
    p.add_argument("--only", nargs="*", choices=[c.key for c in CONFIGS], help="run only these rows")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    _against.add_options(p)
    args = p.parse_args(argv)
    for name in ("messages", "repeat", "count_messages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fast_messages is not None and args.fast_messages < 1:
        p.error("--fast-messages must be >= 1")
    if args.only and "none" not in args.only:
        args.only = ["none", *args.only]  # the baseline is always measured
    return args


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: per row msg/s, share of no durability and of the medium."""
    out: dict[str, Any] = {}
    for key, row in results["rows"].items():
        label = row["label"]
        out[f"{label}: msg/s best"] = row["best"]
        if key == "memory" and "vs_no_durability" in row:
            out[f"{label}: % of no durability"] = 100 * row["vs_no_durability"]
        if "medium_share" in row:
            out[f"{label}: % of the medium's limit"] = 100 * row["medium_share"]
        if row.get("counts"):
            out[f"{label}: journal writes/msg"] = row["counts"]["writes_per_msg"]
    for r in results["raw"].values():
        out[f"raw {r['label']}: ops/s best"] = r["best"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    results = asyncio.run(main_async(args))
    _against.emit(args, figures(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
