#!/usr/bin/env python3
"""What the held-operation sweep costs per point, beside the power-cut loop's cost per cut.

For each backend (default ``file``, ``file+log``, ``sqlite``), in the same run:

* **held-operation sweep** — :func:`botmesh_testkit.kill.held.held_op_sweep` with
  ``--points`` points (each: a fresh workload of 3 messages on the mount, the bot killed
  inside its n-th write/truncate/rename, a process death or a power cut, a new process
  that drains, the judge), plus its one-off census and SQLite oracle;
* **baseline: power-cut loop** — :func:`botmesh_testkit.kill.powercut.power_cut_loop`
  with as many cuts (the loop the ``powercuts`` part already ran, ``kill_messages`` 20).

Printed: seconds in all and per point / per cut, and whether each passed (a failure is
printed too: a benchmark on a broken backend measures nothing). The smoke profile's
``held_ops = 24`` costs about 24 x the per-point figure plus the one-off part.

Needs ``/dev/fuse``, libfuse 3 and the ``powercuts`` extra; prints the reason and exits
2 when the machine cannot mount. Everything lives in ``tempfile`` directories.

Usage::

    python benchmarks/held_ops.py [--points 12] [--backend file+log ...] [--seed 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from botmesh_testkit.crash.fs import mount_refused_reason
from botmesh_testkit.kill.held import held_op_sweep
from botmesh_testkit.kill.powercut import power_cut_loop

import _against


def _one(backend: str, points: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="botmesh-bench-held-") as tmp:
        t = time.perf_counter()
        sweep = held_op_sweep(backend, points=points, seed=seed, policy="skip", workdir=os.path.join(tmp, "held"))
        held_s = time.perf_counter() - t
        t = time.perf_counter()
        loop = power_cut_loop(backend, cuts=points, messages=20, seed=seed, policy="skip",
                              workdir=os.path.join(tmp, "loop"))
        loop_s = time.perf_counter() - t
    if isinstance(sweep, str) or isinstance(loop, str):
        return {"skipped": sweep if isinstance(sweep, str) else loop}
    held = sum(1 for p in sweep.points if p.held is not None)
    return {
        "held_s": held_s, "held_points": held, "operations": sweep.operations, "held_passed": sweep.passed,
        "held_per_point_s": held_s / max(1, held), "loop_s": loop_s, "cuts": len(loop.cuts),
        "loop_passed": loop.passed, "loop_per_cut_s": loop_s / max(1, len(loop.cuts)),
    }


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: per backend seconds per held point and per cut."""
    out: dict[str, Any] = {}
    for backend, r in result["backends"].items():
        if "skipped" in r:
            out[f"{backend}: s/point"] = f"skipped: {str(r['skipped'])[:60]}"
            continue
        out[f"{backend}: sweep s/point"] = r["held_per_point_s"]
        out[f"{backend}: sweep points"] = r["held_points"]
        out[f"{backend}: power-cut loop s/cut"] = r["loop_per_cut_s"]
        out[f"{backend}: passed"] = "yes" if r["held_passed"] and r["loop_passed"] else "FAILED"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=12)
    parser.add_argument("--backend", action="append")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    _against.add_options(parser)
    args = parser.parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    logging.getLogger("botmesh").setLevel(logging.ERROR)  # lock take-overs after every kill: expected
    reason = mount_refused_reason()
    if reason is not None:
        print(f"cannot mount the power-cut file system: {reason}", file=sys.stderr)
        return 2
    backends = args.backend or ["file", "file+log", "sqlite"]
    began = time.perf_counter()
    load = os.getloadavg()[0]
    result: dict[str, Any] = {"machine": f"{platform.platform()}, {os.cpu_count()} CPUs, CPython "
                                         f"{platform.python_version()}", "load_before": load, "backends": {}}
    for backend in backends:
        result["backends"][backend] = _one(backend, args.points, args.seed)
    result["load_after"] = os.getloadavg()[0]
    result["total_s"] = time.perf_counter() - began

    print("botmesh held-operation sweep")
    print("============================")
    print(f"machine: {result['machine']}; load average {load:.1f} before, {result['load_after']:.1f} after")
    print(f"{'backend':<10} {'sweep':>8} {'points':>7} {'s/point':>8} {'ops':>5}   "
          f"{'baseline: power-cut loop':>24} {'cuts':>5} {'s/cut':>6}")
    ok = True
    for backend, r in result["backends"].items():
        if "skipped" in r:
            print(f"{backend:<10} skipped: {r['skipped']}")
            continue
        ok = ok and r["held_passed"] and r["loop_passed"]
        print(f"{backend:<10} {r['held_s']:>7.1f}s {r['held_points']:>7} {r['held_per_point_s']:>8.2f} "
              f"{r['operations']:>5}   {r['loop_s']:>23.1f}s {r['cuts']:>5} {r['loop_per_cut_s']:>6.2f}"
              + ("" if r["held_passed"] and r["loop_passed"] else "   FAILED (the figures measure a failing run)"))
    print(f"(ops: the write/truncate/rename operations of the sweep's workload; total {result['total_s']:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    _against.emit(args, figures(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
