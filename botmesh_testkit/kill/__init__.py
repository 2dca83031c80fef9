"""Real process death: kill loops, poison messages and replica failover (TEST-4,
GUAR-1..7, INB-7, OUT-14, LEASE-2, REPL-1..3).

The crash matrix simulates deaths inside one process; this package kills real child
processes with ``SIGKILL`` (and freezes them with ``SIGSTOP``) and judges what the
outside world saw.

* A **child** is a process (``multiprocess``, ``forkserver`` context by default, or
  ``spawn``; never ``fork``) running a :class:`~botmesh.core.Bot` on the real clock over
  a durable backend described by a small picklable
  :class:`~botmesh_testkit.backends.base.KillSpec` and built inside the child by
  :func:`build_backend` (:mod:`.spec`; a backend harness gives the spec of its storage,
  and the entry points also take its tuple form, ``("sqlite", path)`` ...).

  Its handler is the test's own ``async def handler(ctx)`` (a closure is fine: dill
  pickles it). Its provider appends every accepted send to a **delivery ledger** outside
  the child (one JSON line, ``write`` + ``fsync`` before ``send`` returns: the channel
  accepted it) with the outbox key being sent, the chat, the text, the pid and the
  incarnation (:mod:`.childproc`).
* The parent feeds inbound messages through a pipe; the child acknowledges each one
  after ``deliver`` returned (journaled and processed); like a webhook, the parent
  redelivers every unacknowledged message to the next incarnation (:mod:`.parent`).
* The child writes **markers** to the pipe before and after each journal write, each
  provider send and each handler run. ``stop_at=n`` makes a child freeze on its n-th
  marker (``stop_at="after provider.send#2"``: on the second marker of that kind), so the
  parent kills it at an exact point (``after provider.send m7:1``: the
  channel has it, the outbox does not know); other kills land after a random delay.
* :class:`KillLoop` (:mod:`.loop`) kills and restarts one ``instance_id`` K times at
  seeded moments, lets the last incarnation drain, then :func:`judge`
  (:mod:`botmesh_testkit.checker.judge`) checks the history with the delivery rule of
  the crash matrix's checker: every admitted inbound done or in the DLQ as the rules
  allow (INB-7), ``skip`` never duplicates and every missing send is an ``unknown``
  record, ``resend`` never loses and every duplicate has a ``durability:ambiguous``
  event, fencing tokens only grow (LEASE-2). The outcome is a :class:`KillResult`
  (:mod:`.result`).
* :class:`Replicas` (:mod:`.replicas`) drives several children on one shared backend by
  hand: freeze one, let another take its leases, thaw it and read its ``stale_leases``.
* :func:`run_workers` (:mod:`.workers`) runs N worker processes on one backend at once,
  started together behind a barrier, each a seeded workload (:mod:`.contention`: CAS
  increments, journal races, claim rounds) whose results come back to the parent — how
  the conformance suite checks a ``multi_process`` claim
  (:mod:`botmesh_testkit.checker.contention` judges them).

A kill test in a few lines (the ``botmesh_kill_loop`` fixture of
:mod:`botmesh_testkit.pytest.kill_plugin` builds a :class:`KillLoop` in ``tmp_path``)::

    async def handler(ctx):
        await ctx.reply(f"echo {ctx.text}")

    @pytest.mark.botmesh_kill(kills=20, messages=40)
    def test_my_backend_survives_sigkill(botmesh_kill_loop):
        result = botmesh_kill_loop(FactorySpec("my_pkg.backend:make", ("/tmp/x",)), handler,
                                   on_ambiguous="resend", seed=7).run()
        result.assert_ok()          # prints kills, deliveries, duplicates, losses ...

or without pytest: ``KillLoop(SQLiteSpec("/tmp/bot.db"), handler, kills=20).run()``, or
from a shell with a built-in handler (:mod:`.cli`): ``python -m botmesh_testkit.kill
--backend sqlite --kills 20 --messages 40 --seed 7``.

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

from ..backends.base import FactorySpec, FileSpec, KillSpec, MemorySpec, PostgresSpec, RedisSpec, SQLiteSpec
from ..checker.judge import Accounting, KillOracle, judge
from ..checker.violation import Violation
from ..matrix.cells import POLICIES
from .childproc import ChildConfig, ChildInfo, LedgerProvider, MarkedBackend, child, hold, marker, replies
from .cli import main
from .loop import KILLS, KillLoop
from .parent import Delivery, Event, Incarnation, Mark, Run
from .replicas import Replicas
from .result import KillInfo, KillResult
from .workers import Worker, WorkerOutcome, WorkersRun, run_workers
from .spec import (
    SCOPE,
    BackendSpec,
    Built,
    HarnessError,
    as_kill_spec,
    build_backend,
    read_journal,
    spec_for,
    spec_name,
)

__all__ = [
    "KILLS",
    "POLICIES",
    "SCOPE",
    "Accounting",
    "BackendSpec",
    "Built",
    "ChildConfig",
    "ChildInfo",
    "Delivery",
    "Event",
    "FactorySpec",
    "FileSpec",
    "HarnessError",
    "Incarnation",
    "KillInfo",
    "KillLoop",
    "KillOracle",
    "KillResult",
    "KillSpec",
    "LedgerProvider",
    "Mark",
    "MarkedBackend",
    "MemorySpec",
    "PostgresSpec",
    "RedisSpec",
    "Replicas",
    "Run",
    "SQLiteSpec",
    "Violation",
    "Worker",
    "WorkerOutcome",
    "WorkersRun",
    "as_kill_spec",
    "build_backend",
    "child",
    "hold",
    "judge",
    "main",
    "marker",
    "read_journal",
    "replies",
    "run_workers",
    "spec_for",
    "spec_name",
]
