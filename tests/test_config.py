"""Configuration of durability (CONF-1, OUT-17), turning it on (ENABLE-1, ENABLE-2) and
the backoff formula (RETRY-1)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from botmesh.core import (
    Bot,
    ConfigError,
    MemoryDurability,
    MemoryStore,
    ProviderError,
    RateLimitedError,
    VirtualClock,
    parse_duration,
)
from botmesh.core.backend import READ_OPS, WRITE_OPS
from botmesh.core.config import Backoff
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh.core.testing import MockProvider

from botmesh_testkit.crash import World

SECOND = 1000.0
MINUTE = 60 * SECOND
DAY = 86_400_000.0


def _bot(durability: Any) -> Bot:
    return Bot(MockProvider(), MemoryStore(), durability, clock=VirtualClock())


# -- CONF-1: durations ----------------------------------------------------------------------


@pytest.mark.spec("CONF-1")
@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("250ms", 250.0),
        ("15s", 15_000.0),
        ("5m", 5 * MINUTE),
        ("2h", 2 * 3_600_000.0),
        ("7d", 7 * DAY),
        ("1.5s", 1500.0),
        ("1500", 1500.0),
        (1500, 1500.0),
        (2.5, 2.5),
        (0, 0.0),
    ],
)
def test_durations_parse(value: Any, ms: float) -> None:
    """CONF-1: a duration is a string with a unit (ms, s, m, h, d) or milliseconds."""
    assert parse_duration(value, "durability.poll_ms") == ms


@pytest.mark.spec("CONF-1")
@pytest.mark.parametrize(
    ("option", "value", "ms"),
    [
        ("poll_ms", "1ms", 1.0),
        ("poll_ms", 1, 1.0),
        ("retention", "365d", 365 * DAY),
        ("retention", 365 * 86_400_000, 365 * DAY),
        ("retention", 0, 0.0),
        ("outbox", {"lease_ms": "20ms"}, 20.0),
        ("inbox", {"backoff": {"base_ms": 0, "cap_ms": "0.5ms"}}, 0.5),
    ],
)
def test_durations_at_the_bounds_are_accepted(option: str, value: Any, ms: float) -> None:
    """CONF-1 (issue 13): the bounds themselves are accepted — poll_ms from 1 ms, lease_ms
    from 20 ms, any duration up to one year, retention 0 (kept for ever)."""
    bot = _bot({option: value})
    assert bot.durability is not None
    cfg = bot.durability.config
    got = {"poll_ms": cfg.poll_ms, "retention": cfg.retention_ms, "outbox": cfg.outbox.lease_ms,
           "inbox": cfg.inbox.backoff.cap_ms}[option]
    assert got == ms


@pytest.mark.spec("CONF-1")
def test_durations_reach_the_bot_config() -> None:
    """CONF-1: every duration option of the CONF table accepts a string or milliseconds,
    and the bot uses the parsed value (in ms)."""
    bot = _bot(
        {
            "poll_ms": "250ms",
            "retention": "7d",
            "inbox": {"lease_ms": "5m", "backoff": {"base_ms": "2s", "cap_ms": "1m"}},
            "outbox": {"inline_max_ms": "15s", "lease_ms": 30_000, "backoff": {"base_ms": 100, "cap_ms": "10s"}},
        }
    )
    assert bot.durability is not None
    cfg = bot.durability.config
    assert cfg.poll_ms == 250.0
    assert cfg.retention_ms == 7 * DAY
    assert cfg.inbox.lease_ms == 5 * MINUTE
    assert (cfg.inbox.backoff.base_ms, cfg.inbox.backoff.cap_ms) == (2000.0, MINUTE)
    assert cfg.outbox.inline_max_ms == 15_000.0
    assert cfg.outbox.lease_ms == 30_000.0
    assert (cfg.outbox.backoff.base_ms, cfg.outbox.backoff.cap_ms) == (100.0, 10_000.0)


@pytest.mark.spec("CONF-1")
def test_defaults_of_the_conf_table() -> None:
    """CONF-1 (table): the defaults of every option."""
    bot = _bot({})
    assert bot.durability is not None
    cfg = bot.durability.config
    assert cfg.fail_open is False
    assert cfg.inbox.lease_ms == 60_000.0
    assert cfg.inbox.max_attempts == 5
    assert cfg.inbox.backoff == Backoff(1000.0, 60_000.0, 0.2)
    assert cfg.inbox.media_refs is True
    assert cfg.outbox.retries == 5
    assert cfg.outbox.backoff == cfg.inbox.backoff
    assert cfg.outbox.inline_max_ms == 15_000.0
    assert cfg.outbox.on_ambiguous == "skip"
    assert cfg.outbox.on_diverged == "send"
    assert cfg.outbox.max_payload_bytes == 1024 * 1024
    assert cfg.outbox.lease_ms == 60_000.0
    assert cfg.poll_ms == 1000.0
    assert cfg.retention_ms == 7 * DAY


@pytest.mark.spec("CONF-1")
def test_outbox_backoff_defaults_to_the_inbox_backoff() -> None:
    """CONF table: ``outbox.backoff`` is "as ``inbox.backoff``" when not given."""
    bot = _bot({"inbox": {"backoff": {"base_ms": "3s", "cap_ms": "30s", "jitter": 0}}})
    assert bot.durability is not None
    assert bot.durability.config.outbox.backoff == Backoff(3000.0, 30_000.0, 0.0)


BAD_VALUES = [
    # (durability setting, option named)
    ({"poll_ms": "15 parsecs"}, "durability.poll_ms"),
    ({"poll_ms": "s"}, "durability.poll_ms"),
    ({"poll_ms": "-5s"}, "durability.poll_ms"),
    ({"poll_ms": " 30s "}, "durability.poll_ms"),
    ({"poll_ms": "0.9ms"}, "durability.poll_ms"),
    ({"retention": "366d"}, "durability.retention"),
    ({"retention": -1}, "durability.retention"),
    ({"retention": True}, "durability.retention"),
    ({"retention": "forever"}, "durability.retention"),
    ({"retention": float("nan")}, "durability.retention"),
    ({"poll_ms": None}, "durability.poll_ms"),
    ({"inbox": {"lease_ms": False}}, "durability.inbox.lease_ms"),
    ({"outbox": {"inline_max_ms": [15]}}, "durability.outbox.inline_max_ms"),
    ({"outbox": {"inline_max_ms": -1}}, "durability.outbox.inline_max_ms"),
    ({"bogus": 1}, "durability.bogus"),
    ({"inbox": {"max_attempt": 3}}, "durability.inbox.max_attempt"),
    ({"outbox": {"on_ambiguos": "skip"}}, "durability.outbox.on_ambiguos"),
    ({"outbox": {"backoff": {"base": 1}}}, "durability.outbox.backoff.base"),
    ({"outbox": {"on_ambiguous": "maybe"}}, "durability.outbox.on_ambiguous"),
    ({"outbox": {"on_diverged": "resend"}}, "durability.outbox.on_diverged"),
    ({"outbox": {"lease_ms": "10ms"}}, "durability.outbox.lease_ms"),
    ({"outbox": {"lease_ms": 19.9}}, "durability.outbox.lease_ms"),
    ({"outbox": {"retries": -1}}, "durability.outbox.retries"),
    ({"outbox": {"retries": 2.5}}, "durability.outbox.retries"),
    ({"outbox": {"retries": True}}, "durability.outbox.retries"),
    ({"outbox": {"max_payload_bytes": 0}}, "durability.outbox.max_payload_bytes"),
    ({"inbox": {"max_attempts": 0}}, "durability.inbox.max_attempts"),
    ({"inbox": {"media_refs": "yes"}}, "durability.inbox.media_refs"),
    ({"inbox": {"backoff": {"jitter": 2}}}, "durability.inbox.backoff.jitter"),
    ({"outbox": {"backoff": {"jitter": -0.1}}}, "durability.outbox.backoff.jitter"),
    ({"outbox": {"backoff": {"jitter": True}}}, "durability.outbox.backoff.jitter"),
    ({"inbox": {"backoff": {"base_ms": "1x"}}}, "durability.inbox.backoff.base_ms"),
    ({"backend": object()}, "durability.backend"),
    ({"backend": "memory"}, "durability.backend"),
    ({"fail_open": 1}, "durability.fail_open"),
    ({"instance_id": ""}, "durability.instance_id"),
    ({"inbox": []}, "durability.inbox"),
]


@pytest.mark.spec("CONF-1", "OUT-17")
@pytest.mark.parametrize(("setting", "option"), BAD_VALUES, ids=[f"{o}-{i}" for i, (_, o) in enumerate(BAD_VALUES)])
def test_bad_value_is_rejected_when_the_bot_is_built(setting: dict[str, Any], option: str) -> None:
    """CONF-1: a bad value raises ConfigError at ``Bot(...)``, naming the exact option in
    ``.option`` and in the message. OUT-17: ``outbox.lease_ms`` below 20 ms is one."""
    with pytest.raises(ConfigError) as info:
        _bot(setting)
    assert info.value.option == option
    message = str(info.value)
    parent, _, leaf = option.rpartition(".")
    # the message names the option: its full dotted name, or (an unknown key) the
    # mapping it sits in and the key as given
    assert option in message or (parent in message and repr(leaf) in message), message
    assert info.value.code == "CONFIG_INVALID"


@pytest.mark.spec("CONF-1")
def test_durability_must_be_a_dict() -> None:
    """CONF-1: the setting itself is validated."""
    with pytest.raises(ConfigError) as info:
        _bot("on")
    assert info.value.option == "durability"


@pytest.mark.spec("CONF-1")
@pytest.mark.parametrize(
    ("good", "bad", "option"),
    [
        ({"outbox": {"retries": 1}}, {"outbox": {"retries": True}}, "durability.outbox.retries"),
        ({"inbox": {"max_attempts": 2}}, {"inbox": {"max_attempts": 2.0}}, "durability.inbox.max_attempts"),
        ({"fail_open": False}, {"fail_open": 0}, "durability.fail_open"),
    ],
)
def test_a_bad_value_equal_to_a_good_one_is_still_rejected(good: dict[str, Any], bad: dict[str, Any], option: str) -> None:
    """CONF-1: a setting validated once is not taken for another that compares equal to
    it (``True == 1``, ``2.0 == 2``, ``0 == False``): each bot's setting is judged as given."""
    for _ in range(2):
        assert _bot(good).durability is not None
        with pytest.raises(ConfigError) as info:
            _bot(bad)
        assert info.value.option == option


