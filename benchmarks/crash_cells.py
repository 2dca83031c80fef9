#!/usr/bin/env python3
"""Crash cells per second per backend, and the overhead of ``crashable`` on a bot.

Part 1, crash cells (``--parts cells``). For each backend, the cells of a matrix profile
(default ``smoke``) are drawn exactly as ``pytest --botmesh-backend=NAME
--botmesh-seed=SEED`` draws them (``botmesh_testkit.matrix``: one crash-free dry run per
workload with ``oracle()``, then ``draw_cells()``, the one cell-drawing function), and each cell is run with ``run_cell()`` in a
fresh temporary directory made where the matrix makes its own
(``botmesh_testkit.matrix.scratch.scratch_dir``: ``/dev/shm`` when there is one; the
system's temporary directory for a release without it), one after the other, in one
event loop. A cell's time is the
wall time of ``run_cell()`` including the creation and removal of its directory: the
bot until the crash, the restart, the redelivery and the drain in virtual time, and the
history check. Reported: cells, their total seconds, cells/s (= cells / that total),
mean, median, p90 and max per-cell time, and how many cells failed (a correct backend
fails none) or did not crash (a point the run did not reach again). The dry runs are
timed apart and not counted in cells/s.
``--cells N`` runs an evenly spaced subset of N cells per backend. ``--passes N`` runs
the chosen cells N times over, one pass after the other, every cell timed (a cell is
counted once per pass): a backend whose cells take half a second in all gives a figure
that one slow moment of the machine moves a lot; several passes give a steadier one.

Baseline of part 1, measured in the same run: the crash-free run of the same workload on
the same backend (``oracle()``: start, feed, drain, with a ``crashable`` armed with
nothing), ``--baseline-runs`` times per workload, median. "cell / dry run" is the total
cell time divided by the sum, over the cells, of the dry-run time of each cell's
workload: how many crash-free runs one crash cell costs (a cell runs the workload up to
the crash, then a second incarnation with the redelivery, and the checker).

``--callgrind`` (needs ``valgrind``) counts instead of timing: the CPU instructions per
crash cell, per backend — ``valgrind --tool=callgrind`` over a child of this script
running the chosen cells once, and over one running them twice (``--passes 1`` and
``2``, one dry run per workload, ``PYTHONHASHSEED=0``), the difference divided by the
cells. Start-up, imports and dry runs cancel out; the figure is deterministic to a
fraction of a percent, where cells/s moves by a third from one round to the next on a
noisy VM. It counts this process only: a server's work (PostgreSQL, Redis) and the
kernel's (fsync, directories) are not in it. With ``--against REF`` the children run
REF's code (figure ``BACKEND: instructions/cell``).

Part 2, overhead of ``crashable`` (``--parts overhead``). The same workload as
``durable_throughput.py``: a bot (``botmesh.core.bot.Bot``, real clock) whose only
handler does ``await ctx.reply("ok")`` is fed messages one at a time, each an
``InboundEvent`` built by the channel (a ``MockProvider``) and handed to the bot's
provider with ``await provider.deliver(event)``, so one message is one inbound and one
send. The backend and the store come from the backend's harness
(``botmesh_testkit.backends.resolve(name)(workdir).open()``, the same objects the crash
cells use). Two bots, each on its own fresh backend and store:

* **bare**: ``Bot(channel, store, durability={"backend": backend})``;
* **crashable**: ``cb = crashable(backend)``,
  ``Bot(CrashableProvider(cb, channel), store, durability={"backend": cb})``, nothing
  armed: every write and every send goes through the crash-point bookkeeping.

One repetition starts both bots, feeds each 10 untimed warm-up messages, then N timed
messages each (``--messages``; ``--fast-messages`` for ``memory``, ``--slow-messages``
for ``file``, whose snapshot rewrite grows with the journal) in alternating blocks of
``--block`` messages (bare, crashable, crashable, bare, ...), every block timed, so load
from other processes hits both alike; ``--repeat`` repetitions with fresh bots. A
repetition's msg/s per variant = its messages / the sum of its block times; its
overhead = median over the block pairs of (crashable block time / bare block time) - 1
(the ratio of the total times is printed beside it). The same is computed with the
process's CPU time (``time.process_time()`` per block): the wrapper's cost is CPU work,
and CPU time is barely moved by other processes' load or by fsync waits, which swamp
the wall-clock difference on the disk backends. Reported: the medians over the
repetitions of both msg/s, of the wall and the CPU overhead and of the CPU us/msg of
each variant, the wall time added per message (difference of the medians of us/msg), and
the crash points one message passes (``len(cb.history)`` / messages).

``postgres`` and ``redis`` run when ``resolve(name)`` works and a server answers (a URL
in ``BOTMESH_POSTGRES_URL`` / ``BOTMESH_REDIS_URL``, else a private server provisioned
by ``botmesh_testkit.services``); otherwise the row says ``skipped: <reason>``.

Usage::

    python benchmarks/crash_cells.py [--cells N] [--messages N] [--json PATH]

Needs only botmesh and botmesh_testkit (``pip install -e .``); temporary files go in
``tempfile`` directories under ``/tmp`` and are deleted.
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
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botmesh.core.bot import Bot
from botmesh.core.testing import MockProvider
from botmesh_testkit.backends import SERVICE_BACKENDS, resolve
from botmesh_testkit.crash import CrashableProvider, crashable
from botmesh_testkit.matrix import Cell, Oracle, draw_cells, oracle, run_cell
from botmesh_testkit.matrix.profiles import load_profile

import _against
import _callgrind

try:  # where the matrix itself makes a cell's directory (RAM when there is /dev/shm; issue 16)
    from botmesh_testkit.matrix.scratch import scratch_dir as cell_dir
except ImportError:  # a release before it: the system's temporary directory, as its matrix did
    def cell_dir(prefix: str) -> Any:
        return tempfile.TemporaryDirectory(prefix=prefix)

DEFAULT_BACKENDS = ["memory", "file", "file+log", "sqlite", "postgres", "redis"]
PARTS = ("cells", "overhead")
WARMUP = 10  # untimed messages per bot before the timed part of an overhead repetition


def one_line(exc: BaseException, limit: int = 240) -> str:
    """``exc`` on one line, cut at ``limit`` characters (type name first unless it is a
    ValueError, whose message names the problem)."""
    text = str(exc)
    if not isinstance(exc, ValueError) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------
# service backends (postgres, redis)
# --------------------------------------------------------------------------------------


def prepare_backend(name: str, cleanups: list[Callable[[], Any]]) -> str | None:
    """None when ``name`` can be used, else the reason to skip it. For a service backend
    it also makes sure a server is there (URL from the environment, else a private one)
    and exports its URL, the way the pytest plugin does."""
    try:
        resolve(name)
    except Exception as exc:  # unknown name, driver missing, harness not there yet
        return f"resolve({name!r}) failed: {one_line(exc)}"
    if name not in SERVICE_BACKENDS:
        return None
    from botmesh_testkit import servers

    try:
        if name == "postgres":
            pg = servers.provision_postgres(os.environ.get(servers.POSTGRES_URL_ENV))
            cleanups.append(pg.close)
            os.environ[servers.POSTGRES_URL_ENV] = pg.new_database(servers.namespace_hint("bench"))
        else:
            rd = servers.provision_redis(os.environ.get(servers.REDIS_URL_ENV))
            cleanups.append(rd.close)
            os.environ[servers.REDIS_URL_ENV] = rd.url
            os.environ[servers.REDIS_PREFIX_ENV] = rd.new_prefix(servers.namespace_hint("bench"))
    except Exception as exc:
        return f"no {name} server: {one_line(exc)}"
    return None


# --------------------------------------------------------------------------------------
# part 1: crash cells
# --------------------------------------------------------------------------------------


@dataclass
class CellsResult:
    backend: str
    skipped: str | None = None
    dry_seconds: dict[str, list[float]] = field(default_factory=dict)  # workload -> dry-run times
    cell_seconds: list[float] = field(default_factory=list)
    cell_workloads: list[str] = field(default_factory=list)
    total_cells: int = 0  # before --cells
    failed: list[str] = field(default_factory=list)
    not_crashed: int = 0
    wall: float = 0.0


async def timed_oracle(backend: str, workload: str, seed: int, timeout: float) -> tuple[Oracle, float]:
    t0 = time.perf_counter()
    with cell_dir("botmesh-bench-dry-") as tmp:
        truth = await asyncio.wait_for(oracle(backend, workload, seed, tmp), timeout)
    return truth, time.perf_counter() - t0


def subset(cells: list[Cell], n: int | None) -> list[Cell]:
    """``n`` evenly spaced cells of ``cells`` (all of them when ``n`` is None or larger)."""
    if n is None or n >= len(cells):
        return cells
    return [cells[i * len(cells) // n] for i in range(n)]


async def bench_cells(backend: str, profile: Any, seed: int, args: argparse.Namespace) -> CellsResult:
    res = CellsResult(backend)
    started = time.perf_counter()
    cells: list[Cell] = []
    truths: dict[str, Oracle] = {}
    for workload in profile.workloads:
        try:
            truth, seconds = await timed_oracle(backend, workload, seed, args.cell_timeout)
        except Exception as exc:
            res.skipped = f"the crash-free dry run of {workload!r} failed: {one_line(exc)}"
            return res
        truths[workload] = truth
        res.dry_seconds[workload] = [seconds]
        cells += draw_cells(backend, workload, truth, profile.policies, profile.random_per_workload, seed)
    res.total_cells = len(cells)
    if args.list_cells:
        for cell in cells:
            print(cell.id)
        res.skipped = "--list-cells: cells listed, none run"
        return res
    chosen = subset(cells, args.cells)
    for workload in {c.workload for c in chosen}:  # more dry runs for a steadier baseline
        for _ in range(args.baseline_runs - 1):
            _, seconds = await timed_oracle(backend, workload, seed, args.cell_timeout)
            res.dry_seconds[workload].append(seconds)
    for cell in chosen * args.passes:  # every pass the same cells in the same order
        t0 = time.perf_counter()
        with cell_dir("botmesh-bench-cell-") as tmp:
            try:
                outcome = await asyncio.wait_for(run_cell(cell, seed, truths[cell.workload], tmp), args.cell_timeout)
            except Exception as exc:
                outcome = None
                res.failed.append(f"{cell.id}: raised {one_line(exc)}")
        res.cell_seconds.append(time.perf_counter() - t0)
        res.cell_workloads.append(cell.workload)
        if outcome is not None:
            if not outcome.passed:
                res.failed.append(f"{cell.id}: " + "; ".join(str(v) for v in outcome.violations))
            if not outcome.crashed:
                res.not_crashed += 1
    res.wall = time.perf_counter() - started
    return res


def cells_summary(res: CellsResult) -> dict[str, Any]:
    s = res.cell_seconds
    dry_median = {w: statistics.median(v) for w, v in res.dry_seconds.items()}
    baseline = sum(dry_median[w] for w in res.cell_workloads)
    total = sum(s)
    per_workload = {}
    for w in dry_median:
        mine = [t for t, ww in zip(s, res.cell_workloads, strict=True) if ww == w]
        if mine:
            per_workload[w] = {"cells": len(mine), "median_ms": 1e3 * statistics.median(mine),
                               "dry_run_ms": 1e3 * dry_median[w]}
    return {
        "cells": len(s),
        "cells_in_profile": res.total_cells,
        "seconds": total,
        "cells_per_s": len(s) / total if total else None,
        "mean_ms": 1e3 * statistics.fmean(s) if s else None,
        "median_ms": 1e3 * statistics.median(s) if s else None,
        "p90_ms": 1e3 * statistics.quantiles(s, n=10)[-1] if len(s) >= 2 else None,
        "max_ms": 1e3 * max(s) if s else None,
        "failed": len(res.failed),
        "failures": res.failed[:20],
        "not_crashed": res.not_crashed,
        "dry_run_ms": {w: 1e3 * v for w, v in dry_median.items()},
        "dry_runs_seconds": sum(sum(v) for v in res.dry_seconds.values()),
        "cell_per_dry_run": total / baseline if baseline else None,
        "per_workload": per_workload,
        "wall_seconds": res.wall,
    }


# --------------------------------------------------------------------------------------
# part 2: overhead of crashable
# --------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One bot of an overhead repetition: bare or wrapped in crashable."""

    name: str
    harness: Any
    bot: Bot
    channel: MockProvider
    cb: Any  # the CrashableBackend, or None for the bare bot
    errors: list[Any]
    seconds: float = 0.0
    messages: int = 0
    block_seconds: list[float] = field(default_factory=list)
    cpu: float = 0.0
    block_cpu: list[float] = field(default_factory=list)


