"""The smaller points of issue 14 (item 12), each as users meet it: pytest's "collected N
items" counts the plugin's items; the CLI's errors name the CLI's options (``--report``,
not the plugin's ``--botmesh-report``); ``botmesh-testkit run -n 2`` says "bringing up
nodes..." once; the installed ``pytest --help`` says nothing about this repository's
``.ci/run``; failures of one scenario under two policies have distinct header lines; a
kill report with more ambiguous sends than it lists says how many more."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from botmesh_testkit.checker.judge import Accounting
from botmesh_testkit.cli import main
from botmesh_testkit.kill.result import KillResult

from conftest import collected_parts

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")


@pytest.mark.spec("BACK-7", "TEST-3")
def test_pytests_collected_count_is_the_plugins_count(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_own="def test_mine():\n    pass\n")
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=memory", "--botmesh-parts=suite,scenarios",
                                           "--co")
    out = result.stdout.str()
    collected = re.search(r"^collected (\d+) items$", out, re.M)
    assert collected, out[-2000:]
    parts = collected_parts(out)
    assert int(collected.group(1)) == parts["all"] == parts["suite"] + parts["scenarios"] + parts["tests"], out[-2000:]


@pytest.mark.spec("TEST-4")
@pytest.mark.parametrize(("args", "says"), [
    (["--report", "{tmp}/nowhere/r.json"], "botmesh-testkit: --report: the directory of '{tmp}/nowhere/r.json'"),
    (["--report", "{tmp}"], "botmesh-testkit: --report: '{tmp}' is a directory"),
    (["--parts", "suite,everything"], "botmesh-testkit: --parts: 'suite,everything': choose from suite, scenarios"),
    (["--scenarios", "{tmp}/nowhere"], "botmesh-testkit: --scenarios: '{tmp}/nowhere' is not a directory"),
])
def test_cli_errors_name_the_cli_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                         says: str) -> None:
    code = main(["run", "--backend", "memory", *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert code == 2
    assert says.format(tmp=tmp_path) in err, err
    assert "--botmesh-" not in err, err


@pytest.mark.spec("TEST-4")
def test_the_cli_under_xdist_brings_up_its_nodes_once(tmp_path: Path) -> None:
    cli = Path(sys.executable).with_name("botmesh-testkit")
    done = subprocess.run([str(cli), "run", "--backend", "memory", "--parts", "scenarios", "-n", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("bringing up nodes...") <= 1, done.stdout[:2000]
    assert re.search(r"^2 workers \[\d+ items\]$", done.stdout, re.M), done.stdout[:2000]


@pytest.mark.spec("TEST-4")
def test_pytest_help_does_not_refer_to_this_repositorys_ci_script(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    out = result.stdout.str()
    assert "--botmesh-require-services" in out and "--botmesh-item-timeout" in out
    assert ".ci/" not in out, [line for line in out.splitlines() if ".ci/" in line]


@pytest.mark.spec("TEST-3")
def test_failures_of_one_scenario_under_two_policies_have_distinct_headers(pytester: pytest.Pytester) -> None:
    pytester.mkdir("stories")
    (pytester.path / "stories" / "twice.py").write_text('''
from botmesh_testkit.scenario import scenario


@scenario("GUAR-3", policies=["skip", "resend"])
async def story(s):
    await s.start()
    s.expect(False, "fails under every policy")
''')
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=memory", "--botmesh-parts=scenarios",
                                           "--botmesh-scenarios=stories", "-k", "story")
    result.assert_outcomes(failed=2)
    headers = re.findall(r"^_{3,} (.+?) _{3,}$", result.stdout.str(), re.M)
    assert len(headers) == 2 and len(set(headers)) == 2, headers
    assert all("skip" in h or "resend" in h for h in headers), headers


@pytest.mark.spec("TEST-3", "OUT-14")
def test_a_kill_report_says_how_many_ambiguous_sends_it_does_not_list() -> None:
    sends = [f"m{i}:1 in c1" for i in range(24)]
    result = KillResult(backend="sqlite", policy="skip", seed=1, params={}, kills=[], self_deaths=0, incarnations=1,
                        messages=24, acked=24, feeds=24, deliveries=24, distinct_keys=24, inbox_states={},
                        outbox_states={}, violations=[], accounting=Accounting(ambiguous=sends), seconds=1.0,
                        kill_phase_seconds=1.0, reproduce="")
    lines = result.report().splitlines()
    start = lines.index("  ambiguous sends: 24")
    listed = [line for line in lines[start + 1:] if line.startswith("    m")]
    assert len(listed) == 20
    assert lines[start + 21] == "    ... and 4 more"
