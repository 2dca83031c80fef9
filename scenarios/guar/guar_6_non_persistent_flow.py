"""GUAR-6: the process dies while a non-persistent flow waits for an answer — the
conversation is lost; the replayed answer is routed as a new message and its reply is
sent (OUT-5)."""

from typing import Any

from botmesh.core.bot import Context
from botmesh.core.flows import Flow

from botmesh_testkit.scenario import Scenario, scenario


@scenario("GUAR-6", "FLOW-1", "OUT-5")
async def the_answer_is_routed_as_a_new_message(s: Scenario) -> None:
    async def confirm(ctx: Context, state: dict[str, Any]) -> None:
        await ctx.reply(f"hello {state['name']}")

    s.when("start", Flow("signup").ask("name?", save_as="name").then(confirm))

    @s.on_message
    async def fallback(ctx: Context) -> None:
        await ctx.reply(f"new message: {ctx.text}")

    await s.start()
    await s.receive("c1", "start", id="m1")
    await s.restart()  # the in-memory conversation dies with the process
    await s.receive("c1", "Ana", id="m2")
    await s.drain()
    s.expect_delivered(["name?", "new message: Ana"])
