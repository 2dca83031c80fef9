"""Real PostgreSQL and Redis servers for tests: private throw-away servers, the
provisioning order the pytest plugin follows, and a TCP fault proxy.

What is where:

* :mod:`.process` — the life cycle every private server shares (:class:`~.process.ChildServer`:
  start and poll until ready, ``kill()`` = SIGKILL of the whole process tree, ``stop()``,
  ``close()``), :func:`free_port`, :class:`ServerStartError`, the OS-user checks;
* :mod:`.postgres` — :class:`PrivatePostgres` (``initdb`` + ``postgres``, run as the OS user
  ``postgres`` under root), :func:`find_postgres_bindir` and :data:`POSTGRES_BIN_GLOBS`;
* :mod:`.redis` — :class:`PrivateRedis` (``redis-server`` with AOF ``always``),
  :func:`find_redis_server`;
* :mod:`.provisioning` — :func:`provision_postgres` / :func:`provision_redis` (a given URL,
  else a private server, else testcontainers, else :class:`ServiceUnavailable`), the
  :class:`Provisioned` servers with their per-run databases and key prefixes,
  :class:`Attempt`, the environment variable names, :func:`namespace_hint`,
  :func:`skips_allowed`, :func:`redact_url`;
* :mod:`.faultproxy` — :class:`~.faultproxy.FaultProxy`, a TCP proxy that injects latency,
  resets, blackholes and cut replies between a backend and its server (not re-exported
  here: import it from its module).

This package re-exports the public names of the first four modules. They are bindings
made at import: to monkeypatch a name (``POSTGRES_BIN_GLOBS``, ``free_port`` ...) for the
code that uses it, patch the module that defines it, not this package.

Nothing here imports pytest, psycopg, redis-py, psutil or testcontainers at import time:
the modules work inside and outside pytest, and each optional package is imported where
it is needed (psycopg to poll and administer PostgreSQL, redis-py to administer Redis
key prefixes, psutil to kill a server's process tree, testcontainers for a container).

Example, in one's own ``conftest.py``::

    import pytest
    from botmesh_testkit.servers import ServiceUnavailable, namespace_hint, provision_postgres

    @pytest.fixture(scope="session")
    def postgres_url():
        try:
            server = provision_postgres()
        except ServiceUnavailable as exc:
            (pytest.fail if exc.should_fail else pytest.skip)(str(exc))
        db_url = server.new_database(namespace_hint())
        yield db_url
        server.close()
"""

from __future__ import annotations

from .postgres import POSTGRES_BIN_GLOBS, PrivatePostgres, find_postgres_bindir
from .process import ServerStartError, free_port
from .provisioning import (
    ALLOW_SKIP_ENV,
    POSTGRES_URL_ENV,
    REDIS_PREFIX_ENV,
    REDIS_URL_ENV,
    Attempt,
    Provisioned,
    ProvisionedPostgres,
    ProvisionedRedis,
    ServiceUnavailable,
    namespace_hint,
    provision_postgres,
    provision_redis,
    redact_url,
    skips_allowed,
)
from .redis import PrivateRedis, find_redis_server

__all__ = [
    "ALLOW_SKIP_ENV",
    "POSTGRES_BIN_GLOBS",
    "POSTGRES_URL_ENV",
    "REDIS_PREFIX_ENV",
    "REDIS_URL_ENV",
    "Attempt",
    "PrivatePostgres",
    "PrivateRedis",
    "Provisioned",
    "ProvisionedPostgres",
    "ProvisionedRedis",
    "ServerStartError",
    "ServiceUnavailable",
    "find_postgres_bindir",
    "find_redis_server",
    "free_port",
    "namespace_hint",
    "provision_postgres",
    "provision_redis",
    "redact_url",
    "skips_allowed",
]
