"""The HTML certification report (``--botmesh-report=report.html``, issue 14), checked
in a real browser: the plugin runs through pytester as a third party runs it, then
Debian's headless Chromium loads the file, its DOM is dumped (the grid counted cell by
cell against the items run, a cell opened through its ``#cell=`` link) and a screenshot
is taken and decoded (the outcome colours are on screen). Without Chromium these tests
skip, naming why; under ``BOTMESH_REQUIRE_SERVICES`` (CI) they fail."""

from __future__ import annotations

import html
import json
import re
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from conftest import collected_parts, require_chromium

from botmesh_testkit.pytest.html_report import render_html
from botmesh_testkit.requirements import title

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")

BROKEN_KV = '''
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_STORES = {}


class ForgetsSent(KvDurability):
    """Acknowledges mark_sent without writing it: after a crash the send is repeated."""

    async def outbox_mark_sent(self, scope, key, **kwargs):
        return True


def make(workdir):
    return ForgetsSent(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)
'''

ONE_WORKLOAD = '''description = "one workload, both policies, one random cell"
workloads = ["one-send"]
policies = ["skip", "resend"]
random_per_workload = 1
'''


# -- the browser ----------------------------------------------------------------------------
def _chromium(browser: str, profile: Path, url: str, *args: str) -> str:
    """Run headless Chromium on ``url`` (own profile directory: tests run in parallel)
    and return its standard output."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--hide-scrollbars", f"--user-data-dir={profile}", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout


class _Dom(HTMLParser):
    """The elements of a page (tag, attributes), its title and the text inside ``#detail``."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.detail: list[str] = []
        self.title = ""
        self._depth = 0  # > 0: inside #detail
        self._tag = ""
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        self.elements.append((tag, found))
        self._tag = tag
        if self._depth:
            self._depth += 1
        elif found.get("id") == "detail":
            self._depth = 1

    def handle_endtag(self, tag: str) -> None:
        if self._depth:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._tag == "title":
            self.title += data
        if self._depth:
            self.detail.append(data)

    def find(self, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == tag and (cls is None or cls in a.get("class", "").split())]

    def one(self, id_: str) -> dict[str, str]:
        (found,) = [a for _, a in self.elements if a.get("id") == id_]
        return found


