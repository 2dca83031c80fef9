"""GUAR-1: the process dies before journaling the inbound event — nothing recorded;
processed if the channel redelivers it."""

from botmesh.core.bot import Context

from botmesh_testkit.scenario import Scenario, scenario


@scenario("GUAR-1", "INB-1", "INB-8")
async def dies_before_journaling(s: Scenario) -> None:
    @s.on_message
    async def echo(ctx: Context) -> None:
        await ctx.reply(f"echo {ctx.text}")

    await s.start(crash_before="inbox.journal")
    s.expect(await s.receive("c1", "hi", id="m1") is False, "the bot acknowledged a message it never journaled")
    s.expect_crashed()
    s.expect_delivered([])
    await s.restart()
    s.expect(await s.inbox() == [], "a record exists although the process died before journaling it")
    await s.receive("c1", "hi", id="m1")  # the channel redelivers
    await s.drain()
    s.expect_delivered(["echo hi"])
    await s.expect_states(inbox={"m1": "done"})
