"""The conformance suites any botmesh backend must pass (BACK-7), shipped inside the
package so that a third party certifies its backend in its own repository.

* :mod:`botmesh_testkit.conformance.kv` — :class:`DurableKvConformance`, the suite of
  the :class:`botmesh.core.spi.DurableKv` contract: compare-and-set with versions, the
  two ordered indexes, scans, scope and space isolation, atomicity under concurrency,
  lifecycle, survival of a crash (when claimed) and step-by-step agreement with
  :class:`botmesh.core.spi.MemoryKv`, the reference.

Binding it takes three lines in a test module::

    from botmesh_testkit.conformance.kv import DurableKvConformance

    class TestMyKv(DurableKvConformance):
        @pytest.fixture
        def kv_factory(self, tmp_path):
            return lambda: MyKv(path=tmp_path / "db")

``kv_factory`` returns a zero-argument callable; each call gives a **new, unopened**
``DurableKv`` on the **same** storage (the suite opens, closes, and — for the crash test —
abandons instances itself).

The tests carry ``@pytest.mark.spec(<ids>)``. The testkit's pytest plugin (entry point
``botmesh``) registers the ``spec`` marker; a project that runs without it and with
``--strict-markers`` registers the marker in its own configuration
(``markers = ["spec(*ids): ..."]``).
"""

from __future__ import annotations

from .kv import DurableKvConformance, KvFactory

__all__ = ["DurableKvConformance", "KvFactory"]
