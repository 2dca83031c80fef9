"""The shipped server-fault suite (:mod:`botmesh_testkit.conformance.faults`) bound to the
PostgreSQL and Redis backends on the shared servers (through a fault proxy of its own),
and shown to catch a backend whose client replays a write whose outcome was unknown."""

from __future__ import annotations

import os

import pytest

from botmesh_testkit.conformance.faults import ServerFaultConformance
from botmesh_testkit.backends.postgres import PostgresHarness
from botmesh_testkit.backends.redis import RedisHarness

pytest_plugins = ["pytester"]

PG_URL = os.environ.get("BOTMESH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0")


class TestPostgresFaults(ServerFaultConformance):
    @pytest.fixture
    def botmesh_harness_factory(self):  # type: ignore[no-untyped-def]
        return lambda workdir: PostgresHarness(workdir, url=PG_URL)


class TestRedisFaults(ServerFaultConformance):
    @pytest.fixture
    def botmesh_harness_factory(self):  # type: ignore[no-untyped-def]
        return lambda workdir: RedisHarness(workdir, url=REDIS_URL)


REPLAYS = '''
import os

import pytest
from botmesh.core.errors import BackendUnavailableError
from botmesh.redis_store import RedisDurability, RedisKv

from botmesh_testkit.conformance.faults import ServerFaultConformance
from botmesh_testkit.backends.redis import RedisHarness


class ReplayingKv(RedisKv):
    """A client-side retry: a write that failed is sent again."""

    async def put(self, *args, **kwargs):
        try:
            return await super().put(*args, **kwargs)
        except BackendUnavailableError:
            return await super().put(*args, **kwargs)


class ReplayingHarness(RedisHarness):
    def _new_backend(self):
        backend = RedisDurability(url=self.url, prefix=self.prefix)
        backend.kv = ReplayingKv(url=self.url, prefix=self.prefix)
        self.backends.append(backend)
        self.backend = backend
        return backend

    def via(self, host, port):
        twin = ReplayingHarness(self.workdir, url=super().via(host, port).url)
        twin.prefix = self.prefix
        return twin


class TestReplaying(ServerFaultConformance):
    @pytest.fixture
    def botmesh_harness_factory(self):
        return lambda workdir: ReplayingHarness(workdir, url=os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0"))
'''


@pytest.mark.spec("OUT-14", "BACK-3")
def test_the_fault_suite_catches_a_client_that_replays_writes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_replaying=REPLAYS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "resolved_by_key", "-rf", "--tb=line")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: OUT-14: mark_sent returned False for a write that landed*"])
