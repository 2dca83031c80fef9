"""Real PostgreSQL and Redis servers for tests: private throw-away servers, and the
provisioning order the pytest plugin follows (issue 4, "Servers for the tests").

Nothing here imports pytest, psycopg, redis-py, psutil or testcontainers at import time:
the module works inside and outside pytest, and each optional package is imported where
it is needed (psycopg to poll and administer PostgreSQL, redis-py to administer Redis
key prefixes, psutil to kill a server's process tree, testcontainers for step 3).

Private servers
---------------

:class:`PrivatePostgres` runs ``initdb`` into a temporary directory and starts
``postgres`` on a free port of 127.0.0.1 (``fsync=on``, ``shared_buffers=16MB``,
``max_connections=50``), with its Unix socket in a private directory. When the tests run
as root, ``initdb`` and ``postgres`` run as the OS user ``postgres`` (PostgreSQL refuses to
run as root) and the directories are handed to that user; as any other user they run as
that user. The database superuser is always called ``postgres``, so :attr:`~PrivatePostgres.url`
is ``postgresql://postgres@127.0.0.1:PORT/postgres``.

:class:`PrivateRedis` starts ``redis-server --appendonly yes --appendfsync always
--save ''`` (configurable) in a temporary directory on a free port.

Both are context managers and have the same life cycle::

    with PrivatePostgres() as pg:           # initdb (first time) + start + wait ready
        use(pg.url)
        pg.kill()                           # SIGKILL the server and its children: a crash
        pg.start()                          # same data dir, same port: crash recovery
        pg.stop()                           # clean shutdown (fast for PostgreSQL)
    # leaving the block stops the server and deletes the directory it created

``start()`` waits until the server accepts connections by polling it (bounded by
``startup_timeout``), never by sleeping a fixed time; if the server exits first, the error
carries the tail of its log. A free port is found by binding port 0; when another process
grabs it before the server does, the server is started again on another port (only when
no port was given). A server still running when the interpreter exits is killed.

A ``workdir`` may be given (the data lives in ``workdir/data`` and is reused when it
exists); it is then kept at :meth:`close`. Under root it must be reachable by the user
``postgres`` (pytest's ``tmp_path`` under ``/tmp/pytest-of-root`` is not: leave
``workdir`` to its default, a fresh directory under the system temp directory).

Provisioning (the plugin's order)
---------------------------------

:func:`provision_postgres` and :func:`provision_redis` return a :class:`Provisioned`
server, trying in this order:

1. **a URL**: the ``url`` argument, else ``BOTMESH_POSTGRES_URL`` / ``BOTMESH_REDIS_URL``.
   It must answer. *A given URL that does not answer is an error, not a fallback*: the
   user chose that server, and silently testing another one would certify the wrong
   thing. :class:`ServiceUnavailable` is raised with ``fatal=True`` (the plugin fails
   the run, with or without ``--botmesh-require-services``).
2. **a private server** from local binaries: ``postgres``/``initdb`` on ``PATH`` or in
   ``/usr/lib/postgresql/*/bin`` (see :data:`POSTGRES_BIN_GLOBS`), ``redis-server`` on
   ``PATH``.
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

Example, in one's own ``conftest.py``::

    import pytest
    from botmesh_testkit.services import ServiceUnavailable, namespace_hint, provision_postgres

    @pytest.fixture(scope="session")
    def postgres_url():
        try:
            server = provision_postgres()
        except ServiceUnavailable as exc:
            (pytest.fail if exc.should_fail else pytest.skip)(str(exc))
        db_url = server.new_database(namespace_hint())
        yield db_url
        server.close()

Server-fault tests (kill -9 and restart) use a :class:`PrivatePostgres` /
:class:`PrivateRedis` of their own, never a shared server; the provisioned private
server is reachable as :attr:`Provisioned.server`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import quote, urlsplit, urlunsplit

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

POSTGRES_URL_ENV = "BOTMESH_POSTGRES_URL"
REDIS_URL_ENV = "BOTMESH_REDIS_URL"
REDIS_PREFIX_ENV = "BOTMESH_REDIS_PREFIX"
"""The key prefix the plugin gives a test run on the Redis server (the redis harness puts
its per-workdir prefixes under it)."""
#: Set to ``1`` to let the project's own service tests skip when binaries are missing
#: (by default they fail: CI runs them for real).
ALLOW_SKIP_ENV = "BOTMESH_ALLOW_SKIP_SERVICES"
#: Where PostgreSQL binaries are looked for after ``PATH`` (newest version first).
POSTGRES_BIN_GLOBS: list[str] = ["/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin", "/usr/pgsql-*/bin"]

Kind = Literal["url", "private", "container"]


class ServerStartError(RuntimeError):
    """A private server could not be prepared or did not come up (the message carries
    the command and the tail of the server's log)."""


# --------------------------------------------------------------------------- helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _postgres_os_user() -> tuple[int, int] | None:
    """(uid, gid) of the OS user ``postgres`` when running as root, else None."""
    if not _is_root():
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


def _reachable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether every existing ancestor of ``path`` can be traversed by ``uid``/``gid``."""
    import grp
    import pwd

    name = pwd.getpwuid(uid).pw_name
    groups = {gid} | {g.gr_gid for g in grp.getgrall() if name in g.gr_mem}
    for ancestor in [path, *path.parents]:
        if not ancestor.exists():
            continue
        st = ancestor.stat()
        if st.st_uid == uid:
            ok = bool(st.st_mode & 0o100)
        elif st.st_gid in groups:
            ok = bool(st.st_mode & 0o010)
        else:
            ok = bool(st.st_mode & 0o001)
        if not ok:
            return False
    return True


def _log_tail(path: Path, lines: int = 30, offset: int = 0) -> str:
    """The last ``lines`` lines of ``path`` written after byte ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _kill_tree(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGKILL ``proc`` and all its descendants, like a machine-level crash of the server.

    The parent is stopped (SIGSTOP) first so it cannot fork while its children are being
    listed; then everything gets SIGKILL, and we wait until all of it is gone."""
    import psutil

    if proc.poll() is not None:
        return
    children: list[psutil.Process] = []
    try:
        parent = psutil.Process(proc.pid)
        parent.send_signal(signal.SIGSTOP)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGKILL)
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    for child in children:
        while not _gone(child.pid):
            if time.monotonic() > deadline:
                raise ServerStartError(f"process {child.pid} survived SIGKILL for {timeout}s")
            time.sleep(0.01)


@dataclass
class _Runtime:
    """What a finalizer needs to clean up after a server object that was never closed."""

    proc: subprocess.Popen[bytes] | None = None
    remove: list[Path] = field(default_factory=list)


def _finalize(runtime: _Runtime) -> None:
    if runtime.proc is not None and runtime.proc.poll() is None:
        with contextlib.suppress(Exception):
            _kill_tree(runtime.proc)
    for path in runtime.remove:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- private servers


class _ChildServer(ABC):
    """Common life cycle of a server run as a child process in a private directory."""

    name = "server"
    _PORT_IN_USE = ("Address already in use",)

    def __init__(self, workdir: str | os.PathLike[str] | None, port: int | None, startup_timeout: float) -> None:
        self._runtime = _Runtime()
        self._finalizer = weakref.finalize(self, _finalize, self._runtime)
        if workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"botmesh-{self.name}-"))
            self._runtime.remove.append(self.workdir)
        else:
            self.workdir = Path(workdir).absolute()
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.logfile = self.workdir / f"{self.name}.log"
        self._port_given = port is not None
        self.port: int = port if port is not None else free_port()
        self.startup_timeout = startup_timeout
        self.host = "127.0.0.1"
        self._log_offset = 0  # where the current start's output begins in the log

    # -- to implement
    @abstractmethod
    def _argv(self) -> list[str]:
        """The command line that runs the server in the foreground."""

    @abstractmethod
    def _ready(self) -> bool:
        """One readiness probe: True when the server serves requests."""

    def _prepare(self) -> None:
        """One-time preparation before the first start (e.g. initdb)."""

    def _popen_extra(self) -> dict[str, Any]:
        return {}

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL clients connect to."""

    # -- life cycle
    @property
    def pid(self) -> int | None:
        """The server's (main process) pid while it runs, else None."""
        proc = self._runtime.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> Self:
        """Start the server (preparing its directory the first time) and wait until it
        serves requests. A no-op while it runs. Returns ``self``."""
        if self.running:
            return self
        self._prepare()
        for attempt in range(5):
            proc = self._spawn()
            try:
                self._wait_ready(proc)
                return self
            except ServerStartError:
                in_use = any(m in self._log_tail(15) for m in self._PORT_IN_USE)
                if proc.poll() is None:
                    _kill_tree(proc)
                if in_use and not self._port_given and attempt < 4:
                    self.port = free_port()  # somebody took our port: pick another one
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self) -> subprocess.Popen[bytes]:
        argv = self._argv()
        with contextlib.suppress(OSError):
            self._log_offset = self.logfile.stat().st_size
        with open(self.logfile, "ab") as log:
            log.write(f"\n--- botmesh: starting {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,  # a Ctrl-C in the terminal is for pytest, not the server
                **self._popen_extra(),
            )
        self._runtime.proc = proc
        return proc

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.01
        while True:
            if proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with status {proc.returncode} before accepting connections "
                    f"(command: {' '.join(self._argv())}); log {self.logfile}:\n{self._log_tail()}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not accept connections within {self.startup_timeout}s; "
                    f"log {self.logfile}:\n{self._log_tail()}"
                )
            time.sleep(delay)  # poll interval, growing a little; readiness is what we wait for
            delay = min(delay * 1.5, 0.1)

    def _log_tail(self, lines: int = 30) -> str:
        return _log_tail(self.logfile, lines, self._log_offset)

    def kill(self) -> None:
        """SIGKILL the server and every process it started (no shutdown of any kind), and
        wait until they are all gone. The data directory is left as the crash left it."""
        proc = self._runtime.proc
        if proc is not None:
            _kill_tree(proc)

    def _graceful_signal(self) -> signal.Signals:
        return signal.SIGTERM

    def stop(self, timeout: float = 30.0) -> None:
        """Clean shutdown; after ``timeout`` seconds the server is killed instead."""
        proc = self._runtime.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(self._graceful_signal())
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)

    def close(self) -> None:
        """Stop the server and delete the directory this object created (a given
        ``workdir`` is kept)."""
        self.stop()
        self._finalizer()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} pid={self.pid} dir={self.workdir}>"


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


