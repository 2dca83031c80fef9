"""The certification report as one self-contained HTML page
(``--botmesh-report=report.html``, ``botmesh-testkit run --report report.html``).

It is drawn from the same report dict as the JSON one (:func:`.report.build_report`),
so the two never disagree: for the run, the verdict, date, seed, profile, parts, exit
status, versions and the command line; per backend its verdict with the reasons and the
profile it rests on, its claims, the items per part, the broken ids with their one-line
titles and the held ones, a **grid** of its crash-matrix cells (a table per workload:
a row per crash point, a column per ``on_ambiguous`` policy, each cell coloured by its
outcome: passed, failed, skipped), the kill-loop accounting, the skips, the failed items
with their message and reproduce command.

Clicking a cell (or opening ``report.html#cell=CELL-ID``: a link to one cell) shows its
crash point, whether the crash fired, the crash points passed, what the channel
received, the guarantees it broke, the failure message and the command that reproduces
it. Without JavaScript the grid is still there, each cell naming itself in its tooltip.

The page loads nothing: its CSS and script are inline, and its Content-Security-Policy
allows only those two (by hash), so a report opened from a mail or an artifact store
makes no request. Every text of the report (backend names, messages, ids) is escaped;
the cells' data is embedded as JSON and only ever put in the page as text.
"""

from __future__ import annotations

import base64
import hashlib
import json
from html import escape
from typing import Any

OUTCOMES = ("passed", "failed", "skipped")
"""The outcomes a cell is coloured by (anything else is drawn as ``other``)."""

_SYMBOL = {"passed": "\u2713", "failed": "\u2717", "skipped": "\u2013"}

CSS = """
:root { --ok: #1f8a45; --bad: #c81e3a; --skip: #8d949c; --warn: #c98a00; --ink: #1d232a; --line: #d5dae0;
        --soft: #f4f6f8; --cell-passed: #2a9d58; --cell-failed: #dc3148; --cell-skipped: #9aa1a8; --cell-other: #5a4fcf;
        font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink); }
body { margin: 0 auto; max-width: 86em; padding: 1em 1.5em 4em; line-height: 1.4; }
h1 { font-size: 1.6em; margin: .3em 0; } h2 { font-size: 1.3em; margin: 0 0 .4em; }
h3 { font-size: 1.05em; margin: 1em 0 .4em; }
code, pre, .mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: .86em; }
pre { background: var(--soft); border: 1px solid var(--line); border-radius: 4px; padding: .5em .7em; margin: .3em 0;
      white-space: pre-wrap; word-break: break-word; }
table { border-collapse: collapse; margin: .3em 0 .8em; }
th, td { border: 1px solid var(--line); padding: .25em .5em; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
table.kv th { width: 13em; }
.badge { display: inline-block; border-radius: 3px; padding: .05em .5em; color: #fff; font-weight: 700; }
.v-certified { background: var(--ok); } .v-partial { background: var(--warn); } .v-not-certified { background: var(--bad); }
.o-passed { color: var(--ok); } .o-failed, .o-error { color: var(--bad); } .o-skipped { color: var(--skip); }
section.backend { border: 1px solid var(--line); border-radius: 6px; padding: 1em 1.2em; margin: 1.4em 0; }
.legend span { margin-right: 1.2em; } .legend span:has(i) { white-space: nowrap; }
.legend i { display: inline-block; width: .9em; height: .9em; border-radius: 2px; vertical-align: -.1em; margin-right: .3em; }
.grid { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.grid table { margin: 0; } .grid caption { text-align: left; font-weight: 600; padding-bottom: .2em; }
.grid th.at { font-weight: 400; background: #fff; font-size: .8em; } .grid th.when { font-weight: 400; font-size: .75em; }
.grid td { padding: 2px; text-align: center; }
.grid td.void { background: repeating-linear-gradient(45deg, #fff 0 3px, #eef0f2 3px 6px); }
button.cell { width: 1.9em; height: 1.5em; border: 0; border-radius: 3px; color: #fff; font-weight: 700; cursor: pointer;
              padding: 0; line-height: 1; }
button.cell.wide { width: 100%; min-width: 4em; }
button.cell.passed, .legend i.passed { background: var(--cell-passed); }
button.cell.failed, .legend i.failed { background: var(--cell-failed); }
button.cell.skipped, .legend i.skipped { background: var(--cell-skipped); }
button.cell.other, .legend i.other { background: var(--cell-other); }
button.cell.selected { outline: 3px solid #1d4ed8; outline-offset: 1px; }
#detail { position: fixed; top: 1em; right: 1em; width: min(36em, 92vw); max-height: calc(100vh - 2em); overflow: auto;
          background: #fff; border: 1px solid #9aa3ad; border-radius: 6px; box-shadow: 0 6px 24px rgba(0, 0, 0, .18);
          padding: .8em 1em; z-index: 10; }
#detail[hidden] { display: none; }
#detail h3 { margin-top: 0; word-break: break-all; padding-right: 2em; }
#detail .close { position: absolute; top: .5em; right: .6em; border: 0; background: none; font-size: 1.3em; cursor: pointer; }
#detail dl { display: grid; grid-template-columns: max-content 1fr; gap: .2em .8em; margin: .4em 0; }
#detail dt { font-weight: 600; } #detail dd { margin: 0; word-break: break-word; }
.muted { color: #5f6b76; } ul.reasons { margin: .2em 0 .6em; }
"""