@pytest.mark.spec("CONF-1", "ENABLE-2")
def test_bots_built_from_one_setting_get_its_values_and_their_own_backend() -> None:
    """CONF-1: two bots of one setting have the same validated values; the backend of
    each is the one it was given (or a fresh memory backend each, ENABLE-2)."""
    setting = {"instance_id": "i1", "outbox": {"on_ambiguous": "resend", "lease_ms": "2s"}, "poll_ms": 250}
    given = MemoryDurability()
    a, b, c = _bot(setting), _bot(setting), _bot({**setting, "backend": given})
    assert a.durability is not None and b.durability is not None and c.durability is not None
    assert a.durability.config.outbox.on_ambiguous == "resend" and a.durability.config.outbox.lease_ms == 2000.0
    assert a.durability.config.poll_ms == 250.0 and a.durability.config.instance_id == "i1"
    assert a.durability.config.inbox == b.durability.config.inbox == c.durability.config.inbox
    assert a.durability.backend is not b.durability.backend and c.durability.backend is given


@pytest.mark.spec("OUT-17")
@pytest.mark.parametrize("value", [20, "20ms", "0.02s", "1s"])
def test_outbox_lease_of_20ms_or_more_is_accepted(value: Any) -> None:
    """OUT-17: 20 ms is the smallest accepted ``outbox.lease_ms``."""
    bot = _bot({"outbox": {"lease_ms": value}})
    assert bot.durability is not None
    assert bot.durability.config.outbox.lease_ms == parse_duration(value, "x")
    assert bot.durability.config.outbox.lease_ms >= 20


