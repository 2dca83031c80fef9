"""Scenarios (the GUAR table as runnable stories, and users' own folders), run by the
plugin the way a user runs them: pytester in a subprocess."""

from __future__ import annotations

import pytest
from conftest import collected_parts, shipped_scenario_files

from botmesh_testkit.scenario import scenario

pytest_plugins = ["pytester"]

ECHO = '''
from botmesh_testkit.scenario import scenario


@scenario("GUAR-4", policies=["skip", "resend"])
async def crash_after_recording_the_send(s):
    @s.on_message
    async def echo(ctx):
        await ctx.reply(f"echo {ctx.text}")

    await s.start(crash_after="outbox.mark_sent")
    await s.receive("c1", "hi", id="m1")
    s.expect_crashed()
    await s.restart()
    await s.receive("c1", "hi", id="m1")
    await s.drain()
    s.expect_delivered(["echo hi"])


@scenario("INB-4", requires=["survives_crash"])
async def needs_a_durable_backend(s):
    await s.start()
    s.expect(s.capabilities.survives_crash, "the backend should survive a crash")
'''

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

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")


@pytest.mark.spec("GUAR-4", "TEST-3")
def test_a_folder_of_scenarios_runs_per_backend_and_policy(pytester: pytest.Pytester) -> None:
    pytester.mkdir("stories")
    (pytester.path / "stories" / "echo.py").write_text(ECHO)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-scenarios=stories", "-v")
    # no --botmesh-backend: the default backend, sqlite, which claims survives_crash
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*stories/echo.py::crash_after_recording_the_send[[]sqlite-skip[]] PASSED*",
                                 "*needs_a_durable_backend[[]sqlite[]] PASSED*"])
    memory = pytester.runpytest_subprocess(*RUN, "--botmesh-scenarios=stories", "--botmesh-backend=memory",
                                           "--botmesh-parts=scenarios", "-rs")
    # the shipped GUAR scenarios run too; of the folder's three items, the one needing
    # survives_crash is skipped
    shipped = collected_parts(memory.stdout.str())["scenarios"] - 3
    assert shipped >= len(shipped_scenario_files())
    memory.assert_outcomes(passed=shipped + 2, skipped=1)
    memory.stdout.fnmatch_lines(["*capability not claimed: survives_crash (backend memory)*"])


@pytest.mark.spec("GUAR-2", "GUAR-3", "GUAR-4", "OUT-2")
def test_a_broken_backend_fails_the_guar_scenarios_naming_ids_and_a_rerun(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=BROKEN)
    pytester.mkdir("stories")
    (pytester.path / "stories" / "echo.py").write_text(ECHO)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:make", "--botmesh-parts=scenarios",
                                           "--botmesh-scenarios=stories", "--botmesh-seed=3")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*scenario guar_4_before_acknowledging.py::dies_before_completing_the_inbound on thirdparty:make checks GUAR-4*",
        "*FAILED: [[]GUAR-4, OUT-2, INB-9[]]*",
        "*crash: before inbox.complete #1*",
        "*reproduce: pytest --botmesh-backend=thirdparty:make --botmesh-seed=3 -k *dies_before_completing_the_inbound*",
    ])
    result.stdout.fnmatch_lines([
        "*scenario echo.py::crash_after_recording_the_send on thirdparty:make (on_ambiguous=resend) checks GUAR-4*",
        "*delivered ['echo hi', 'echo hi'*expected exactly ['echo hi']*",
        "*reproduce: * --botmesh-scenarios=stories -k *crash_after_recording_the_send[[]thirdparty:make-resend[]]*",
    ])
    result.stdout.fnmatch_lines(["*thirdparty:make: scenarios * failed*", "*BROKEN*GUAR-4 in * item(s)*"])


@pytest.mark.spec("TEST-3")
def test_ini_folder_bad_folder_and_a_file_that_does_not_import(pytester: pytest.Pytester) -> None:
    pytester.mkdir("stories")
    (pytester.path / "stories" / "echo.py").write_text(ECHO)
    pytester.makeini("[pytest]\nbotmesh_scenarios = stories\n")
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=file", "--botmesh-parts=scenarios")
    result.assert_outcomes(passed=13)
    bad = pytester.runpytest_subprocess(*RUN, "--botmesh-scenarios=nowhere")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--botmesh-scenarios: 'nowhere' is not a directory*"])
    (pytester.path / "stories" / "broken.py").write_text("import no_such_module_here\n")
    err = pytester.runpytest_subprocess(*RUN, "--botmesh-parts=scenarios")
    assert err.ret == pytest.ExitCode.INTERRUPTED
    err.stdout.fnmatch_lines(["*scenario file *broken.py failed to import*no_such_module_here*"])


