"""The pytest plugin, tested the way a third party runs it (pytester, a subprocess)."""

from __future__ import annotations

import re

import pytest
from conftest import collected_parts, shipped_scenario_files

pytest_plugins = ["pytester"]

BROKEN_KV = '''
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_STORES = {}   # one storage per working directory (per cell), shared by its incarnations


class ForgetsSent(KvDurability):
    """Acknowledges mark_sent without writing it: an outbox that forgets `sent`."""

    async def outbox_mark_sent(self, scope, key, **kwargs):
        return True


def make(workdir):
    return ForgetsSent(_STORES.setdefault(("bad", workdir), MemoryKv()), own_kv=False)


def good(workdir):
    return _STORES.setdefault(("good", workdir), MemoryKv())
'''


@pytest.mark.spec("TEST-4", "BACK-7")
def test_matrix_runs_as_items_with_a_summary(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=memory", "--botmesh-seed=4", "-rs")
    # memory claims no survives_crash / multi_process: those suite tests (the claims check
    # among them) skip, naming it; nothing fails or errors
    outcomes = result.parseoutcomes()
    # 9: four need survives_crash, five multi_process (four of the durability suite, one of the kv suite)
    assert set(outcomes) == {"passed", "skipped"} and outcomes["skipped"] == 9, outcomes
    assert outcomes["passed"] > 300
    result.stdout.fnmatch_lines(["*capability not claimed: survives_crash*"])
    result.stdout.fnmatch_lines(["*botmesh: backends memory; parts suite, scenarios, matrix, explore, kills, powercuts, "
                                 "corruption; "
                                 "matrix smoke; seed 4*",
                                 "*botmesh durability report*",
                                 "memory: suite * passed, 0 failed, 9 skipped; scenarios * passed, 0 failed; "
                                 "matrix * passed, 0 failed",
                                 "*held (*): *GUAR-3, GUAR-4*"])
    # the header's totals count the plugin's items, per part
    header = re.search(r"^botmesh: (\d+) items in all \(suite (\d+), scenarios (\d+), matrix (\d+), explore (\d+)\)$",
                       result.stdout.str(), re.M)
    summary = re.search(r"^memory: suite (\d+) passed, 0 failed, (\d+) skipped; scenarios (\d+) passed, 0 failed; "
                        r"matrix (\d+) passed", result.stdout.str(), re.M)
    assert header and summary, result.stdout.str()[-3000:]
    total, suite, scenarios, matrix, explore = (int(g) for g in header.groups())
    assert scenarios >= len(shipped_scenario_files())  # every shipped GUAR file yields an item
    assert suite == int(summary.group(1)) + int(summary.group(2))
    assert (scenarios, matrix) == (int(summary.group(3)), int(summary.group(4)))
    assert explore == 1  # one item per backend
    assert total == suite + scenarios + matrix + explore == sum(result.parseoutcomes().values())


@pytest.mark.spec("TEST-4", "OUT-2", "BACK-7")
def test_a_third_party_backend_by_dotted_path(pytester: pytest.Pytester) -> None:
    """A good third-party kv passes; a broken one fails naming the requirement ids and the
    command that reproduces a cell."""
    pytester.makepyfile(thirdparty=BROKEN_KV)
    pytester.syspathinsert()
    good = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=thirdparty:good", "--botmesh-seed=4")
    assert good.ret == 0
    bad = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=thirdparty:make", "--botmesh-seed=4")
    assert bad.ret == 1
    bad.stdout.fnmatch_lines(["*violated [[]OUT-2*", "*reproduce: botmesh-testkit run --backend thirdparty:make --seed 4 --cell*",
                              "*BROKEN (*): *OUT-2 in * item(s)*"])
    # each broken id with its one-line title from the shipped spec (issue 14: the ids explained)
    bad.stdout.fnmatch_lines(["    OUT-2: A send whose key is already `sent` is answered from the outbox*"])


def test_bad_option_values_are_usage_errors(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--botmesh-backend=nosuch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--botmesh-backend: 'nosuch' is not a known backend*"])
    result = pytester.runpytest_subprocess("--botmesh-backend=memory", "--botmesh-matrix=huge")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown matrix profile 'huge'; choose one of full, smoke*"])


HOOKED = '''
from botmesh.core.memory import MemoryKv

from botmesh_testkit.backends import MemoryHarness

_STORES = {}


def pytest_botmesh_register_backends(registry):
    registry.add("mine", lambda workdir: MemoryHarness(workdir))
    registry.add_factory("mine-kv", lambda workdir: _STORES.setdefault(workdir, MemoryKv()))
'''


@pytest.mark.spec("BACK-7", "TEST-4")
def test_backends_registered_by_hook_and_by_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(HOOKED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=mine", "--botmesh-backend=mine-kv",
                                           "--botmesh-parts=scenarios")
    each = collected_parts(result.stdout.str())["scenarios"] // 2
    assert each >= len(shipped_scenario_files())
    result.assert_outcomes(passed=2 * each)
    result.stdout.fnmatch_lines([f"*mine: scenarios {each} passed, 0 failed*", f"*mine-kv: scenarios {each} passed, 0 failed*"])
    # an installed distribution declaring the entry-point group botmesh_testkit.backends
    pytester.path.joinpath("conftest.py").unlink()
    pytester.makepyfile(epbackend="from botmesh.core.memory import MemoryKv\n_S = {}\n"
                                  "def make(workdir):\n    return _S.setdefault(workdir, MemoryKv())\n")
    info = pytester.mkdir("epbackend-1.0.dist-info")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: epbackend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[botmesh_testkit.backends]\nep-kv = epbackend:make\n")
    ep = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=ep-kv", "--botmesh-parts=scenarios")
    ep.assert_outcomes(passed=10)
    unknown = pytester.runpytest_subprocess("--botmesh-backend=nope")
    unknown.stderr.fnmatch_lines(["*'nope' is not a known backend (memory, file, file+log, sqlite, events, events-shared, "
                                  "events-shared+log, postgres, redis, ep-kv)*"])


HANGS = '''
import asyncio

from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_S = {}


class Hangs(KvDurability):
    """Never answers a recovery claim (a backend stuck on a lock)."""

    async def inbox_claim(self, scope, id, **kwargs):
        if kwargs["recover"]:
            await asyncio.Event().wait()
        return await super().inbox_claim(scope, id, **kwargs)


class HangsAlways(Hangs):
    async def outbox_mark_sent(self, scope, key, **kwargs):
        await asyncio.Event().wait()


def make(workdir):
    return Hangs(_S.setdefault(workdir, MemoryKv()), own_kv=False)


def always(workdir):
    return HangsAlways(_S.setdefault(workdir, MemoryKv()), own_kv=False)
'''


@pytest.mark.spec("TEST-4")
def test_a_cell_that_hangs_fails_on_its_real_time_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(hangs=HANGS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--botmesh-backend=hangs:make", "--botmesh-parts=matrix", "--botmesh-seed=1",
        "--botmesh-cell=hangs:make/one-send/skip/after:inbox.journal#1", "--botmesh-cell-timeout=1")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*did not finish within its real-time budget of 1 s (--botmesh-cell-timeout)*",
                                 "*reproduce: botmesh-testkit run --backend hangs:make --seed 1 --cell*"])
    # without --botmesh-cell, the crash-free dry run itself hangs: reported as a failing item
    dry = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=hangs:always", "--botmesh-parts=matrix",
                                        "--botmesh-seed=1", "--botmesh-cell-timeout=1", "--botmesh-matrix=smoke")
    assert dry.ret == pytest.ExitCode.TESTS_FAILED
    dry.stdout.fnmatch_lines(["*the crash-free dry run of workload 'one-send' on hangs:always did not finish within*"])
    bad = pytester.runpytest_subprocess("--botmesh-backend=memory", "--botmesh-cell-timeout=0")
    bad.stderr.fnmatch_lines(["*--botmesh-cell-timeout: 0 must be > 0 seconds*"])
    bad = pytester.runpytest_subprocess("--botmesh-backend=memory", "--botmesh-parts=suite,everything")
    bad.stderr.fnmatch_lines(["*--botmesh-parts: 'suite,everything': choose from suite, scenarios, matrix*"])
    bad = pytester.runpytest_subprocess("--botmesh-backend=memory", "--botmesh-cell=x")
    bad.stderr.fnmatch_lines(["*--botmesh-cell: --cell 'x': expected BACKEND/WORKLOAD/POLICY/WHEN:POINT#N*"])


