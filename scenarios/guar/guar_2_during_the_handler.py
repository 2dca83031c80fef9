"""GUAR-2: the process dies after journaling the inbound event, before or during the
handler — reprocessed; sends already made are answered from the outbox, missing ones
are sent."""

from botmesh.core.bot import Context

from botmesh_testkit.scenario import Scenario, scenario


def two_replies(s: Scenario) -> None:
    @s.on_message
    async def handler(ctx: Context) -> None:
        await ctx.reply(f"one:{ctx.text}")
        await ctx.reply(f"two:{ctx.text}")


@scenario("GUAR-2", "INB-3", "LEASE-4")
async def dies_before_the_handler(s: Scenario) -> None:
    two_replies(s)
    await s.start(crash_after="inbox.journal")
    await s.receive("c1", "hi", id="m1")
    s.expect_crashed()
    await s.restart()
    await s.advance(1)  # same instance_id: recovered at once, no lease wait (LEASE-4)
    s.expect_delivered(["one:hi", "two:hi"])
    await s.expect_states(inbox={"m1": "done"})


@scenario("GUAR-2", "OUT-2", "INB-9")
async def dies_between_two_sends(s: Scenario) -> None:
    two_replies(s)
    await s.start(crash_before="outbox.journal#2")  # the first reply went out
    await s.receive("c1", "hi", id="m1")
    s.expect_crashed()
    s.expect_delivered(["one:hi"])
    await s.restart()
    await s.receive("c1", "hi", id="m1")
    await s.drain()
    s.expect_delivered(["one:hi", "two:hi"])  # the first answered from the outbox
    s.expect(s.metrics()["outbox_deduped"] == 1, f"outbox_deduped is {s.metrics()['outbox_deduped']}, expected 1")