async def open_variant(backend_name: str, workdir: str, *, wrap: bool) -> Variant:
    os.makedirs(workdir, exist_ok=True)
    harness = resolve(backend_name)(workdir)
    backend, store = await harness.open()
    channel = MockProvider()
    cb = None
    if wrap:
        cb = crashable(backend)
        bot = Bot(CrashableProvider(cb, channel), store, durability={"backend": cb})
    else:
        bot = Bot(channel, store, durability={"backend": backend})
    errors: list[Any] = []
    bot.on("error", errors.append)

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    try:
        await bot.start()
    except BaseException:
        await harness.close()
        raise
    return Variant("crashable" if wrap else "bare", harness, bot, channel, cb, errors)


async def feed(v: Variant, ids: list[str]) -> tuple[float, float]:
    """Deliver one message per id, one at a time; the elapsed wall and CPU seconds."""
    events = [v.channel.event("chat-1", "hi", id=i) for i in ids]
    deliver = v.bot.provider.deliver
    c0 = time.process_time()
    t0 = time.perf_counter()
    for event in events:
        await deliver(event)
    return time.perf_counter() - t0, time.process_time() - c0


async def close_variant(v: Variant) -> None:
    try:
        await v.bot.stop()
    finally:
        await v.harness.close()


async def overhead_repetition(backend: str, root: str, rep: int, messages: int, block: int) -> dict[str, Any]:
    """A bare and a crashable bot, both fresh and started; WARMUP untimed messages each,
    then ``messages`` each in alternating blocks of ``block`` (the first of each pair
    alternates too), every block timed."""
    variants: list[Variant] = []
    try:
        for wrap in (False, True):
            variants.append(await open_variant(backend, os.path.join(root, f"ovh-{rep}-{int(wrap)}"), wrap=wrap))
        bare, wrapped = variants
        for v in variants:
            await feed(v, [f"r{rep}-warm-{i}" for i in range(WARMUP)])
        start_points = len(wrapped.cb.history)
        done = 0
        k = 0
        while done < messages:
            n = min(block, messages - done)
            order = (bare, wrapped) if k % 2 == 0 else (wrapped, bare)
            for v in order:
                seconds, cpu = await feed(v, [f"r{rep}-m{done + i}" for i in range(n)])
                v.block_seconds.append(seconds)
                v.seconds += seconds
                v.block_cpu.append(cpu)
                v.cpu += cpu
                v.messages += n
            done += n
            k += 1
        for v in variants:
            if v.errors:
                raise RuntimeError(f"{backend} ({v.name}): the bot reported errors: {v.errors[:3]!r}")
            if len(v.channel.sent) != WARMUP + messages:
                raise RuntimeError(f"{backend} ({v.name}): {len(v.channel.sent)} replies for {WARMUP + messages} messages")
        points = len(wrapped.cb.history) - start_points
        ratios = [c / b for b, c in zip(bare.block_seconds, wrapped.block_seconds, strict=True)]
        cpu_ratios = [c / b for b, c in zip(bare.block_cpu, wrapped.block_cpu, strict=True) if b > 0]
        return {
            "bare_msg_s": bare.messages / bare.seconds,
            "crashable_msg_s": wrapped.messages / wrapped.seconds,
            "overhead": statistics.median(ratios) - 1.0,
            "overhead_totals": wrapped.seconds / bare.seconds - 1.0,
            "cpu_overhead": statistics.median(cpu_ratios) - 1.0 if cpu_ratios else None,
            "bare_cpu_us": 1e6 * bare.cpu / bare.messages,
            "crashable_cpu_us": 1e6 * wrapped.cpu / wrapped.messages,
            "points_per_msg": points / messages,
        }
    finally:
        for v in variants:
            await close_variant(v)
        for wrap in (0, 1):
            shutil.rmtree(os.path.join(root, f"ovh-{rep}-{wrap}"), ignore_errors=True)


