"""``RedisKv``: the :class:`~botmesh.core.spi.DurableKv` of the Redis backend (BACK-3),
over redis-py's asyncio client (``redis.asyncio.Redis``) or cluster client
(``redis.asyncio.cluster.RedisCluster``).

Key layout (BACK-3)
-------------------
Everything of one ``(scope, space)`` lives under one Redis Cluster hash tag, so that one
scope's journal is in one slot and every write can be one atomic script::

    <prefix>:{durable:<space>:<scope>}:records  hash  key -> {"version": n, "value": {...}}
    <prefix>:{durable:<space>:<scope>}:due      zset  score = due (ms), member = key
    <prefix>:{durable:<space>:<scope>}:expires  zset  score = expires (ms), member = key
    <prefix>:{durable:<space>:<scope>}:keys     zset  score 0, member = key (for scan)

With the engine's spaces this is ``<prefix>:{durable:inbox:<scope>}`` and
``<prefix>:{durable:outbox:<scope>}``, exactly as BACK-3 says.

* ``<scope>`` is any string. It is written with ``%``, ``{``, ``}`` and the ASCII control
  characters percent-encoded (``%XX`` of their UTF-8 bytes); everything else is kept
  as is, so keys stay readable. The encoded scope never contains ``}``, so the hash tag
  always ends where the scope ends, and the encoding is injective (``%`` itself is
  encoded), so no two scopes share keys — a scope ``a}:x`` cannot reach into the keys of
  scope ``a``.
* ``<space>`` is encoded the same way plus ``:``, so the first ``:`` after ``durable:``
  always ends the space (a space ``in:box`` can never meet space ``in`` and a scope
  starting with ``box:``).
* ``<prefix>`` may contain no ``{``, ``}``, whitespace or control characters (see
  :func:`check_prefix`), so the first ``{`` of every key opens the hash tag, and two
  prefixes never share keys (after a prefix comes ``:{``, which no prefix contains).
* Keys and members are UTF-8 bytes. Keys, scopes and spaces are checked first as every
  built-in kv checks them (:mod:`botmesh.core.inputs`: no lone surrogate, no U+0000,
  a key a non-empty ``str`` of at most 512 characters); ``surrogatepass`` stays for
  records written by an older version.
  Redis orders members of equal score, and ``ZRANGEBYLEX`` ranges, by comparing bytes;
  for UTF-8 byte order is code-point order, which is what ``range`` (ties by key) and
  ``scan`` promise.
* A record's hash field holds the JSON text ``{"version":n,"value":<value JSON>}``: the
  scripts read the version from the fixed prefix of that text with a Lua pattern and
  never parse the value (Lua's cjson would round big integers and floats).

Atomicity
---------
Every ``put`` and ``delete`` is ONE Lua script run with ``EVALSHA`` (redis-py's
``register_script``): it reads the current version, compares it with
``expected_version`` and — only when they match — writes the record and both index
entries, all inside the server. Concurrent CAS calls on one key therefore have exactly
one winner, across processes and hosts (REPL-1); a conflict returns the record found.
``scan`` is a read-only script too; ``get`` is one ``HGET``, ``range`` one ``ZRANGEBYSCORE``.
Concurrent calls share round trips (auto-pipelining, :mod:`botmesh.redis_store._pipeline`).

No automatic retry of a write
-----------------------------
A write whose reply is lost (connection reset after the command was sent) may have
landed. Re-sending it would turn a landed CAS into a false ``VersionConflict`` (or a
landed create into a "duplicate"), so no client used here may retry a command on its
own: clients this module builds get ``retry=Retry(NoBackoff(), 0)`` and
``retry_on_error=[]`` (redis-py 6+ retries 3 times by default), and an injected client
whose retry policy would resend a command is refused with a
:class:`~botmesh.core.errors.ConfigError` naming ``client`` (build it with
``retry=Retry(NoBackoff(), 0)``; for a ``RedisCluster`` the cluster-level ``retry``).
Instead of a resend, the error is raised as
:class:`~botmesh.core.errors.BackendUnavailableError` and
:class:`~botmesh.core.kv_durability.KvDurability` re-reads the record by key to learn the outcome.
The only resends left are safe ones: redis-py's ``NOSCRIPT`` fallback (``SCRIPT LOAD``
then ``EVALSHA`` again — a ``NOSCRIPT`` reply means the script did not run) and a
cluster's ``MOVED``/``ASK``/``TRYAGAIN`` redirections (the node refused the command).

Redis Cluster
-------------
With ``cluster=`` (or an injected ``RedisCluster``) every script touches the keys of one
hash tag, so one slot, so one node. The slot map is loaded once before the first
command (:meth:`RedisKv._initialize_cluster`), with concurrent first calls waiting for
it: redis-py initializes lazily and concurrent first commands racing that can see their
connections closed under them. Tested against a private 3-node cluster started by the
tests from the local ``redis-server`` binaries.

Cancellation
------------
redis-py sends commands under ``asyncio.wait_for``; on Python 3.11 a cancellation that
arrives in the same loop iteration as the completed write is dropped and the command
returns normally. Every call here compares ``Task.cancelling()`` before and after the
driver call and raises ``CancelledError`` itself when a cancellation was swallowed, so
that cancelling a task blocked on this backend (``bot.stop()`` cancelling the sweep)
always works.

Errors, lifecycle, durability
-----------------------------
Every redis-py error (connection refused or reset, timeout, error reply, cluster error)
is raised as ``BackendUnavailableError`` naming the operation and the prefix, and
reported to ``logger.error``. A hash field under our keys that is not a record written
here is reported when read: ``get``/``scan`` raise
:class:`~botmesh.core.errors.JournalCorruptError` naming the Redis key and the record
key; a ``put``/``delete`` on it fails in the script (``BackendUnavailableError``,
"malformed record") and changes nothing.

A client built from ``url``/``cluster`` is created when
the kv is built (a bad URL is a ``ConfigError`` at once), closed by :meth:`close` and
created again by a later :meth:`open`; an injected ``client`` belongs to its owner and
is never closed here. After :meth:`close` (or :meth:`abandon`) every call raises
``BackendUnavailableError``.

``capabilities.survives_crash`` is claimed, but it holds only when the *server* makes
acknowledged writes durable: AOF with ``appendfsync always``. With ``everysec`` a server
crash may lose the last second of acknowledged writes; without persistence a server
restart loses everything. A crash of the *client* process never loses an acknowledged
write (nothing is buffered client-side). :meth:`RedisKv.durability_settings` reports what
the server runs with (``CONFIG GET appendonly``/``appendfsync``), so a certification
refuses the claim on a server that cannot keep it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import unicodedata
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from ..core.errors import BackendUnavailableError, ConfigError, JournalCorruptError, VersionConflict
from ..core.inputs import check_delete, check_put, check_range, check_record, check_scan, check_score
from ..core.spi import Capabilities, DurableKv, IndexName, Versioned, check_index, check_json_object, encode_checked
from ._driver import check_client_options, check_connection_options, direct_send, driver_options, options_refused
from ._lua import DELETE, PUT, RANGES, SCAN
from ._pipeline import AutoPipeline

__all__ = [
    "ClusterSpec",
    "DEFAULT_PREFIX",
    "MAX_PREFIX_LENGTH",
    "RedisClient",
    "RedisKv",
    "check_prefix",
    "client_from_url",
    "client_retries",
    "key_pattern",
    "scope_keys",
]

RedisClient = Redis | RedisCluster
"""What ``client=`` accepts: an asyncio ``Redis`` or ``RedisCluster`` client."""

ClusterSpec = str | Sequence[str | tuple[str, int]]
"""What ``cluster=`` accepts: a ``redis://host:port`` URL of one node, or a list of
startup nodes as ``"host:port"`` strings or ``(host, port)`` tuples."""

DEFAULT_PREFIX = "botmesh"
MAX_PREFIX_LENGTH = 64
DEFAULT_SOCKET_TIMEOUT_S = 30.0
"""Socket timeout of the clients built here (a URL query ``socket_timeout=`` wins): a
server that stops answering makes a call fail instead of hanging forever."""
DEFAULT_CONNECT_TIMEOUT_S = 5.0

log = logging.getLogger("botmesh.redis_store")
T = TypeVar("T")

_DRIVER_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError, EOFError)

_NEW, _OPEN, _CLOSED = "new", "open", "closed"

_PERSISTENCE_SETTINGS = ("appendonly", "appendfsync")
"""What :meth:`RedisKv.durability_settings` reads: whether the server keeps an
append-only file, and when it fsyncs it."""

# -- key layout --------------------------------------------------------------------------


def _escape(text: str, special: str) -> str:
    """``text`` with every character of ``special``, and every ASCII control character,
    replaced by ``%XX`` of its UTF-8 bytes (``%`` must be in ``special``: that makes the
    encoding injective)."""
    out: list[str] = []
    for ch in text:
        if ch in special or ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8")))
        else:
            out.append(ch)
    return "".join(out)


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _s(data: bytes | str) -> str:
    return data if isinstance(data, str) else data.decode("utf-8", "surrogatepass")


def _text(data: object) -> str:
    """A reply element as text, whether the client decodes replies or not."""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)


@functools.lru_cache(maxsize=1024)
def scope_keys(prefix: str, scope: str, space: str) -> dict[str, bytes]:
    """The Redis keys of one ``(scope, space)`` under ``prefix``: ``records``, ``due``,
    ``expires`` and ``keys``, all under the hash tag ``{durable:<space>:<scope>}``. Kept once
    made (issue 16: ~3 % of a Redis message's CPU); the dict is shared, not to be changed."""
    base = f"{prefix}:{{durable:{_escape(space, '%{}:')}:{_escape(scope, '%{}')}}}"
    return {part: _b(f"{base}:{part}") for part in ("records", "due", "expires", "keys")}


def key_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern for every key this backend writes under ``prefix`` (and
    nothing of another prefix: the pattern includes the ``:{durable:`` that follows)."""
    escaped = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in prefix)
    return f"{escaped}:{{durable:*"


def check_prefix(prefix: Any) -> str:
    """``prefix`` when valid, else a :class:`ConfigError` naming the option ``prefix``:
    a non-empty string of at most 64 characters without ``{``, ``}``, whitespace or
    control characters (they would break the hash tag or make keys unreadable)."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"prefix: {why}, got {prefix!r}", option="prefix", value=prefix)

    if not isinstance(prefix, str):
        raise bad("expected a string")
    if not prefix:
        raise bad("must not be empty")
    if len(prefix) > MAX_PREFIX_LENGTH:
        raise bad(f"at most {MAX_PREFIX_LENGTH} characters ({len(prefix)} given)")
    for ch in prefix:
        if ch in "{}":
            raise bad(f"must not contain {ch!r} (it would change the Redis Cluster hash tag)")
        if ch.isspace():
            raise bad("must not contain whitespace")
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn"):
            raise bad(f"must not contain control or unassigned characters ({ch!r})")
    return prefix


# -- clients -------------------------------------------------------------------------------


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def client_retries(client: RedisClient) -> int:
    """How many times ``client`` would resend a command on its own after a connection
    error or timeout (``-1``: forever). For a ``Redis`` client this mirrors how
    redis-py builds a connection's retry policy from the pool's connection settings;
    for a ``RedisCluster`` it is the cluster-level policy (its node connections never
    retry)."""
    if isinstance(client, RedisCluster):
        return int(client.retry.get_retries())
    single = getattr(client, "connection", None)
    if single is not None:
        return int(single.retry.get_retries())
    kwargs = client.connection_pool.connection_kwargs
    retry = kwargs.get("retry")
    if retry is not None:
        return int(retry.get_retries())
    if kwargs.get("retry_on_error") or kwargs.get("retry_on_timeout"):
        return 1  # redis-py then builds Retry(NoBackoff(), 1)
    return 0


def _client_options(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"retry": _no_retry(), "socket_timeout": DEFAULT_SOCKET_TIMEOUT_S,
            "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT_S, **driver_options(), **(extra or {})}


def _client_from_url(url: Any, extra: Mapping[str, Any] | None = None) -> Redis:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url: expected a redis:// URL string, got {url!r}", option="url", value=url)
    try:
        client = Redis.from_url(url, retry_on_error=[], **_client_options(extra))
    except (ValueError, TypeError, RedisError) as exc:
        if extra:
            raise options_refused(exc, extra, f"url {url!r}") from exc
        raise ConfigError(f"url: not a usable Redis URL ({exc}): {url!r}", option="url", value=url) from exc
    pool = client.connection_pool  # (no connection made yet: each will be of this class)
    pool.connection_class = direct_send(pool.connection_class)
    return client


def client_from_url(url: str, client_options: Mapping[str, Any] | None = None) -> Redis:
    """A ``redis.asyncio.Redis`` built as ``RedisKv(url=url, client_options=...)`` builds
    its own (no retries, the kv's socket timeouts, commands sent without a task each),
    to be given to several kvs as ``client=`` — e.g. the testkit's crash-matrix harness,
    whose incarnations share one (:mod:`botmesh_testkit.backends.redis`). No connection
    is made yet. A ``ConfigError`` for a bad URL or option, as the kv raises it."""
    return _client_from_url(url, check_client_options(client_options))


def _cluster_from_spec(cluster: Any, extra: Mapping[str, Any] | None = None) -> RedisCluster:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"cluster: {why}, got {cluster!r}", option="cluster", value=cluster)

    try:
        if isinstance(cluster, str):
            if not cluster:
                raise bad("expected a redis:// URL or a list of 'host:port' startup nodes")
            return RedisCluster.from_url(cluster, **_client_options(extra))
        if not isinstance(cluster, Sequence) or not cluster:
            raise bad("expected a redis:// URL or a non-empty list of 'host:port' startup nodes")
        nodes: list[ClusterNode] = []
        for node in cluster:
            if isinstance(node, str):
                host, sep, port = node.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise bad(f"a startup node is 'host:port', not {node!r}")
                nodes.append(ClusterNode(host, int(port)))
            elif isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], str) and isinstance(node[1], int):
                nodes.append(ClusterNode(node[0], node[1]))
            else:
                raise bad(f"a startup node is 'host:port' or (host, port), not {node!r}")
        return RedisCluster(startup_nodes=nodes, **_client_options(extra))
    except ConfigError:
        raise
    except (ValueError, TypeError, RedisError, RedisClusterException) as exc:
        if extra:
            raise options_refused(exc, extra, f"cluster {cluster!r}") from exc
        raise bad(f"cannot build a cluster client ({exc})") from exc


