"""A TCP fault proxy (asyncio) to put between a backend and its server in tests.

The proxy listens on a local port and forwards every connection to the target server.
Faults are switched on and off at runtime and apply to the connections already open as
well as to new ones::

    from botmesh_testkit.servers.faultproxy import FaultProxy

    async with FaultProxy("127.0.0.1", 6379) as proxy:
        client = redis.asyncio.Redis.from_url(proxy.url_for("redis://127.0.0.1:6379/0"))
        proxy.latency(200)                 # +200 ms on every chunk, each direction
        proxy.latency(0)
        proxy.reset()                      # RST every open connection now
        proxy.blackhole(True)              # forward nothing (held until blackhole(False))
        proxy.blackhole(False)
        proxy.cut_reply_after(1000)        # the next reply: 1000 bytes, then the connection drops
        proxy.cut_after_request(b"SET")    # "outcome unknown": see below
        proxy.refuse(True)                 # new connections are reset as soon as accepted
        proxy.clear()                      # every fault off
        print(proxy.stats)                 # connections, bytes each way, faults fired

The faults:

``latency(ms)``
    every chunk read from either side waits ``ms`` milliseconds before it is forwarded
    (so a request/reply round trip takes at least ``2 * ms`` more).
``reset()``
    closes every open connection abruptly, on both sides, with an RST (``SO_LINGER`` 0):
    the client's next read or write fails with "connection reset".
``blackhole(True, drop=False)``
    connections are accepted and kept, but nothing is forwarded: clients hang until their
    own timeout. Bytes read meanwhile are held and forwarded when the blackhole ends
    (what TCP retransmission does across a healed partition), or discarded with
    ``drop=True``.
``cut_reply_after(nbytes, times=1)``
    one shot: on the first connection that receives server bytes after the call, only
    ``nbytes`` more bytes reach the client, then the client's connection is closed and
    the server's reset: a reply cut in the middle. A client must report an error, never
    a truncated value. ``times=n``: the next ``n`` replies are cut so (a write cut, then
    the read that would resolve its outcome).
``cut_after_request(match=None)``
    one shot, "outcome unknown" (OUT-14): the next chunk a client sends (the next one
    containing ``match`` when given; the match is looked for inside one chunk, which is how
    clients send a short command) is forwarded to the server, and so is whatever the
    client sends after it on that connection until the server answers; the proxy waits
    for the server's answer (at most ``cut_reply_wait`` seconds), discards it, and resets
    the client's connection. The write has landed on the server, the client sees a connection
    error, and by the time it sees it the server has already executed the command.
``refuse(True)``
    new connections are reset as soon as they are accepted (the server "is down").

Counters are in :attr:`FaultProxy.stats` (:class:`ProxyStats`).

Fault methods are plain (non-async) methods and must be called on the proxy's event loop
(the test's own loop when the test is a coroutine). A synchronous test uses
:class:`ThreadedFaultProxy`, the same proxy on a loop of its own thread::

    with ThreadedFaultProxy("127.0.0.1", 5432) as proxy:
        conn = psycopg.connect(proxy.url_for(server_url), autocommit=True)
        proxy.cut_after_request(b"INSERT")
        ...

:meth:`FaultProxy.url_for` rewrites a ``postgresql://`` or ``redis://`` URL's host and
port to the proxy's (user, password, database and query are kept).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

__all__ = ["FaultProxy", "ProxyStats", "ThreadedFaultProxy"]

_T = TypeVar("_T")


@dataclass
class ProxyStats:
    """What went through the proxy. ``faults_fired`` counts, per fault: ``reset``
    (connections reset), ``blackhole`` (chunks held or dropped), ``latency`` (chunks
    delayed), ``cut_reply``, ``cut_after_request``, ``refuse`` (connections refused),
    ``upstream_unreachable`` (the target did not accept a connection)."""

    connections_accepted: int = 0
    connections_active: int = 0
    bytes_client_to_server: int = 0
    bytes_server_to_client: int = 0
    bytes_withheld: int = 0  # dropped by a blackhole, or a reply discarded by a cut
    faults_fired: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> ProxyStats:
        """An independent copy."""
        return dataclasses.replace(self, faults_fired=dict(self.faults_fired))


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with an RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    writer.close()


class _Link:
    """One proxied connection: the client side and the server side."""

    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.creader, self.cwriter = client
        self.sreader, self.swriter = server
        self.closed = False
        self.cut_pending = False  # cut_after_request fired here: waiting for the server's answer
        self.cut_timer: asyncio.TimerHandle | None = None
        self.reply_budget: int | None = None  # cut_reply_after in effect here
        self.tasks: list[asyncio.Task[None]] = []


class FaultProxy:
    """A TCP proxy to ``target_host:target_port`` listening on ``listen_host:listen_port``
    (port 0: a free port, see :attr:`port` after :meth:`start`)."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        chunk_size: int = 65536,
        connect_timeout: float = 10.0,
        cut_reply_wait: float = 5.0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.port = listen_port
        self.chunk_size = chunk_size
        self.connect_timeout = connect_timeout
        self.cut_reply_wait = cut_reply_wait
        self.stats = ProxyStats()
        self._server: asyncio.base_events.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._latency_s = 0.0
        self._blackhole = False
        self._blackhole_drop = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refuse = False
        self._cut_reply: int | None = None
        self._cut_reply_left = 0
        self._cut_request_armed = False
        self._cut_request_match: bytes | None = None

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> Self:
        """Listen; returns ``self``."""
        if self._server is not None:
            return self
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        """Stop listening and drop every connection (with an RST)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for link in list(self._links):
            self._close_link(link, client_rst=True, server_rst=True)
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect: (host, port)."""
        host = self.listen_host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return host, self.port

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        host, port = self.address
        if ":" in host:
            host = f"[{host}]"
        userinfo, at, _ = parts.netloc.rpartition("@")
        return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}:{port}"))

    # ------------------------------------------------------------------ faults

    def latency(self, ms: float) -> None:
        """Delay every forwarded chunk by ``ms`` milliseconds, both ways (0: off)."""
        if ms < 0:
            raise ValueError("latency must be >= 0 ms")
        self._latency_s = ms / 1000.0

    def reset(self) -> int:
        """Reset (RST) every open connection, both sides; returns how many."""
        links = list(self._links)
        for link in links:
            self._close_link(link, client_rst=True, server_rst=True)
        self._fired("reset", len(links))
        return len(links)

    def blackhole(self, on: bool = True, *, drop: bool = False) -> None:
        """Forward nothing while on; bytes are held (or dropped with ``drop=True``)."""
        self._blackhole = on
        self._blackhole_drop = drop
        if on and not drop:
            self._flowing.clear()
        else:
            self._flowing.set()  # held chunks wake up: forwarded, or dropped in drop mode

    def refuse(self, on: bool = True) -> None:
        """Reset new connections as soon as they are accepted, while on."""
        self._refuse = on

    def cut_reply_after(self, nbytes: int, times: int = 1) -> None:
        """One shot (``times`` shots): let ``nbytes`` more bytes of the next server reply
        through, then drop that connection."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if times < 1:
            raise ValueError("times must be >= 1")
        self._cut_reply, self._cut_reply_left = nbytes, times

    def cut_after_request(self, match: bytes | None = None) -> None:
        """One shot: forward the next client chunk (containing ``match`` if given) to the
        server, then reset the client once the server has answered: the outcome is
        unknown to the client."""
        self._cut_request_armed = True
        self._cut_request_match = match

    def clear(self) -> None:
        """Every fault off (held bytes are released)."""
        self.latency(0)
        self.blackhole(False)
        self.refuse(False)
        self._cut_reply = None
        self._cut_request_armed = False
        self._cut_request_match = None

    # ------------------------------------------------------------------ forwarding

    def _fired(self, fault: str, n: int = 1) -> None:
        if n:
            self.stats.faults_fired[fault] = self.stats.faults_fired.get(fault, 0) + n

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            self.stats.connections_accepted += 1
            if self._refuse:
                self._fired("refuse")
                _rst(cwriter)
                return
            try:
                server = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout
                )
            except (TimeoutError, OSError):
                self._fired("upstream_unreachable")
                _rst(cwriter)
                return
            except asyncio.CancelledError:
                _rst(cwriter)
                raise
            link = _Link((creader, cwriter), server)
            self._links.add(link)
            self.stats.connections_active += 1
            link.tasks = [
                asyncio.create_task(self._pump(link, upstream=True)),
                asyncio.create_task(self._pump(link, upstream=False)),
            ]
            try:
                await asyncio.gather(*link.tasks, return_exceptions=True)
            finally:
                self._close_link(link, client_rst=False, server_rst=False)
                for pump in link.tasks:
                    pump.cancel()
                await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            self._handlers.discard(task)

    def _close_link(self, link: _Link, *, client_rst: bool, server_rst: bool) -> None:
        if link.closed:
            return
        link.closed = True
        if link.cut_timer is not None:
            link.cut_timer.cancel()
        for writer, rst in ((link.cwriter, client_rst), (link.swriter, server_rst)):
            if rst:
                _rst(writer)
            else:
                writer.close()
        self._links.discard(link)
        self.stats.connections_active -= 1
        current = asyncio.current_task()
        for pump in link.tasks:
            if pump is not current:
                pump.cancel()

    def _doom_client(self, link: _Link) -> None:
        """End of a cut_after_request: reset the client, close the server side politely."""
        self._close_link(link, client_rst=True, server_rst=False)

    async def _pump(self, link: _Link, *, upstream: bool) -> None:
        src = link.creader if upstream else link.sreader
        dst = link.swriter if upstream else link.cwriter
        try:
            while not link.closed:
                data = await src.read(self.chunk_size)
                if not data:
                    if not link.closed and dst.can_write_eof():
                        dst.write_eof()
                    return
                if self._latency_s > 0:
                    self._fired("latency")
                    await asyncio.sleep(self._latency_s)
                if self._blackhole:
                    self._fired("blackhole")
                    if self._blackhole_drop:
                        self.stats.bytes_withheld += len(data)
                        continue
                    while self._blackhole and not self._blackhole_drop:
                        await self._flowing.wait()
                    if self._blackhole:  # switched to drop while held
                        self.stats.bytes_withheld += len(data)
                        continue
                if link.closed:
                    return
                if upstream:
                    await self._forward_up(link, data)
                elif await self._forward_down(link, data):
                    return
        except (ConnectionError, OSError):
            self._close_link(link, client_rst=True, server_rst=True)  # pass the reset on

    async def _forward_up(self, link: _Link, data: bytes) -> None:
        # Once the cut fired, the rest of the request (a large command, the Bind/Execute/
        # Sync after a Parse) still goes to the server until its answer comes back.
        matches = self._cut_request_match is None or self._cut_request_match in data
        if not link.cut_pending and self._cut_request_armed and matches:
            self._cut_request_armed = False
            self._fired("cut_after_request")
            link.cut_pending = True
            link.cut_timer = asyncio.get_running_loop().call_later(self.cut_reply_wait, self._doom_client, link)
        link.swriter.write(data)
        self.stats.bytes_client_to_server += len(data)
        await link.swriter.drain()

    async def _forward_down(self, link: _Link, data: bytes) -> bool:
        """Forward a server chunk to the client; True when the link ended here."""
        if link.cut_pending:
            # The server answered the cut request: it landed. The client never hears of it.
            self.stats.bytes_withheld += len(data)
            self._doom_client(link)
            return True
        budget = link.reply_budget
        if budget is None and self._cut_reply is not None:
            budget = self._cut_reply
            self._cut_reply_left -= 1
            if self._cut_reply_left <= 0:
                self._cut_reply = None
        if budget is not None:
            if len(data) >= budget:
                link.cwriter.write(data[:budget])
                self.stats.bytes_server_to_client += budget
                self.stats.bytes_withheld += len(data) - budget
                self._fired("cut_reply")
                # FIN after the partial reply (the client reads it, then end of stream).
                self._close_link(link, client_rst=False, server_rst=True)
                return True
            link.reply_budget = budget - len(data)
        link.cwriter.write(data)
        self.stats.bytes_server_to_client += len(data)
        await link.cwriter.drain()
        return False


class ThreadedFaultProxy:
    """:class:`FaultProxy` on an event loop of its own (a daemon thread), with the same
    methods, all synchronous: for tests that use blocking clients. A context manager."""

    def __init__(
        self, target_host: str, target_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0, **kwargs: Any
    ) -> None:
        self.proxy = FaultProxy(target_host, target_port, listen_host, listen_port, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.timeout = 30.0

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy is not started")
        future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(self.timeout)

    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        async def call() -> _T:
            return fn(*args, **kwargs)

        return self._run(call())

    def start(self) -> Self:
        if self._loop is not None:
            return self
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="botmesh-faultproxy", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._run(self.proxy.start())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._run(self.proxy.stop())
        finally:
            self._loop = self._thread = None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(self.timeout)
            loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        return self._call(self.proxy.stats.snapshot)

    def url_for(self, url: str) -> str:
        return self.proxy.url_for(url)

    def latency(self, ms: float) -> None:
        self._call(self.proxy.latency, ms)

    def reset(self) -> int:
        return self._call(self.proxy.reset)

    def blackhole(self, on: bool = True, *, drop: bool = False) -> None:
        self._call(self.proxy.blackhole, on, drop=drop)

    def refuse(self, on: bool = True) -> None:
        self._call(self.proxy.refuse, on)

    def cut_reply_after(self, nbytes: int, times: int = 1) -> None:
        self._call(self.proxy.cut_reply_after, nbytes, times)

    def cut_after_request(self, match: bytes | None = None) -> None:
        self._call(self.proxy.cut_after_request, match)

    def clear(self) -> None:
        self._call(self.proxy.clear)

