"""Backend harnesses: how the testkit opens a backend, "kills the process" holding it,
and opens it again as a restarted process would (TEST-3).

One module per backend (:mod:`.memory`, :mod:`.file`, :mod:`.sqlite`, :mod:`.postgres`,
:mod:`.redis`), the harness protocol (:mod:`.base`), a third party's factory
(:mod:`.factory`) and the names the plugin accepts (:mod:`.registry`:
:func:`resolve`). A harness describes its storage for a child process of
:mod:`botmesh_testkit.kill` as a :class:`~.base.KillSpec`. The PostgreSQL and Redis harnesses need their drivers and are not
imported here.
"""

from .base import (
    BackendHarness,
    FactorySpec,
    FileSpec,
    HarnessFactory,
    KillSpec,
    MemorySpec,
    PostgresSpec,
    RedisSpec,
    SQLiteSpec,
)
from .factory import FactoryHarness
from .file import FileHarness
from .memory import MemoryHarness
from .registry import (
    ENTRY_POINT_GROUP,
    HARNESSES,
    REGISTRY,
    SERVICE_BACKENDS,
    BackendRegistry,
    BackendSpecError,
    entry_point_backends,
    known_names,
    resolve,
)
from .sqlite import SQLiteHarness

__all__ = [
    "ENTRY_POINT_GROUP", "HARNESSES", "REGISTRY", "SERVICE_BACKENDS", "BackendHarness", "BackendRegistry",
    "BackendSpecError", "FactoryHarness", "FactorySpec", "FileHarness", "FileSpec", "HarnessFactory", "KillSpec",
    "MemoryHarness", "MemorySpec", "PostgresSpec", "RedisSpec", "SQLiteHarness", "SQLiteSpec",
    "entry_point_backends", "known_names", "resolve",
]
