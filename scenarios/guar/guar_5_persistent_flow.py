"""GUAR-5: the process dies while a persistent flow waits for an answer — the flow
resumes from its checkpoint; the pending question is not repeated; the next message is
taken as its answer."""

from typing import Any

from botmesh.core.bot import Context
from botmesh.core.flows import Flow

from botmesh_testkit.scenario import Scenario, scenario


def order_flow(s: Scenario) -> None:
    async def confirm(ctx: Context, state: dict[str, Any]) -> None:
        await ctx.reply(f"ordered {state['qty']} for {state['name']}")

    s.when("order", Flow("order").ask("name?", save_as="name").ask("how many?", save_as="qty")
           .then(confirm).persistent())


@scenario("GUAR-5", "FLOW-1")
async def resumes_from_the_checkpoint(s: Scenario) -> None:
    order_flow(s)
    await s.start()
    await s.receive("c1", "order", id="m1")
    await s.receive("c1", "Ana", id="m2")
    await s.restart()  # the process dies while the flow waits for "how many?"
    await s.receive("c1", "3", id="m3")
    await s.drain()
    s.expect_delivered(["name?", "how many?", "ordered 3 for Ana"])


@scenario("GUAR-5", "FLOW-1", "INB-9")
async def a_replayed_answer_is_not_applied_twice(s: Scenario) -> None:
    order_flow(s)
    await s.start(crash_before="inbox.complete#2")  # the answer's checkpoint is written, not acknowledged
    await s.receive("c1", "order", id="m1")
    await s.receive("c1", "Ana", id="m2")
    s.expect_crashed()
    await s.restart()
    await s.drain()
    await s.receive("c1", "3", id="m3")
    await s.drain()
    s.expect_delivered(["name?", "how many?", "ordered 3 for Ana"])