def _pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) with the
    standard library: ``(width, height, rows of RGB triples as bytes)``."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + size]
        pos += 12 + size
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
    assert header is not None, "a PNG without IHDR"
    width, height, depth, ctype, _, _, interlace = header
    assert depth == 8 and ctype in (2, 6) and interlace == 0, header
    n = 3 if ctype == 2 else 4
    stride = width * n
    raw = zlib.decompress(b"".join(chunks))
    prev = bytearray(stride)
    rows = []
    for y in range(height):
        at = y * (stride + 1)
        kind, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
        if kind == 1:
            for i in range(n, stride):
                line[i] = (line[i] + line[i - n]) & 0xFF
        elif kind == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev, strict=True))
        elif kind == 3:
            for i in range(stride):
                line[i] = (line[i] + (((line[i - n] if i >= n else 0) + prev[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a, b, c = (line[i - n], prev[i], prev[i - n]) if i >= n else (0, prev[i], 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        else:
            assert kind == 0, f"PNG filter {kind}"
        rows.append(bytes(line) if n == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return width, height, rows


def _colour(page: str, name: str) -> bytes:
    """The RGB value of the CSS variable ``--NAME`` the page declares."""
    found = re.search(rf"--{name}:\s*#([0-9a-fA-F]{{6}})\b", page)
    assert found, f"--{name} not declared in the page's CSS"
    return bytes.fromhex(found.group(1))


# -- the tests -------------------------------------------------------------------------------
@pytest.mark.spec("TEST-4", "BACK-7", "OUT-2", "GUAR-4")
def test_the_html_report_draws_the_crash_grid_in_chromium(pytester: pytest.Pytester) -> None:
    """One self-contained page: the grid has one cell per matrix item run, coloured by
    its outcome (the failed ones exactly the items pytest reported failed), a cell's
    link opens its history, deliveries and reproduce command, the broken ids carry their
    titles, and the screenshot shows the passed and failed colours."""
    browser = require_chromium()
    pytester.makepyfile(thirdparty=BROKEN_KV)
    pytester.makefile(".toml", onework=ONE_WORKLOAD)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:make", "--botmesh-backend=memory",
                                           "--botmesh-parts=matrix", "--botmesh-matrix=onework.toml",
                                           "--botmesh-seed=3", "--botmesh-report=report.html")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"botmesh report written to {pytester.path / 'report.html'}"])
    out = result.stdout.str()
    matrix = collected_parts(out)["matrix"]
    outcomes = result.parseoutcomes()
    failed_ids = set(re.findall(r"^FAILED botmesh-matrix::(\S+)", out, re.M))
    assert outcomes["failed"] == len(failed_ids) > 0 and outcomes["passed"] > 0
    assert outcomes["passed"] + outcomes["failed"] == matrix
    page = pytester.path / "report.html"
    text = page.read_text(encoding="utf-8")
    static = _Dom(text)
    # self-contained: nothing to fetch, and its policy forbids fetching anything
    assert not [(t, a) for t, a in static.elements if {"src", "href"} & set(a) or t in ("link", "iframe", "img")]
    (policy,) = [a["content"] for t, a in static.elements if a.get("http-equiv") == "Content-Security-Policy"]
    assert "default-src 'none'" in policy

    profile = pytester.path / "chromium-profile"
    dom = _Dom(_chromium(browser, profile, page.as_uri(), "--dump-dom"))
    cells = dom.find("button", "cell")
    assert len(cells) == matrix, (len(cells), matrix)
    assert dom.find("html")[0].get("data-botmesh-ready") == str(matrix)  # the page's script ran in the browser
    red = {c["title"].rsplit(": ", 1)[0] for c in cells if "failed" in c["class"].split()}
    green = [c for c in cells if "passed" in c["class"].split()]
    assert red == failed_ids and len(green) == outcomes["passed"]
    assert all(i.startswith("thirdparty:make/") for i in red)
    assert dom.one("detail").get("hidden") is not None  # nothing opened yet
    # the broken ids with their one-line titles
    assert title("OUT-2") in text and "OUT-2" in {t for t in re.findall(r"<th class=\"o-failed\">([^<]+)</th>", text)}

    # a cell's link: what clicking it shows
    chosen = sorted(red)[0]
    opened = _Dom(_chromium(browser, profile, f"{page.as_uri()}#cell={quote(chosen, safe='')}", "--dump-dom"))
    assert opened.one("detail").get("hidden") is None
    shown = " ".join(opened.detail)
    assert chosen in shown and "failed" in shown and "crash points passed" in shown and "delivered (" in shown
    assert f"botmesh-testkit run --backend thirdparty:make --seed 3 --cell '{chosen}'" in shown
    assert "violated" in shown and "OUT-2" in shown
    (selected,) = [c for c in opened.find("button", "selected")]
    assert selected["title"].startswith(chosen + ":")

    # the picture: a real PNG with the outcome colours painted
    shot = pytester.path / "report.png"
    _chromium(browser, profile, page.as_uri(), f"--screenshot={shot}", "--window-size=1100,1300")
    assert shot.is_file() and shot.stat().st_size > 10_000
    width, height, rows = _pixels(shot.read_bytes())
    assert (width, height) == (1100, 1300)
    seen: dict[bytes, int] = {}
    for row in rows:
        for x in range(0, len(row), 3):
            px = row[x:x + 3]
            seen[px] = seen.get(px, 0) + 1
    assert len(seen) >= 8, f"a nearly blank screenshot: {len(seen)} colour(s)"
    for name in ("cell-passed", "cell-failed"):  # the cells' own colours (the verdict badges have others)
        assert seen.get(_colour(text, name), 0) >= 500, f"the --{name} colour of the grid is not on screen"


HANGS = '''
import asyncio

from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_S = {}


class Hangs(KvDurability):
    """Never answers a recovery claim: a crash cell runs out of its time."""

    async def inbox_claim(self, scope, id, **kwargs):
        if kwargs["recover"]:
            await asyncio.Event().wait()
        return await super().inbox_claim(scope, id, **kwargs)


class HangsAlways(Hangs):
    """Never acknowledges a send: even the crash-free dry run cannot finish."""

    async def outbox_mark_sent(self, scope, key, **kwargs):
        await asyncio.Event().wait()


def make(workdir):
    return Hangs(_S.setdefault(workdir, MemoryKv()), own_kv=False)


def always(workdir):
    return HangsAlways(_S.setdefault(workdir, MemoryKv()), own_kv=False)
'''


@pytest.mark.spec("TEST-4")
def test_cells_without_a_run_record_are_in_the_grid(pytester: pytest.Pytester) -> None:
    """A cell that ran out of its budget and a workload whose dry run failed have no
    history: they are still cells of the report (failed, with their message and
    reproduce command), and the JSON renders as HTML as it is."""
    pytester.makepyfile(hangs=HANGS)
    pytester.makefile(".toml", onework=ONE_WORKLOAD)
    cell = "hangs:make/one-send/skip/after:inbox.journal#1"
    timed = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=hangs:make", "--botmesh-parts=matrix",
                                          "--botmesh-seed=1", f"--botmesh-cell={cell}", "--botmesh-cell-timeout=1",
                                          "--botmesh-report=timed.json")
    dry = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=hangs:always", "--botmesh-parts=matrix",
                                        "--botmesh-seed=1", "--botmesh-cell-timeout=1", "--botmesh-matrix=onework.toml",
                                        "--botmesh-report=dry.json")
    assert timed.ret == dry.ret == pytest.ExitCode.TESTS_FAILED
    records = []
    for name, backend in (("timed.json", "hangs:make"), ("dry.json", "hangs:always")):
        report = json.loads((pytester.path / name).read_text(encoding="utf-8"))
        (entry,) = report["backends"]
        (record,) = entry["matrix_cells"]
        assert record["outcome"] == "failed" and "history" not in record
        page = render_html(report)
        dom = _Dom(page)
        (button,) = dom.find("button", "cell")
        assert "failed" in button["class"].split()
        embedded = re.search(r'<script type="application/json" id="botmesh-cells">(.*?)</script>', page, re.S)
        assert embedded is not None
        (data,) = json.loads(embedded.group(1))
        assert data["backend"] == backend and data["message"] == entry["failed_items"][0]["message"]
        records.append((record, button))
    (timed_record, _), (dry_record, dry_button) = records
    assert timed_record["id"] == cell and "real-time budget of 1 s" in _message(pytester, "timed.json")
    assert timed_record["reproduce"] == f"botmesh-testkit run --backend hangs:make --seed 1 --cell '{cell}'"
    assert dry_record["id"] == "hangs:always/one-send/dry-run" and dry_record["at"] == "dry-run"
    assert dry_record["reproduce"] == "botmesh-testkit run --backend hangs:always --seed 1 --parts matrix"
    assert "wide" in dry_button["class"].split()


def _message(pytester: pytest.Pytester, name: str) -> str:
    report = json.loads((pytester.path / name).read_text(encoding="utf-8"))
    return str(report["backends"][0]["failed_items"][0]["message"])


@pytest.mark.spec("TEST-4", "BACK-7")
def test_the_cli_writes_the_html_report(pytester: pytest.Pytester) -> None:
    """``botmesh-testkit run --report report.html`` (no browser needed: the page's own
    markup is counted)."""
    import sys

    pytester.makefile(".toml", onework=ONE_WORKLOAD)
    result = pytester.run(sys.executable, "-m", "botmesh_testkit.cli", "run", "--backend", "memory", "--parts", "matrix",
                          "--matrix", str(pytester.path / "onework.toml"), "--seed", "8", "--report", "cli.html",
                          "--junitxml", "junit.xml")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"botmesh report written to {pytester.path / 'cli.html'}"])
    page = (pytester.path / "cli.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    dom = _Dom(page)
    cells = dom.find("button", "cell")
    assert len(cells) == collected_parts(result.stdout.str())["matrix"] == result.parseoutcomes()["passed"]
    assert all("passed" in c["class"].split() for c in cells)
    assert "partial" in dom.title and "run --backend memory --parts matrix" in page
    # what the grid needs travels beside the JUnit properties, not in them (one short line each there)
    import xml.etree.ElementTree as ET

    cases = list(ET.parse(pytester.path / "junit.xml").iter("testcase"))
    assert len(cases) == len(cells)
    names = {p.get("name") for case in cases for p in case.iter("property")}
    assert "botmesh_reproduce" in names and not {n for n in names if n and n.startswith("botmesh_cell")}


EVIL = "<img src=x onerror=alert(1)>"
EVIL_MESSAGE = "</script><script>document.title='owned'</script> & <b>bold</b>"


def _evil_report() -> dict[str, Any]:
    """A report whose user-controlled texts (backend name, message, ids) are markup."""
    cell_id = f"{EVIL}/one-send/skip/before:outbox.mark_sent#1"
    return {
        "format": "botmesh-certification-report/1", "verdict": "not certified", "date": "2026-01-01T00:00:00+00:00",
        "seed": 1, "matrix": {"name": "smoke", "description": EVIL, "workloads": ["one-send"], "policies": ["skip"]},
        "parts": ["matrix"], "exit_status": 1, "versions": {EVIL: EVIL}, "command": f"pytest --botmesh-backend='{EVIL}'",
        "backends": [{
            "name": EVIL, "verdict": "not certified", "verdict_reasons": [EVIL_MESSAGE], "profile": EVIL,
            "claims": {EVIL: True}, "parts": {"matrix": {"passed": 0, "failed": 1, "skipped": 0}},
            "held": [], "broken_items": {"OUT-2": 1}, "broken_titles": {"OUT-2": EVIL_MESSAGE},
            "skips": [{"reason": EVIL, "count": 1, "parts": ["matrix"]}], "kill_loops": [EVIL_MESSAGE],
            "failed_items": [{"item": f"botmesh-matrix::{cell_id}", "outcome": "failed", "violated": ["OUT-2"],
                              "message": EVIL_MESSAGE, "reproduce": f"run --cell '{EVIL}'"}],
            "matrix_cells": [{"id": cell_id, "workload": "one-send", "policy": "skip", "at": "before:outbox.mark_sent#1",
                              "outcome": "failed", "crash": EVIL, "history": EVIL_MESSAGE,
                              "deliveries": [[EVIL, EVIL_MESSAGE]], "violations": [EVIL_MESSAGE],
                              "reproduce": f"run --cell '{EVIL}'"}],
        }],
    }


@pytest.mark.spec("TEST-4", "BACK-7")
def test_the_html_report_escapes_every_text() -> None:
    page = render_html(_evil_report())
    assert "<img" not in page and "<b>" not in page
    assert page.count("</script>") == 2  # the page's own two: the data and the script
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    dom = _Dom(page)
    assert not [a for _, a in dom.elements if any(k.startswith("on") for k in a)]
    (data,) = [a for t, a in dom.elements if a.get("id") == "botmesh-cells"]
    assert data["type"] == "application/json"
    embedded = re.search(r'<script type="application/json" id="botmesh-cells">(.*?)</script>', page, re.S)
    assert embedded and json.loads(embedded.group(1))[0]["message"] == EVIL_MESSAGE


@pytest.mark.spec("TEST-4", "BACK-7")
def test_the_html_report_shows_markup_as_text_in_chromium(tmp_path: Path) -> None:
    """Opened in the browser, a cell of a backend named like markup shows that markup
    as text in its details, and nothing of it becomes an element or runs."""
    browser = require_chromium()
    report = _evil_report()
    page = tmp_path / "evil.html"
    page.write_text(render_html(report), encoding="utf-8")
    cell_id = report["backends"][0]["matrix_cells"][0]["id"]
    dom = _Dom(_chromium(browser, tmp_path / "profile", f"{page.as_uri()}#cell={quote(cell_id, safe='')}",
                         "--dump-dom"))
    assert not dom.find("img") and not dom.find("b")
    assert not [a for _, a in dom.elements if any(k.startswith("on") for k in a)]
    assert dom.find("html")[0].get("data-botmesh-ready") == "1"
    shown = " ".join(dom.detail)
    assert EVIL in shown and EVIL_MESSAGE in shown
    assert dom.title == "botmesh certification report: not certified"  # the planted script did not run


@pytest.mark.spec("TEST-4", "BACK-5")
def test_the_html_report_shows_the_explore_and_corruption_runs_in_chromium(pytester: pytest.Pytester) -> None:
    """The explore run's and the corruption part's headline lines (issue 12, issue 13),
    which the JSON report carries, are on the page too: one block each, with the
    counts the terminal printed."""
    browser = require_chromium()
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=file", "--botmesh-parts=explore,corruption",
                                           "--botmesh-explore-examples=2", "--botmesh-seed=5",
                                           "--botmesh-report=report.html")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    out = result.stdout.str()
    explore_line = re.search(r"^  (explore on file, seed 5: \d+ stories.*: passed)$", out, re.M)
    corruption_line = re.search(r"^  (corruption: 40 damaged variants of file's files: .*)$", out, re.M)
    assert explore_line and corruption_line, out
    page = pytester.path / "report.html"
    dumped = _chromium(browser, pytester.path / "chromium-profile", page.as_uri(), "--dump-dom")
    headings = re.findall(r"<h3>([^<]*)</h3>", dumped)
    assert "Explore (1)" in headings and "Corruption (1)" in headings, headings
    blocks = [html.unescape(b) for b in re.findall(r'<pre class="loop passed">(.*?)</pre>', dumped, re.S)]
    assert explore_line.group(1) in blocks and corruption_line.group(1) in blocks, blocks
