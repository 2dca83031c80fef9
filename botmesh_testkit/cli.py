"""``botmesh-testkit``: the command line.

* ``botmesh-testkit run`` — the main job, run through pytest and the plugin: the
  durability conformance suite, the GUAR scenarios and the crash matrix against the
  embedded default backend (SQLite) or ``--backend NAME`` (repeatable), printing the
  plugin's summary of requirement ids held and broken and items passed/failed; exit
  status 1 when something failed, 2 on bad arguments. ``--cell ID`` reruns one cell (the
  command a failing cell prints); ``--junitxml PATH`` writes a JUnit report for CI;
  ``--report PATH`` the certification report (JSON, Markdown for ``.md``, HTML for ``.html``).
* ``botmesh-testkit points`` — the catalogue of crash points and the spec ids each one
  exercises.
* ``botmesh-testkit spec [ID...]`` — the requirements: with ids, the full text of each
  (exit status 2 naming the closest known ids for an id the spec does not define);
  without, every id with its one-line title, by section.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys


def _points(_: argparse.Namespace) -> int:
    from .crash.points import POINTS, spec_ids

    width = max(map(len, POINTS))
    print("Crash points (crash_before / crash_after / crash_at) and the spec ids they exercise:")
    for op in POINTS:
        print(f"  {op:<{width}}  {', '.join(spec_ids(op))}")
    return 0


def _spec(args: argparse.Namespace) -> int:
    from .requirements import requirements, suggest

    known = requirements()
    wanted = [i.upper() for i in args.ids]
    bad = [i for i in wanted if i not in known]
    if bad:
        for i in bad:
            close = suggest(i)
            hint = f" (closest: {', '.join(close)})" if close else ""
            print(f"botmesh-testkit spec: {i!r} is not a requirement id of the spec{hint}", file=sys.stderr)
        return 2
    if wanted:
        for i in wanted:
            req = known[i]
            print(f"{req.id} ({req.section})")
            print(f"  {req.text}")
        return 0
    section = None
    width = max(map(len, known))
    for req in known.values():
        if req.section != section:
            section = req.section
            print(f"{section}:")
        print(f"  {req.id:<{width}}  {req.title}")
    return 0


def _run(args: argparse.Namespace) -> int:
    """The main job, through pytest and the plugin: the conformance suite, the GUAR
    scenarios and the crash matrix against each backend, then the plugin's summary."""
    import tempfile
    from pathlib import Path

    import pytest

    from .backends.registry import BackendSpecError, resolve
    from .matrix.cells import Cell
    from .matrix.profiles import ProfileError, load_profile

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
    if args.cell:
        try:
            only = Cell.parse(args.cell)
        except ValueError as exc:
            print(f"botmesh-testkit: {exc}", file=sys.stderr)
            return 2
        backends = [only.backend]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"botmesh-testkit run: backend(s) {', '.join(backends)}; matrix {profile.name!r} ({profile.description}); "
          f"seed {seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="botmesh-run-") as tmp:
        # an empty configuration of our own: the caller's pytest.ini/pyproject (addopts,
        # filterwarnings=error ...) must not change what the job does
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")
        argv = ["-c", str(ini), "--rootdir", tmp, "-p", "no:cacheprovider", "-q", "--tb=short",
                *(f"--botmesh-backend={b}" for b in backends), f"--botmesh-matrix={args.matrix}",
                f"--botmesh-seed={seed}"]
        if args.cell:
            argv += [f"--botmesh-cell={args.cell}", "--botmesh-parts=matrix"]
        elif args.parts:
            argv.append(f"--botmesh-parts={args.parts}")
        if args.explore_examples is not None:
            argv.append(f"--botmesh-explore-examples={args.explore_examples}")
        for folder in args.scenarios or []:
            argv.append(f"--botmesh-scenarios={folder}")
        if args.junitxml:
            argv.append(f"--junitxml={args.junitxml}")
        if args.report:
            argv.append(f"--botmesh-report={Path(args.report).absolute()}")
        if args.jobs:
            argv += ["-n", str(args.jobs)]
        if args.require_services:
            argv.append("--botmesh-require-services")
        if args.quiet:
            argv.append("-q")
        argv.append(tmp)
        code = int(pytest.main(argv))
    if code == 0:
        return 0
    if code in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        print(f"Rerun with --seed {seed}; each failure above prints the command that reproduces it.")
        return 1
    return 2


def main(argv: list[str] | None = None) -> int:
    from .backends.registry import HARNESSES
    from .matrix.profiles import builtin_names

    parser = argparse.ArgumentParser(prog="botmesh-testkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the crash matrix against a backend and print a summary")
    run.add_argument("--backend", action="append", metavar="NAME",
                     help=f"backend to certify (repeatable; default sqlite): {', '.join(HARNESSES)}")
    run.add_argument("--matrix", default="smoke", metavar="PROFILE",
                     help=f"matrix profile: {', '.join(builtin_names())} or a path to a .toml file (default smoke)")
    run.add_argument("--seed", type=int, help="seed of the random cells (printed on every run)")
    run.add_argument("--cell", help="run one cell only: BACKEND/WORKLOAD/POLICY/WHEN:POINT#N")
    run.add_argument("--parts", metavar="LIST",
                     help="comma-separated parts: suite, scenarios, matrix, explore, kills, powercuts (default: all)")
    run.add_argument("--explore-examples", type=int, metavar="N",
                     help="generated stories per backend in the explore part (default: the profile's)")
    run.add_argument("--scenarios", action="append", metavar="DIR", help="also run the scenario files of DIR (repeatable)")
    run.add_argument("--junitxml", metavar="PATH", help="write a JUnit XML report (one test case per item)")
    run.add_argument("--report", metavar="PATH",
                     help="write the certification report: JSON, Markdown when PATH ends in .md, HTML when it "
                          "ends in .html")
    run.add_argument("-n", "--jobs", type=int, metavar="N", help="run on N processes (pytest-xdist)")
    run.add_argument("--require-services", action="store_true",
                     help="fail when a postgres/redis server cannot be provisioned instead of skipping")
    run.add_argument("-q", "--quiet", action="store_true", help="less output")
    run.set_defaults(fn=_run)
    points = sub.add_parser("points", help="list the crash points and the spec ids they exercise")
    points.set_defaults(fn=_points)
    spec = sub.add_parser("spec", help="print the requirements the ids name (all, or the ids given)")
    spec.add_argument("ids", nargs="*", metavar="ID", help="requirement ids, e.g. INB-8 GUAR-3")
    spec.set_defaults(fn=_spec)
    args = parser.parse_args(argv)
    # the engine's warnings (divergent replays, bypassed payloads) are expected inside a
    # crash matrix; a failing cell reports what matters
    # (restored afterwards: main() is also called in-process, by tests and by users' scripts)
    logger = logging.getLogger("botmesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return int(args.fn(args))
    finally:
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
