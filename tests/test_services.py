"""Tests of ``botmesh_testkit.servers``: private PostgreSQL and Redis servers (started
from the local binaries, killed with SIGKILL and restarted on the same directory) and
the provisioning order the plugin follows.

Spec ids: BACK-2 / BACK-3 (the backends these servers serve; the backend table's
"survives a crash" column for PostgreSQL and for Redis with AOF ``always``), TEST-3
(recovery pattern: after the crash, a new start on the same storage sees what was
committed).

Missing binaries make these tests **fail**, not skip (CI runs them for real), unless
``BOTMESH_ALLOW_SKIP_SERVICES=1``. One private server per kind serves the whole module;
the shared servers (127.0.0.1:5432 and :6379, or ``BOTMESH_POSTGRES_URL`` /
``BOTMESH_REDIS_URL``) are only read from and given throw-away databases and prefixes,
never killed.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import psutil
import psycopg
import pytest
import redis

import botmesh_testkit.servers.postgres as servers_postgres
import botmesh_testkit.servers.process as servers_process
from botmesh_testkit import servers as services
from botmesh_testkit.servers import (
    POSTGRES_URL_ENV,
    REDIS_URL_ENV,
    PrivatePostgres,
    PrivateRedis,
    ServerStartError,
    ServiceUnavailable,
    find_postgres_bindir,
    find_redis_server,
    free_port,
    namespace_hint,
    provision_postgres,
    provision_redis,
    skips_allowed,
)

SHARED_POSTGRES = os.environ.get(POSTGRES_URL_ENV) or "postgresql://postgres@127.0.0.1:5432/test"
SHARED_REDIS = os.environ.get(REDIS_URL_ENV) or "redis://127.0.0.1:6379/0"


def _missing(what: str) -> NoReturn:
    message = f"{what} not found: these tests need it (set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip instead)"
    if skips_allowed():
        pytest.skip(message)
    pytest.fail(message)


def _need_postgres() -> None:
    if find_postgres_bindir() is None:
        _missing("PostgreSQL binaries (postgres, initdb)")


def _need_redis() -> None:
    if find_redis_server() is None:
        _missing("redis-server")


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PrivatePostgres]:
    _need_postgres()
    started = time.perf_counter()
    with PrivatePostgres() as pg:
        print(f"\nprivate PostgreSQL up in {time.perf_counter() - started:.2f}s: {pg}")
        yield pg


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    _need_redis()
    with PrivateRedis() as server:
        yield server


@pytest.fixture
def hidden_binaries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No postgres/initdb/redis-server anywhere, and no testcontainers package."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(servers_postgres, "POSTGRES_BIN_GLOBS", [])  # where find_postgres_bindir reads it
    monkeypatch.setitem(sys.modules, "testcontainers", None)  # makes the import fail
    monkeypatch.delenv(POSTGRES_URL_ENV, raising=False)
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)


# --------------------------------------------------------------------------- private servers


@pytest.mark.spec("BACK-2", "TEST-3")
def test_private_postgres_keeps_a_committed_row_across_kill_9(private_pg: PrivatePostgres) -> None:
    with psycopg.connect(private_pg.url) as conn:
        conn.execute("CREATE TABLE crash_check (id int PRIMARY KEY, note text)")
        conn.execute("INSERT INTO crash_check VALUES (1, 'committed')")
        conn.commit()
        conn.execute("INSERT INTO crash_check VALUES (2, 'never committed')")  # open transaction
        postmaster = private_pg.pid
        assert postmaster is not None
        children = [p.pid for p in psutil.Process(postmaster).children(recursive=True)]
        assert children, "a running postmaster has helper processes"
        port = private_pg.port

        private_pg.kill()

        assert private_pg.pid is None
        assert not psutil.pid_exists(postmaster)
        assert all(_gone(pid) for pid in children)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    started = time.perf_counter()
    private_pg.start()  # crash recovery on the same data directory
    print(f"recovered in {time.perf_counter() - started:.2f}s")
    assert private_pg.port == port and private_pg.pid not in (None, postmaster)
    with psycopg.connect(private_pg.url) as conn:
        rows = conn.execute("SELECT id, note FROM crash_check ORDER BY id").fetchall()
        conn.execute("DROP TABLE crash_check")
        conn.commit()
    assert rows == [(1, "committed")]


@pytest.mark.spec("BACK-2")
def test_private_postgres_stops_cleanly_and_starts_again(private_pg: PrivatePostgres) -> None:
    with psycopg.connect(private_pg.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE stop_check (id int)")
        conn.execute("INSERT INTO stop_check VALUES (7)")
    pid = private_pg.pid
    assert pid is not None
    private_pg.stop()
    assert private_pg.pid is None and _gone(pid)
    assert "database system is shut down" in private_pg.logfile.read_text()
    private_pg.start()
    with psycopg.connect(private_pg.url, autocommit=True) as conn:
        assert conn.execute("SELECT id FROM stop_check").fetchall() == [(7,)]
        conn.execute("DROP TABLE stop_check")
        setting = conn.execute("SHOW fsync").fetchone()
    assert setting == ("on",)


@pytest.mark.spec("BACK-2")
def test_private_postgres_runs_as_the_postgres_user_under_root(private_pg: PrivatePostgres) -> None:
    assert private_pg.pid is not None
    owner = psutil.Process(private_pg.pid).username()
    if os.geteuid() == 0:
        assert owner == "postgres"
        import pwd

        assert private_pg.datadir.stat().st_uid == pwd.getpwnam("postgres").pw_uid
    else:
        import pwd

        assert owner == pwd.getpwuid(os.geteuid()).pw_name
    assert private_pg.url == f"postgresql://postgres@127.0.0.1:{private_pg.port}/postgres"


def test_private_postgres_refuses_a_workdir_the_postgres_user_cannot_reach(tmp_path: Path) -> None:
    _need_postgres()
    if os.geteuid() == 0:
        # pytest's tmp_path lives under /tmp/pytest-of-root (mode 0700)
        closed = tmp_path / "closed"
        closed.mkdir(mode=0o700)
        os.chmod(closed, 0o700)
        with pytest.raises(ServerStartError, match="cannot reach"):
            PrivatePostgres(workdir=closed / "pg")
    else:
        pg = PrivatePostgres(workdir=tmp_path / "pg")  # as its owner, any directory will do
        assert pg.datadir == tmp_path / "pg" / "data"
        pg.close()
        assert (tmp_path / "pg").exists()  # a given workdir is kept


@pytest.mark.spec("BACK-3", "TEST-3")
def test_private_redis_with_aof_always_keeps_a_set_across_kill_9(private_redis: PrivateRedis) -> None:
    client = redis.Redis.from_url(private_redis.url)
    try:
        client.set("crash:key", "acknowledged")
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()
    pid = private_redis.pid
    assert pid is not None
    port = private_redis.port
    private_redis.kill()
    assert private_redis.pid is None and not psutil.pid_exists(pid)
    private_redis.start()  # reloads the AOF from the same directory
    assert private_redis.port == port and private_redis.pid != pid
    client = redis.Redis.from_url(private_redis.url)
    try:
        assert client.get("crash:key") == b"acknowledged"
        client.delete("crash:key")
    finally:
        client.close()


@pytest.mark.spec("BACK-3")
def test_private_redis_without_aof_loses_the_set_the_control_case() -> None:
    """The same crash without persistence loses the write: the kill is a real crash."""
    _need_redis()
    with PrivateRedis(appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.set("crash:key", "acknowledged")
        finally:
            client.close()
        server.kill()
        server.start()
        client = redis.Redis.from_url(server.url)
        try:
            assert client.get("crash:key") is None
        finally:
            client.close()
    assert not server.workdir.exists()  # a directory it created is removed at close


@pytest.mark.spec("BACK-3")
def test_a_free_port_taken_by_another_server_is_replaced(
    monkeypatch: pytest.MonkeyPatch, private_redis: PrivateRedis
) -> None:
    """Between choosing a free port and binding it, another server may take it: the
    private server is started again on another port, and readiness is checked against
    *our* process (the other server answering PING on that port does not count)."""
    taken = private_redis.port
    ports = iter([taken])
    real_free_port = servers_process.free_port
    # patched where ChildServer calls it
    monkeypatch.setattr(servers_process, "free_port", lambda host="127.0.0.1": next(ports, None) or real_free_port(host))
    with PrivateRedis() as server:
        assert server.port != taken
        assert "Address already in use" in server.logfile.read_text()
        client = redis.Redis.from_url(server.url)
        try:
            assert client.info("server")["process_id"] == server.pid
        finally:
            client.close()
    fixed = PrivateRedis(port=taken)  # a port that was given is not changed
    try:
        with pytest.raises(ServerStartError, match="exited with status"):
            fixed.start()
    finally:
        fixed.close()
    assert not fixed.workdir.exists()


# --------------------------------------------------------------------------- provisioning


@pytest.mark.spec("BACK-2")
def test_provision_postgres_uses_the_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POSTGRES_URL_ENV, SHARED_POSTGRES)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    server = provision_postgres()
    try:
        assert server.kind == "url" and server.url == SHARED_POSTGRES and server.server is None
        first = server.new_database(namespace_hint("run"))
        second = server.new_database(namespace_hint("run"))
        assert first != second
        name = first.rsplit("/", 1)[1]
        assert name.startswith("bm_run_gw7_") and len(name) <= 63
        with psycopg.connect(first, autocommit=True) as conn:  # the database is usable
            conn.execute("CREATE TABLE t (x int)")
        with psycopg.connect(second, autocommit=True) as conn:  # and isolated from the other
            assert conn.execute("SELECT to_regclass('t')").fetchone() == (None,)
    finally:
        server.close()
    with psycopg.connect(SHARED_POSTGRES) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bm_run_gw7_%'").fetchall()
    assert left == []  # close() dropped what it created on a server it did not start


@pytest.mark.spec("BACK-3")
def test_provision_redis_uses_the_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, SHARED_REDIS)
    with provision_redis() as server:
        assert server.kind == "url" and server.url == SHARED_REDIS
        prefix = server.new_prefix("weird hint: {x}")
        other = server.new_prefix("weird hint: {x}")
        assert prefix != other and prefix.startswith("bm_weird_hint_x_")
        assert not set(prefix) & set(":{}*?[]")
        client = redis.Redis.from_url(server.url)
        try:
            client.set(f"{prefix}:{{durable:inbox:s1}}", "1")
            client.set(f"{prefix}:{{durable:outbox:s1}}", "2")
            client.set(f"{other}:kept-until-close", "3")
            assert server.drop_prefix(prefix) == 2
            assert client.exists(f"{prefix}:{{durable:inbox:s1}}") == 0
            assert client.exists(f"{other}:kept-until-close") == 1
        finally:
            client.close()
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        assert client.exists(f"{other}:kept-until-close") == 0  # dropped at close()
    finally:
        client.close()


@pytest.mark.spec("BACK-2", "BACK-3")
def test_a_given_url_that_does_not_answer_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL the user gave is the server they want certified: when it does not answer,
    provisioning fails (``fatal``) instead of quietly testing a private server."""
    dead = free_port()
    with pytest.raises(ServiceUnavailable) as caught:
        provision_postgres(f"postgresql://postgres:s3cret@127.0.0.1:{dead}/postgres", timeout=2)
    exc = caught.value
    assert exc.fatal and exc.should_fail and not exc.required
    assert [a.step for a in exc.attempts] == ["url"]  # nothing else was tried
    assert f"127.0.0.1:{dead}" in str(exc) and "does not answer" in str(exc)
    assert "s3cret" not in str(exc) and "***" in str(exc)

    monkeypatch.setenv(REDIS_URL_ENV, f"redis://127.0.0.1:{dead}/0")
    with pytest.raises(ServiceUnavailable) as caught:
        provision_redis(timeout=2)
    assert caught.value.should_fail
    assert f"{REDIS_URL_ENV}=redis://127.0.0.1:{dead}/0 was given but does not answer" in str(caught.value)
    assert "never replaced by another server" in str(caught.value)


