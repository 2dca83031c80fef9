"""Scenarios (the GUAR table as runnable stories, and users' own folders), run by the
plugin the way a user runs them: pytester in a subprocess."""

from __future__ import annotations

import pytest

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
from botmesh.core.spi import KvDurability, MemoryKv

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
    # the shipped GUAR scenarios run too (10 items); the one needing survives_crash is skipped
    memory.assert_outcomes(passed=12, skipped=1)
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
