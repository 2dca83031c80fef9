#!/usr/bin/env python3
"""Power cuts per minute on the power-cut file system, and what the FUSE layer costs.

Needs ``/dev/fuse``, libfuse 3 and the ``powercuts`` extra (``pip install -e '.[dev]'``);
prints the reason and exits 2 when the machine cannot mount. Everything lives in a
``tempfile`` directory, deleted at the end. About 30 s on a 2-CPU machine with the
defaults.

Power cuts per minute:

* **bare cut** — the layer alone: 4 KiB written unsynced and 100 bytes appended and
  fsynced, then ``cut()`` (modes drop, subset, torn in turn), ``--cuts`` times;
* **kill cycle, file+log** / **kill cycle, sqlite** — what the ``powercuts`` part does
  per kill: start a child process that opens the backend on the mount
  (``FileDurability`` with the append log and ``fsync=True`` / SQLite WAL with
  ``synchronous=FULL``), makes ``--writes`` acknowledged writes, is SIGKILLed; power cut;
  the parent reopens the store and checks every acknowledged write is there (the count of
  lost ones is printed: it must be 0), ``--cycles`` times.

The FUSE layer's cost, same run: ``FileDurability`` append-log puts per second in this
process, on the mount and on a plain directory of the same disk, with and without fsync,
and raw 200-byte appends (+ fsync) per second. On the mount an fsync costs no disk flush
(durability is the model's, in memory), so "fsync" rows are *faster* there: the
``no fsync`` rows are the layer's real per-operation cost.

Usage::

    python benchmarks/powercut_fs.py [--cuts 300] [--cycles 20] [--writes 20] [--puts 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from botmesh.core.file_backend import FileDurability
from botmesh_testkit.crash.fs import PowerCutFS, PowerCutMount, PowerCutUnavailable, unavailable_reason

import _against

MODES = ("drop", "subset", "torn")

FILE_CHILD = r"""
import asyncio, sys
from botmesh.core.file_backend import FileDurability
async def main():
    d = await FileDurability.open(sys.argv[1], append_log=True, fsync=True)
    start = int(sys.argv[2])
    for i in range(start, start + int(sys.argv[3])):
        await d.file_kv.put("s", "sp", f"k{i:06d}", {"i": i}, expected_version=0)
    print("acked", flush=True)
    sys.stdin.read()
asyncio.run(main())
"""

SQLITE_CHILD = r"""
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA journal_mode=WAL"); c.execute("PRAGMA synchronous=FULL")
c.execute("CREATE TABLE IF NOT EXISTS t(n INTEGER)")
for i in range(int(sys.argv[3])):
    c.execute("INSERT INTO t VALUES (?)", (i,))
