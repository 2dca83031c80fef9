"""GUAR-7: the process dies on every execution of one message — reprocessed until
``inbox.max_attempts`` charged executions, then the DLQ (INB-7); the next start runs
normally."""

from botmesh.core.bot import Bot, Context

from botmesh_testkit.scenario import Scenario, scenario


@scenario("GUAR-7", "INB-7", "OPS-1")
async def a_poison_message_ends_in_the_dlq(s: Scenario) -> None:
    executions: list[str | None] = []

    @s.setup
    def handlers(bot: Bot) -> None:
        @bot.when("poison")
        async def poison(ctx: Context) -> None:
            executions.append(ctx.record_id)
            raise s.die()

        @bot.when("ok")
        async def ok(ctx: Context) -> None:
            await ctx.reply("fine")

    s.configure(inbox={"max_attempts": 3})
    await s.start()
    await s.receive("c1", "poison", id="p1")
    for _ in range(5):
        await s.restart()
        await s.advance(1)
    s.expect(executions == ["p1"] * 3, f"executions {executions}, expected exactly 3 (inbox.max_attempts)")
    await s.expect_states(inbox={"p1": "dead"})
    s.expect([e["id"] for e in s.events("durability:dead")] == ["p1"], "one durability:dead event for p1 expected",
             ids=["OPS-1"])
    await s.receive("c1", "ok", id="m2")
    s.expect_delivered(["fine"])
