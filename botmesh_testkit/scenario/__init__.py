"""Scenarios: recovery stories written as short async functions, run by the pytest
plugin against every selected backend. The API is :mod:`.api` (``scenario``,
``Scenario``); :mod:`.collect` turns scenario files into pytest items. Scenario files
import ``from botmesh_testkit.scenario import scenario``."""

from .api import CrashPoint, Scenario, ScenarioFailure, ScenarioSpec, scenario

__all__ = ["CrashPoint", "Scenario", "ScenarioFailure", "ScenarioSpec", "scenario"]
