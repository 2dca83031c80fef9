"""A counting proxy: how many round trips (and which commands) a client really sends to
a PostgreSQL or Redis server — a deterministic measure, no timing (issue 16).

:class:`CountingProxy` is a :class:`~.faultproxy.FaultProxy` (every fault still works)
that also reads the protocol going through it, on every connection::

    from botmesh_testkit.servers.roundtrips import CountingProxy

    async with CountingProxy("127.0.0.1", 6379, protocol="redis") as proxy:
        client = redis.asyncio.Redis.from_url(proxy.url_for("redis://127.0.0.1:6379/0"))
        await client.ping()                       # connection set-up counts too ...
        proxy.reset_counts()                      # ... so start counting here
        await client.get("a")
        assert proxy.counts.round_trips == 1
        assert proxy.counts.commands["GET"] == 1

What is counted, per connection:

* a **request** is what the client then waits on: a Redis command (a RESP array), or for
  PostgreSQL a ``Sync`` (the end of an extended-query batch: ``Parse``/``Bind``/
  ``Execute``...), a simple ``Query``, or the start-up / ``SSLRequest`` packet;
* a **reply** ends one: a complete RESP reply (RESP2 and RESP3 types; pushes are not
  replies), or PostgreSQL's ``ReadyForQuery`` (and the one-byte answer to
  ``SSLRequest``);
* a **round trip** is a request sent while the connection had no reply outstanding: a
  pipeline of ten commands is one round trip and ten requests; the same ten commands
  each waiting for its reply are ten.

``commands`` counts Redis commands by name (upper case: ``"EVALSHA"``, ``"HGET"``) and
PostgreSQL front-end messages by name (``"Query"``, ``"Parse"``, ``"Bind"``,
``"Execute"``, ``"Sync"`` ...). A PostgreSQL connection must not use TLS (the bytes would
be unreadable): give ``sslmode=disable`` in the URL (:meth:`CountingProxy.url_for` adds it
for ``postgresql://`` URLs unless another ``sslmode`` is there). Password exchanges
during start-up are not counted as round trips of their own: reset the counts after the
connections are open.

Replies are parsed before they are forwarded, so the client can never send its next
request before the proxy has seen the reply to the last one: the counts do not depend
on timing or on how TCP cuts the bytes into chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .faultproxy import FaultProxy, _Link

__all__ = ["CountingProxy", "RoundTripCounts"]

Protocol = Literal["postgres", "redis"]

_PG_FRONTEND = {
    "Q": "Query", "P": "Parse", "B": "Bind", "E": "Execute", "S": "Sync", "D": "Describe",
    "C": "Close", "H": "Flush", "X": "Terminate", "p": "Password", "d": "CopyData",
    "c": "CopyDone", "f": "CopyFail", "F": "FunctionCall",
}
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102


@dataclass
class RoundTripCounts:
    """What went through a :class:`CountingProxy` since the last reset."""

    round_trips: int = 0
    requests: int = 0
    replies: int = 0
    commands: Counter[str] = field(default_factory=Counter)
    prepare_only: int = 0
    """PostgreSQL round trips that executed nothing: a batch ending in ``Sync`` without
    ``Execute`` (psycopg prepares a statement server-side on its 5th use on a
    connection, in a round trip of its own). Included in ``round_trips``."""

    @property
    def executing(self) -> int:
        """``round_trips - prepare_only``: the round trips that ran something."""
        return self.round_trips - self.prepare_only

    def snapshot(self) -> RoundTripCounts:
        """An independent copy."""
        return RoundTripCounts(self.round_trips, self.requests, self.replies, Counter(self.commands), self.prepare_only)


class _Unparsable(Exception):
    """The stream is not the protocol expected (TLS, a foreign client)."""


def _resp_element(buf: bytearray, i: int) -> tuple[int, Any] | None:
    """Parse one RESP element at ``buf[i:]``: ``(end, value)`` (the value only for the
    first bulk strings of a command, else None), or None when incomplete."""
    if i >= len(buf):
        return None
    line_end = buf.find(b"\r\n", i)
    if line_end < 0:
        return None
    kind = chr(buf[i])
    head = bytes(buf[i + 1 : line_end])
    after = line_end + 2
    if kind in "+-:_,#(":
        return after, None
    if kind in "$=!":
        n = int(head)
        if n < 0:
            return after, None
        if len(buf) < after + n + 2:
            return None
        return after + n + 2, bytes(buf[after : after + n])
    if kind in "*~>%|":
        n = int(head)
        if kind in "%|":
            n *= 2
        items: list[Any] = []
        for _ in range(max(n, 0)):
            parsed = _resp_element(buf, after)
            if parsed is None:
                return None
            after, value = parsed
            items.append(value)
        return after, items
    raise _Unparsable(f"not RESP: {kind!r}")


class _Side:
    """The parser state of one connection."""

    def __init__(self) -> None:
        self.up = bytearray()
        self.down = bytearray()
        self.outstanding = 0
        self.started = False  # PostgreSQL: the start-up packet went through
        self.raw_answers = 0  # PostgreSQL: one-byte answers expected (SSLRequest)
        self.batch_ran = False  # PostgreSQL: an Execute since the last Sync
        self.broken = False


class CountingProxy(FaultProxy):
    """A :class:`FaultProxy` to ``target_host:target_port`` that counts round trips,
    requests and commands of ``protocol`` (``"postgres"`` or ``"redis"``) in
    :attr:`counts` (see the module docstring). ``unparsable`` counts connections whose
    bytes were not the protocol (they are forwarded, not counted)."""

    def __init__(self, target_host: str, target_port: int, *, protocol: Protocol, **kwargs: Any) -> None:
        if protocol not in ("postgres", "redis"):
            raise ValueError(f"protocol must be 'postgres' or 'redis', got {protocol!r}")
        super().__init__(target_host, target_port, **kwargs)
        self.protocol: Protocol = protocol
        self.counts = RoundTripCounts()
        self.unparsable = 0
        self._sides: dict[int, _Side] = {}
        self._idle = asyncio.Event()

    async def stop(self, *, drain: float = 2.0) -> None:
        """Stop as :meth:`FaultProxy.stop`, after waiting up to ``drain`` seconds for the
        open connections to end by themselves (their clients closed them): a connection
        still open is reset, and Python 3.11's asyncio then logs a ``CancelledError``
        for its handler ("Exception in callback ... connection_made")."""
        if self._links and drain > 0:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain)
        await super().stop()

    def reset_counts(self) -> RoundTripCounts:
        """Start counting afresh; returns what was counted until now."""
        counted, self.counts = self.counts, RoundTripCounts()
        return counted

    def url_for(self, url: str) -> str:
        """``url`` through the proxy; a ``postgresql://`` URL also gets ``sslmode=disable``
        unless it names an ``sslmode``."""
        proxied = super().url_for(url)
        parts = urlsplit(proxied)
        if parts.scheme in ("postgres", "postgresql"):
            query = parse_qsl(parts.query, keep_blank_values=True)
            if not any(name == "sslmode" for name, _ in query):
                query.append(("sslmode", "disable"))
                proxied = urlunsplit(parts._replace(query=urlencode(query)))
        return proxied

    # -- observing ---------------------------------------------------------------------

    def _side(self, link: _Link) -> _Side:
        side = self._sides.get(id(link))
        if side is None:
            side = self._sides[id(link)] = _Side()
        return side

    def _close_link(self, link: _Link, *, client_rst: bool, server_rst: bool) -> None:
        self._sides.pop(id(link), None)
        super()._close_link(link, client_rst=client_rst, server_rst=server_rst)
        if not self._links:
            self._idle.set()

    async def _forward_up(self, link: _Link, data: bytes) -> None:
        self._observe(link, data, up=True)
        await super()._forward_up(link, data)

    async def _forward_down(self, link: _Link, data: bytes) -> bool:
        self._observe(link, data, up=False)
        return await super()._forward_down(link, data)

    def _observe(self, link: _Link, data: bytes, *, up: bool) -> None:
        side = self._side(link)
        if side.broken:
            return
        (side.up if up else side.down).extend(data)
        try:
            if self.protocol == "redis":
                self._redis(side, up=up)
            else:
                self._postgres(side, up=up)
        except (_Unparsable, ValueError, struct.error):
            side.broken = True
            side.up.clear()
            side.down.clear()
            self.unparsable += 1

    def _request(self, side: _Side, name: str | None) -> None:
        if side.outstanding == 0:
            self.counts.round_trips += 1
        side.outstanding += 1
        self.counts.requests += 1
        if name is not None:
            self.counts.commands[name] += 1

    def _reply(self, side: _Side) -> None:
        side.outstanding = max(0, side.outstanding - 1)
        self.counts.replies += 1

    def _redis(self, side: _Side, *, up: bool) -> None:
        buf = side.up if up else side.down
        while buf:
            parsed = _resp_element(buf, 0)
            if parsed is None:
                return
            end, value = parsed
            kind = chr(buf[0])
            del buf[:end]
            if up:
                name = value[0] if isinstance(value, list) and value and isinstance(value[0], bytes) else None
                self._request(side, None if name is None else name.decode("ascii", "replace").upper())
            elif kind != ">":  # a RESP3 push is not a reply
                self._reply(side)

    def _postgres(self, side: _Side, *, up: bool) -> None:
        if up:
            buf = side.up
            while True:
                if not side.started:
                    if len(buf) < 8:
                        return
                    (length,) = struct.unpack("!i", buf[:4])
                    if len(buf) < length:
                        return
                    (code,) = struct.unpack("!i", buf[4:8])
                    del buf[:length]
                    if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                        side.raw_answers += 1
                        self._request(side, "SSLRequest" if code == _SSL_REQUEST else "GSSENCRequest")
                    elif code == _CANCEL_REQUEST:
                        self.counts.commands["CancelRequest"] += 1
                    else:
                        side.started = True
                        self._request(side, "Startup")
                    continue
                if len(buf) < 5:
                    return
                kind = chr(buf[0])
                (length,) = struct.unpack("!i", buf[1:5])
                if length < 4:
                    raise _Unparsable("bad length")
                if len(buf) < 1 + length:
                    return
                del buf[: 1 + length]
                name = _PG_FRONTEND.get(kind, kind)
                if kind in ("S", "Q"):
                    starts = side.outstanding == 0
                    self._request(side, name)
                    if kind == "S" and not side.batch_ran and starts:
                        self.counts.prepare_only += 1
                    side.batch_ran = False
                else:
                    if kind in ("E", "F"):
                        side.batch_ran = True
                    self.counts.commands[name] += 1
        else:
            buf = side.down
            while buf:
                if side.raw_answers:
                    answer = chr(buf[0])
                    del buf[:1]
                    side.raw_answers -= 1
                    self._reply(side)
                    if answer != "N":
                        raise _Unparsable("TLS/GSS accepted: encrypted from here on")
                    continue
                if len(buf) < 5:
                    return
                kind = chr(buf[0])
                (length,) = struct.unpack("!i", buf[1:5])
                if length < 4:
                    raise _Unparsable("bad length")
                if len(buf) < 1 + length:
                    return
                del buf[: 1 + length]
                if kind == "Z":
                    self._reply(side)
