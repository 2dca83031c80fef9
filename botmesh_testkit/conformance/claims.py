"""Claims checked against real settings: a backend that claims ``survives_crash`` must
run on settings that can give it, read live from the backend and held to the rules of
:mod:`botmesh_testkit.checker.claims` — without a kill or a power cut, so this is what a
user pointing the plugin at a managed server they cannot cut the power of gets.

The backend reports its settings through ``durability_settings()`` (optional in the
contract: :meth:`botmesh.core.spi.DurableKv.durability_settings`,
:meth:`botmesh.core.backend.DurabilityBackend.durability_settings`). The test:

* skips with ``capability not claimed: survives_crash`` when nothing is claimed;
* skips, saying so, when the backend does not report its settings (``None``: a third
  party that does not implement it — the claim is then left to the kill loops and the
  power cuts) or reports a kind the rules do not know;
* fails naming each setting and its value that cannot keep an acknowledged write
  through a power cut (``synchronous=NORMAL``, ``synchronous_commit=off``,
  ``appendfsync=everysec``, ``fsync=False`` ...), or that could not be read.

Bind it like the durability suite::

    class TestMyClaims(ClaimsConformance):
        @pytest.fixture
        def botmesh_harness_factory(self):
            return resolve("my_pkg.backend:make")
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
from botmesh.core.spi_types import Capabilities

from ..checker.claims import IDS, RULES, settings_violations
from .durability.base import HarnessFactory

__all__ = ["NOT_REPORTED", "ClaimsConformance"]

NOT_REPORTED = "durability_settings() not implemented: the claim is checked by kill loops and power cuts only"
"""The skip reason for a backend that claims ``survives_crash`` but reports no settings."""


async def _read(factory: HarnessFactory, workdir: str) -> tuple[str, Capabilities, Mapping[str, object] | None]:
    """Open a harness on ``workdir`` and start its backend as a bot would; return its name,
    what it claims and — when it claims ``survives_crash`` — what it reports."""
    harness = factory(workdir)
    settings: Mapping[str, object] | None = None
    try:
        backend, _ = await harness.open()
        try:
            await backend.start()
            caps = harness.capabilities  # after open(): a factory harness learns them there
            if caps.survives_crash:
                # getattr: a duck-typed backend that predates the method reports nothing
                read = getattr(backend, "durability_settings", None)
                settings = await read() if callable(read) else None
        finally:
            with contextlib.suppress(Exception):
                await backend.stop()
    finally:
        await harness.close()
    return harness.name, caps, settings


class ClaimsConformance:
    """The claims check (see the module docstring). Override ``botmesh_harness_factory``."""

    timeout_seconds: ClassVar[float] = 60.0

    @pytest.fixture
    def botmesh_harness_factory(self) -> HarnessFactory:
        """Override me: return ``factory(workdir) -> BackendHarness``."""
        raise NotImplementedError(f"{type(self).__name__} must define a `botmesh_harness_factory` fixture")

    @pytest.mark.spec(*IDS)
    def test_a_survives_crash_claim_rests_on_durable_settings(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """GUAR-1, GUAR-2, INB-1, OUT-1 (``survives_crash``): the settings the backend
        reports from its live connection or configuration keep an acknowledged write
        through a power cut (SQLite ``synchronous`` FULL/EXTRA and a real journal;
        PostgreSQL ``fsync``, ``full_page_writes`` on and ``synchronous_commit`` not off;
        Redis ``appendonly yes`` with ``appendfsync always``; file journals with
        ``fsync``). Skipped when the backend claims no ``survives_crash`` or does not
        report its settings."""
        name, caps, settings = asyncio.run(
            asyncio.wait_for(_read(botmesh_harness_factory, str(tmp_path)), self.timeout_seconds))
        if not caps.survives_crash:
            pytest.skip("capability not claimed: survives_crash")
        if settings is None:
            pytest.skip(NOT_REPORTED)
        kind = str(settings.get("kind", ""))
        if kind not in RULES:
            pytest.skip(f"durability_settings() reports kind {kind!r}, which the claims check has no rules for "
                        f"(it knows {', '.join(RULES)}): the claim is checked by kill loops and power cuts only")
        violations = settings_violations(settings, backend=name)
        if violations:
            shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "kind")
            # No traceback: the message is the whole story (the test's code would hide it).
            pytest.fail("\n".join([str(v) for v in violations] + [f"reported settings: {kind}: {shown}"]),
                        pytrace=False)
