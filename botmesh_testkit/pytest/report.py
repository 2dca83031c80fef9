"""The certification report: what a run of the plugin established, as a file one can
publish (``--botmesh-report=PATH``, ini ``botmesh_report``, ``botmesh-testkit run
--report PATH``).

It is built on the controller after the session from what the plugin gathered from the
test reports (so it is complete under pytest-xdist): per backend, the capabilities it
claims, the items passed/failed/skipped per part, the requirement ids held and broken
(the rule of the terminal summary), the skip reasons with their counts, the kill-loop
summaries and a verdict; for the run, the seed, the matrix profile, the parts, the date
(UTC), the versions of what was involved and the command line (passwords of URLs
redacted). ``PATH`` ending in ``.md`` gives a Markdown document; anything else, JSON.

A backend is **certified** when at least one of its items ran, none failed, its server
was provisioned (no service skip) and the run was not interrupted. Skips of tests that
need a capability the backend does not claim do not prevent it: the report lists the
claims beside the verdict, and the skips with their reasons.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import platform
import re
import shlex
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from . import options
from .options import PARTS, matrix_name, selected
from .session import BotmeshSession, held_and_broken

FORMAT = "botmesh-certification-report/1"
CERTIFIED = "certified"
NOT_CERTIFIED = "not certified"
PROBE_TIMEOUT = 30.0
"""Seconds allowed to open a backend for its claims, or to ask a server its version."""

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


# --------------------------------------------------------------------------------------
# pieces
# --------------------------------------------------------------------------------------
def redact_argv(argv: Iterable[str]) -> list[str]:
    """``argv`` with the password of every URL in it replaced by ``***``."""
    from ..servers import redact_url

    return [_URL.sub(lambda m: redact_url(m.group(0)), str(arg)) for arg in argv]


def _command(argv: list[str]) -> str:
    """A readable command line: ``python -m pytest`` for pytest's ``__main__``."""
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "pytest":
        return shlex.join(["python", "-m", "pytest", *argv[1:]])
    return shlex.join(argv)


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def run_versions(config: pytest.Config | None = None) -> dict[str, str]:
    """botmesh-testkit, Python, pytest and the platform (and pytest-xdist under ``-n``)."""
    found = {"botmesh-testkit": _dist_version("botmesh-testkit") or "unknown",
             "python": platform.python_version(),
             "pytest": pytest.__version__,
             "platform": platform.platform()}
    xdist = _dist_version("pytest-xdist")
    if xdist and config is not None and getattr(config.option, "numprocesses", None):
        found["pytest-xdist"] = xdist
    return found


def _guard(fn: Any, *args: Any) -> str:
    try:
        return str(fn(*args))
    except Exception as exc:  # a version we could not learn is reported, not fatal
        return f"unknown ({type(exc).__name__}: {exc})"


def backend_versions(name: str, harness: Any = None) -> dict[str, str]:
    """What provides the backend: the distribution of ``pkg`` for ``pkg.module:factory``
    or of an entry point; the driver (and, when it answers quickly, the server) for
    ``postgres`` and ``redis``."""
    from importlib.metadata import packages_distributions

    from ..backends.registry import ENTRY_POINT_GROUP, HARNESSES, REGISTRY, SERVICE_BACKENDS, entry_point_backends

    found: dict[str, str] = {}
    if name in SERVICE_BACKENDS:
        driver = "psycopg" if name == "postgres" else "redis"
        found[driver] = _dist_version(driver) or "not installed"
        url = getattr(harness, "url", None)
        if url:
            found[f"{name} server"] = _guard(_server_version, name, url)
        return found
    if name in HARNESSES:
        found["built in"] = f"botmesh-testkit {_dist_version('botmesh-testkit') or 'unknown'}"
        return found
    if REGISTRY.get(name) is not None:
        found["registered"] = "by a pytest_botmesh_register_backends hook (conftest.py or plugin)"
        return found
    if ":" in name:
        package = name.partition(":")[0].split(".")[0]
        try:
            dists = sorted(set(packages_distributions().get(package, [])))
        except Exception:  # broken metadata of some installed distribution
            dists = []
        for dist in dists:
            found[dist] = _dist_version(dist) or "unknown"
        if not dists:
            found[package] = "not from an installed distribution"
        return found
    try:
        ep = entry_point_backends().get(name)
        if ep is not None and ep.dist is not None:
            found[ep.dist.name] = ep.dist.version
            found["entry point"] = f"{ENTRY_POINT_GROUP}: {ep.value}"
    except Exception as exc:
        found["entry point"] = f"unknown ({exc!r})"
    return found


