"""Backends by name: the built-in ones, those on a provisioned server, names registered by
the ``pytest_botmesh_register_backends`` hook or the entry-point group, and
``pkg.module:factory`` paths; :func:`resolve` turns any of them into a harness factory."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .base import HarnessFactory
from .events import EventsHarness
from .factory import factory_harness
from .file import FileHarness
from .memory import MemoryHarness
from .sqlite import SQLiteHarness

HARNESSES: dict[str, HarnessFactory] = {
    "memory": MemoryHarness,
    "file": lambda d: FileHarness(d),
    "file+log": lambda d: FileHarness(d, append_log=True),
    "sqlite": SQLiteHarness,
    "events": lambda d: EventsHarness(d, name="events"),
    "events-shared": lambda d: EventsHarness(d, name="events-shared"),
    "events-shared+log": lambda d: EventsHarness(d, name="events-shared+log"),
}
"""The built-in backends by name."""


class BackendSpecError(ValueError):
    """A ``--botmesh-backend`` value that names nothing usable."""


ENTRY_POINT_GROUP = "botmesh_testkit.backends"
"""Installed distributions register backends by name in this entry-point group."""


class BackendRegistry:
    """Backends added by name at run time (``pytest_botmesh_register_backends``), beside
    the built-in ones and the entry-point group."""

    def __init__(self) -> None:
        self._factories: dict[str, HarnessFactory] = {}

    def add(self, name: str, harness_factory: HarnessFactory) -> None:
        """``harness_factory(workdir)`` returns a :class:`BackendHarness`."""
        if not name or ":" in name or name in HARNESSES:
            raise BackendSpecError(f"cannot register backend name {name!r}: it must be non-empty, "
                                   f"without ':', and not a built-in ({', '.join(HARNESSES)})")
        if not callable(harness_factory):
            raise BackendSpecError(f"backend {name!r}: harness factory {harness_factory!r} is not callable")
        self._factories[name] = harness_factory

    def add_factory(self, name: str, factory: Callable[..., Any]) -> None:
        """A backend factory as for ``pkg.module:factory`` (see :class:`FactoryHarness`)."""
        self.add(name, factory_harness(name, factory))

    def get(self, name: str) -> HarnessFactory | None:
        return self._factories.get(name)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def clear(self) -> None:
        self._factories.clear()


REGISTRY = BackendRegistry()
"""The process-wide registry that :func:`resolve` consults."""


def entry_point_backends() -> dict[str, Any]:
    """Entry points of the group ``botmesh_testkit.backends``, by name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_names() -> list[str]:
    """Every backend name :func:`resolve` accepts without a dotted path."""
    return [*HARNESSES, *SERVICE_BACKENDS, *REGISTRY.names(), *sorted(entry_point_backends())]


SERVICE_BACKENDS: dict[str, str] = {
    "postgres": "botmesh_testkit.backends.postgres:provisioned",
    "redis": "botmesh_testkit.backends.redis:provisioned",
}
"""Built-in backends on a server the plugin provisions (:mod:`botmesh_testkit.servers`)."""


def resolve(spec: str) -> HarnessFactory:
    """A harness factory for a built-in name, a registered name (hook or entry point),
    or a ``pkg.module:factory`` path."""
    if spec in HARNESSES:
        return HARNESSES[spec]
    if spec in SERVICE_BACKENDS:
        module_name, _, attr = SERVICE_BACKENDS[spec].partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
        except ImportError as exc:
            raise BackendSpecError(f"{spec!r} needs its driver: pip install 'botmesh-testkit[{spec}]' ({exc})") from None
    registered = REGISTRY.get(spec)
    if registered is not None:
        return registered
    if ":" not in spec:
        eps = entry_point_backends()
        if spec in eps:
            try:
                obj = eps[spec].load()
            except Exception as exc:  # an installed plugin that does not import
                raise BackendSpecError(f"{spec!r}: entry point {eps[spec].value!r} of group "
                                       f"{ENTRY_POINT_GROUP!r} failed to load: {exc!r}") from None
            return factory_harness(spec, obj)
        raise BackendSpecError(f"{spec!r} is not a known backend ({', '.join(known_names())}) "
                               "nor a 'pkg.module:factory' path")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendSpecError(f"{spec!r}: cannot import module {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise BackendSpecError(f"{spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory_harness(spec, factory)
