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


HANGS = '''
import asyncio
import os

import pytest

from botmesh_testkit.conformance.faults import ServerFaultConformance
from botmesh_testkit.backends.redis import RedisHarness


async def stuck_in_the_backend(event):
    await event.wait()


class TestHanging(ServerFaultConformance):
    timeout_seconds = 3.0

    @pytest.fixture
    def botmesh_harness_factory(self):
        return lambda workdir: RedisHarness(workdir, url=os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0"))

    def test_a_body_that_never_ends(self, botmesh_harness_factory, tmp_path):
        async def body(t):
            await stuck_in_the_backend(asyncio.Event())

        self.run_faults(botmesh_harness_factory, tmp_path, body)
'''


def test_a_fault_test_that_hangs_fails_naming_where_it_waits(pytester: pytest.Pytester) -> None:
    """A fault test that does not end within its timeout fails with the stage and the
    frames every task waited in (a bare TimeoutError said nothing of where a CI run hung)."""
    pytester.makepyfile(test_hanging=HANGS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "never_ends", "-rf", "--tb=short")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*the fault test did not end within 3s while running the test body (before that: opening the backends *s)*",
        "*stuck_in_the_backend (test_hanging.py:*) <- body (test_hanging.py:*) <- main (faults.py:*)*",
    ])
