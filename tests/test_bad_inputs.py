"""Bad input at the public API, table-driven, on every built-in backend (issue 13).

One table of the inputs the issue measured — durations (CONF-1), idempotency keys
(OUT-3), inbound ids (INB-1, INB-4) and the keys of the operator API (OPS-2) — is run
against memory, file, SQLite, PostgreSQL and Redis (the local servers, as in
``test_postgres_store.py`` / ``test_redis_store.py``: a missing server fails the tests
unless ``BOTMESH_ALLOW_SKIP_SERVICES=1``). Each backend first gets a bot that journaled
and answered a message and delivered an enqueued send; then every bad input is given to
it. For each row the tests hold, on every backend:

* it is refused with the project's error — ``ConfigError`` for an option,
  ``InvalidKeyError`` (a ``ValueError``) for a key — whose message names the option or
  argument and shows the value, and whose ``option``/``argument`` says the same;
* the error (type and message) is the same on the five backends;
* no backend operation ran during the call (refused before any backend saw it), the
  channel got nothing, and the records already stored are exactly as before.

The paths of the file backend and of SQLite are in ``test_bad_paths.py``.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from botmesh.core import Bot, ConfigError, InboundEvent, InvalidKeyError, VirtualClock
from botmesh.core.backend import READ_OPS, WRITE_OPS, DurabilityBackend
from botmesh.core.testing import MockProvider

from botmesh_testkit.backends import HARNESSES, BackendHarness
from botmesh_testkit.backends.postgres import PostgresHarness
from botmesh_testkit.backends.redis import RedisHarness
from botmesh_testkit.crash import World
from botmesh_testkit.servers import skips_allowed

POSTGRES_URL = os.environ.get("BOTMESH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("BOTMESH_REDIS_URL", "redis://127.0.0.1:6379/0")
BACKENDS = ("memory", "file", "sqlite", "postgres", "redis")
YEAR_MS = 365 * 86_400_000

# -- the table: durations ---------------------------------------------------------------------
DURATION_OPTIONS = (
    "inbox.lease_ms", "outbox.lease_ms", "inbox.backoff.base_ms", "inbox.backoff.cap_ms", "outbox.backoff.base_ms",
    "outbox.backoff.cap_ms", "outbox.inline_max_ms", "poll_ms", "retention",
)
"""Every duration option of the CONF table (their path under ``durability.``)."""

BAD_DURATIONS: list[tuple[str, Any]] = [
    ("inf", math.inf),
    ("minus-inf", -math.inf),
    ("nan", math.nan),
    ("int-10e400", 10**400),
    ("400-digit-days", "1" + "0" * 400 + "d"),
    ("20-digit-days", "99999999999999999999d"),
    ("over-a-year", "366d"),
    ("over-a-year-in-ms", YEAR_MS + 1),
    ("inner-space", "15 s"),
    ("outer-spaces", " 30s "),
    ("trailing-newline", "15s\n"),
    ("full-width-digits", "\uff11\uff15s"),
    ("arabic-indic-digit", "\u0663s"),
    ("exponent", "1e3"),
    ("plus-sign", "+5s"),
    ("negative-string", "-5s"),
    ("negative-number", -1),
    ("unknown-unit", "15 parsecs"),
    ("bool", True),
    ("none", None),
]

PER_OPTION: list[tuple[str, str, Any]] = [
    # (row id, option, value): bounds of one option
    ("poll-1e-9", "poll_ms", 1e-9),
    ("poll-half-ms", "poll_ms", "0.5ms"),
    ("poll-zero", "poll_ms", 0),
    ("inbox-lease-19ms", "inbox.lease_ms", 19),
    ("outbox-lease-10ms", "outbox.lease_ms", "10ms"),
]


def _nested(option: str, value: Any) -> dict[str, Any]:
    """``{"inbox": {"backoff": {"cap_ms": value}}}`` for ``"inbox.backoff.cap_ms"``."""
    setting: Any = value
    for part in reversed(option.split(".")):
        setting = {part: setting}
    assert isinstance(setting, dict)
    return setting


@dataclass(frozen=True)
class ConfigRow:
    id: str
    option: str  # full path, "durability.poll_ms"
    value: Any

    @property
    def setting(self) -> dict[str, Any]:
        return _nested(self.option.removeprefix("durability."), self.value)


CONFIG_ROWS = [ConfigRow(f"{opt}-{name}", f"durability.{opt}", value)
               for opt in DURATION_OPTIONS for name, value in BAD_DURATIONS]
CONFIG_ROWS += [ConfigRow(name, f"durability.{opt}", value) for name, opt, value in PER_OPTION]

# -- the table: keys --------------------------------------------------------------------------
BAD_KEYS: list[tuple[str, Any, bool]] = [
    # (row id, value, bad only as a new id/key: the operator API takes up to 512 characters)
    ("int", 5, False),
    ("bytes", b"k", False),
    ("list", ["k"], False),
    ("float", 1.5, False),
    ("empty", "", False),
    ("449-chars", "x" * 449, True),
    ("513-chars", "y" * 513, False),
    ("10000-chars", "z" * 10_000, False),
    ("lone-surrogate", "a\ud800b", False),
    ("low-surrogate-alone", "\udfff", False),
    ("nul", "a\x00b", False),
]

KeyCall = Callable[[World, Any], Awaitable[Any]]


async def _deliver(w: World, key: Any) -> Any:
    assert w.bot is not None
    return await w.bot.provider.deliver(InboundEvent(id=key, chat_id="c1", text="hi"))


async def _send(w: World, key: Any) -> Any:
    assert w.bot is not None
    return await w.bot.send("c1", "bad", idempotency_key=key)


async def _enqueue(w: World, key: Any) -> Any:
    assert w.bot is not None
    return await w.bot.enqueue("c1", "bad", idempotency_key=key)


async def _broadcast(w: World, key: Any) -> Any:
    assert w.bot is not None
    return await w.bot.broadcast(["c1", "c2"], "bad", idempotency_key=key)


def _runtime(w: World) -> Any:
    assert w.bot is not None and w.bot.durability is not None
    return w.bot.durability


ENTRIES: dict[str, tuple[str, bool, KeyCall]] = {
    # name: (argument named, a new id/key (448 limit) or an existing record's (512), the call)
    "deliver": ("event.id", True, _deliver),
    "send": ("idempotency_key", True, _send),
    "enqueue": ("idempotency_key", True, _enqueue),
    "broadcast": ("idempotency_key", True, _broadcast),
    "replay_inbound": ("id", False, lambda w, k: _runtime(w).replay_inbound(k)),
    "retry_send": ("key", False, lambda w, k: _runtime(w).retry_send(k)),
    "inbox.get": ("id", False, lambda w, k: _runtime(w).inbox.get(k)),
    "outbox.get": ("id", False, lambda w, k: _runtime(w).outbox.get(k)),
    "outbox.discard": ("key", False, lambda w, k: _runtime(w).outbox.discard(k)),
}


@dataclass(frozen=True)
class KeyRow:
    id: str
    entry: str
    value: Any


KEY_ROWS = [KeyRow(f"{entry}-{name}", entry, value) for entry, (_, new, _) in ENTRIES.items()
            for name, value, new_only in BAD_KEYS if new or not new_only]
KEY_ROWS += [KeyRow(f"{entry}-unit-separator", entry, "a\x1f#2") for entry in ("send", "enqueue", "broadcast")]
"""U+001F is reserved for the keys of a split text's parts (OUT-12): refused in an
explicit key only."""

REPLY_ROWS = [KeyRow(f"reply-{name}", "reply", value) for name, value, _ in BAD_KEYS]
"""``ctx.reply(..., idempotency_key=bad)`` inside a handler: the handler's ``error``
event carries the refusal (INB-6), nothing is sent or journaled for the send."""


# -- running the table ------------------------------------------------------------------------
@dataclass
class Outcome:
    error: BaseException | None
    calls: list[str]
    unchanged: bool
    sent: int
    result: Any = None

    @property
    def kind(self) -> str:
        return type(self.error).__name__ if self.error is not None else "accepted"

    @property
    def message(self) -> str:
        return str(self.error) if self.error is not None else f"accepted: {self.result!r}"


@dataclass
class BackendRun:
    name: str
    config: dict[str, Outcome] = field(default_factory=dict)
    keys: dict[str, Outcome] = field(default_factory=dict)
    replies: dict[str, Outcome] = field(default_factory=dict)


def _spy(backend: DurabilityBackend) -> list[str]:
    """Record every journal operation the engine calls on ``backend`` (its instance
    attributes shadow the methods)."""
    calls: list[str] = []
    for name in (*WRITE_OPS.values(), *READ_OPS.values()):
        original = getattr(backend, name)

        def wrapper(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(backend, name, wrapper)
    return calls


async def _stored(w: World) -> Any:
    d = _runtime(w)
    inbox = sorted((r.to_json() for r in await d.backend.inbox_list(d.scope)), key=lambda r: str(r["id"]))
    outbox = sorted((r.to_json() for r in await d.backend.outbox_list(d.scope)), key=lambda r: str(r["key"]))
    return inbox, outbox


REPLY_KEYS = {f"reply-{name}": value for name, value, _ in BAD_KEYS}


def _setup(bot: Bot) -> None:
    @bot.when("hi")
    async def hi(ctx: Any) -> None:
        await ctx.reply("hello")

    @bot.otherwise
    async def other(ctx: Any) -> None:
        await ctx.reply("never sent", idempotency_key=REPLY_KEYS[ctx.text])


def _harness(name: str, workdir: str) -> BackendHarness:
    if name == "postgres":
        return PostgresHarness(workdir, url=POSTGRES_URL)
    if name == "redis":
        return RedisHarness(workdir, url=REDIS_URL)
    return HARNESSES[name](workdir)


async def _listed(w: World) -> Any:
    """What is stored, or None when it cannot even be listed any more (an earlier input
    broke the backend)."""
    try:
        return await _stored(w)
    except Exception:  # noqa: BLE001 - reported as "changed" by the tests
        return None


async def _refused(w: World, call: Callable[[], Awaitable[Any]], calls: list[str]) -> Outcome:
    before = await _listed(w)
    sent = len(w.channel.sent)
    calls.clear()
    error: BaseException | None = None
    result: Any = None
    try:
        result = await w.drive(call())
    except Exception as exc:  # the outcome under test
        error = exc
    made = list(calls)
    await w.clock.settle()
    after = await _listed(w)
    return Outcome(error, made, before is not None and after == before, len(w.channel.sent) - sent, result)


async def _seeded(name: str, workdir: str) -> World:
    """A started bot on backend ``name`` that answered a message and delivered an
    enqueued send: records in both journals."""
    os.makedirs(workdir)
    w = World(_harness(name, workdir), setup=_setup)
    await w.start()
    assert await w.receive("c1", "hi", id="m1")
    await w.call(lambda bot: bot.enqueue("c1", "later", idempotency_key="enq-1"))
    await w.drain()
    assert w.channel.texts() == ["hello", "later"], w.channel.texts()
    return w


async def _run_backend(name: str, workdir: str) -> BackendRun:
    run = BackendRun(name)
    w = await _seeded(name, os.path.join(workdir, "calls"))
    try:
        d = _runtime(w)
        calls = _spy(d.backend)
        for row in KEY_ROWS:
            call = ENTRIES[row.entry][2]
            run.keys[row.id] = await _refused(w, lambda call=call, value=row.value: call(w, value), calls)
        for row in CONFIG_ROWS:
            def build(row: ConfigRow = row) -> Any:
                return Bot(MockProvider(), w.store, {"backend": d.backend, "instance_id": "i2", **row.setting},
                           clock=VirtualClock())

            async def building(build: Callable[[], Any] = build) -> Any:
                return build()

            run.config[row.id] = await _refused(w, building, calls)
    finally:
        await w.close()
    w = await _seeded(name, os.path.join(workdir, "replies"))
    try:
        for row in REPLY_ROWS:
            errors = len(w.named("error"))
            stored_before = await _listed(w)
            sent = len(w.channel.sent)
            await w.receive("c1", row.id, id=f"in-{row.id}")
            try:
                await w.drain()
            except Exception as exc:  # noqa: BLE001 - the backend broke: reported as the row's outcome
                run.replies[row.id] = Outcome(exc, [], False, len(w.channel.sent) - sent)
                continue
            new = w.named("error")[errors:]
            error = new[0]["error"] if len(new) == 1 and new[0].get("stage") == "handler" else None
            if error is None and new:
                error = RuntimeError(f"unexpected error events: {new!r}")
            stored_after = await _listed(w)
            unchanged = stored_before is not None and stored_after is not None and stored_after[1] == stored_before[1]
            run.replies[row.id] = Outcome(error, [], unchanged, len(w.channel.sent) - sent)
    finally:
        await w.close()
    return run


def _servers_reachable() -> None:
    import psycopg
    import redis

    problems = []
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        problems.append(f"PostgreSQL at {POSTGRES_URL}: {exc}")
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        problems.append(f"Redis at {REDIS_URL}: {exc}")
    finally:
        client.close()
    if problems:
        message = "; ".join(problems) + " (BOTMESH_POSTGRES_URL / BOTMESH_REDIS_URL)"
        if skips_allowed():
            pytest.skip(message)
        pytest.fail(message + " -- set BOTMESH_ALLOW_SKIP_SERVICES=1 to skip these tests instead", pytrace=False)


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, BackendRun]]:
    """The whole table run once on each backend (per test process)."""
    _servers_reachable()
    with tempfile.TemporaryDirectory(prefix="botmesh-bad-inputs-") as tmp:
        async def main() -> dict[str, BackendRun]:
            found = {}
            for name in BACKENDS:
                workdir = os.path.join(tmp, name)
                found[name] = await asyncio.wait_for(_run_backend(name, workdir), 300)
            return found

        yield asyncio.run(main())


def _same_everywhere(outcomes: dict[str, Outcome]) -> Outcome:
    """The one outcome of every backend; fails listing them when they differ."""
    distinct = {(o.kind, o.message) for o in outcomes.values()}
    assert len(distinct) == 1, "the backends answer differently:\n" + "\n".join(
        f"  {name}: {o.kind}: {o.message[:200]}" for name, o in outcomes.items())
    return next(iter(outcomes.values()))


def _shows(message: str, value: Any) -> bool:
    """Whether ``message`` shows ``value``: its repr, or the start of it when long."""
    return repr(value)[:40] in message


def _untouched(outcomes: dict[str, Outcome]) -> None:
    for name, o in outcomes.items():
        assert o.calls == [], f"{name}: the backend was called before the refusal: {o.calls}"
        assert o.unchanged, f"{name}: the records already stored changed"
        assert o.sent == 0, f"{name}: the channel got {o.sent} message(s)"


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.spec("CONF-1", "OUT-17")
@pytest.mark.parametrize("row", CONFIG_ROWS, ids=[r.id for r in CONFIG_ROWS])
def test_a_bad_duration_is_refused_naming_the_option_and_the_value_on_every_backend(
        runs: dict[str, BackendRun], row: ConfigRow) -> None:
    """CONF-1: a duration that is not finite, not in [0, 1 year] (poll_ms from 1 ms,
    lease_ms from 20 ms) or not exactly ``<ASCII digits>[.<digits>][unit]`` raises
    ConfigError when the bot is built, naming the option path and the value — the same
    on every backend, which is not touched."""
    outcomes = {name: run.config[row.id] for name, run in runs.items()}
    outcome = _same_everywhere(outcomes)
    assert isinstance(outcome.error, ConfigError), f"{row.option}={row.value!r:.60}: {outcome.kind}: {outcome.message}"
    assert outcome.error.option == row.option
    assert outcome.error.details["value"] is row.value
    assert row.option in outcome.message and _shows(outcome.message, row.value), outcome.message
    _untouched(outcomes)


@pytest.mark.spec("OUT-3", "INB-1", "INB-4", "OPS-2", "BACK-7")
@pytest.mark.parametrize("row", KEY_ROWS, ids=[r.id for r in KEY_ROWS])
def test_a_bad_key_or_id_is_refused_before_any_backend_sees_it(runs: dict[str, BackendRun], row: KeyRow) -> None:
    """OUT-3, INB-1: an idempotency key or inbound id that is not a non-empty str of at
    most 448 characters, valid Unicode without U+0000 (a key of the operator API: up to
    512; an explicit key: without U+001F, OUT-12) raises InvalidKeyError — a ValueError,
    and a TypeError when it is not a str — naming the argument and the value, the same
    on every backend; no backend operation ran, nothing was sent, nothing stored
    changed."""
    argument = ENTRIES[row.entry][0]
    outcomes = {name: run.keys[row.id] for name, run in runs.items()}
    outcome = _same_everywhere(outcomes)
    assert isinstance(outcome.error, InvalidKeyError), f"{row.entry}({row.value!r:.60}): {outcome.kind}: {outcome.message}"
    assert isinstance(outcome.error, ValueError)
    assert isinstance(outcome.error, TypeError) is not isinstance(row.value, str), "a TypeError too: only for a non-str"
    assert outcome.error.details["argument"] == argument and outcome.error.details["value"] is row.value
    assert outcome.message.startswith(argument + " ") and _shows(outcome.message, row.value), outcome.message
    _untouched(outcomes)


@pytest.mark.spec("OUT-3", "INB-6")
@pytest.mark.parametrize("row", REPLY_ROWS, ids=[r.id for r in REPLY_ROWS])
def test_a_bad_key_given_to_reply_is_the_handlers_error_and_nothing_is_sent(
        runs: dict[str, BackendRun], row: KeyRow) -> None:
    """OUT-3, INB-6: ``ctx.reply(..., idempotency_key=bad)`` raises InvalidKeyError in
    the handler (reported as its ``error`` event, the same on every backend); the send
    is neither journaled nor sent."""
    outcomes = {name: run.replies[row.id] for name, run in runs.items()}
    outcome = _same_everywhere(outcomes)
    assert isinstance(outcome.error, InvalidKeyError), f"{outcome.kind}: {outcome.message}"
    assert outcome.message.startswith("idempotency_key ") and _shows(outcome.message, row.value)
    for name, o in outcomes.items():
        assert o.unchanged and o.sent == 0, f"{name}: the refused send was journaled or sent"


@pytest.mark.spec("OUT-3", "INB-1", "BACK-7")
def test_keys_at_the_limits_are_accepted_on_every_backend(tmp_path: Any) -> None:
    """The other side of the table: an inbound id and an explicit key of 448 characters
    (4-byte ones included), keys with control characters other than U+0000, spaces only,
    U+FFFF: taken, sent once and answered from the outbox when sent again, on every
    backend (derived keys of a 448-character id stay within the kv's 512)."""
    _servers_reachable()
    ids = ["i" * 448, "\U0001f916" * 448, "tab\tnew\nline\x01", " ", "\uffff"]

    def setup(bot: Bot) -> None:
        @bot.otherwise
        async def echo(ctx: Any) -> None:
            await ctx.reply(f"re {len(ctx.event.id)}")
            await ctx.reply(f"re2 {len(ctx.event.id)}")

    async def main() -> None:
        for name in BACKENDS:
            (tmp_path / name).mkdir()
            w = World(_harness(name, str(tmp_path / name)), setup=setup)
            try:
                await w.start()
                for i, id in enumerate(ids):
                    assert await w.receive("c1", f"t{i}", id=id)
                    assert await w.receive("c1", f"t{i}", id=id)  # a redelivery: not processed again
                    result = await w.call(lambda bot, id=id: bot.send("c2", "x", idempotency_key=id))
                    again = await w.call(lambda bot, id=id: bot.send("c2", "x", idempotency_key=id))
                    assert again.deduped and again.message_id == result.message_id, name
                await w.drain()
                assert w.named("error") == [], f"{name}: {w.named('error')}"
                assert len(w.channel.texts("c1")) == 2 * len(ids) and len(w.channel.texts("c2")) == len(ids), name
                d = _runtime(w)
                assert sorted(r.id for r in await d.backend.inbox_list(d.scope)) == sorted(ids), name
            finally:
                await w.close()

    asyncio.run(main())
