#!/usr/bin/env python3
"""The engine's own cost per message, counted rather than timed: memory durability
beside no durability, in work that does not depend on the machine's load.

A message is the one of ``durable_throughput.py``: ``await provider.receive(chat, "hi",
id=unique)`` to a bot whose only handler does ``await ctx.reply("ok")`` (real clock,
sequential), after 10 untimed warm-up messages.

Two deterministic measures per row (``none`` = no durability, ``memory`` = ``durability={}``):

* **Python calls per message** (``--calls``, the default): ``cProfile``'s count of
  function calls (primitive and recursive; a coroutine's every resumption counts as a
  call) over ``--messages`` messages, divided by them; the warm-up is outside the profile.
* **CPU instructions per message** (``--callgrind``, needs ``valgrind`` on the PATH): the
  difference of the instructions ``valgrind --tool=callgrind`` counts in two whole
  processes, one doing ``--messages`` messages and one doing twice as many, divided by
  ``--messages``, so that start-up and import costs cancel out.

Both print memory / none, the figure the issue's target (memory durability at >= 25 % of
the no-durability rate) is about when the machine is too loaded to time it. A wall-clock
rate of both rows, alternating, best of ``--repeat``, is printed as well (``--wall``).

Usage::

    python benchmarks/engine_cost.py [--messages N] [--calls] [--callgrind] [--wall]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import platform
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from botmesh.core import Bot, MemoryStore
from botmesh.core.testing import MockProvider

WARMUP = 10
ROWS = ("none", "memory")


async def _run(row: str, messages: int, profile: cProfile.Profile | None = None) -> float:
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
        t0 = time.perf_counter()
        for i in range(messages):
            await provider.receive("chat-1", "hi", id=f"msg-{i}")
        elapsed = time.perf_counter() - t0
        if profile is not None:
            profile.disable()
    finally:
        await bot.stop()
    if len(provider.sent) != WARMUP + messages:
        raise RuntimeError(f"{row}: {len(provider.sent)} replies for {WARMUP + messages} messages")
    return elapsed


def calls_per_message(row: str, messages: int) -> float:
    profile = cProfile.Profile()
    asyncio.run(_run(row, messages, profile))
    stats = pstats.Stats(profile)
    return stats.total_calls / messages  # type: ignore[attr-defined]


def instructions(row: str, messages: int) -> int:
    with tempfile.TemporaryDirectory(prefix="botmesh-callgrind-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
             "--child", row, "--messages", str(messages)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        with open(out, encoding="utf-8") as f:
            for line in f:
                m = re.match(r"(?:summary|totals):\s+(\d+)", line)
                if m:
                    return int(m.group(1))
    raise RuntimeError("no instruction total in the callgrind output")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=500, help="counted messages (default 500)")
    p.add_argument("--calls", action="store_true", help="Python calls per message (cProfile)")
    p.add_argument("--callgrind", action="store_true", help="CPU instructions per message (valgrind)")
    p.add_argument("--wall", action="store_true", help="wall-clock msg/s, rows alternating, best of --repeat")
    p.add_argument("--repeat", type=int, default=5, help="repetitions of --wall (default 5)")
    p.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.messages < 1:
        p.error("--messages must be >= 1")
    if args.child:
        asyncio.run(_run(args.child, args.messages))
        return 0
    if not (args.calls or args.callgrind or args.wall):
        args.calls = True
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}")
    print(f"load:    {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    if args.wall:
        best = dict.fromkeys(ROWS, 0.0)
        for _ in range(args.repeat):
            for row in ROWS:
                best[row] = max(best[row], args.messages / asyncio.run(_run(row, args.messages)))
        print(f"wall msg/s (best of {args.repeat}, {args.messages} msgs): none {best['none']:,.0f}, "
              f"memory {best['memory']:,.0f}, memory/none {best['memory'] / best['none']:.1%}")
    if args.calls:
        c = {row: calls_per_message(row, args.messages) for row in ROWS}
        print(f"Python calls/msg (cProfile): none {c['none']:,.0f}, memory {c['memory']:,.0f}, "
              f"none/memory {c['none'] / c['memory']:.1%}")
    if args.callgrind:
        if shutil.which("valgrind") is None:
            print("callgrind: skipped, valgrind is not on the PATH")
        else:
            ins = {row: (instructions(row, 2 * args.messages) - instructions(row, args.messages)) / args.messages
                   for row in ROWS}
            print(f"instructions/msg (callgrind, {args.messages} vs {2 * args.messages} msgs): "
                  f"none {ins['none']:,.0f}, memory {ins['memory']:,.0f}, none/memory {ins['none'] / ins['memory']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
