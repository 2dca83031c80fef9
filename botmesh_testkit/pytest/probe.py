"""What a backend claims and what provides it: the harness opened once to read its
capabilities (a factory backend learns them there), the distributions and servers
behind it, and the run's versions. Used by the summary, the verdict and the report."""

from __future__ import annotations

import asyncio
import platform
import tempfile
from typing import Any

import pytest

PROBE_TIMEOUT = 30.0
"""Seconds allowed to open a backend for its claims, or to ask a server its version."""


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def run_versions(config: pytest.Config | None = None) -> dict[str, str]:
    """botmesh-testkit, Python, pytest and the platform (and pytest-xdist under ``-n``)."""
    found = {"botmesh-testkit": _dist_version("botmesh-testkit") or "unknown",
             "python": platform.python_version(),
             "pytest": pytest.__version__,
             "platform": platform.platform()}
    xdist = _dist_version("pytest-xdist")
    if xdist and config is not None and getattr(config.option, "numprocesses", None):
        found["pytest-xdist"] = xdist
    return found


def _guard(fn: Any, *args: Any) -> str:
    try:
        return str(fn(*args))
    except Exception as exc:  # a version we could not learn is reported, not fatal
        return f"unknown ({type(exc).__name__}: {exc})"


def backend_versions(name: str, harness: Any = None) -> dict[str, str]:
    """What provides the backend: the distribution of ``pkg`` for ``pkg.module:factory``
    or of an entry point; the driver (and, when it answers quickly, the server) for
    ``postgres`` and ``redis``."""
    from importlib.metadata import packages_distributions

    from ..backends.registry import ENTRY_POINT_GROUP, HARNESSES, REGISTRY, SERVICE_BACKENDS, entry_point_backends

    found: dict[str, str] = {}
    if name in SERVICE_BACKENDS:
        driver = "psycopg" if name == "postgres" else "redis"
        found[driver] = _dist_version(driver) or "not installed"
        url = getattr(harness, "url", None)
        if url:
            found[f"{name} server"] = _guard(_server_version, name, url)
        return found
    if name in HARNESSES:
        found["built in"] = f"botmesh-testkit {_dist_version('botmesh-testkit') or 'unknown'}"
        return found
    if REGISTRY.get(name) is not None:
        found["registered"] = "by a pytest_botmesh_register_backends hook (conftest.py or plugin)"
        return found
    if ":" in name:
        package = name.partition(":")[0].split(".")[0]
        try:
            dists = sorted(set(packages_distributions().get(package, [])))
        except Exception:  # broken metadata of some installed distribution
            dists = []
        for dist in dists:
            found[dist] = _dist_version(dist) or "unknown"
        if not dists:
            found[package] = "not from an installed distribution"
        return found
    try:
        ep = entry_point_backends().get(name)
        if ep is not None and ep.dist is not None:
            found[ep.dist.name] = ep.dist.version
            found["entry point"] = f"{ENTRY_POINT_GROUP}: {ep.value}"
    except Exception as exc:
        found["entry point"] = f"unknown ({exc!r})"
    return found


def _server_version(name: str, url: str) -> str:
    if name == "postgres":
        import psycopg

        with psycopg.connect(url, connect_timeout=int(PROBE_TIMEOUT), autocommit=True) as conn:
            row = conn.execute("SELECT version()").fetchone()
        return str(row[0]) if row else "unknown"
    import redis

    client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT, socket_connect_timeout=PROBE_TIMEOUT)
    try:
        return "redis " + str(client.info("server").get("redis_version", "unknown"))
    finally:
        client.close()


def probe_backend(name: str) -> tuple[dict[str, bool] | None, str | None, dict[str, str]]:
    """``(claims, error, versions)`` of a backend: its harness is resolved and opened
    (a factory backend learns its capabilities there), the capabilities read, and it is
    closed. ``claims`` is None and ``error`` says why when that fails."""
    from ..backends.base import CAPABILITIES
    from ..backends.registry import resolve

    claims: dict[str, bool] | None = None
    error: str | None = None
    harness: Any = None
    with tempfile.TemporaryDirectory(prefix="botmesh-report-") as tmp:
        try:
            harness = resolve(name)(tmp)

            async def probe() -> Any:
                try:
                    await harness.open()
                    return harness.capabilities
                finally:
                    await harness.close()

            caps = asyncio.run(asyncio.wait_for(probe(), PROBE_TIMEOUT))
            claims = {c: bool(getattr(caps, c)) for c in CAPABILITIES}
        except TimeoutError:
            error = f"opening the backend took longer than {PROBE_TIMEOUT:g} s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        versions = backend_versions(name, harness)
    return claims, error, versions
