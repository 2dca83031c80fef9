"""The requirements the ids name, read from the spec shipped in this package.

``botmesh_testkit/durability.md`` is the numbered specification of botmesh's durable
message processing; every id a test, a crash point, a scenario or a report names
(``INB-3``, ``OUT-14``, ``GUAR-4`` ...) is defined there, either as a list item
(``- INB-3. After a crash ...``) or as a row of the crash table (``| GUAR-4 | ... |``).
This module parses it once (through :mod:`importlib.resources`, so it works from a
wheel as from a checkout) and answers:

* :func:`requirements` — every id, in the spec's order, with its section and text;
* :func:`title` — a one-line title for summaries and reports (the first sentence,
  cut at 90 characters);
* :func:`unknown` — the ids of a list that the spec does not define (a scenario that
  names an id the spec lacks is a mistake of the scenario, not a requirement held);
* :func:`suggest` — the known ids closest to a mistyped one.

``botmesh-testkit spec [ID...]`` prints them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

__all__ = ["Requirement", "requirements", "spec_text", "suggest", "title", "unknown"]

_ITEM = re.compile(r"^- (?P<id>[A-Z]+-\d+)\. (?P<text>.*)$")
_ROW = re.compile(r"^\| (?P<id>[A-Z]+-\d+) \| (?P<cells>.*) \|$")
_SECTION = re.compile(r"^## (?P<name>.*)$")
TITLE_MAX = 90


@dataclass(frozen=True)
class Requirement:
    id: str
    section: str
    text: str

    @property
    def title(self) -> str:
        return _first_sentence(self.text)


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    m = re.search(r"(?<=\.)\s", flat)
    first = flat[: m.start()] if m else flat
    if len(first) > TITLE_MAX:
        first = first[: TITLE_MAX - 1].rstrip() + "…"
    return first


@cache
def spec_text() -> str:
    """The whole shipped spec (Markdown)."""
    return resources.files("botmesh_testkit").joinpath("durability.md").read_text(encoding="utf-8")


@cache
def requirements() -> dict[str, Requirement]:
    """Every requirement id of the spec, in order, with its section and full text."""
    found: dict[str, Requirement] = {}
    section = ""
    current: tuple[str, list[str]] | None = None

    def close() -> None:
        nonlocal current
        if current is not None:
            rid, lines = current
            found[rid] = Requirement(rid, section, " ".join(" ".join(lines).split()))
            current = None

    for line in spec_text().splitlines():
        if m := _SECTION.match(line):
            close()
            section = m["name"].strip()
            continue
        if m := _ITEM.match(line):
            close()
            current = (m["id"], [m["text"]])
            continue
        if m := _ROW.match(line):
            close()
            cells = [c.strip() for c in m["cells"].split(" | ")]
            # the crash table: "the process dies ..." | "on restart"
            text = f"the process dies {cells[0]} → on restart, {cells[1]}" if len(cells) >= 2 else cells[0]
            found[m["id"]] = Requirement(m["id"], section, text)
            continue
        if current is not None and line.startswith("  ") and line.strip():
            current[1].append(line.strip())
        else:
            close()
    close()
    return found


def title(rid: str) -> str:
    """The one-line title of ``rid``; ``"(not in the spec)"`` for an unknown id."""
    req = requirements().get(rid)
    return req.title if req is not None else "(not in the spec)"


def unknown(ids: object) -> list[str]:
    """The ids of ``ids`` (an iterable of str) that the spec does not define, in order."""
    known = requirements()
    return [i for i in ids if i not in known]  # type: ignore[attr-defined]


def suggest(rid: str, n: int = 3) -> list[str]:
    """The known ids closest to ``rid`` (same prefix first)."""
    known = list(requirements())
    prefix = rid.split("-", 1)[0].upper()
    same = [k for k in known if k.split("-", 1)[0] == prefix]
    close = difflib.get_close_matches(rid.upper(), known, n=n, cutoff=0.5)
    out = [c for c in close if c in same] + [c for c in close if c not in same]
    if not out and same:
        out = same[-n:]
    return out[:n]
