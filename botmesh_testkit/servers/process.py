"""What every private server shares: a child process in a private directory, on a free
port of 127.0.0.1, polled until it serves and killed as a crash would kill it.

:class:`ChildServer` is the life cycle that :class:`~.postgres.PrivatePostgres` and
:class:`~.redis.PrivateRedis` implement; both are context managers::

    with PrivatePostgres() as pg:           # initdb (first time) + start + wait ready
        use(pg.url)
        pg.kill()                           # SIGKILL the server and its children: a crash
        pg.start()                          # same data dir, same port: crash recovery
        pg.stop()                           # clean shutdown (fast for PostgreSQL)
    # leaving the block stops the server and deletes the directory it created

``start()`` waits until the server accepts connections by polling it (bounded by
``startup_timeout``), never by sleeping a fixed time; if the server exits first, the error
carries the tail of its log. A free port is found by binding port 0 (:func:`free_port`);
when another process grabs it before the server does, the server is started again on
another port (only when no port was given). A server still running when the interpreter
exits is killed.

A ``workdir`` may be given (the data lives under it and is reused when it exists); it is
then kept at :meth:`ChildServer.close`.

Also here: :func:`is_root` and :func:`reachable_by`, the OS-user checks a server that must
not run as root needs, and :class:`ServerStartError`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = ["ChildServer", "ServerStartError", "free_port", "is_root", "reachable_by"]

class ServerStartError(RuntimeError):
    """A private server could not be prepared or did not come up (the message carries
    the command and the tail of the server's log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_root() -> bool:
    """Whether this process runs as root (never on a platform without ``geteuid``)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def reachable_by(path: Path, uid: int, gid: int) -> bool:
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


class ChildServer(ABC):
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
        """Whether the server's main process runs."""
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