async def bench_overhead(backend: str, messages: int, repeat: int, block: int, root: str) -> dict[str, Any]:
    reps = [await overhead_repetition(backend, root, rep, messages, block) for rep in range(repeat)]
    bare_rate = [r["bare_msg_s"] for r in reps]
    wrap_rate = [r["crashable_msg_s"] for r in reps]
    return {
        "messages": messages,
        "repeat": repeat,
        "block": block,
        "bare_msg_s": statistics.median(bare_rate),
        "crashable_msg_s": statistics.median(wrap_rate),
        "bare_all": bare_rate,
        "crashable_all": wrap_rate,
        "overhead": statistics.median(r["overhead"] for r in reps),
        "overhead_all": [r["overhead"] for r in reps],
        "overhead_totals_all": [r["overhead_totals"] for r in reps],
        "us_per_msg_added": 1e6 * (statistics.median(1 / x for x in wrap_rate)
                                   - statistics.median(1 / x for x in bare_rate)),
        "points_per_msg": statistics.median(r["points_per_msg"] for r in reps),
        "cpu_overhead": statistics.median(r["cpu_overhead"] for r in reps if r["cpu_overhead"] is not None),
        "cpu_overhead_all": [r["cpu_overhead"] for r in reps],
        "bare_cpu_us": statistics.median(r["bare_cpu_us"] for r in reps),
        "crashable_cpu_us": statistics.median(r["crashable_cpu_us"] for r in reps),
    }


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ",.1f") -> str:
    return "-" if x is None else format(x, spec)


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align, strict=True)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def messages_for(backend: str, args: argparse.Namespace) -> int:
    """Timed messages per bot and repetition of the overhead part."""
    if backend == "memory":
        return args.fast_messages
    if backend == "file":
        return args.slow_messages
    return args.messages


