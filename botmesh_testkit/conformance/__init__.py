"""The conformance suites any botmesh backend must pass (BACK-7), shipped inside the
package so that a third party certifies its backend in its own repository.

* :mod:`botmesh_testkit.conformance.kv` — :class:`DurableKvConformance`, the suite of
  the :class:`botmesh.core.spi.DurableKv` contract: compare-and-set with versions, the
  two ordered indexes, scans, scope and space isolation, atomicity under concurrency
  (between real processes too, when ``multi_process`` is claimed), lifecycle, survival
  of a crash (when claimed) and step-by-step agreement with :class:`botmesh.core.MemoryKv`,
  the reference.
* :mod:`botmesh_testkit.conformance.durability` — :class:`DurabilityConformance`, the
  suite of the durability backend contract (:class:`botmesh.core.backend.DurabilityBackend`):
  every INB, OUT, LEASE, SCOPE and OPS requirement the backend contract makes checkable
  and the declared capabilities make applicable (survival of a crash, several real
  processes on one storage), plus a few end-to-end checks through a ``Bot``.
* :mod:`botmesh_testkit.conformance.claims` — :class:`ClaimsConformance`: a backend
  that claims ``survives_crash`` runs on settings that can give it (read live through
  ``durability_settings()``: SQLite ``synchronous``, PostgreSQL ``synchronous_commit``,
  Redis ``appendfsync`` ...), checked without a kill.
* :mod:`botmesh_testkit.conformance.faults` — :class:`ServerFaultConformance`, for
  backends on a server: the backend reaches it through a
  :class:`~botmesh_testkit.faultproxy.FaultProxy` (a write whose reply is lost, reset
  connections, latency); skipped for harnesses without a ``server_address()``.

Binding the kv suite takes three lines in a test module::

    from botmesh_testkit.conformance.kv import DurableKvConformance

    class TestMyKv(DurableKvConformance):
        @pytest.fixture
        def kv_factory(self, tmp_path):
            return lambda: MyKv(path=tmp_path / "db")

``kv_factory`` returns a zero-argument callable; each call gives a **new, unopened**
``DurableKv`` on the **same** storage (the suite opens, closes, and — for the crash test —
abandons instances itself).

Binding the durability suite takes three lines too::

    from botmesh_testkit.backends import resolve
    from botmesh_testkit.conformance.durability import DurabilityConformance

    class TestMyBackend(DurabilityConformance):
        @pytest.fixture
        def botmesh_harness_factory(self):
            return resolve("my_pkg.backend:make")   # or: lambda workdir: MyHarness(workdir)

``botmesh_harness_factory`` returns ``factory(workdir) -> BackendHarness`` — exactly what
:func:`botmesh_testkit.backends.resolve` returns for a built-in name or a
``pkg.module:factory`` path.

The tests carry ``@pytest.mark.spec(<ids>)``. The testkit's pytest plugin (entry point
``botmesh``) registers the ``spec`` marker; a project that runs without it and with
``--strict-markers`` registers the marker in its own configuration
(``markers = ["spec(*ids): ..."]``).
"""

from __future__ import annotations

from .claims import ClaimsConformance
from .durability import DurabilityConformance, HarnessFactory
from .faults import ServerFaultConformance
from .kv import DurableKvConformance, KvFactory

__all__ = [
    "ClaimsConformance",
    "DurabilityConformance",
    "DurableKvConformance",
    "HarnessFactory",
    "KvFactory",
    "ServerFaultConformance",
]