OWN_TEST = '''
import asyncio

import pytest


@pytest.mark.spec("INB-4")
def test_my_restart(botmesh_bot):
    async def story():
        def setup(bot):
            @bot.otherwise
            async def echo(ctx):
                await ctx.reply("echo " + ctx.text)

        bot = await botmesh_bot(setup)
        await bot.provider.receive("c1", "hi", id="m1")
        again = await botmesh_bot(setup)            # a restart on the same storage
        await again.provider.receive("c1", "hi", id="m1")
        assert again.provider.texts() == []         # recognised as already processed
        assert [r.state for r in await again.durability.inbox.list()] == ["done"]

    asyncio.run(story())


def test_my_world(botmesh_world, botmesh_harness):
    world = botmesh_world(instance_id="x")
    assert world.harness is botmesh_harness
    assert botmesh_harness.name == "sqlite"
'''


@pytest.mark.spec("INB-4", "TEST-3")
def test_fixtures_for_ones_own_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_own=OWN_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


@pytest.mark.spec("GUAR-1", "GUAR-3", "OUT-14", "TEST-3")
def test_the_profile_kill_loops_run_as_items(pytester: pytest.Pytester) -> None:
    """``kills = N`` in a profile: one real kill loop per backend and policy, its counts
    in the summary; a backend that does not survive a crash gets none."""
    pytester.makefile(".toml", tiny='workloads = ["one-send"]\npolicies = ["resend"]\nkills = 4\nkill_messages = 6\n')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=sqlite", "--botmesh-backend=memory",
                                           "--botmesh-parts=kills", "--botmesh-matrix=tiny.toml", "--botmesh-seed=2", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*botmesh-kills::sqlite/resend/4-kills PASSED*", "sqlite: kills 1 passed, 0 failed",
                                 "*kill loop on sqlite, on_ambiguous=resend, seed 2: passed*",
                                 "*kills: 4 (*); self-deaths: 0; incarnations: 5*",
                                 "*deliveries: * duplicates: *; losses: 0*"])
    pytester.makefile(".toml", bad="kills = -1\n")
    bad = pytester.runpytest_subprocess("--botmesh-backend=sqlite", "--botmesh-matrix=bad.toml")
    bad.stderr.fnmatch_lines(["*--botmesh-matrix: bad.toml: kills must be an integer >= 0, got -1*"])