def _raise_swallowed_cancel(task: asyncio.Task[Any] | None, cancels: int, cause: BaseException | None) -> None:
    """Raise ``CancelledError`` when the current task was cancelled during a driver call
    that still returned (or raised another error): redis-py wraps socket writes in
    ``asyncio.wait_for``, which on Python 3.11 drops a cancellation that arrives as the
    write completes — the task would then never stop (a bot's ``stop()`` would wait for
    its sweep forever)."""
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError() from cause


def _float_arg(name: str, score: float | None) -> bytes:
    if score is None:
        return b""
    value = check_score(score, name)
    assert value is not None
    if math.isinf(value):
        return b"+inf" if value > 0 else b"-inf"
    return repr(value).encode("ascii")


def _decode_record(text: bytes | str, where: bytes, key: str) -> Versioned:
    """A stored ``{"version": n, "value": {...}}`` as a :class:`Versioned`; anything else
    (written by someone else under our keys) is a :class:`JournalCorruptError` naming the
    Redis key and the record key."""
    try:
        record = json.loads(text)
        value, version = record["value"], record["version"]
        if not isinstance(value, dict) or not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError("not a {version, value} record")
    except (ValueError, KeyError, TypeError) as exc:
        raise JournalCorruptError(
            f"malformed record {key!r} in {_s(where)!r}: {exc}", redis_key=_s(where), key=key
        ) from exc
    return Versioned(value, version)