print("acked", flush=True)
sys.stdin.read()
"""


def _run_child(code: str, *args: str) -> None:
    """Start the child, wait for its "acked", SIGKILL it (the power cut kills it)."""
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    child.kill()
    _, err = child.communicate(timeout=120)
    if line.strip() != "acked":
        raise SystemExit(f"child failed: {err}")


async def _file_count(path: Path) -> int:
    d = await FileDurability.open(path, append_log=True, fsync=True)
    try:
        return len(await d.file_kv.scan("s", "sp", limit=1_000_000))
    finally:
        await d.close()


def bare_cuts(m: PowerCutMount, n: int) -> dict[str, Any]:
    times: list[float] = []
    f = m.path / "data"
    log = m.path / "log"
    fd = os.open(log, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    os.close(fd)
    dfd = os.open(m.path, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    start = time.perf_counter()
    for i in range(n):
        f.write_bytes(os.urandom(4096))
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"x" * 100)
        os.fsync(fd)
        os.close(fd)
        t = time.perf_counter()
        m.cut(MODES[i % 3], seed=i)
        times.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return {"cuts": n, "per_min": 60 * n / wall, "cut_ms_median": 1000 * statistics.median(times),
            "cut_ms_max": 1000 * max(times)}


def kill_cycles(m: PowerCutMount, backend: str, cycles: int, writes: int) -> dict[str, Any]:
    lost = 0
    acked = 0
    start = time.perf_counter()
    for i in range(cycles):
        if backend == "file+log":
            path = m.path / "journal.json"
            _run_child(FILE_CHILD, str(path), str(i * writes), str(writes))
            m.cut(MODES[i % 3], seed=i)
            acked += writes
            lost += acked - asyncio.run(_file_count(path))
        else:
            path = m.path / "bot.db"
            _run_child(SQLITE_CHILD, str(path), "0", str(writes))
            m.cut(MODES[i % 3], seed=i)
            acked += writes
            conn = sqlite3.connect(path)
            lost += acked - int(conn.execute("SELECT count(*) FROM t").fetchone()[0])
            conn.close()
    wall = time.perf_counter() - start
    return {"cycles": cycles, "per_min": 60 * cycles / wall, "lost": lost, "acked": acked}


async def _puts(directory: Path, *, fsync: bool, n: int) -> float:
    path = directory / f"throughput-{fsync}.json"
    d = await FileDurability.open(path, append_log=True, fsync=fsync)
    for i in range(20):  # warm-up
        await d.file_kv.put("w", "sp", f"w{i}", {"i": i}, expected_version=0)
    start = time.perf_counter()
    for i in range(n):
        await d.file_kv.put("s", "sp", f"k{i}", {"i": i, "pad": "x" * 100}, expected_version=0)
    rate = n / (time.perf_counter() - start)
    await d.close()
    return rate


def _appends(directory: Path, *, fsync: bool, n: int) -> float:
    fd = os.open(directory / f"raw-{fsync}.log", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    record = b"r" * 199 + b"\n"
    start = time.perf_counter()
    for _ in range(n):
        os.write(fd, record)
        if fsync:
            os.fsync(fd)
    rate = n / (time.perf_counter() - start)
    os.close(fd)
    return rate


def throughput(m: PowerCutMount, plain: Path, puts: int) -> list[dict[str, Any]]:
    rows = []
    for label, measure in (
        ("FileDurability append_log put, fsync", lambda d: asyncio.run(_puts(d, fsync=True, n=puts))),
        ("FileDurability append_log put, no fsync", lambda d: asyncio.run(_puts(d, fsync=False, n=puts))),
        ("raw 200-byte append + fsync", lambda d: _appends(d, fsync=True, n=puts)),
        ("raw 200-byte append, no fsync", lambda d: _appends(d, fsync=False, n=puts)),
    ):
        on_plain = measure(plain)
        on_mount = measure(m.path)
        m.cut()  # drop what the no-fsync rows left unsynced, so memory does not grow
        rows.append({"what": label, "plain": on_plain, "mount": on_mount, "ratio": on_mount / on_plain})
    return rows


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: cuts and kill cycles per minute, the layer's cost."""
    out: dict[str, Any] = {"bare cuts/min": result["bare"]["per_min"]}
    for name in ("file+log", "sqlite"):
        out[f"kill cycles/min, {name}"] = result[name]["per_min"]
        out[f"acknowledged writes lost, {name}"] = result[name]["lost"]
    for row in result["throughput"]:
        out[f"{row['what']}: mount/plain"] = row["ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", type=int, default=300)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--writes", type=int, default=20)
    parser.add_argument("--puts", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    _against.add_options(parser)
    args = parser.parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    # Every reopen after a kill takes over the dead child's lock, and says so: expected here.
    logging.getLogger("botmesh").setLevel(logging.ERROR)
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot mount the power-cut file system: {reason}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="botmesh-bench-powercut-"))
    result: dict[str, Any] = {
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}, "
                   f"SQLite {sqlite3.sqlite_version}",
    }
    try:
        plain = tmp / "plain"
        plain.mkdir()
        try:
            t = time.perf_counter()
            m = PowerCutFS(tmp / "pc").mount()
            result["mount_s"] = time.perf_counter() - t
        except PowerCutUnavailable as exc:
            print(f"cannot mount the power-cut file system: {exc}", file=sys.stderr)
            return 2
        with m:
            result["bare"] = bare_cuts(m, args.cuts)
            m.cut()
            for name in ("data", "log"):
                (m.path / name).unlink()
            result["file+log"] = kill_cycles(m, "file+log", args.cycles, args.writes)
            result["sqlite"] = kill_cycles(m, "sqlite", args.cycles, args.writes)
            result["throughput"] = throughput(m, plain, args.puts)
            result["stats"] = {"cuts": m.stats().cuts, "layer_errors": m.check()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["total_s"] = time.perf_counter() - began

    print("botmesh power-cut file system")
    print("=============================")
    print(f"machine: {result['machine']}")
    print(f"mount:   {result['mount_s'] * 1000:.0f} ms (server start + kernel mount)")
    print()
    print("Power cuts per minute")
    b = result["bare"]
    print(f"  bare cut (4 KiB unsynced + fsynced append)  {b['per_min']:>9,.0f} /min   cut itself: median "
          f"{b['cut_ms_median']:.2f} ms, max {b['cut_ms_max']:.2f} ms ({b['cuts']} cuts)")
    for name in ("file+log", "sqlite"):
        c = result[name]
        print(f"  kill cycle, {name:<9} (child, {args.writes} writes)  {c['per_min']:>9,.0f} /min   "
              f"{c['cycles']} cycles, {c['acked']} acknowledged writes, {c['lost']} lost")
    print()
    print(f"FUSE layer cost ({args.puts} operations per row, this process; ops/s)")
    print(f"  {'what':<42} {'plain dir':>10} {'on mount':>10} {'mount/plain':>12}")
    for row in result["throughput"]:
        print(f"  {row['what']:<42} {row['plain']:>10,.0f} {row['mount']:>10,.0f} {row['ratio']:>11.2f}x")
    print("  (on the mount fsync is a memory copy, not a disk flush: compare the no-fsync rows for the layer's cost)")
    print()
    print(f"layer self-check after {result['stats']['cuts']} cuts: "
          f"{'clean' if not result['stats']['layer_errors'] else result['stats']['layer_errors']}")
    print(f"Total time {result['total_s']:.1f} s.")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    _against.emit(args, figures(result))
    return 0 if result["file+log"]["lost"] == 0 and result["sqlite"]["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