@pytest.mark.spec("BACK-2", "BACK-3")
def test_a_server_that_cannot_be_provisioned_skips_or_fails_when_required(pytester: pytest.Pytester,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No server: the backend's items are one skip saying what was tried; under
    --botmesh-require-services (or $BOTMESH_REQUIRE_SERVICES, which .ci/run sets) a usage
    error; a given URL that does not answer is always an error."""
    monkeypatch.delenv("BOTMESH_REDIS_URL", raising=False)
    monkeypatch.delenv("BOTMESH_REQUIRE_SERVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no redis-server binary to start a private server from
    args = ("-p", "no:cacheprovider", "--botmesh-backend=redis", "--botmesh-parts=suite", "-rs")
    skipped = pytester.runpytest_subprocess(*args)
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["redis: SKIPPED — no server could be provisioned (no redis server for the tests; tried:",
                                  "*2. private: no redis-server on PATH*"])
    required = pytester.runpytest_subprocess(*args, "--botmesh-require-services")
    assert required.ret == pytest.ExitCode.USAGE_ERROR
    required.stderr.fnmatch_lines(["*--botmesh-backend=redis: *"])
    monkeypatch.setenv("BOTMESH_REQUIRE_SERVICES", "1")
    by_env = pytester.runpytest_subprocess(*args)
    assert by_env.ret == pytest.ExitCode.USAGE_ERROR
    monkeypatch.delenv("BOTMESH_REQUIRE_SERVICES")
    dead = pytester.runpytest_subprocess(*args, "--botmesh-redis-url=redis://127.0.0.1:1/0")
    assert dead.ret == pytest.ExitCode.USAGE_ERROR


@pytest.mark.spec("TEST-4")
def test_xdist_workers_share_the_drawn_seed(pytester: pytest.Pytester) -> None:
    """Without --botmesh-seed the controller draws one and every worker collects the
    random cells of that seed (xdist refuses differing collections)."""
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=memory", "--botmesh-parts=matrix",
                                           "-n", "2")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["memory: matrix * passed, 0 failed"])
