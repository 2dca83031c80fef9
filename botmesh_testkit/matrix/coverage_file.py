"""A coverage.py data file of a certification run, one dynamic context per item
(``--botmesh-coverage=PATH``, ``botmesh-testkit run --coverage PATH``).

What is measured: the engine (the ``botmesh.core`` package: the recovery code of
:data:`~botmesh_testkit.matrix.coverage.ENGINE_FILE`, the ``DurableKv`` adapter, the
built-in file and memory backends) and the *backend's own package*: for a built-in name
its ``botmesh.*_store`` package, for ``pkg.module:factory`` (or an entry point, or a
name registered by hook) the top-level package of the factory's module — a third
party's code included — or that module alone when it is not in a package.

Contexts: each item of the parts that run in the pytest process gets one, named after
its part and what it is. A crash-matrix cell is two: ``matrix:<cell id>`` (e.g.
``matrix:sqlite/one-send/skip/before:outbox.mark_sent#1``) is the recovery — from the
restart after the crash to the end of the drain, what the crash point made run — and
``matrix:<cell id> (outside recovery)`` the rest of the cell (the run up to the crash,
the checks). A suite, scenario or explore item is ``<part>:<its node id>``. The kill
and power-cut loops run the backend in child processes that die by ``SIGKILL`` (their
coverage can never be saved): they are not measured. So ``coverage html
--data-file=PATH --show-contexts`` shows, next to each line of the backend, the crash
points whose recovery ran it.

Under pytest-xdist each worker writes ``PATH.botmesh-<worker>``; the controller combines
them into PATH at the end. The per-point summary of ``--botmesh-recovery-coverage``
(:mod:`.coverage`) is read from the same measurement when both are on. Another tracer
(pytest-cov, a debugger) is left alone: nothing is measured and the summary says why.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.util
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

OUTSIDE_RECOVERY = " (outside recovery)"
"""Suffix of a matrix cell's context for what ran outside its recovery."""

WORKER_SUFFIX = "botmesh-"
"""An xdist worker's data file is ``PATH.botmesh-<worker id>``."""

BUILTIN_PACKAGES: dict[str, str] = {
    "sqlite": "botmesh.sqlite_store",
    "postgres": "botmesh.postgres_store",
    "redis": "botmesh.redis_store",
    "file": "botmesh.core",
    "file+log": "botmesh.core",
    "memory": "botmesh.core",
}
"""The package each built-in backend's code lives in."""

ENGINE_PACKAGE = "botmesh.core"


class CoverageFileError(ValueError):
    """A data file path that cannot be written."""