def _server_version(name: str, url: str) -> str:
    if name == "postgres":
        import psycopg

        with psycopg.connect(url, connect_timeout=int(PROBE_TIMEOUT), autocommit=True) as conn:
            row = conn.execute("SELECT version()").fetchone()
        return str(row[0]) if row else "unknown"
    import redis

    client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT, socket_connect_timeout=PROBE_TIMEOUT)
    try:
        return "redis " + str(client.info("server").get("redis_version", "unknown"))
    finally:
        client.close()


def probe_backend(name: str) -> tuple[dict[str, bool] | None, str | None, dict[str, str]]:
    """``(claims, error, versions)`` of a backend: its harness is resolved and opened
    (a factory backend learns its capabilities there), the capabilities read, and it is
    closed. ``claims`` is None and ``error`` says why when that fails."""
    from ..backends.base import CAPABILITIES
    from ..backends.registry import resolve

    claims: dict[str, bool] | None = None
    error: str | None = None
    harness: Any = None
    with tempfile.TemporaryDirectory(prefix="botmesh-report-") as tmp:
        try:
            harness = resolve(name)(tmp)

            async def probe() -> Any:
                try:
                    await harness.open()
                    return harness.capabilities
                finally:
                    await harness.close()

            caps = asyncio.run(asyncio.wait_for(probe(), PROBE_TIMEOUT))
            claims = {c: bool(getattr(caps, c)) for c in CAPABILITIES}
        except TimeoutError:
            error = f"opening the backend took longer than {PROBE_TIMEOUT:g} s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        versions = backend_versions(name, harness)
    return claims, error, versions


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------
def build_report(state: BotmeshSession, exitstatus: int | None = None) -> dict[str, Any]:
    """The report of this session, JSON-serializable (see the module docstring)."""
    from ..matrix.profiles import load_profile

    config = state.config
    results = list(state.results)
    service_skips = dict(state.service_skips)
    skip_reasons = state.skip_reasons
    kill_lines = state.kill_lines()
    names = list(dict.fromkeys([*selected(config), *service_skips, *(r.backend for r in results)]))
    matrix = matrix_name(config)
    try:
        profile = load_profile(matrix)
        profile_info: dict[str, Any] = {"name": profile.name, "description": profile.description, "source": matrix}
    except Exception as exc:
        profile_info = {"name": matrix, "description": f"unknown ({exc})", "source": matrix}
    interrupted = exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR,
                                 pytest.ExitCode.USAGE_ERROR)
    backends = []
    for name in names:
        rows = [r for r in results if r.backend == name]
        parts: dict[str, dict[str, int]] = {}
        for part in (*PARTS, "tests"):
            mine = [r for r in rows if r.part == part]
            if mine:
                parts[part] = {k: sum(r.outcome == k for r in mine) for k in ("passed", "failed", "skipped")}
        held, broken = held_and_broken(rows)
        grouped: Counter[str] = Counter(reason for b, _, reason in skip_reasons if b == name)
        in_parts: dict[str, set[str]] = defaultdict(set)
        for b, part, reason in skip_reasons:
            if b == name:
                in_parts[reason].add(part)
        skips = [{"reason": reason, "count": count, "parts": sorted(in_parts[reason])}
                 for reason, count in sorted(grouped.items(), key=lambda kv: (-kv[1], kv[0]))]
        claims: dict[str, bool] | None
        error: str | None
        if name in service_skips:
            claims, error, versions = None, service_skips[name], backend_versions(name)
        else:
            claims, error, versions = probe_backend(name)
        passed = sum(c["passed"] for c in parts.values())
        failed = sum(c["failed"] for c in parts.values())
        reasons = []
        if name in service_skips:
            reasons.append(f"service skipped: {service_skips[name]}")
        if failed:
            reasons.append(f"{failed} item(s) failed")
        if not passed and name not in service_skips:
            reasons.append("no item ran")
        if interrupted:
            reasons.append(f"the run did not complete (exit status {int(exitstatus or 0)})")
        entry: dict[str, Any] = {
            "name": name,
            "verdict": NOT_CERTIFIED if reasons else CERTIFIED,
            "verdict_reasons": reasons,
            "claims": claims if claims is not None else "unknown",
        }
        if claims is None:
            entry["claims_error"] = error
        entry.update({
            "versions": versions,
            "parts": parts,
            "totals": {"passed": passed, "failed": failed, "skipped": sum(c["skipped"] for c in parts.values())},
            "held": held,
            "broken": list(broken),
            "broken_items": broken,
            "skips": skips,
            "service_skip": service_skips.get(name),
            "kill_loops": kill_lines.get(name, []),
        })
        recovery = state.recovery.get(name)
        if recovery is not None:
            entry["recovery_coverage"] = recovery.to_json()
        backends.append(entry)
    argv = redact_argv(sys.argv)
    return {
        "format": FORMAT,
        "verdict": CERTIFIED if backends and all(b["verdict"] == CERTIFIED for b in backends) else NOT_CERTIFIED,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "seed": state.seed,
        "matrix": profile_info,
        "parts": list(options.parts(config)),
        "exit_status": None if exitstatus is None else int(exitstatus),
        "versions": run_versions(config),
        "command": _command(argv),
        "argv": argv,
        "pytest_args": redact_argv(config.invocation_params.args),
        "backends": backends,
    }


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown document: the run, then a table per backend."""
    matrix = report["matrix"]
    verdicts = ", ".join(f"`{b['name']}` {b['verdict']}" for b in report["backends"]) or "no backend was run"
    out = [
        "# botmesh certification report",
        "",
        f"**Verdict: {report['verdict']}** ({verdicts})",
        "",
        "| run | |",
        "| --- | --- |",
        f"| date (UTC) | {_cell(report['date'])} |",
        f"| seed | {report['seed']} (rerun with `--botmesh-seed={report['seed']}`) |",
        f"| matrix profile | {_cell(matrix['name'])}: {_cell(matrix['description'])} |",
        f"| parts | {', '.join(report['parts'])} |",
        f"| exit status | {report['exit_status']} |",
        *(f"| {_cell(k)} | {_cell(v)} |" for k, v in report["versions"].items()),
        f"| command | `{_cell(report['command'])}` |",
        "",
    ]
    for b in report["backends"]:
        claims = b["claims"]
        if isinstance(claims, dict):
            claimed = ", ".join(f"{c} {'yes' if v else 'no'}" for c, v in claims.items())
        else:
            claimed = f"unknown ({_cell(b.get('claims_error'))})"
        out += [f"## Backend `{b['name']}`: {b['verdict']}", "", "| | |", "| --- | --- |",
                f"| verdict | **{b['verdict']}**"
                + (f" ({_cell('; '.join(b['verdict_reasons']))})" if b["verdict_reasons"] else "") + " |",
                f"| claims | {claimed} |"]
        for part, c in b["parts"].items():
            out.append(f"| {part} | {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped |")
        out.append(f"| held ({len(b['held'])}) | {', '.join(b['held']) or '—'} |")
        broken = ", ".join(f"{i} in {n} item(s)" for i, n in b["broken_items"].items())
        out.append(f"| broken ({len(b['broken'])}) | {broken or '—'} |")
        if b["service_skip"]:
            out.append(f"| service skip | {_cell(b['service_skip'])} |")
        for s in b["skips"]:
            out.append(f"| skipped ×{s['count']} ({', '.join(s['parts'])}) | {_cell(s['reason'])} |")
        for line in b["kill_loops"]:
            out.append(f"| kill loop | {_cell(line)} |")
        for k, v in b["versions"].items():
            out.append(f"| version: {_cell(k)} | {_cell(v)} |")
        out += [f"| seed | {report['seed']} |", f"| command | `{_cell(report['command'])}` |", ""]
    return "\n".join(out)


def write_report(state: BotmeshSession, path: Path, exitstatus: int | None = None) -> dict[str, Any]:
    """Build the report and write it to ``path`` (Markdown for ``.md``, else JSON)."""
    report = build_report(state, exitstatus)
    if path.suffix.lower() == ".md":
        text = render_markdown(report)
    else:
        text = json.dumps(report, indent=2) + "\n"
    path.write_text(text, encoding="utf-8")
    return report
