"""A private Redis server, and where its binary is found.

:class:`PrivateRedis` starts ``redis-server --appendonly yes --appendfsync always
--save ''`` (configurable) in a temporary directory on a free port; ``redis-server`` is
looked for on ``PATH`` (:func:`find_redis_server`). :func:`redis_probe` tells whether a
server at a URL answers.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from .process import ChildServer, ServerStartError

__all__ = ["PrivateRedis", "find_redis_server", "redis_probe"]

def find_redis_server() -> Path | None:
    """``redis-server`` from ``PATH``, or None."""
    found = shutil.which("redis-server")
    return Path(found) if found else None


class PrivateRedis(ChildServer):
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


def redis_probe(url: str, timeout: float) -> str | None:
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