def check_path(raw: str, base: str | os.PathLike[str] | None = None) -> Path:
    """The absolute data file path of ``raw`` (relative to ``base``, else the current
    directory), or :class:`CoverageFileError` saying why it cannot be written: it is a
    directory, its directory does not exist, or that directory is not writable."""
    path = (Path(base or os.getcwd()) / Path(raw).expanduser()).absolute()
    if path.is_dir():
        raise CoverageFileError(f"{raw!r} is a directory; give the path of the coverage data file to write")
    if not path.parent.is_dir():
        raise CoverageFileError(f"the directory of {raw!r} ({str(path.parent)!r}) does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CoverageFileError(f"the directory of {raw!r} ({str(path.parent)!r}) is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise CoverageFileError(f"{raw!r} exists and is not writable")
    return path


def _package_of(module_name: str) -> str:
    """What to measure for code of ``module_name``: the directory of its top-level
    package, or its top-level module's name when that is a single file."""
    top = module_name.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        return top
    if spec.submodule_search_locations:
        return os.path.realpath(next(iter(spec.submodule_search_locations)))
    return top


def _dir_of(package: str) -> str:
    module = importlib.import_module(package)
    return os.path.realpath(os.path.dirname(module.__file__ or ""))


def backend_sources(backend: str) -> list[str]:
    """The code of ``backend`` (a name as ``--botmesh-backend`` takes it) to measure: a
    directory, or an importable module name (see the module docstring)."""
    if backend in BUILTIN_PACKAGES:
        with contextlib.suppress(ImportError):  # a server backend without its driver: measured if importable
            return [_dir_of(BUILTIN_PACKAGES[backend])]
        return []
    if ":" in backend:
        return [_package_of(backend.partition(":")[0])]
    from ..backends.registry import REGISTRY, entry_point_backends

    eps = entry_point_backends()
    if backend in eps:
        return [_package_of(eps[backend].value.partition(":")[0])]
    factory = REGISTRY.get(backend)
    module = getattr(getattr(factory, "botmesh_factory", factory), "__module__", None)
    if isinstance(module, str) and not module.startswith(("botmesh_testkit", "botmesh.")):
        return [_package_of(module)]
    return []


def sources(backends: Iterable[str]) -> list[str]:
    """The engine's package and each backend's code, without repeats."""
    out = [_dir_of(ENGINE_PACKAGE)]
    for b in backends:
        out += [s for s in backend_sources(b) if s not in out]
    return out


class CoverageFile:
    """The measurement of one pytest process, written to ``path`` (plus ``suffix``: an
    xdist worker's). :meth:`item` measures one item under its context; :meth:`lines`
    reads back the lines one context ran (the per-point summary)."""

    def __init__(self, path: Path, source: list[str], suffix: str | None = None) -> None:
        import coverage

        self.path = path
        self.suffix = suffix
        self.label: str | None = None
        """The context of the item being measured (a matrix cell's recovery context)."""
        self.cov: Any = coverage.Coverage(data_file=str(path), data_suffix=suffix, source=source, branch=False,
                                          config_file=False)
        self.cov.set_option("run:disable_warnings", [
            "no-data-collected", "module-not-measured", "module-not-imported", "already-imported",
            "include-ignored", "couldnt-parse", "module-not-python",
        ])
        self.started = False
        self.items = 0

    @property
    def written(self) -> str:
        """The file this process writes."""
        return str(self.path) + (f".{self.suffix}" if self.suffix else "")

    @contextlib.contextmanager
    def item(self, label: str, *, recovery_split: bool = False) -> Iterator[None]:
        """Measure the block under the context ``label``; with ``recovery_split`` (a
        matrix cell) under ``label + OUTSIDE_RECOVERY`` until :meth:`recovery` says
        otherwise."""
        self.label = label
        self.cov.start()
        self.started = True
        self.cov.switch_context(label + OUTSIDE_RECOVERY if recovery_split else label)
        try:
            yield
        finally:
            self.cov.stop()
            self.started = False
            self.label = None
            self.items += 1

    @contextlib.contextmanager
    def recovery(self) -> Iterator[None]:
        """Inside :meth:`item` of a matrix cell: the block is its recovery."""
        assert self.label is not None and self.started
        self.cov.switch_context(self.label)
        try:
            yield
        finally:
            self.cov.switch_context(self.label + OUTSIDE_RECOVERY)

    def lines(self, label: str, filename: str) -> set[int]:
        """The lines of ``filename`` that ran under the context ``label`` (so far)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = self.cov.get_data()
        data.set_query_contexts(["^" + re.escape(label) + "$"])
        try:
            for path in data.measured_files():
                if os.path.realpath(path) == os.path.realpath(filename):
                    return set(data.lines(path) or ())
            return set()
        finally:
            data.set_query_contexts(None)

    def save(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.cov.save()


_ACTIVE: CoverageFile | None = None


def active() -> CoverageFile | None:
    """The measurement of this process, while an item is measured (else None)."""
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.started else None


def activate(cf: CoverageFile | None) -> None:
    global _ACTIVE
    _ACTIVE = cf


def stale_files(path: Path) -> list[str]:
    """The data file and the worker files of an earlier run at ``path``."""
    return [p for p in [str(path), *glob.glob(glob.escape(str(path)) + "." + WORKER_SUFFIX + "*")] if os.path.exists(p)]


def combine(path: Path) -> int:
    """Combine the workers' files into ``path`` (they are removed); the number combined."""
    import coverage

    parts = sorted(glob.glob(glob.escape(str(path)) + "." + WORKER_SUFFIX + "*"))
    if not parts:
        return 0
    cov = coverage.Coverage(data_file=str(path), config_file=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cov.combine(parts, keep=False)
        cov.save()
    return len(parts)
