"""The ``botmesh.events`` backends certified the way a user certifies one (issue 15):
``pytest --botmesh-backend=NAME --botmesh-matrix=full`` in a fresh directory (pytester, a
subprocess), every part — the conformance suites (the real multi-process items for the
shared journals), the GUAR scenarios, the crash matrix with its power-cut states, explore,
the real kill loops, the power cuts and the I/O-error loop. Each must end ``verdict:
certified at profile full``.

Cost: a few minutes per backend on a 2-CPU machine at ``full`` (the matrix's 700-odd
cells and the kill and power-cut loops), hence ``slow`` like tests/test_certification.py.
CI runs ``events-shared+log`` (the one that has every moving part: several processes, the
mutex, the append log) at ``full`` and the two others at ``smoke``, to keep the whole run
near half an hour; ``BOTMESH_EVENTS_FULL=1`` runs all three at ``full``."""

from __future__ import annotations

import os
import re

import pytest

pytest_plugins = ["pytester"]

PARTS = {"suite", "scenarios", "matrix", "explore", "kills", "powercuts", "corruption"}


@pytest.mark.slow
@pytest.mark.spec("BACK-7", "TEST-4", "GUAR-1", "GUAR-3", "EVENTS-1", "EVENTS-2", "EVENTS-3", "EVENTS-4", "EVENTS-5",
                  "REPL-4")
@pytest.mark.parametrize("backend", ["events", "events-shared", "events-shared+log"])
def test_event_journal_backends_pass_the_certification(pytester: pytest.Pytester, backend: str) -> None:
    full = backend == "events-shared+log" or os.environ.get("BOTMESH_EVENTS_FULL") == "1"
    profile = "full" if full else "smoke"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--botmesh-backend={backend}",
                                           f"--botmesh-matrix={profile}", "--botmesh-seed=20261205", "-rs",
                                           timeout=3600)
    line = next((ln for ln in result.outlines if ln.startswith(f"{backend}: ")), "")
    parts = dict(re.findall(r"(\w+) (\d+ passed, \d+ failed(?:, \d+ skipped)?)", line))
    print("\n".join(result.outlines[-14:]))
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    assert PARTS <= set(parts), parts  # and any part a later release adds (it must pass too)
    assert all(re.fullmatch(r"\d+ passed, 0 failed(, \d+ skipped)?", v) for v in parts.values()), parts
    assert parts["kills"] == "2 passed, 0 failed"
    assert re.fullmatch(r"[3-9] passed, 0 failed", parts["powercuts"]), parts  # a loop per policy, the I/O-error loop ...
    result.stdout.fnmatch_lines([f"*verdict: certified at profile {profile} (suite, scenarios, matrix, explore, kills, "
                                 "powercuts*)*"])
    skips = [ln for ln in result.outlines if ln.startswith("SKIPPED")]
    if backend == "events":  # one process: the only claim it does not make
        assert skips and all("capability not claimed: multi_process" in ln for ln in skips), skips
    else:  # several processes of one host: the multi-process items run, nothing is skipped
        assert not skips, skips
        assert result.parseoutcomes().get("skipped", 0) == 0
