"""Mistakes in a scenario are the scenario's (issue 14): an unknown crash point, keyword
or requirement id, a crash armed and never reached, a story that checks the outcome of a
bot that died without restarting it, an exception of the scenario's own code. Each ends
its item as a *scenario error* naming the file, the line and the fix — never as a broken
requirement of the backend, and without a page of traceback. Run through pytester as
users run scenario folders."""

from __future__ import annotations

import json
import re

import pytest

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark", "--botmesh-backend=memory", "--botmesh-parts=scenarios",
       "--botmesh-scenarios=stories")

HEAD = '''
from botmesh_testkit.scenario import scenario


def echo_setup(s):
    @s.on_message
    async def echo(ctx):
        await ctx.reply(f"echo {ctx.text}")

'''

# each: (file body after HEAD, the line the error must name, what the message must say) —
# or (body, [(line, message), ...]) when the crash point decides which of them applies
MISTAKES = {
    "unknown_point": ('''
@scenario("GUAR-4")
async def story(s):
    echo_setup(s)
    await s.start(crash_after="outbox.mark_sentt")
    await s.receive("c1", "hi", id="m1")
''', 'await s.start(crash_after="outbox.mark_sentt")',
        "unknown crash point 'outbox.mark_sentt' (did you mean 'outbox.mark_sent'"),
    "unknown_keyword": ('''
@scenario("GUAR-4")
async def story(s):
    echo_setup(s)
    await s.start(crash_afterr="outbox.mark_sent")
''', 'await s.start(crash_afterr="outbox.mark_sent")',
        "start(): unknown keyword 'crash_afterr' (did you mean 'crash_after'"),
    "unknown_id": ('''
@scenario("OUT-99")
async def story(s):
    echo_setup(s)
    await s.start()
''', '@scenario("OUT-99")', "'OUT-99', which is not a requirement id of the spec (closest: OUT-"),
    "never_reached": ('''
@scenario("GUAR-4")
async def story(s):
    echo_setup(s)
    await s.start(crash_after="outbox.mark_sent#3")
    await s.receive("c1", "hi", id="m1")
    await s.drain()
    s.expect_delivered(["echo hi"])
''', 'await s.start(crash_after="outbox.mark_sent#3")', "armed a crash that was never reached"),
    "no_recover": ('''
@scenario("GUAR-4", crash="every")
async def story(s):
    echo_setup(s)
    await s.start()
    await s.receive("c1", "hi", id="m1")
    await s.drain()
    s.expect_delivered(["echo hi"])
''', [('s.expect_delivered(["echo hi"])', "checked while the bot was dead"),
          # where the check passed (the reply went out before the death), the story ends dead
          ('@scenario("GUAR-4", crash="every")', "the story ends with the bot dead")]),
    "own_code": ('''
@scenario("GUAR-4")
async def story(s):
    echo_setup(s)
    await s.start()
    await s.receive("c1", "hi", id="m1")
    s.expect_delivered(deliverd)
''', "s.expect_delivered(deliverd)", "NameError: name 'deliverd' is not defined"),
}


def _line_of(body: str, text: str) -> int:
    lines = (HEAD + body).splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


@pytest.mark.spec("TEST-3")
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_scenario_mistake_is_a_scenario_error(pytester: pytest.Pytester, name: str) -> None:
    body, *rest = MISTAKES[name]
    expected = rest[0] if len(rest) == 1 else [tuple(rest)]
    pytester.mkdir("stories")
    (pytester.path / "stories" / f"{name}.py").write_text(HEAD + body)
    # the shipped GUAR scenarios run beside it and pass: the verdict is partial, not broken
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-report=report.json")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    wanted = [(f"stories/{name}.py:{_line_of(body, at)}: ", says) for at, says in expected]
    lines = [line for line in out.splitlines() if line.startswith("scenario error (a mistake in the scenario")]
    assert lines, out[-3000:]
    assert all(any(where in line and says in line for where, says in wanted) for line in lines), (wanted, lines)
    # no traceback of the library, no broken requirement
    assert "Traceback" not in out and "botmesh_testkit/scenario/api.py" not in out
    assert "BROKEN" not in out, out[-2000:]
    assert re.search(r"memory: scenarios \d+ passed, 0 failed, \d+ scenario error\(s\)", out), out[-2000:]
    entry = json.loads((pytester.path / "report.json").read_text())["backends"][0]
    assert entry["broken"] == [] and entry["verdict"] == "partial", entry
    assert "scenario error(s)" in entry["verdict_reasons"][-1]


@pytest.mark.spec("GUAR-4", "TEST-3")
def test_a_correct_story_next_to_them_still_passes_and_genuine_failures_stay_failures(pytester: pytest.Pytester) -> None:
    """The rules do not swallow real failures: a backend that forgets ``mark_sent`` still
    breaks GUAR-4 through a correct story (restart, redeliver, check)."""
    pytester.makepyfile(thirdparty='''
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_STORES = {}


class ForgetsSent(KvDurability):
    async def outbox_mark_sent(self, scope, key, **kwargs):
        return True


def make(workdir):
    return ForgetsSent(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)
''')
    pytester.mkdir("stories")
    (pytester.path / "stories" / "good.py").write_text(HEAD + '''
@scenario("GUAR-4", policies=["resend"])
async def story(s):
    echo_setup(s)
    await s.start(crash_after="outbox.mark_sent")
    await s.receive("c1", "hi", id="m1")
    s.expect_crashed()
    await s.recover()
    s.expect_delivered(["echo hi"])
''')
    good = pytester.runpytest_subprocess(*RUN, "-k", "story")
    good.assert_outcomes(passed=1)
    bad = pytester.runpytest_subprocess(*RUN[:-3], "--botmesh-backend=thirdparty:make", "--botmesh-parts=scenarios",
                                        "--botmesh-scenarios=stories", "-k", "story")
    bad.assert_outcomes(failed=1)
    out = bad.stdout.str()
    assert "scenario error" not in out
    bad.stdout.fnmatch_lines(["*FAILED: [[]GUAR-4[]] delivered ['echo hi', 'echo hi'*", "*BROKEN*GUAR-4 in 1 item(s)*"])
