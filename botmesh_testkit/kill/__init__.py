"""Real process death: kill loops, poison messages and replica failover (TEST-4,
GUAR-1..7, INB-7, OUT-14, LEASE-2, REPL-1..3).

The crash matrix simulates deaths inside one process; this module kills real child
processes with ``SIGKILL`` (and freezes them with ``SIGSTOP``) and judges what the
outside world saw.

* A **child** is a process (``multiprocess``, ``forkserver`` context by default, or
  ``spawn``; never ``fork``) running a :class:`~botmesh.core.Bot` on the real clock over
  a durable backend described by a small picklable **spec** and built inside the child
  by :func:`build_backend`::

      ("file", path, append_log[, fsync])     ("sqlite", path)
      ("postgres", url, table_prefix)         ("redis", url, prefix)
      ("memory",)                             ("factory", "pkg.mod:fn" or callable, *args)

  Its handler is the test's own ``async def handler(ctx)`` (a closure is fine: dill
  pickles it). Its provider appends every accepted send to a **delivery ledger** outside
  the child (one JSON line, ``write`` + ``fsync`` before ``send`` returns: the channel
  accepted it) with the outbox key being sent, the chat, the text, the pid and the
  incarnation.
* The parent feeds inbound messages through a pipe; the child acknowledges each one
  after ``deliver`` returned (journaled and processed); like a webhook, the parent
  redelivers every unacknowledged message to the next incarnation.
* The child writes **markers** to the pipe before and after each journal write, each
  provider send and each handler run. ``stop_at=n`` makes a child freeze on its n-th
  marker, so the parent kills it at an exact point (``after provider.send m7:1``: the
  channel has it, the outbox does not know); other kills land after a random delay.
* :class:`KillLoop` kills and restarts one ``instance_id`` K times at seeded moments,
  lets the last incarnation drain, then :func:`judge` checks the history with the rules
  of the crash matrix's checker (:func:`botmesh_testkit.checker.history.check`): every admitted
  inbound done or in the DLQ as the rules allow (INB-7), ``skip`` never duplicates and
  every missing send is an ``unknown`` record, ``resend`` never loses and every duplicate
  has a ``durability:ambiguous`` event, fencing tokens only grow (LEASE-2).
* :class:`Replicas` drives several children on one shared backend by hand: freeze one,
  let another take its leases, thaw it and read its ``stale_leases``.

A kill test in a few lines (the ``botmesh_kill_loop`` fixture of
:mod:`botmesh_testkit.pytest.kill_plugin` builds a :class:`KillLoop` in ``tmp_path``)::

    async def handler(ctx):
        await ctx.reply(f"echo {ctx.text}")

    @pytest.mark.botmesh_kill(kills=20, messages=40)
    def test_my_backend_survives_sigkill(botmesh_kill_loop):
        result = botmesh_kill_loop(("factory", "my_pkg.backend:make", "/tmp/x"), handler,
                                   on_ambiguous="resend", seed=7).run()
        result.assert_ok()          # prints kills, deliveries, duplicates, losses ...

or without pytest: ``KillLoop(("sqlite", "/tmp/bot.db"), handler, kills=20).run()``, or
from a shell with a built-in handler: ``python -m botmesh_testkit.kill --backend sqlite
--kills 20 --messages 40 --seed 7``.

Inside the child, :func:`child` tells a handler which child it runs in (name,
incarnation, pid), :func:`marker` writes a marker of its own and :func:`hold` blocks
the child's event loop for a while after a marker: a safe point at which to freeze it
(no journal write in flight, no heartbeat can run).

Limits, on purpose:

* Fencing refuses a stale *completion*; it cannot recall a provider call already under
  way. A replica frozen inside ``provider.send`` past its lease may deliver after it is
  thawed, while the new owner resolved the send as ambiguous: freeze at a safe point.
* The order of replies *across* inbound messages of one chat is not judged (a message
  recovered by the sweep may be answered after a newer one the channel redelivered);
  the sends of one handler (``<id>:1``, ``<id>:2`` ...) must keep their order (OUT-11).
* The child's clock is real: kill loops use short leases, poll and backoff (see
  :class:`KillLoop`), so each cycle takes tens of milliseconds with ``forkserver``.
  ``multiprocess``'s forkserver helper process lives as long as the parent; it is not
  one of the children checked for strays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from botmesh.core.backend import READ_OPS, WRITE_OPS, DurabilityBackend
from botmesh.core.engine import derive_scope
from botmesh.core.provider import Content, InboundEvent, Provider, ProviderError
from botmesh.core.records import InboxRecord, OutboxRecord

from ..checker.violation import Violation

_T = TypeVar("_T")

__all__ = [
    "BackendSpec",
    "Built",
    "ChildInfo",
    "Delivery",
    "HarnessError",
    "KillLoop",
    "KillOracle",
    "KillResult",
    "Replicas",
    "Violation",
    "build_backend",
    "child",
    "hold",
    "judge",
    "marker",
    "read_journal",
    "replies",
]

BackendSpec = tuple[Any, ...]
POLICIES = ("skip", "resend")
SCOPE = derive_scope(None, None, "bot", "default")
"""The scope of the children's bots (default ``bot_id``/``connection_id``)."""

COUNTED_OPS = frozenset(op for op in WRITE_OPS if not op.endswith((".heartbeat", ".purge"))) | {
    "provider.send", "handler"}
"""Markers that count towards ``stop_at`` (heartbeats and purges run on timers: they would
make the n-th marker depend on timing)."""


class HarnessError(RuntimeError):
    """The harness itself could not run (a child crashed with a traceback, could not be
    pickled, did not start): not a verdict on the backend."""


# =========================================================================================
# Backends from specs (built inside the child, and by the parent to read the final journal)
# =========================================================================================
@dataclass
class Built:
    """A backend built from a spec: the durability backend, the bot's store, and what to
    call when done (close files, pools)."""

    backend: DurabilityBackend
    store: Any
    close: Callable[[], Awaitable[None]] | None = None


def _import(target: str) -> Any:
    import importlib

    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"factory {target!r}: expected 'pkg.module:function'")
    return getattr(importlib.import_module(module), attr)


async def build_backend(spec: BackendSpec) -> Built:
    """Build the backend a spec describes (see the module docstring). A ``("factory",
    fn, *args)`` spec calls ``fn(*args)`` (awaited when it returns an awaitable), which
    returns a ``DurabilityBackend``, a ``DurableKv`` (wrapped in ``KvDurability``) or a
    :class:`Built`. PostgreSQL and Redis are imported only when asked for."""
    from botmesh.core.spi import DurableKv, KvDurability, MemoryDurability
    from botmesh.core.store import MemoryStore

    kind = spec[0]
    if kind == "memory":
        return Built(MemoryDurability(), MemoryStore())
    if kind == "file":
        from botmesh.core.file_backend import FileDurability

        path = spec[1]
        append_log = bool(spec[2]) if len(spec) > 2 else False
        fsync = bool(spec[3]) if len(spec) > 3 else True
        fd = await FileDurability.open(path, append_log=append_log, fsync=fsync)
        return Built(fd, MemoryStore(), fd.close)
    if kind == "sqlite":
        from botmesh.sqlite_store import SQLiteStore

        store = SQLiteStore(file=spec[1])
        await store.open()
        return Built(store.durability(), store, store.close)
    if kind == "postgres":
        try:
            from botmesh.postgres_store import PostgresDurability
        except ImportError as exc:  # pragma: no cover - arrives with another issue
            raise HarnessError(f"backend spec {spec!r}: botmesh.postgres_store is not available ({exc})") from None
        url = spec[1]
        prefix = spec[2] if len(spec) > 2 else "botmesh_"
        return Built(_construct(PostgresDurability, url, ("connection_string", "url", "dsn"), table_prefix=prefix),
                     MemoryStore())
    if kind == "redis":
        try:
            from botmesh.redis_store import RedisDurability
        except ImportError as exc:  # pragma: no cover - arrives with another issue
            raise HarnessError(f"backend spec {spec!r}: botmesh.redis_store is not available ({exc})") from None
        url = spec[1]
        prefix = spec[2] if len(spec) > 2 else "botmesh"
        return Built(_construct(RedisDurability, url, ("url",), prefix=prefix), MemoryStore())
    if kind == "factory":
        fn = _import(spec[1]) if isinstance(spec[1], str) else spec[1]
        made = fn(*spec[2:])
        if asyncio.iscoroutine(made) or isinstance(made, Awaitable):
            made = await made
        if isinstance(made, Built):
            return made
        if isinstance(made, DurableKv):
            return Built(KvDurability(made, own_kv=True, name=getattr(fn, "__name__", "factory")), MemoryStore())
        if isinstance(made, DurabilityBackend):
            close = getattr(made, "close", None)
            return Built(made, MemoryStore(), close if callable(close) else None)
        raise HarnessError(f"backend factory {spec[1]!r} returned {type(made).__name__}; expected a "
                           "DurabilityBackend, a DurableKv or a kill.Built")
    raise HarnessError(f"unknown backend spec {spec!r}: expected file, sqlite, postgres, redis, memory or factory")


def _construct(cls: Any, url: str, url_names: tuple[str, ...], **kwargs: Any) -> Any:
    """``cls(<url>, **kwargs)`` with the url passed under the first of ``url_names`` the
    constructor accepts (keyword-only constructors), else positionally."""
    import inspect

    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    for name in url_names:
        if name in params:
            return cls(**{name: url}, **kwargs)
    return cls(url, **kwargs)


def spec_name(spec: BackendSpec) -> str:
    """A short name for reports: ``file+log``, ``sqlite``, ``factory:LazyKv`` ..."""
    kind = spec[0]
    if kind == "file":
        return "file+log" if len(spec) > 2 and spec[2] else "file"
    if kind == "factory":
        target = spec[1]
        return f"factory:{target if isinstance(target, str) else _callable_repr(target)}"
    return str(kind)


def _callable_repr(fn: Any) -> str:
    if fn is None or isinstance(fn, replies):
        return repr(fn)
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if name and module else repr(fn)


def _spec_repr(spec: BackendSpec) -> str:
    """The spec for a report: callables by name, server URLs without their password."""
    from ..servers import redact_url

    def one(x: Any) -> str:
        if callable(x):
            return _callable_repr(x)
        if isinstance(x, str) and "://" in x:
            return repr(redact_url(x))
        return repr(x)

    return "(" + ", ".join(one(x) for x in spec) + ("," if len(spec) == 1 else "") + ")"


