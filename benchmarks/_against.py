"""``--against REF`` for every benchmark: the same benchmark on another version of the code,
in the same run, alternating, with the ratio new/old of every figure.

REF is either

* a **git ref** of this repository (``main``, ``518b67f``, ``v0.1.0``, ``HEAD~3``): it is
  resolved to its commit and the tree of that commit is installed once in a venv of its
  own, cached in ``~/.cache/botmesh-testkit/against/<commit>/`` (``$BOTMESH_AGAINST_CACHE``
  overrides the folder); or
* an **installed older version**: a path to a Python interpreter, or to a venv (its
  ``bin/python``), in which ``botmesh`` and ``botmesh_testkit`` import. Nothing is installed.

How the venv of a git ref is made (measured on this machine: about 5 s once, then nothing):
``git archive <commit>`` into ``src/``, ``python -m venv --without-pip venv``, then
``pip --python venv/bin/python install --no-deps src`` (a plain, not editable, install:
the venv does not depend on where ``src`` is). The dependencies (pytest, Hypothesis,
psycopg, redis-py, ...) are not installed again: a ``.pth`` file adds the site-packages of
the interpreter running the benchmark *after* the venv's own, so the REF's ``botmesh`` and
``botmesh_testkit`` come first and the rest is shared (no network). Only when a
requirement of REF's ``pyproject.toml`` is not met by those packages (an older ref pinning
another version) is that requirement installed into the venv with pip's normal index.
Everything is built in ``<cache>/.build-<commit>-<random>/`` and renamed to
``<cache>/<commit>/`` when it imports, so a failed or interrupted build leaves nothing
that a later run would take for ready; a cached venv that no longer imports is rebuilt.

Which script runs for REF: **the current script file**, with the other interpreter. The
method (what is timed, how, with which options) is then the same for both versions and
only the code measured differs; the options of the current script always exist. The cost
is that a benchmark which needs something REF does not have cannot measure REF: before
running, the module-level ``from botmesh... import ...`` lines of the script are checked
in REF's interpreter, and what is missing is reported in one line, ``<script>: not in REF
<ref>: <what>``, exit status 0 (nothing to compare is a result, not an error); the same
line comes when REF's run fails on an ``ImportError``.

Alternation: ``--rounds N`` (default 2) rounds, each running the whole benchmark once per
version, current first (A B A B ...). Each run is a child process writing its figures (a
flat ``{name: number or text}``, the ``figures()`` of the script) to a temporary JSON file;
the table shows, per figure, the median over the rounds of each version and the ratio
new/old of the medians (``current / REF``: above 1 means the current code gives a larger
number, which is better for a rate and worse for a time; ``-`` where a figure is zero or
negative on a side, e.g. an overhead in %), and with several rounds the ratios per round.
``--json PATH`` writes all of it instead of the script's own JSON.

A REF that is neither a path nor a git ref, that does not install, or whose interpreter
does not import ``botmesh``: one error naming REF on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD_OPTION = "--against-figures"
DEPS_PTH = "_botmesh_against_deps.pth"


class AgainstError(Exception):
    """REF cannot be measured: not a ref, not an interpreter, or it does not install."""


def cache_root() -> str:
    """The folder of the cached venvs: ``$BOTMESH_AGAINST_CACHE``, else ``~/.cache/botmesh-testkit/against``."""
    env = os.environ.get("BOTMESH_AGAINST_CACHE")
    if env:
        return os.path.abspath(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "botmesh-testkit", "against")


@dataclass
class Version:
    """One side of the comparison: a label and the interpreter whose ``botmesh`` is measured."""

    label: str
    python: str
    detail: str = ""


def _git(*args: str, root: str = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def current() -> Version:
    """This checkout, with the interpreter running the benchmark."""
    head = _git("rev-parse", "--short", "HEAD").stdout.strip() or "?"
    dirty = _git("status", "--porcelain", "--", "reference_impl", "botmesh_testkit").stdout.strip()
    return Version(f"current ({head}{', modified' if dirty else ''})", sys.executable, ROOT)


_PROBE = """
import json, sys
import botmesh, botmesh_testkit
print(json.dumps({"botmesh": botmesh.__file__, "botmesh_testkit": botmesh_testkit.__file__,
                  "python": sys.version.split()[0]}))
