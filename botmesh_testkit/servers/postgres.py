"""A private PostgreSQL server, and where its binaries are found.

:class:`PrivatePostgres` runs ``initdb`` into a temporary directory and starts
``postgres`` on a free port of 127.0.0.1 (``fsync=on``, ``shared_buffers=16MB``,
``max_connections=50``), with its Unix socket in a private directory. When the tests run
as root, ``initdb`` and ``postgres`` run as the OS user ``postgres`` (PostgreSQL refuses to
run as root) and the directories are handed to that user; as any other user they run as
that user. The database superuser is always called ``postgres``, so :attr:`~PrivatePostgres.url`
is ``postgresql://postgres@127.0.0.1:PORT/postgres``.

A given ``workdir`` holds the data in ``workdir/data``. Under root it must be reachable by
the user ``postgres`` (pytest's ``tmp_path`` under ``/tmp/pytest-of-root`` is not: leave
``workdir`` to its default, a fresh directory under the system temp directory).

The binaries are looked for on ``PATH``, then in :data:`POSTGRES_BIN_GLOBS`
(:func:`find_postgres_bindir`). :func:`pg_probe` tells whether a server at a URL answers.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .process import ChildServer, ServerStartError, is_root, reachable_by

__all__ = ["POSTGRES_BIN_GLOBS", "PrivatePostgres", "find_postgres_bindir", "pg_probe"]

#: Where PostgreSQL binaries are looked for after ``PATH`` (newest version first).
POSTGRES_BIN_GLOBS: list[str] = ["/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin", "/usr/pgsql-*/bin"]


def _postgres_os_user() -> tuple[int, int] | None:
    """(uid, gid) of the OS user ``postgres`` when running as root, else None."""
    if not is_root():
        return None
    import pwd

    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise ServerStartError(
            "running as root, and PostgreSQL refuses to run as root, but there is no OS user "
            "'postgres' to run it as (create one, or run the tests as another user)"
        ) from None
    return entry.pw_uid, entry.pw_gid


def find_postgres_bindir() -> Path | None:
    """The directory holding ``postgres`` and ``initdb``: from ``PATH`` first, then
    :data:`POSTGRES_BIN_GLOBS` (highest version first); None when there is none."""
    candidates: list[Path] = []
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(on_path).parent)
        candidates.append(Path(os.path.realpath(on_path)).parent)
    for pattern in POSTGRES_BIN_GLOBS:
        found = glob.glob(pattern)
        found.sort(key=lambda p: [int(n) for n in re.findall(r"\d+", p)] or [0], reverse=True)
        candidates.extend(Path(p) for p in found)
    for directory in candidates:
        if all(os.access(directory / exe, os.X_OK) for exe in ("postgres", "initdb")):
            return directory
    return None


def pg_probe(url: str, timeout: float) -> str | None:
    """None when PostgreSQL at ``url`` runs ``SELECT 1``, else why not."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'botmesh-testkit[postgres]')"
    try:
        with psycopg.connect(url, connect_timeout=max(2, int(timeout)), autocommit=True) as conn:
            conn.execute("SELECT 1")
        return None
    except psycopg.Error as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'error'}"


class PrivatePostgres(ChildServer):
    """A throw-away PostgreSQL server in its own directory, on its own port.

    ``settings`` adds ``-c name=value`` options to the defaults; ``bindir`` overrides
    :func:`find_postgres_bindir`."""

    name = "postgres"
    DEFAULT_SETTINGS: Mapping[str, str] = {
        "listen_addresses": "127.0.0.1",
        "fsync": "on",
        "shared_buffers": "16MB",
        "max_connections": "50",
    }

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        *,
        bindir: str | os.PathLike[str] | None = None,
        settings: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        found = Path(bindir) if bindir is not None else find_postgres_bindir()
        if found is None:
            places = " nor in " + ", ".join(POSTGRES_BIN_GLOBS) if POSTGRES_BIN_GLOBS else ""
            raise ServerStartError(
                f"no PostgreSQL binaries (postgres and initdb) on PATH ({os.environ.get('PATH', '')}){places}"
            )
        self.bindir = found
        self._owner = _postgres_os_user()
        super().__init__(workdir, port, startup_timeout)
        self.datadir = self.workdir / "data"
        self.settings = {**self.DEFAULT_SETTINGS, **(settings or {})}
        # Unix socket paths are limited to ~107 bytes: use a short directory of our own.
        sock = self.workdir / "sock"
        if len(str(sock)) > 60:
            sock = Path(tempfile.mkdtemp(prefix="bmpg-"))
            self._runtime.remove.append(sock)
        self.sockdir = sock
        self.sockdir.mkdir(exist_ok=True)
        if self._owner is not None:
            uid, gid = self._owner
            for path in (self.workdir, self.sockdir):
                os.chown(path, uid, gid)
            for path in (self.workdir, self.sockdir):
                if not reachable_by(path, uid, gid):
                    self.close()
                    raise ServerStartError(
                        f"running as root, PostgreSQL runs as OS user 'postgres', who cannot reach "
                        f"{path} (a parent directory is closed to it); leave workdir=None"
                    )
            if self.logfile.exists():
                os.chown(self.logfile, uid, gid)

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres``"""
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    def _popen_extra(self) -> dict[str, Any]:
        if self._owner is None:
            return {}
        uid, gid = self._owner
        return {"user": uid, "group": gid, "extra_groups": []}

    def _prepare(self) -> None:
        if (self.datadir / "PG_VERSION").exists():
            return
        argv = [
            str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres",
            "--auth=trust", "-E", "UTF8", "--locale=C",
            "--no-sync",  # only the bootstrap skips fsync; the server runs with fsync=on
        ]
        env = {**os.environ, "LC_ALL": "C"}
        env.pop("PGDATA", None)
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=self.workdir, env=env, timeout=max(self.startup_timeout, 60.0), check=False,
            **self._popen_extra(),
        )
        if done.returncode != 0:
            raise ServerStartError(
                f"initdb failed (status {done.returncode}): {' '.join(argv)}\n"
                + done.stdout.decode(errors="replace")[-3000:]
            )

    def _argv(self) -> list[str]:
        argv = [str(self.bindir / "postgres"), "-D", str(self.datadir), "-p", str(self.port), "-k", str(self.sockdir)]
        for key, value in self.settings.items():
            argv += ["-c", f"{key}={value}"]
        return argv

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = super()._spawn()
        if self._owner is not None:  # the log is written by root; later starts append as root too
            with contextlib.suppress(OSError):
                os.chown(self.logfile, *self._owner)
        return proc

    def _ready(self) -> bool:
        # Our server, not another one that holds the port while ours fails to bind.
        try:
            import psycopg
        except ImportError:
            raise ServerStartError("psycopg is needed to wait for PostgreSQL (pip install psycopg)") from None
        try:
            with psycopg.connect(self.url, connect_timeout=2, autocommit=True) as conn:
                row = conn.execute("SHOW data_directory").fetchone()
        except psycopg.Error:
            return False
        return row is not None and os.path.realpath(str(row[0])) == os.path.realpath(self.datadir)

    def _graceful_signal(self) -> signal.Signals:
        return signal.SIGINT  # PostgreSQL's "fast" shutdown
