"""GUAR-3: the process dies between "calling the provider" and "recorded sent" —
ambiguous (OUT-14): ``skip`` never duplicates and marks the send ``unknown``;
``resend`` never loses; both emit ``durability:ambiguous`` and count
``outbox_ambiguous``."""

from botmesh.core.bot import Context

from botmesh_testkit.scenario import Scenario, scenario


@scenario("GUAR-3", "OUT-14", "OPS-1", policies=["skip", "resend"])
async def dies_after_the_channel_accepted(s: Scenario) -> None:
    @s.on_message
    async def handler(ctx: Context) -> None:
        await ctx.reply(f"one:{ctx.text}")
        await ctx.reply(f"two:{ctx.text}")

    await s.start(crash_after="provider.send")
    await s.receive("c1", "hi", id="m1")
    s.expect_crashed()
    await s.restart()
    await s.receive("c1", "hi", id="m1")
    await s.drain()
    s.expect(s.events("durability:ambiguous") == [{"key": "m1:1", "chat_id": "c1"}],
             f"durability:ambiguous events {s.events('durability:ambiguous')}, expected one for m1:1 in c1",
             ids=["OPS-1"])  # an event missing breaks OPS-1 alone, not the guarantee
    s.expect(s.metrics()["outbox_ambiguous"] == 1, "outbox_ambiguous should count the ambiguous send once",
             ids=["OPS-1"])
    if s.policy == "skip":
        s.expect_delivered(["one:hi", "two:hi"])
        await s.expect_states(outbox={"m1:1": "unknown", "m1:2": "sent"})
    else:
        s.expect_delivered(["one:hi", "one:hi", "two:hi"])
        await s.expect_states(outbox={"m1:1": "sent", "m1:2": "sent"})
