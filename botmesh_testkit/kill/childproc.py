"""What runs in a child process: who it is (:func:`child`), its progress markers to the
parent (:func:`marker`, :func:`hold`), the backend wrapper that writes a marker around
each journal write (:class:`MarkedBackend`), the channel that appends each accepted send
to the delivery ledger (:class:`LedgerProvider`), the built-in handler :class:`replies`,
and the child's main (:func:`run_child`), which runs a bot until the parent says stop.

The markers that count towards ``stop_at`` are those of
:data:`botmesh_testkit.crash.points.COUNTED` (and the handler's own :func:`marker`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.provider import Content, InboundEvent, Provider, ProviderError
from botmesh.core.records import InboxRecord, OutboxRecord

from ..crash.intercept import InterceptedBackend
from ..crash.points import COUNTED, HANDLER, PROVIDER_SEND
from ..backends.base import KillSpec
from .spec import SCOPE, build_backend


# =========================================================================================
# The built-in handler
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
    spec: KillSpec
    handler: Any
    setup: Any
    durability: dict[str, Any]
    ledger_path: str
    log_path: str
    workdir: str
    stop_at: int | str | None = None
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

    def __init__(self, conn: Any, stop_at: int | str | None) -> None:
        self.conn = conn
        self.stop_at = stop_at
        self.count = 0
        self.seen: Counter[str] = Counter()
        """Counted markers per ``"<when> <op>"`` (for a ``stop_at`` of ``"after provider.send#2"``)."""
        self.lock = threading.Lock()
        self.dispatch: Callable[[tuple[Any, ...]], None] | None = None
        """What handles a message of the parent (set once the bot is built); the ones
        that come while frozen are handed to it when the parent lets the child go on."""

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                os._exit(3)  # the parent is gone: never outlive it

    def mark(self, when: str, op: str, ident: Any, info: Any = None) -> None:
        seq = None
        if op in COUNTED or op == "mark":
            self.count += 1
            seq = self.count
        self.send(("mk", seq, when, op, ident, info, time.monotonic()))
        if seq is not None:
            self.seen[f"{when} {op}"] += 1
            if stop_reached(self.stop_at, seq, when, op, self.seen[f"{when} {op}"]):
                self.freeze()

    def freeze(self) -> None:
        """Wait here, the event loop blocked, for the parent's SIGKILL — or for its
        ``("go", stop_at)``: the parent moved the kill to a later marker (a kill here
        would have charged a message its last allowed execution, see
        :meth:`botmesh_testkit.kill.loop.KillLoop.last_attempts`); what it sent meanwhile
        is then handled as if it had come now."""
        held: list[tuple[Any, ...]] = []
        while True:
            try:
                if not self.conn.poll(1.0):
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(3)
            if msg[0] == "go":
                self.stop_at = msg[1]
                for m in held:
                    if self.dispatch is not None:
                        self.dispatch(m)
                return
            held.append(msg)  # a message fed meanwhile: if this child is killed here, it is redelivered


def stop_reached(stop_at: int | str | None, seq: int, when: str, op: str, nth: int) -> bool:
    """Whether the counted marker number ``seq``, the ``nth`` ``"<when> <op>"`` one, is
    where a child freezes: ``stop_at`` is that number, or ``"<when> <op>#<nth>"`` (e.g.
    ``"after provider.send#2"``: right after the channel accepted the second send; the
    same point however a busy machine interleaves the sweep's markers with it)."""
    if stop_at is None:
        return False
    if isinstance(stop_at, int):
        return seq == stop_at
    label, _, n = stop_at.rpartition("#")
    return label == f"{when} {op}" and n.isdigit() and int(n) == nth


def _ident(args: tuple[Any, ...]) -> Any:
    """What a write is about, from its arguments after the scope: an inbound id, an
    outbox key, or None."""
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


class MarkedBackend(InterceptedBackend):
    """Wraps the child's backend: a marker before and after each write (or when it
    raised), and the outbox key in flight per chat with the text it is about to send (so
    the ledger can name the key of each delivery).

    What the channel gets is the text of the record last claimed (or journaled in flight)
    for that chat — unless the engine splits that record afterwards (OUT-13): a record
    journaled whole and claimed before its split landed (the process died between the
    two) is split *after* the claim, by whoever recovers it, and its first part is what
    goes out. So a split of the key in flight replaces the text in flight
    (:meth:`_track`); the later parts are records of their own, each claimed before it is
    sent."""

    def __init__(self, inner: DurabilityBackend, markers: _Markers, sending: dict[str, tuple[str, Any]]) -> None:
        super().__init__(inner)
        self.markers = markers
        self.sending = sending

    def before_write(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ident = _ident(args if "scope" in kwargs else args[1:])  # args[0] is the scope
        self.markers.mark("before", op, ident, {"token": kwargs["token"]} if "token" in kwargs else None)
        return ident

    def write_failed(self, op: str, token: Any, exc: Exception) -> None:
        self.markers.mark("raised", op, token, {"error": repr(exc)})

    def after_write(self, op: str, token: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        self._track(op, token, kwargs, result)
        self.markers.mark("after", op, token, _info(op, kwargs, result))

    def _track(self, op: str, key: Any, kwargs: dict[str, Any], result: Any) -> None:
        """Keep :attr:`sending` (chat -> (key, text) in flight) up to date after write
        ``op`` about ``key`` returned ``result``."""
        rec: OutboxRecord | None = None
        if op == "outbox.journal" and isinstance(result, tuple) and result[1] and result[0].state == "sending":
            rec = result[0]
        elif op == "outbox.claim" and result is not None:
            rec = result[0]
        if rec is not None:
            self.sending[rec.chat_id] = (rec.key, rec.content.get("text"))
        elif op == "outbox.split" and isinstance(kwargs.get("content"), dict):
            # A split under the claim's token is followed by the send of its first part
            # even when the backend refused it (the lease was lost: a stale completion
            # is refused later, the send itself is not recalled); a split before the
            # claim (token None) only matters when it landed, and the claim that follows
            # records the part's text anyway.
            if kwargs.get("token") is None and result is not True:
                return
            for chat, (in_flight, _) in list(self.sending.items()):
                if in_flight == key:
                    self.sending[chat] = (key, kwargs["content"].get("text"))


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
        self.markers.mark("before", PROVIDER_SEND, key)
        if self.cfg.fail_rate and self.rng.random() < self.cfg.fail_rate:
            self.markers.mark("raised", PROVIDER_SEND, key, {"error": "injected 503"})
            raise ProviderError("injected 503 from the channel", retryable=True)
        self.seq += 1
        line = json.dumps({"key": key, "chat": chat_id, "text": text, "name": self.cfg.name, "n": self.cfg.n,
                           "pid": os.getpid(), "seq": self.seq, "t": time.monotonic()}, separators=(",", ":"))
        os.write(self.fd, (line + "\n").encode())
        os.fsync(self.fd)
        self.markers.mark("after", PROVIDER_SEND, key)
        return f"{self.cfg.name}.{self.cfg.n}.{self.seq}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def dumps_config(cfg: ChildConfig) -> bytes:
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


def run_child(blob: bytes, log_path: str, conn: Any) -> None:
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
    # InterceptedBackend's operations are installed by setattr (and __abstractmethods__
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
            markers.mark("before", HANDLER, ctx.record_id)
            await handler(ctx)
            markers.mark("after", HANDLER, ctx.record_id)

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

    def on_message(msg: tuple[Any, ...]) -> None:
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

    markers.dispatch = on_message

    def on_readable() -> None:
        try:
            while conn.poll():
                on_message(conn.recv())
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
