"""Provisioning: the order in which the pytest plugin finds a server for a service backend,
and the namespaces that keep runs sharing one server apart.

:func:`provision_postgres` and :func:`provision_redis` return a :class:`Provisioned`
server, trying in this order:

1. **a URL**: the ``url`` argument, else ``BOTMESH_POSTGRES_URL`` / ``BOTMESH_REDIS_URL``.
   It must answer. *A given URL that does not answer is an error, not a fallback*: the
   user chose that server, and silently testing another one would certify the wrong
   thing. :class:`ServiceUnavailable` is raised with ``fatal=True`` (the plugin fails
   the run, with or without ``--botmesh-require-services``).
2. **a private server** from local binaries: ``postgres``/``initdb`` on ``PATH`` or in
   ``/usr/lib/postgresql/*/bin`` (see :data:`~.postgres.POSTGRES_BIN_GLOBS`),
   ``redis-server`` on ``PATH``.
3. **testcontainers**, when it is installed and a Docker engine answers (images
   ``postgres:15-alpine`` / ``redis:7-alpine``, overridable with
   ``BOTMESH_POSTGRES_IMAGE`` / ``BOTMESH_REDIS_IMAGE``).
4. otherwise :class:`ServiceUnavailable`, whose message lists each step and why it did
   not give a server. :attr:`ServiceUnavailable.should_fail` tells the plugin whether to
   fail (a broken given URL, or ``require=True`` from ``--botmesh-require-services``) or to
   skip.

Isolation: each test run / xdist worker takes its own namespace on the provisioned
server, so runs sharing one server never see each other's data:

* PostgreSQL: :meth:`ProvisionedPostgres.new_database` creates a database named
  ``bm_<hint>_<random>`` and returns its URL (databases rather than schemas: nothing to
  add to the URL, and dropping one removes everything a run left behind);
* Redis: :meth:`ProvisionedRedis.new_prefix` returns a unique key prefix
  ``bm_<hint>_<random>`` (the Redis backend keeps all its keys under ``{prefix}:``).

:func:`namespace_hint` gives a default hint (the xdist worker id, or ``main``).
:meth:`Provisioned.close` drops the databases/prefixes it created on a server given by
URL, and stops a private server or a container it started.

Server-fault tests (kill -9 and restart) use a :class:`~.postgres.PrivatePostgres` /
:class:`~.redis.PrivateRedis` of their own, never a shared server; the provisioned private
server is reachable as :attr:`Provisioned.server`.

Also here: the names of the environment variables involved, :func:`skips_allowed` and
:func:`redact_url`.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import quote, urlsplit, urlunsplit

from .postgres import PrivatePostgres, pg_probe
from .process import ChildServer, ServerStartError
from .redis import PrivateRedis, redis_probe

__all__ = [
    "ALLOW_SKIP_ENV",
    "POSTGRES_URL_ENV",
    "REDIS_PREFIX_ENV",
    "REDIS_URL_ENV",
    "Attempt",
    "Provisioned",
    "ProvisionedPostgres",
    "ProvisionedRedis",
    "ServiceUnavailable",
    "namespace_hint",
    "provision_postgres",
    "provision_redis",
    "redact_url",
    "skips_allowed",
]

POSTGRES_URL_ENV = "BOTMESH_POSTGRES_URL"
REDIS_URL_ENV = "BOTMESH_REDIS_URL"
REDIS_PREFIX_ENV = "BOTMESH_REDIS_PREFIX"
"""The key prefix the plugin gives a test run on the Redis server (the redis harness puts
its per-workdir prefixes under it)."""
#: Set to ``1`` to let the project's own service tests skip when binaries are missing
#: (by default they fail: CI runs them for real).
ALLOW_SKIP_ENV = "BOTMESH_ALLOW_SKIP_SERVICES"

Kind = Literal["url", "private", "container"]


def skips_allowed() -> bool:
    """Whether ``BOTMESH_ALLOW_SKIP_SERVICES=1`` lets service tests skip instead of fail."""
    return os.environ.get(ALLOW_SKIP_ENV, "").strip().lower() in {"1", "true", "yes"}


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def namespace_hint(prefix: str = "") -> str:
    """A hint for :meth:`ProvisionedPostgres.new_database` / :meth:`ProvisionedRedis.new_prefix`:
    the xdist worker id (``gw0`` ...) or ``main``, after an optional ``prefix``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"{prefix}_{worker}" if prefix else worker


def _sanitize(hint: str, limit: int) -> str:
    cleaned = re.sub(r"[^a-z0-9_]+", "_", hint.lower()).strip("_")
    return re.sub(r"_+", "_", cleaned)[:limit].strip("_") or "x"


@dataclass(frozen=True)
class Attempt:
    """One provisioning step and what came of it."""

    step: str  # "url", "private", "container"
    outcome: str


