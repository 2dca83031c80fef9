"""Workloads of the crash matrix (TEST-4): what a bot does in one cell.

A workload registers handlers on every incarnation (``setup``) and feeds inbound
messages (``inbound``, a list of ``(chat_id, text, id)``) — all of them before the crash
and, as a channel that redelivers (webhooks do), all of them again after the restart.
``channel_failures`` makes the channel refuse the first sends (retryable),
``text_limit`` makes the channel split long texts, and ``store_down_at_restart`` makes
the bot's store (message log, flow checkpoints) fail during the first sweep pass after
the restart, so the replays of that pass fail before their handlers (INB-5). What a run
*should* deliver is not written here: the checker takes it from a crash-free run of the
same workload (the oracle), so a workload cannot disagree with itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botmesh.core.bot import Bot
from botmesh.core.flows import Flow
from botmesh.core.provider import ProviderError


@dataclass(frozen=True)
class Workload:
    """What a bot does in one crash cell: ``setup`` registers its handlers on every
    incarnation, ``inbound`` are the messages fed (again after the restart, as a channel
    redelivers), ``spec_ids`` the requirements it exercises; the rest shape the channel
    and the store (see the module docstring)."""

    name: str
    description: str
    setup: Callable[[Bot], None]
    inbound: list[tuple[str, str, str]]
    spec_ids: tuple[str, ...]
    text_limit: int | None = None
    channel_failures: int = 0
    store_down_at_restart: bool = False
    answers: list[tuple[str, str, str]] = field(default_factory=list)
    """Inbound messages fed only after everything before them settled (flow answers)."""


def _replies(n: int) -> Callable[[Bot], None]:
    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            for i in range(1, n + 1):
                await ctx.reply(f"{ctx.text}/reply {i}")

    return setup


def _enqueue(reminder: Callable[[str], str]) -> Callable[[Bot], None]:
    """A handler that enqueues a keyed reminder (its text from the inbound text) and
    replies."""

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await bot.enqueue(ctx.chat_id, reminder(ctx.text), idempotency_key=f"reminder:{ctx.record_id}")
            await ctx.reply(f"{ctx.text}/scheduled")

    return setup


def _split(bot: Bot) -> None:
    @bot.otherwise
    async def handler(ctx: Any) -> None:
        await ctx.reply(" ".join(f"{ctx.text}-word{i:02d}" for i in range(12)))


def _flow(bot: Bot) -> None:
    async def done(ctx: Any, state: dict[str, Any]) -> None:
        await ctx.reply(f"thanks {state['name']}")

    bot.when("start", Flow("signup").ask("your name?", save_as="name").then(done).persistent())

    @bot.otherwise
    async def other(ctx: Any) -> None:
        await ctx.reply(f"unrouted {ctx.text}")


def _raises(bot: Bot) -> None:
    @bot.otherwise
    async def handler(ctx: Any) -> None:
        await ctx.reply(f"{ctx.text}/before error")
        raise ValueError("handler bug")


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("no-send", "a handler that sends nothing", _replies(0), [("c1", "a", "m1")], ("INB-1", "INB-2", "INB-3")),
        Workload(
            "one-send", "a handler that sends once", _replies(1), [("c1", "a", "m1")],
            ("GUAR-2", "GUAR-3", "GUAR-4", "OUT-1", "OUT-2"),
        ),
        Workload(
            "three-sends", "a handler that sends three times, two messages", _replies(3),
            [("c1", "a", "m1"), ("c2", "b", "m2")], ("GUAR-2", "GUAR-3", "GUAR-4", "OUT-3", "OUT-14"),
        ),
        Workload(
            "enqueue", "a handler that enqueues a keyed reminder and replies",
            _enqueue(lambda text: f"reminder for {text}"), [("c1", "a", "m1")],
            ("OUT-10", "OUT-3", "OUT-4"),
        ),
        Workload(
            "split", "a reply over the channel limit, split in parts", _split, [("c1", "a", "m1")],
            ("OUT-12", "OUT-13"), text_limit=40,
        ),
        Workload(
            "enqueue-split", "an enqueued reminder over the channel limit, split by the sweep",
            _enqueue(lambda text: " ".join(f"{text}-reminder{i:02d}" for i in range(8))),
            [("c1", "a", "m1")], ("OUT-10", "OUT-12", "OUT-13"), text_limit=40,
        ),
        Workload(
            "flow", "a persistent flow waiting for an answer", _flow, [("c1", "start", "m1")], ("GUAR-5", "FLOW-1"),
            answers=[("c1", "Ana", "m2")],
        ),
        Workload(
            "retry", "a send the channel refuses twice before accepting", _replies(1), [("c1", "a", "m1")],
            ("OUT-7", "RETRY-1"), channel_failures=2,
        ),
        Workload("raises", "a handler that sends and then raises", _raises, [("c1", "a", "m1")], ("INB-6",)),
        Workload(
            "store-down", "two replies; the store is down while the restarted bot replays", _replies(2),
            [("c1", "a", "m1")], ("INB-3", "INB-5", "RETRY-1"), store_down_at_restart=True,
        ),
    ]
}


def transient() -> ProviderError:
    return ProviderError("503 from the channel", retryable=True)
