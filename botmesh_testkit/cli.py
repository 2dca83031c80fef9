"""``botmesh-testkit``: the command line.

* ``botmesh-testkit run`` — the main job: the crash matrix against the embedded default
  backend (SQLite) or ``--backend NAME`` (repeatable), printing a summary of cells and
  guarantees; exit status 1 when a cell failed. ``--cell ID`` reruns one cell (the
  command a failing cell prints).
* ``botmesh-testkit points`` — the catalogue of crash points and the spec ids each one
  exercises.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections import defaultdict

from botmesh.core.backend import WRITE_OPS

from .backends import HARNESSES, BackendSpecError, resolve
from .crash import PROVIDER_SEND
from .matrix import Cell, MatrixResult, Outcome, run_matrix_sync
from .profiles import ProfileError, builtin_names, load_profile
from .workloads import WORKLOADS

POINT_SPEC: dict[str, tuple[str, ...]] = {
    "inbox.journal": ("INB-1", "INB-4", "INB-8", "GUAR-1", "GUAR-2"),
    "inbox.claim": ("INB-3", "INB-7", "LEASE-2", "LEASE-4", "GUAR-7"),
    "inbox.heartbeat": ("LEASE-1", "REPL-3"),
    "inbox.complete": ("INB-2", "GUAR-4", "LEASE-2"),
    "inbox.retry_later": ("INB-5", "RETRY-1"),
    "inbox.kill": ("INB-5", "INB-7", "GUAR-7", "OPS-1"),
    "inbox.replay": ("OPS-2",),
    "inbox.purge": ("OPS-3",),
    "outbox.journal": ("OUT-1", "OUT-3", "OUT-10", "OUT-12", "GUAR-2"),
    "outbox.claim": ("OUT-7", "OUT-14", "LEASE-2", "LEASE-4"),
    "outbox.heartbeat": ("LEASE-1",),
    "outbox.mark_sent": ("OUT-1", "OUT-2", "GUAR-3", "GUAR-4"),
    "outbox.mark_failed": ("OUT-7", "OUT-9", "RETRY-1"),
    "outbox.mark_dead": ("OUT-7", "OUT-8", "OUT-12", "OPS-1"),
    "outbox.mark_unknown": ("OUT-14", "GUAR-3"),
    "outbox.split": ("OUT-12", "OUT-13"),
    "outbox.retry": ("OPS-2",),
    "outbox.discard": ("OPS-2",),
    "outbox.purge": ("OPS-3",),
    PROVIDER_SEND: ("OUT-1", "OUT-6", "OUT-14", "GUAR-3"),
}
"""The spec ids each crash point exercises."""


def _points(_: argparse.Namespace) -> int:
    width = max(map(len, POINT_SPEC))
    print("Crash points (crash_before / crash_after / crash_at) and the spec ids they exercise:")
    for op in [*WRITE_OPS, PROVIDER_SEND]:
        print(f"  {op:<{width}}  {', '.join(POINT_SPEC.get(op, ()))}")
    return 0


def summarize(result: MatrixResult, backends: list[str], profile_line: str) -> str:
    lines = [profile_line, ""]
    lines.append(f"{'backend':<10} {'cells':>6} {'passed':>7} {'failed':>7} {'crashed':>8} {'time':>8}")
    by_backend: dict[str, list[Outcome]] = defaultdict(list)
    for o in result.outcomes:
        by_backend[o.cell.backend].append(o)
    for b in backends:
        outs = by_backend.get(b, [])
        failed = sum(not o.passed for o in outs)
        crashed = sum(o.crashed for o in outs)
        secs = sum(o.seconds for o in outs)
        lines.append(f"{b:<10} {len(outs):>6} {len(outs) - failed:>7} {failed:>7} {crashed:>8} {secs:>7.1f}s")
    exercised: dict[str, int] = defaultdict(int)
    broken: dict[str, int] = defaultdict(int)
    for o in result.outcomes:
        ids = set(WORKLOADS[o.cell.workload].spec_ids)
        if o.crash_point:
            ids.update(POINT_SPEC.get(o.crash_point.split(" ")[1], ()))
        for v in o.violations:
            ids.update(v.ids)
            for i in v.ids:
                broken[i] += 1
        for i in ids:
            exercised[i] += 1
    lines.append("")
    lines.append("Guarantees exercised (cells) and held:")
    for i in sorted(exercised, key=lambda s: (s.split("-")[0], int(s.split("-")[1]))):
        state = f"BROKEN in {broken[i]} cell(s)" if broken[i] else "held"
        lines.append(f"  {i:<9} {exercised[i]:>5} cells  {state}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    backends = args.backend or ["sqlite"]
    for b in backends:
        try:
            resolve(b)
        except BackendSpecError as exc:
            print(f"botmesh-testkit: --backend {exc}", file=sys.stderr)
            return 2
    try:
        profile = load_profile(args.matrix)
    except ProfileError as exc:
        print(f"botmesh-testkit: --matrix: {exc}", file=sys.stderr)
        return 2
    only = None
    if args.cell:
        try:
            only = Cell.parse(args.cell)
        except ValueError as exc:
            print(f"botmesh-testkit: {exc}", file=sys.stderr)
            return 2
        backends = [only.backend]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    head = (f"botmesh-testkit run: backend(s) {', '.join(backends)}; matrix {profile.name!r} ({profile.description}); "
            f"seed {seed}")
    print(head, flush=True)

    def progress(o: Outcome) -> None:
        if not o.passed:
            print(o.report(seed), flush=True)
        elif not args.quiet:
            print(".", end="", flush=True)

    result = run_matrix_sync(
        backends,
        [only.workload] if only else list(profile.workloads),
        policies=profile.policies,
        random_per_workload=profile.random_per_workload,
        seed=seed,
        only=only,
        progress=progress,
    )
    print()
    print(summarize(result, backends, f"Summary (seed {seed}, {result.seconds:.1f}s):"))
    failed = len(result.failed)
    print()
    print(f"{len(result.outcomes) - failed} passed, {failed} failed")
    if failed:
        print(f"Rerun one failing cell with the command printed under it; rerun all with --seed {seed}.")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="botmesh-testkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the crash matrix against a backend and print a summary")
    run.add_argument("--backend", action="append", metavar="NAME",
                     help=f"backend to certify (repeatable; default sqlite): {', '.join(HARNESSES)}")
    run.add_argument("--matrix", default="smoke", metavar="PROFILE",
                     help=f"matrix profile: {', '.join(builtin_names())} or a path to a .toml file (default smoke)")
    run.add_argument("--seed", type=int, help="seed of the random cells (printed on every run)")
    run.add_argument("--cell", help="run one cell only: BACKEND/WORKLOAD/POLICY/WHEN:POINT#N")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress dots")
    run.set_defaults(fn=_run)
    points = sub.add_parser("points", help="list the crash points and the spec ids they exercise")
    points.set_defaults(fn=_points)
    args = parser.parse_args(argv)
    # the engine's warnings (divergent replays, bypassed payloads) are expected inside a
    # crash matrix; a failing cell reports what matters
    logging.getLogger("botmesh").setLevel(logging.ERROR)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
