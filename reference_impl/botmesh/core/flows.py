"""Conversations (flows): a fixed list of steps, some of which ``ask`` and wait for the
chat's next message. A flow marked :meth:`Flow.persistent` checkpoints in the store at
every step, so a question it waits on survives a restart (FLOW-1, GUAR-5); any other flow
lives in the bot's memory and is lost with the process (GUAR-6).

Checkpoint (store namespace ``"flow"``, key = chat id)::

    {"flow": name, "step": index of the next step, "state": {...},
     "waiting": True while an ask waits, "fed_by": id of the inbound record applied last}

``fed_by`` makes a replayed record that already advanced the flow a no-op: its sends were
journaled before the checkpoint was written, so the outbox answers for them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .host import HandlerContext

_C = TypeVar("_C", bound=HandlerContext)
StepFn = Callable[[_C, dict[str, Any]], Awaitable[Any]]
"""A step of :meth:`Flow.then`: ``await fn(ctx, state)`` with the bot's context."""
Question = str | Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class _Ask:
    question: Question
    save_as: str


@dataclass(frozen=True)
class _Then:
    # Stored without its context type: the bot runs every step with its own Context,
    # the type the step was registered with (checked by then()).
    fn: Callable[[Any, dict[str, Any]], Awaitable[Any]]


class Flow:
    """A conversation, built step by step::

        order = (Flow("order")
                 .ask("What is your name?", save_as="name")
                 .ask(lambda s: f"How many, {s['name']}?", save_as="qty")
                 .then(confirm)
                 .persistent())
        bot.when("order", order)
    """

    def __init__(self, name: str) -> None:
        if not name:
            raise ValueError("a flow needs a name")
        self.name = name
        self.steps: list[_Ask | _Then] = []
        self.is_persistent = False

    def ask(self, question: Question, *, save_as: str) -> Flow:
        """Send ``question`` and wait for the chat's next message; its text is stored in
        the flow state under ``save_as``."""
        self.steps.append(_Ask(question, save_as))
        return self

    def then(self, fn: StepFn[_C]) -> Flow:
        """Run ``await fn(ctx, state)``; return ``"stop"`` to end the flow."""
        self.steps.append(_Then(fn))
        return self

    def persistent(self) -> Flow:
        """Checkpoint in the store at every step (FLOW-1)."""
        self.is_persistent = True
        return self

    async def run(self, ctx: HandlerContext, checkpoint: dict[str, Any] | None) -> dict[str, Any] | None:
        """Run from ``checkpoint`` (None: from the start) until the flow asks or ends.
        Returns the new checkpoint, or None when the flow ended."""
        if checkpoint is None:
            state: dict[str, Any] = {}
            index = 0
        else:
            state = dict(checkpoint.get("state", {}))
            index = int(checkpoint["step"])
            if checkpoint.get("waiting"):
                step = self.steps[index]
                assert isinstance(step, _Ask)
                state[step.save_as] = ctx.text
                index += 1
        while index < len(self.steps):
            step = self.steps[index]
            if isinstance(step, _Ask):
                question = step.question(state) if callable(step.question) else step.question
                await ctx.reply(question)
                return {"flow": self.name, "step": index, "state": state, "waiting": True, "fed_by": ctx.record_id}
            result = await step.fn(ctx, state)
            index += 1
            if result == "stop":
                break
        return None