def print_skipped(entries: dict[str, dict[str, Any]], out: Any) -> None:
    for backend, e in entries.items():
        if "skipped" in e:
            print(f"{backend}: skipped: {e['skipped']}", file=out)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("botmesh").setLevel(logging.ERROR)  # lock take-overs, MemoryStore warnings
    out = sys.stdout
    profile = load_profile(args.profile)
    now = _dt.datetime.now().astimezone()
    machine = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "sqlite": sqlite3.sqlite_version,
        "loadavg_start": list(os.getloadavg()),
    }
    fast = args.fast_messages
    print("botmesh crash cells and crashable overhead", file=out)
    print("==========================================", file=out)
    print(f"date:     {now.isoformat(timespec='seconds')}", file=out)
    print(f"machine:  {machine['platform']}, {machine['cpu_count']} CPUs, {machine['python']}, "
          f"SQLite {machine['sqlite']}", file=out)
    print(f"load:     {' '.join(f'{x:.2f}' for x in machine['loadavg_start'])} (1, 5, 15 min) at the start", file=out)
    if "cells" in args.parts:
        print(f"cells:    profile {profile.name!r} ({', '.join(profile.workloads)}; {', '.join(profile.policies)}; "
              f"{profile.random_per_workload} random/workload), seed {args.seed}, "
              f"{'all cells' if args.cells is None else f'at most {args.cells} cells'} per backend"
              f"{'' if args.passes == 1 else f' x {args.passes} passes'}, sequential; "
              f"baseline: crash-free dry run of the workload, median of {args.baseline_runs}", file=out)
    if "overhead" in args.parts:
        print(f"overhead: bot replying once per message, real clock; per repetition a bare and a crashable bot, "
              f"{WARMUP} warm-up messages each, then {args.messages} timed messages each ({fast} for memory, "
              f"{args.slow_messages} for file) in alternating blocks of {args.block}; {args.repeat} repetitions; "
              "medians", file=out)
    print(file=out)
    out.flush()

    results: dict[str, Any] = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine,
        "params": {"profile": profile.name, "seed": args.seed, "cells": args.cells, "baseline_runs": args.baseline_runs,
                   "messages": args.messages, "fast_messages": fast, "slow_messages": args.slow_messages,
                   "block": args.block, "repeat": args.repeat, "warmup": WARMUP,
                   "parts": list(args.parts)},
        "backends": {},
    }
    started = time.perf_counter()
    cleanups: list[Callable[[], Any]] = []
    root = tempfile.mkdtemp(prefix="botmesh-bench-")
    try:
        for backend in args.backends:
            entry: dict[str, Any] = {}
            results["backends"][backend] = entry
            reason = prepare_backend(backend, cleanups)
            if reason is None and "cells" in args.parts:
                res = await bench_cells(backend, profile, args.seed, args)
                if res.skipped is not None:
                    reason = res.skipped
                else:
                    entry["cells"] = cells_summary(res)
                    c = entry["cells"]
                    print(f"  {backend:<9} cells: {c['cells']} in {c['seconds']:.1f} s, {fmt_rate(c['cells_per_s'])} "
                          f"cells/s, {c['failed']} failed", file=out)
                    for line in c["failures"][:5]:
                        print(f"    FAILED {line}", file=out)
                    out.flush()
            if reason is None and "overhead" in args.parts:
                try:
                    entry["overhead"] = await bench_overhead(backend, messages_for(backend, args), args.repeat,
                                                             args.block, root)
                except Exception as exc:
                    if backend not in SERVICE_BACKENDS:
                        raise
                    reason = f"overhead run failed: {one_line(exc)}"
                else:
                    o = entry["overhead"]
                    print(f"  {backend:<9} overhead: bare {fmt_rate(o['bare_msg_s'])} msg/s, crashable "
                          f"{fmt_rate(o['crashable_msg_s'])} msg/s, {fmt_pct(o['overhead'])}", file=out)
                    out.flush()
            if reason is not None:
                entry.clear()
                entry["skipped"] = reason
                print(f"  {backend:<9} skipped: {reason}", file=out)
                out.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for close in reversed(cleanups):
            try:
                close()
            except Exception as exc:  # a server that does not stop cleanly must not hide the results
                print(f"warning: cleanup failed: {one_line(exc)}", file=sys.stderr)
    total = time.perf_counter() - started
    results["total_seconds"] = total
    machine["loadavg_end"] = list(os.getloadavg())

    entries = results["backends"]
    if "cells" in args.parts:
        print(file=out)
        print("Crash cells (sequential; a cell = run to the crash, restart, redeliver, drain, check)", file=out)
        rows = []
        for backend, e in entries.items():
            c = e.get("cells")
            if c is None:
                continue
            rows.append([backend, f"{c['cells']}" + (f"/{c['cells_in_profile']}" if c["cells"] != c["cells_in_profile"] else ""),
                         f"{c['seconds']:.2f}", fmt_rate(c["cells_per_s"]), fmt(c["mean_ms"]), fmt(c["median_ms"]),
                         fmt(c["p90_ms"]), fmt(c["max_ms"]), f"{c['cell_per_dry_run']:.2f}x", str(c["failed"]),
                         str(c["not_crashed"])])
        if rows:
            print(table(["backend", "cells", "seconds", "cells/s", "mean ms", "median ms", "p90 ms", "max ms",
                         "cell / dry run", "failed", "no crash"], rows, "lrrrrrrrrrr"), file=out)
        print_skipped(entries, out)
        print(file=out)
        print("Per workload: median ms per cell / ms of the crash-free dry run (the baseline)", file=out)
        wrows = []
        for backend, e in entries.items():
            c = e.get("cells")
            if c is None:
                continue
            cols = []
            for w in profile.workloads:
                pw = c["per_workload"].get(w)
                cols.append("-" if pw is None else f"{pw['median_ms']:.1f} / {pw['dry_run_ms']:.1f}")
            wrows.append([backend, *cols])
        if wrows:
            print(table(["backend", *profile.workloads], wrows, "l" + "r" * len(profile.workloads)), file=out)
        print(file=out)
    if "overhead" in args.parts:
        print("Overhead of crashable(backend) + CrashableProvider, nothing armed (medians of repetitions)", file=out)
        rows = []
        for backend, e in entries.items():
            o = e.get("overhead")
            if o is None:
                continue
            rows.append([backend, str(o["messages"]), fmt_rate(o["bare_msg_s"]), fmt_rate(o["crashable_msg_s"]),
                         fmt_pct(o["overhead"]), f"{o['us_per_msg_added']:+.1f}",
                         f"{o['bare_cpu_us']:,.0f} / {o['crashable_cpu_us']:,.0f}", fmt_pct(o["cpu_overhead"]),
                         fmt(o["points_per_msg"], ".1f")])
        if rows:
            print(table(["backend", "timed msgs", "bare msg/s", "crashable msg/s", "overhead", "us/msg added",
                         "CPU us/msg bare / crashable", "CPU overhead", "points/msg"], rows, "lrrrrrrrr"), file=out)
        print_skipped(entries, out)
        print("timed msgs = per bot and repetition. overhead = median over repetitions of: median over block pairs",
              file=out)
        print("of (crashable block time / bare block time) - 1; CPU overhead the same with the process's CPU time",
              file=out)
        print("(time.process_time), which load from other processes and fsync waits barely move. Per repetition:",
              file=out)
        print("wall [wall from the repetition's total times] (CPU)", file=out)
        for backend, e in entries.items():
            o = e.get("overhead")
            if o is not None:
                triples = zip(o["overhead_all"], o["overhead_totals_all"], o["cpu_overhead_all"], strict=True)
                print(f"  {backend:<9} " + ", ".join(
                    f"{fmt_pct(x)} [{fmt_pct(y)}] ({fmt_pct(z)})" for x, y, z in triples), file=out)
        print(file=out)

    print("Summary", file=out)
    rows = []
    for backend, e in entries.items():
        c, o = e.get("cells"), e.get("overhead")
        if c is None and o is None:
            continue
        rows.append([backend,
                     fmt_rate(c["cells_per_s"]) if c else "-",
                     fmt(c["median_ms"]) if c else "-",
                     f"{c['failed']}/{c['cells']}" if c else "-",
                     fmt_rate(o["bare_msg_s"]) if o else "-",
                     fmt_rate(o["crashable_msg_s"]) if o else "-",
                     fmt_pct(o["overhead"]) if o else "-",
                     fmt_pct(o["cpu_overhead"]) if o else "-"])
    if rows:
        print(table(["backend", "cells/s", "median ms/cell", "failed", "bare msg/s", "crashable msg/s",
                     "crashable overhead", "CPU overhead"], rows, "lrrrrrrr"), file=out)
    print_skipped(entries, out)
    print(f"Total time {total:.1f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}.", file=out)
    return results


