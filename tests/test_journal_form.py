"""A send's journal form is made once (issue 16): ``content.journal_form`` gives the
encoding, the fingerprint (OUT-5) and the size checked against
``outbox.max_payload_bytes`` (OUT-15) from one JSON text, and a send without
``before("send")`` hooks journals that very encoding. These tests hold the derived size
to the compact encoding's byte for byte, and the payload limit to it at its edge, with
hooks and without."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botmesh.core import Bot
from botmesh.core.content import encode, encoded_size, fingerprint, journal_form
from hypothesis import given, settings
from hypothesis import strategies as st

from botmesh_testkit.backends.registry import resolve
from botmesh_testkit.crash import World

# strings that take more bytes, or more characters, in JSON than in Python: multi-byte
# UTF-8, quotes and backslashes, control characters (escaped as \n or \u001f)
STRINGS = st.text(alphabet=st.sampled_from(["a", "é", "🙂", '"', "\\", "\n", "\x1f", "/", " "]), max_size=12)
SCALARS = st.one_of(STRINGS, st.integers(-10**20, 10**20), st.booleans(), st.none(),
                    st.floats(allow_nan=False, allow_infinity=False), st.binary(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(STRINGS, inner, max_size=4)), max_leaves=12)


@pytest.mark.spec("OUT-5", "OUT-15")
@settings(max_examples=400, deadline=None, database=None)
@given(chat_id=STRINGS, content=st.dictionaries(STRINGS, VALUES, max_size=5))
def test_the_journal_form_is_the_encoding_its_fingerprint_and_its_compact_size(chat_id: str,
                                                                               content: dict[str, Any]) -> None:
    encoded, fp, size = journal_form(chat_id, content)
    assert encoded == encode(content)
    assert fp == fingerprint(chat_id, encoded)
    assert size == encoded_size(encoded) == len(json.dumps(encoded, ensure_ascii=False,
                                                           separators=(",", ":")).encode("utf-8"))


def _limit_world(tmp: str, content: dict[str, Any], limit: int, hook: Any = None) -> World:
    def setup(bot: Bot) -> None:
        if hook is not None:
            bot.before("send")(hook)

        @bot.otherwise
        async def handler(ctx: Any) -> None:
            await ctx.reply(content)

    return World(resolve("memory")(tmp), setup=setup, durability={"outbox": {"max_payload_bytes": limit}})


async def _journaled(world: World) -> bool:
    """Whether the one reply of message m1 went out through the outbox (False: it was
    sent past it, OUT-15)."""
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    assert bot.durability is not None
    metrics = bot.durability.metrics()
    assert len(world.channel.sent) == 1
    assert metrics["outbox_journaled"] + metrics["outbox_bypassed"] == 1, metrics
    await world.close()
    return metrics["outbox_journaled"] == 1


# 'é' and '🙂' take 2 and 4 bytes, '"' and '\n' two characters in JSON: a size counted
# in characters, or without the escapes, misses the edge
EDGE = {"text": 'é🙂 "quoted"\nline', "n": [1, 2.5, None]}
EDGE_SIZE = len(json.dumps(EDGE, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


@pytest.mark.spec("OUT-15")
@pytest.mark.parametrize("limit, journaled", [(EDGE_SIZE, True), (EDGE_SIZE - 1, False)])
async def test_without_hooks_the_payload_limit_holds_at_its_edge(tmp_path: Any, limit: int, journaled: bool) -> None:
    """A send whose content is exactly ``max_payload_bytes`` of journaled JSON is
    journaled; one byte over, it bypasses the outbox."""
    assert await _journaled(_limit_world(str(tmp_path), EDGE, limit)) is journaled


@pytest.mark.spec("OUT-15")
async def test_a_hook_that_grows_the_content_in_place_is_measured_after_it(tmp_path: Any) -> None:
    """The content a hook changed in place (returning None) is encoded and measured
    again: under the limit before the hook, over it after, it bypasses the outbox, and
    what reaches the channel is the hook's content."""

    def grow(chat_id: str, content: dict[str, Any]) -> None:
        content["text"] += "x" * 50

    world = _limit_world(str(tmp_path), {"text": "short"}, 40, hook=grow)
    assert await _journaled(world) is False
    assert world.channel.texts() == ["short" + "x" * 50]


@pytest.mark.spec("OUT-15", "OUT-10")
async def test_a_hook_that_changes_the_content_in_place_is_what_the_outbox_journals(tmp_path: Any) -> None:
    """Under the limit, the outbox journals the content as the hook left it, not the
    encoding made before the hook ran."""

    def mark(chat_id: str, content: dict[str, Any]) -> None:
        content["text"] = content["text"].upper()

    world = _limit_world(str(tmp_path), {"text": "ok"}, 1000, hook=mark)
    bot = await world.start()
    await world.receive("c1", "hi", id="m1")
    assert bot.durability is not None
    assert [r.content for r in await bot.durability.outbox.list()] == [{"text": "OK"}]
    assert world.channel.texts() == ["OK"]
    await world.close()
