"""The parent's side of a kill run: the children of one backend (:class:`Run`), what
each of them reported (:class:`Incarnation`, its :class:`Mark` s and :class:`Event` s),
and what reached the channel (the delivery ledger, one :class:`Delivery` per line).

The parent feeds inbound messages through a pipe and redelivers every unacknowledged one
to the next incarnation, as a webhook does; it kills (``SIGKILL``), freezes
(``SIGSTOP``) and thaws (``SIGCONT``) children and checks with psutil that each one it
let go is really gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from botmesh.core.records import InboxRecord, OutboxRecord

from ..backends.base import KillSpec
from .childproc import ChildConfig, dumps_config, run_child, stop_reached
from .spec import HarnessError, read_journal, run_sync


@dataclass
class Mark:
    """One marker a child wrote: ``when`` (``before``, ``after``, ``raised``, ``at``)
    ``op`` (a crash point, ``handler`` or ``mark``) about ``ident`` (an inbound id, an
    outbox key), with ``info`` (tokens, results); ``seq`` its number among the counted
    markers (None for the others), ``t`` the child's monotonic time."""

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
    stop_at: int | str | None
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
    """An event the bot of incarnation ``n`` emitted (``error``, ``durability:dead``,
    ``durability:ambiguous``), with its payload made JSON-able."""

    n: int
    name: str
    payload: dict[str, Any]
    t: float


def _mp_context(method: str) -> Any:
    """The ``multiprocess`` context children start from (never ``fork``)."""
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
    """Whether process ``pid`` (started at ``create_time``) is no longer there."""
    import psutil

    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.01:
            return True  # the pid was reused: ours is gone
        return False  # still in the process table (running, stopped or an unreaped zombie)
    except psutil.NoSuchProcess:
        return True


class Run:
    """Children on one backend, everything they reported, and the channel's messages."""

    def __init__(self, spec: KillSpec, handler: Any, *, setup: Any, durability: dict[str, Any], workdir: str,
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
    def spawn(self, name: str, instance_id: str, stop_at: int | str | None = None) -> Incarnation:
        import psutil

        n = len(self.incarnations) + 1
        cfg = ChildConfig(
            name=name, n=n, instance_id=instance_id, spec=self.spec, handler=self.handler, setup=self.setup,
            durability=self.durability, ledger_path=os.path.join(self.ledger_dir, f"{name}-{n}.jsonl"),
            log_path=os.path.join(self.log_dir, f"{name}-{n}.log"), workdir=self.workdir, stop_at=stop_at,
            concurrency=self.concurrency, fail_rate=self.fail_rate, seed=self.seed, text_limit=self.text_limit,
        )
        try:
            blob = dumps_config(cfg)
        except Exception as exc:
            raise HarnessError(f"cannot pickle the child's configuration: {type(exc).__name__}: {exc} "
                               "(the handler, setup and spec must be picklable with dill)") from exc
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=run_child, args=(blob, cfg.log_path, child_conn), name=f"botmesh-kill-{name}-{n}",
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
            if m.seq is not None and inc.stop_at is not None:
                nth = sum(1 for x in inc.markers if x.seq is not None and x.when == m.when and x.op == m.op)
                if stop_reached(inc.stop_at, m.seq, m.when, m.op, nth):
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
        return run_sync(lambda: read_journal(self.spec))

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


def durability_options(policy: str, lease_ms: float, poll_ms: float, max_attempts: int, retries: int,
                       extra: dict[str, Any] | None) -> dict[str, Any]:
    """The children's ``durability`` options: short leases, poll and backoff (the child's
    clock is real), ``extra`` merged in one level deep."""
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
