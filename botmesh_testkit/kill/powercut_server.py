"""The power-cut loop for server backends: a private PostgreSQL or Redis whose data
directory is on the power-cut file system (:mod:`botmesh_testkit.crash.fs`), killed with
SIGKILL and the power cut at every kill of the bot, then restarted on what the cut left.

:func:`power_cut_server_loop` mounts a :class:`~botmesh_testkit.crash.fs.PowerCutFS`,
puts the server's data directory on it, starts the server and runs the kill loop
(:class:`~botmesh_testkit.kill.loop.KillLoop`) with the backend's spec pointing at it.
After each SIGKILL of the bot's child (the loop's ``after_kill`` hook) the server is
SIGKILLed too (its whole process tree, waited for), the power is cut — the cuts rotate
through ``drop``, ``subset`` and ``torn`` like :mod:`.powercut` — and the server is
started again on the same data directory and port: PostgreSQL recovers from its WAL,
Redis reloads its AOF. The delivery ledger is outside the mount; the journals the loop
judges are read back from the restarted server. A server that no longer starts on what a
cut left is :class:`ServerDidNotRecover` (a :class:`~.spec.HarnessError`, which the
``powercuts`` item reports as the backend not starting on its storage, with the ids).

The bot child is dead while its server restarts (the loop kills it first and starts the
next incarnation only after the hook returns), so no child ever has to ride out a
server that is down here; the engine's answer to that (``BackendUnavailableError``,
retries) is the fault proxy's subject.

Set-up, and why:

* PostgreSQL: ``initdb`` runs once per process into a template directory off the mount
  (as the OS user ``postgres`` under root, see :mod:`botmesh_testkit.servers.postgres`);
  each loop copies the template (owner and modes kept) into the power-cut file system's
  backing directory *before* mounting, where the model counts it as durable — the same as
  ``initdb`` through the mount followed by ``mount.sync()``, which costs ~11 s through
  the FUSE layer instead of ~0.2 s. The server runs with the testkit's defaults
  (``fsync=on``; ``synchronous_commit``, ``full_page_writes``, ``wal_sync_method`` as
  PostgreSQL ships them) plus ``recovery_init_sync_method=syncfs``: at a start after a
  crash PostgreSQL first fsyncs every file of the data directory one by one (~6 s on the
  mount); a ``syncfs`` does not reach the FUSE layer, so it is a no-op here — harmless,
  because every restart follows a power cut, after which nothing on the mount is
  unsynced. ``settings`` override any of them (``{"fsync": "off"}``).
* Redis: ``redis-server`` with ``--dir`` on the mount (an empty directory made durable
  by the harness; Redis creates its AOF directory, manifest and files itself — whether it
  makes them durable is part of what is tested), ``appendonly yes``, ``appendfsync``
  from ``settings`` (default ``always``), Redis' defaults otherwise
  (``aof-load-truncated yes``: a torn last command is dropped at load). Its log and
  everything else of the harness stay off the mount.
* Both: once the server first serves, ``mount.sync()`` (``sync_setup``): what a fresh
  server lays out is set-up, not workload. Found doing this: Redis 7.0 creates
  ``appendonlydir`` on its first start and fsyncs the files in it and that directory,
  but never the data directory holding it (nor, for the base file it renames from there
  into ``appendonlydir``, the source directory), so a power cut in the first moments of
  a fresh Redis loses the whole AOF — acknowledged writes with ``appendfsync always``
  included — or leaves a manifest naming a base file that is not there, on which Redis
  no longer starts (``sync_setup=False`` shows both: "Unable to obtain the AOF file
  appendonly.aof.1.base.rdb length").
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..backends.base import KillSpec
from ..crash.fs.mount import PowerCutError, PowerCutFS
from ..servers.postgres import PrivatePostgres, find_postgres_bindir
from ..servers.process import ChildServer, ServerStartError
from ..servers.redis import PrivateRedis, find_redis_server
from .loop import KillLoop
from .powercut import CUT_MODES, PowerCutHarnessError, PowerCutRun, harness_faults
from .spec import HarnessError

__all__ = ["POSTGRES_POWERCUT_SETTINGS", "SERVER_KINDS", "PowerCutServerRun", "ServerDidNotRecover", "ServerKind",
           "power_cut_server_loop", "server_unavailable_reason"]

SERVER_KINDS = ("postgres", "redis")
"""The server backends the loop runs."""

POSTGRES_POWERCUT_SETTINGS: Mapping[str, str] = {"recovery_init_sync_method": "syncfs"}
"""Added to :attr:`PrivatePostgres.DEFAULT_SETTINGS` on the mount (module docstring:
the start-up fsync of every file is a no-op after a power cut, and slow through FUSE)."""

ServerKind = Literal["postgres", "redis"]
"""The ``kind`` of :func:`power_cut_server_loop`."""


class ServerDidNotRecover(HarnessError):
    """The server did not start again on what a power cut left of its data directory:
    the backend's storage is lost (its configuration cannot survive a power cut), not a
    fault of the harness. The message names the cut and has the server's log."""


