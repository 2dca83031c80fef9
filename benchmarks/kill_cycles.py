#!/usr/bin/env python3
"""Kill cycles per minute, and how long a SIGKILLed bot takes to come back.

For each backend (file with the append log, SQLite; optionally the snapshot-only file
backend) it runs a :class:`botmesh_testkit.kill.KillLoop` (``--kills`` SIGKILLs,
``2 x kills`` messages, a handler replying twice, ``on_ambiguous=skip``) and prints:

* **cycles/min** — kills / wall time of the kill phase x 60 (one cycle = start a child,
  redeliver what is unacknowledged, let it work until the seeded kill point, SIGKILL it,
  check with psutil that it is gone);
* **kill -> ready** — from the SIGKILL to the next child's "ready" (backend open, bot
  started: the first progress marker of the new process), median and p90;
* **kill -> recovered** — from the SIGKILL to the end of the next child's first sweep
  pass (every record the dead incarnation left is taken back and run again, LEASE-4,
  INB-3), median and p90, over the kills the next child outlived.

Baseline, measured in the same run with the same start method: a child started on a
fresh journal with no kill at all (start -> ready, start -> first sweep done), and a
clean restart (stop, start again on the journal the kill loop left). The verdict of
each loop (passed / violated ids) is printed too: a benchmark of a broken run is no
benchmark.

Usage::

    python benchmarks/kill_cycles.py [--kills 40] [--seed 1] [--start-method forkserver|spawn|both]
                                     [--backend file+log --backend sqlite --backend file]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from botmesh_testkit.kill import KillLoop, KillResult, Replicas, replies, spec_for

import _against


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def baseline(backend: str, workdir: str, start_method: str, repeat: int) -> dict[str, list[float]]:
    """Start -> ready and start -> first sweep for a fresh journal, ``repeat`` times."""
    ready: list[float] = []
    swept: list[float] = []
    for i in range(repeat):
        sub = os.path.join(workdir, f"fresh-{i}")
        os.makedirs(sub)
        with Replicas(spec_for(backend, sub), replies(1), workdir=sub, start_method=start_method) as r:
            inc = r.start("bot")
            r.wait_recovered("bot")
            ready.append(1000 * (inc.ready_at - inc.started))
            swept.append(1000 * (inc.swept_at - inc.started))
            r.stop("bot")
    return {"ready": ready, "swept": swept}


def clean_restart(backend: str, loop_dir: str, start_method: str, repeat: int) -> dict[str, list[float]]:
    """Stop and start again on the journal the kill loop left (no kill)."""
    ready: list[float] = []
    swept: list[float] = []
    spec = spec_for(backend, loop_dir)
    for i in range(repeat):
        sub = os.path.join(loop_dir, f"restart-{i}")
        os.makedirs(sub)
        with Replicas(spec, replies(1), workdir=sub, start_method=start_method) as r:
            inc = r.start("bot", instance_id="kill-1")
            r.wait_recovered("bot")
            ready.append(1000 * (inc.ready_at - inc.started))
            swept.append(1000 * (inc.swept_at - inc.started))
            r.stop("bot")
    return {"ready": ready, "swept": swept}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--backend", action="append", choices=["file+log", "sqlite", "file"])
    p.add_argument("--start-method", default="forkserver", choices=["forkserver", "spawn", "both"])
    p.add_argument("--repeat", type=int, default=5, help="baseline starts per backend")
    _against.add_options(p)
    args = p.parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    figures: dict[str, Any] = {}
    backends = args.backend or ["file+log", "sqlite"]
    methods = ["forkserver", "spawn"] if args.start_method == "both" else [args.start_method]
    root = tempfile.mkdtemp(prefix="botmesh-killbench-")
    t0 = time.monotonic()
    print("botmesh kill cycles")
    print("===================")
    print(f"date:     {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}")
    print(f"machine:  {platform.platform()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}")
    print(f"method:   {args.kills} SIGKILLs per loop, {2 * args.kills} messages, handler replies(2), "
          f"on_ambiguous=skip, seed {args.seed}; baseline {args.repeat} starts each")
    rows: list[tuple[str, str, KillResult, dict[str, list[float]], dict[str, list[float]]]] = []
    try:
        for method in methods:
            for backend in backends:
                work = os.path.join(root, f"{method}-{backend}")
                os.makedirs(work)
                base = baseline(backend, os.path.join(work, "baseline"), method, args.repeat)
                loop_dir = os.path.join(work, "loop")
                loop = KillLoop(spec_for(backend, loop_dir), replies(2), messages=2 * args.kills, kills=args.kills,
                                seed=args.seed, workdir=loop_dir, start_method=method)
                result = loop.run()
                restart = clean_restart(backend, loop_dir, method, args.repeat)
                rows.append((method, backend, result, base, restart))
                print(f"  ran {method:<10} {backend:<8} {len(result.kills)} kills in {result.kill_phase_seconds:.1f} s "
                      f"({'passed' if result.passed else 'FAILED ' + ','.join(sorted(result.violated_ids))})")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    head = (f"{'start':<10} {'backend':<8} {'kills':>5} {'cycles/min':>10} {'kill->ready':>16} "
            f"{'kill->recovered':>16} {'fresh start->ready':>18} {'->swept':>8} {'restart->ready':>14} "
            f"{'->swept':>8}  verdict")
    print(head)
    print("-" * len(head))
    for method, backend, result, base, restart in rows:
        ready, rec = result.ready_ms(), result.recovered_ms()
        cpm = 60.0 * len(result.kills) / result.kill_phase_seconds if result.kill_phase_seconds else float("nan")
        name = f"{method}/{backend}"
        figures[f"{name}: cycles/min"] = cpm
        figures[f"{name}: kill->ready ms"] = statistics.median(ready) if ready else None
        figures[f"{name}: kill->recovered ms"] = statistics.median(rec) if rec else None
        figures[f"{name}: fresh start->ready ms"] = statistics.median(base["ready"])
        figures[f"{name}: verdict"] = "passed" if result.passed else "FAILED"
        print(f"{method:<10} {backend:<8} {len(result.kills):>5} {cpm:>10.0f} "
              f"{statistics.median(ready):>7.0f} p90 {_pct(ready, 0.9):>4.0f} "
              f"{statistics.median(rec) if rec else float('nan'):>7.0f} p90 {_pct(rec, 0.9):>4.0f} "
              f"{statistics.median(base['ready']):>18.0f} {statistics.median(base['swept']):>8.0f} "
              f"{statistics.median(restart['ready']):>14.0f} {statistics.median(restart['swept']):>8.0f}  "
              f"{'passed' if result.passed else 'FAILED'}")
    print()
    print("Times in ms (median; p90 where shown). kill->ready: SIGKILL to the next child's 'ready' (backend open,")
    print("bot started). kill->recovered: SIGKILL to the end of the next child's first sweep (the dead")
    print("incarnation's records taken back and run). Baseline: a child on a fresh journal, and a clean")
    print("restart on the journal the loop left, no kill. cycles/min counts the kill phase only (not the")
    print("crash-free oracle run nor the final drain).")
    for method, backend, result, _, _ in rows:
        modes: dict[str, int] = {}
        for k in result.kills:
            modes[k.mode] = modes.get(k.mode, 0) + 1
        print(f"  {method}/{backend}: kill modes {modes}; deliveries {result.deliveries}, duplicates "
              f"{result.accounting.duplicate_count}, losses {result.accounting.loss_count}; total {result.seconds:.1f} s")
    print(f"Total time {time.monotonic() - t0:.1f} s.")
    _against.emit(args, figures)
    return 0 if all(r[2].passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
