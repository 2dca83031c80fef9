#!/usr/bin/env python3
"""The corruption part's cost per backend (issue 13: smoke must stay under ~30 s a backend).

For each backend, ``corruption_loop()`` (``botmesh_testkit.matrix.corruption``, the
function the plugin's corruption item calls) runs ``--variants`` damaged variants with
``--seed``, in this process, one backend after the other: wall seconds, variants/s, and
how the variants were handled. The baseline, measured in the same run on the same
backend: the undamaged image reopened and read ``--variants`` times (copy, open, read
the journals, close — everything a variant does but the damage and the judging), so
"x baseline" is what damaging and judging add.

    python benchmarks/corruption.py                      # file, file+log, sqlite; 40 variants
    python benchmarks/corruption.py --variants 200 --backend sqlite
    python benchmarks/corruption.py --variants 10 --against main   # beside main (benchmarks/_against.py)
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

from botmesh_testkit.backends.registry import resolve
from botmesh_testkit.checker.journal import read_journal
from botmesh_testkit.matrix.corruption import SCOPE, CorruptionRun, _image, _workload, corruption_loop

import _against


async def baseline(backend: str, variants: int, workdir: str) -> float:
    """Seconds to reopen the undamaged image ``variants`` times."""
    base = os.path.join(workdir, "image")
    os.makedirs(base)
    harness = resolve(backend)(base)
    try:
        await _workload(harness)
        image = _image(base)
    finally:
        await harness.close()
    started = time.perf_counter()
    for n in range(variants):
        copy = os.path.join(workdir, f"copy-{n}")
        os.makedirs(copy)
        for rel, data in image.items():
            with open(os.path.join(copy, rel), "wb") as f:
                f.write(data)
        h = resolve(backend)(copy)
        try:
            opened, _ = await h.open()
            await opened.start()
            await read_journal(opened, SCOPE)
        finally:
            await h.close()
        shutil.rmtree(copy)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", help="backend (repeatable; default file, file+log, sqlite)")
    parser.add_argument("--variants", type=int, default=40, help="damaged variants per backend (default 40, smoke)")
    parser.add_argument("--seed", type=int, default=1)
    _against.add_options(parser)
    args = parser.parse_args(argv)
    if args.variants < 1:
        parser.error(f"--variants must be >= 1, got {args.variants}")
    if args.against:
        return _against.compare(__file__, args, argv)
    figures: dict[str, Any] = {}
    backends = args.backend or ["file", "file+log", "sqlite"]
    print(f"{'backend':<10} {'variants':>8} {'seconds':>8} {'var/s':>7} {'baseline s':>10} {'x baseline':>10}  outcomes")
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="bench-corruption-") as tmp:
            base = asyncio.run(baseline(backend, args.variants, tmp))
        with tempfile.TemporaryDirectory(prefix="bench-corruption-") as tmp:
            started = time.perf_counter()
            run = asyncio.run(corruption_loop(backend, variants=args.variants, seed=args.seed, workdir=tmp))
            seconds = time.perf_counter() - started
        if not isinstance(run, CorruptionRun):
            print(f"{backend:<10} not applicable: {run}")
            figures[f"{backend}: variants/s"] = f"not applicable: {str(run)[:60]}"
            continue
        c = run.counts
        figures[f"{backend}: variants/s"] = len(run.variants) / seconds
        figures[f"{backend}: x baseline"] = seconds / base
        figures[f"{backend}: refused"] = c["refused"]
        print(f"{backend:<10} {len(run.variants):>8} {seconds:>8.2f} {len(run.variants) / seconds:>7.1f} {base:>10.2f} "
              f"{seconds / base:>10.2f}  refused {c['refused']}, intact {c['intact']}, torn {c['torn']}, "
              f"altered {c['altered']}, foreign {c['foreign']}")


    _against.emit(args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