@dataclass
class PowerCutServerRun(PowerCutRun):
    """A :class:`~.powercut.PowerCutRun` of a server backend, with the server's kind,
    its settings and the seconds each kill + cut + restart of the server took."""

    kind: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    restart_seconds: list[float] = field(default_factory=list)

    def report(self) -> str:
        lines = super().report().splitlines()
        times = self.restart_seconds
        figures = (f"{sum(times) / len(times):.2f} s mean, {max(times):.2f} s max" if times else "none")
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.settings.items())) or "defaults"
        lines.insert(2, f"  private {self.kind} on the mount ({shown}): SIGKILLed and restarted {len(times)} time(s); "
                        f"kill + cut + restart {figures}")
        return "\n".join(lines)


# -- the servers --------------------------------------------------------------------------------------
_templates: dict[str, PrivatePostgres] = {}
_templates_lock = threading.Lock()


def _postgres_template() -> Path:
    """A data directory fresh from ``initdb``, made once per process (the object owning
    its temporary directory is kept, and removes it when the interpreter exits)."""
    bindir = find_postgres_bindir()
    key = str(bindir)
    with _templates_lock:
        template = _templates.get(key)
        if template is None:
            template = PrivatePostgres()
            template._prepare()  # initdb only: the template never runs
            _templates[key] = template
    return template.datadir


def _postgres_on(datadir: Path, settings: Mapping[str, str]) -> PrivatePostgres:
    server = PrivatePostgres(settings={**POSTGRES_POWERCUT_SETTINGS, **settings})
    server.datadir = datadir  # on the mount; its socket directory and log stay off it
    return server


def _redis_on(workdir: str, datadir: Path, settings: Mapping[str, str]) -> PrivateRedis:
    rest = {k: v for k, v in settings.items() if k not in ("appendfsync", "appendonly")}
    extra: list[str] = []
    for key, value in rest.items():
        extra += [f"--{key}", value]
    # a later --dir wins over the one PrivateRedis gives (its workdir, which keeps the log)
    return PrivateRedis(workdir, appendonly=settings.get("appendonly", "yes") == "yes",
                        appendfsync=settings.get("appendfsync", "always"), extra_args=[*extra, "--dir", str(datadir)])


def server_unavailable_reason(kind: str) -> str | None:
    """Why a private ``kind`` server (``"postgres"``, ``"redis"``) cannot run on this
    machine (no binaries, no client library), or None."""
    if kind == "postgres":
        if find_postgres_bindir() is None:
            return "no PostgreSQL binaries (postgres, initdb) on this machine"
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "psycopg is not installed (pip install 'botmesh-testkit[postgres]')"
        return None
    if find_redis_server() is None:
        return "no redis-server on PATH"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install 'botmesh-testkit[redis]')"
    return None


def _spec(kind: str, server: ChildServer, loopdir: str) -> KillSpec | None:
    """The backend's spec on ``server``, from its harness (table / key prefix derived from
    the loop's directory)."""
    if kind == "postgres":
        from ..backends.postgres import PostgresHarness

        return PostgresHarness(loopdir, url=server.url).kill_spec()
    from ..backends.redis import RedisHarness

    return RedisHarness(loopdir, url=server.url).kill_spec()