async def read_journal(spec: BackendSpec, scope: str = SCOPE) -> tuple[list[InboxRecord], list[OutboxRecord]]:
    """Every inbox and outbox record of ``scope`` as stored (no child may hold the
    backend: call it after the last child stopped or died)."""
    built = await build_backend(spec)
    try:
        await built.backend.start()
        try:
            inbox = list(await built.backend.inbox_list(scope, limit=1_000_000))
            outbox = list(await built.backend.outbox_list(scope, limit=1_000_000))
        finally:
            await built.backend.stop()
    finally:
        if built.close is not None:
            await built.close()
    return inbox, outbox


def _run_coro(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion from synchronous code, also when this thread already
    runs an event loop (an async test calling :meth:`KillLoop.run`): then in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="botmesh-kill-journal")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return cast(_T, box.get("value"))


# =========================================================================================
# Handlers
# =========================================================================================
class replies:  # noqa: N801 - used like a function: replies(2)
    """A built-in handler: ``n`` replies ``"<text>/reply <i>"`` per message (optionally
    sleeping ``sleep_ms`` between them, in the middle of the handler). Being a plain
    class, a kill loop using it can be reproduced from a shell
    (``python -m botmesh_testkit.kill --replies N``)."""

    def __init__(self, n: int = 2, sleep_ms: float = 0.0) -> None:
        self.n = n
        self.sleep_ms = sleep_ms

    async def __call__(self, ctx: Any) -> None:
        for i in range(1, self.n + 1):
            if self.sleep_ms and i > 1:
                await asyncio.sleep(self.sleep_ms / 1000.0)
            await ctx.reply(f"{ctx.text}/reply {i}")

    def __repr__(self) -> str:
        return f"replies({self.n}{f', sleep_ms={self.sleep_ms}' if self.sleep_ms else ''})"


# =========================================================================================
# The child process
# =========================================================================================
@dataclass
class ChildInfo:
    """Who the current child is (:func:`child`)."""

    name: str
    n: int
    """Incarnation number, 1-based, over the whole run (all names)."""
    pid: int
    instance_id: str
    workdir: str


@dataclass
class ChildConfig:
    """Everything a child needs; pickled (with dill) into it."""

    name: str
    n: int
    instance_id: str
    spec: BackendSpec
    handler: Any
    setup: Any
    durability: dict[str, Any]
    ledger_path: str
    log_path: str
    workdir: str
    stop_at: int | None = None
    concurrency: int = 1
    fail_rate: float = 0.0
    seed: int = 0
    text_limit: int | None = None


_CHILD: ChildInfo | None = None
_MARKERS: _Markers | None = None


def child() -> ChildInfo | None:
    """Inside a child: who it is (None in any other process)."""
    return _CHILD


def marker(label: str, detail: Any = None) -> None:
    """Inside a child: write a marker ``("mark", label)`` the parent can wait for (it
    counts towards ``stop_at``). Does nothing outside a child."""
    if _MARKERS is not None:
        _MARKERS.mark("at", "mark", label, detail)


def hold(seconds: float, label: str = "hold") -> None:
    """Inside a child: write a marker, then block the whole child (its event loop too)
    for ``seconds``: no journal write is in flight and no heartbeat runs, the safe
    moment for the parent to ``SIGSTOP`` it. Blocks outside a child too."""
    marker(label)
    time.sleep(seconds)


class _Markers:
    """Progress markers to the parent. The marker whose count equals ``stop_at`` freezes
    the child (it waits to be killed)."""

    def __init__(self, conn: Any, stop_at: int | None) -> None:
        self.conn = conn
        self.stop_at = stop_at
        self.count = 0
        self.lock = threading.Lock()

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                os._exit(3)  # the parent is gone: never outlive it

    def mark(self, when: str, op: str, ident: Any, info: Any = None) -> None:
        seq = None
        if op in COUNTED_OPS or op == "mark":
            self.count += 1
            seq = self.count
        self.send(("mk", seq, when, op, ident, info, time.monotonic()))
        if seq is not None and seq == self.stop_at:
            self.freeze()

    def freeze(self) -> None:
        """Wait here, the event loop blocked, for the parent's SIGKILL."""
        while True:
            try:
                if self.conn.poll(1.0):
                    self.conn.recv()  # inbound fed meanwhile: never acknowledged, redelivered
            except (EOFError, OSError):
                os._exit(3)


