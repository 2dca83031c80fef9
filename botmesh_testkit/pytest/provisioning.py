"""Servers for the ``postgres`` and ``redis`` backends, provisioned once per run in the
main process (:mod:`botmesh_testkit.servers` does the work)."""

from __future__ import annotations

import os

import pytest

from .options import selected, usage
from .session import BotmeshSession


def provision_services(config: pytest.Config, state: BotmeshSession) -> None:
    """Provision the servers of the selected service backends (``postgres``, ``redis``)
    once, in the main process, before any xdist worker starts: a database (PostgreSQL) or
    a key prefix (Redis) of this run's own on the server found, exported in the
    environment that the harnesses — and the workers, which inherit it — read. A server
    that cannot be had makes the backend's items one skip naming what was tried (or a
    usage error under ``--botmesh-require-services``, or when a given URL does not
    answer)."""
    from ..backends.registry import SERVICE_BACKENDS

    wanted = [n for n in selected(config) if n in SERVICE_BACKENDS]
    if not wanted:
        return
    skips = state.service_skips
    if hasattr(config, "workerinput"):  # an xdist worker: the main process did it
        for name in wanted:
            reason = os.environ.get(_unavailable_env(name))
            if reason:
                skips[name] = reason
        return
    from .. import servers as services

    saved = {k: os.environ.get(k) for k in (services.POSTGRES_URL_ENV, services.REDIS_URL_ENV,
                                              services.REDIS_PREFIX_ENV, *map(_unavailable_env, wanted))}

    def restore() -> None:  # the run's database/prefix is gone after it: do not leave them in the environment
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    config.add_cleanup(restore)
    require = bool(config.getoption("--botmesh-require-services"))
    for name in wanted:
        url = config.getoption(f"--botmesh-{name}-url")
        try:
            if name == "postgres":
                pg = services.provision_postgres(url, require=require)
                config.add_cleanup(pg.close)
                os.environ[services.POSTGRES_URL_ENV] = pg.new_database(services.namespace_hint("run"))
            else:
                rd = services.provision_redis(url, require=require)
                config.add_cleanup(rd.close)
                os.environ[services.REDIS_URL_ENV] = rd.url
                os.environ[services.REDIS_PREFIX_ENV] = rd.new_prefix(services.namespace_hint("run"))
        except services.ServiceUnavailable as exc:
            if exc.should_fail:
                raise usage(f"--botmesh-backend={name}", str(exc)) from None
            skips[name] = f"{name}: no server could be provisioned ({exc}); --botmesh-require-services makes this fail"
            os.environ[_unavailable_env(name)] = skips[name]


def _unavailable_env(name: str) -> str:
    return f"BOTMESH_{name.upper()}_UNAVAILABLE"
