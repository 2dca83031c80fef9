"""The certification report: what a run of the plugin established, as a file one can
publish (``--botmesh-report=PATH``, ini ``botmesh_report``, ``botmesh-testkit run
--report PATH``).

It is built on the controller after the session from what the plugin gathered from the
test reports (so it is complete under pytest-xdist): per backend, the capabilities it
claims, the items passed/failed/skipped per part, the requirement ids held and broken
(the rule of the terminal summary), the skip reasons with their counts, the kill-loop
summaries, the power-cut crash states the matrix recovered from
(``matrix_power_cut_states``: cells, states, failed), the failed items with their
message and reproduce command, the crash-matrix cells one by one (``matrix_cells``:
coordinates, outcome, crash points passed, deliveries, violations, power-cut states,
reproduce command; one line each in the JSON) and a verdict; for the run, the seed, the
matrix profile, the parts, the date (UTC), the versions of what was involved and the
command line (passwords of URLs redacted). ``PATH`` ending in ``.md``
gives a Markdown document, ``.html`` / ``.htm`` one self-contained HTML page drawn from
the same dict (:mod:`.html_report`); anything else, JSON.

The verdict of each backend is :mod:`.verdict`'s: **certified** only when every part its
claims require ran and passed, **partial** when some did not run (listed), **not
certified** when something broke, its server could not be had or the run did not
complete; it names the profile it rests on. Skips of tests that need a capability the
backend does not claim do not prevent it: the report lists the claims beside the
verdict, and the skips with their reasons.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import secrets
import shlex
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any


from ..requirements import title
from . import options
from .options import PARTS, matrix_name, selected
from .probe import run_versions
from .results import held_and_broken
from .session import BotmeshSession
from .verdict import overall

FORMAT = "botmesh-certification-report/1"
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
    explore_lines = state.kill_lines(("explore",))
    names = list(dict.fromkeys([*selected(config), *service_skips, *(r.backend for r in results)]))
    matrix = matrix_name(config)
    try:
        profile = load_profile(matrix)
        profile_info: dict[str, Any] = {"name": profile.name, "description": profile.description, "source": matrix,
                                        "workloads": list(profile.workloads), "policies": list(profile.policies)}
    except Exception as exc:
        profile_info = {"name": matrix, "description": f"unknown ({exc})", "source": matrix,
                        "workloads": [], "policies": []}
    backends = []
    verdicts = []
    for name in names:
        rows = [r for r in results if r.backend == name]
        parts: dict[str, dict[str, int]] = {}
        for part in (*PARTS, "tests"):
            mine = [r for r in rows if r.part == part]
            if mine:
                parts[part] = {k: sum(r.outcome == k for r in mine) for k in ("passed", "failed", "skipped")}
                errors = sum(r.outcome == "error" for r in mine)
                if errors:
                    parts[part]["scenario_errors"] = errors
        held, broken = held_and_broken(rows)
        grouped: Counter[str] = Counter(reason for b, _, reason in skip_reasons if b == name)
        in_parts: dict[str, set[str]] = defaultdict(set)
        for b, part, reason in skip_reasons:
            if b == name:
                in_parts[reason].add(part)
        skips = [{"reason": reason, "count": count, "parts": sorted(in_parts[reason])}
                 for reason, count in sorted(grouped.items(), key=lambda kv: (-kv[1], kv[0]))]
        claims, error, versions = state.probe(name)
        passed = sum(c["passed"] for c in parts.values())
        failed = sum(c["failed"] for c in parts.values())
        verdict = state.verdict(name, exitstatus)
        verdicts.append(verdict)
        entry: dict[str, Any] = {
            "name": name,
            "verdict": verdict.status,
            "verdict_line": verdict.line(),
            "verdict_reasons": list(verdict.reasons),
            "profile": verdict.profile,
            "required_parts": list(verdict.required),
            "missing_parts": list(verdict.missing),
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
            "broken_titles": {rid: title(rid) for rid in broken},
            "skips": skips,
            "service_skip": service_skips.get(name),
            "kill_loops": kill_lines.get(name, []),
            "explore": explore_lines.get(name, []),
            "corruption": state.kill_lines(("corruption",)).get(name, []),
            "failed_items": [f for f in state.failures if f["backend"] == name],
            "matrix_cells": sorted((c for b, c in state.cells if b == name), key=lambda c: (c["seq"], c["id"])),
        })
        cuts = state.power_cut_states.get(name)
        if cuts is not None:
            entry["matrix_power_cut_states"] = cuts.to_json()
        recovery = state.recovery.get(name)
        if recovery is not None:
            entry["recovery_coverage"] = recovery.to_json()
        backends.append(entry)
    argv = redact_argv(sys.argv)
    overall_verdict = overall(verdicts)
    return {
        "format": FORMAT,
        "verdict": overall_verdict,
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
        out += [f"## Backend `{b['name']}`: {b['verdict']} at profile {_cell(b['profile'])}", "", "| | |", "| --- | --- |",
                f"| verdict | **{b['verdict']}** at profile {_cell(b['profile'])}"
                + (f" ({_cell('; '.join(b['verdict_reasons']))})" if b["verdict_reasons"] else "") + " |",
                f"| parts required | {', '.join(b['required_parts'])} |",
                f"| claims | {claimed} |"]
        for part, c in b["parts"].items():
            out.append(f"| {part} | {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped |")
        out.append(f"| held ({len(b['held'])}) | {', '.join(b['held']) or '—'} |")
        broken = ", ".join(f"{i} in {n} item(s)" for i, n in b["broken_items"].items())
        out.append(f"| broken ({len(b['broken'])}) | {broken or '—'} |")
        for rid, text in b.get("broken_titles", {}).items():
            out.append(f"| {_cell(rid)} | {_cell(text)} |")
        if b["service_skip"]:
            out.append(f"| service skip | {_cell(b['service_skip'])} |")
        for s in b["skips"]:
            out.append(f"| skipped ×{s['count']} ({', '.join(s['parts'])}) | {_cell(s['reason'])} |")
        cuts = b.get("matrix_power_cut_states")
        if cuts:
            out.append(f"| matrix power-cut states | {cuts['states']} recovered in {cuts['cells']} crashed cells, "
                       f"{cuts['failed']} broke a guarantee |")
        for line in b["kill_loops"]:
            out.append(f"| kill loop | {_cell(line)} |")
        for line in b.get("explore", []):
            out.append(f"| explore | {_cell(line)} |")
        for line in b.get("corruption", []):
            out.append(f"| corruption | {_cell(line)} |")
        for k, v in b["versions"].items():
            out.append(f"| version: {_cell(k)} | {_cell(v)} |")
        out += [f"| seed | {report['seed']} |", f"| command | `{_cell(report['command'])}` |", ""]
        failed = b.get("failed_items", [])
        if failed:
            out += [f"### Failed items of `{b['name']}` ({len(failed)})", "",
                    "| item | outcome | broken | message | reproduce |", "| --- | --- | --- | --- | --- |"]
            for f in failed:
                rerun = f"`{_cell(f['reproduce'])}`" if f.get("reproduce") else "—"
                out.append(f"| `{_cell(f['item'])}` | {f['outcome']} | {', '.join(f['violated']) or '—'} | "
                           f"{_cell(f['message'])} | {rerun} |")
            out.append("")
    return "\n".join(out)


def render_json(report: dict[str, Any]) -> str:
    """The report as JSON, indented, with each matrix cell's record on one line (a
    matrix has hundreds of cells: one line each keeps the file short and diffable)."""
    nonce = secrets.token_hex(8)  # no value of the report can be mistaken for a placeholder
    cells: list[str] = []

    def mark(entry: dict[str, Any]) -> dict[str, Any]:
        if "matrix_cells" not in entry:
            return entry
        placeholders = []
        for record in entry["matrix_cells"]:
            placeholders.append(f"cell-{nonce}-{len(cells)}")
            cells.append(json.dumps(record))
        return {**entry, "matrix_cells": placeholders}

    text = json.dumps({**report, "backends": [mark(b) for b in report["backends"]]}, indent=2)
    return re.sub(f'"cell-{nonce}-(\\d+)"', lambda m: cells[int(m.group(1))], text) + "\n"


def write_report(state: BotmeshSession, path: Path, exitstatus: int | None = None) -> dict[str, Any]:
    """Build the report and write it to ``path``: Markdown for ``.md``, one
    self-contained HTML page for ``.html`` / ``.htm`` (:mod:`.html_report`), else JSON."""
    report = build_report(state, exitstatus)
    suffix = path.suffix.lower()
    if suffix == ".md":
        text = render_markdown(report)
    elif suffix in (".html", ".htm"):
        from .html_report import render_html

        text = render_html(report)
    else:
        text = render_json(report)
    path.write_text(text, encoding="utf-8")
    return report