@pytest.mark.spec("BACK-2")
def test_without_a_url_postgres_is_a_private_server(monkeypatch: pytest.MonkeyPatch) -> None:
    _need_postgres()
    monkeypatch.delenv(POSTGRES_URL_ENV, raising=False)
    server = provision_postgres()
    try:
        assert server.kind == "private" and isinstance(server.server, PrivatePostgres)
        assert [a.step for a in server.attempts] == ["url"]
        db = server.new_database("private")
        with psycopg.connect(db) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == (db.rsplit("/", 1)[1],)
        pid, workdir = server.server.pid, server.server.workdir
        assert pid is not None
    finally:
        server.close()
    assert _gone(pid) and not workdir.exists()  # close() stops what it started


@pytest.mark.spec("BACK-3")
def test_without_a_url_redis_is_a_private_server_with_aof_always(monkeypatch: pytest.MonkeyPatch) -> None:
    _need_redis()
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with provision_redis() as server:
        assert server.kind == "private" and isinstance(server.server, PrivateRedis)
        client = redis.Redis.from_url(server.url)
        try:
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
        finally:
            client.close()
        pid = server.server.pid
        assert pid is not None
    assert _gone(pid)


@pytest.mark.spec("BACK-2", "BACK-3")
@pytest.mark.usefixtures("hidden_binaries")
def test_no_server_anywhere_says_what_was_tried() -> None:
    with pytest.raises(ServiceUnavailable) as caught:
        provision_postgres()
    exc = caught.value
    message = str(exc)
    assert [a.step for a in exc.attempts] == ["url", "private", "container"]
    assert not exc.should_fail  # the plugin skips...
    assert POSTGRES_URL_ENV in message
    assert "no PostgreSQL binaries (postgres and initdb) on PATH" in message
    assert "testcontainers is not installed" in message

    with pytest.raises(ServiceUnavailable) as caught:
        provision_redis(require=True)
    exc = caught.value
    assert exc.required and exc.should_fail  # ...unless services are required
    assert REDIS_URL_ENV in str(exc) and "no redis-server on PATH" in str(exc)
    assert "testcontainers is not installed" in str(exc)
    assert "--botmesh-require-services" in str(exc)