"""


def _probe(python: str) -> dict[str, str] | str:
    """What ``python`` imports as botmesh/botmesh_testkit, or why it cannot."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                             timeout=120)
    except OSError as exc:
        return f"cannot run {python}: {exc}"
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return f"{python} cannot import botmesh and botmesh_testkit: {lines[-1] if lines else 'exit ' + str(out.returncode)}"
    result: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _interpreter(path: str) -> str:
    if os.path.isdir(path):
        for candidate in (os.path.join(path, "bin", "python"), os.path.join(path, "Scripts", "python.exe")):
            if os.path.exists(candidate):
                return os.path.abspath(candidate)
        raise AgainstError(f"--against {path}: a folder but not a venv (no bin/python in it)")
    return os.path.abspath(path)


def prepare(ref: str, *, cache: str | None = None, log: Any = None, root: str = ROOT) -> Version:
    """The version REF names, installed and importable; :class:`AgainstError` naming REF if not.

    ``root``: the git repository a ref is looked up in (this checkout; tests pass another).
    """
    if os.path.exists(ref):
        python = _interpreter(ref)
        probe = _probe(python)
        if isinstance(probe, str):
            raise AgainstError(f"--against {ref}: {probe}")
        return Version(f"{ref}", python, f"botmesh from {os.path.dirname(probe['botmesh'])}")
    resolved = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", root=root)
    if resolved.returncode != 0 or not resolved.stdout.strip():
        raise AgainstError(f"--against {ref}: neither an existing path (interpreter or venv) nor a git ref of {root}")
    commit = resolved.stdout.strip()
    try:
        python = ensure_venv(commit, cache=cache or cache_root(), log=log, root=root)
    except AgainstError as exc:
        raise AgainstError(f"--against {ref} ({commit[:7]}): {exc}") from None
    return Version(f"{ref} ({commit[:7]})", python, f"venv {os.path.dirname(os.path.dirname(python))}")


def _venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _unmet_requirements(python: str) -> list[str]:
    """REF's requirements (base and the server/FUSE extras) that the shared packages do not meet."""
    code = """
import importlib.metadata as md, json
from packaging.requirements import Requirement
dist = md.distribution("botmesh-testkit")
unmet = []
for text in dist.requires or []:
    req = Requirement(text)
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", "postgres", "redis", "powercuts")):
        continue
    if req.name.replace("_", "-").lower() == "botmesh-testkit":
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        unmet.append(str(req)); continue
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        unmet.append(str(req))
print(json.dumps(unmet))
"""
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        return []  # no packaging module: nothing to check with; the import probe still decides
    unmet: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return unmet


