"""One botmesh item's result as the summary, the verdict and the report count it, and
the rules they share (which part an item is, which ids held and broke)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple


class Result(NamedTuple):
    """One botmesh item's outcome, as the summary and the report count it."""

    backend: str
    part: str
    outcome: str
    """``passed``, ``failed``, ``skipped`` or ``error`` (a scenario's own mistake: it
    checked nothing, so it neither holds nor breaks an id)."""
    spec: tuple[str, ...]
    """The requirement ids the item checks (its ``spec`` marker)."""
    violated: tuple[str, ...]
    """The ids it broke (a failing item's own, else its whole marker)."""
    skip: str = ""
    """Why it was skipped (empty unless skipped)."""


def part_of(nodeid: str) -> str:
    """The part an item belongs to, from its node id (``tests`` for the project's own)."""
    if nodeid.startswith("botmesh-matrix::"):
        return "matrix"
    if nodeid.startswith("botmesh-scenarios/"):
        return "scenarios"
    if nodeid.startswith("botmesh-conformance"):
        return "suite"
    if nodeid.startswith("botmesh-explore::"):
        return "explore"
    if nodeid.startswith("botmesh-kills::"):
        return "kills"
    if nodeid.startswith("botmesh-powercuts::"):
        return "powercuts"
    if nodeid.startswith("botmesh-corruption::"):
        return "corruption"
    if nodeid.startswith("botmesh-services::"):
        return "services"
    return "tests"


def skip_reason(longrepr: Any) -> str:
    """The reason of a skipped test report (``Skipped: `` removed)."""
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ")


def _id_key(s: str) -> tuple[str, int]:
    prefix, _, num = s.partition("-")
    return prefix, int(num) if num.isdigit() else 0


def held_and_broken(rows: Iterable[Result]) -> tuple[list[str], dict[str, int]]:
    """The ids held (exercised by a non-skipped item and broken by none) and the ids
    broken (named by a failing item's violated ids) with how many items broke each —
    the rule of the terminal summary."""
    exercised: set[str] = set()
    broken: Counter[str] = Counter()
    for _, _, outcome, spec, violated, _ in rows:
        if outcome in ("skipped", "error"):
            continue
        exercised.update(spec)
        exercised.update(violated)
        broken.update(violated)
    held = sorted((i for i in exercised if not broken[i]), key=_id_key)
    return held, {i: broken[i] for i in sorted(broken, key=_id_key)}
