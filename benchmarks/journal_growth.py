#!/usr/bin/env python3
"""The file append log as its journal grows: durable msg/s per block of messages, and the
CPU one fold of the log into the snapshot costs, beside the raw rate of the medium.

Why: ``FileDurability.open(path, append_log=True)`` folds its log into the snapshot every
1000 entries (BACK-4), and a fold rewrites the whole snapshot, so its cost grows with the
records the journal holds (every inbound and outbound record stays until retention
removes it). Issue 16 made the fold encode only the records written since; this
benchmark shows what is left as the journal grows.

Part 1, end to end. One bot (``MockProvider``, real clock, a handler doing ``await
ctx.reply("ok")``: one inbound and one send per message, as in ``durable_throughput.py``)
on ``FileDurability.open(path, append_log=True)`` (fsync on) in a temporary directory is
fed ``--messages`` messages one at a time, in ``--blocks`` equal blocks; per block:
msg/s, and the snapshot's size at its end. Baseline in the same run, same directory:
the raw rate of ~200-byte appends each followed by ``os.fsync`` (best of 3 runs of 2,000;
``durable_throughput.py``'s raw medium (a)).

Part 2, one fold's CPU. ``snapshot_buffer`` — the function the kv makes its snapshot with
(``snapshot_bytes`` in a release without it) — for
a journal of ``--records`` records (half inbound-like, half outbound-like values) of which
``--written`` were written since the last snapshot (new entries of existing keys), with
the lines of the last snapshot kept as the kv keeps them: process CPU time, best of 7.

Usage::

    python benchmarks/journal_growth.py [--messages N] [--blocks B] [--records N] [--written K] [--against REF]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

from botmesh.core import Bot, MemoryStore
from botmesh.core.file_backend import FileDurability
from botmesh.core import file_format
from botmesh.core.testing import MockProvider

import _against
from durable_throughput import raw_append

SCOPE = "bench"

FOLD = getattr(file_format, "snapshot_buffer", file_format.snapshot_bytes)
"""What the kv makes its snapshot with: ``snapshot_buffer`` (a release before it:
``snapshot_bytes``)."""


def raw_appends(workdir: str, n: int = 2000) -> float:
    """fsync'ed appends/s of a ~200-byte line, best of 3 (``durable_throughput.py``'s
    raw medium (a))."""
    path = os.path.join(workdir, "raw.log")
    return n / min(raw_append(path, n, fsync=True) for _ in range(3))


async def blocks(workdir: str, messages: int, count: int) -> list[dict[str, float]]:
    path = os.path.join(workdir, "journal.json")
    backend = await FileDurability.open(path, append_log=True)
    provider = MockProvider()
    bot = Bot(provider, store=MemoryStore(), durability={"backend": backend})

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    await bot.start()
    out = []
    per = messages // count
    try:
        for i in range(10):
            await provider.receive("chat-1", "hi", id=f"warm-{i}")
        for b in range(count):
            t0 = time.perf_counter()
            for i in range(per):
                await provider.receive("chat-1", "hi", id=f"m-{b}-{i}")
            seconds = time.perf_counter() - t0
            size = os.path.getsize(path) if os.path.exists(path) else 0  # (none before the first fold)
            out.append({"msg_s": per / seconds, "snapshot_kib": size / 1024})
    finally:
        await bot.stop()
        await backend.close()
    return out


def fold_cpu(records_n: int, written: int) -> float:
    """Best CPU ms of one snapshot (:data:`FOLD`) with ``written`` records written since."""

    def entry(i: int, round_: int) -> Any:
        value = {"id": f"msg-{i}", "kind": "message", "chat_id": "chat-1", "state": "done", "attempts": 1,
                 "event": {"text": "hi", "round": round_}, "created_at": 1.7e9 + i, "finished_at": None}
        return (value, 3, None, 1.8e9 + i)

    half = records_n // 2
    records: dict[tuple[str, str], dict[str, Any]] = {
        (SCOPE, "inbox"): {f"in-{i:07d}": entry(i, 0) for i in range(half)},
        (SCOPE, "outbox"): {f"out-{i:07d}": entry(i, 0) for i in range(records_n - half)},
    }
    lines: Any = {}
    FOLD(records, 1, lines)
    best = float("inf")
    for r in range(7):
        space = records[(SCOPE, "inbox")]
        for j in range(written):
            space[f"in-{(r * written + j) % half:07d}"] = entry(j, r + 1)
        t0 = time.process_time()
        FOLD(records, r + 2, lines)
        best = min(best, time.process_time() - t0)
    return best * 1e3


def figures(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"raw appends+fsync/s": result["raw"]}
    for i, b in enumerate(result["blocks"], start=1):
        out[f"block {i}: msg/s"] = b["msg_s"]
    out["snapshot KiB at the end"] = result["blocks"][-1]["snapshot_kib"]
    out[f"fold CPU ms ({result['records']} records, {result['written']} written since)"] = result["fold_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10000, help="messages in part 1 (default 10000)")
    parser.add_argument("--blocks", type=int, default=5, help="blocks of part 1 (default 5)")
    parser.add_argument("--records", type=int, default=20000, help="records of part 2's journal (default 20000)")
    parser.add_argument("--written", type=int, default=1000, help="of which written since (default 1000)")
    parser.add_argument("--json", help="also write the figures to this file")
    _against.add_options(parser, rounds=3)
    args = parser.parse_args(argv)
    for name in ("messages", "blocks", "records", "written"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.blocks > args.messages or args.written > args.records // 2:
        parser.error("--blocks must be at most --messages, and --written at most half of --records")
    if args.against:
        return _against.compare(__file__, args, argv)
    logging.disable(logging.WARNING)
    print("botmesh: the file append log as its journal grows")
    print(f"date:     {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}")
    print(f"machine:  {platform.platform()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}")
    workdir = tempfile.mkdtemp(prefix="botmesh-growth-")
    try:
        raw = raw_appends(workdir)
        result = {"raw": raw, "blocks": asyncio.run(blocks(workdir, args.messages, args.blocks)),
                  "records": args.records, "written": args.written,
                  "fold_ms": fold_cpu(args.records, args.written)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"raw medium: {raw:,.0f} fsync'ed appends/s (4 per message: a limit of {raw / 4:,.0f} msg/s)")
    print(f"part 1: {args.messages} messages, 1 chat, in {args.blocks} blocks")
    for i, b in enumerate(result["blocks"], start=1):
        print(f"  block {i}: {b['msg_s']:7,.0f} msg/s ({100 * 4 * b['msg_s'] / raw:3.0f} % of the medium), "
              f"snapshot {b['snapshot_kib']:,.0f} KiB at its end")
    print(f"part 2: one fold of {args.records:,} records, {args.written:,} written since: "
          f"{result['fold_ms']:.1f} ms of CPU (best of 7)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    _against.emit(args, figures(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