def test_the_decorator_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="spec ids like 'GUAR-3'"):
        scenario()
    with pytest.raises(ValueError, match="policies: \\['maybe'\\]"):
        scenario("GUAR-3", policies=["maybe"])
    with pytest.raises(ValueError, match="unknown capability \\['durable'\\]"):
        scenario("GUAR-3", requires=["durable"])
    with pytest.raises(TypeError, match="must be an 'async def' function"):
        scenario("GUAR-3")(lambda s: None)  # type: ignore[arg-type,return-value]


REMINDER = '''
from botmesh_testkit.scenario import scenario


@scenario("OUT-10", "OUT-14", "GUAR-2", crash="every", policies=["skip"])
async def a_reminder_is_never_sent_twice(s):
    @s.on_message
    async def schedule(ctx):
        await ctx.bot.enqueue(ctx.chat_id, f"reminder for {ctx.text}", idempotency_key=f"reminder:{ctx.text}")

    await s.start()                              # the runner arms one crash point per item
    await s.receive("c1", "invoice-7", id="m1")
    await s.recover()                            # restart, redelivery and drain if it died
    sent = s.delivered().count("reminder for invoice-7")
    s.expect(sent <= 1, f"the reminder went out {sent} times")
    s.expect(sent == 1 or s.events("durability:ambiguous"), "the reminder was lost without an ambiguity event")


@scenario("OUT-10", crash="random", count=3, seed=7)
async def random_deaths(s):
    @s.on_message
    async def schedule(ctx):
        await ctx.reply("ok")

    await s.start()
    await s.receive("c1", "x", id="m1")
    await s.recover()
    s.expect(s.delivered() in (["ok"], []), f"delivered {s.delivered()}")
'''


OVERWRITES = '''
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_STORES = {}


class Overwrites(KvDurability):
    """Forgets that a claimed send was in flight (reports its previous state as
    pending): a send interrupted by a death goes out again, unannounced."""

    async def outbox_claim(self, scope, key, **kwargs):
        claimed = await super().outbox_claim(scope, key, **kwargs)
        return None if claimed is None else (claimed[0], "pending")


def make(workdir):
    return Overwrites(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)
'''


@pytest.mark.spec("OUT-10", "OUT-14", "GUAR-2", "TEST-4")
def test_a_scenario_can_die_at_every_point_or_at_random_ones(pytester: pytest.Pytester) -> None:
    """``crash="every"``: one item per crash point the dry run passed, before and after;
    ``crash="random"``: ``count`` items drawn from the seed. A backend that forgets sends
    fails some of those items, named by their point."""
    pytester.mkdir("stories")
    (pytester.path / "stories" / "reminder.py").write_text(REMINDER)
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-scenarios=stories", "-v")
    assert result.ret == 0, result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes["passed"] > 10, outcomes
    result.stdout.fnmatch_lines(["*a_reminder_is_never_sent_twice[[]sqlite-skip-before:inbox.journal:1[]] PASSED*"])
    result.stdout.fnmatch_lines(["*a_reminder_is_never_sent_twice[[]sqlite-skip-after:outbox.mark_sent:1[]] PASSED*"])
    result.stdout.fnmatch_lines(["*random_deaths[[]sqlite-random-*:*[]] PASSED*"])
    pytester.makepyfile(overwrites=OVERWRITES)
    bad = pytester.runpytest_subprocess(*RUN, "--botmesh-scenarios=stories", "--botmesh-backend=overwrites:make",
                                        "--botmesh-parts=scenarios", "-k", "never_sent_twice")
    assert bad.ret == pytest.ExitCode.TESTS_FAILED
    bad.stdout.fnmatch_lines(["*on overwrites:make (on_ambiguous=skip), dying at *:* checks OUT-10, OUT-14, GUAR-2*",
                              "*the reminder went out 2 times*"])


@pytest.mark.spec("TEST-3")
def test_the_rerun_command_of_a_crash_point_item_selects_it(pytester: pytest.Pytester) -> None:
    """The ``-k`` of a failing item's reproduce line is a valid expression that selects
    exactly that item (labels avoid characters ``-k`` rejects)."""
    pytester.mkdir("stories")
    (pytester.path / "stories" / "reminder.py").write_text(REMINDER)
    one = pytester.runpytest_subprocess(*RUN, "--botmesh-scenarios=stories",
                                        "-k", "a_reminder_is_never_sent_twice[sqlite-skip-after:outbox.mark_sent:1]")
    one.assert_outcomes(passed=1)


@pytest.mark.spec("TEST-4")
def test_random_scenario_deaths_are_distinct_for_every_seed() -> None:
    """Item names of ``crash="random"`` scenarios stay unique: no death drawn twice, and
    a short story gives as many as it has."""
    from botmesh_testkit.scenario.api import ScenarioSpec, crash_points_of

    async def story(s: object) -> None:
        return None

    spec = ScenarioSpec(fn=story, ids=("OUT-10",), policies=None, requires=(), timeout=1.0, crash="random", count=10)
    for seed in range(300):
        labels = [p.label for p in crash_points_of(spec, ["inbox.journal", "outbox.journal"], set(), seed)]
        assert len(labels) == len(set(labels)) == 4, (seed, labels)
