"""Collecting scenario files as pytest items (used by the plugin): a
:class:`ScenarioFile` per file, a :class:`ScenarioItem` per scenario, backend and
policy — and per crash point for ``crash="every"|"random"`` scenarios. The shipped GUAR
scenarios are the top-level ``scenarios/guar/`` folder, installed as the package
``botmesh_testkit.scenarios`` (:func:`shipped_dir`)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import shlex
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ..backends.registry import resolve
from ..requirements import suggest, unknown
from .api import (CrashPoint, Scenario, ScenarioError, ScenarioFailure, ScenarioSpec, crash_points_of, dry_run,
                  innermost_is_own, where_in_scenario)

SHIPPED_PACKAGE = "botmesh_testkit.scenarios"


def shipped_dir() -> Path:
    """The folder of the shipped GUAR scenarios: where the import system finds the package
    ``botmesh_testkit.scenarios`` (the installed wheel's copy, or ``scenarios/guar/`` of a
    source checkout)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the shipped scenarios ({SHIPPED_PACKAGE}) are not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def scenario_files(folder: Path) -> list[Path]:
    """The scenario files of ``folder`` (``*.py`` not starting with ``_``), sorted."""
    return sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))


def load_module(path: Path) -> Any:
    """Import a scenario file: shipped ones as package modules, others by path."""
    if path.parent == shipped_dir():
        return importlib.import_module(f"{SHIPPED_PACKAGE}.{path.stem}")
    folder = str(path.parent.resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    digest = hashlib.sha1(folder.encode()).hexdigest()[:8]
    name = f"botmesh_scenario_{digest}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def scenarios_of(module: Any) -> list[ScenarioSpec]:
    """The :func:`~.api.scenario` functions of a module, in definition order."""
    return [obj.__botmesh_scenario__ for obj in vars(module).values() if hasattr(obj, "__botmesh_scenario__")]


class ScenarioFile(pytest.File):
    """A scenario file; its items are ``scenario[backend(-policy)]``."""

    def __init__(self, *, backends: Sequence[str], rerun: str, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backends = list(backends)
        self.rerun = rerun
        self.seed = seed

    def collect(self) -> Iterator[pytest.Item]:
        try:
            module = load_module(self.path)
        except Exception as exc:
            raise self.CollectError(f"scenario file {self.path} failed to import: {exc!r}") from exc
        found = scenarios_of(module)
        if not found:
            raise self.CollectError(f"scenario file {self.path} defines no @scenario function")
        for spec in found:
            for backend in self.backends:
                for policy in spec.policies or (None,):
                    suffix = backend if policy is None else f"{backend}-{policy}"
                    if spec.crash is None or not self._claims(backend, spec.requires):
                        yield ScenarioItem.from_parent(self, name=f"{spec.name}[{suffix}]", spec=spec,
                                                       backend=backend, policy=policy)
                        continue
                    try:
                        passed, raised = dry_run(spec, backend, policy)
                    except BaseException as exc:  # the scenario fails without any crash
                        yield ScenarioItem.from_parent(self, name=f"{spec.name}[{suffix}-dry-run]", spec=spec,
                                                       backend=backend, policy=policy, dry_error=exc)
                        continue
                    for point in crash_points_of(spec, passed, raised, self.seed):
                        yield ScenarioItem.from_parent(self, name=f"{spec.name}[{suffix}-{point.label}]", spec=spec,
                                                       backend=backend, policy=policy, point=point)

    @staticmethod
    def _claims(backend: str, requires: Sequence[str]) -> bool:
        if not requires:
            return True
        with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
            caps = resolve(backend)(tmp).capabilities
        return all(getattr(caps, c, False) for c in requires)


class ScenarioItem(pytest.Item):
    """One scenario on one backend (and policy)."""

    def __init__(self, *, spec: ScenarioSpec, backend: str, policy: str | None, point: CrashPoint | None = None,
                 dry_error: BaseException | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.backend = backend
        self.policy = policy
        self.point = point
        self.dry_error = dry_error
        self.scenario: Scenario | None = None
        self.add_marker(pytest.mark.spec(*spec.ids))
        self.user_properties.append(("botmesh_backend", backend))

    @property
    def origin(self) -> str:
        """``file:line`` of the scenario function."""
        code = self.spec.fn.__code__
        return f"{code.co_filename}:{code.co_firstlineno}"

    def runtest(self) -> None:
        try:
            self._runtest()
        except ScenarioError as exc:
            # the scenario's mistake, not the backend's: no requirement is broken by it
            self.user_properties.append(("botmesh_scenario_error", str(exc)))
            self.user_properties.append(("botmesh_violated", ()))
            raise
        except ScenarioFailure as exc:  # broken: the ids the failed expectation names
            if exc.ids:
                self.user_properties.append(("botmesh_violated", exc.ids))
            raise

    def _runtest(self) -> None:
        spec = self.spec
        bad = unknown(spec.ids)
        if bad:
            close = suggest(bad[0])
            raise ScenarioError(self.origin, f"@scenario names {bad[0]!r}, which is not a requirement id of the spec"
                                + (f" (closest: {', '.join(close)})" if close else "")
                                + "; `botmesh-testkit spec` lists them")
        if self.dry_error is not None:
            if isinstance(self.dry_error, ScenarioError):
                raise self.dry_error
            mistake = _own_mistake(self.dry_error, self.spec.fn.__code__.co_filename)
            if mistake is not None:
                raise mistake
            raise ScenarioFailure(f"[{', '.join(spec.ids)}] the crash-free dry run (which finds the crash points) "
                                  f"failed: {self.dry_error!r}", spec.ids) from self.dry_error
        with tempfile.TemporaryDirectory(prefix="botmesh-scenario-") as tmp:
            harness = resolve(self.backend)(tmp)
            missing = [c for c in spec.requires if not getattr(harness.capabilities, c, False)]
            if missing:
                pytest.skip(f"capability not claimed: {', '.join(missing)} (backend {self.backend})")
            self.scenario = Scenario(harness, backend=self.backend, ids=spec.ids, policy=self.policy, point=self.point,
                                     origin=self.origin)

            async def run() -> None:
                s = self.scenario
                assert s is not None
                try:
                    await asyncio.wait_for(spec.fn(s), spec.timeout)
                except (ScenarioError, pytest.skip.Exception):
                    raise
                except TimeoutError:
                    raise s.fail(f"did not finish within {spec.timeout:g} real seconds "
                                 "(a backend that hangs or never settles)") from None
                except BaseException as exc:
                    mistake = s.mistake(exc) or _own_mistake(exc, s.file)
                    if mistake is not None:
                        raise mistake from None
                    raise
                else:
                    mistake = s.mistake(None)
                    if mistake is not None:
                        raise mistake
                finally:
                    await s.world.close()

            asyncio.run(run())

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        rerun = f"  reproduce: {self.parent.rerun} -k {shlex.quote(self.name)}"  # type: ignore[union-attr]
        if isinstance(excinfo.value, ScenarioError):
            return (f"scenario error (a mistake in the scenario, not a violation by backend {self.backend}): "
                    f"{excinfo.value}\n{rerun}")
        head = f"scenario {self.path.name}::{self.spec.name} on {self.backend}"
        if self.policy:
            head += f" (on_ambiguous={self.policy})"
        if self.point is not None:
            head += f", dying at {self.point.label}"
        lines = [f"{head} checks {', '.join(self.spec.ids)}"]
        if isinstance(excinfo.value, AssertionError):
            lines.append(f"  FAILED: {excinfo.value}")
        else:
            lines.append(str(super().repr_failure(excinfo)))
        if self.scenario is not None:
            lines += [f"  {line}" for line in self.scenario.story()]
        lines.append(rerun)
        return "\n".join(lines)

    def reportinfo(self) -> tuple[Path, int, str]:
        # the item's own name (backend, policy, crash point): the header of its failure is its own
        return self.path, 0, f"scenario {self.path.name}::{self.name}"


def _own_mistake(exc: BaseException, file: str) -> ScenarioError | None:
    """An error that is the scenario's own: a bad ``durability=`` option it gave
    (``ConfigError``), or an exception raised in the scenario's own code (a NameError, a
    wrong call)."""
    from botmesh.core.errors import ConfigError

    if isinstance(exc, ConfigError):
        where = where_in_scenario(exc.__traceback__, file) or file
        return ScenarioError(where, f"the scenario's durability options: {exc}")
    if not isinstance(exc, AssertionError) and innermost_is_own(exc.__traceback__, file):
        where = where_in_scenario(exc.__traceback__, file) or file
        return ScenarioError(where, f"{type(exc).__name__}: {exc}")
    return None