def ensure_venv(commit: str, *, cache: str, log: Any = None, root: str = ROOT) -> str:
    """The interpreter of the cached venv of ``commit``, built first if needed (see the module doc)."""
    final = os.path.join(cache, commit)
    python = _venv_python(os.path.join(final, "venv"))
    if os.path.isdir(final):
        if not isinstance(_probe(python), str):
            return python
        stale = os.path.join(cache, f".stale-{commit}-{uuid.uuid4().hex[:8]}")
        os.rename(final, stale)  # out of the way first, so that no one takes it for ready
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(cache, exist_ok=True)
    build = os.path.join(cache, f".build-{commit}-{uuid.uuid4().hex[:8]}")
    os.makedirs(build)
    started = time.perf_counter()
    try:
        src = os.path.join(build, "src")
        os.makedirs(src)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=root, capture_output=True)
        if archive.returncode != 0:
            raise AgainstError(f"git archive {commit} failed: {archive.stderr.decode(errors='replace').strip()}")
        untar = subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, capture_output=True)
        if untar.returncode != 0:
            raise AgainstError(f"unpacking {commit} failed: {untar.stderr.decode(errors='replace').strip()}")
        venv = os.path.join(build, "venv")
        _run([sys.executable, "-m", "venv", "--without-pip", venv], "python -m venv")
        purelib = subprocess.run([_venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(purelib, DEPS_PTH), "w", encoding="utf-8") as f:
            f.write(sysconfig.get_path("purelib") + "\n")
        _run([sys.executable, "-m", "pip", "--python", _venv_python(venv), "install", "--quiet", "--no-deps",
              "--disable-pip-version-check", src], "pip install --no-deps")
        unmet = _unmet_requirements(_venv_python(venv))
        if unmet:
            _run([sys.executable, "-m", "pip", "--python", _venv_python(venv), "install", "--quiet",
                  "--disable-pip-version-check", *unmet], f"pip install {' '.join(unmet)}")
        probe = _probe(_venv_python(venv))
        if isinstance(probe, str):
            raise AgainstError(f"installed, but {probe}")
        if not probe["botmesh"].startswith(os.path.realpath(venv)) and not probe["botmesh"].startswith(venv):
            raise AgainstError(f"installed, but botmesh comes from {probe['botmesh']}, not from the venv")
        with open(os.path.join(build, "against.json"), "w", encoding="utf-8") as f:
            json.dump({"commit": commit, "deps": sysconfig.get_path("purelib"), "python": sys.version.split()[0],
                       "seconds": round(time.perf_counter() - started, 1)}, f, indent=2)
        try:
            os.rename(build, final)
        except OSError:
            if not os.path.isdir(final):  # not someone else's finished build: a real failure
                raise
            shutil.rmtree(build, ignore_errors=True)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    if log is not None:
        print(f"installed {commit[:7]} in {final} ({time.perf_counter() - started:.1f} s)", file=log)
    return python


def _run(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        tail = [line for line in (out.stderr + out.stdout).strip().splitlines() if "is ignored" not in line][-8:]
        raise AgainstError(f"{what} failed (exit {out.returncode}): " + " | ".join(tail))


# -- what a script needs from the code ---------------------------------------------------------
def script_imports(script: str) -> list[tuple[str, list[str]]]:
    """The module-level ``import botmesh...`` / ``from botmesh... import names`` of ``script``."""
    with open(script, encoding="utf-8") as f:
        tree = ast.parse(f.read(), script)
    found: list[tuple[str, list[str]]] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("botmesh", "botmesh_testkit"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names if a.name.split(".")[0] in ("botmesh", "botmesh_testkit"))
    return found


_MISSING = """
import importlib, json, sys
missing = []
for module, names in json.loads(sys.argv[1]):
    try:
        m = importlib.import_module(module)
    except ImportError as exc:
        missing.append(f"{module} ({type(exc).__name__}: {exc})"); continue
    for name in names:
        if hasattr(m, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{module}.{name}")
print(json.dumps(missing))
"""


def missing_in(python: str, needs: list[tuple[str, list[str]]]) -> list[str]:
    """Which of ``needs`` (module, names) the code of ``python`` lacks."""
    out = subprocess.run([python, "-c", _MISSING, json.dumps(needs)], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return [f"probe failed: {lines[-1] if lines else out.returncode}"]
    result: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the options and the child side -------------------------------------------------------------
def add_options(parser: argparse.ArgumentParser, *, rounds: int = 2) -> None:
    """``--against REF``, ``--rounds N`` and the hidden option a child writes its figures with.

    Abbreviated options are switched off on ``parser`` so that the parent can drop exactly
    these options from the command line it hands its children.
    """
    parser.allow_abbrev = False
    group = parser.add_argument_group("side by side (benchmarks/_against.py)")
    group.add_argument("--against", metavar="REF",
                       help="also run this benchmark on REF (a git ref, or a venv / python of an installed version), "
                            "alternating, and print each figure of both with the ratio new/old")
    group.add_argument("--rounds", type=int, default=rounds, metavar="N",
                       help=f"with --against: runs per version, alternating current, REF, current, ... (default {rounds})")
    parser.add_argument(CHILD_OPTION, metavar="PATH", help=argparse.SUPPRESS)


def emit(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """In a child of ``--against``: write ``figures`` where the parent reads them."""
    path = getattr(args, CHILD_OPTION.lstrip("-").replace("-", "_"), None)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)


def child_argv(argv: list[str], drop: tuple[str, ...] = ("--against", "--rounds", "--json")) -> list[str]:
    """``argv`` without the options in ``drop`` (each with its one value)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token in drop:
            skip = True
            continue
        if any(token.startswith(name + "=") for name in drop):
            continue
        out.append(token)
    return out


# -- the parent ----------------------------------------------------------------------------------
@dataclass
class Run:
    version: Version
    round: int
    seconds: float
    code: int
    figures: dict[str, Any] | None
    tail: str = ""
    not_in_ref: str | None = None
    notes: list[str] = field(default_factory=list)


def _run_child(version: Version, script: str, argv: list[str], round_: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="botmesh-against-") as tmp:
        path = os.path.join(tmp, "figures.json")
        env = dict(os.environ)
        if version.python != sys.executable:
            env.pop("PYTHONPATH", None)  # nothing of this checkout ahead of the other version's code
        started = time.perf_counter()
        out = subprocess.run([version.python, script, *argv, CHILD_OPTION, path], capture_output=True, text=True,
                             env=env)
        seconds = time.perf_counter() - started
        figures = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                figures = json.load(f)
    lines = (out.stderr or out.stdout).strip().splitlines()
    run = Run(version, round_, seconds, out.returncode, figures, "\n".join(lines[-15:]))
    if figures is None and lines and lines[-1].startswith(("ImportError", "ModuleNotFoundError")):
        run.not_in_ref = lines[-1]
    return run


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    a = abs(value)
    if a >= 100:
        return f"{value:,.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _median(values: list[Any]) -> Any:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if nums:
        return statistics.median(nums)
    texts = [v for v in values if v is not None]
    return texts[-1] if texts else None


def _ratio(new: Any, old: Any) -> float | None:
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (new, old)):
        return None
    if old <= 0 or new < 0:
        return None  # a ratio of a signed figure (an overhead of -3 %) or of zero says nothing
    return float(new) / float(old)


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def compare(script: str, args: argparse.Namespace, argv: list[str] | None = None, *,
            needs: list[tuple[str, list[str]]] | None = None, out: Any = None) -> int:
    """Run ``script`` on this checkout and on ``args.against``, alternating; print the figures side by side.

    ``argv`` is the command line of the parent (default ``sys.argv[1:]``); the children get
    it without ``--against``, ``--rounds`` and ``--json``. ``needs`` (default: the
    module-level botmesh imports of ``script``) is what REF must have for the script to run.
    """
    out = out or sys.stdout
    name = os.path.basename(script)
    ref = args.against
    if args.rounds < 1:
        print(f"{name}: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    try:
        other = prepare(ref, log=out)
    except AgainstError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    me = current()
    missing = missing_in(other.python, script_imports(script) if needs is None else needs)
    if missing:
        print(f"{name}: not in REF {ref}: {', '.join(missing)}", file=out)
        return 0
    child = child_argv(list(sys.argv[1:] if argv is None else argv))
    print(f"{name} side by side: {me.label} vs {other.label}", file=out)
    print(f"  current: {me.python} ({me.detail})", file=out)
    print(f"  REF:     {other.python} ({other.detail})", file=out)
    print(f"  {args.rounds} round(s), alternating current, REF; the same script ({script}) for both; "
          f"options: {' '.join(child) or '(defaults)'}", file=out, flush=True)
    runs: dict[str, list[Run]] = {me.label: [], other.label: []}
    for r in range(1, args.rounds + 1):
        for v in (me, other):
            run = _run_child(v, script, child, r)
            runs[v.label].append(run)
            state = "ok" if run.figures is not None and run.code == 0 else (
                f"exit {run.code}" + ("" if run.figures is not None else ", no figures"))
            print(f"  round {r}: {v.label:<28} {run.seconds:7.1f} s  {state}", file=out, flush=True)
            if run.figures is None:
                if v is other and run.not_in_ref:
                    print(f"{name}: not in REF {ref}: {run.not_in_ref}", file=out)
                    return 0
                print(f"{name}: the run on {v.label} failed (exit {run.code}):\n{run.tail}", file=sys.stderr)
                return 1
    keys: list[str] = []
    for label in runs:
        for run in runs[label]:
            for k in run.figures or {}:
                if k not in keys:
                    keys.append(k)
    rows: list[list[str]] = []
    result: dict[str, Any] = {"script": name, "ref": ref, "current": me.label, "other": other.label,
                              "rounds": args.rounds, "options": child, "figures": {}}
    for k in keys:
        new_all = [(run.figures or {}).get(k) for run in runs[me.label]]
        old_all = [(run.figures or {}).get(k) for run in runs[other.label]]
        new, old = _median(new_all), _median(old_all)
        ratio = _ratio(new, old)
        per_round = [_ratio(a, b) for a, b in zip(new_all, old_all, strict=True)]
        row = [k, _fmt(new), _fmt(old) if k in (runs[other.label][0].figures or {}) else "not in REF",
               "-" if ratio is None else f"{ratio:.2f}"]
        if args.rounds > 1:
            row.append(" ".join("-" if x is None else f"{x:.2f}" for x in per_round))
        rows.append(row)
        result["figures"][k] = {"current": new_all, "ref": old_all, "ratio_of_medians": ratio}
    headers = ["figure", "current", "REF", "new/old"] + (["new/old per round"] if args.rounds > 1 else [])
    print(file=out)
    print(f"{me.label} vs {other.label}" + (f", medians of {args.rounds} rounds" if args.rounds > 1 else ""), file=out)
    print(table(rows, headers), file=out)
    print("new/old = current / REF (above 1: a larger number now; better for a rate, worse for a time).", file=out)
    json_path = getattr(args, "json", None)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"JSON written to {json_path}", file=out)
    failed = [f"{run.version.label} round {run.round} exit {run.code}" for rs in runs.values() for run in rs if run.code]
    if failed:
        print(f"note: some runs exited non-zero (their figures are shown): {', '.join(failed)}", file=out)
    return 0