def _ident(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not args:
        return None
    first = args[0]
    if isinstance(first, InboxRecord):
        return first.id
    if isinstance(first, OutboxRecord):
        return first.key
    return first if isinstance(first, str) else None


def _info(op: str, kwargs: dict[str, Any], result: Any) -> dict[str, Any]:
    info: dict[str, Any] = {}
    if "token" in kwargs:
        info["token"] = kwargs["token"]
    if op.endswith(".journal") and isinstance(result, tuple):
        rec, created = result
        info.update(created=created, token=rec.token, state=rec.state)
    elif op == "inbox.claim":
        info["claimed"] = result.token if result is not None else None
        if result is not None:
            info["attempts"] = result.attempts
    elif op == "outbox.claim":
        info["claimed"] = result[0].token if result is not None else None
        if result is not None:
            info["previous"] = result[1]
    elif isinstance(result, bool):
        info["ok"] = result
    elif isinstance(result, InboxRecord):
        info["token"] = result.token
    return info


class MarkedBackend(DurabilityBackend):
    """Wraps the child's backend: a marker before and after each write, and the outbox
    key in flight per chat (so the ledger can name the key of each delivery)."""

    def __init__(self, inner: DurabilityBackend, markers: _Markers, sending: dict[str, tuple[str, Any]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.markers = markers
        self.sending = sending

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def _track(self, op: str, result: Any) -> None:
        rec: OutboxRecord | None = None
        if op == "outbox.journal" and isinstance(result, tuple) and result[1] and result[0].state == "sending":
            rec = result[0]
        elif op == "outbox.claim" and result is not None:
            rec = result[0]
        if rec is not None:
            self.sending[rec.chat_id] = (rec.key, rec.content.get("text"))


def _write_op(op: str, method: str) -> Any:
    async def call(self: MarkedBackend, scope: str, *args: Any, **kwargs: Any) -> Any:
        ident = _ident(method, args, kwargs)
        self.markers.mark("before", op, ident, {"token": kwargs["token"]} if "token" in kwargs else None)
        try:
            result = await getattr(self.inner, method)(scope, *args, **kwargs)
        except Exception as exc:
            self.markers.mark("raised", op, ident, {"error": repr(exc)})
            raise
        self._track(op, result)
        self.markers.mark("after", op, ident, _info(op, kwargs, result))
        return result

    call.__name__ = method
    return call


def _read_op(method: str) -> Any:
    async def call(self: MarkedBackend, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = method
    return call


for _op, _method in WRITE_OPS.items():
    setattr(MarkedBackend, _method, _write_op(_op, _method))
for _method in READ_OPS.values():
    setattr(MarkedBackend, _method, _read_op(_method))
MarkedBackend.__abstractmethods__ = frozenset()


class LedgerProvider(Provider):
    """The child's channel: each accepted send is one JSON line appended to the ledger
    and fsync'ed before ``send`` returns. ``fail_rate`` makes a share of the sends fail
    (retryable) before they reach the ledger."""

    name = "ledger"

    def __init__(self, cfg: ChildConfig, markers: _Markers, sending: dict[str, tuple[str, Any]]) -> None:
        super().__init__()
        self.cfg = cfg
        self.markers = markers
        self.sending = sending
        self.text_limit = cfg.text_limit
        self.rng = random.Random(f"{cfg.seed}/{cfg.n}")
        self.seq = 0
        self.fd = os.open(cfg.ledger_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        dfd = os.open(os.path.dirname(cfg.ledger_path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    async def send(self, chat_id: str, content: Content) -> str:
        entry = self.sending.get(chat_id)
        text = content.get("text")
        key = entry[0] if entry is not None and entry[1] == text else None
        self.markers.mark("before", "provider.send", key)
        if self.cfg.fail_rate and self.rng.random() < self.cfg.fail_rate:
            self.markers.mark("raised", "provider.send", key, {"error": "injected 503"})
            raise ProviderError("injected 503 from the channel", retryable=True)
        self.seq += 1
        line = json.dumps({"key": key, "chat": chat_id, "text": text, "name": self.cfg.name, "n": self.cfg.n,
                           "pid": os.getpid(), "seq": self.seq, "t": time.monotonic()}, separators=(",", ":"))
        os.write(self.fd, (line + "\n").encode())
        os.fsync(self.fd)
        self.markers.mark("after", "provider.send", key)
        return f"{self.cfg.name}.{self.cfg.n}.{self.seq}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _dumps(cfg: ChildConfig) -> bytes:
    """Pickle a child's configuration with dill, closures by value *with only the globals
    they use* (``recurse``): the child then need not import the module that defined the
    handler (a test module importing pytest would cost every restart ~0.4 s)."""
    import io

    buf = io.BytesIO()
    _child_pickler()(buf, recurse=True).dump(cfg)
    return buf.getvalue()


_PICKLER: Any = None


def _child_pickler() -> Any:
    """A dill pickler that saves every module by reference (dill saves a module that is
    not in the standard library with its whole ``__dict__``: a handler using
    ``botmesh_testkit.kill`` would drag pytest's capture objects along)."""
    global _PICKLER
    if _PICKLER is None:
        import importlib
        import types

        import dill
        from dill._dill import MetaCatchingDict

        class ChildPickler(dill.Pickler):  # type: ignore[misc]
            dispatch = MetaCatchingDict(dill.Pickler.dispatch.copy())

        def save_module(pickler: Any, obj: types.ModuleType) -> None:
            pickler.save_reduce(importlib.import_module, (obj.__name__,), obj=obj)

        ChildPickler.dispatch[types.ModuleType] = save_module
        _PICKLER = ChildPickler
    return _PICKLER


def _child_entry(blob: bytes, log_path: str, conn: Any) -> None:
    """The child's main: stdout/stderr go to its own log file (the parent shows its tail
    when the child crashes), then the bot runs until told to stop."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        import dill

        cfg: ChildConfig = dill.loads(blob)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in a terminal is for the parent
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{cfg.name}#{cfg.n} pid {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_child_main(cfg, conn))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _child_main(cfg: ChildConfig, conn: Any) -> None:
    global _CHILD, _MARKERS
    from botmesh.core.bot import Bot
    from botmesh.core.clock import RealClock

    loop = asyncio.get_running_loop()
    _CHILD = ChildInfo(cfg.name, cfg.n, os.getpid(), cfg.instance_id, cfg.workdir)
    markers = _MARKERS = _Markers(conn, cfg.stop_at)
    sending: dict[str, tuple[str, Any]] = {}
    built = await build_backend(cfg.spec)
    # MarkedBackend's operations are installed by setattr (and __abstractmethods__
    # cleared), which mypy cannot see
    backend = MarkedBackend(built.backend, markers, sending)  # type: ignore[abstract]
    provider = LedgerProvider(cfg, markers, sending)
    options = dict(cfg.durability)
    options.update(backend=backend, instance_id=cfg.instance_id)
    bot = Bot(provider, built.store, options, clock=RealClock(), rng=random.Random(f"{cfg.seed}/{cfg.n}"))
    if cfg.setup is not None:
        cfg.setup(bot)
    if cfg.handler is not None:
        handler = cfg.handler

        async def handle(ctx: Any) -> None:
            markers.mark("before", "handler", ctx.record_id)
            await handler(ctx)
            markers.mark("after", "handler", ctx.record_id)

        bot.otherwise(handle)
    def listener(name: str) -> Callable[[dict[str, Any]], None]:
        def on(payload: dict[str, Any]) -> None:
            markers.send(("ev", name, _jsonable(payload), time.monotonic()))

        return on

    for name in ("error", "durability:dead", "durability:ambiguous"):
        bot.on(name, listener(name))
    d = bot.durability
    assert d is not None
    inner_sweep = d.sweep
    swept = False

    async def sweep() -> None:  # reports the end of the first pass: the dead incarnation's work resumed
        nonlocal swept
        await inner_sweep()
        if not swept:
            swept = True
            markers.send(("swept", time.monotonic()))

    d.sweep = sweep  # type: ignore[method-assign]

    queue: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
    pending: set[asyncio.Future[None]] = set()
    busy = 0
    stop = asyncio.Event()

    async def worker() -> None:
        nonlocal busy
        while True:
            id, chat, text = await queue.get()
            busy += 1
            try:
                try:
                    taken = await provider.deliver(InboundEvent(id=id, chat_id=chat, text=text))
                except Exception as exc:
                    markers.send(("nack", id, repr(exc)))
                    continue
                if not taken:  # the journal write failed (INB-8): the channel redelivers
                    markers.send(("nack", id, "inbox.journal failed"))
                else:
                    markers.send(("ack", id, time.monotonic()))
            finally:
                busy -= 1

    async def status(req: int) -> None:
        try:
            inbox = await built.backend.inbox_list(SCOPE, limit=1_000_000)
            outbox = await built.backend.outbox_list(SCOPE, limit=1_000_000)
            states = {"inbox": dict(Counter(r.state for r in inbox)), "outbox": dict(Counter(r.state for r in outbox))}
            settled = (all(r.state in ("done", "dead") for r in inbox)
                       and all(r.state in ("sent", "dead", "unknown") for r in outbox))
            markers.send(("reply", req, {"settled": settled and queue.empty() and busy == 0, "states": states,
                                         "queued": queue.qsize(), "busy": busy}))
        except Exception as exc:
            markers.send(("reply", req, {"settled": False, "error": repr(exc)}))

    def on_readable() -> None:
        try:
            while conn.poll():
                msg = conn.recv()
                kind = msg[0]
                if kind == "msg":
                    queue.put_nowait((msg[1], msg[2], msg[3]))
                elif kind == "status":
                    task = asyncio.ensure_future(status(msg[1]))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                elif kind == "metrics":
                    markers.send(("reply", msg[1], d.metrics()))
                elif kind == "stop":
                    stop.set()
        except (EOFError, OSError):
            os._exit(3)  # the parent is gone

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, cfg.concurrency))]
    await bot.start()
    markers.send(("ready", {"pid": os.getpid(), "incarnation": d.incarnation, "instance_id": d.instance_id},
                  time.monotonic()))
    loop.add_reader(conn.fileno(), on_readable)
    on_readable()
    await stop.wait()
    loop.remove_reader(conn.fileno())
    while not queue.empty() or busy:
        await asyncio.sleep(0.01)
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    await bot.stop()
    if built.close is not None:
        await built.close()
    markers.send(("stopped", d.metrics(), time.monotonic()))


# =========================================================================================
# The parent side: one run (children, history, ledger)
# =========================================================================================
@dataclass
class Mark:
    seq: int | None
    when: str
    op: str
    ident: Any
    info: Any
    t: float

    def __str__(self) -> str:
        return f"{self.when} {self.op}{f' {self.ident}' if self.ident is not None else ''}"


@dataclass
class Incarnation:
    """One child process, as the parent saw it."""

    n: int
    name: str
    instance_id: str
    pid: int
    stop_at: int | None
    started: float
    proc: Any = field(repr=False, default=None)
    conn: Any = field(repr=False, default=None)
    create_time: float | None = None
    ready_at: float | None = None
    swept_at: float | None = None
    ended_at: float | None = None
    end: str | None = None
    """``killed`` (by the harness), ``died`` (by itself), ``stopped`` (cleanly)."""
    exitcode: int | None = None
    engine_incarnation: str | None = None
    markers: list[Mark] = field(default_factory=list)
    killed_at: float | None = None
    kill_point: str | None = None
    frozen: bool = False
    stop_requested: bool = False
    metrics: dict[str, int] | None = None
    fed: set[str] = field(default_factory=set)
    replies: dict[int, Any] = field(default_factory=dict)
    log_path: str = ""

    @property
    def alive(self) -> bool:
        return self.end is None

    @property
    def died(self) -> bool:
        return self.end in ("killed", "died")

    def last_marker(self) -> Mark | None:
        return self.markers[-1] if self.markers else None

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Delivery:
    """One line of the delivery ledger: what reached the channel."""

    key: str | None
    chat: str
    text: str
    name: str
    n: int
    pid: int
    t: float


@dataclass
class Event:
    n: int
    name: str
    payload: dict[str, Any]
    t: float


def _mp_context(method: str) -> Any:
    import multiprocess

    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method {method!r}: use 'forkserver' or 'spawn' (never fork: the parent has threads)")
    ctx = multiprocess.get_context(method)
    if method == "forkserver":
        # imported once in the server, inherited by every child; the optional backends
        # only when they import cleanly here (a broken import would kill the server)
        preload = ["botmesh_testkit.kill", "botmesh.sqlite_store", "botmesh.core.file_backend"]
        for optional in ("botmesh.redis_store", "botmesh.postgres_store"):
            try:
                __import__(optional)
            except Exception:  # absent, or its driver is not installed
                continue
            preload.append(optional)
        ctx.set_forkserver_preload(preload)
    return ctx


def _gone(pid: int, create_time: float | None) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.01:
            return True  # the pid was reused: ours is gone
        return False  # still in the process table (running, stopped or an unreaped zombie)
    except psutil.NoSuchProcess:
        return True


class _Run:
    """Children on one backend, everything they reported, and the channel's messages."""

    def __init__(self, spec: BackendSpec, handler: Any, *, setup: Any, durability: dict[str, Any], workdir: str,
                 start_method: str, concurrency: int, fail_rate: float, seed: int, text_limit: int | None) -> None:
        self.spec = spec
        self.handler = handler
        self.setup = setup
        self.durability = durability
        self.workdir = workdir
        self.ledger_dir = os.path.join(workdir, "ledger")
        self.log_dir = os.path.join(workdir, "logs")
        os.makedirs(self.ledger_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        self.ctx = _mp_context(start_method)
        self.concurrency = concurrency
        self.fail_rate = fail_rate
        self.seed = seed
        self.text_limit = text_limit
        self.incarnations: list[Incarnation] = []
        self.messages: dict[str, tuple[str, str]] = {}
        self.order: list[str] = []
        self.acked: dict[str, float] = {}
        self.nacked: dict[str, tuple[str, float]] = {}
        """Messages a child refused (the journal write failed, INB-8): redelivered 100 ms
        later, as a channel retrying a failed webhook."""
        self.feeds = 0
        self.events: list[Event] = []
        self._req = 0

    # -- children ----------------------------------------------------------------------
    def spawn(self, name: str, instance_id: str, stop_at: int | None = None) -> Incarnation:
        import psutil

        n = len(self.incarnations) + 1
        cfg = ChildConfig(
            name=name, n=n, instance_id=instance_id, spec=self.spec, handler=self.handler, setup=self.setup,
            durability=self.durability, ledger_path=os.path.join(self.ledger_dir, f"{name}-{n}.jsonl"),
            log_path=os.path.join(self.log_dir, f"{name}-{n}.log"), workdir=self.workdir, stop_at=stop_at,
            concurrency=self.concurrency, fail_rate=self.fail_rate, seed=self.seed, text_limit=self.text_limit,
        )
        try:
            blob = _dumps(cfg)
        except Exception as exc:
            raise HarnessError(f"cannot pickle the child's configuration: {type(exc).__name__}: {exc} "
                               "(the handler, setup and spec must be picklable with dill)") from exc
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=_child_entry, args=(blob, cfg.log_path, child_conn), name=f"botmesh-kill-{name}-{n}",
                                daemon=True)
        started = time.monotonic()
        try:
            proc.start()
        except Exception as exc:
            parent_conn.close()
            child_conn.close()
            raise HarnessError(f"cannot start child {name}#{n}: {type(exc).__name__}: {exc}") from exc
        child_conn.close()
        inc = Incarnation(n, name, instance_id, proc.pid, stop_at, started, proc=proc, conn=parent_conn,
                          log_path=cfg.log_path)
        with contextlib.suppress(psutil.Error):
            inc.create_time = psutil.Process(proc.pid).create_time()
        self.incarnations.append(inc)
        return inc

    def live(self) -> list[Incarnation]:
        return [i for i in self.incarnations if i.alive]

    def current(self, name: str) -> Incarnation | None:
        for inc in reversed(self.incarnations):
            if inc.name == name:
                return inc
        return None

    # -- the pipe ----------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Read whatever the live children wrote, waiting up to ``timeout`` seconds for
        the first message; notice the ones that ended."""
        from multiprocess.connection import wait

        live = self.live()
        if not live:
            time.sleep(timeout)
            return
        ready = wait([i.conn for i in live], timeout)
        for inc in live:
            if inc.conn not in ready:
                continue
            try:
                while inc.conn.poll():
                    self._handle(inc, inc.conn.recv())
            except (EOFError, OSError):
                self._ended(inc)

    def _handle(self, inc: Incarnation, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "mk":
            m = Mark(msg[1], msg[2], msg[3], msg[4], msg[5], msg[6])
            inc.markers.append(m)
            if inc.stop_at is not None and m.seq == inc.stop_at:
                inc.frozen = True
        elif kind == "ack":
            self.acked.setdefault(msg[1], msg[2])
            self.nacked.pop(msg[1], None)
        elif kind == "nack":
            if msg[1] not in self.acked:
                self.nacked[msg[1]] = (msg[2], time.monotonic())
            inc.fed.discard(msg[1])
        elif kind == "ev":
            self.events.append(Event(inc.n, msg[1], msg[2], msg[3]))
        elif kind == "ready":
            inc.ready_at = msg[2]
            inc.engine_incarnation = msg[1].get("incarnation")
        elif kind == "swept":
            inc.swept_at = msg[1]
        elif kind == "reply":
            inc.replies[msg[1]] = msg[2]
        elif kind == "stopped":
            inc.metrics = msg[1]

    def _ended(self, inc: Incarnation) -> None:
        if inc.end is not None:
            return
        with contextlib.suppress(OSError):
            inc.conn.close()
        inc.proc.join(10)
        inc.exitcode = inc.proc.exitcode
        inc.ended_at = time.monotonic()
        if inc.killed_at is not None:
            inc.end = "killed"
        elif inc.stop_requested and inc.exitcode == 0:
            inc.end = "stopped"
        else:
            inc.end = "died"
        deadline = time.monotonic() + 5
        while not _gone(inc.pid, inc.create_time):
            if time.monotonic() > deadline:
                raise HarnessError(f"child {inc.name}#{inc.n} (pid {inc.pid}) is still there after it ended")
            time.sleep(0.01)

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str, *, poll: float = 0.05) -> bool:
        """Pump until ``predicate()``; False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(poll, left))
        return True

    def send(self, inc: Incarnation, msg: tuple[Any, ...]) -> bool:
        if not inc.alive:
            return False
        try:
            inc.conn.send(msg)
            return True
        except (OSError, EOFError):
            self._ended(inc)
            return False

    def request(self, inc: Incarnation, kind: str, timeout: float = 10.0) -> Any:
        """Ask a live child (``status`` or ``metrics``); None when it died or did not
        answer in time."""
        self._req += 1
        req = self._req
        if not self.send(inc, (kind, req)):
            return None
        self.wait(lambda: req in inc.replies or not inc.alive, timeout, kind, poll=0.02)
        return inc.replies.pop(req, None)

    # -- signals -----------------------------------------------------------------------
    def kill(self, inc: Incarnation, point: str | None = None) -> None:
        """SIGKILL, then wait until the process is gone (psutil)."""
        if not inc.alive:
            return
        inc.killed_at = time.monotonic()
        inc.kill_point = point
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.pid, signal.SIGKILL)
        self.wait(lambda: not inc.alive, 10.0, "death", poll=0.02)
        if inc.alive:  # the pipe did not close: reap it anyway
            self._ended(inc)

    def freeze(self, inc: Incarnation) -> None:
        """SIGSTOP, then wait until the kernel shows the process stopped (psutil)."""
        os.kill(inc.pid, signal.SIGSTOP)
        self._await_status(inc, stopped=True)

    def thaw(self, inc: Incarnation) -> None:
        """SIGCONT, then wait until the process runs again."""
        os.kill(inc.pid, signal.SIGCONT)
        self._await_status(inc, stopped=False)

    def _await_status(self, inc: Incarnation, *, stopped: bool, timeout: float = 5.0) -> None:
        import psutil

        deadline = time.monotonic() + timeout
        while True:
            try:
                is_stopped = psutil.Process(inc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
            except psutil.NoSuchProcess:
                return
            if is_stopped == stopped:
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"child {inc.name}#{inc.n} (pid {inc.pid}) did not {'stop' if stopped else 'continue'}")
            time.sleep(0.002)

    def stop(self, inc: Incarnation, timeout: float = 20.0) -> bool:
        """Ask the child to stop cleanly (bot.stop, backend closed, metrics reported)."""
        if not inc.alive:
            return False
        inc.stop_requested = True
        self.send(inc, ("stop",))
        if not self.wait(lambda: not inc.alive, timeout, "stop"):
            self.kill(inc, "did not stop in time")
            return False
        return inc.end == "stopped"

    # -- messages ----------------------------------------------------------------------
    def add_messages(self, messages: Iterable[tuple[str, str, str]]) -> None:
        for id, chat, text in messages:
            if id not in self.messages:
                self.messages[id] = (chat, text)
                self.order.append(id)

    def unacked(self, ids: Iterable[str] | None = None) -> list[str]:
        return [i for i in (self.order if ids is None else ids) if i not in self.acked]

    def feed(self, inc: Incarnation, ids: Iterable[str]) -> int:
        """Deliver messages (not yet acknowledged, not already in flight in ``inc``)."""
        sent = 0
        for id in ids:
            if id in self.acked or id in inc.fed:
                continue
            chat, text = self.messages[id]
            if not self.send(inc, ("msg", id, chat, text)):
                break
            inc.fed.add(id)
            self.nacked.pop(id, None)
            self.feeds += 1
            sent += 1
        return sent

    def refeed_nacked(self, inc: Incarnation, after: float = 0.1) -> None:
        now = time.monotonic()
        due = {id for id, (_, t) in self.nacked.items() if now - t >= after}
        if due:
            self.feed(inc, [i for i in self.order if i in due])

    # -- evidence ----------------------------------------------------------------------
    def ledger(self) -> list[Delivery]:
        """Every complete ledger line (a torn last line is a send that never returned:
        the channel did not accept it)."""
        out: list[Delivery] = []
        for fname in sorted(os.listdir(self.ledger_dir)):
            with open(os.path.join(self.ledger_dir, fname), "rb") as f:
                data = f.read()
            for raw in data.split(b"\n")[:-1]:  # the last piece is "" or a torn line
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue
                out.append(Delivery(obj.get("key"), obj["chat"], obj["text"], obj["name"], obj["n"], obj["pid"], obj["t"]))
        out.sort(key=lambda d: d.t)
        return out

    def journal(self) -> tuple[list[InboxRecord], list[OutboxRecord]]:
        if self.live():
            raise HarnessError("read the journal only after every child ended")
        return _run_coro(lambda: read_journal(self.spec))

    def cleanup(self) -> list[int]:
        """SIGKILL every child still alive (a frozen one too); returns their pids."""
        killed = []
        for inc in self.live():
            killed.append(inc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(inc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(inc.pid, signal.SIGCONT)
            inc.killed_at = inc.killed_at or time.monotonic()
            self._ended(inc)
        return killed

    def stray_pids(self) -> list[int]:
        """Pids of this run's children that still exist (should be none at the end)."""
        return [i.pid for i in self.incarnations if not _gone(i.pid, i.create_time)]


# =========================================================================================
# The judge
# =========================================================================================
@dataclass
class KillOracle:
    """What a run without harness kills does (children that kill themselves still die):
    deliveries per (chat, text), the final state of each inbound, and the pace."""

    deliveries: Counter[tuple[str, str]]
    inbox_states: dict[str, str]
    markers_per_message: float
    ms_per_message: float
    self_deaths: int = 0
    by_inbound: dict[str, Counter[tuple[str, str]]] = field(default_factory=dict)
    """Deliveries per inbound id (from keys ``<id>:<n>``): what an inbound that the run
    legitimately put in the DLQ (INB-7) may have left unsent."""


@dataclass
class Accounting:
    """How every duplicate and every loss was accounted for."""

    duplicates: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)
    dead_inbound: list[str] = field(default_factory=list)
    duplicate_count: int = 0
    loss_count: int = 0


def _charged_deaths(incarnations: Iterable[Incarnation]) -> dict[str, int]:
    """Per inbound id, how many incarnations may have been charged an execution of it
    (journaled or claimed it, or died inside that write) and died before completing it:
    an upper bound of the unfinished charged executions of INB-7."""
    deaths: Counter[str] = Counter()
    for inc in incarnations:
        if not inc.died:
            continue
        charged: set[str] = set()
        finished: set[str] = set()
        open_writes: dict[tuple[str, str], int] = defaultdict(int)
        for m in inc.markers:
            if m.op not in ("inbox.journal", "inbox.claim", "inbox.complete", "inbox.kill", "inbox.retry_later"):
                continue
            key = (m.op, str(m.ident))
            if m.when == "before":
                open_writes[key] += 1
            elif m.when in ("after", "raised"):
                open_writes[key] -= 1
                info = m.info or {}
                if m.when == "after" and m.op == "inbox.journal" and info.get("created"):
                    charged.add(str(m.ident))
                if m.when == "after" and m.op == "inbox.claim" and info.get("claimed") is not None:
                    charged.add(str(m.ident))
                if m.when == "after" and m.op in ("inbox.complete", "inbox.kill", "inbox.retry_later") and info.get("ok"):
                    finished.add(str(m.ident))
        for (op, ident), n in open_writes.items():
            if n > 0 and op in ("inbox.journal", "inbox.claim"):
                charged.add(ident)  # died inside the write: it may have landed
        for ident in charged - finished:
            deaths[ident] += 1
    return dict(deaths)


def _delivery_rules(policy: str, item: Any, want: int, got: int, amb: int, v: list[Violation], excused: int = 0) -> None:
    """The crash matrix's per-send rules (matrix.check), for one (chat, text).
    ``excused``: sends the oracle made for inbounds this run legitimately put in the DLQ."""
    if want == 0:
        v.append(Violation(("OUT-5", "OUT-2"), f"{item} delivered {got}x, the crash-free run never sent it"))
    elif policy == "skip" and got > want:
        v.append(Violation(("OUT-2", "OUT-14", "GUAR-4"), f"{item} delivered {got}x (duplicate under on_ambiguous=skip)"))
    elif policy == "skip" and got < want - amb - excused:
        v.append(Violation(("GUAR-2", "OUT-1"), f"{item} delivered {got}x, expected {want} ({amb} ambiguous)"))
    elif policy == "resend" and got < want - excused:
        v.append(Violation(("OUT-14", "GUAR-2"), f"{item} delivered {got}x, expected {want} (lost under on_ambiguous=resend)"))
    elif policy == "resend" and got > want + amb:
        v.append(Violation(("OUT-2", "GUAR-4"), f"{item} delivered {got}x, only {amb} ambiguous send(s) account for duplicates"))


def judge(
    *,
    policy: str,
    max_attempts: int,
    messages: dict[str, tuple[str, str]],
    acked: Iterable[str],
    inbox: list[InboxRecord],
    outbox: list[OutboxRecord],
    ledger: list[Delivery],
    events: list[Event],
    incarnations: list[Incarnation],
    oracle: KillOracle | None = None,
    fail_rate: float = 0.0,
) -> tuple[list[Violation], Accounting]:
    """The history checker of a real-process run. Pure: it reads the evidence — the
    messages fed and acknowledged, the final journals (read after the last child
    ended), the delivery ledger, the events and markers of every incarnation, and
    optionally a run without harness kills (the oracle) — and returns the violations
    (with requirement ids, as :func:`botmesh_testkit.checker.history.check`) and how each
    duplicate and loss was accounted for."""
    v: list[Violation] = []
    acc = Accounting()
    acked = set(acked)
    in_by_id = {r.id: r for r in inbox}
    out_by_key = {r.key: r for r in outbox}

    # -- inbound: admitted means journaled; everything ends done, or dead by the rules --
    deaths = _charged_deaths(incarnations)
    excused: Counter[tuple[str, str]] = Counter()
    for id in messages:
        rec = in_by_id.get(id)
        want = oracle.inbox_states.get(id) if oracle is not None else None
        if id not in acked:
            v.append(Violation(("INB-1", "INB-8"), f"inbound {id!r} was never acknowledged (journaled) by any incarnation"))
            continue
        if rec is None:
            v.append(Violation(("GUAR-1", "INB-1"), f"inbound {id!r} was acknowledged but has no inbox record: "
                                                    "an acknowledged journal write was lost"))
        elif rec.state == "dead":
            charged = deaths.get(id, 0)
            if want == "dead" or charged >= max_attempts:
                unsent = oracle.by_inbound.get(id, Counter()) if oracle is not None and want != "dead" else Counter()
                excused.update(unsent)
                acc.dead_inbound.append(f"{id}: in the DLQ after {charged} unfinished execution(s) "
                                        f"(max_attempts {max_attempts}, INB-7): {rec.error}"
                                        + (f"; sends it may have left unmade: {sum(unsent.values())}" if unsent else ""))
            else:
                v.append(Violation(("INB-7", "INB-3"), f"inbound {id!r} is in the DLQ after at most {charged} "
                                                       f"unfinished execution(s), max_attempts is {max_attempts} "
                                                       f"(error {rec.error!r})"))
        elif rec.state != "done":
            v.append(Violation(("INB-3", "INB-2"), f"inbound {id!r} ended {rec.state!r}: never settled"))
        elif want == "dead":
            v.append(Violation(("INB-7", "GUAR-7"), f"inbound {id!r} is done, but it kills every execution: "
                                                    "a run without kills puts it in the DLQ"))

    # -- sends, per key: the ledger against the outbox ----------------------------------
    by_key: dict[str | None, list[Delivery]] = defaultdict(list)
    for d in ledger:
        by_key[d.key].append(d)
    amb_events: dict[str, list[int]] = defaultdict(list)
    for e in events:
        if e.name == "durability:ambiguous":
            amb_events[str(e.payload.get("key"))].append(e.n)
    for d in by_key.get(None, []):
        v.append(Violation(("OUT-1",), f"{(d.chat, d.text)} reached the channel (incarnation {d.n}) while no "
                                       "journaled send was in flight for that chat"))
    for key, ds in by_key.items():
        if key is None:
            continue
        orec = out_by_key.get(key)
        if orec is None:
            v.append(Violation(("OUT-1", "GUAR-2"), f"{key!r} reached the channel {len(ds)}x (incarnations "
                                                    f"{[d.n for d in ds]}) but the outbox has no record of it"))
    for key, orec in out_by_key.items():
        ds = by_key.get(key, [])
        got = len(ds)
        amb = amb_events.get(key, [])
        where = f"incarnations {[d.n for d in ds]}"
        if amb:
            acc.ambiguous.append(f"{key}: ambiguous in incarnation(s) {amb}, delivered {got}x, ended {orec.state}")
        if orec.state in ("pending", "sending", "failed"):
            v.append(Violation(("OUT-7", "OUT-9"), f"outbox {key!r} never settled (state {orec.state!r})"))
        elif orec.state == "dead":
            if not fail_rate:
                v.append(Violation(("OUT-7", "OUT-8"), f"outbox {key!r} is in the DLQ although the channel never "
                                                       f"refused a send: {orec.error}"))
        elif orec.state == "sent" and got == 0:
            v.append(Violation(("OUT-1", "GUAR-4"), f"outbox {key!r} is recorded sent but never reached the channel"))
        elif orec.state == "unknown":
            if policy == "resend":
                v.append(Violation(("OUT-14",), f"outbox {key!r} marked unknown under on_ambiguous=resend"))
            elif not amb:
                v.append(Violation(("OUT-14", "OPS-1"), f"outbox {key!r} is unknown without a durability:ambiguous event"))
            elif got == 0:
                acc.losses.append(f"{key} ({orec.chat_id}, {orec.content.get('text')!r}): never delivered; outbox "
                                  f"unknown after durability:ambiguous in incarnation(s) {amb} (OUT-14 skip)")
                acc.loss_count += 1
        if got > 1:
            acc.duplicate_count += got - 1
            if policy == "skip":
                v.append(Violation(("OUT-2", "OUT-14", "GUAR-4"), f"{key!r} delivered {got}x ({where}) under "
                                                                  "on_ambiguous=skip"))
            elif got - 1 > len(amb):
                v.append(Violation(("OUT-2", "GUAR-4"), f"{key!r} delivered {got}x ({where}), only {len(amb)} "
                                                        "durability:ambiguous event(s) account for duplicates"))
            else:
                acc.duplicates.append(f"{key} delivered {got}x ({where}): resent after durability:ambiguous in "
                                      f"incarnation(s) {amb} (OUT-14 resend)")

    # -- sends of one handler keep their order (OUT-11): <id>:1 before <id>:2 ... ------
    firsts: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for key, ds in by_key.items():
        if key is None or ":" not in key:
            continue
        base, _, nth = key.rpartition(":")
        if nth.isdigit():
            firsts[base].append((ds[0].t, int(nth), key))
    for base, items in firsts.items():
        by_time = [k for _, _, k in sorted(items)]
        by_number = [k for _, _, k in sorted(items, key=lambda x: x[1])]
        if by_time != by_number:
            v.append(Violation(("OUT-11",), f"sends of inbound {base!r} reached the channel in the order {by_time}"))

    # -- against the run without kills (the matrix's oracle rules) ----------------------
    if oracle is not None:
        # several deaths may make one key ambiguous several times (once per incarnation
        # that resolved it): each may add a duplicate under resend, but a key loses at
        # most its one delivery under skip
        delivered = Counter((d.chat, d.text) for d in ledger)
        amb_keys: Counter[tuple[str, str]] = Counter()
        amb_times: Counter[tuple[str, str]] = Counter()
        for key in set(amb_events) | {k for k, r in out_by_key.items() if r.state == "unknown"}:
            orec = out_by_key.get(key)
            if orec is not None:
                item = (orec.chat_id, str(orec.content.get("text")))
                amb_keys[item] += 1
                amb_times[item] += max(1, len(set(amb_events.get(key, []))))
        for item in sorted(set(oracle.deliveries) | set(delivered)):
            amb_n = amb_times[item] if policy == "resend" else amb_keys[item]
            _delivery_rules(policy, item, oracle.deliveries[item], delivered[item], amb_n, v, excused[item])

    # -- fencing: every new lease a larger token; no completion under a superseded one --
    claims: dict[tuple[str, str], list[tuple[float, int, int]]] = defaultdict(list)
    for inc in incarnations:
        for m in inc.markers:
            info = m.info or {}
            if m.when != "after":
                continue
            space = m.op.split(".")[0]
            if m.op.endswith(".claim") and info.get("claimed") is not None:
                claims[(space, str(m.ident))].append((m.t, int(info["claimed"]), inc.n))
            elif m.op.endswith(".journal") and info.get("created") and info.get("state") in ("leased", "sending"):
                claims[(space, str(m.ident))].append((m.t, int(info["token"]), inc.n))
    for (space, ident), cs in claims.items():
        tokens = [t for _, t, _ in cs]
        if len(set(tokens)) != len(tokens):
            dup = sorted(t for t, c in Counter(tokens).items() if c > 1)
            v.append(Violation(("REPL-1", "LEASE-2"), f"{space} {ident!r}: fencing token(s) {dup} handed out twice "
                                                      f"(claims by incarnations {[n for _, _, n in cs]})"))
    for inc in incarnations:
        starts: dict[tuple[str, str, int], float] = {}
        for m in inc.markers:
            info = m.info or {}
            if m.op in ("inbox.complete", "outbox.mark_sent") and "token" in info:
                space = m.op.split(".")[0]
                k = (space, str(m.ident), int(info["token"]))
                if m.when == "before":
                    starts[k] = m.t
                elif m.when == "after" and info.get("ok") and k in starts:
                    newer = [n for t, tok, n in claims.get(k[:2], []) if tok > k[2] and t < starts[k]]
                    if newer:
                        v.append(Violation(("LEASE-2",), f"{m.op} {m.ident!r} accepted under token {k[2]} from "
                                                         f"incarnation {inc.n} after incarnation(s) {newer} took a "
                                                         "newer lease"))

    # -- metrics agree with the events of each cleanly stopped incarnation (OPS-2) -------
    for inc in incarnations:
        if inc.end != "stopped" or inc.metrics is None:
            continue
        own = [e for e in events if e.n == inc.n]
        amb_n = sum(1 for e in own if e.name == "durability:ambiguous")
        dead = sum(1 for e in own if e.name == "durability:dead")
        if inc.metrics.get("outbox_ambiguous", 0) != amb_n:
            v.append(Violation(("OPS-2", "OUT-14"), f"incarnation {inc.n}: metrics outbox_ambiguous="
                                                    f"{inc.metrics.get('outbox_ambiguous')} but {amb_n} ambiguous events"))
        if inc.metrics.get("inbound_dead", 0) + inc.metrics.get("outbox_dead", 0) != dead:
            v.append(Violation(("OPS-2", "OPS-1"), f"incarnation {inc.n}: dead counters {inc.metrics.get('inbound_dead')}"
                                                   f"+{inc.metrics.get('outbox_dead')} but {dead} durability:dead events"))
    return v, acc


# =========================================================================================
# Results
# =========================================================================================
@dataclass
class KillInfo:
    n: int
    mode: str
    """``marker`` (frozen at its n-th marker), ``delay`` (after a random delay), ``idle``
    (the planned point was never reached: killed with nothing in flight)."""
    point: str
    planned: str
    kill_to_ready_ms: float | None = None
    kill_to_recovered_ms: float | None = None


@dataclass
class KillResult:
    """The outcome of a kill loop (or of a replica scenario judged with
    :meth:`Replicas.judge`)."""

    backend: str
    policy: str
    seed: int
    params: dict[str, Any]
    kills: list[KillInfo]
    self_deaths: int
    incarnations: int
    messages: int
    acked: int
    feeds: int
    deliveries: int
    distinct_keys: int
    inbox_states: dict[str, int]
    outbox_states: dict[str, int]
    violations: list[Violation]
    accounting: Accounting
    seconds: float
    kill_phase_seconds: float
    reproduce: str
    events: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run: Any = field(default=None, repr=False)
    """The :class:`_Run` with every incarnation, marker and event (for custom checks)."""
    label: str = "kill loop"

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def violated_ids(self) -> set[str]:
        return {i for v in self.violations for i in v.ids}

    def ready_ms(self) -> list[float]:
        return [k.kill_to_ready_ms for k in self.kills if k.kill_to_ready_ms is not None]

    def recovered_ms(self) -> list[float]:
        return [k.kill_to_recovered_ms for k in self.kills if k.kill_to_recovered_ms is not None]

    def report(self) -> str:
        points = Counter(f"{k.mode}: {k.point}" for k in self.kills)
        # how the duplicates and losses of a passing run were accounted for (a failing run
        # lists each one that was not, under "violated")
        dups, losses = self.accounting.duplicate_count, self.accounting.loss_count
        dups_why = " (each covered by a durability:ambiguous event, OUT-14 resend)" if dups and self.passed else ""
        losses_why = (" (each an outbox 'unknown' record after a durability:ambiguous event, OUT-14 skip)"
                      if losses and self.passed else "")
        modes = Counter(k.mode for k in self.kills)
        lines = [
            f"{self.label} on {self.backend}, on_ambiguous={self.policy}, seed {self.seed}: "
            f"{'passed' if self.passed else 'FAILED'} ({self.seconds:.1f} s)",
            f"  kills: {len(self.kills)} ({', '.join(f'{m} {c}' for m, c in sorted(modes.items())) or 'none'}); "
            f"self-deaths: {self.self_deaths}; incarnations: {self.incarnations}",
            f"  messages: {self.messages}, acknowledged {self.acked}, fed {self.feeds}x "
            f"({self.feeds - self.messages} redeliveries)",
            f"  inbox: {dict(sorted(self.inbox_states.items()))}; outbox: {dict(sorted(self.outbox_states.items()))}",
            f"  deliveries: {self.deliveries} of {self.distinct_keys} keys; duplicates: "
            f"{dups}{dups_why}; losses: {losses}{losses_why}",
        ]
        if self.events:
            lines.append("  events: " + ", ".join(f"{k} {v}" for k, v in sorted(self.events.items())))
        ready, rec = self.ready_ms(), self.recovered_ms()
        if ready:
            lines.append(f"  kill -> ready median {statistics.median(ready):.0f} ms; kill -> recovered (first sweep "
                         f"done) median {statistics.median(rec) if rec else float('nan'):.0f} ms")
        for d in self.accounting.duplicates:
            lines.append(f"  duplicate: {d}")
        for d in self.accounting.losses:
            lines.append(f"  loss: {d}")
        for d in self.accounting.dead_inbound:
            lines.append(f"  dead: {d}")
        amb_only = [a for a in self.accounting.ambiguous]
        if amb_only:
            lines.append(f"  ambiguous sends: {len(amb_only)}")
            lines.extend(f"    {a}" for a in amb_only[:20])
        if points:
            lines.append("  kill points: " + "; ".join(f"{p} x{c}" if c > 1 else p for p, c in points.most_common()))
        lines.extend(f"  note: {n}" for n in self.notes)
        for v in self.violations:
            lines.append(f"  violated {v}")
        if not self.passed:
            lines.append(f"  violated ids: {', '.join(sorted(self.violated_ids))}")
            lines.append(f"  seed: {self.seed}")
            lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)

    def assert_ok(self) -> KillResult:
        """Raise ``AssertionError`` with the report when a guarantee was broken."""
        if not self.passed:
            raise AssertionError(self.report())
        return self


# =========================================================================================
# The kill loop
# =========================================================================================
def _messages(spec: int | Iterable[Any], chats: int) -> list[tuple[str, str, str]]:
    if isinstance(spec, int):
        return [(f"m{i}", f"c{i % chats}", f"msg {i}") for i in range(1, spec + 1)]
    out: list[tuple[str, str, str]] = []
    for i, item in enumerate(spec, 1):
        if isinstance(item, str):
            out.append((f"m{i}", f"c{(i - 1) % chats}", item))
        else:
            id, chat, text = item
            out.append((str(id), str(chat), str(text)))
    return out


def _durability(policy: str, lease_ms: float, poll_ms: float, max_attempts: int, retries: int,
                extra: dict[str, Any] | None) -> dict[str, Any]:
    backoff = {"base_ms": 20, "cap_ms": 200}
    options: dict[str, Any] = {
        "inbox": {"lease_ms": lease_ms, "max_attempts": max_attempts, "backoff": backoff},
        "outbox": {"on_ambiguous": policy, "lease_ms": lease_ms, "retries": retries, "backoff": backoff,
                   "inline_max_ms": 2000},
        "poll_ms": poll_ms,
        "retention": 0,
    }
    for k, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(options.get(k), dict):
            options[k] = {**options[k], **value}
        else:
            options[k] = value
    return options


class KillLoop:
    """Kill one bot ``kills`` times with SIGKILL at seeded moments, restart it with the
    same ``instance_id`` each time, let the last incarnation drain, judge.

    ``backend_spec``: see :func:`build_backend`. ``handler``: ``async def handler(ctx)``
    run for every message (default :class:`replies` ``(2)``); or ``setup(bot)`` to
    register handlers yourself. ``messages``: a count (``m1``.. on ``chats`` chats) or a
    list of texts or ``(id, chat, text)``. Messages are released over the kill cycles;
    every cycle's child first gets every message not yet acknowledged (redelivery).

    Each kill is drawn from ``seed``: with probability ``marker_share`` the child
    freezes at a random marker (before/after a journal write, a provider send, a
    handler) and is killed there; otherwise it is killed after a random delay (anywhere:
    inside a write, a handler, the startup). ``on_ambiguous`` is the outbox policy under
    test. ``oracle``: run the same messages once without kills on SQLite first and
    compare deliveries with it (as the crash matrix does). ``drain_timeout``: seconds the
    last child gets to settle everything; past it the result fails, naming what is left.
    """

    def __init__(
        self,
        backend_spec: BackendSpec,
        handler: Callable[[Any], Awaitable[Any]] | None = None,
        *,
        messages: int | Iterable[Any] = 20,
        kills: int = 10,
        seed: int = 0,
        on_ambiguous: str = "skip",
        workdir: str | None = None,
        setup: Callable[[Any], None] | None = None,
        chats: int = 3,
        max_attempts: int = 5,
        retries: int = 5,
        lease_ms: float = 2000.0,
        poll_ms: float = 50.0,
        durability: dict[str, Any] | None = None,
        instance_id: str = "kill-1",
        concurrency: int = 1,
        fail_rate: float = 0.0,
        text_limit: int | None = None,
        oracle: bool | KillOracle = True,
        marker_share: float = 0.65,
        start_method: str = "forkserver",
        drain_timeout: float = 30.0,
        cycle_timeout: float = 20.0,
        max_self_deaths: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if on_ambiguous not in POLICIES:
            raise ValueError(f"on_ambiguous must be one of {POLICIES}, got {on_ambiguous!r}")
        if handler is None and setup is None:
            handler = replies(2)
        self.spec = tuple(backend_spec)
        self.handler = handler
        self.setup = setup
        self.messages = _messages(messages, chats)
        self.kills = kills
        self.seed = seed
        self.policy = on_ambiguous
        self.workdir: str | None = workdir
        """Where the journal (for specs under it), ledgers and child logs go; kept after
        the run for post-mortems. None: a fresh temporary directory at :meth:`run`."""
        self.max_attempts = max_attempts
        self.retries = retries
        self.options = _durability(on_ambiguous, lease_ms, poll_ms, max_attempts, retries, durability)
        self.instance_id = instance_id
        self.concurrency = concurrency
        self.fail_rate = fail_rate
        self.text_limit = text_limit
        self.oracle = oracle
        self.marker_share = marker_share
        self.start_method = start_method
        self.drain_timeout = drain_timeout
        self.cycle_timeout = cycle_timeout
        self.max_self_deaths = max_self_deaths if max_self_deaths is not None else 2 * max_attempts * len(self.messages) + 10
        self.progress = progress
        self.runs: list[_Run] = []
        self._kw = dict(messages=messages if isinstance(messages, int) else len(self.messages), kills=kills, seed=seed,
                        on_ambiguous=on_ambiguous, chats=chats, max_attempts=max_attempts, lease_ms=lease_ms,
                        poll_ms=poll_ms, concurrency=concurrency, fail_rate=fail_rate, marker_share=marker_share)

    # -- public --------------------------------------------------------------------------
    def run(self) -> KillResult:
        """Run the loop (blocking) and return the judged result; never raises for a
        broken guarantee (see :meth:`KillResult.assert_ok`), raises
        :class:`HarnessError` when the harness itself cannot run."""
        started = time.monotonic()
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="botmesh-kill-")
        try:
            oracle = self._oracle()
            return self._main(oracle, started)
        finally:
            self.cleanup()

    async def arun(self) -> KillResult:
        """:meth:`run` in a thread, for async tests."""
        return await asyncio.to_thread(self.run)

    def cleanup(self) -> list[int]:
        """Kill whatever child is left (they all are gone after :meth:`run`)."""
        pids: list[int] = []
        for r in self.runs:
            pids += r.cleanup()
        return pids

    def stray_pids(self) -> list[int]:
        return [p for r in self.runs for p in r.stray_pids()]

    def reproduce(self) -> str:
        node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        kw = ", ".join(f"{k}={v!r}" for k, v in self._kw.items())
        call = f"KillLoop({_spec_repr(self.spec)}, {_callable_repr(self.handler)}, {kw})"
        if isinstance(self.handler, replies) and self.setup is None and self.spec[0] in ("file", "sqlite", "postgres", "redis"):
            backend = spec_name(self.spec)
            server = ""
            if self.spec[0] in ("postgres", "redis"):
                from ..servers import redact_url

                server = f" --{self.spec[0]}-url {shlex.quote(redact_url(str(self.spec[1])))}"
            cli = (f"python -m botmesh_testkit.kill --backend {backend}{server} --messages {self._kw['messages']} "
                   f"--kills {self.kills} --seed {self.seed} --policy {self.policy} --replies {self.handler.n}")
            return cli + (f"  (or pytest {shlex.quote(node)})" if node else "")
        return (f"pytest {shlex.quote(node)}  # " if node else "") + call

    # -- internals ---------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def _new_run(self, spec: BackendSpec, sub: str) -> _Run:
        assert self.workdir is not None
        workdir = os.path.join(self.workdir, sub)
        os.makedirs(workdir, exist_ok=True)
        if spec[0] in ("file", "sqlite") and isinstance(spec[1], str) and os.path.dirname(spec[1]):
            os.makedirs(os.path.dirname(spec[1]), exist_ok=True)
        run = _Run(spec, self.handler, setup=self.setup, durability=self.options, workdir=workdir,
                   start_method=self.start_method, concurrency=self.concurrency, fail_rate=self.fail_rate,
                   seed=self.seed, text_limit=self.text_limit)
        self.runs.append(run)
        return run

    def _oracle(self) -> KillOracle | None:
        if isinstance(self.oracle, KillOracle):
            return self.oracle
        if not self.oracle:
            return None
        assert self.workdir is not None  # run() sets it before asking for the oracle
        run = self._new_run(("sqlite", os.path.join(self.workdir, "oracle", "oracle.db")), "oracle")
        run.add_messages(self.messages)
        t0 = time.monotonic()
        inc, problem = self._settle(run, None, deadline=time.monotonic() + self.drain_timeout)
        if problem:
            raise HarnessError(f"the run without kills (oracle) did not settle: {problem}")
        first = run.incarnations[0]
        elapsed = time.monotonic() - (first.ready_at if first.ready_at is not None else t0)
        assert inc is not None
        run.stop(inc)
        inbox, _ = run.journal()
        counted = sum(1 for i in run.incarnations for m in i.markers if m.seq is not None)
        n = max(1, len(self.messages))
        ledger = run.ledger()
        by_inbound: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
        for d in ledger:
            if d.key is not None and ":" in d.key:
                by_inbound[d.key.rpartition(":")[0]][(d.chat, d.text)] += 1
        return KillOracle(
            deliveries=Counter((d.chat, d.text) for d in ledger),
            by_inbound=dict(by_inbound),
            inbox_states={r.id: r.state for r in inbox},
            markers_per_message=counted / n,
            ms_per_message=1000.0 * elapsed / n,
            self_deaths=sum(1 for i in run.incarnations if i.end == "died"),
        )

    def _start(self, run: _Run, stop_at: int | None) -> Incarnation:
        return run.spawn("bot", self.instance_id, stop_at)

    def _crashed(self, inc: Incarnation) -> None:
        if inc.end == "died" and inc.exitcode is not None and inc.exitcode > 0:
            raise HarnessError(f"child {inc.name}#{inc.n} (pid {inc.pid}) crashed with exit code {inc.exitcode}; "
                               f"its log:\n{inc.log_tail()}")

    def _settle(self, run: _Run, inc: Incarnation | None, deadline: float) -> tuple[Incarnation | None, str | None]:
        """Keep one child alive (restarting it after a death of its own), feed it every
        unacknowledged message, until it reports everything settled. Returns the live
        child, or a description of what is left when ``deadline`` passed."""
        deaths = 0
        fed = inc is not None
        last_status: Any = None
        next_status = 0.0
        while True:
            if inc is None or not inc.alive:
                if inc is not None:
                    self._crashed(inc)
                    deaths += 1
                    if deaths > self.max_self_deaths:
                        return inc, f"the child died {deaths} times by itself while draining"
                inc = self._start(run, None)
                fed = False
            if not fed and (inc.ready_at is not None):
                run.feed(inc, run.unacked())
                fed = True
            if time.monotonic() > deadline:
                left = run.unacked()
                return inc, (f"did not settle in time: unacknowledged {left[:10]}{'...' if len(left) > 10 else ''}; "
                             f"last status {last_status}")
            run.pump(0.02)
            if not inc.alive or not fed:
                continue
            if run.nacked:
                run.refeed_nacked(inc)
            if not run.unacked() and time.monotonic() >= next_status:
                next_status = time.monotonic() + 0.05
                last_status = run.request(inc, "status")
                if last_status is not None and last_status.get("settled") and not run.unacked():
                    return inc, None

    def _plan(self, rng: random.Random, oracle: KillOracle | None, pending: int, startup_ms: float) -> tuple[str, float]:
        per_msg_markers = oracle.markers_per_message if oracle else 12.0
        per_msg_ms = oracle.ms_per_message if oracle else 15.0
        if rng.random() < self.marker_share:
            top = max(2, int(per_msg_markers * max(1, pending) * 0.9))
            return "marker", float(rng.randint(1, top))
        return "delay", rng.uniform(0.0, startup_ms + per_msg_ms * max(1, pending) * 1.2)

    def _main(self, oracle: KillOracle | None, started: float) -> KillResult:
        run = self._new_run(self.spec, "run")
        rng = random.Random(self.seed)
        kills: list[KillInfo] = []
        self_deaths = 0
        released = 0
        startup: list[float] = []
        notes: list[str] = []
        previous_kill: float | None = None
        previous_info: KillInfo | None = None
        inc: Incarnation | None  # each cycle starts one; the last settle may end without one
        kill_phase_start = time.monotonic()
        while len(kills) < self.kills:
            # messages are spread over the cycles, so that every cycle has fresh work
            upto = round((len(kills) + 1) * len(self.messages) / self.kills)
            batch = self.messages[released:upto]
            released = max(released, upto)
            run.add_messages(batch)
            pending = len(run.unacked())
            mode, amount = self._plan(rng, oracle, pending, statistics.median(startup) if startup else 50.0)
            stop_at = int(amount) if mode == "marker" else None
            inc = self._start(run, stop_at)
            planned = f"marker #{stop_at}" if mode == "marker" else f"{amount:.0f} ms after start"
            deadline = inc.started + self.cycle_timeout
            fed = False
            while inc.alive and time.monotonic() < deadline:
                run.pump(0.005)
                if inc.ready_at is not None and not fed:
                    startup.append(1000.0 * (inc.ready_at - inc.started))
                    run.feed(inc, run.unacked())
                    fed = True
                if fed and run.nacked:
                    run.refeed_nacked(inc)
                if mode == "marker" and inc.frozen:
                    break
                if mode == "delay" and time.monotonic() >= inc.started + amount / 1000.0:
                    break
                if mode == "marker" and fed and not run.unacked():
                    last_t = inc.markers[-1].t if inc.markers else inc.ready_at or inc.started
                    if time.monotonic() - last_t > max(0.15, 3 * self.options["poll_ms"] / 1000.0):
                        mode = "idle"
                        break
            if previous_info is not None and previous_kill is not None:
                if inc.ready_at is not None:
                    previous_info.kill_to_ready_ms = 1000.0 * (inc.ready_at - previous_kill)
                if inc.swept_at is not None:
                    previous_info.kill_to_recovered_ms = 1000.0 * (inc.swept_at - previous_kill)
                previous_info = None
            if not inc.alive:
                self._crashed(inc)
                self_deaths += 1
                if self_deaths > self.max_self_deaths:
                    raise HarnessError(f"the child died {self_deaths} times by itself; last log:\n{inc.log_tail()}")
                self._say(f"incarnation {inc.n} died by itself (exit {inc.exitcode})")
                continue
            if time.monotonic() >= deadline and mode == "marker" and not inc.frozen:
                mode = "idle"
                notes.append(f"incarnation {inc.n}: planned {planned} not reached in {self.cycle_timeout:.0f} s")
            last = inc.last_marker()
            if mode == "marker":
                point = str(last)
            elif mode == "idle":
                point = f"idle (planned {planned}; last marker {last})"
            else:
                point = (f"after {1000.0 * (time.monotonic() - inc.started):.0f} ms"
                         + (f", last marker {last}" if last else ", before any marker"))
            run.kill(inc, point)
            info = KillInfo(inc.n, mode, point if mode != "delay" else (str(last) if last else "startup"), planned)
            kills.append(info)
            previous_kill, previous_info = inc.killed_at, info
            self._say(f"kill {len(kills)}/{self.kills}: incarnation {inc.n} {mode} at {point}")
        kill_phase = time.monotonic() - kill_phase_start
        run.add_messages(self.messages[released:])
        inc, problem = self._settle(run, None, deadline=time.monotonic() + self.drain_timeout)
        if previous_info is not None and previous_kill is not None and inc is not None and run.incarnations:
            first = next((i for i in run.incarnations if i.started >= previous_kill), None)
            if first is not None and first.ready_at is not None:
                previous_info.kill_to_ready_ms = 1000.0 * (first.ready_at - previous_kill)
            if first is not None and first.swept_at is not None:
                previous_info.kill_to_recovered_ms = 1000.0 * (first.swept_at - previous_kill)
        violations: list[Violation] = []
        if problem:
            violations.append(Violation(("INB-3", "OUT-7"), f"the last incarnation {problem}"))
            run.cleanup()
        elif inc is not None and not run.stop(inc):
            notes.append(f"incarnation {inc.n} did not stop cleanly")
        inbox, outbox = run.journal()
        ledger = run.ledger()
        found, acc = judge(
            policy=self.policy, max_attempts=self.max_attempts, messages=run.messages, acked=run.acked,
            inbox=inbox, outbox=outbox, ledger=ledger, events=run.events, incarnations=run.incarnations,
            oracle=oracle, fail_rate=self.fail_rate,
        )
        violations += found
        stray = run.stray_pids()
        if stray:
            violations.append(Violation(("TEST-4",), f"child processes still alive after the run: {stray}"))
        return KillResult(
            backend=spec_name(self.spec), policy=self.policy, seed=self.seed, params=dict(self._kw), kills=kills,
            self_deaths=sum(1 for i in run.incarnations if i.end == "died"), incarnations=len(run.incarnations),
            messages=len(run.messages), acked=len(run.acked), feeds=run.feeds, deliveries=len(ledger),
            distinct_keys=len({d.key for d in ledger}), inbox_states=dict(Counter(r.state for r in inbox)),
            outbox_states=dict(Counter(r.state for r in outbox)), violations=violations, accounting=acc,
            seconds=time.monotonic() - started, kill_phase_seconds=kill_phase, reproduce=self.reproduce(),
            events=dict(Counter(e.name for e in run.events)), notes=notes, run=run,
        )


# =========================================================================================
# Replicas
# =========================================================================================
class Replicas:
    """Several children on one shared backend (SQLite, PostgreSQL, Redis), each with
    its own ``instance_id``, driven by hand::

        with Replicas(("sqlite", db), handler, workdir=tmp) as r:
            a, b = r.start("a"), r.start("b")
            r.feed("a", [("m1", "c1", "slow")])
            r.wait_marker("a", lambda m: m.op == "mark" and m.ident == "hold")
            r.freeze("a")                                  # SIGSTOP past lease_ms
            r.wait_marker("b", lambda m: m.op == "inbox.complete" and m.ident == "m1" and m.when == "after")
            r.thaw("a")                                    # its completion is refused
            assert r.metrics("a")["stale_leases"] >= 1
            result = r.finish()                            # drain, stop, judge

    Every wait has a deadline (``timeout``) and raises :class:`HarnessError` naming what
    it waited for, rather than hanging."""

    def __init__(self, backend_spec: BackendSpec, handler: Callable[[Any], Awaitable[Any]] | None = None, *,
                 workdir: str | None = None, on_ambiguous: str = "skip", lease_ms: float = 400.0,
                 poll_ms: float = 50.0, max_attempts: int = 5, retries: int = 5, setup: Any = None,
                 durability: dict[str, Any] | None = None, start_method: str = "forkserver", seed: int = 0,
                 timeout: float = 20.0) -> None:
        self.spec = tuple(backend_spec)
        self.policy = on_ambiguous
        self.max_attempts = max_attempts
        self.seed = seed
        self.timeout = timeout
        self.workdir = workdir or tempfile.mkdtemp(prefix="botmesh-replicas-")
        options = _durability(on_ambiguous, lease_ms, poll_ms, max_attempts, retries, durability)
        self.run = _Run(self.spec, handler if handler is not None or setup is not None else replies(1), setup=setup,
                        durability=options, workdir=self.workdir, start_method=start_method, concurrency=1,
                        fail_rate=0.0, seed=seed, text_limit=None)
        self.started = time.monotonic()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, name: str, instance_id: str | None = None, *, stop_at: int | None = None) -> Incarnation:
        """Start replica ``name`` (instance id ``replica-<name>`` unless given) and wait
        until it is ready. ``stop_at=n``: it freezes at its n-th marker (see
        :meth:`wait_frozen`)."""
        inc = self.run.spawn(name, instance_id or f"replica-{name}", stop_at)
        if not self.run.wait(lambda: inc.ready_at is not None or inc.frozen or not inc.alive, self.timeout, "ready"):
            raise HarnessError(f"replica {name} not ready within {self.timeout} s; log:\n{inc.log_tail()}")
        if not inc.alive:
            raise HarnessError(f"replica {name} died while starting (exit {inc.exitcode}); log:\n{inc.log_tail()}")
        return inc

    def child(self, name: str) -> Incarnation:
        inc = self.run.current(name)
        if inc is None:
            raise KeyError(name)
        return inc

    def feed(self, name: str, messages: Iterable[tuple[str, str, str]]) -> None:
        msgs = list(messages)
        self.run.add_messages(msgs)
        self.run.feed(self.child(name), [m[0] for m in msgs])

    def redeliver(self, name: str) -> None:
        """Feed ``name`` every message not yet acknowledged (a channel redelivering to the
        surviving replica)."""
        self.run.feed(self.child(name), self.run.unacked())

    def wait_marker(self, name: str, predicate: Callable[[Mark], bool], timeout: float | None = None) -> Mark:
        inc = self.child(name)
        found: list[Mark] = []

        def seen() -> bool:
            for m in inc.markers:
                if predicate(m):
                    found.append(m)
                    return True
            return False

        if not self.run.wait(lambda: seen() or not inc.alive, timeout or self.timeout, "marker") or not found:
            raise HarnessError(f"replica {name}: the awaited marker did not come within {timeout or self.timeout} s "
                               f"(alive: {inc.alive}; last markers: {[str(m) for m in inc.markers[-5:]]})")
        return found[0]

    def wait_frozen(self, name: str, timeout: float | None = None) -> Mark:
        """Wait until replica ``name`` froze at its ``stop_at`` marker; returns it."""
        inc = self.child(name)
        if not self.run.wait(lambda: inc.frozen or not inc.alive, timeout or self.timeout, "frozen") or not inc.frozen:
            raise HarnessError(f"replica {name} did not reach marker #{inc.stop_at} within {timeout or self.timeout} s "
                               f"(alive: {inc.alive}; {len([m for m in inc.markers if m.seq])} counted markers)")
        return inc.markers[-1]

    def wait_recovered(self, name: str, timeout: float | None = None) -> float:
        """Wait until replica ``name`` finished its first sweep pass (what a previous
        incarnation left is taken back and run); returns the monotonic time of it."""
        inc = self.child(name)
        if not self.run.wait(lambda: inc.swept_at is not None or not inc.alive, timeout or self.timeout, "sweep") \
                or inc.swept_at is None:
            raise HarnessError(f"replica {name} did not finish its first sweep within {timeout or self.timeout} s")
        return inc.swept_at

    def stop(self, name: str) -> dict[str, int] | None:
        """Stop replica ``name`` cleanly; returns its final metrics."""
        inc = self.child(name)
        self.run.stop(inc, self.timeout)
        return inc.metrics

    def wait_acked(self, ids: Iterable[str], timeout: float | None = None) -> None:
        ids = list(ids)
        if not self.run.wait(lambda: all(i in self.run.acked for i in ids), timeout or self.timeout, "acks"):
            raise HarnessError(f"messages not acknowledged in time: {[i for i in ids if i not in self.run.acked]}")

    def freeze(self, name: str) -> None:
        """SIGSTOP the replica."""
        self.run.freeze(self.child(name))

    def thaw(self, name: str) -> None:
        """SIGCONT the replica."""
        self.run.thaw(self.child(name))

    def kill(self, name: str) -> None:
        """SIGKILL the replica (and check with psutil that it is gone)."""
        inc = self.child(name)
        self.run.kill(inc, str(inc.last_marker()))

    def metrics(self, name: str) -> dict[str, int]:
        got = self.run.request(self.child(name), "metrics", self.timeout)
        if got is None:
            raise HarnessError(f"replica {name} did not report its metrics")
        return dict(got)

    def status(self, name: str) -> dict[str, Any]:
        got = self.run.request(self.child(name), "status", self.timeout)
        if got is None:
            raise HarnessError(f"replica {name} did not report its status")
        return dict(got)

    def drain(self, name: str, timeout: float | None = None) -> None:
        """Wait until every fed message is acknowledged and replica ``name`` sees the
        shared journals settled."""
        inc = self.child(name)
        deadline = time.monotonic() + (timeout or self.timeout)
        status: Any = None
        while time.monotonic() < deadline:
            self.run.pump(0.05)
            if self.run.nacked:
                self.run.refeed_nacked(inc)
            if not self.run.unacked():
                status = self.run.request(inc, "status")
                if status is not None and status.get("settled"):
                    return
        raise HarnessError(f"replicas did not settle within {timeout or self.timeout} s: unacknowledged "
                           f"{self.run.unacked()}; {name} sees {status}")

    def finish(self, oracle: KillOracle | None = None) -> KillResult:
        """Stop every live replica cleanly, read the journal and the ledger, judge."""
        for inc in self.run.live():
            self.run.stop(inc)
        inbox, outbox = self.run.journal()
        ledger = self.run.ledger()
        violations, acc = judge(policy=self.policy, max_attempts=self.max_attempts, messages=self.run.messages,
                                acked=self.run.acked, inbox=inbox, outbox=outbox, ledger=ledger,
                                events=self.run.events, incarnations=self.run.incarnations, oracle=oracle)
        killed = [KillInfo(i.n, "replica", i.kill_point or "", "by hand") for i in self.run.incarnations if i.end == "killed"]
        stray = self.run.stray_pids()
        if stray:
            violations.append(Violation(("TEST-4",), f"child processes still alive after the run: {stray}"))
        return KillResult(
            backend=spec_name(self.spec), policy=self.policy, seed=self.seed, params={}, kills=killed,
            self_deaths=sum(1 for i in self.run.incarnations if i.end == "died"),
            incarnations=len(self.run.incarnations), messages=len(self.run.messages), acked=len(self.run.acked),
            feeds=self.run.feeds, deliveries=len(ledger), distinct_keys=len({d.key for d in ledger}),
            inbox_states=dict(Counter(r.state for r in inbox)), outbox_states=dict(Counter(r.state for r in outbox)),
            violations=violations, accounting=acc, seconds=time.monotonic() - self.started, kill_phase_seconds=0.0,
            reproduce=os.environ.get("PYTEST_CURRENT_TEST", "(replica scenario)"),
            events=dict(Counter(e.name for e in self.run.events)), run=self.run, label="replicas",
        )

    def close(self) -> list[int]:
        return self.run.cleanup()


# =========================================================================================
# Command line: python -m botmesh_testkit.kill
# =========================================================================================
def main(argv: list[str] | None = None) -> int:
    """``python -m botmesh_testkit.kill``: one kill loop on a file, SQLite, PostgreSQL or
    Redis backend, its report printed; exit status 0 when the run passed.

    PostgreSQL and Redis need a server URL (``--postgres-url`` / ``--redis-url``, else
    ``$BOTMESH_POSTGRES_URL`` / ``$BOTMESH_REDIS_URL``); the run uses a table prefix
    (PostgreSQL) or key prefix (Redis) of its own, derived from the work directory, and
    drops it at the end — unless the run failed or ``--keep`` is given, so that what the
    children journaled can be inspected (the prefix is printed)."""
    p = argparse.ArgumentParser(prog="python -m botmesh_testkit.kill",
                                description="Kill a bot with SIGKILL in a loop and judge what the channel saw.")
    p.add_argument("--backend", default="sqlite", choices=["file", "file+log", "sqlite", "postgres", "redis"])
    p.add_argument("--postgres-url", default=None, metavar="URL",
                   help="server of --backend=postgres (default $BOTMESH_POSTGRES_URL)")
    p.add_argument("--redis-url", default=None, metavar="URL", help="server of --backend=redis (default $BOTMESH_REDIS_URL)")
    p.add_argument("--keep", action="store_true", help="keep the PostgreSQL table / Redis keys even when the run passed")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--messages", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", choices=POLICIES, default="skip")
    p.add_argument("--replies", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--start-method", default="forkserver", choices=["forkserver", "spawn"])
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    server_url: str | None = None
    if args.backend in ("postgres", "redis"):
        option, env = f"--{args.backend}-url", f"BOTMESH_{args.backend.upper()}_URL"
        server_url = getattr(args, f"{args.backend}_url") or os.environ.get(env)
        if not server_url:
            p.error(f"--backend={args.backend} needs a server: give {option}=URL or set ${env}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="botmesh-kill-")
    spec: BackendSpec
    drop: Callable[[], Coroutine[Any, Any, Any]] | None = None
    where = ""
    if args.backend == "sqlite":
        spec = ("sqlite", os.path.join(workdir, "bot.db"))
    elif args.backend == "postgres":
        from ..backends.postgres import PostgresHarness

        pg = PostgresHarness(workdir, url=cast(str, server_url))
        spec, drop = cast(BackendSpec, pg.kill_spec()), pg.drop_table
        where = f"table {pg.table_prefix}durable"
    elif args.backend == "redis":
        from ..backends.redis import RedisHarness

        rh = RedisHarness(workdir, url=cast(str, server_url))
        spec, drop = cast(BackendSpec, rh.kill_spec()), rh.delete_keys
        where = f"keys of prefix {rh.prefix!r}"
    else:
        spec = ("file", os.path.join(workdir, "journal.json"), args.backend == "file+log")
    loop = KillLoop(spec, replies(args.replies), messages=args.messages, kills=args.kills, seed=args.seed,
                    on_ambiguous=args.policy, workdir=workdir, start_method=args.start_method,
                    progress=print if args.verbose else None)
    result = loop.run()
    print(result.report())
    if drop is not None:
        if result.passed and not args.keep:
            asyncio.run(drop())
        else:
            from ..servers import redact_url

            print(f"kept for inspection: {where} on {redact_url(cast(str, server_url))}")
    return 0 if result.passed else 1
