"""The plugin's own hooks (``pytest_botmesh_*``), for conftest files and plugins.

Register a backend under a short name, so that ``--botmesh-backend=NAME`` and the
``botmesh_backend`` ini key accept it::

    # conftest.py
    def pytest_botmesh_register_backends(registry):
        registry.add("mykv", lambda workdir: MyHarness(workdir))        # a BackendHarness
        registry.add_factory("mykv-lite", my_pkg.make_kv)              # like pkg.module:factory

An installed distribution can do the same without a conftest, through the entry-point
group ``botmesh_testkit.backends`` (``name = "pkg.module:factory"``; the object is a
``BackendHarness`` subclass or a factory as for ``--botmesh-backend=pkg.module:factory``).

``pytest_botmesh_cell_finished(cell, outcome)`` is called after every crash-matrix cell
(on the process that ran it), e.g. to export outcomes to a dashboard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .backends.registry import BackendRegistry
    from .matrix.cells import Cell, Outcome


@pytest.hookspec
def pytest_botmesh_register_backends(registry: BackendRegistry) -> None:
    """Add backends by name: ``registry.add(name, harness_factory)`` where
    ``harness_factory(workdir)`` returns a :class:`~botmesh_testkit.backends.base.BackendHarness`,
    or ``registry.add_factory(name, factory)`` with a backend factory as for
    ``--botmesh-backend=pkg.module:factory``. Called once per test process, at
    configure time."""


@pytest.hookspec
def pytest_botmesh_cell_finished(cell: Cell, outcome: Outcome) -> None:
    """A crash-matrix cell finished; ``outcome.passed``, ``outcome.violations`` and
    ``outcome.report(seed)`` say how."""
