"""End to end, through a :class:`~botmesh.core.Bot` on the backend: journaled before the
handler and done after it, reprocessed after a restart with its sends answered from the
outbox, a dead inbound replayed by the operator."""

from __future__ import annotations

import contextlib
import random
from typing import TYPE_CHECKING, Any

import pytest
from botmesh.core.backend import DurabilityBackend

from .base import T0, DurabilitySuiteBase, DurabilityTest, HarnessFactory
from .records import _j, inbound

if TYPE_CHECKING:
    from botmesh.core.bot import Bot


class EndToEndTests(DurabilitySuiteBase):
    """The end-to-end tests through a Bot (a mixin of
    :class:`~botmesh_testkit.conformance.durability.DurabilityConformance`)."""

    @pytest.mark.spec("INB-1", "INB-2", "OUT-1")
    def test_inb1_a_bot_journals_before_its_handler_and_settles_after(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-1, INB-2, OUT-1 (through a Bot on the backend): while the handler runs,
        the backend already holds the inbound record, leased to the bot's instance; the
        reply is in the outbox under ``<record id>:1`` before the handler goes on; after
        the handler the inbound record is ``done`` and the send ``sent`` with the
        channel's message id."""

        async def body(t: DurabilityTest) -> None:
            from botmesh.core.testing import MockProvider

            clock, channel = _clock(), MockProvider()
            bot = _bot(t, channel, clock, instance_id="e2e-1")
            assert bot.durability is not None
            scope = bot.durability.scope
            seen: dict[str, Any] = {}

            @bot.when("hi")
            async def hi(ctx: Any) -> None:
                seen["inbox"] = await t.backend.inbox_get(scope, ctx.record_id)
                result = await ctx.reply("hello")
                seen["key"] = result.key
                seen["outbox"] = await t.backend.outbox_get(scope, result.key)

            await bot.start()
            try:
                await channel.receive("chat-1", "hi", id="m1")
                rec = seen.get("inbox")
                assert rec is not None and rec.state == "leased" and rec.owner == "e2e-1", (
                    f"INB-1: the inbound event is journaled before any handler runs (leased to the bot's instance); "
                    f"inside the handler inbox_get returned {_j(rec)!r}"
                )
                out = seen.get("outbox")
                assert out is not None and out.key == "m1:1" and out.state == "sent", (
                    f"OUT-1: the reply is journaled under m1:1 and sent before the handler goes on; got {_j(out)!r}"
                )
                assert channel.sent and out.message_id == channel.sent[0].message_id, (
                    "OUT-1: the outbox stores the provider's message id "
                    f"{channel.sent[0].message_id if channel.sent else None!r}; "
                    f"got {out.message_id!r}"
                )
                done = await t.backend.inbox_get(scope, "m1")
                assert done is not None and done.state == "done", (
                    f"INB-2: the inbound record is done once the handler returned and its sends are recorded; got {_j(done)!r}"
                )
            finally:
                await bot.abandon()

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("INB-3", "INB-4", "OUT-2", "LEASE-4", "TEST-3")
    def test_inb3_a_restarted_bot_reprocesses_and_answers_from_the_outbox(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """INB-3, OUT-2, LEASE-4, INB-4 (through Bots on the backend, TEST-3): a bot dies
        after its reply was sent and before the inbound record was acknowledged; a new
        bot with the same ``instance_id`` on the same backend reprocesses the record at
        once, its reply is answered from the outbox (the channel gets it once), the
        record ends ``done``, and a redelivery is then recognised as a duplicate."""

        async def body(t: DurabilityTest) -> None:
            from botmesh.core.testing import MockProvider, SimulatedCrash

            from ...crash import crashable

            clock, channel = _clock(), MockProvider()
            runs: list[str] = []

            def setup(bot: Bot) -> None:
                @bot.when("hi")
                async def hi(ctx: Any) -> None:
                    runs.append(ctx.record_id)
                    await ctx.reply("hello")

            dying = crashable(t.backend)
            first = _bot(t, channel, clock, instance_id="e2e-1", backend=dying)
            setup(first)
            await first.start()
            dying.crash_before("inbox.complete")
            try:
                with contextlib.suppress(SimulatedCrash):
                    await channel.receive("chat-1", "hi", id="m1")
            finally:
                await first.abandon()
            assert dying.crashed and channel.texts() == ["hello"], "INB-3: setting up: the first bot must die after its reply"
            second = _bot(t, channel, clock, instance_id="e2e-1")
            assert second.durability is not None
            setup(second)
            await second.start()
            try:
                await clock.advance(1)  # far below the lease: recovery is immediate (LEASE-4)
                scope = second.durability.scope
                rec = await t.backend.inbox_get(scope, "m1")
                assert runs == ["m1", "m1"] and rec is not None and rec.state == "done", (
                    "INB-3/LEASE-4: after a restart with the same instance_id the unfinished record is reprocessed at "
                    f"once and ends done; handler runs {runs!r}, record {_j(rec)!r}"
                )
                assert channel.texts() == ["hello"], (
                    "OUT-2: the reprocessed reply is answered from the outbox, not sent again; the channel got "
                    f"{channel.texts()!r}"
                )
                await channel.receive("chat-1", "hi", id="m1")
                metrics = second.durability.metrics()
                assert runs == ["m1", "m1"] and metrics["inbound_duplicates"] == 1, (
                    f"INB-4: a redelivery whose record exists is recognised and not processed; runs {runs!r}, "
                    f"inbound_duplicates {metrics['inbound_duplicates']}"
                )
            finally:
                await second.abandon()

        self.run_backend(botmesh_harness_factory, tmp_path, body)

    @pytest.mark.spec("OPS-2")
    def test_ops2_an_operator_replays_a_dead_inbound_through_the_bot(
        self, botmesh_harness_factory: HarnessFactory, tmp_path: Any
    ) -> None:
        """OPS-2 (through a Bot on the backend): an inbound record in the DLQ is listed
        by ``bot.durability.inbox.list(state="dead")``; ``replay_inbound(id)`` runs
        its handler again from the journaled event; the record ends ``done`` and leaves
        the DLQ."""

        async def body(t: DurabilityTest) -> None:
            from botmesh.core.testing import MockProvider

            clock, channel = _clock(), MockProvider()
            bot = _bot(t, channel, clock, instance_id="e2e-1")
            d = bot.durability
            assert d is not None
            runs: list[str] = []

            @bot.when("hi")
            async def hi(ctx: Any) -> None:
                runs.append(ctx.text)
                await ctx.reply(f"replayed: {ctx.text}")

            await t.backend.inbox_journal(d.scope, inbound("m1", text="hi", owner="dead-process"))
            assert await t.backend.inbox_kill(d.scope, "m1", token=None, now=T0, error="poison") is True
            await bot.start()
            try:
                dead = [r.id for r in await d.inbox.list(state="dead")]
                assert dead == ["m1"], f"OPS-2: inbox.list(state='dead') lists the DLQ; got {dead!r}"
                ok = await d.replay_inbound("m1")
                assert ok is True and runs == ["hi"] and channel.texts() == ["replayed: hi"], (
                    f"OPS-2: replay_inbound runs the handler again from the journaled event; it returned {ok!r}, "
                    f"runs {runs!r}, sent {channel.texts()!r}"
                )
                rec = await t.backend.inbox_get(d.scope, "m1")
                dead = [r.id for r in await d.inbox.list(state="dead")]
                assert rec is not None and rec.state == "done" and dead == [], (
                    f"OPS-2: the replayed record ends done and leaves the DLQ; record {_j(rec)!r}, DLQ {dead!r}"
                )
            finally:
                await bot.abandon()

        self.run_backend(botmesh_harness_factory, tmp_path, body)


def _clock() -> Any:
    from botmesh.core.clock import VirtualClock

    return VirtualClock(T0)


def _bot(t: DurabilityTest, channel: Any, clock: Any, *, instance_id: str, backend: DurabilityBackend | None = None) -> Bot:
    """A bot on the test's backend (or a wrapper of it) and store, in a scope of its own
    (its bot id carries the test's random tag)."""
    from botmesh.core import Bot

    tag = t.scopes.a.split("/")[1]
    bot = Bot(
        channel, t.store, {"backend": backend or t.backend, "instance_id": instance_id},
        bot_id=f"conformance-{tag}", clock=clock, rng=random.Random(0),
    )
    if bot.durability is not None and bot.durability.scope not in t.bot_scopes:
        t.bot_scopes.append(bot.durability.scope)
    return bot