SCRIPT = """
(function () {
  "use strict";
  var cells = JSON.parse(document.getElementById("botmesh-cells").textContent);
  var panel = document.getElementById("detail");
  var body = document.getElementById("detail-body");
  var byId = new Map();
  cells.forEach(function (c, i) { byId.set(c.id, i); });

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function field(dl, name, value) {
    dl.appendChild(el("dt", "", name));
    var dd = el("dd");
    if (value instanceof Node) { dd.appendChild(value); } else { dd.textContent = String(value); }
    dl.appendChild(dd);
  }
  function list(items, cls) {
    var ul = el("ul", cls);
    items.forEach(function (t) { ul.appendChild(el("li", "", t)); });
    return ul;
  }
  function show(i, remember) {
    var c = cells[i];
    if (!c) { return; }
    body.replaceChildren();
    body.appendChild(el("h3", "", c.id));
    var dl = el("dl");
    field(dl, "outcome", el("strong", "o-" + c.outcome, c.outcome));
    field(dl, "backend", c.backend);
    field(dl, "workload", c.workload);
    if (c.at !== "dry-run") {
      field(dl, "policy", "on_ambiguous=" + c.policy);
      field(dl, "crash point", c.at);
    }
    if ("crash" in c) { field(dl, "crash", c.crash === null ? "did not fire" : c.crash); }
    if ("seconds" in c) { field(dl, "real time", c.seconds + " s"); }
    if (c.power_cut_states) {
      field(dl, "power-cut states", c.power_cut_states[0] + " recovered of " + c.power_cut_states[1] +
            " distinct crash states of the unsynced window; " + c.power_cut_states[2] + " broke a guarantee");
    }
    body.appendChild(dl);
    if (c.violations && c.violations.length) {
      body.appendChild(el("h4", "", "violated"));
      body.appendChild(list(c.violations, "o-failed"));
    }
    if (c.message && !("history" in c)) {  // a cell that ran: its details say more than the message
      body.appendChild(el("h4", "", "message"));
      body.appendChild(el("pre", "message", c.message));
    }
    if ("history" in c) {
      body.appendChild(el("h4", "", "crash points passed"));
      body.appendChild(el("pre", "history", c.history || "(none)"));
    }
    if (c.deliveries) {
      body.appendChild(el("h4", "", "delivered (" + c.deliveries.length + ")"));
      if (c.deliveries.length) {
        body.appendChild(list(c.deliveries.map(function (d) { return d[0] + ": " + d[1]; }), "mono deliveries"));
      } else {
        body.appendChild(el("p", "muted", "nothing"));
      }
    }
    if (c.ambiguous && c.ambiguous.length) {
      body.appendChild(el("h4", "", "ambiguous keys"));
      body.appendChild(el("pre", "", c.ambiguous.join(", ")));
    }
    if (c.reproduce) {
      body.appendChild(el("h4", "", "reproduce"));
      body.appendChild(el("pre", "reproduce", c.reproduce));
      var copy = el("button", "copy", "copy");
      copy.type = "button";
      copy.addEventListener("click", function () {
        if (navigator.clipboard) {
          navigator.clipboard.writeText(c.reproduce).then(function () { copy.textContent = "copied"; },
                                                          function () { copy.textContent = "select and copy"; });
        }
      });
      body.appendChild(copy);
    }
    document.querySelectorAll("button.cell.selected").forEach(function (b) { b.classList.remove("selected"); });
    var own = document.querySelector('button.cell[data-cell="' + i + '"]');
    if (own) { own.classList.add("selected"); }
    panel.hidden = false;
    if (remember) {
      try { history.replaceState(null, "", "#cell=" + encodeURIComponent(c.id)); } catch (e) { /* file: URL rules */ }
    }
  }
  function hide() {
    panel.hidden = true;
    document.querySelectorAll("button.cell.selected").forEach(function (b) { b.classList.remove("selected"); });
  }
  function fromHash() {
    var m = /^#cell=(.*)$/.exec(location.hash);
    if (!m) { return; }
    var id;
    try { id = decodeURIComponent(m[1]); } catch (e) { return; }
    if (byId.has(id)) { show(byId.get(id), false); }
  }
  document.addEventListener("click", function (ev) {
    var target = ev.target instanceof Element ? ev.target.closest("button.cell[data-cell]") : null;
    if (target) { show(Number(target.getAttribute("data-cell")), true); }
  });
  document.addEventListener("keydown", function (ev) { if (ev.key === "Escape") { hide(); } });
  panel.querySelector("button.close").addEventListener("click", hide);
  window.addEventListener("hashchange", fromHash);
  fromHash();
  document.documentElement.setAttribute("data-botmesh-ready", String(document.querySelectorAll("button.cell").length));
})();
"""


