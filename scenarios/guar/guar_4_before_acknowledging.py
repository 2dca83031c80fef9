"""GUAR-4: the process dies after recording the send, before acknowledging the inbound
— reprocessed; every reply answered from the outbox."""

from botmesh.core.bot import Context

from botmesh_testkit.scenario import Scenario, scenario


@scenario("GUAR-4", "OUT-2", "INB-9")
async def dies_before_completing_the_inbound(s: Scenario) -> None:
    runs: list[str | None] = []

    @s.on_message
    async def handler(ctx: Context) -> None:
        runs.append(ctx.record_id)
        await ctx.reply("one")
        await ctx.reply("two")

    await s.start(crash_before="inbox.complete")
    await s.receive("c1", "hi", id="m1")
    s.expect_crashed()
    await s.restart()
    await s.drain()
    s.expect(runs == ["m1", "m1"], f"the handler ran for {runs}, expected twice for m1 (at-least-once)")
    s.expect_delivered(["one", "two"])
    s.expect(s.metrics()["outbox_deduped"] == 2, "both replies of the second run should be answered from the outbox")
    await s.expect_states(inbox={"m1": "done"}, outbox={"m1:1": "sent", "m1:2": "sent"})
