"""Nothing a broken backend does can stall a run (issue 14, points 9-11), as users run
it (pytester, a subprocess, ``--botmesh-backend=module:factory``):

* a suite item past its real-time budget (``--botmesh-item-timeout``) fails with one
  line naming the budget and the option — also when the kv spins without ever yielding
  to the event loop, which ``asyncio.wait_for`` cannot interrupt;
* a workload's dry run at collection has a budget of its own
  (``--botmesh-dry-run-timeout``) and a dry run past it is one item error;
* a ``scan(after=k)`` that lists ``k`` again is a ``KvContractError`` naming the method and
  the key, not an endless paging loop;
* the suite's Hypothesis state machine draws its operations from ``--botmesh-seed`` and
  keeps its database under pytest's cache directory, not in the current directory;
* ``pytest --botmesh-backend=pkg.mod:make`` (the console script, which does not put the
  current directory on ``sys.path``) imports ``pkg`` from the folder it runs in.

The hanging kvs really hang (a ``while True`` loop): ``runpytest_subprocess(timeout=...)``
bounds each run, so without the budgets under test these tests fail instead of hanging.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")
BOUND = 300  # real seconds a pytester run may take before the test fails (not a timing assertion)

SPINNING_RANGE = '''
from botmesh.core.memory import MemoryKv


class SpinningRangeKv(MemoryKv):
    """range() never returns and never yields to the event loop."""

    async def range(self, scope, space, index, *, upto, limit):
        n = 0
        while True:
            n += 1


def make():
    return SpinningRangeKv()
'''

SPINNING_PUT = '''
from botmesh.core.memory import MemoryKv


class SpinningPutKv(MemoryKv):
    """put() never returns and never yields to the event loop."""

    async def put(self, scope, space, key, value, *, expected_version, due=None, expires=None):
        n = 0
        while True:
            n += 1


def make():
    return SpinningPutKv()
'''

INCLUSIVE_SCAN = '''
import botmesh.core.kv_durability as engine
from botmesh.core.memory import MemoryKv

# The engine lists a journal in pages and stops at a short one (BACK-7: scan returns
# min(limit, what is after)); pages of one record make it page (scan(after=k)) whenever
# there is a record at all, as a journal of more than a page does.
engine._SCAN_PAGE = 1


class InclusiveScanKv(MemoryKv):
    """scan(after=k) lists k itself too (built on MemoryKv's public scan only)."""

    async def scan(self, scope, space, *, after=None, limit=100):
        everything = await super().scan(scope, space, limit=1_000_000)
        return [(k, v) for k, v in everything if after is None or k >= after][:limit]


def make():
    return InclusiveScanKv()
'''

RECORDING = '''
import json
import os

from botmesh.core.memory import MemoryKv


class RecordingKv(MemoryKv):
    """A correct kv that appends every put, delete and scan it is asked for (the scope
    left out: it carries a fresh random tag per test) to $RECORD_TO."""

    def _note(self, *call):
        with open(os.environ["RECORD_TO"], "a") as f:
            f.write(json.dumps(call) + "\\n")

    async def put(self, scope, space, key, value, *, expected_version, due=None, expires=None):
        self._note("put", space, key, value, expected_version, due, expires)
        return await super().put(scope, space, key, value, expected_version=expected_version, due=due,
                                 expires=expires)

    async def delete(self, scope, space, key, *, expected_version):
        self._note("delete", space, key, expected_version)
        return await super().delete(scope, space, key, expected_version=expected_version)

    async def scan(self, scope, space, *, after=None, limit=100):
        self._note("scan", space, after, limit)
        return await super().scan(scope, space, after=after, limit=limit)


def make():
    return RecordingKv()
'''

DESCENDING_RANGE = '''
from botmesh.core.memory import MemoryKv


class DescendingRangeKv(MemoryKv):
    """range() lists entries in descending order."""

    async def range(self, scope, space, index, *, upto, limit):
        entries = await super().range(scope, space, index, upto=upto, limit=10**9)
        return sorted(entries, reverse=True)[:limit]


def make():
    return DescendingRangeKv()
'''

AGREEMENT = "TestDurableKv and test_agrees_with_the_reference_memory_kv"


@pytest.mark.spec("BACK-7")
def test_a_suite_item_that_spins_fails_at_its_budget_naming_the_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=SPINNING_RANGE)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        *RUN, "--botmesh-backend=thirdparty:make", "--botmesh-parts=suite", "--botmesh-item-timeout=3",
        "-k", f"{AGREEMENT} or test_range_limit", timeout=BOUND)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    failed = re.findall(r"^FAILED (botmesh-conformance::\S+)", out, re.M)
    assert any("test_agrees_with_the_reference_memory_kv" in f for f in failed), out[-3000:]
    assert "errors" not in result.parseoutcomes(), out[-3000:]  # the teardown after a budget that ran out still closes cleanly
    budget = re.findall(r"did not finish within its real-time budget of 3 s \(--botmesh-item-timeout", out)
    assert len(budget) >= len(failed), out[-3000:]
    # one line and the reproduce command, not the traceback of wherever the alarm landed
    assert "SpinningRangeKv" not in out and "n += 1" not in out, out[-3000:]
    assert re.search(r"^reproduce: pytest --botmesh-backend=thirdparty:make .*-k ", out, re.M), out[-3000:]


@pytest.mark.spec("BACK-7")
def test_a_bad_item_timeout_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=memory", "--botmesh-item-timeout=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--botmesh-item-timeout: 0 must be > 0 seconds" in result.stderr.str()


@pytest.mark.spec("TEST-4")
def test_a_dry_run_that_spins_is_one_item_error_within_its_own_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=SPINNING_PUT)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        *RUN, "--botmesh-backend=thirdparty:make", "--botmesh-parts=matrix", "--botmesh-dry-run-timeout=1",
        "--botmesh-matrix=smoke", timeout=BOUND)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    failed = re.findall(r"^FAILED (botmesh-matrix::\S+)", out, re.M)
    # the first workload's dry run ran out of budget; the others of this backend are not tried
    assert failed == ["botmesh-matrix::thirdparty:make/one-send/dry-run"], failed
    assert "did not finish within its real-time budget of 1 s (--botmesh-dry-run-timeout" in out, out[-3000:]
    assert "the dry runs of its other workloads (three-sends, enqueue, split, flow) were not tried" in out
    assert "n += 1" not in out, out[-3000:]


@pytest.mark.spec("BACK-7")
def test_a_scan_that_does_not_advance_is_a_contract_error_not_an_endless_loop(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=INCLUSIVE_SCAN)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        *RUN, "--botmesh-backend=thirdparty:make", "--botmesh-parts=suite",
        "-k", "test_out14_an_expired_send or test_ops2_outbox_list_filters_by_state", timeout=BOUND)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    result.assert_outcomes(failed=2)
    found = re.findall(r"KvContractError: InclusiveScanKv\.scan\(scope='[^']*', space='outbox', after='([^']+)'\) "
                       r"returned key '([^']+)', which is not after", out)
    assert found and all(after == key for after, key in found), out[-3000:]


def _recorded_calls(pytester: pytest.Pytester, seed: int, name: str) -> list[str]:
    record = pytester.path / f"{name}.jsonl"
    os.environ["RECORD_TO"] = str(record)  # pytester's monkeypatch restores the environment
    result = pytester.runpytest_subprocess(*RUN, "--botmesh-backend=thirdparty:make", "--botmesh-parts=suite",
                                           f"--botmesh-seed={seed}", "-k", AGREEMENT, timeout=BOUND)
    result.assert_outcomes(passed=1)
    return record.read_text().splitlines()


@pytest.mark.spec("BACK-7")
def test_the_state_machine_draws_its_operations_from_the_botmesh_seed(pytester: pytest.Pytester,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECORD_TO", "")
    pytester.makepyfile(thirdparty=RECORDING)
    pytester.syspathinsert()
    first = _recorded_calls(pytester, 11, "first")
    again = _recorded_calls(pytester, 11, "again")
    other = _recorded_calls(pytester, 12, "other")
    assert len(first) > 100
    assert first == again  # same seed, same operations in the same order
    assert first != other


@pytest.mark.spec("BACK-7")
def test_the_hypothesis_database_is_under_the_pytest_cache_not_the_current_directory(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(thirdparty=DESCENDING_RANGE)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess("-p", "no:benchmark", "--botmesh-backend=thirdparty:make",
                                           "--botmesh-parts=suite", "--botmesh-seed=3", "-k", AGREEMENT,
                                           timeout=BOUND)
    result.assert_outcomes(failed=1)
    assert not (pytester.path / ".hypothesis").exists()
    saved = pytester.path / ".pytest_cache" / "d" / "botmesh-hypothesis"
    assert saved.is_dir() and any(p.is_file() for p in saved.rglob("*")), sorted(pytester.path.rglob("*"))


@pytest.mark.spec("BACK-7")
def test_pytest_imports_a_factory_package_from_the_folder_it_runs_in(pytester: pytest.Pytester) -> None:
    """The ``pytest`` command (not ``python -m pytest``) with a clean ``PYTHONPATH``."""
    package = pytester.mkpydir("mykv")
    (package / "store.py").write_text("from botmesh.core.memory import MemoryKv\n\n\ndef make():\n"
                                      "    return MemoryKv()\n")
    command = Path(sys.executable).with_name("pytest")
    assert command.is_file(), command
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(command), *RUN, "--botmesh-backend=mykv.store:make", "--botmesh-parts=suite",
                           "-k", "test_scan_after_and_limit"], cwd=pytester.path, env=env, capture_output=True,
                          text=True, timeout=BOUND, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\b1 passed\b", done.stdout), done.stdout[-3000:]


@pytest.mark.spec("BACK-7")
def test_the_cli_imports_a_factory_package_from_the_folder_it_runs_in(tmp_path: Path) -> None:
    """``botmesh-testkit run`` checks the backends before pytest starts: from the same
    folder, with a clean ``PYTHONPATH``."""
    (tmp_path / "mykv").mkdir()
    (tmp_path / "mykv" / "__init__.py").write_text("")
    (tmp_path / "mykv" / "store.py").write_text("from botmesh.core.memory import MemoryKv\n\n_KVS = {}\n\n\n"
                                                "def make(workdir):\n"
                                                "    return _KVS.setdefault(workdir, MemoryKv())\n")
    command = Path(sys.executable).with_name("botmesh-testkit")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(command), "run", "--backend", "mykv.store:make", "--parts", "scenarios"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BOUND, check=False)
    out = done.stdout + done.stderr
    assert "cannot import" not in out and done.returncode != 2, out[-3000:]
    assert re.search(r"\b\d+ passed\b", done.stdout), out[-3000:]


@pytest.mark.spec("BACK-7")
def test_botmesh_testkit_run_passes_its_item_timeout_on(tmp_path: Path) -> None:
    (tmp_path / "spinning.py").write_text(SPINNING_RANGE)
    command = Path(sys.executable).with_name("botmesh-testkit")
    done = subprocess.run([str(command), "run", "--backend", "spinning:make", "--parts", "suite", "--item-timeout",
                           "1"], cwd=tmp_path, capture_output=True, text=True, timeout=BOUND, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "did not finish within its real-time budget of 1 s (--botmesh-item-timeout, or --item-timeout of " \
           "botmesh-testkit run" in out, out[-3000:]