class RedisKv(DurableKv):
    """A :class:`~botmesh.core.spi.DurableKv` in Redis (standalone or Cluster), keys
    under ``prefix`` (BACK-3; see the module docstring for the layout and the rules).

    Exactly one of:

    * ``client`` — an ``redis.asyncio.Redis`` or ``RedisCluster`` you own (never closed
      here). It must not retry commands by itself: build it with
      ``retry=Retry(NoBackoff(), 0)`` (a ``ConfigError`` naming ``client`` otherwise).
    * ``url`` — ``redis://[[user]:[password]@]host:port/db`` (or ``rediss://``,
      ``unix://``): a client of its own, without retries.
    * ``cluster`` — a Redis Cluster: a ``redis://host:port`` URL of one node or a list
      of ``"host:port"`` / ``(host, port)`` startup nodes; a ``RedisCluster`` of its
      own, without retries.

    ``prefix`` — see :func:`check_prefix`. ``logger`` — where driver errors are
    reported (``logger.error``); default ``logging.getLogger("botmesh.redis_store")``.
    ``auto_pipeline`` (default True) — on a standalone server, calls made while others
    are in flight go out together as one pipeline (one round trip), and on a client
    built from ``url`` calls skip redis-py's per-command machinery (retry wrapper,
    metrics hooks; see :mod:`botmesh.redis_store._pipeline`); False: a round trip per
    call through ``execute_command``. A ``RedisCluster`` never pipelines.
    ``client_options`` (only with ``url`` or ``cluster``) — more keyword arguments for the
    redis-py client the kv builds (``Redis.from_url`` / ``RedisCluster``), over its own
    (no retries, the socket timeouts, the driver's name): for example TLS settings, a
    ``protocol``, a ``client_name``, or ``driver_info=DriverInfo(name=None,
    lib_version=None)`` to send no ``CLIENT SETINFO`` on each new connection. Options in
    the URL's query string win over these. Options that make the client resend commands
    (``retry``, ``retry_on_error``, ``retry_on_timeout``, ``cluster_error_retry_attempts``)
    are refused; a bad one is a ``ConfigError`` naming ``client_options``.
    """

    capabilities = Capabilities(survives_crash=True, multi_process=True, multi_host=True, shared=True)

    def __init__(
        self,
        *,
        client: RedisClient | None = None,
        url: str | None = None,
        cluster: ClusterSpec | None = None,
        prefix: str = DEFAULT_PREFIX,
        logger: logging.Logger | None = None,
        auto_pipeline: bool = True,
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(auto_pipeline, bool):
            raise ConfigError(
                f"auto_pipeline: expected True or False, got {auto_pipeline!r}", option="auto_pipeline", value=auto_pipeline
            )
        given = [name for name, value in (("client", client), ("url", url), ("cluster", cluster)) if value is not None]
        if len(given) != 1:
            raise ConfigError(
                "exactly one of client=, url= or cluster= is required"
                + (f" (got {', '.join(given)})" if given else " (got none)"),
                option="client|url|cluster",
                value=given,
            )
        self._prefix = check_prefix(prefix)
        self._client_options = check_client_options(client_options)
        if self._client_options and client is not None:
            raise ConfigError("client_options: only for a client the kv builds (url= or cluster=), not with client=",
                              option="client_options", value=client_options)
        self._logger = logger if logger is not None else log
        self._url = url
        self._cluster = cluster
        self._owns_client = client is None
        if client is not None:
            if not isinstance(client, (Redis, RedisCluster)):
                raise ConfigError(
                    f"client: expected a redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster, "
                    f"got {type(client).__name__}",
                    option="client",
                    value=client,
                )
            retries = client_retries(client)
            if retries != 0:
                raise ConfigError(
                    f"client: it retries commands by itself ({'forever' if retries < 0 else f'{retries} times'}); "
                    "a resent write may apply twice (a landed compare-and-set replayed becomes a false conflict). "
                    "Build it with retry=Retry(NoBackoff(), 0) and retry_on_error=[] (for a RedisCluster: "
                    "retry=Retry(NoBackoff(), 0)), or pass url= / cluster= instead",
                    option="client",
                    value=client,
                )
        self._client: RedisClient | None = client if client is not None else self._new_client()
        if self._client_options and isinstance(self._client, Redis):
            check_connection_options(self._client, self._client_options)
        self._scripts = self._register(self._client)
        self._pipeline = AutoPipeline(lambda: cast(Redis, self._live_client()), self._script_source) if auto_pipeline else None
        self._state = _NEW
        self._ready_cluster: RedisCluster | None = None
        self._cluster_lock = asyncio.Lock()

    # -- properties ----------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """The key prefix (``<prefix>:{durable:<space>:<scope>}:...``)."""
        return self._prefix

    @property
    def owns_client(self) -> bool:
        """Whether the client was built here (from ``url``/``cluster``) and is closed by
        :meth:`close`; False for an injected ``client``."""
        return self._owns_client

    @property
    def client(self) -> RedisClient | None:
        """The client in use (``None`` while an own client is closed)."""
        return self._client

    def __repr__(self) -> str:
        where = "client" if not self._owns_client else ("cluster" if self._cluster is not None else "url")
        return f"RedisKv({where}, prefix={self._prefix!r}, state={self._state})"

    def keys_of(self, scope: str, space: str) -> dict[str, bytes]:
        """The Redis keys of ``(scope, space)`` (see :func:`scope_keys`)."""
        return scope_keys(self._prefix, scope, space)

    # -- lifecycle -----------------------------------------------------------------------

    def _new_client(self) -> RedisClient:
        if self._cluster is not None:
            return _cluster_from_spec(self._cluster, self._client_options)
        return _client_from_url(self._url, self._client_options)

    @staticmethod
    def _register(client: RedisClient) -> dict[str, Any]:
        return {
            "put": client.register_script(PUT),
            "delete": client.register_script(DELETE),
            "scan": client.register_script(SCAN),
            "ranges": client.register_script(RANGES),
        }

    async def open(self) -> None:
        """Make the kv usable. Idempotent; after :meth:`close` (or :meth:`abandon`) an
        own client is built again. Connections are made on the first call."""
        if self._client is None:
            self._client = self._new_client()
            self._scripts = self._register(self._client)
            self._cluster_lock = asyncio.Lock()
        self._state = _OPEN

    async def close(self) -> None:
        """Close an own client (an injected one is left open). Idempotent. Later calls
        raise ``BackendUnavailableError`` until :meth:`open`."""
        self._state = _CLOSED
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            try:
                await client.aclose()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection is not an error of the caller
                self._logger.warning("redis: closing the client of prefix %r failed: %r", self._prefix, exc)

    def abandon(self) -> asyncio.Task[None] | None:
        """Let the kv go as a dead process would: every later call raises
        ``BackendUnavailableError``; an own client's connections are dropped (closed
        without any further command to the server — nothing is flushed, because nothing
        is buffered client-side). Returns the task doing the drop when an event loop
        runs (await it to be sure the sockets are closed), else None."""
        self._state = _CLOSED
        if not self._owns_client or self._client is None:
            return None
        client, self._client = self._client, None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            _close_sockets_now(client)
            return None
        task = loop.create_task(self._drop(client))
        _DROPS.add(task)
        task.add_done_callback(_DROPS.discard)
        return task

    async def _drop(self, client: RedisClient) -> None:
        try:
            await client.aclose()
        except Exception:  # noqa: BLE001, S110 - a dead process's sockets just vanish
            pass

    def _script_source(self, sha: bytes | str) -> str | None:
        for script in self._scripts.values():
            if script.sha == _s(sha):
                return cast(str, script.script)
        return None

    def _command(self, *command: Any) -> Callable[[RedisClient, dict[str, Any]], Awaitable[Any]]:
        """What :meth:`_call` runs for one command: auto-pipelined on a standalone client,
        else directly (``EVALSHA`` by script name: redis-py's ``Script``)."""

        def run(client: RedisClient, scripts: dict[str, Any]) -> Awaitable[Any]:
            if command[0] == "EVALSHA":
                script, keys, args = scripts[command[1]], command[2], command[3]
                if self._pipeline is not None and isinstance(client, Redis):
                    return self._pipeline.call("EVALSHA", script.sha, len(keys), *keys, *args)
                return cast(Awaitable[Any], script(keys=keys, args=args))
            if self._pipeline is not None and isinstance(client, Redis):
                return self._pipeline.call(*command)
            return cast(Awaitable[Any], client.execute_command(*command))

        return run

    def _live_client(self) -> RedisClient:
        if self._state == _CLOSED or self._client is None:
            state = "not open yet (call open() first)" if self._state == _NEW else "closed"
            raise BackendUnavailableError(f"RedisKv (prefix {self._prefix!r}) is {state}", prefix=self._prefix)
        return self._client

    async def _initialize_cluster(self, client: RedisCluster) -> None:
        """Load the cluster's slot map once, before the first command, with the other
        first calls waiting: redis-py initializes a ``RedisCluster`` lazily, and concurrent
        first commands racing that initialization can find their connections closed
        under them (seen with 50 concurrent first writes)."""
        async with self._cluster_lock:
            if client is not self._ready_cluster:
                await client.initialize()
                self._ready_cluster = client

    async def _call(self, op: str, fn: Callable[[RedisClient, dict[str, Any]], Awaitable[T]]) -> T:
        """Run ``fn(client, scripts)``, translating every driver error into
        ``BackendUnavailableError`` (reported to the logger)."""
        client = self._live_client()
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            if isinstance(client, RedisCluster) and client is not self._ready_cluster:
                await self._initialize_cluster(client)
            result = await fn(client, self._scripts)
        except _DRIVER_ERRORS as exc:
            _raise_swallowed_cancel(task, cancels, exc)
            self._logger.error("redis: %s failed (prefix %r): %s: %s", op, self._prefix, type(exc).__name__, exc)
            raise BackendUnavailableError(
                f"redis {op} failed (prefix {self._prefix!r}): {type(exc).__name__}: {exc}",
                prefix=self._prefix,
                operation=op,
            ) from exc
        _raise_swallowed_cancel(task, cancels, None)
        return result

    async def durability_settings(self) -> dict[str, str]:
        """``{"kind": "redis", "appendonly": ..., "appendfsync": ...}`` read with
        ``CONFIG GET`` from the server this kv writes to — on a Cluster from every
        primary (one value when they agree, else ``"<value> on <node>, ..."``). A server
        that refuses ``CONFIG`` (renamed away or denied by an ACL, as managed services
        do) leaves the two keys out and says why under ``"unreadable"``: the claim then
        cannot be verified from here. Other driver errors raise
        ``BackendUnavailableError``."""

        async def read(client: RedisClient, _: dict[str, Any]) -> dict[str, str]:
            if isinstance(client, RedisCluster):
                nodes: list[tuple[str, ClusterNode | None]] = [(n.name, n) for n in client.get_primaries()]
            else:
                nodes = [("", None)]
            values: dict[str, list[tuple[str, str]]] = {name: [] for name in _PERSISTENCE_SETTINGS}
            try:
                for where, node in nodes:
                    for name in _PERSISTENCE_SETTINGS:
                        if node is None:
                            answer = await client.config_get(name)
                        else:
                            answer = await cast(RedisCluster, client).config_get(name, target_nodes=node)
                        got = {_text(k): _text(v) for k, v in dict(answer).items()}
                        if name in got:
                            values[name].append((where, got[name]))
            except ResponseError as exc:  # CONFIG renamed or not permitted: not an outage
                return {"kind": "redis", "unreadable": f"CONFIG GET refused: {exc}"}
            found = {"kind": "redis"}
            for name, seen in values.items():
                if not seen:
                    continue
                distinct = {value for _, value in seen}
                found[name] = seen[0][1] if len(distinct) == 1 else ", ".join(f"{v} on {w}" for w, v in seen)
            return found

        return await self._call("durability settings", read)

    # -- DurableKv -----------------------------------------------------------------------

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        """The record at ``(scope, space, key)`` with its version, or ``None`` (one
        ``HGET``)."""
        check_record(scope, space, key)
        keys = self.keys_of(scope, space)
        raw = await self._call("get", self._command("HGET", keys["records"], _b(key)))
        return None if raw is None else _decode_record(raw, keys["records"], key)

    async def put(
        self,
        scope: str,
        space: str,
        key: str,
        value: dict[str, Any],
        *,
        expected_version: int,
        due: float | None = None,
        expires: float | None = None,
    ) -> int:
        """Compare-and-set (see :meth:`DurableKv.put`), record and both index entries in
        one Lua script."""
        due, expires = check_put(scope, space, key, expected_version, due, expires)
        text = encode_checked(check_json_object(value))
        keys = self.keys_of(scope, space)
        args = [_b(key), str(int(expected_version)).encode(), text.encode("ascii"), _float_arg("due", due),
                _float_arg("expires", expires)]
        reply = await self._call(
            "put", self._command("EVALSHA", "put", [keys["records"], keys["due"], keys["expires"], keys["keys"]], args)
        )
        if not reply[0]:
            raise _conflict(reply, keys["records"], space, key, expected_version)
        return int(reply[1])

    async def delete(self, scope: str, space: str, key: str, *, expected_version: int) -> None:
        """Remove the record at version ``expected_version`` and its index entries, in
        one Lua script; ``VersionConflict`` when absent or at another version."""
        check_delete(scope, space, key, expected_version)
        keys = self.keys_of(scope, space)
        args = [_b(key), str(int(expected_version)).encode()]
        reply = await self._call(
            "delete",
            self._command("EVALSHA", "delete", [keys["records"], keys["due"], keys["expires"], keys["keys"]], args),
        )
        if not reply[0]:
            raise _conflict(reply, keys["records"], space, key, expected_version)

    async def range(
        self, scope: str, space: str, index: IndexName, *, upto: float, limit: int
    ) -> list[tuple[float, str]]:
        """Up to ``limit`` entries ``(score, key)`` of ``index`` with ``score <= upto``,
        ascending by ``(score, key)`` (one ``ZRANGEBYSCORE``; Redis orders equal scores by
        member bytes, i.e. by code point; standalone: the ``ranges`` script, pipelined)."""
        upper = check_range(scope, space, upto)
        keys = self.keys_of(scope, space)
        name = keys[check_index(index)]  # ValueError for an unknown name
        top = "+inf" if upper == math.inf else ("-inf" if upper == -math.inf else repr(upper))
        exact = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
        if exact and self._pipeline is not None and isinstance(self._live_client(), Redis):
            (flat,) = await self._call("range", self._command("EVALSHA", "ranges", [name], [top, str(limit)]))
            return [(float(flat[i + 1]), _s(flat[i])) for i in range(0, len(flat), 2)]
        rows = await self._call(
            "range",
            lambda c, _: c.zrangebyscore(
                name, "-inf", top, start=0 if exact else None, num=limit if exact else None, withscores=True
            ),
        )
        result = [(float(score), _s(member)) for member, score in cast(list[tuple[bytes, float]], rows)]
        return result if exact else result[:limit]

    async def ranges(
        self, scope: str, reads: Sequence[tuple[str, IndexName]], *, upto: float, limit: int
    ) -> list[list[tuple[float, str]]]:
        """Several range reads in one round trip on a standalone server: one script runs
        their ``ZRANGEBYSCORE`` commands (scores as Redis prints them, as
        :meth:`range` reads them). On a Cluster — the reads' keys are in different hash
        slots — or with a ``limit`` Redis cannot take, :meth:`range` for each read in
        turn."""
        exact = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
        if not exact or isinstance(self._live_client(), RedisCluster):
            return await super().ranges(scope, reads, upto=upto, limit=limit)
        names = []
        upper = math.inf
        for space, index in reads:
            upper = check_range(scope, space, upto)
            names.append(self.keys_of(scope, space)[check_index(index)])  # ValueError for an unknown name
        if not names:
            return []
        top = "+inf" if upper == math.inf else ("-inf" if upper == -math.inf else repr(upper))
        args = [top, str(limit)]
        replies = await self._call("range", self._command("EVALSHA", "ranges", names, args))
        return [[(float(flat[i + 1]), _s(flat[i])) for i in range(0, len(flat), 2)] for flat in replies]

    async def scan(
        self, scope: str, space: str, *, after: str | None = None, limit: int = 100
    ) -> list[tuple[str, Versioned]]:
        """Up to ``limit`` records with key ``> after`` (all when ``after`` is None),
        ascending by key in code-point order (``ZRANGEBYLEX`` on UTF-8 bytes), keys and
        values read by one script."""
        after = check_scan(scope, space, after)
        keys = self.keys_of(scope, space)
        low = b"-" if after is None else b"(" + _b(after)
        exact = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
        args = [low, str(limit if exact else -1).encode()]
        flat = await self._call("scan", self._command("EVALSHA", "scan", [keys["records"], keys["keys"]], args))
        result = [(_s(flat[i]), _decode_record(flat[i + 1], keys["records"], _s(flat[i]))) for i in range(0, len(flat), 2)]
        return result if exact else result[:limit]


def _conflict(reply: list[Any], records: bytes, space: str, key: str, expected: int) -> VersionConflict:
    """The ``VersionConflict`` of a write script's ``{0, version[, record]}`` reply."""
    found = int(reply[1])
    current: Versioned | None = None
    if len(reply) > 2:
        try:
            current = _decode_record(reply[2], records, key)
        except JournalCorruptError:  # a write reports the conflict; a get reports the damage
            current = None
        if current is not None and current.version != found:
            current = None
    return VersionConflict.at(space, key, expected, found, current)


def _close_sockets_now(client: RedisClient) -> None:
    """Close every socket of ``client`` without awaiting anything — what redis-py itself
    does when it disconnects outside a task. Used by :meth:`RedisKv.abandon` when no
    event loop runs (the loop closes the transports when it runs next). It reaches into
    redis-py's pools (``_available_connections``/``_in_use_connections`` of a pool,
    ``_connections`` of a cluster node, each connection's ``_close()``); should those
    names change, nothing is closed and the sockets are only released at garbage
    collection (with a ``ResourceWarning``), which changes nothing of what the server
    holds. For a ``RedisCluster`` the client is also marked closed as ``aclose()``
    does."""
    connections: list[Any] = []
    if isinstance(client, RedisCluster):
        manager = client.nodes_manager
        for cache in (getattr(manager, "nodes_cache", {}), getattr(manager, "startup_nodes", {})):
            for node in cache.values():
                connections.extend(getattr(node, "_connections", ()))
        if hasattr(client, "_initialize"):
            client._initialize = True  # what aclose() sets: the client is no longer in use
    else:
        pool = client.connection_pool
        connections.extend(getattr(pool, "_available_connections", ()))
        connections.extend(getattr(pool, "_in_use_connections", ()))
        single = getattr(client, "connection", None)
        if single is not None:
            connections.append(single)
    for connection in connections:
        close = getattr(connection, "_close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001, S110 - a dead process's sockets just vanish
                pass


_DROPS: set[asyncio.Task[None]] = set()
"""Connection drops of abandoned kvs still running (kept referenced until done)."""
