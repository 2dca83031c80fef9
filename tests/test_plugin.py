"""The pytest plugin, tested the way a third party runs it (pytester, a subprocess)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

BROKEN_KV = '''
from botmesh.core.spi import KvDurability, MemoryKv

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
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=memory", "--botmesh-seed=4")
    result.assert_outcomes(passed=result.parseoutcomes()["passed"])
    assert result.parseoutcomes()["passed"] > 100
    result.stdout.fnmatch_lines(["*botmesh: backends memory; matrix smoke; seed 4*", "*botmesh durability report*",
                                 "*GUAR-3 * held*"])


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
                              "*BROKEN in*"])


def test_bad_option_values_are_usage_errors(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--botmesh-backend=nosuch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--botmesh-backend: 'nosuch' is not a built-in backend*"])
    result = pytester.runpytest_subprocess("--botmesh-backend=memory", "--botmesh-matrix=huge")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown matrix profile 'huge'; choose one of full, smoke*"])
