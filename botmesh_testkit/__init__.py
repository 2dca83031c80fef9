"""botmesh_testkit: fault injection and conformance for botmesh durability backends.

* :func:`crashable` / :class:`CrashableProvider` — simulated process deaths at named
  crash points (TEST-1, TEST-2), :class:`World` — successive bot incarnations on one
  backend (TEST-3); all in :mod:`botmesh_testkit.crash`.
* :func:`scenario` — recovery stories run by the pytest plugin
  (:mod:`botmesh_testkit.scenario`).

The names are re-exported lazily: importing this package (as loading the pytest plugin
does) imports nothing of ``botmesh``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from .crash.points import crash_points
    from .crash.provider import CrashableProvider
    from .crash.world import World
    from .crash.wrapper import CrashableBackend, crashable
    from .scenario.api import Scenario, scenario

__all__ = ["CrashableBackend", "CrashableProvider", "Scenario", "World", "crash_points", "crashable", "scenario"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "CrashableBackend": ".crash.wrapper",
    "CrashableProvider": ".crash.provider",
    "Scenario": ".scenario.api",
    "World": ".crash.world",
    "crash_points": ".crash.points",
    "crashable": ".crash.wrapper",
    "scenario": ".scenario.api",
})
