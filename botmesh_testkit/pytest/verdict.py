"""The verdict on a backend: **certified** only when every part its claims require ran
and passed; **partial** when some of them did not run (not selected, not in the
profile, or every item skipped), listing them; **not certified** when something broke,
its server could not be had, or the run did not complete. A verdict always names the
profile it rests on: a smoke run is a certification *at smoke*.

Required parts: ``suite``, ``scenarios``, ``matrix`` and ``explore`` for every backend; ``kills``
when it claims ``survives_crash`` (a claim only a real process death can test), and
``powercuts`` too when its storage lives in the workdir, where the power-cut file system
can be mounted (a SIGKILL leaves the page cache intact: only a power cut tests fsync). A
backend that claims nothing is certified on the four in-process parts. ``postgres`` and
``redis`` are power-cut on a private server of the same binaries whose data directory is
on the mount (a server given by URL cannot be cut: its settings are checked instead).
A ``survives_crash`` backend whose storage is files in its workdir must also pass
``corruption`` (damaged files refused or read back as acknowledged); for one on a server
the part is not applicable, which its verdict line says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .results import Result

CERTIFIED = "certified"
PARTIAL = "partial"
NOT_CERTIFIED = "not certified"

ALWAYS = ("suite", "scenarios", "matrix", "explore")
"""The parts every backend must pass."""

BY_CLAIM: dict[str, tuple[str, ...]] = {"survives_crash": ("kills",)}
"""The parts a claim adds."""


def required_parts(claims: Mapping[str, bool] | None, *, storage_in_workdir: bool = False,
                   files_in_workdir: bool = False) -> tuple[str, ...]:
    """The parts a backend making ``claims`` must pass (None: claims unknown — only the
    parts every backend needs); ``storage_in_workdir`` adds the power cuts to a
    ``survives_crash`` claim, ``files_in_workdir`` the corruption part."""
    parts = list(ALWAYS)
    for claim, more in BY_CLAIM.items():
        if claims and claims.get(claim):
            parts.extend(p for p in more if p not in parts)
    if claims and claims.get("survives_crash") and storage_in_workdir:
        parts.append("powercuts")
    if claims and claims.get("survives_crash") and files_in_workdir:
        parts.append("corruption")
    return tuple(parts)


@dataclass(frozen=True)
class Verdict:
    """A backend's verdict (see the module docstring)."""

    status: str
    profile: str
    reasons: tuple[str, ...] = ()
    """Why it is not certified: what broke, what is missing."""
    missing: tuple[str, ...] = ()
    """Required parts that did not run."""
    required: tuple[str, ...] = ()
    not_applicable: str = ""
    """A part that does not apply to the backend, and why (``corruption not applicable:
    ...``), said in the line without weighing on the verdict."""

    def line(self) -> str:
        """``certified at profile smoke (suite, scenarios, matrix, kills)`` ..."""
        head = f"{self.status} at profile {self.profile}"
        note = f"; {self.not_applicable}" if self.not_applicable else ""
        if self.status == CERTIFIED:
            return f"{head} ({', '.join(self.required)}{note})"
        return f"{head}: {'; '.join(self.reasons)}{note}"


def judge(rows: Iterable[Result], claims: Mapping[str, bool] | None, *, profile: str,
          service_skip: str | None = None, interrupted: str | None = None,
          why_not_run: Mapping[str, str] | None = None, storage_in_workdir: bool = False,
          files_in_workdir: bool = False) -> Verdict:
    """The verdict on one backend from its items' results. ``why_not_run`` may say why a
    part has no item (``"not selected with --botmesh-parts"`` ...)."""
    rows = list(rows)
    required = required_parts(claims, storage_in_workdir=storage_in_workdir, files_in_workdir=files_in_workdir)
    na = ("corruption not applicable (its storage is not files in the workdir)"
          if claims and claims.get("survives_crash") and not files_in_workdir else "")
    verdict = _judge(rows, required, profile, service_skip, interrupted, why_not_run)
    return Verdict(verdict.status, profile, verdict.reasons, verdict.missing, required, na)


def _judge(rows: list[Result], required: tuple[str, ...], profile: str, service_skip: str | None,
           interrupted: str | None, why_not_run: Mapping[str, str] | None) -> Verdict:
    reasons: list[str] = []
    if service_skip:
        reasons.append(f"service skipped: {service_skip}")
    failed = [r for r in rows if r.outcome == "failed"]
    if failed:
        ids = sorted({i for r in failed for i in r.violated})
        reasons.append(f"{len(failed)} item(s) failed" + (f", breaking {', '.join(ids)}" if ids else ""))
    if interrupted:
        reasons.append(interrupted)
    if reasons:
        return Verdict(NOT_CERTIFIED, profile, tuple(reasons), (), required)
    errors = [r for r in rows if r.outcome == "error"]
    if not any(r.outcome == "passed" for r in rows):
        why = f"no item passed, {len(errors)} scenario error(s)" if errors else "no item ran"
        return Verdict(NOT_CERTIFIED, profile, (why,), required, required)
    missing: list[str] = []
    for part in required:
        mine = [r for r in rows if r.part == part]
        if any(r.outcome == "passed" for r in mine):
            continue
        missing.append(part)
        if mine:
            reasons_seen = sorted({r.skip for r in mine if r.skip})
            why = f"every item skipped ({len(mine)})" + (f": {'; '.join(reasons_seen)}" if reasons_seen else "")
        else:
            why = (why_not_run or {}).get(part, "no item ran")
        reasons.append(f"{part} did not run ({why})")
    if errors:
        # a scenario that is itself wrong checked nothing: what it stands for did not run
        parts = sorted({r.part for r in errors})
        reasons.append(f"{len(errors)} scenario error(s) (mistakes in the scenario files, not violations by the "
                       "backend: fix them and rerun)")
        missing += [p for p in parts if p not in missing]
    if missing:
        return Verdict(PARTIAL, profile, tuple(reasons), tuple(missing), required)
    return Verdict(CERTIFIED, profile, (), (), required)


def overall(verdicts: Iterable[Verdict]) -> str:
    """The run's verdict: certified when every backend is, not certified when any is not,
    else partial (none when no backend ran)."""
    statuses = [v.status for v in verdicts]
    if not statuses or NOT_CERTIFIED in statuses:
        return NOT_CERTIFIED
    return CERTIFIED if all(s == CERTIFIED for s in statuses) else PARTIAL
