"""The certification report (``--botmesh-report``): the artifact a backend's author
publishes — backend, versions, claims, guarantees held and broken, seed — tested the way
a third party runs it (pytester, a subprocess)."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
from conftest import collected_parts, shipped_scenario_files

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")
MEMORY = ("--botmesh-backend=memory", "--botmesh-parts=suite,scenarios,matrix,explore", "--botmesh-seed=11")
"""Every part the memory backend's claims require (it claims nothing: no kill loop)."""

BROKEN = '''
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_STORES = {}


class ForgetsSent(KvDurability):
    """Acknowledges mark_sent without writing it."""

    async def outbox_mark_sent(self, scope, key, **kwargs):
        return True


def make(workdir):
    return ForgetsSent(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)
'''

NO_POSTGRES = '''
import botmesh_testkit.servers as services


def _unavailable(url=None, *, require=False):
    raise services.ServiceUnavailable("postgres", [services.Attempt("test", "no server here")], required=require)


services.provision_postgres = _unavailable
'''


def _load(pytester: pytest.Pytester, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((pytester.path / name).read_text(encoding="utf-8"))
    return data


def _backend(report: dict[str, Any], name: str) -> dict[str, Any]:
    (entry,) = [b for b in report["backends"] if b["name"] == name]
    return entry


@pytest.mark.spec("TEST-4", "BACK-7")
def test_a_json_report_of_a_certified_backend(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(*RUN, *MEMORY, "--botmesh-report=r.json",
                                           "--botmesh-redis-url=redis://bob:hunter2@127.0.0.1:1/0")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"botmesh report written to {pytester.path / 'r.json'}"])
    outcomes = result.parseoutcomes()
    report = _load(pytester, "r.json")
    assert report["format"] == "botmesh-certification-report/1"
    assert report["verdict"] == "certified"
    assert report["seed"] == 11
    assert report["parts"] == ["suite", "scenarios", "matrix", "explore"]
    assert report["matrix"]["name"] == "smoke" and "random cells" in report["matrix"]["description"]
    assert report["date"].endswith("+00:00")
    assert report["exit_status"] == 0
    assert {"botmesh-testkit", "python", "pytest", "platform"} <= set(report["versions"])
    assert "--botmesh-seed=11" in report["command"] and "--botmesh-report=r.json" in report["command"]
    assert "hunter2" not in json.dumps(report) and "redis://bob:***@127.0.0.1:1/0" in report["command"]
    memory = _backend(report, "memory")
    assert memory["verdict"] == "certified" and memory["verdict_reasons"] == []
    assert memory["claims"] == {"survives_crash": False, "multi_process": False, "multi_host": False, "shared": False}
    collected = collected_parts(result.stdout.str())
    assert collected["scenarios"] >= len(shipped_scenario_files())
    assert memory["parts"]["scenarios"] == {"passed": collected["scenarios"], "failed": 0, "skipped": 0}
    suite = memory["parts"]["suite"]
    # 9: four need survives_crash (the claims check among them), five multi_process (four of
    # the durability suite, one of the kv suite)
    assert suite["failed"] == 0 and suite["skipped"] == outcomes["skipped"] == 9
    assert suite["passed"] + collected["scenarios"] + collected["matrix"] + collected["explore"] == outcomes["passed"]
    assert memory["parts"]["explore"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert memory["parts"]["matrix"] == {"passed": collected["matrix"], "failed": 0, "skipped": 0}
    assert memory["profile"] == "smoke" and memory["required_parts"] == ["suite", "scenarios", "matrix", "explore"]
    assert memory["verdict_line"].startswith("certified at profile smoke")
    assert {"GUAR-3", "GUAR-4", "OUT-2"} <= set(memory["held"]) and memory["broken"] == []
    # the suite's skips, grouped by reason, name the claim memory does not make
    assert sum(s["count"] for s in memory["skips"]) == 9
    assert all(s["reason"].startswith("capability not claimed: ") and s["parts"] == ["suite"]
               for s in memory["skips"])
    assert {s["reason"] for s in memory["skips"]} == {"capability not claimed: survives_crash",
                                                      "capability not claimed: multi_process"}
    assert memory["service_skip"] is None and memory["kill_loops"] == []
    # the explore run's headline is the explore part's, not a kill loop's
    assert len(memory["explore"]) == 1 and memory["explore"][0].startswith("explore on memory, seed 11: ")
    # the matrix cell by cell (the HTML report's grid): one record per item, one line each
    cells = memory["matrix_cells"]
    assert len(cells) == collected["matrix"] == len({c["id"] for c in cells})
    assert {c["outcome"] for c in cells} == {"passed"} and {c["workload"] for c in cells} == set(report["matrix"]["workloads"])
    assert {c["policy"] for c in cells} == set(report["matrix"]["policies"]) == {"skip", "resend"}
    for c in cells:
        assert c["reproduce"] == f"botmesh-testkit run --backend memory --seed 11 --cell {shlex.quote(c['id'])}"
        assert c["id"] == f"memory/{c['workload']}/{c['policy']}/{c['at']}" and isinstance(c["deliveries"], list)
    lines = (pytester.path / "r.json").read_text(encoding="utf-8").splitlines()
    assert sum(line.lstrip().startswith('{"id": "memory/') for line in lines) == len(cells)


@pytest.mark.spec("TEST-4", "BACK-7", "OUT-2", "GUAR-4")
def test_a_broken_third_party_backend_is_not_certified(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=BROKEN)
    pytester.mkdir("out")
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:make", "--botmesh-parts=scenarios",
                                           "--botmesh-seed=3", "--botmesh-report=out/r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["botmesh report written to *r.json"])
    report = _load(pytester, "out/r.json")
    assert report["verdict"] == "not certified"
    entry = _backend(report, "thirdparty:make")
    assert entry["verdict"] == "not certified"
    failed = entry["parts"]["scenarios"]["failed"]
    assert failed > 0 and entry["verdict_reasons"][0].startswith(f"{failed} item(s) failed, breaking ")
    assert "GUAR-4" in entry["broken"] and "OUT-2" in entry["broken"]
    assert entry["broken_items"]["GUAR-4"] >= 1
    assert not set(entry["broken"]) & set(entry["held"])
    # a KvDurability claims nothing unless told; the factory's module is not an installed distribution
    assert entry["claims"]["shared"] is False
    assert entry["versions"] == {"thirdparty": "not from an installed distribution"}
    assert report["seed"] == 3
    assert entry["matrix_cells"] == []  # no matrix in this run


@pytest.mark.spec("TEST-4", "BACK-7")
def test_a_markdown_report_has_a_table_per_backend(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nbotmesh_report = cert.md\n")
    result = pytester.runpytest_subprocess(*RUN, *MEMORY)
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"botmesh report written to {pytester.path / 'cert.md'}"])
    text = (pytester.path / "cert.md").read_text(encoding="utf-8")
    assert text.startswith("# botmesh certification report")
    assert "**Verdict: certified**" in text
    assert "## Backend `memory`: certified at profile smoke" in text
    scenarios = collected_parts(result.stdout.str())["scenarios"]
    for row in ("| claims | survives_crash no, multi_process no, multi_host no, shared no |",
                f"| scenarios | {scenarios} passed, 0 failed, 0 skipped |",
                "| broken (0) | — |",
                "| seed | 11 |",
                "| skipped ×5 (suite) | capability not claimed: multi_process |"):
        assert row in text, row
    assert "| held (" in text and "GUAR-4" in text
    assert "| pytest |" in text and "| botmesh-testkit |" in text
    assert "--botmesh-seed=11" in text