def _e(value: Any) -> str:
    """``value`` as HTML text (or attribute value): everything escaped."""
    return escape(str(value), quote=True)


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def _json_for_script(data: Any) -> str:
    """JSON that cannot end the ``<script>`` element it is embedded in."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _badge(status: str) -> str:
    return f'<span class="badge v-{_e(status.replace(" ", "-"))}">{_e(status)}</span>'


def _kv(rows: list[tuple[str, str]]) -> str:
    """A two-column table; the values are HTML already escaped by the caller."""
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _outcome_class(outcome: Any) -> str:
    return str(outcome) if outcome in OUTCOMES else "other"


def _split(at: str) -> tuple[str, str]:
    """``"before:outbox.mark_sent#1"`` -> ``("before", "outbox.mark_sent#1")``."""
    when, _, point = at.partition(":")
    return (when, point) if point else ("", at)


def _grid(backend: dict[str, Any], cells: list[dict[str, Any]], first: int, workloads: list[str],
          policies: list[str]) -> str:
    """The backend's matrix cells as a table per workload: a row per crash point (in
    the dry run's order), a column per policy and moment (before / after the point).
    ``first`` is the index of its first cell in the page's cell data."""
    if not cells:
        return ""
    indexed = list(enumerate(cells, start=first))
    order = list(dict.fromkeys([*workloads, *(c["workload"] for c in cells)]))
    tables = []
    for workload in order:
        mine = [(i, c) for i, c in indexed if c["workload"] == workload]
        if not mine:
            continue
        drawn = [(i, c) for i, c in mine if c["at"] != "dry-run"]
        columns = list(dict.fromkeys([*(p for p in policies if any(c["policy"] == p for _, c in drawn)),
                                      *(c["policy"] for _, c in drawn)]))
        moments = list(dict.fromkeys([*(w for w in ("before", "after") if any(_split(c["at"])[0] == w for _, c in drawn)),
                                      *(_split(c["at"])[0] for _, c in drawn)]))
        width = max(1, len(columns) * len(moments))
        counts = {k: sum(_outcome_class(c["outcome"]) == k for _, c in mine) for k in (*OUTCOMES, "other")}
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        head = ""
        if drawn:
            head = ("<tr><th rowspan=\"2\">crash point</th>"
                    + "".join(f'<th colspan="{len(moments)}">{_e(p)}</th>' for p in columns) + "</tr><tr>"
                    + "".join(f'<th class="when">{_e(w)}</th>' for _ in columns for w in moments) + "</tr>")
        lines = [f'<tr><th class="at mono">dry run</th><td colspan="{width}">{_button(i, c, wide=True)}</td></tr>'
                 for i, c in mine if c["at"] == "dry-run"]
        for point in dict.fromkeys(_split(c["at"])[1] for _, c in drawn):
            tds = ""
            for policy in columns:
                for when in moments:
                    inside = [(i, c) for i, c in drawn if c["policy"] == policy and _split(c["at"]) == (when, point)]
                    tds += (f'<td>{"".join(_button(i, c) for i, c in inside)}</td>' if inside
                            else '<td class="void" title="not drawn"></td>')
            lines.append(f'<tr><th class="at mono">{_e(point)}</th>{tds}</tr>')
        tables.append(f'<table class="workload" data-workload="{_e(workload)}"><caption>{_e(workload)} '
                      f'<span class="muted">({_e(summary)})</span></caption>'
                      f'<thead>{head}</thead><tbody>{"".join(lines)}</tbody></table>')
    total = {k: sum(_outcome_class(c["outcome"]) == k for c in cells) for k in (*OUTCOMES, "other")}
    legend = "".join(f'<span><i class="{k}"></i>{_e(k)}: {n}</span>' for k, n in total.items() if n or k != "other")
    return (f'<h3>Crash matrix ({len(cells)} cells)</h3><p class="legend">{legend}'
            f'<span class="muted">click a cell for its history, deliveries and reproduce command; hatched: not '
            f'drawn (a call that raised has no "after"; random cells <code>*#N</code> crash at the N-th point '
            f'passed)</span></p>'
            f'<div class="grid" data-backend="{_e(backend["name"])}">{"".join(tables)}</div>')