# -- ENABLE ---------------------------------------------------------------------------------


@pytest.fixture
def journal_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of a journal operation of any KvDurability, and of any MemoryKv, made
    anywhere in the process."""
    calls: list[str] = []

    def spy(cls: type, name: str) -> None:
        original = getattr(cls, name)

        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"{cls.__name__}.{name}")
            return await original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for name in [*WRITE_OPS.values(), *READ_OPS.values()]:
        spy(KvDurability, name)
    for name in ("get", "put", "delete", "range", "scan"):
        spy(MemoryKv, name)
    return calls


def _echo(bot: Bot) -> None:
    @bot.otherwise
    async def echo(ctx: Any) -> None:
        await ctx.reply(f"echo: {ctx.text}")


@pytest.mark.spec("ENABLE-1")
@pytest.mark.parametrize("setting", ["absent", None])
async def test_without_durability_no_journal_is_written(journal_spy: list[str], setting: Any) -> None:
    """ENABLE-1: without a ``durability`` setting the bot has no durability runtime,
    its handlers and sends work, and no journal operation happens at all."""
    channel = MockProvider()
    kwargs = {} if setting == "absent" else {"durability": setting}
    bot = Bot(channel, MemoryStore(), clock=VirtualClock(), **kwargs)
    _echo(bot)
    await bot.start()
    await channel.receive("c1", "hi", id="m1")
    result = await bot.send("c1", "direct", idempotency_key="k1")
    assert channel.texts() == ["echo: hi", "direct"]
    assert result.message_id == channel.sent[1].message_id
    assert bot.durability is None
    assert journal_spy == []
    await bot.stop()


@pytest.mark.spec("ENABLE-1", "ENABLE-2")
async def test_with_empty_durability_the_journals_are_written(journal_spy: list[str]) -> None:
    """ENABLE-2 (the control of ENABLE-1's spy): with ``durability={}`` the same bot
    journals the inbound event and the reply."""
    channel = MockProvider()
    bot = Bot(channel, MemoryStore(), {}, clock=VirtualClock())
    _echo(bot)
    await bot.start()
    await channel.receive("c1", "hi", id="m1")
    assert channel.texts() == ["echo: hi"]
    assert bot.durability is not None
    assert [r.id for r in await bot.durability.inbox.list()] == ["m1"]
    assert [r.state for r in await bot.durability.inbox.list()] == ["done"]
    outbox = await bot.durability.outbox.list()
    assert [(r.key, r.state, r.message_id) for r in outbox] == [("m1:1", "sent", channel.sent[0].message_id)]
    assert "KvDurability.inbox_journal" in journal_spy
    assert "KvDurability.outbox_journal" in journal_spy
    await bot.abandon()


@pytest.mark.spec("ENABLE-2")
def test_empty_durability_is_a_fresh_memory_backend() -> None:
    """ENABLE-2: ``durability={}`` means a *fresh* MemoryDurability per bot."""
    a, b = _bot({}), _bot({})
    assert a.durability is not None and b.durability is not None
    assert type(a.durability.backend) is MemoryDurability
    assert type(b.durability.backend) is MemoryDurability
    assert a.durability.backend is not b.durability.backend


@pytest.mark.spec("ENABLE-2")
async def test_empty_durability_retries_and_dead_letters() -> None:
    """ENABLE-2: the memory backend still gives retries, backoff and the DLQ."""
    clock = VirtualClock()
    channel = MockProvider()
    bot = Bot(channel, MemoryStore(), {"outbox": {"retries": 2}}, clock=clock, rng=random.Random(1))
    dead: list[dict[str, Any]] = []
    bot.on("durability:dead", dead.append)
    await bot.start()
    channel.fail_when(lambda chat, content: content.get("text") == "doomed", ProviderError("down"))
    channel.fail_next(ProviderError("blip"))
    async with clock.auto():
        ok = await bot.send("c1", "fine", idempotency_key="a")
        assert ok.message_id is not None
        with pytest.raises(Exception) as info:
            await bot.send("c1", "doomed", idempotency_key="b")
    assert type(info.value).__name__ == "SendFailedError"
    assert channel.texts() == ["fine"]
    assert len([c for c in channel.calls if c.content.get("text") == "doomed"]) == 3
    assert bot.durability is not None
    assert [r.key for r in await bot.durability.outbox.list(state="dead")] == ["b"]
    assert [d["id"] for d in dead] == ["b"]
    await bot.abandon()


# -- RETRY-1: the backoff -------------------------------------------------------------------


@pytest.mark.spec("RETRY-1")
@pytest.mark.parametrize(("base", "cap", "jitter"), [(1000.0, 60_000.0, 0.2), (250.0, 5000.0, 0.5), (100.0, 100.0, 1.0)])
def test_backoff_formula(base: float, cap: float, jitter: float) -> None:
    """RETRY-1: ``min(cap_ms, base_ms * 2**(attempt-1))`` spread by ± jitter; rand=0.5
    is the centre, rand 0 and ~1 the ends of the spread."""
    b = Backoff(base, cap, jitter)
    for attempt in range(1, 9):
        raw = min(cap, base * 2 ** (attempt - 1))
        assert b.delay(attempt, 0.5) == pytest.approx(raw)
        assert b.delay(attempt, 0.0) == pytest.approx(raw * (1 - jitter))
        assert b.delay(attempt, 0.999999) == pytest.approx(raw * (1 + jitter), rel=1e-5)
        for r in (0.0, 0.1, 0.3, 0.7, 0.999999):
            d = b.delay(attempt, r)
            assert raw * (1 - jitter) - 1e-9 <= d <= raw * (1 + jitter) + 1e-9


@pytest.mark.spec("RETRY-1")
def test_backoff_default_values() -> None:
    """RETRY-1 with the default ``{base_ms: 1000, cap_ms: 60000, jitter: 0.2}``."""
    b = Backoff()
    assert [b.delay(a, 0.5) for a in range(1, 9)] == [1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000]


def _times_of_calls(world: World, fail_first: int, error: Exception) -> list[float]:
    times: list[float] = []

    def failing(chat_id: str, content: dict[str, Any]) -> bool:
        times.append(world.clock.now())
        return len(times) <= fail_first

    world.channel.fail_when(failing, error)
    return times


@pytest.mark.spec("RETRY-1", "OUT-7")
async def test_send_retries_follow_the_backoff_in_virtual_time(harness: Any) -> None:
    """RETRY-1: with jitter 0 the provider calls of a failing send are
    base, 2*base, 4*base ... apart (inline retries of ``bot.send``)."""
    world = World(
        harness,
        durability={"outbox": {"retries": 5, "inline_max_ms": "1h", "backoff": {"base_ms": 1000, "cap_ms": 3000, "jitter": 0}}},
    )
    bot = await world.start()
    times = _times_of_calls(world, 4, ProviderError("down"))
    async with world.clock.auto():
        result = await bot.send("c1", "hello", idempotency_key="k")
    assert result.message_id is not None
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == [1000, 2000, 3000, 3000]  # capped at cap_ms
    assert world.channel.texts() == ["hello"]
    await world.close()


@pytest.mark.spec("RETRY-1", "OUT-7")
async def test_rate_limit_retry_after_is_a_floor(harness: Any) -> None:
    """RETRY-1: ``RateLimitedError.retry_after_ms`` is a floor of the wait, and a
    shorter ``retry_after_ms`` does not shorten the backoff."""
    world = World(
        harness,
        durability={"outbox": {"inline_max_ms": "1h", "backoff": {"base_ms": 1000, "cap_ms": 60_000, "jitter": 0}}},
    )
    bot = await world.start()
    world.channel.fail_next(RateLimitedError(retry_after_ms=7000))
    world.channel.fail_next(RateLimitedError(retry_after_ms=10))
    calls_at: list[float] = []
    original = world.channel.send

    async def timed(chat_id: str, content: dict[str, Any]) -> str:
        calls_at.append(world.clock.now())
        return await original(chat_id, content)

    world.channel.send = timed  # type: ignore[method-assign]
    async with world.clock.auto():
        result = await bot.send("c1", "hello", idempotency_key="k")
    assert result.message_id is not None
    gaps = [b - a for a, b in itertools.pairwise(calls_at)]
    assert gaps == [7000, 2000]
    await world.close()
