"""The built-in backends certified the way a user certifies one: ``pytest
--botmesh-backend=NAME`` in a fresh directory (pytester, a subprocess), with every part —
the conformance suites, the GUAR scenarios, the crash matrix, the real kill loops and the
power cuts (for PostgreSQL and Redis on a private server whose data directory is on the
power-cut file system), and for the embedded ones the I/O-error loop. ``full`` (every crash point
of every workload, 25 random cells per workload, 50 SIGKILLs and 100 power cuts per
policy) for the durable backends, ``smoke`` for snapshot-only files. Each must end
``verdict: certified`` at its profile.

PostgreSQL and Redis run under ``--botmesh-require-services``: a server that cannot be
provisioned fails the test instead of skipping it, and the run must skip nothing (both
backends claim every capability the suites check)."""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]


def certify(pytester: pytest.Pytester, backend: str, profile: str, *extra: str) -> tuple[pytest.RunResult, dict[str, str]]:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--botmesh-backend={backend}",
                                           f"--botmesh-matrix={profile}", "--botmesh-seed=20261202", "-rs", *extra,
                                           timeout=1500)
    line = next((ln for ln in result.outlines if ln.startswith(f"{backend}: ")), "")
    parts = dict(re.findall(r"(suite|scenarios|matrix|explore|kills|powercuts|corruption) "
                            r"(\d+ passed, \d+ failed(?:, \d+ skipped)?)", line))
    print("\n".join(result.outlines[-12:]))
    return result, parts


@pytest.mark.slow
@pytest.mark.spec("BACK-7", "TEST-4", "GUAR-1", "GUAR-3", "OUT-14")
@pytest.mark.parametrize("backend", ["file+log", "sqlite"])
def test_local_durable_backends_pass_the_full_certification(pytester: pytest.Pytester, backend: str) -> None:
    result, parts = certify(pytester, backend, "full")
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    assert set(parts) == {"suite", "scenarios", "matrix", "explore", "kills", "powercuts", "corruption"}, parts
    assert all(" 0 failed" in v for v in parts.values()), parts
    assert parts["corruption"] == "1 passed, 0 failed"
    assert parts["kills"] == "2 passed, 0 failed"
    # a power-cut loop per policy, the held-operation sweep, the I/O-error loop
    assert parts["powercuts"] == "4 passed, 0 failed"
    result.stdout.fnmatch_lines(["*verdict: certified at profile full (suite, scenarios, matrix, explore, kills, powercuts, "
                                  "corruption)*"])
    # whatever is skipped is a capability the backend does not claim
    skips = [ln for ln in result.outlines if ln.startswith("SKIPPED")]
    assert all("capability not claimed: multi_process" in ln for ln in skips), skips
    assert backend != "sqlite" or not skips


@pytest.mark.slow
@pytest.mark.spec("BACK-7", "TEST-4")
def test_snapshot_file_backend_passes_the_smoke_certification(pytester: pytest.Pytester) -> None:
    result, parts = certify(pytester, "file", "smoke")
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    assert all(" 0 failed" in v for v in parts.values()) and {"kills", "powercuts", "corruption"} <= set(parts), parts
    result.stdout.fnmatch_lines(["*verdict: certified at profile smoke (suite, scenarios, matrix, explore, kills, powercuts, "
                                  "corruption)*"])


@pytest.mark.slow
@pytest.mark.spec("BACK-2", "BACK-3", "BACK-7", "TEST-4", "REPL-4")
@pytest.mark.parametrize("backend", ["postgres", "redis"])
def test_shared_backends_pass_the_full_certification_with_zero_skips(pytester: pytest.Pytester, backend: str) -> None:
    result, parts = certify(pytester, backend, "full", "--botmesh-require-services")
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    assert set(parts) == {"suite", "scenarios", "matrix", "explore", "kills", "powercuts"}, parts
    assert all(re.fullmatch(r"\d+ passed, 0 failed", v) for v in parts.values()), parts
    assert parts["powercuts"] == "2 passed, 0 failed"  # a private server on the mount, per policy
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) == 0 and outcomes["passed"] > 600, outcomes
    result.stdout.fnmatch_lines(["*verdict: certified at profile full (suite, scenarios, matrix, explore, kills, powercuts; "
                                  "corruption not applicable (its storage is not files in the workdir))*"])