@pytest.mark.spec("TEST-4", "BACK-7")
def test_a_report_in_a_directory_that_does_not_exist_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=memory", "--botmesh-report=nowhere/r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--botmesh-report: the directory of 'nowhere/r.json' (*nowhere*) does not exist*"])
    pytester.mkdir("adir")
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=memory", "--botmesh-report=adir")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--botmesh-report: 'adir' is a directory*"])
    pytester.makeini("[pytest]\nbotmesh_report = missing/r.md\n")
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=memory")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*botmesh_report (ini): the directory of 'missing/r.md'*does not exist*"])


@pytest.mark.spec("TEST-4", "BACK-7")
def test_a_backend_whose_server_is_missing_is_not_certified(pytester: pytest.Pytester,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOTMESH_REQUIRE_SERVICES", raising=False)  # .ci/run sets it; this run must be allowed to skip
    pytester.makeconftest(NO_POSTGRES)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=postgres", "--botmesh-backend=memory",
                                           "--botmesh-parts=scenarios", "--botmesh-report=r.json",
                                           "--botmesh-seed=2")
    assert result.ret == 0
    report = _load(pytester, "r.json")
    assert report["verdict"] == "not certified"
    assert _backend(report, "memory")["verdict"] == "partial"  # only its scenarios ran
    postgres = _backend(report, "postgres")
    assert postgres["verdict"] == "not certified"
    assert postgres["claims"] == "unknown" and "no server could be provisioned" in postgres["claims_error"]
    assert "no server could be provisioned" in postgres["service_skip"]
    assert postgres["verdict_reasons"][0].startswith("service skipped: ")
    assert postgres["parts"] == {} and "psycopg" in postgres["versions"]


