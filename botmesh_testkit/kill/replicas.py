"""Several children on one shared backend, driven by hand (:class:`Replicas`): freeze
one past its lease, let another take over, thaw it and read its ``stale_leases``."""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ..checker.judge import KillOracle, judge
from ..checker.violation import Violation
from .childproc import replies
from .parent import Incarnation, Mark, Run, durability_options
from .result import KillInfo, KillResult
from .spec import BackendSpec, HarnessError, as_kill_spec


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

    ``backend_spec``: a :class:`~botmesh_testkit.backends.base.KillSpec`, or its tuple
    form (see :mod:`botmesh_testkit.kill.spec`). Every wait has a deadline (``timeout``)
    and raises :class:`HarnessError` naming what it waited for, rather than hanging."""

    def __init__(self, backend_spec: BackendSpec, handler: Callable[[Any], Awaitable[Any]] | None = None, *,
                 workdir: str | None = None, on_ambiguous: str = "skip", lease_ms: float = 400.0,
                 poll_ms: float = 50.0, max_attempts: int = 5, retries: int = 5, setup: Any = None,
                 durability: dict[str, Any] | None = None, start_method: str = "forkserver", seed: int = 0,
                 timeout: float = 20.0) -> None:
        self.spec = as_kill_spec(backend_spec)
        self.policy = on_ambiguous
        self.max_attempts = max_attempts
        self.seed = seed
        self.timeout = timeout
        self.workdir = workdir or tempfile.mkdtemp(prefix="botmesh-replicas-")
        options = durability_options(on_ambiguous, lease_ms, poll_ms, max_attempts, retries, durability)
        self.run = Run(self.spec, handler if handler is not None or setup is not None else replies(1), setup=setup,
                       durability=options, workdir=self.workdir, start_method=start_method, concurrency=1,
                       fail_rate=0.0, seed=seed, text_limit=None)
        self.started = time.monotonic()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, name: str, instance_id: str | None = None, *, stop_at: int | str | None = None) -> Incarnation:
        """Start replica ``name`` (instance id ``replica-<name>`` unless given) and wait
        until it is ready. ``stop_at=n``: it freezes at its n-th counted marker; or
        ``stop_at="after provider.send#2"``: at the second marker of that kind (see
        :meth:`wait_frozen`)."""
        inc = self.run.spawn(name, instance_id or f"replica-{name}", stop_at)
        if not self.run.wait(lambda: inc.ready_at is not None or inc.frozen or not inc.alive, self.timeout, "ready"):
            raise HarnessError(f"replica {name} not ready within {self.timeout} s; log:\n{inc.log_tail()}")
        if not inc.alive:
            raise HarnessError(f"replica {name} died while starting (exit {inc.exitcode}); log:\n{inc.log_tail()}")
        return inc

    def child(self, name: str) -> Incarnation:
        """The current incarnation of replica ``name`` (``KeyError`` when none)."""
        inc = self.run.current(name)
        if inc is None:
            raise KeyError(name)
        return inc

    def feed(self, name: str, messages: Iterable[tuple[str, str, str]]) -> None:
        """Deliver ``(id, chat, text)`` messages to replica ``name``."""
        msgs = list(messages)
        self.run.add_messages(msgs)
        self.run.feed(self.child(name), [m[0] for m in msgs])

    def redeliver(self, name: str) -> None:
        """Feed ``name`` every message not yet acknowledged (a channel redelivering to the
        surviving replica)."""
        self.run.feed(self.child(name), self.run.unacked())

    def wait_marker(self, name: str, predicate: Callable[[Mark], bool], timeout: float | None = None) -> Mark:
        """Wait until replica ``name`` wrote a marker ``predicate`` accepts; returns it."""
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
        """Wait until every message of ``ids`` is acknowledged (by any replica)."""
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
        """The live metrics of replica ``name`` (``stale_leases`` ...)."""
        got = self.run.request(self.child(name), "metrics", self.timeout)
        if got is None:
            raise HarnessError(f"replica {name} did not report its metrics")
        return dict(got)

    def status(self, name: str) -> dict[str, Any]:
        """What replica ``name`` sees of the shared journals (states, settled or not)."""
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
            backend=self.spec.name, policy=self.policy, seed=self.seed, params={}, kills=killed,
            self_deaths=sum(1 for i in self.run.incarnations if i.end == "died"),
            incarnations=len(self.run.incarnations), messages=len(self.run.messages), acked=len(self.run.acked),
            feeds=self.run.feeds, deliveries=len(ledger), distinct_keys=len({d.key for d in ledger}),
            inbox_states=dict(Counter(r.state for r in inbox)), outbox_states=dict(Counter(r.state for r in outbox)),
            violations=violations, accounting=acc, seconds=time.monotonic() - self.started, kill_phase_seconds=0.0,
            reproduce=os.environ.get("PYTEST_CURRENT_TEST", "(replica scenario)"),
            events=dict(Counter(e.name for e in self.run.events)), run=self.run, label="replicas",
        )

    def close(self) -> list[int]:
        """Kill every replica still alive; returns their pids."""
        return self.run.cleanup()
