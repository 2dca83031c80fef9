"""The spec ships in the package and explains every id (issue 14, "the spec inside the
project"): ``botmesh_testkit.requirements`` parses it, ``botmesh-testkit spec`` prints it,
and every id the shipped code, scenarios and matrices name is one the spec defines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from botmesh_testkit.requirements import requirements, suggest, title, unknown

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("ENABLE", "INB", "OUT", "LEASE", "SCOPE", "CONF", "GUAR", "RETRY", "OPS", "MEDIA", "REPL", "BACK",
            "EVENTS", "FLOW", "TEST")
CITED = re.compile(r"\b(?:" + "|".join(PREFIXES) + r")-\d+\b")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "botmesh_testkit.cli", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_both_kinds_of_definition_are_parsed() -> None:
    """List items (``- INB-8. ...``) and rows of the crash table (``| GUAR-3 | ... |``)."""
    reqs = requirements()
    assert reqs["INB-8"].section.startswith("INB")
    assert reqs["INB-8"].text.startswith("Fail closed: when the journal cannot record an inbound event")
    # continuation lines are joined: the last words of INB-8's item are part of its text
    assert "forgets" in reqs["INB-8"].text
    assert reqs["GUAR-3"].section.startswith("GUAR")
    assert "ambiguous" in reqs["GUAR-3"].text and '"calling the provider"' in reqs["GUAR-3"].text
    assert [k for k in reqs if k.startswith("GUAR-")] == [f"GUAR-{n}" for n in range(1, 8)]
    # a title is one line, cut short
    assert all("\n" not in r.title and len(r.title) <= 90 for r in reqs.values())


def test_every_id_the_shipped_code_names_is_defined() -> None:
    """An id cited in the packages, the shipped scenarios or the matrices that the spec does
    not define is a typo a report would print as a requirement held or broken."""
    cited: dict[str, set[str]] = {}
    for folder in ("botmesh_testkit", "reference_impl", "scenarios", "matrices"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".toml", ".md"} and path.name != "durability.md":
                for rid in CITED.findall(path.read_text(encoding="utf-8")):
                    cited.setdefault(rid, set()).add(str(path.relative_to(ROOT)))
    assert len(cited) > 40  # the scan found the citations at all
    missing = {rid: sorted(where) for rid, where in cited.items() if unknown([rid])}
    assert not missing, missing


def test_unknown_ids_and_suggestions() -> None:
    assert unknown(["OUT-2", "OUT-99", "GAUR-4"]) == ["OUT-99", "GAUR-4"]
    assert suggest("GAUR-4")[0] == "GUAR-4"
    assert all(s.startswith("OUT-") for s in suggest("OUT-99"))
    assert title("OUT-99") == "(not in the spec)"


def test_cli_prints_a_requirement_and_refuses_an_unknown_id() -> None:
    ok = _cli("spec", "inb-8", "GUAR-4")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("INB-8 (INB")
    assert "Fail closed" in ok.stdout and "GUAR-4 (GUAR" in ok.stdout
    bad = _cli("spec", "OUT-2", "GAUR-4")
    assert bad.returncode == 2 and bad.stdout == ""  # nothing printed in part
    assert "'GAUR-4' is not a requirement id of the spec (closest: GUAR-4" in bad.stderr


def test_cli_lists_every_id_by_section() -> None:
    out = _cli("spec")
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^  ([A-Z]+-\d+) ", out.stdout, re.M)
    assert listed == list(requirements())
    assert "GUAR — what is guaranteed (the crash table):" in out.stdout.splitlines()


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md"])
def test_the_docs_refer_to_nothing_outside_the_repository(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert "shared/" not in text and "../seed" not in text


def test_the_cli_called_in_process_leaves_the_botmesh_logger_as_it_found_it() -> None:
    """``main()`` quiets the engine's warnings for its own run only: a test or script that
    calls it in-process still sees botmesh's warnings afterwards (a caplog test that ran
    after the CLI in the same worker used to see none)."""
    import logging

    from botmesh_testkit.cli import main

    logger = logging.getLogger("botmesh")
    before = logger.level
    assert main(["spec", "INB-1"]) == 0
    assert logger.level == before