@pytest.mark.spec("TEST-4", "BACK-7")
def test_the_report_is_complete_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    plain = pytester.runpytest_subprocess(*RUN, *MEMORY, "--botmesh-report=plain.json")
    assert plain.ret == 0
    spread = pytester.runpytest_subprocess(*RUN, *MEMORY, "--botmesh-report=spread.json", "-n", "2")
    assert spread.ret == 0
    spread.stdout.fnmatch_lines(["botmesh report written to *spread.json"])
    one, two = _load(pytester, "plain.json"), _load(pytester, "spread.json")
    assert two["verdict"] == "certified" and two["seed"] == 11
    for key in ("parts", "totals", "held", "broken", "skips", "claims", "verdict"):
        assert _backend(one, "memory")[key] == _backend(two, "memory")[key], key
    # the cells came back from the workers, in the dry runs' order
    cells = [[(c["id"], c["outcome"], c["history"]) for c in _backend(r, "memory")["matrix_cells"]] for r in (one, two)]
    assert cells[0] == cells[1] and len(cells[0]) == _backend(one, "memory")["parts"]["matrix"]["passed"]
    assert two["versions"]["pytest-xdist"]
    assert " -n 2" in two["command"]


@pytest.mark.spec("TEST-4", "BACK-7")
def test_the_cli_passes_report_through(pytester: pytest.Pytester) -> None:
    import sys

    result = pytester.run(sys.executable, "-m", "botmesh_testkit.cli", "run", "--backend", "memory",
                          "--parts", "scenarios", "--seed", "6", "--report", "cli.json", "-q")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"botmesh report written to {pytester.path / 'cli.json'}"])
    report = _load(pytester, "cli.json")
    assert report["verdict"] == "partial" and report["seed"] == 6  # --parts scenarios: suite and matrix missing
    scenarios = collected_parts(result.stdout.str())["scenarios"]
    assert _backend(report, "memory")["parts"] == {"scenarios": {"passed": scenarios, "failed": 0, "skipped": 0}}
    assert _backend(report, "memory")["missing_parts"] == ["suite", "matrix", "explore"]
    assert "run --backend memory --parts scenarios --seed 6 --report cli.json" in report["command"]


GOOD_KV = '''
from botmesh.core.memory import MemoryKv

_STORES = {}


def make(workdir):
    return _STORES.setdefault(workdir, MemoryKv())
'''


@pytest.mark.spec("TEST-4", "BACK-7")
@pytest.mark.parametrize("parts", ["scenarios", "scenarios,matrix,kills"])
def test_a_run_that_leaves_out_a_required_part_is_partial_not_certified(pytester: pytest.Pytester, parts: str) -> None:
    """Whatever passed, a run without the suite proves nothing about the contract
    sentence by sentence (a CAS that ignores its expected version, say): the verdict is
    partial, naming what did not run — never certified."""
    pytester.makepyfile(thirdparty=GOOD_KV)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:make", f"--botmesh-parts={parts}",
                                           "--botmesh-seed=5", "--botmesh-report=r.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    report = _load(pytester, "r.json")
    entry = _backend(report, "thirdparty:make")
    assert entry["verdict"] == "partial" and report["verdict"] == "partial"
    assert "suite" in entry["missing_parts"]
    assert "suite did not run (not selected with --botmesh-parts)" in entry["verdict_reasons"]
    result.stdout.fnmatch_lines(["*verdict: partial at profile smoke: suite did not run (not selected with --botmesh-parts)*"])


@pytest.mark.spec("TEST-4", "BACK-7", "GUAR-1")
def test_a_backend_claiming_survives_crash_needs_its_kill_loops(pytester: pytest.Pytester) -> None:
    """sqlite claims survives_crash: a run without kill loops (a profile with kills = 0)
    is partial and says why; memory claims nothing and is certified by the same run."""
    pytester.makefile(".toml", nokills='description = "no kill loops"\nworkloads = ["one-send"]\nexplore_examples = 10\n')
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=sqlite", "--botmesh-backend=memory",
                                           "--botmesh-matrix=nokills.toml", "--botmesh-seed=5", "--botmesh-report=r.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    report = _load(pytester, "r.json")
    sqlite, memory = _backend(report, "sqlite"), _backend(report, "memory")
    assert sqlite["verdict"] == "partial" and sqlite["missing_parts"] == ["kills", "powercuts", "corruption"]
    assert sqlite["verdict_reasons"] == ["kills did not run (profile 'nokills' has no kill loops (kills = 0))",
                                         "powercuts did not run (profile 'nokills' has no power cuts (power_cuts = 0), "
                                         "no held-operation sweep (held_ops = 0) and no I/O-error loop)",
                                         "corruption did not run (profile 'nokills' damages no files "
                                         "(corruption_variants = 0))"]
    assert memory["verdict"] == "certified" and memory["required_parts"] == ["suite", "scenarios", "matrix", "explore"]
    assert report["verdict"] == "partial"