def _button(index: int, cell: dict[str, Any], wide: bool = False) -> str:
    outcome = _outcome_class(cell["outcome"])
    label = "dry run failed" if cell["at"] == "dry-run" else _SYMBOL.get(outcome, "?")
    title = f"{cell['id']}: {cell['outcome']}"
    return (f'<button type="button" class="cell {outcome}{" wide" if wide else ""}" data-cell="{index}" '
            f'title="{_e(title)}" aria-label="{_e(title)}">{_e(label)}</button>')


def _loops(heading: str, lines: list[str]) -> str:
    """The headline lines of a part's runs (kill and power-cut loops, explore runs, the
    corruption part), one block per run (a run's first line is not indented)."""
    loops: list[list[str]] = []
    for line in lines:
        if not line.startswith(" ") or not loops:
            loops.append([])
        loops[-1].append(line)
    if not loops:
        return ""
    blocks = "".join(f'<pre class="loop {"failed" if "FAILED" in loop[0] else "passed"}">{_e(chr(10).join(loop))}</pre>'
                     for loop in loops)
    return f"<h3>{heading} ({len(loops)})</h3>{blocks}"


def _reproduce(command: Any) -> str:
    return f'<pre class="reproduce">{_e(command)}</pre>' if command else "—"


def _backend_section(n: int, b: dict[str, Any], cells_html: str) -> str:
    claims = b.get("claims")
    if isinstance(claims, dict):
        claimed = ", ".join(f"{_e(c)} {'yes' if v else 'no'}" for c, v in claims.items()) or "none"
    else:
        claimed = f"unknown ({_e(b.get('claims_error'))})"
    rows: list[tuple[str, str]] = [
        ("profile", _e(b.get("profile", ""))),
        ("parts required", _e(", ".join(b.get("required_parts", [])) or "—")),
        ("parts missing", _e(", ".join(b.get("missing_parts", [])) or "—")),
        ("claims", claimed),
    ]
    for part, c in b.get("parts", {}).items():
        extra = f', <span class="o-error">{int(c["scenario_errors"])} scenario error(s)</span>' \
            if c.get("scenario_errors") else ""
        rows.append((f"part: {part}", f'<span class="o-passed">{int(c["passed"])} passed</span>, '
                                      f'<span class="o-failed">{int(c["failed"])} failed</span>, '
                                      f'<span class="o-skipped">{int(c["skipped"])} skipped</span>{extra}'))
    held = b.get("held", [])
    rows.append((f"held ({len(held)})", _e(", ".join(held) or "—")))
    if b.get("service_skip"):
        rows.append(("service skip", _e(b["service_skip"])))
    cuts = b.get("matrix_power_cut_states")
    if isinstance(cuts, dict):
        rows.append(("matrix power-cut states", _e(f"{cuts.get('states')} recovered in {cuts.get('cells')} crashed cells, "
                                                   f"{cuts.get('failed')} broke a guarantee")))
    recovery = b.get("recovery_coverage")
    if isinstance(recovery, dict):
        rows.append(("recovery coverage", _e(f"{recovery.get('hit_lines')}/{recovery.get('total_lines')} lines of "
                                             f"{recovery.get('file')} ({recovery.get('percent')}%) "
                                             f"by {recovery.get('cells')} cells")))
    for k, v in b.get("versions", {}).items():
        rows.append((f"version: {k}", _e(v)))
    reasons = b.get("verdict_reasons", [])
    out = [f'<section class="backend" id="backend-{n}" data-backend="{_e(b["name"])}">',
           f'<h2>Backend <code>{_e(b["name"])}</code> {_badge(b.get("verdict", "?"))} '
           f'<span class="muted">at profile {_e(b.get("profile", ""))}</span></h2>',
]
    if reasons:
        out.append('<ul class="reasons">' + "".join(f"<li>{_e(r)}</li>" for r in reasons) + "</ul>")
    out.append(_kv(rows))
    broken = b.get("broken_items", {})
    if broken:
        titles = b.get("broken_titles", {})
        body = "".join(f'<tr><th class="o-failed">{_e(rid)}</th><td>{int(count)}</td><td>{_e(titles.get(rid, ""))}</td></tr>'
                       for rid, count in broken.items())
        out.append(f'<h3>Broken ({len(broken)})</h3><table class="broken"><thead><tr><th>id</th><th>items</th>'
                   f'<th>requirement</th></tr></thead><tbody>{body}</tbody></table>')
    out.append(cells_html)
    out.append(_loops("Kill loops", b.get("kill_loops", [])))
    out.append(_loops("Explore", b.get("explore", [])))
    out.append(_loops("Corruption", b.get("corruption", [])))
    skips = b.get("skips", [])
    if skips:
        body = "".join(f'<tr><td>{int(s["count"])}</td><td>{_e(", ".join(s.get("parts", [])))}</td>'
                       f'<td>{_e(s["reason"])}</td></tr>' for s in skips)
        out.append(f'<h3>Skipped</h3><table class="skips"><thead><tr><th>items</th><th>parts</th><th>reason</th></tr>'
                   f'</thead><tbody>{body}</tbody></table>')
    failed = b.get("failed_items", [])
    if failed:
        body = "".join(
            f'<tr><td><code>{_e(f["item"])}</code></td><td class="o-{_e(f["outcome"])}">{_e(f["outcome"])}</td>'
            f'<td>{_e(", ".join(f.get("violated", [])) or "—")}</td><td><pre>{_e(f.get("message", ""))}</pre></td>'
            f'<td>{_reproduce(f.get("reproduce"))}</td></tr>'
            for f in failed)
        out.append(f'<h3>Failed items ({len(failed)})</h3><table class="failed"><thead><tr><th>item</th><th>outcome</th>'
                   f'<th>broken</th><th>message</th><th>reproduce</th></tr></thead><tbody>{body}</tbody></table>')
    out.append("</section>")
    return "".join(out)


