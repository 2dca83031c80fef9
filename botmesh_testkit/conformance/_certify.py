"""What ``pytest --botmesh-backend=NAME`` collects as the ``suite`` part: the shipped
conformance suites bound to each selected backend (the plugin parametrizes
``botmesh_certified_backend``). Not meant to be imported by users: bind the suites with
a subclass and a fixture instead (see :mod:`botmesh_testkit.conformance`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..backends.base import BackendHarness
from ..backends.registry import resolve
from .claims import ClaimsConformance
from .durability import DurabilityConformance
from .faults import ServerFaultConformance
from .kv import DurableKvConformance, KvFactory


# First: the cheapest check, and the one a managed server that cannot be killed gets.
class TestClaims(ClaimsConformance):
    @pytest.fixture
    def botmesh_harness_factory(self, botmesh_certified_backend: str) -> Callable[[str], BackendHarness]:
        return resolve(botmesh_certified_backend)


class TestDurability(DurabilityConformance):
    @pytest.fixture
    def botmesh_harness_factory(self, botmesh_certified_backend: str) -> Callable[[str], BackendHarness]:
        return resolve(botmesh_certified_backend)


class TestDurableKv(DurableKvConformance):
    @pytest.fixture
    def kv_factory(self, botmesh_certified_backend: str, tmp_path: Any) -> KvFactory:
        harness = resolve(botmesh_certified_backend)(str(tmp_path))
        factory = harness.kv_factory()
        if factory is None:
            pytest.skip(f"backend {botmesh_certified_backend} is not built on a DurableKv: the kv-level suite does not apply")
        return factory


class TestServerFaults(ServerFaultConformance):
    @pytest.fixture
    def botmesh_harness_factory(self, botmesh_certified_backend: str) -> Callable[[str], BackendHarness]:
        return resolve(botmesh_certified_backend)
