"""Power cuts of server backends (issue 11, item 3): a private PostgreSQL or Redis whose
data directory is on the FUSE power-cut file system, SIGKILLed with a power cut at every
kill of the bot and restarted (:mod:`botmesh_testkit.kill.powercut_server`).

Certified: PostgreSQL as the testkit runs it and Redis with AOF ``appendfsync always``,
8 cuts per policy, no violation. Teeth: Redis ``appendfsync no`` and PostgreSQL
``fsync=off`` lose acknowledged journal writes at the first cut and the loop names them
(GUAR-1, INB-1); Redis' AOF without fsync is also left with holes by a cut that keeps a
subset of the writes, which Redis refuses to load, while a torn last write is dropped
at load (``aof-load-truncated``, Redis' default).

Needs ``/dev/fuse``, PostgreSQL's binaries and ``redis-server``: without them each test
skips with the reason, or fails when ``$BOTMESH_REQUIRE_SERVICES`` is set. No sleeps: the
servers are polled until they serve, the loop waits for its children.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from botmesh_testkit.crash.fs import PowerCutFS, unavailable_reason
from botmesh_testkit.kill.powercut import CUT_MODES
from botmesh_testkit.kill.powercut_server import (
    PowerCutServerRun,
    ServerKind,
    ServerDidNotRecover,
    power_cut_server_loop,
    server_unavailable_reason,
)
from botmesh_testkit.matrix.cells import POLICIES
from botmesh_testkit.servers.process import ServerStartError
from botmesh_testkit.servers.redis import PrivateRedis

CUTS = 8
MESSAGES = 16


def _need(kind: str) -> None:
    reason = unavailable_reason() or server_unavailable_reason(kind)
    if reason is not None:
        if os.environ.get("BOTMESH_REQUIRE_SERVICES", "") not in ("", "0"):
            pytest.fail(f"power cuts of a private {kind} must run here (BOTMESH_REQUIRE_SERVICES), but: {reason}")
        pytest.skip(f"power cuts of a private {kind} cannot run here: {reason}")


def _loop(kind: ServerKind, tmp_path: Path, policy: str = "skip", *, settings: dict[str, str] | None = None,
          modes: tuple[str, ...] = CUT_MODES) -> PowerCutServerRun:
    _need(kind)
    run = power_cut_server_loop(kind, cuts=CUTS, messages=MESSAGES, seed=3, policy=policy, workdir=str(tmp_path),
                                settings=settings, modes=modes)
    assert not isinstance(run, str), run
    return run


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_durable_server_survives_every_cut(kind: ServerKind, policy: str, tmp_path: Path) -> None:
    run = _loop(kind, tmp_path, policy)
    assert run.passed, run.report()
    assert run.result.violations == []
    assert len(run.cuts) == CUTS and set(run.cuts) == {"drop", "subset", "torn"}
    assert len(run.restart_seconds) == CUTS  # the server was killed and started again at every cut
    assert run.result.acked == MESSAGES
    assert f"private {kind} on the mount" in run.report()
    if kind == "postgres":
        assert run.stats.fsyncs + run.stats.fdatasyncs > 0  # the WAL really was flushed through the mount


def test_redis_without_aof_fsync_loses_acknowledged_writes(tmp_path: Path) -> None:
    # only "drop" cuts: a cut that keeps a subset of the unsynced writes can leave an AOF
    # Redis refuses to load (test_redis_aof_with_holes_is_refused), a failure of another kind
    run = _loop("redis", tmp_path, settings={"appendfsync": "no"}, modes=("drop",))
    assert not run.passed
    assert {"GUAR-1", "INB-1"} <= run.result.violated_ids, run.report()
    assert "acknowledged journal write was lost" in run.report()
    assert run.dropped_ops > 0


def test_postgres_with_fsync_off_loses_acknowledged_writes(tmp_path: Path) -> None:
    run = _loop("postgres", tmp_path, settings={"fsync": "off"}, modes=("drop",))
    assert not run.passed
    assert "GUAR-1" in run.result.violated_ids, run.report()
    assert run.dropped_ops > 0


def test_redis_without_aof_fsync_is_not_certified_with_every_cut(tmp_path: Path) -> None:
    # the rotation of the part (drop, subset, torn): whichever way it breaks, it breaks
    _need("redis")
    try:
        run = power_cut_server_loop("redis", cuts=CUTS, messages=MESSAGES, seed=3, policy="skip",
                                    workdir=str(tmp_path), settings={"appendfsync": "everysec"})
    except ServerDidNotRecover as exc:
        assert "did not start again after power cut" in str(exc) and "appendfsync=everysec" in str(exc)
        return
    assert not isinstance(run, str), run
    assert not run.passed and "GUAR-1" in run.result.violated_ids, run.report()


def _redis_after_cut(tmp_path: Path, mode: str, seed: int) -> int | str:
    """A Redis with ``appendfsync no`` on the mount, 30 SETs, SIGKILL, a cut: the keys it
    loads afterwards, or the line of its log saying why it refused."""
    import redis

    _need("redis")
    with PowerCutFS(tmp_path / "fs").mount() as mount:
        datadir = mount.path / "redis"
        datadir.mkdir()
        server = PrivateRedis(tmp_path / "server", appendfsync="no", extra_args=["--dir", str(datadir)])
        try:
            server.start()
            mount.sync()
            client = redis.Redis.from_url(server.url)
            for i in range(30):
                client.set(f"k{i}", "x" * 300)
            client.close()
            server.kill()
            mount.cut(mode, seed=seed)
            try:
                server.start()
            except ServerStartError as exc:
                return next((line for line in str(exc).splitlines() if "append only file" in line), str(exc))
            client = redis.Redis.from_url(server.url)
            try:
                return int(client.dbsize())
            finally:
                client.close()
        finally:
            server.kill()
            server.close()


def test_redis_loads_an_aof_with_a_torn_last_write(tmp_path: Path) -> None:
    # everything reached the disk but the tail of the last SET: aof-load-truncated drops it
    assert _redis_after_cut(tmp_path, "torn", seed=0) == 29


def test_redis_aof_with_holes_is_refused(tmp_path: Path) -> None:
    # a subset of the unsynced writes persisted, out of order: holes in the AOF, which
    # aof-load-truncated does not cover (it only forgives a short tail)
    outcome = _redis_after_cut(tmp_path, "subset", seed=0)
    assert isinstance(outcome, str) and "Bad file format" in outcome, outcome
