"""botmesh_testkit: fault injection and conformance for botmesh durability backends.

* :func:`crashable` / :class:`CrashableProvider` — simulated process deaths at named
  crash points (TEST-1, TEST-2).
"""

from .crash import CrashableBackend, CrashableProvider, crash_points, crashable

__all__ = ["CrashableBackend", "CrashableProvider", "crash_points", "crashable"]
