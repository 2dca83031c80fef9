#!/usr/bin/env python3
"""The engine's own cost per message: memory durability beside no durability, timed and
counted, optionally beside another version of the code (``--against REF``).

A message is the one of ``durable_throughput.py``: ``await provider.receive(chat, "hi",
id=unique)`` to a bot whose only handler does ``await ctx.reply("ok")`` (real clock,
sequential), after 10 untimed warm-up messages. Rows: ``none`` (no durability) and
``memory`` (``durability={}``). The figure of the issue's target is **none/memory**: the
memory rate as a share of the no-durability rate (wall), or its inverse in work (counts).

Every measurement runs in a child process (``python engine_cost.py --child ...``), so
that two versions of the code can be measured in one run:

* **wall** (``--wall``): msg/s of ``--messages`` messages, by the wall clock and by the
  child's CPU time (``time.process_time``, less hit by other processes on a loaded
  machine); the rows and the versions take turns, ``--repeat`` rounds, best (and median)
  per row. Compare the ratios, not the absolute rates.
* **Python calls per message** (``--calls``): ``cProfile``'s count of function calls
  (a coroutine's every resumption counts as a call) over the timed messages, divided by
  them. Deterministic.
* **CPU instructions per message** (``--callgrind``, needs ``valgrind``): the
  instructions ``valgrind --tool=callgrind`` counts in a child doing N messages
  (``--messages`` when given, else 200), subtracted from one doing 2N, divided by N
  (start-up and imports cancel out). Deterministic to a fraction of a percent; slow.

``--against REF``: the other version comes from ``benchmarks/_against.py`` (a git ref
installed once in a cached venv of its own, or the interpreter of an installed version);
that version's children run this script with that interpreter (this script, that code);
the rows of both versions are printed one under the other, then the ratio current / REF
of each figure. Without an option, ``--wall --calls``.

Usage::

    python benchmarks/engine_cost.py [--messages N] [--wall] [--calls] [--callgrind] [--against REF]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as _dt
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import _against
import _callgrind

WARMUP = 10
ROWS = ("none", "memory")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- the child: one row of one version ---------------------------------------------------
async def _run(row: str, messages: int, profile: cProfile.Profile | None = None) -> tuple[float, float]:
    from botmesh.core import Bot, MemoryStore
    from botmesh.core.testing import MockProvider

    provider = MockProvider()
    if row == "memory":
        bot = Bot(provider, store=MemoryStore(), durability={})
    else:
        bot = Bot(provider, store=MemoryStore())

    async def handler(ctx: Any) -> None:
        await ctx.reply("ok")

    bot.otherwise(handler)
    await bot.start()
    try:
        for i in range(WARMUP):
            await provider.receive("chat-1", "hi", id=f"warm-{i}")
        if profile is not None:
            profile.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(messages):
            await provider.receive("chat-1", "hi", id=f"msg-{i}")
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if profile is not None:
            profile.disable()
    finally:
        await bot.stop()
    if len(provider.sent) != WARMUP + messages:
        raise RuntimeError(f"{row}: {len(provider.sent)} replies for {WARMUP + messages} messages")
    return elapsed, cpu


def _child(row: str, messages: int, what: str) -> None:
    if what == "calls":
        profile = cProfile.Profile()
        asyncio.run(_run(row, messages, profile))
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
        print(json.dumps({"calls": calls / messages}))
    else:
        seconds, cpu = asyncio.run(_run(row, messages))
        print(json.dumps({"seconds": seconds, "cpu": cpu}))


# -- the parent ----------------------------------------------------------------------------
class Version:
    """A version of the code: the interpreter whose ``botmesh`` its children measure."""

    def __init__(self, name: str, python: str) -> None:
        self.name = name
        self.python = python

    script = os.path.abspath(__file__)  # this script; the code measured is the interpreter's

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.python != sys.executable:
            env.pop("PYTHONPATH", None)
        return env

    def child(self, row: str, messages: int, what: str) -> dict[str, float]:
        out = subprocess.run([self.python, self.script, "--child", row, "--messages", str(messages), "--what", what],
                             check=True, capture_output=True, text=True, env=self.env())
        result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    def instructions(self, row: str, messages: int) -> int:
        return _callgrind.instructions(
            [self.python, self.script, "--child", row, "--messages", str(messages), "--what", "wall"], self.env())


def _ratios(results: dict[str, dict[str, Any]], versions: list[Version], key: str) -> None:
    """With --against: print current / REF for each row of ``results[...][key]``."""
    if len(versions) < 2:
        return
    new, old = (results[v.name].get(key) for v in versions)
    if not new or not old:
        return
    new, old = new.get("best", new), old.get("best", old)
    parts = [f"{r} {new[r] / old[r]:.2f}" for r in ROWS if old.get(r)]
    share = (new["memory"] / new["none"]) / (old["memory"] / old["none"])
    print(f"  {'current / REF':<28} " + "   ".join(parts) + f"   (memory/none {share:.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=2000, help="timed/counted messages per child (default 2000; "
                   "callgrind: 200 unless given)")
    p.add_argument("--wall", action="store_true", help="wall-clock msg/s, rows and versions taking turns")
    p.add_argument("--repeat", type=int, default=5, help="rounds of --wall (default 5)")
    p.add_argument("--calls", action="store_true", help="Python calls per message (cProfile)")
    p.add_argument("--callgrind", action="store_true", help="CPU instructions per message (valgrind)")
    p.add_argument("--against", metavar="REF", help="also measure the code of REF (a git ref, or a venv / python of "
                   "an installed version; see benchmarks/_against.py), side by side")
    p.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    p.add_argument("--what", choices=("wall", "calls"), default="wall", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.messages < 1 or args.repeat < 1:
        p.error("--messages and --repeat must be >= 1")
    if args.child:
        _child(args.child, args.messages, args.what)
        return 0
    if not (args.calls or args.callgrind or args.wall):
        args.wall = args.calls = True
    started = time.perf_counter()
    versions = [Version(_against.current().label, sys.executable)]
    if args.against:
        try:
            other = _against.prepare(args.against, log=sys.stdout)
        except _against.AgainstError as exc:
            print(f"engine_cost.py: {exc}", file=sys.stderr)
            return 2
        versions.append(Version(other.label, other.python))
    print("botmesh engine cost: memory durability beside no durability")
    print(f"date:     {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}")
    print(f"machine:  {platform.platform()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}")
    print(f"load:     {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the start")
    print(f"versions: {', '.join(v.name for v in versions)}")
    results: dict[str, dict[str, Any]] = {v.name: {} for v in versions}
    if args.wall:
        rates: dict[tuple[str, str, str], list[float]] = {
            (v.name, r, clock): [] for v in versions for r in ROWS for clock in ("seconds", "cpu")
        }
        for _ in range(args.repeat):
            for v in versions:
                for row in ROWS:
                    got = v.child(row, args.messages, "wall")
                    for clock in ("seconds", "cpu"):
                        rates[(v.name, row, clock)].append(args.messages / max(got[clock], 1e-9))
        for clock, title in (("seconds", "wall clock"), ("cpu", "process CPU time")):
            print(f"\nmsg/s by {title}, {args.messages} messages per child, {args.repeat} rounds (rows and "
                  "versions taking turns); best (median)")
            for v in versions:
                best = {r: max(rates[(v.name, r, clock)]) for r in ROWS}
                med = {r: statistics.median(rates[(v.name, r, clock)]) for r in ROWS}
                results[v.name][clock] = {"best": best, "median": med}
                print(f"  {v.name:<28} none {best['none']:>8,.0f} ({med['none']:,.0f})   memory "
                      f"{best['memory']:>7,.0f} ({med['memory']:,.0f})   memory/none "
                      f"{best['memory'] / best['none']:6.1%} ({med['memory'] / med['none']:.1%})")
            _ratios(results, versions, clock)
    if args.calls:
        print(f"\nPython calls per message (cProfile, {args.messages} messages)")
        for v in versions:
            calls = {r: v.child(r, args.messages, "calls")["calls"] for r in ROWS}
            results[v.name]["calls"] = calls
            print(f"  {v.name:<28} none {calls['none']:>8,.0f}   memory {calls['memory']:>8,.0f}   "
                  f"none/memory {calls['none'] / calls['memory']:6.1%}")
        _ratios(results, versions, "calls")
    if args.callgrind:
        if shutil.which("valgrind") is None:
            print("\ncallgrind: skipped, valgrind is not on the PATH")
        else:
            n = args.messages if "--messages" in (argv or sys.argv) else 200
            print(f"\nCPU instructions per message (callgrind; children of {n} and {2 * n} messages, the difference / {n})")
            for v in versions:
                ins = {r: (v.instructions(r, 2 * n) - v.instructions(r, n)) / n for r in ROWS}
                results[v.name]["instructions"] = ins
                print(f"  {v.name:<28} none {ins['none']:>10,.0f}   memory {ins['memory']:>10,.0f}   "
                      f"none/memory {ins['none'] / ins['memory']:6.1%}")
            _ratios(results, versions, "instructions")
    print(f"\nTotal time {time.perf_counter() - started:.1f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