def render_html(report: dict[str, Any]) -> str:
    """The report dict of :func:`.report.build_report` as one HTML page (see the module
    docstring). Missing keys (a report of an older format) render as absent."""
    matrix = report.get("matrix", {})
    workloads = list(matrix.get("workloads", []))
    policies = list(matrix.get("policies", []))
    data: list[dict[str, Any]] = []
    sections = []
    for n, b in enumerate(report.get("backends", [])):
        cells = list(b.get("matrix_cells", []))
        messages = {f["item"]: f.get("message", "") for f in b.get("failed_items", [])}
        grid = _grid(b, cells, len(data), workloads, policies)
        for c in cells:
            entry = {**c, "backend": b["name"]}
            message = messages.get(f"botmesh-matrix::{c['id']}")
            if message:
                entry["message"] = message
            data.append(entry)
        sections.append(_backend_section(n, b, grid))
    verdict = str(report.get("verdict", "?"))
    overview = ", ".join(f'<code>{_e(b["name"])}</code> {_badge(b.get("verdict", "?"))}'
                         for b in report.get("backends", [])) or "no backend was run"
    run_rows: list[tuple[str, str]] = [
        ("date (UTC)", _e(report.get("date", ""))),
        ("seed", f'{_e(report.get("seed"))} <span class="muted">(rerun with <code>--botmesh-seed='
                 f'{_e(report.get("seed"))}</code>)</span>'),
        ("matrix profile", f'{_e(matrix.get("name", ""))}: {_e(matrix.get("description", ""))}'),
        ("parts", _e(", ".join(report.get("parts", [])))),
        ("exit status", _e(report.get("exit_status"))),
        ("command", f'<code class="command">{_e(report.get("command", ""))}</code>'),
        *((f"version: {k}", _e(v)) for k, v in report.get("versions", {}).items()),
    ]
    style, script = CSS, SCRIPT
    csp = (f"default-src 'none'; style-src {_csp_hash(style)}; script-src {_csp_hash(script)}; "
           "img-src 'none'; base-uri 'none'; form-action 'none'")
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f'<meta http-equiv="Content-Security-Policy" content="{_e(csp)}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>botmesh certification report: {_e(verdict)}</title>",
        f"<style>{style}</style></head><body>",
        f'<h1>botmesh certification report {_badge(verdict)}</h1>',
        f'<p class="overview">{overview}</p>',
        "<noscript><p class=\"muted\">Without JavaScript a cell's details are not shown; its tooltip names "
        "it.</p></noscript>",
        _kv(run_rows),
        *sections,
        '<aside id="detail" hidden><button type="button" class="close" aria-label="close">\u00d7</button>'
        '<div id="detail-body"></div></aside>',
        f'<script type="application/json" id="botmesh-cells">{_json_for_script(data)}</script>',
        f"<script>{script}</script>",
        f'<p class="muted">{_e(report.get("format", ""))}</p>',
        "</body></html>\n",
    ])