def _fake_testcontainers(monkeypatch: pytest.MonkeyPatch, *, docker_answers: bool, port: int) -> list[str]:
    """Install stand-ins for ``testcontainers`` and ``docker``; returns a call log."""
    calls: list[str] = []

    class FakeContainer:
        def __init__(self, image: str) -> None:
            calls.append(f"image {image}")

        def with_exposed_ports(self, *ports: int) -> FakeContainer:
            return self

        def with_command(self, command: str) -> FakeContainer:
            calls.append(f"command {command}")
            return self

        def with_env(self, key: str, value: str) -> FakeContainer:
            return self

        def start(self) -> FakeContainer:
            calls.append("start")
            return self

        def get_container_host_ip(self) -> str:
            return "127.0.0.1"

        def get_exposed_port(self, port_: int) -> str:
            return str(port)

        def stop(self) -> None:
            calls.append("stop")

    class FakeDockerClient:
        def ping(self) -> bool:
            if not docker_answers:
                raise ConnectionError("Cannot connect to the Docker daemon at unix:///var/run/docker.sock")
            return True

        def close(self) -> None:
            pass

    def from_env(**kwargs: Any) -> FakeDockerClient:
        return FakeDockerClient()

    container_mod = types.ModuleType("testcontainers.core.container")
    container_mod.DockerContainer = FakeContainer  # type: ignore[attr-defined]
    docker_mod = types.ModuleType("docker")
    docker_mod.from_env = from_env  # type: ignore[attr-defined]
    for name in ("testcontainers", "testcontainers.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "testcontainers.core.container", container_mod)
    monkeypatch.setitem(sys.modules, "docker", docker_mod)
    return calls


@pytest.mark.spec("BACK-3")
@pytest.mark.usefixtures("hidden_binaries")
def test_container_step_needs_a_docker_engine_that_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_testcontainers(monkeypatch, docker_answers=False, port=6379)
    with pytest.raises(ServiceUnavailable) as caught:
        provision_redis()
    assert "no Docker engine answers" in str(caught.value)
    assert "Cannot connect to the Docker daemon" in str(caught.value)
    assert calls == []  # no container was attempted


@pytest.mark.spec("BACK-3")
@pytest.mark.usefixtures("hidden_binaries")
def test_container_step_is_used_when_docker_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The container plumbing, with a stand-in container "published" on the shared Redis."""
    from urllib.parse import urlsplit

    shared_port = urlsplit(SHARED_REDIS).port or 6379
    calls = _fake_testcontainers(monkeypatch, docker_answers=True, port=shared_port)
    server = provision_redis()
    try:
        assert server.kind == "container" and server.url == f"redis://127.0.0.1:{shared_port}/0"
        assert [a.step for a in server.attempts] == ["url", "private"]
    finally:
        server.close()
    assert calls == [
        "image redis:7-alpine",
        "command redis-server --appendonly yes --appendfsync always --save ''",
        "start",
        "stop",
    ]


def test_namespace_hint_names_the_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert namespace_hint() == "gw3" and namespace_hint("run1") == "run1_gw3"
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert namespace_hint() == "main"


def test_redact_url_hides_only_the_password() -> None:
    assert services.redact_url("postgresql://u:pw@h:5/db?x=1") == "postgresql://u:***@h:5/db?x=1"
    assert services.redact_url("redis://h:6379/0") == "redis://h:6379/0"
