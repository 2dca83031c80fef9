"""A second live process beside the explored bot: explore's verbs and model for backends
that claim ``multi_process`` (several live processes on one storage, REPL-4), mixed into
:class:`~.story.Explorer`.

The *replica* is a second bot alive at the same time as the world's bot (the *main*
one), on the same storage, with the same handler, channel and virtual clock. It opens
its own backend: a second harness of the same backend on the same work directory (for
the built-in backends that is the same SQLite file, table, key prefix or shared journal;
a third party's harness factory must give the same storage for the same directory, as
:class:`~botmesh_testkit.backends.factory.FactoryHarness` documents). Its backend is not
crashable: it dies only when the story stops it (:meth:`ReplicaVerbs.stop_replica`).

Verbs (see each method): :meth:`~ReplicaVerbs.replica` boots it — now, or at the start
of the n-th handler execution from now (so that it boots while the other process holds
a lease: the moment two processes sharing an ``instance_id`` steal each other's leases,
issue 12's LEASE-3 on SQLite) — with the default ``instance_id`` or an explicit one;
``receive(..., replica=True)`` delivers a message to it; :meth:`~ReplicaVerbs.stop_replica`
kills it. ``Explorer(s, default_id=True)`` runs the main bot on the default
``instance_id`` too.

What the model requires while both live (each violation names its ids; LEASE-3 is
added when both processes run on the default ``instance_id``, which must tell them
apart):

* an execution of a message's handler never starts while another execution of it runs
  in a live process (LEASE-1, REPL-1): a record in process is leased to one process;
* no live process has a completion refused as stale (``stale_leases`` stays 0): no
  lease is taken from a live holder, whose heartbeats keep it (LEASE-1, LEASE-2, REPL-3);
* the fencing token of a record never goes down from one look to the next (LEASE-2),
  looked at after every step of a story that booted a replica;
* a replica starts on the storage (REPL-4): a boot whose ``start()`` raises — also one
  inside a handler, whose error the engine only reports — leaves no replica alive, and
  the next check names the error.

On a backend on a server (the world's ``serial`` lock, :class:`~botmesh_testkit.crash.world.World`)
the replica's backend calls run under the main bot's lock, one call of either process at
a time: when both work at one virtual instant (a replay waking from a slow action as the
other's sweep pass is due), the order of their calls is the program's, not the network's.
A verb starts, and checks, only once the world is at rest
(:meth:`~botmesh_testkit.explore.story.Explorer._quiet`): a boot that a handler of a
background replay set off (a restart's recovery pass) has ended by then, so no verb
meets a replica whose backend is still opening, and no restart cancels one half-booted.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

__all__ = ["ReplicaVerbs"]

LOOKED_ENOUGH = 400
"""Records the fencing look reads per journal at most (explore's stories hold fewer)."""


class ReplicaVerbs:
    """Mixed into :class:`~.story.Explorer`: the replica's state, verbs and checks."""

    # provided by Explorer
    s: Any
    world: Any
    crashes: int
    messages: dict[str, Any]

    def _init_replicas(self, default_id: bool) -> None:
        self.default_id = default_id
        if default_id:
            self.world.instance_id = None  # every incarnation of the main bot takes the default (LEASE-3)
        self.replica_bot: Any = None
        self.replica_id: str | None = None
        """The ``instance_id`` the live replica was given (None: the default)."""
        self.replicas = 0
        """Replicas booted so far (the n-th one's hooks and events are filed under ``-n``)."""
        self._armed_boot: list[Any] | None = None  # [executions to go, instance_id]
        self._replica_harnesses: list[Any] = []
        self._running: dict[str, list[int]] = defaultdict(list)
        """Message id -> processes (incarnation numbers; ``-n`` the n-th replica) running its handler now."""
        self.overlaps: list[tuple[str, int, int]] = []
        """(message, process running it, process that started it as well) while both lived."""
        self.token_errors: list[str] = []
        self.boot_errors: list[str] = []
        """Why a replica could not start (REPL-4)."""
        self._tokens: dict[tuple[str, str], int] = {}
        close = self.world.close

        async def close_all() -> None:  # the replicas' storage handles go first: the world's close drops the storage
            try:
                await self._close_replicas()
            finally:
                await close()

        self.world.close = close_all

    # -- processes ------------------------------------------------------------------------
    def _live(self, process: int) -> bool:
        if process < 0:
            return self.replica_bot is not None and -process == self.replicas
        return process == self.world.incarnations and not self.world.crashed

    def _name(self, process: int) -> str:
        return f"replica {-process}" if process < 0 else f"incarnation {process} of the main bot"

    def _tracked(self, process: int, handle: Any) -> Any:
        """The handler of ``process``: ``handle`` with the executions in progress
        recorded, and an armed boot of the replica done at its start."""

        async def handler(ctx: Any) -> None:
            mid = str(ctx.event.id)
            known = mid in self.messages
            if known:
                for other in self._running[mid]:
                    if self._live(other) and self._live(process):
                        self.overlaps.append((mid, other, process))
                self._running[mid].append(process)
            try:
                if self._armed_boot is not None:
                    self._armed_boot[0] -= 1
                    if self._armed_boot[0] <= 0:
                        instance_id = self._armed_boot[1]
                        self._armed_boot = None
                        await self._boot(instance_id)
                        # the handler is a moment slower than the boot: virtual time moves only once
                        # the replica's first sweep pass (its recovery, LEASE-4) is over, so that pass
                        # always runs while this execution holds its lease, whatever the backend's I/O
                        await self.world.clock.sleep(1)
                await handle(ctx)
            finally:
                if known:
                    self._running[mid].remove(process)

        return handler

    async def _boot(self, instance_id: str | None) -> None:
        from botmesh.core.bot import Bot

        from ..backends.registry import resolve
        from ..crash.provider import ChannelProvider

        harness = resolve(self.s.backend)(self.s.harness.workdir)
        self._replica_harnesses.append(harness)
        backend, store = await harness.open()
        backend = self.world.serialized(backend)  # one call at a time with the main bot's (module docstring)
        self.replicas += 1
        n = self.replicas
        options = {"backend": backend, **self.world.options}
        if instance_id is not None:
            options["instance_id"] = instance_id
        bot = Bot(ChannelProvider(self.world.channel), store, options, clock=self.world.clock, rng=random.Random(n))
        for name in ("error", "durability:dead", "durability:ambiguous"):
            def listener(payload: dict[str, Any], name: str = name) -> None:
                self.world._record(-n, name, payload)

            bot.on(name, listener)
        self._install_as(bot, -n)
        self.replica_bot, self.replica_id = bot, instance_id
        try:
            await bot.start()
        except BaseException as exc:
            # not alive: no verb may use a bot whose backend never opened (its first read would
            # only say "not open yet"); a backend that cannot open for a second process breaks
            # REPL-4, which the next check says — also when the boot ran inside a handler, whose
            # error the engine reports and goes on
            self.replica_bot = None
            if isinstance(exc, Exception):
                self.boot_errors.append(f"replica {n} could not start on the storage: {type(exc).__name__}: {exc}")
            raise

    def _install_as(self, bot: Any, process: int) -> None:
        raise NotImplementedError  # Explorer's

    async def _quiet(self) -> None:
        raise NotImplementedError  # Explorer's

    async def _close_replicas(self) -> None:
        if self.replica_bot is not None:
            await self.replica_bot.abandon()
            self.replica_bot = None
        for harness in self._replica_harnesses:
            await harness.close()
        self._replica_harnesses.clear()

    # -- verbs ----------------------------------------------------------------------------
    async def replica(self, instance_id: str | None = None, during: int = 0) -> None:
        """A second process boots on the same storage — now (``during=0``), or at the
        start of the ``during``-th handler execution from now, in either process (that
        execution then holds its message's lease while the replica's first sweep pass
        runs: it waits 1 ms of virtual time after the boot) — as ``instance_id`` (None:
        the default of LEASE-3). At most one replica lives at a time."""
        await self._quiet()
        if self.replica_bot is not None or self._armed_boot is not None:
            raise ValueError("replica(): a replica is already alive or armed; stop_replica() first")
        if during > 0:
            self._armed_boot = [during, instance_id]
        else:
            await self._boot(instance_id)  # no virtual time passes: the other process stands still meanwhile
        await self._after_replica_step()

    async def stop_replica(self) -> None:
        """The replica's process dies (an execution it had in flight is cut short)."""
        await self._quiet()
        if self.replica_bot is None:
            return
        bot, self.replica_bot = self.replica_bot, None
        self.crashes += 1
        await bot.abandon()
        await self._after_replica_step()


    # -- the model ------------------------------------------------------------------------
    def _lease_ids(self, *base: str) -> tuple[str, ...]:
        # the main bot's id now, not the story's flag: a restart with a new instance_id
        # leaves the default behind
        both_default = self.world.instance_id is None and self.replica_id is None
        return (*base, "LEASE-3") if both_default else base

    def check_replicas(self) -> None:
        """The checks of the module docstring that need no look at the backend."""
        from .violation import ExploreViolation

        for error in self.boot_errors:
            raise ExploreViolation(("REPL-4",), f"{error}: the backend claims several live processes may share it")
        for mid, first, second in self.overlaps:
            ids = self._lease_ids("LEASE-1", "REPL-1")
            raise ExploreViolation(ids, f"the handler of message {mid} started in {self._name(second)} while it ran in "
                                   f"{self._name(first)}, both alive: {self._instances()}")
        if not self.replicas:
            return
        for process, bot in ((self.world.incarnations, self.world.bot), (-self.replicas, self.replica_bot)):
            if bot is None or not self._live(process) or bot.durability is None:
                continue
            stale = bot.durability.metrics().get("stale_leases", 0)
            if stale:
                raise ExploreViolation(self._lease_ids("LEASE-1", "LEASE-2", "REPL-1"),
                                       f"{self._name(process)}, alive, had {stale} completion(s) refused as stale "
                                       f"(stale_leases): a lease was taken from a live holder; {self._instances()}")
        for error in self.token_errors:
            raise ExploreViolation(("LEASE-2",), error)

    def _instances(self) -> str:
        main = self.world.bot.durability.instance_id if self.world.bot is not None else "?"
        how = "the default instance_id" if self.world.instance_id is None else "an explicit instance_id"
        if self.replica_bot is None:
            return f"main bot {main!r} ({how}), no replica alive"
        other_how = "the default" if self.replica_id is None else "an explicit one"
        return f"main bot {main!r} ({how}), replica {self.replica_bot.durability.instance_id!r} ({other_how})"

    async def _after_replica_step(self) -> None:
        await self._quiet()  # a replica's first sweep pass (its recovery) is over before the look
        await self._look_at_tokens()
        self.check()  # type: ignore[attr-defined]

    async def _look_at_tokens(self) -> None:
        """Fencing tokens only grow (LEASE-2): each record's token, compared with the last
        look's. Read through a live process's backend (nothing when none lives)."""
        bot = self.replica_bot if self.replica_bot is not None else (None if self.world.crashed else self.world.bot)
        if not self.replicas or bot is None or bot.durability is None:
            return
        d = bot.durability
        seen: dict[tuple[str, str], int] = {}
        for journal, records in (("inbox", await d.backend.inbox_list(d.scope)),
                                 ("outbox", await d.backend.outbox_list(d.scope))):
            for rec in records[:LOOKED_ENOUGH]:
                name = rec.id if journal == "inbox" else rec.key
                seen[(journal, name)] = rec.token
                before = self._tokens.get((journal, name))
                if before is not None and rec.token < before:
                    self.token_errors.append(f"the fencing token of {journal} record {name!r} went down from {before} "
                                             f"to {rec.token}: tokens only grow")
        self._tokens = seen  # a purged record is forgotten (journaled again, it starts over)