class ServiceUnavailable(RuntimeError):
    """No server could be provisioned. The message lists every step tried and why it
    failed. ``should_fail`` is True when the run must fail rather than skip: a URL was
    given and does not answer (``fatal``), or services are required (``required``,
    from ``--botmesh-require-services``)."""

    def __init__(self, service: str, attempts: Sequence[Attempt], *, required: bool = False, fatal: bool = False) -> None:
        self.service = service
        self.attempts = list(attempts)
        self.required = required
        self.fatal = fatal
        lines = [f"no {service} server for the tests; tried:"]
        lines += [f"  {n}. {a.step}: {a.outcome}" for n, a in enumerate(self.attempts, 1)]
        if fatal:
            lines.append("  a URL that was given is used or fails: it is never replaced by another server")
        elif required:
            lines.append("  services are required (--botmesh-require-services): failing instead of skipping")
        super().__init__("\n".join(lines))

    @property
    def should_fail(self) -> bool:
        return self.required or self.fatal


class _StepFailed(Exception):
    """Internal: one provisioning step did not give a server (the message says why)."""


class Provisioned:
    """A server provisioned for the tests. ``kind`` is ``"url"`` (a given server),
    ``"private"`` (:attr:`server` is the :class:`PrivatePostgres`/:class:`PrivateRedis`)
    or ``"container"``. ``attempts`` records the steps tried before it."""

    service = "service"

    def __init__(
        self,
        url: str,
        kind: Kind,
        *,
        server: ChildServer | None = None,
        container: Any = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        self.url = url
        self.kind: Kind = kind
        self.server = server
        self.container = container
        self.attempts = list(attempts)
        self._closed = False

    def _cleanup_namespaces(self) -> None:
        """Drop what :meth:`new_*` created (only matters on a server we did not start)."""

    def close(self) -> None:
        """Drop the namespaces created on a given server; stop a private server or a
        container started here. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.kind == "url":
                self._cleanup_namespaces()
        finally:
            if self.server is not None:
                self.server.close()
            if self.container is not None:
                with contextlib.suppress(Exception):
                    self.container.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {redact_url(self.url)}>"


class ProvisionedPostgres(Provisioned):
    """A provisioned PostgreSQL server; tests work in databases of their own."""

    service = "postgres"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.databases: list[str] = []

    def database_url(self, name: str) -> str:
        """:attr:`url` pointing at database ``name``."""
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(path="/" + quote(name)))

    def new_database(self, name_hint: str = "") -> str:
        """CREATE a database ``bm_<hint>_<random>`` and return its URL."""
        import psycopg
        from psycopg import sql

        name = f"bm_{_sanitize(name_hint or namespace_hint(), 40)}_{secrets.token_hex(5)}"
        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.databases.append(name)
        return self.database_url(name)

    def drop_database(self, name_or_url: str) -> None:
        """DROP a database (given by name or URL), disconnecting its sessions."""
        import psycopg
        from psycopg import sql

        name = name_or_url
        if "://" in name_or_url:
            name = urlsplit(name_or_url).path.lstrip("/")
        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            ident = sql.Identifier(name)
            try:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
            except psycopg.errors.SyntaxError:  # before PostgreSQL 13
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(ident))
        if name in self.databases:
            self.databases.remove(name)

    def _cleanup_namespaces(self) -> None:
        for name in list(self.databases):
            with contextlib.suppress(Exception):
                self.drop_database(name)


class ProvisionedRedis(Provisioned):
    """A provisioned Redis server; tests work under key prefixes of their own."""

    service = "redis"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefixes: list[str] = []

    def new_prefix(self, hint: str = "") -> str:
        """A key prefix ``bm_<hint>_<random>`` nobody else uses (no ``:``, ``{`` or ``}``)."""
        prefix = f"bm_{_sanitize(hint or namespace_hint(), 40)}_{secrets.token_hex(5)}"
        self.prefixes.append(prefix)
        return prefix

    def drop_prefix(self, prefix: str) -> int:
        """Delete every key ``prefix`` and ``prefix:*``; returns how many were deleted."""
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=10)
        try:
            keys = [prefix, *client.scan_iter(match=f"{prefix}:*", count=500)]
            deleted = 0
            for start in range(0, len(keys), 500):
                deleted += int(client.delete(*keys[start:start + 500]))
        finally:
            client.close()
        if prefix in self.prefixes:
            self.prefixes.remove(prefix)
        return deleted

    def _cleanup_namespaces(self) -> None:
        for prefix in list(self.prefixes):
            with contextlib.suppress(Exception):
                self.drop_prefix(prefix)


@dataclass(frozen=True)
class _ServiceSpec:
    service: str
    env: str
    probe: Callable[[str, float], str | None]
    private: Callable[[], ChildServer]
    image_env: str
    image: str
    container_port: int
    container_env: Mapping[str, str]
    container_command: str
    container_url: Callable[[str, int], str]
    result: type[Provisioned]


def _try_container(spec: _ServiceSpec, timeout: float) -> tuple[str, Any]:
    """Step 3: a throw-away container, when testcontainers is installed and Docker answers."""
    try:
        from testcontainers.core.container import DockerContainer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise _StepFailed("testcontainers is not installed (pip install testcontainers)") from None
    try:
        import docker  # type: ignore[import-untyped,import-not-found,unused-ignore]

        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # any failure to reach the engine means "no Docker"
        raise _StepFailed(f"no Docker engine answers ({type(exc).__name__}: {exc})") from None
    image = os.environ.get(spec.image_env) or spec.image
    container = DockerContainer(image).with_exposed_ports(spec.container_port).with_command(spec.container_command)
    for key, value in spec.container_env.items():
        container = container.with_env(key, value)
    try:
        container.start()
        url = spec.container_url(container.get_container_host_ip(), int(container.get_exposed_port(spec.container_port)))
        deadline = time.monotonic() + timeout
        while (why := spec.probe(url, 2.0)) is not None:
            if time.monotonic() > deadline:
                raise _StepFailed(f"container {image} did not answer within {timeout}s ({why})")
            time.sleep(0.2)
        return url, container
    except _StepFailed:
        with contextlib.suppress(Exception):
            container.stop()
        raise
    except Exception as exc:
        with contextlib.suppress(Exception):
            container.stop()
        raise _StepFailed(f"container {image} failed: {type(exc).__name__}: {exc}") from None


def _provision(
    spec: _ServiceSpec,
    url: str | None,
    *,
    require: bool,
    private: bool,
    container: bool,
    timeout: float,
) -> Provisioned:
    attempts: list[Attempt] = []
    source = "argument url"
    if url is None:
        url = os.environ.get(spec.env) or None
        source = spec.env
    if url is not None:
        why = spec.probe(url, timeout)
        if why is None:
            return spec.result(url, "url", attempts=attempts)
        attempts.append(Attempt("url", f"{source}={redact_url(url)} was given but does not answer: {why}"))
        raise ServiceUnavailable(spec.service, attempts, required=require, fatal=True)
    attempts.append(Attempt("url", f"none given (no url argument, {spec.env} unset)"))

    if private:
        try:
            server = spec.private()
        except ServerStartError as exc:
            attempts.append(Attempt("private", str(exc)))
        else:
            try:
                server.start()
            except ServerStartError as exc:
                server.close()
                attempts.append(Attempt("private", f"failed to start: {exc}"))
            else:
                return spec.result(server.url, "private", server=server, attempts=attempts)
    else:
        attempts.append(Attempt("private", "disabled by the caller"))

    if container:
        try:
            curl, handle = _try_container(spec, timeout=max(timeout, 60.0))
        except _StepFailed as exc:
            attempts.append(Attempt("container", str(exc)))
        else:
            return spec.result(curl, "container", container=handle, attempts=attempts)
    else:
        attempts.append(Attempt("container", "disabled by the caller"))
    raise ServiceUnavailable(spec.service, attempts, required=require)


_POSTGRES = _ServiceSpec(
    service="postgres",
    env=POSTGRES_URL_ENV,
    probe=pg_probe,
    private=lambda: PrivatePostgres(),
    image_env="BOTMESH_POSTGRES_IMAGE",
    image="postgres:15-alpine",
    container_port=5432,
    container_env={"POSTGRES_HOST_AUTH_METHOD": "trust"},
    container_command="postgres -c fsync=on -c max_connections=100",
    container_url=lambda host, port: f"postgresql://postgres@{host}:{port}/postgres",
    result=ProvisionedPostgres,
)

_REDIS = _ServiceSpec(
    service="redis",
    env=REDIS_URL_ENV,
    probe=redis_probe,
    private=lambda: PrivateRedis(),
    image_env="BOTMESH_REDIS_IMAGE",
    image="redis:7-alpine",
    container_port=6379,
    container_env={},
    container_command="redis-server --appendonly yes --appendfsync always --save ''",
    container_url=lambda host, port: f"redis://{host}:{port}/0",
    result=ProvisionedRedis,
)


def provision_postgres(
    url: str | None = None,
    *,
    require: bool = False,
    private: bool = True,
    container: bool = True,
    timeout: float = 10.0,
) -> ProvisionedPostgres:
    """A PostgreSQL server for the tests, in the order described in the module docstring
    (URL → private server → container → :class:`ServiceUnavailable`). ``private`` /
    ``container`` = False leave out those steps; ``timeout`` bounds the probe of a given
    URL."""
    result = _provision(_POSTGRES, url, require=require, private=private, container=container, timeout=timeout)
    assert isinstance(result, ProvisionedPostgres)
    return result


def provision_redis(
    url: str | None = None,
    *,
    require: bool = False,
    private: bool = True,
    container: bool = True,
    timeout: float = 10.0,
) -> ProvisionedRedis:
    """A Redis server for the tests, like :func:`provision_postgres`."""
    result = _provision(_REDIS, url, require=require, private=private, container=container, timeout=timeout)
    assert isinstance(result, ProvisionedRedis)
    return result