def _instructions(backend: str, passes: int, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """CPU instructions of a child of this script running ``backend``'s cells ``passes``
    times under callgrind, and the child's cells summary (its ``--json``)."""
    with tempfile.TemporaryDirectory(prefix="botmesh-callgrind-cells-") as tmp:
        report = os.path.join(tmp, "cells.json")
        argv = [sys.executable, os.path.abspath(__file__), "--parts", "cells", "--backends", backend,
                "--passes", str(passes), "--baseline-runs", "1", "--profile", args.profile, "--seed", str(args.seed),
                "--cell-timeout", str(args.cell_timeout), "--json", report]
        if args.cells is not None:
            argv += ["--cells", str(args.cells)]
        total = _callgrind.instructions(argv, dict(os.environ, PYTHONHASHSEED="0"))
        with open(report, encoding="utf-8") as f:
            return total, json.load(f)["backends"][backend]


def callgrind_cells(args: argparse.Namespace) -> dict[str, Any]:
    """``--callgrind``: instructions per crash cell per backend (module docstring)."""
    out = sys.stdout
    print("botmesh crash cells: CPU instructions per cell (callgrind)", file=out)
    print(f"cells: profile {args.profile!r}, seed {args.seed}, "
          f"{'all cells' if args.cells is None else f'at most {args.cells} cells'} per backend; "
          "children of 1 and 2 passes, the difference / cells", file=out)
    if shutil.which("valgrind") is None:
        print("callgrind: skipped, valgrind is not on the PATH", file=out)
        return {"backends": {b: {"skipped": "valgrind is not on the PATH"} for b in args.backends}}
    backends: dict[str, Any] = {}
    cleanups: list[Callable[[], Any]] = []
    try:
        for backend in args.backends:
            skipped = prepare_backend(backend, cleanups)
            if skipped:
                backends[backend] = {"skipped": skipped}
                continue
            (one, first), (two, second) = _instructions(backend, 1, args), _instructions(backend, 2, args)
            if "skipped" in first or "skipped" in second:
                backends[backend] = {"skipped": first.get("skipped") or second.get("skipped")}
                continue
            cells = first["cells"]["cells"]
            failed = first["cells"]["failed"] + second["cells"]["failed"]
            backends[backend] = {"instructions_per_cell": (two - one) / cells, "cells": cells, "failed": failed}
            print(f"  {backend:<9} {(two - one) / cells:>14,.0f} instructions/cell  ({cells} cells, {failed} failed)",
                  file=out)
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
    print_skipped(backends, out)
    return {"callgrind": True, "backends": backends}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, metavar="NAME",
                   help=f"backends to measure (default: {' '.join(DEFAULT_BACKENDS)})")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: cells, overhead (default: both)")
    p.add_argument("--profile", default="smoke", help="matrix profile of the cells (default smoke)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random cells (default 1)")
    p.add_argument("--cells", type=int, default=None, metavar="N",
                   help="run at most N cells per backend, evenly spaced over the profile's cells (default: all)")
    p.add_argument("--passes", type=int, default=1, metavar="N",
                   help="run the chosen cells N times over, all timed (default 1; more: a steadier cells/s)")
    p.add_argument("--baseline-runs", type=int, default=3,
                   help="crash-free dry runs per workload for the baseline; the median is used (default 3)")
    p.add_argument("--cell-timeout", type=float, default=120.0, help="seconds allowed per cell (default 120)")
    p.add_argument("--messages", type=int, default=150,
                   help="overhead: timed messages per bot and repetition (default 150; see the next two)")
    p.add_argument("--fast-messages", type=int, default=800, help="the same for memory (default 800)")
    p.add_argument("--slow-messages", type=int, default=50,
                   help="the same for file, whose snapshot rewrite slows as the journal grows (default 50)")
    p.add_argument("--block", type=int, default=10,
                   help="overhead: messages per block; the two bots take turns block by block (default 10)")
    p.add_argument("--repeat", type=int, default=5,
                   help="overhead repetitions, each with a fresh bare and a fresh crashable bot (default 5)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--callgrind", action="store_true",
                   help="cells: CPU instructions per cell (valgrind) instead of cells/s; see the module docstring")
    p.add_argument("--list-cells", action="store_true",
                   help="print the id of every cell drawn (as the plugin would draw them) and run none")
    _against.add_options(p)
    args = p.parse_args(argv)
    args.parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    if not args.parts or any(x not in PARTS for x in args.parts):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    for name in ("messages", "fast_messages", "slow_messages", "block", "repeat", "baseline_runs", "passes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.cells is not None and args.cells < 1:
        p.error("--cells must be >= 1")
    try:
        load_profile(args.profile)
    except ValueError as exc:
        p.error(str(exc))
    return args


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: per backend cells/s, ms per cell, crashable's overhead."""
    out: dict[str, Any] = {}
    for backend, e in results.get("backends", {}).items():
        if "skipped" in e:
            out[f"{backend}: cells/s"] = f"skipped: {e['skipped'][:60]}"
            continue
        if "instructions_per_cell" in e:
            out[f"{backend}: instructions/cell"] = e["instructions_per_cell"]
            out[f"{backend}: cells failed"] = e["failed"]
            continue
        c, o = e.get("cells"), e.get("overhead")
        if c:
            out[f"{backend}: cells/s"] = c["cells_per_s"]
            out[f"{backend}: median ms/cell"] = c["median_ms"]
            out[f"{backend}: cells failed"] = c["failed"]
        if o:
            out[f"{backend}: crashable overhead %"] = 100 * o["overhead"]
            out[f"{backend}: bare msg/s"] = o["bare_msg_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    results = callgrind_cells(args) if args.callgrind else asyncio.run(main_async(args))
    _against.emit(args, figures(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
