"""``botmesh-testkit``: the command line.

* ``botmesh-testkit run`` — the main job, run through pytest and the plugin: the
  durability conformance suite, the GUAR scenarios and the crash matrix against the
  embedded default backend (SQLite) or ``--backend NAME`` (repeatable), printing the
  plugin's summary of requirement ids held and broken and items passed/failed; exit
  status 1 when something failed, 2 on bad arguments. ``--cell ID`` reruns one cell (the
  command a failing cell prints); ``--junitxml PATH`` writes a JUnit report for CI;
  ``--report PATH`` the certification report (JSON, Markdown for ``.md``, HTML for ``.html``).
* ``botmesh-testkit explore`` — the explore part alone (generated stories checked
  against a model, :mod:`botmesh_testkit.explore`), through pytest and the plugin as
  ``run`` is: per backend its headline (stories, steps, time), and for a failure the
  violation, the shrunk story, the scenario file it was written to and the command that
  replays it; exit status 0 when every backend's stories passed, 1 when one failed or
  could not be explored (its server could not be provisioned), 2 on bad arguments.
* ``botmesh-testkit points`` — the catalogue of crash points and the spec ids each one
  exercises.
* ``botmesh-testkit spec [ID...]`` — the requirements: with ids, the full text of each
  (exit status 2 naming the closest known ids for an id the spec does not define);
  without, every id with its one-line title, by section.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import random
import sys
from typing import Any, TextIO


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


def _count(minimum: int) -> Any:
    """An argparse type: a whole number >= ``minimum`` (argparse names the option the
    user typed in the error: abbreviations are off)."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{raw!r} must be >= {minimum}")
        return value

    return parse


