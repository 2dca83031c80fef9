"""A failing scenario breaks the ids its failing expectation names (issue 14, point 11):
``s.expect(..., ids=["OPS-1"])`` that fails reports OPS-1 broken and leaves the scenario's
other ids held; an expectation without ``ids=`` breaks every id of the scenario, as
before. ``ids=`` naming an id the spec does not define, or one the scenario does not
list, is a scenario error. Run through pytester as users run scenario folders."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark", "--botmesh-backend=memory", "--botmesh-parts=scenarios",
       "--botmesh-scenarios=stories", "--botmesh-report=report.json", "-k", "story")

STORY = '''
from botmesh_testkit.scenario import scenario


@scenario("GUAR-4", "OPS-1")
async def story(s):
    @s.on_message
    async def echo(ctx):
        await ctx.reply(f"echo {{ctx.text}}")

    await s.start()
    await s.receive("c1", "hi", id="m1")
    await s.drain()
    s.expect_delivered(["echo hi"])
    s.expect(s.metrics()["outbox_ambiguous"] == 7, "outbox_ambiguous is not 7"{ids})
'''


def _run(pytester: pytest.Pytester, ids: str) -> tuple[pytest.RunResult, dict[str, object]]:
    pytester.mkdir("stories")
    (pytester.path / "stories" / "exact.py").write_text(STORY.format(ids=ids))
    result = pytester.runpytest_subprocess(*RUN)
    return result, json.loads((pytester.path / "report.json").read_text())["backends"][0]


@pytest.mark.spec("OPS-1", "TEST-3")
def test_a_failed_expectation_breaks_only_the_ids_it_names(pytester: pytest.Pytester) -> None:
    result, entry = _run(pytester, ', ids=["OPS-1"]')
    result.assert_outcomes(failed=1)
    assert entry["broken"] == ["OPS-1"], entry
    assert "GUAR-4" in entry["held"], entry
    [failed] = entry["failed_items"]
    assert failed["violated"] == ["OPS-1"] and "[OPS-1] outbox_ambiguous is not 7" in failed["message"], failed


@pytest.mark.spec("TEST-3")
def test_without_ids_a_failed_expectation_breaks_every_id_of_the_scenario(pytester: pytest.Pytester) -> None:
    result, entry = _run(pytester, "")
    result.assert_outcomes(failed=1)
    assert entry["broken"] == ["GUAR-4", "OPS-1"], entry


@pytest.mark.spec("TEST-3")
@pytest.mark.parametrize(("ids", "says"), [
    (', ids=["OPS-99"]', "'OPS-99' is not a requirement id of the spec"),
    (', ids=["GUAR-3"]', "'GUAR-3' is not among this scenario's ids (GUAR-4, OPS-1)"),
])
def test_ids_the_spec_or_the_scenario_does_not_have_are_a_scenario_error(pytester: pytest.Pytester, ids: str,
                                                                         says: str) -> None:
    result, entry = _run(pytester, ids)
    out = result.stdout.str()
    assert "scenario error (a mistake in the scenario" in out and says in out, out[-3000:]
    assert "stories/exact.py:15: " in out, out[-3000:]
    assert entry["broken"] == [], entry