# -- the loop -------------------------------------------------------------------------------------------
def power_cut_server_loop(
    kind: ServerKind,
    *,
    cuts: int,
    messages: int,
    seed: int,
    policy: str,
    workdir: str,
    settings: Mapping[str, str] | None = None,
    modes: Sequence[str] = CUT_MODES,
    sync_setup: bool = True,
    start_method: str = "forkserver",
) -> PowerCutServerRun | str:
    """Run ``cuts`` kills of a bot on a private ``kind`` server (``"postgres"`` or
    ``"redis"``) whose data directory is on a fresh power-cut mount under ``workdir``;
    after each, SIGKILL the server, cut the power (rotating through ``modes``, seeded) and
    restart the server (module docstring). ``settings``: server settings (PostgreSQL
    ``-c`` options; Redis directives, ``appendfsync`` among them). ``sync_setup``: make
    everything durable once the server first serves, before the workload (the files of a
    freshly initialised server are set-up, as ``initdb``'s are; False leaves them to the
    server).

    Returns the run, or the reason it cannot run here (no server binaries or client
    library). Raises :class:`~botmesh_testkit.crash.fs.mount.PowerCutUnavailable` when
    nothing can be mounted, :class:`~.powercut.PowerCutHarnessError` when the file system
    fails, :class:`ServerDidNotRecover` when the server does not start again after a cut,
    :class:`~.spec.HarnessError` when the first start fails."""
    if kind not in SERVER_KINDS:
        raise ValueError(f"kind must be one of {SERVER_KINDS}, got {kind!r}")
    for mode in modes:
        if mode not in CUT_MODES:
            raise ValueError(f"cut modes must be among {CUT_MODES}, got {mode!r}")
    reason = server_unavailable_reason(kind)
    if reason is not None:
        return f"backend {kind}: power cuts of a private server cannot run here: {reason}"
    settings = dict(settings or {})
    fs = PowerCutFS(os.path.join(workdir, "fs"))
    datadir_name = "pgdata" if kind == "postgres" else "redis"
    if kind == "postgres":
        template = _postgres_template()
        fs.backing.mkdir(parents=True, exist_ok=True)
        os.chmod(fs.backing, 0o755)  # the mount's root: the OS user postgres must get through it
        # cp -a keeps the owner (postgres) and the 0700 PostgreSQL insists on
        subprocess.run(["cp", "-a", str(template), str(fs.backing / datadir_name)], check=True)
    loopdir = os.path.join(workdir, "loop")
    os.makedirs(loopdir, exist_ok=True)
    with fs.mount() as mount, harness_faults(mount, f"the power-cut loop on a private {kind} ran"):
        datadir = mount.path / datadir_name
        server: ChildServer
        if kind == "postgres":
            server = _postgres_on(datadir, settings)
        else:
            datadir.mkdir()
            mount.sync()  # the empty directory is the harness's; what Redis puts in it is Redis' to make durable
            server = _redis_on(os.path.join(workdir, "server"), datadir, settings)
        try:
            try:
                server.start()
            except ServerStartError as exc:
                raise HarnessError(f"the private {kind} server on the power-cut mount did not start: {exc}") from exc
            if sync_setup:
                # An initialised server, before any workload: its first start's files are set-up
                # (Redis 7.0 does not fsync its data directory after creating appendonlydir in it,
                # so a cut right after a fresh start loses the whole AOF: see the module docstring).
                mount.sync()
            spec = _spec(kind, server, loopdir)
            assert spec is not None  # both harnesses describe their storage
            rng = random.Random(f"{seed}/{kind}/{policy}/powercuts")
            made: list[str] = []
            dropped = [0]
            restarts: list[float] = []

            def cut(n: int) -> str:
                mode = modes[(n - 1) % len(modes)]
                t0 = time.monotonic()
                try:
                    server.kill()  # the whole process tree, waited for: nothing writes while the power goes
                except ServerStartError as exc:
                    raise HarnessError(f"the private {kind} server survived SIGKILL at cut {n}: {exc}") from exc
                try:
                    report = mount.cut(mode, seed=rng.randrange(2**31))
                except PowerCutError as exc:
                    raise PowerCutHarnessError(f"the power-cut file system failed at cut {n}: {exc}") from exc
                try:
                    server.start()
                except ServerStartError as exc:
                    raise ServerDidNotRecover(
                        f"the private {kind} server ({', '.join(f'{k}={v}' for k, v in settings.items()) or 'defaults'}) "
                        f"did not start again after power cut {n} ({mode}: {report.dropped} of {report.unsynced_ops} "
                        f"unsynced operation(s) lost{f', torn {report.torn}' if report.torn else ''}): "
                        f"{str(exc)[-2500:]}") from None
                took = time.monotonic() - t0
                made.append(mode)
                dropped[0] += report.dropped
                restarts.append(took)
                return (f"{kind} SIGKILLed, power cut ({mode}): {report.dropped} of {report.unsynced_ops} unsynced "
                        f"operation(s) lost; restarted in {took:.2f} s")

            loop = KillLoop(spec, kills=cuts, messages=messages, seed=seed, on_ambiguous=policy,
                            workdir=loopdir, after_kill=cut, label=f"power-cut loop ({kind} server)",
                            start_method=start_method)
            result = loop.run()
        finally:
            server.kill()  # before the checks and the unmount: nothing may hold the mount
            server.close()
        stats = mount.stats()
        problems = [*stats.internal_errors, *stats.model_errors, *mount.check()]
        if problems:
            raise PowerCutHarnessError(f"the power-cut file system disagrees with itself: {problems[:5]}")
    shutil.rmtree(fs.backing, ignore_errors=True)  # a copy of a cluster per loop: do not keep it
    return PowerCutServerRun(result, made, dropped[0], stats, kind=kind, settings=settings, restart_seconds=restarts)