def find_redis_server() -> Path | None:
    """``redis-server`` from ``PATH``, or None."""
    found = shutil.which("redis-server")
    return Path(found) if found else None


def _pg_probe(url: str, timeout: float) -> str | None:
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


class PrivatePostgres(_ChildServer):
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
                if not _reachable_by(path, uid, gid):
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


class PrivateRedis(_ChildServer):
    """A throw-away ``redis-server`` in its own directory, on its own port.

    ``appendonly``/``appendfsync`` set the AOF (default: on, fsync at every write);
    ``extra_args`` are appended to the command line (``["--maxmemory", "64mb"]``)."""

    name = "redis"

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        appendonly: bool = True,
        appendfsync: str = "always",
        *,
        binary: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
    ) -> None:
        found = Path(binary) if binary is not None else find_redis_server()
        if found is None:
            raise ServerStartError(f"no redis-server on PATH ({os.environ.get('PATH', '')})")
        self.binary = found
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args)
        super().__init__(workdir, port, startup_timeout)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``"""
        return f"redis://{self.host}:{self.port}/0"

    def _argv(self) -> list[str]:
        return [
            str(self.binary),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--logfile", "",
            *self.extra_args,
        ]

    def _ready(self) -> bool:
        # Our server (its INFO names our pid) with its data loaded, not another server
        # holding the port.
        pid = self.pid
        return pid is not None and _redis_raw_server_pid(self.host, self.port, timeout=1.0) == pid


def _redis_raw_server_pid(host: str, port: int, timeout: float) -> int | None:
    """``process_id`` from ``INFO`` over a raw socket (no client library needed); None
    while the server refuses connections or is still loading its data (``loading:1``)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"INFO\r\n")
            reply = b""
            while b"\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                reply += chunk
            header, _, body = reply.partition(b"\r\n")
            if not header.startswith(b"$"):
                return None  # e.g. -LOADING
            size = int(header[1:])
            while len(body) < size:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                body += chunk
    except (OSError, ValueError):
        return None
    match = re.search(rb"^process_id:(\d+)", body, re.MULTILINE)
    if match is None or re.search(rb"^loading:0", body, re.MULTILINE) is None:
        return None
    return int(match.group(1))


# --------------------------------------------------------------------------- provisioning


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
        server: _ChildServer | None = None,
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


def _redis_probe(url: str, timeout: float) -> str | None:
    """None when Redis at ``url`` answers PING, else why not."""
    try:
        import redis
    except ImportError:
        return "redis-py is not installed (pip install 'botmesh-testkit[redis]')"
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    except ValueError as exc:
        return f"bad URL: {exc}"
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


@dataclass(frozen=True)
class _ServiceSpec:
    service: str
    env: str
    probe: Callable[[str, float], str | None]
    private: Callable[[], _ChildServer]
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
    probe=_pg_probe,
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
    probe=_redis_probe,
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