def _seconds(raw: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{raw!r} must be a number of seconds > 0")
    return value


def _check_backends(backends: list[str]) -> bool:
    """Whether every ``--backend`` resolves (else the error, naming the option, is printed)."""
    import os

    from .backends.registry import BackendSpecError, resolve

    if any(":" in b for b in backends) and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # pkg.module:factory from the current folder, as the plugin does
    for b in backends:
        try:
            resolve(b)
        except BackendSpecError as exc:
            print(f"botmesh-testkit: --backend {exc}", file=sys.stderr)
            return False
    return True


def _check_run_args(args: argparse.Namespace) -> str | None:
    """What the plugin would refuse among ``run``'s arguments, said with the CLI's option
    names (``--report``, not the plugin's ``--botmesh-report``); None when all is well."""
    from pathlib import Path

    from .pytest.options import PARTS

    if args.parts:
        chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
        if not chosen or any(p not in PARTS for p in chosen):
            return f"--parts: {args.parts!r}: choose from {', '.join(PARTS)}"
    for folder in args.scenarios or []:
        if not Path(folder).is_dir():
            return f"--scenarios: {folder!r} is not a directory"
    if args.report:
        path = Path(args.report).expanduser().absolute()
        if path.is_dir():
            return f"--report: {args.report!r} is a directory; give a file path (.json, .md for Markdown, .html for HTML)"
        if not path.parent.is_dir():
            return f"--report: the directory of {args.report!r} ({str(path.parent)!r}) does not exist"
    return None


def _pytest_argv(tmp: str, backends: list[str], matrix: str, seed: int) -> list[str]:
    """The start of the inner pytest's arguments: an empty configuration of our own (the
    caller's pytest.ini/pyproject — addopts, filterwarnings=error ... — must not change
    what the job does), the backends, the profile, the seed."""
    from pathlib import Path

    ini = Path(tmp) / "pytest.ini"
    ini.write_text("[pytest]\n", encoding="utf-8")
    return ["-c", str(ini), "--rootdir", tmp, "-p", "no:cacheprovider", "-q", "--tb=short",
            *(f"--botmesh-backend={b}" for b in backends), f"--botmesh-matrix={matrix}", f"--botmesh-seed={seed}"]


def _run(args: argparse.Namespace) -> int:
    """The main job, through pytest and the plugin: the conformance suite, the GUAR
    scenarios and the crash matrix against each backend, then the plugin's summary."""
    import tempfile
    from pathlib import Path

    import pytest

    from .matrix.cells import Cell
    from .matrix.profiles import ProfileError, load_profile

    backends = args.backend or ["sqlite"]
    if not _check_backends(backends):
        return 2
    wrong = _check_run_args(args)
    if wrong is not None:
        print(f"botmesh-testkit: {wrong}", file=sys.stderr)
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
    coverage_file: Path | None = None
    if args.coverage:
        from .matrix.coverage_file import CoverageFileError, check_path

        try:
            coverage_file = check_path(args.coverage)
        except CoverageFileError as exc:
            print(f"botmesh-testkit: --coverage: {exc}", file=sys.stderr)
            return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"botmesh-testkit run: backend(s) {', '.join(backends)}; matrix {profile.name!r} ({profile.description}); "
          f"seed {seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="botmesh-run-") as tmp:
        argv = _pytest_argv(tmp, backends, args.matrix, seed)
        if args.cell:
            argv += [f"--botmesh-cell={args.cell}", "--botmesh-parts=matrix"]
        elif args.parts:
            argv.append(f"--botmesh-parts={args.parts}")
        if args.explore_examples is not None:
            argv.append(f"--botmesh-explore-examples={args.explore_examples}")
        if args.explore_seconds is not None:
            argv.append(f"--botmesh-explore-seconds={args.explore_seconds!r}")
        if args.item_timeout is not None:
            argv.append(f"--botmesh-item-timeout={args.item_timeout!r}")
        for folder in args.scenarios or []:
            argv.append(f"--botmesh-scenarios={folder}")
        if args.junitxml:
            argv.append(f"--junitxml={args.junitxml}")
        if args.report:
            argv.append(f"--botmesh-report={Path(args.report).absolute()}")
        if coverage_file is not None:
            argv.append(f"--botmesh-coverage={coverage_file}")
        if args.jobs:
            # xdist under -q prints "bringing up nodes..." twice and never the workers' line:
            # keep pytest's own verbosity there, without its header
            argv = [a for a in argv if a != "-q"] + ["--no-header", "-n", str(args.jobs)]
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


class _ExploreCollector:
    """A plugin of the inner pytest run of ``botmesh-testkit explore``: gathers each
    backend's explore outcome (the ``botmesh_explore`` record its item attaches), and
    prints it as soon as that backend is done — the run takes minutes, and pytest's own
    output goes to a buffer shown only when something else went wrong."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.outcomes: dict[str, str] = {}
        """Backend -> ``passed``, ``failed`` or ``skipped``."""
        self.problems: list[str] = []
        """What failed besides a story: collection errors, an item that crashed."""

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        if nodeid.startswith("botmesh-explore::"):
            self._say(f"exploring {nodeid.removeprefix('botmesh-explore::')} ...")

    def pytest_runtest_logreport(self, report: Any) -> None:
        props = dict(report.user_properties)
        # a server-skip item names its backend in its node id only (botmesh-services::NAME)
        backend = str(props.get("botmesh_backend", report.nodeid.partition("::")[2]))
        failed_setup = report.when == "setup" and report.outcome != "passed"
        if report.nodeid.startswith("botmesh-services::") and report.outcome == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.outcomes[backend] = "skipped"
            self._say(f"{backend}: NOT EXPLORED — {str(reason).removeprefix('Skipped: ')}")
            return
        if not report.nodeid.startswith("botmesh-explore::") or not (report.when == "call" or failed_setup):
            return
        record = props.get("botmesh_explore")
        self.outcomes[backend] = report.outcome
        if not isinstance(record, dict):  # the item did not get to run explore (a harness that raised ...)
            self._say(f"explore on {backend}: {report.outcome.upper()}")
            if report.outcome != "passed":
                self._say(report.longreprtext)
            return
        self._say(str(record["summary"]))
        for note in record.get("notes", []):
            self._say(f"  note: {note}")
        if "story" in record:
            self._say(f"  {record['violated']}")
            self._say(f"  the story ({record['shape']}):")
            for line in record["story_lines"]:
                self._say(f"    {line}")
            self._say(f"  story file: {record['story']}")
            self._say(f"  replay it: {record['replay']}")
            for other in record.get("also", []):
                self._say(f"  also found, another kind: {other['violated']}")
                self._say(f"    its story ({other['shape']}, {len(other['story_lines'])} steps): {other['story']}")
                self._say(f"    replay it: {other['replay']}")

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.problems.append(report.longreprtext)


def _explore(args: argparse.Namespace) -> int:
    """The explore part alone, through pytest and the plugin (as ``run``: the same
    backends, server provisioning and items), its outcome printed per backend."""
    import tempfile

    import pytest

    from .matrix.profiles import load_profile

    backends = args.backend or ["sqlite"]
    if not _check_backends(backends):
        return 2
    profile = load_profile("smoke")
    examples = args.examples if args.examples is not None else profile.explore_examples
    seconds = args.seconds if args.seconds is not None else profile.explore_seconds
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"botmesh-testkit explore: backend(s) {', '.join(backends)}; up to {examples} stories per backend, none "
          f"started after {seconds:g} s; seed {seed}", flush=True)
    collector = _ExploreCollector(sys.stdout)
    inner = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="botmesh-explore-") as tmp:
        argv = [*_pytest_argv(tmp, backends, "smoke", seed), "--botmesh-parts=explore",
                f"--botmesh-explore-examples={examples}", f"--botmesh-explore-seconds={seconds!r}"]
        if args.require_services:
            argv.append("--botmesh-require-services")
        argv.append(tmp)
        with contextlib.redirect_stdout(inner):
            code = int(pytest.main(argv, plugins=[collector]))
    for problem in collector.problems:
        print(problem)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or collector.problems:
        print(inner.getvalue(), end="")  # what pytest said: the cause is in there
        return 1 if code == pytest.ExitCode.TESTS_FAILED else 2
    missing = [b for b in backends if b not in collector.outcomes]
    for b in missing:
        print(f"{b}: NOT EXPLORED — no explore item ran for it")
    bad = [b for b in backends if collector.outcomes.get(b) != "passed"]
    if bad:
        rerun = " ".join([*(f"--backend {b}" for b in backends), f"--seed {seed}", f"--examples {examples}",
                          f"--seconds {seconds:g}"])
        print(f"explore FAILED on {', '.join(bad)}; rerun: botmesh-testkit explore {rerun}")
        return 1
    print(f"explore passed on {', '.join(backends)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .backends.registry import HARNESSES, SERVICE_BACKENDS
    from .matrix.profiles import builtin_names, load_profile

    smoke = load_profile("smoke")

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
                     help="comma-separated parts: suite, scenarios, matrix, explore, kills, powercuts, corruption (default: all)")
    run.add_argument("--explore-examples", type=_count(0), metavar="N",
                     help="generated stories per backend in the explore part (default: the profile's explore_examples)")
    run.add_argument("--explore-seconds", type=_seconds, metavar="S",
                     help="real seconds after which the explore part starts no new story, per backend (default: the "
                          "profile's explore_seconds)")
    run.add_argument("--item-timeout", type=_seconds, metavar="S",
                     help="real-time budget of one conformance-suite item (default: the profile's item_timeout, "
                          "120 s at smoke)")
    run.add_argument("--scenarios", action="append", metavar="DIR", help="also run the scenario files of DIR (repeatable)")
    run.add_argument("--junitxml", metavar="PATH", help="write a JUnit XML report (one test case per item)")
    run.add_argument("--report", metavar="PATH",
                     help="write the certification report: JSON, Markdown when PATH ends in .md, HTML when it "
                          "ends in .html")
    run.add_argument("--coverage", metavar="PATH",
                     help="write a coverage.py data file of the engine and the backend's own package, one context "
                          "per item (a crash cell's recovery: matrix:<cell id>); coverage html --data-file=PATH "
                          "--show-contexts shows which crash points ran each line")
    run.add_argument("-n", "--jobs", type=int, metavar="N", help="run on N processes (pytest-xdist)")
    run.add_argument("--require-services", action="store_true",
                     help="fail when a postgres/redis server cannot be provisioned instead of skipping")
    run.add_argument("-q", "--quiet", action="store_true", help="less output")
    run.set_defaults(fn=_run)
    exp = sub.add_parser(
        "explore", allow_abbrev=False,
        help="explore alone: generated stories against a model; a failure shrunk to a scenario file",
        description="Run the explore part alone: Hypothesis's stateful testing drives a bot on each backend through "
                    "generated stories (receives with drawn plans, redeliveries, channel faults, deaths at crash "
                    "points, restarts, virtual time), checking a model after every step. Prints per backend its "
                    "stories, steps and time; a failure is shrunk and written out as a scenario file, printed with "
                    "the command that replays it. Exit status 0 when every backend passed, 1 when one failed or "
                    "could not be explored, 2 on bad arguments. The defaults are the smoke profile's budget.")
    exp.add_argument("--backend", action="append", metavar="NAME",
                     help=f"backend to explore (repeatable; default sqlite): {', '.join([*HARNESSES, *SERVICE_BACKENDS])}, "
                          "a registered name, or pkg.module:factory (importable from the current directory or "
                          "PYTHONPATH)")
    exp.add_argument("--seed", type=int, help="seed of the stories (default: drawn, and printed)")
    exp.add_argument("--examples", type=_count(1), metavar="N",
                     help=f"stories per backend at most (default: the smoke profile's, {smoke.explore_examples})")
    exp.add_argument("--seconds", type=_seconds, metavar="S",
                     help="real seconds per backend after which no new story starts (default: the smoke profile's, "
                          f"{smoke.explore_seconds:g}; shrinking a failure may add up to a minute)")
    exp.add_argument("--require-services", action="store_true",
                     help="a postgres/redis server that cannot be provisioned is an error (exit status 2) rather "
                          "than a backend not explored (exit status 1)")
    exp.set_defaults(fn=_explore)
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
