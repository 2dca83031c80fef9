"""Tests of ``botmesh.sqlite_store``: the SQLite store, its ``DurableKv`` (``SQLiteKv``)
and its durability backend (``SQLiteStore(...).durability()``).

Spec ids: BACK-1 (journals in table ``durable`` of the store's file, created with the
rest of the schema), BACK-3 (no backend touches the store's tables), BACK-7 (a
``DurableKv`` wrapped in ``KvDurability``; behaves like ``MemoryKv``), REPL-1/REPL-4
(processes of one host sharing the file: exactly one CAS winner / claimer), the BACK
table row "survives a crash: yes".

Plain pytest: every test is synchronous and drives its coroutine with ``asyncio.run``.
The multi-process tests start real interpreters (``subprocess``) that meet at a barrier
on their stdin; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from botmesh.core.errors import BackendUnavailableError, ConfigError, JournalCorruptError, VersionConflict
from botmesh.core.records import InboxRecord
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh.core.spi import Capabilities, DurableKv, Versioned
from botmesh.core.store import MemoryStore, Store
from botmesh.sqlite_store import SQLiteDurability, SQLiteKv, SQLiteStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REFERENCE_IMPL = Path(__file__).resolve().parent.parent / "reference_impl"

T = TypeVar("T")
INF = float("inf")
STORE_TABLES = {"kv", "messages"}
DURABLE_TABLE = "durable"
WORKER_TIMEOUT_S = 120


def run(factory: Callable[[], Awaitable[T]]) -> T:
    """Run one coroutine to completion in a fresh event loop."""

    async def main() -> T:
        return await factory()

    return asyncio.run(main())


def tables(file: Path) -> set[str]:
    with sqlite3.connect(file) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def indexes(file: Path) -> set[str]:
    with sqlite3.connect(file) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}


def schema_sql(file: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(file) as conn:
        return sorted(conn.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall())


def table_dump(file: Path, table: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(file)
    try:
        return sorted(conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "bot.db"


# ----------------------------------------------------------------------------------------
# Schema (BACK-1)
# ----------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-1")
def test_opening_the_store_creates_store_tables_and_durable_together(db: Path) -> None:
    """BACK-1: opening the store creates its tables and table ``durable`` (with both
    indexes) in one schema, before any durability exists."""

    async def body() -> None:
        store = SQLiteStore(db)
        await store.open()
        await store.close()

    run(body)
    assert STORE_TABLES | {DURABLE_TABLE} <= tables(db)
    assert {"durable_due", "durable_expires"} <= indexes(db)
    with sqlite3.connect(db) as conn:
        columns = {row[1]: (row[2], row[5]) for row in conn.execute("PRAGMA table_info(durable)")}
        due_index = [row[2] for row in conn.execute("PRAGMA index_info(durable_due)")]
        expires_index = [row[2] for row in conn.execute("PRAGMA index_info(durable_expires)")]
    assert columns == {
        "scope": ("TEXT", 1),
        "space": ("TEXT", 2),
        "key": ("TEXT", 3),
        "value": ("TEXT", 0),
        "version": ("INTEGER", 0),
        "due": ("REAL", 0),
        "expires": ("REAL", 0),
        "crc": ("INTEGER", 0),  # the row checksum of schema version 2 (issue 13)
    }
    assert due_index == ["scope", "space", "due", "key"]
    assert expires_index == ["scope", "space", "expires", "key"]


@pytest.mark.spec("BACK-1")
def test_opening_the_kv_first_creates_the_same_schema(tmp_path: Path) -> None:
    """BACK-1: whichever connection opens the file first creates the one schema."""
    via_store, via_kv = tmp_path / "store.db", tmp_path / "kv.db"

    async def body() -> None:
        store = SQLiteStore(via_store)
        await store.open()
        await store.close()
        kv = SQLiteKv(via_kv)
        await kv.open()
        await kv.close()

    run(body)
    assert schema_sql(via_store) == schema_sql(via_kv)


@pytest.mark.spec("BACK-1")
@pytest.mark.parametrize("dropped", ["durable_expires", "messages_chat_id", "messages"])
def test_an_open_restores_a_missing_table_or_index(db: Path, dropped: str) -> None:
    """BACK-1: an open skips the schema's ``CREATE`` statements only when the file has
    every table and index of it; a file missing one (here dropped by hand) gets it back,
    the same as a new file's, and keeps its rows."""
    fresh = db.with_name("fresh.db")

    async def body() -> None:
        for path in (db, fresh):
            kv = SQLiteKv(path)
            await kv.open()
            await kv.put("s", "inbox", "k", {"v": 1}, expected_version=0, due=1.0)
            await kv.close()
        with sqlite3.connect(db) as conn:
            kind = "TABLE" if dropped == "messages" else "INDEX"
            conn.execute(f"DROP {kind} {dropped}")
        assert dropped not in tables(db) | indexes(db)
        store = SQLiteStore(db)
        await store.open()
        await store.close()
        kv = SQLiteKv(db)
        await kv.open()
        assert await kv.get("s", "inbox", "k") == Versioned({"v": 1}, 1)
        await kv.close()

    run(body)
    assert schema_sql(db) == schema_sql(fresh)


@pytest.mark.spec("BACK-1")
def test_double_open_is_idempotent_and_keeps_data(db: Path) -> None:
    """BACK-1: the schema is ``CREATE ... IF NOT EXISTS``: opening again (same object,
    new objects, store after kv) changes nothing and loses nothing."""

    async def body() -> None:
        store = SQLiteStore(db)
        await store.open()
        await store.open()
        await store.set("user", "u1", {"name": "Ada"})
        kv = SQLiteKv(db)
        await kv.open()
        await kv.open()
        await kv.put("s", "inbox", "k", {"v": 1}, expected_version=0, due=1.0)
        before = schema_sql(db)
        await store.close()
        await store.close()
        await kv.close()
        await kv.close()
        again = SQLiteStore(db)
        await again.open()
        kv2 = SQLiteKv(db)
        await kv2.open()
        assert schema_sql(db) == before
        assert await again.get("user", "u1") == {"name": "Ada"}
        assert await kv2.get("s", "inbox", "k") == Versioned({"v": 1}, 1)
        await again.close()
        await kv2.close()

    run(body)


@pytest.mark.spec("BACK-1")
def test_connection_uses_wal_full_sync_and_busy_timeout(db: Path) -> None:
    """The file is in WAL mode; each connection runs ``synchronous=FULL`` (every
    acknowledged write survives a process crash and a power cut) and the configured
    ``busy_timeout``."""

    async def body() -> None:
        for obj in (SQLiteStore(db, busy_timeout_ms=1234), SQLiteKv(db, busy_timeout_ms=1234)):
            await obj.open()
            with obj._lock:
                conn = obj._connection()
                assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
                assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
                assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 1234
            await obj.close()

    run(body)


# ----------------------------------------------------------------------------------------
# Configuration errors
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [SQLiteStore, SQLiteKv])
@pytest.mark.parametrize("bad", [None, 42, b"bytes.db", ["a.db"], "", ":memory:"], ids=repr)
def test_bad_file_argument_is_a_config_error_naming_file(cls: type, bad: Any) -> None:
    """A ``file`` that is not a ``str``/``PathLike`` naming a file raises ``ConfigError``
    naming the option ``file``."""
    with pytest.raises(ConfigError) as info:
        cls(bad)
    assert info.value.details["option"] == "file"
    assert "file" in str(info.value)
    assert info.value.code == "CONFIG_INVALID"


@pytest.mark.parametrize("cls", [SQLiteStore, SQLiteKv])
def test_directory_or_missing_parent_is_a_config_error_naming_file(cls: type, tmp_path: Path) -> None:
    """A directory, or a file in a directory that does not exist, is a bad ``file``."""
    for bad in (tmp_path, str(tmp_path), tmp_path / "missing" / "bot.db"):
        with pytest.raises(ConfigError) as info:
            cls(bad)
        assert info.value.details["option"] == "file"
        assert "file" in str(info.value)


@pytest.mark.parametrize("cls", [SQLiteStore, SQLiteKv])
@pytest.mark.parametrize("bad", [-1, 1.5, "5000", True])
def test_bad_busy_timeout_is_a_config_error(cls: type, bad: Any, db: Path) -> None:
    with pytest.raises(ConfigError) as info:
        cls(db, busy_timeout_ms=bad)
    assert info.value.details["option"] == "busy_timeout_ms"


def test_pathlike_and_str_are_accepted(db: Path) -> None:
    async def body() -> None:
        await SQLiteStore(db).set("n", "k", 1)
        assert await SQLiteStore(str(db)).get("n", "k") == 1
        assert SQLiteKv(db).file == str(db)

    run(body)


# ----------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------


def test_store_is_a_store(db: Path) -> None:
    assert isinstance(SQLiteStore(db), Store)


def test_store_get_set_delete(db: Path) -> None:
    async def body() -> None:
        store = SQLiteStore(db)
        assert await store.get("user", "u1") is None
        await store.set("user", "u1", {"name": "Ada", "tags": ["a", "b"], "n": 1.5})
        await store.set("flow", "u1", [1, 2, 3])
        await store.set("user", "u2", "plain string")
        await store.set("user", "u3", None)
        assert await store.get("user", "u1") == {"name": "Ada", "tags": ["a", "b"], "n": 1.5}
        assert await store.get("flow", "u1") == [1, 2, 3]
        assert await store.get("user", "u2") == "plain string"
        await store.set("user", "u1", {"name": "Grace"})  # replace
        assert await store.get("user", "u1") == {"name": "Grace"}
        value = await store.get("user", "u1")
        assert isinstance(value, dict)
        value["name"] = "mutated"
        assert await store.get("user", "u1") == {"name": "Grace"}  # a copy
        await store.delete("user", "u1")
        await store.delete("user", "u1")  # absent: no error
        await store.delete("nobody", "nothing")
        assert await store.get("user", "u1") is None
        assert await store.get("flow", "u1") == [1, 2, 3]
        with pytest.raises(BackendUnavailableError):
            await store.set("user", "bad", {"x": object()})
        await store.close()
        reopened = SQLiteStore(db)
        assert await reopened.get("flow", "u1") == [1, 2, 3]
        assert await reopened.get("user", "u2") == "plain string"
        await reopened.close()

    run(body)


def _entry(i: int, chat: str, direction: str = "in") -> dict[str, Any]:
    return {"direction": direction, "chat_id": chat, "content": {"text": f"m{i}"}, "message_id": f"id{i}", "at": i}


@pytest.mark.parametrize("chat_id", [None, "c1", "c2", "absent"])
@pytest.mark.parametrize("limit", [1000, 0, 1, 2, 3, 5, 100])
def test_store_messages_agree_with_memory_store(db: Path, chat_id: str | None, limit: int) -> None:
    """The message log: oldest first, filtered by chat, ``limit`` keeps the newest
    entries in oldest-first order; exactly as ``MemoryStore``."""
    entries = [_entry(i, "c1" if i % 3 else "c2", "out" if i % 2 else "in") for i in range(10)]

    async def body() -> None:
        sqlite_store, memory = SQLiteStore(db), MemoryStore()
        for entry in entries:
            await sqlite_store.append_message(entry)
            await memory.append_message(entry)
        got = await sqlite_store.messages(chat_id, limit=limit)
        assert got == await memory.messages(chat_id, limit=limit)
        assert await sqlite_store.messages(chat_id) == await memory.messages(chat_id)
        await sqlite_store.close()

    run(body)


def test_store_messages_keep_bytes_and_survive_reopen(db: Path) -> None:
    async def body() -> None:
        store = SQLiteStore(db)
        entry = {"direction": "out", "chat_id": "c", "content": {"media": {"data": b"\x00\xffpng"}}, "at": 1}
        await store.append_message(entry)
        await store.append_message(_entry(2, "c"))
        entry["chat_id"] = "mutated after append"
        await store.close()
        again = SQLiteStore(db)
        log = await again.messages("c")
        assert log[0]["content"]["media"]["data"] == b"\x00\xffpng"
        assert [e["at"] for e in log] == [1, 2]
        await again.close()

    run(body)


def _log_text(value: Any) -> Any:
    """The message log's stored form by its definition: ``bytes`` (``bytearray``,
    ``memoryview``) anywhere as ``{"$bytes": base64}`` (OUT-15), the rest as JSON has it."""
    import base64

    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {k: _log_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_log_text(v) for v in value]
    return value


_LOG_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=6), st.binary(max_size=6), st.binary(max_size=4).map(bytearray)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.dictionaries(st.text(max_size=4), _LOG_VALUES, max_size=4))
def test_a_message_log_entry_is_stored_as_its_definition_says_and_read_back(db: Path, content: dict[str, Any]) -> None:
    """OUT-15, issue 16 (the entry is encoded by the JSON encoder itself, bytes through its
    ``default``): for drawn entries with bytes, bytearrays, tuples and nested containers,
    the stored text is ``json.dumps`` of the definition's form, and the log gives the
    entry back with its bytes (tuples as lists, as JSON keeps them)."""

    async def body() -> None:
        store = SQLiteStore(db)
        await store.append_message({"chat_id": "c", "content": content})
        conn = sqlite3.connect(db)
        try:
            (text,) = conn.execute("SELECT entry FROM messages ORDER BY id DESC LIMIT 1").fetchone()
        finally:
            conn.close()
        assert text == json.dumps(_log_text({"chat_id": "c", "content": content}))
        (back,) = await store.messages("c", limit=1)
        assert json.dumps(_log_text(back)) == text
        await store.close()

    run(body)


def test_store_reopens_lazily_after_close(db: Path) -> None:
    """``close()`` is idempotent and releases the connection; a later call reopens."""

    async def body() -> None:
        store = SQLiteStore(db)
        await store.set("n", "k", 1)
        await store.close()
        await store.close()
        assert await store.get("n", "k") == 1
        await store.close()

    run(body)


def test_store_on_a_file_that_is_not_a_database_is_refused_as_damaged_naming_it(db: Path) -> None:
    """A file SQLite finds is not a database (``SQLITE_NOTADB``) is refused as a damaged
    journal: ``JournalCorruptError`` naming the file (issue 13: a damaged file is not an
    unreachable one; before, ``BackendUnavailableError``)."""
    db.write_bytes(b"this is not an SQLite database, just some text" * 100)

    async def body() -> None:
        for obj in (SQLiteStore(db), SQLiteKv(db)):
            with pytest.raises(JournalCorruptError) as info:
                await obj.open()
            assert str(db) in str(info.value)
            assert info.value.details["file"] == str(db)
            assert not isinstance(info.value, sqlite3.Error)
        kv = SQLiteKv(db)
        with pytest.raises(JournalCorruptError):
            await kv.get("s", "inbox", "k")  # lazy open fails the same way

    run(body)


# ----------------------------------------------------------------------------------------
# SQLiteKv against MemoryKv (BACK-7)
# ----------------------------------------------------------------------------------------

Op = tuple[Any, ...]


async def apply(kv: DurableKv, op: Op) -> Any:
    """Run one operation and describe its outcome (result, or error type and details)."""
    name, *args = op
    try:
        if name == "get":
            scope, space, key = args
            found = await kv.get(scope, space, key)
            return ("ok", None if found is None else (found.value, found.version))
        if name == "put":
            scope, space, key, value, expected, due, expires = args
            return ("ok", await kv.put(scope, space, key, value, expected_version=expected, due=due, expires=expires))
        if name == "delete":
            scope, space, key, expected = args
            await kv.delete(scope, space, key, expected_version=expected)
            return ("ok", None)
        if name == "range":
            scope, space, index, upto, limit = args
            return ("ok", await kv.range(scope, space, index, upto=upto, limit=limit))
        if name == "scan":
            scope, space, after, limit = args
            return ("ok", [(k, v.value, v.version) for k, v in await kv.scan(scope, space, after=after, limit=limit)])
        raise AssertionError(f"unknown op {name}")
    except VersionConflict as exc:
        return ("conflict", exc.details["key"], exc.details["expected"], exc.details["found"], str(exc))
    except (TypeError, ValueError) as exc:
        return ("invalid", type(exc).__name__)


def put(key: str, version: int, due: float | None = None, expires: float | None = None, *, scope: str = "s",
        space: str = "inbox", value: dict[str, Any] | None = None) -> Op:
    return ("put", scope, space, key, value if value is not None else {"key": key, "v": version}, version, due, expires)


def get(key: str, *, scope: str = "s", space: str = "inbox") -> Op:
    return ("get", scope, space, key)


def delete(key: str, version: int, *, scope: str = "s", space: str = "inbox") -> Op:
    return ("delete", scope, space, key, version)


def rng(index: str, upto: float = INF, limit: int = 100, *, scope: str = "s", space: str = "inbox") -> Op:
    return ("range", scope, space, index, upto, limit)


def scan(after: str | None = None, limit: int = 100, *, scope: str = "s", space: str = "inbox") -> Op:
    return ("scan", scope, space, after, limit)


ALL_RANGES: list[Op] = [rng(index, upto) for index in ("due", "expires") for upto in (INF, 5.0, 0.0, -INF)]

SCENARIOS: dict[str, list[Op]] = {
    "cas-create": [
        get("a"), put("a", 0), get("a"), put("a", 0), put("a", 0, value={"other": True}), get("a"), scan(),
    ],
    "cas-replace": [
        put("a", 0), put("a", 1), get("a"), put("a", 1), put("a", 3), put("a", 2), put("a", 2),
        put("absent", 1), get("absent"), put("a", -1), get("a"),
    ],
    "cas-conflict-changes-nothing": [
        put("a", 0, due=1.0, expires=2.0, value={"first": 1}),
        put("a", 0, due=9.0, expires=9.0, value={"second": 2}),
        put("a", 5, due=9.0, expires=9.0, value={"third": 3}),
        get("a"), *ALL_RANGES,
    ],
    "delete": [
        delete("a", 0), delete("a", 1), put("a", 0, due=1.0, expires=1.0), delete("a", 2), delete("a", 0),
        get("a"), delete("a", 1), get("a"), delete("a", 1), *ALL_RANGES, scan(), put("a", 0), get("a"),
        put("a", 1), delete("a", 1), delete("a", 2), scan(),
    ],
    "index-ordering": [
        put("k3", 0, due=3.0, expires=30.0), put("k1", 0, due=1.0), put("k2", 0, due=3.0, expires=10.0),
        put("k0", 0, due=-5.0, expires=-1.0), put("k9", 0, due=INF, expires=INF), put("k8", 0),
        put("k7", 0, due=0.0), put("k6", 0, expires=3.0), put("k5", 0, due=3.0),
        *ALL_RANGES, rng("due", 3.0), rng("due", 2.999), rng("expires", 30.0), rng("expires", 29.9),
    ],
    "entries-move-on-update": [
        put("a", 0, due=10.0, expires=100.0), put("b", 0, due=5.0, expires=50.0), *ALL_RANGES,
        put("a", 1, due=1.0, expires=500.0), *ALL_RANGES, rng("due", 5.0),
        put("a", 2, due=None, expires=None), *ALL_RANGES,
        put("b", 1, due=None, expires=1.0), put("a", 3, due=7.0), *ALL_RANGES,
        delete("b", 2), *ALL_RANGES,
    ],
    "range-limit": [
        *[put(f"k{i:02d}", 0, due=float(i % 4), expires=float(-i)) for i in range(12)],
        *[rng(index, upto, limit) for index in ("due", "expires") for upto in (INF, 2.0, -3.0)
          for limit in (0, 1, 2, 5, 12, 100)],
    ],
    "scan-order": [
        *[put(key, 0) for key in ("b", "a", "aa", "B", "Z", "é", "e", "ａ", "\U0001F600", "z", "a b", "~", "0")],
        scan(), scan(limit=3), scan(after="a"), scan(after="a", limit=2), scan(after=""), scan(after="zzz"),
        scan(after="\U0001F600"), scan(after="é", limit=1), scan(limit=0), scan(after="aa"),
    ],
    "scope-and-space-isolation": [
        put("k", 0, due=1.0, scope="s1"), put("k", 0, due=2.0, scope="s2"), put("k", 0, due=3.0, scope="s1", space="outbox"),
        put("k", 1, scope="s1"), put("k", 2, scope="s2"), put("k", 1, scope="s2", value={"s2": True}),
        get("k", scope="s1"), get("k", scope="s2"), get("k", scope="s1", space="outbox"), get("k", scope="s3"),
        *[rng(i, scope=s, space=sp) for i in ("due", "expires") for s in ("s1", "s2", "s3") for sp in ("inbox", "outbox")],
        scan(scope="s1"), scan(scope="s2"), scan(scope="s1", space="outbox"), scan(scope="s3"),
        delete("k", 2, scope="s1"), get("k", scope="s1"), get("k", scope="s2"), get("k", scope="s1", space="outbox"),
        put("k", 0, scope="s1"), scan(scope="s1"), scan(scope="s2"),
    ],
    "values-and-invalid-values": [
        put("nested", 0, value={"a": [1, 2.5, None, True, "x", {"b": {"c": []}}], "é": "\U0001F600", "n": 10**30}),
        get("nested"),
        ("put", "s", "inbox", "bad1", ["not", "a", "dict"], 0, None, None),
        ("put", "s", "inbox", "bad2", {"nan": math.nan}, 0, None, None),
        ("put", "s", "inbox", "bad3", {"obj": object()}, 0, None, None),
        get("bad1"), get("bad2"), scan(),
    ],
    "odd-limits-and-bounds": [
        *[put(f"k{i}", 0, due=float(i)) for i in range(5)],
        rng("due", INF, -1), rng("due", INF, -4), rng("due", math.nan), rng("due", 2), scan(limit=-2),
        put("k1", 1, due=math.nan), rng("due"),
    ],
}


async def compare(ops: list[Op], sqlite_kv: DurableKv) -> None:
    """Run ``ops`` on a MemoryKv and on ``sqlite_kv``; every outcome must be equal."""
    memory = MemoryKv()
    for n, op in enumerate(ops):
        expected = await apply(memory, op)
        got = await apply(sqlite_kv, op)
        assert got == expected, f"step {n} {op!r}: SQLiteKv {got!r} != MemoryKv {expected!r}"


@pytest.mark.spec("BACK-7", "SCOPE-2")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sqlite_kv_agrees_with_memory_kv(db: Path, scenario: str) -> None:
    """BACK-7: SQLiteKv gives exactly MemoryKv's outcomes (CAS create/replace/conflict,
    delete, index ordering and entries moving on update, range limit, scan order, scope
    isolation, invalid values), step by step."""

    async def body() -> None:
        kv = SQLiteKv(db)
        await kv.open()
        await compare(SCENARIOS[scenario], kv)
        await kv.close()

    run(body)


@pytest.fixture(scope="module")
def shared_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hypothesis") / "shared.db"


_example = itertools.count()

_keys = st.sampled_from(["a", "b", "c", "é", "aa"])
_scores = st.one_of(st.none(), st.sampled_from([-1.0, 0.0, 1.0, 2.5, INF]), st.integers(-3, 3).map(float))
_ops = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(["s1", "s2"]), st.sampled_from(["inbox", "outbox"]), _keys,
              st.dictionaries(st.sampled_from(["x", "y"]), st.integers(-5, 5), max_size=2),
              st.integers(0, 3), _scores, _scores),
    st.tuples(st.just("delete"), st.sampled_from(["s1", "s2"]), st.just("inbox"), _keys, st.integers(0, 3)),
    st.tuples(st.just("get"), st.sampled_from(["s1", "s2"]), st.just("inbox"), _keys),
    st.tuples(st.just("range"), st.sampled_from(["s1", "s2"]), st.sampled_from(["inbox", "outbox"]),
              st.sampled_from(["due", "expires"]), st.sampled_from([-1.0, 0.0, 1.0, 2.0, INF]), st.integers(0, 6)),
    st.tuples(st.just("scan"), st.sampled_from(["s1", "s2"]), st.sampled_from(["inbox", "outbox"]),
              st.one_of(st.none(), _keys), st.integers(0, 6)),
)


@pytest.mark.spec("BACK-7")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_ops, max_size=30))
def test_sqlite_kv_agrees_with_memory_kv_on_random_sequences(shared_db: Path, ops: list[Op]) -> None:
    """BACK-7: random operation sequences give the same outcomes on both. Each example
    works in fresh scopes of one shared file (scope isolation makes them independent)."""
    prefix = f"ex{next(_example)}-"
    scoped = [(op[0], prefix + op[1], *op[2:]) for op in ops]

    async def body() -> None:
        kv = SQLiteKv(shared_db)
        await compare(scoped, kv)
        await kv.close()

    run(body)


def test_sqlite_kv_capabilities(db: Path) -> None:
    """The BACK table row: survives a crash; processes of one host (REPL-4), not hosts."""
    assert SQLiteKv(db).capabilities == Capabilities(survives_crash=True, multi_process=True, multi_host=False, shared=False)


class _NormalSync(SQLiteKv):
    """Commits without syncing the WAL: the connection's pragma is changed after open."""

    def _connect(self) -> sqlite3.Connection:
        conn = super()._connect()
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn


@pytest.mark.spec("GUAR-1", "BACK-1")
def test_sqlite_kv_reports_the_pragmas_of_its_own_connection(db: Path) -> None:
    """The settings ``survives_crash`` rests on, read from the kv's connection (not from
    what it asked for): as shipped WAL with ``synchronous=FULL``; a subclass that changes
    the connection is reported as it is; after close the kv is unavailable."""

    async def body() -> None:
        kv = SQLiteKv(db)
        assert await kv.durability_settings() == {"kind": "sqlite", "synchronous": "FULL", "journal_mode": "wal"}
        backend = SQLiteDurability(_NormalSync(db))
        await backend.start()
        assert await backend.durability_settings() == {"kind": "sqlite", "synchronous": "NORMAL",
                                                       "journal_mode": "wal"}
        await backend.stop()
        await kv.close()
        with pytest.raises(BackendUnavailableError, match="closed"):
            await kv.durability_settings()

    run(body)


def test_sqlite_kv_returns_copies(db: Path) -> None:
    async def body() -> None:
        kv = SQLiteKv(db)
        value: dict[str, Any] = {"list": [1, 2], "inner": {"x": 1}}
        await kv.put("s", "inbox", "k", value, expected_version=0)
        value["list"].append(3)  # mutating the argument after put changes nothing
        found = await kv.get("s", "inbox", "k")
        assert found is not None
        found.value["inner"]["x"] = 99
        assert await kv.get("s", "inbox", "k") == Versioned({"list": [1, 2], "inner": {"x": 1}}, 1)
        [(_, scanned)] = await kv.scan("s", "inbox")
        scanned.value["list"].clear()
        assert await kv.get("s", "inbox", "k") == Versioned({"list": [1, 2], "inner": {"x": 1}}, 1)
        await kv.close()

    run(body)


def test_sqlite_kv_calls_after_close_are_unavailable_and_open_reopens(db: Path) -> None:
    """Calls after ``close()`` raise ``BackendUnavailableError`` (naming the file);
    ``close()`` is idempotent; ``open()`` again makes the kv usable."""

    async def body() -> None:
        kv = SQLiteKv(db)
        await kv.put("s", "inbox", "k", {"v": 1}, expected_version=0)  # lazy open
        await kv.close()
        await kv.close()
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: kv.get("s", "inbox", "k"),
            lambda: kv.put("s", "inbox", "k", {"v": 2}, expected_version=1),
            lambda: kv.delete("s", "inbox", "k", expected_version=1),
            lambda: kv.range("s", "inbox", "due", upto=INF, limit=10),
            lambda: kv.scan("s", "inbox"),
        ]
        for call in calls:
            with pytest.raises(BackendUnavailableError) as info:
                await call()
            assert str(db) in str(info.value)
        await kv.open()
        assert await kv.get("s", "inbox", "k") == Versioned({"v": 1}, 1)
        await kv.close()

    run(body)


def test_sqlite_kv_concurrent_tasks_in_one_process_have_one_winner(db: Path) -> None:
    """Concurrent CAS calls from many tasks with the same ``expected_version``: exactly
    one winner, as the DurableKv contract says."""

    async def body() -> None:
        kv = SQLiteKv(db)
        await kv.put("s", "inbox", "k", {"n": 0}, expected_version=0)

        async def attempt(i: int) -> bool:
            try:
                await kv.put("s", "inbox", "k", {"n": i}, expected_version=1)
                return True
            except VersionConflict:
                return False

        wins = await asyncio.gather(*(attempt(i) for i in range(20)))
        assert sum(wins) == 1
        found = await kv.get("s", "inbox", "k")
        assert found is not None and found.version == 2 and found.value == {"n": wins.index(True)}
        await kv.close()

    run(body)


@pytest.mark.spec("BACK-1")
def test_sqlite_kv_everything_survives_close_and_reopen(db: Path) -> None:
    """Survives a crash (BACK table): a new SQLiteKv on the same file sees every record,
    version and index entry — the same answers as a MemoryKv that never closed."""
    ops = [op for scenario in ("index-ordering", "scope-and-space-isolation", "scan-order") for op in SCENARIOS[scenario]]
    reads = [
        *ALL_RANGES, scan(), scan(scope="s1"), scan(scope="s2"), scan(scope="s1", space="outbox"),
        *[get(k) for k in ("k0", "k1", "k9", "é", "\U0001F600")], get("k", scope="s2"),
    ]

    async def body() -> None:
        memory, kv = MemoryKv(), SQLiteKv(db)
        for op in ops:
            await apply(memory, op)
            await apply(kv, op)
        await kv.close()
        reopened = SQLiteKv(db)
        for op in reads:
            assert await apply(reopened, op) == await apply(memory, op), op
        await reopened.close()

    run(body)


# ----------------------------------------------------------------------------------------
# The durability backend (BACK-1, BACK-3)
# ----------------------------------------------------------------------------------------


@pytest.mark.spec("BACK-1", "BACK-7")
def test_store_durability_is_kv_durability_over_its_own_sqlite_kv(db: Path) -> None:
    """``store.durability()`` is a ``SQLiteDurability`` (a ``KvDurability``) named
    "sqlite" over a ``SQLiteKv`` on the same file with its own connection;
    ``start()``/``stop()`` open and close that connection, never the store's."""

    async def body() -> None:
        store = SQLiteStore(db, busy_timeout_ms=777)
        durability = store.durability()
        assert isinstance(durability, SQLiteDurability)
        assert isinstance(durability, KvDurability)
        assert durability.name == "sqlite"
        assert durability.own_kv is True
        assert isinstance(durability.kv, SQLiteKv)
        assert durability.kv.file == store.file == durability.file
        assert durability.kv.busy_timeout_ms == 777
        assert durability.capabilities == SQLiteKv.capabilities
        assert durability is not store.durability()
        await store.set("user", "u", {"x": 1})
        await durability.start()
        await durability.start()
        with durability.kv._lock, store._lock:
            assert durability.kv._connection() is not store._connection()
        record = InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0, created_at=1.0, updated_at=1.0)
        stored, created = await durability.inbox_journal("scope", record)
        assert created
        await durability.stop()
        await durability.stop()
        with pytest.raises(BackendUnavailableError):
            await durability.kv.get("scope", "inbox", "m1")
        assert await store.get("user", "u") == {"x": 1}  # the store's connection is untouched
        again = store.durability()
        await again.start()
        got = await again.inbox_get("scope", "m1")
        assert got is not None and got.to_json() == stored.to_json()
        await again.stop()
        await store.close()

    run(body)


def test_store_durability_passes_options(db: Path) -> None:
    store = SQLiteStore(db)
    durability = store.durability(name="custom", busy_timeout_ms=10)
    assert durability.name == "custom"
    assert durability.kv.busy_timeout_ms == 10
    with pytest.raises(ConfigError):
        store.durability(busy_timeout_ms=-5)


@pytest.mark.spec("BACK-3")
def test_journals_and_store_never_touch_each_others_tables(db: Path) -> None:
    """BACK-3: durability writes change only table ``durable``; store writes change
    only the store's tables — even with colliding names (namespace "inbox", key "m1")."""

    async def body() -> None:
        store = SQLiteStore(db)
        durability = store.durability()
        await store.open()
        await durability.start()

        store_before = {t: table_dump(db, t) for t in STORE_TABLES}
        durable_before = table_dump(db, DURABLE_TABLE)
        record = InboxRecord(id="m1", chat_id="c", state="pending", next_at=0.0)
        await durability.inbox_journal("inbox", record)
        await durability.inbox_claim("inbox", "m1", owner="o", incarnation="i", now=1.0, lease_ms=1000.0, recover=False)
        await durability.kv.put("s", "inbox", "m1", {"v": 1}, expected_version=0, due=1.0, expires=2.0)
        await durability.kv.delete("s", "inbox", "m1", expected_version=1)
        await durability.inbox_purge("inbox", now=INF, limit=100)
        assert {t: table_dump(db, t) for t in STORE_TABLES} == store_before
        assert table_dump(db, DURABLE_TABLE) != durable_before

        durable_before = table_dump(db, DURABLE_TABLE)
        await store.set("inbox", "m1", {"not": "a journal record"})
        await store.set("durable", "m1", 1)
        await store.delete("inbox", "m1")
        await store.set("user", "u", {"x": 1})
        await store.append_message(_entry(1, "c"))
        assert table_dump(db, DURABLE_TABLE) == durable_before
        assert {t: table_dump(db, t) for t in STORE_TABLES} != store_before
        assert (await durability.inbox_get("inbox", "m1")) is not None

        await durability.stop()
        await store.close()

    run(body)


# ----------------------------------------------------------------------------------------
# Several processes (REPL-4, REPL-1) and a killed process (BACK table: survives a crash)
# ----------------------------------------------------------------------------------------

WORKER = r"""
import asyncio, json, os, sys
from botmesh.core.errors import VersionConflict
from botmesh.sqlite_store import SQLiteKv, SQLiteStore


def barrier():
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go")


async def race(file, me, rounds):
    # A barrier starts every round, so all processes contend in each one: the replace of
    # the shared key "k" at version r (round 0 creates it) and the create of a fresh key
    # c{r}; after the last round all race to delete "k" at version `rounds`.
    kv = SQLiteKv(file)
    await kv.open()
    wins = {"create": [], "replace": [], "delete": []}
    lost = 0
    for r in range(rounds + 1):
        barrier()
        try:
            await kv.put("race", "s", f"c{r}", {"by": me}, expected_version=0, due=float(r))
            wins["create"].append(r)
        except VersionConflict:
            lost += 1
        try:
            if r < rounds:
                await kv.put("race", "s", "k", {"by": me, "round": r}, expected_version=r, due=float(me))
                wins["replace"].append(r)
            else:
                await kv.delete("race", "s", "k", expected_version=r)
                wins["delete"].append(r)
        except VersionConflict:
            lost += 1
    await kv.close()
    return {"wins": wins, "lost": lost}


async def increment(file, me, times):
    # A barrier every 10 increments keeps the processes overlapping.
    kv = SQLiteKv(file)
    await kv.open()
    conflicts = 0
    for i in range(times):
        if i % 10 == 0:
            barrier()
        while True:
            current = await kv.get("inc", "s", "counter")
            try:
                if current is None:
                    await kv.put("inc", "s", "counter", {"n": 1}, expected_version=0)
                else:
                    n = current.value["n"] + 1
                    await kv.put("inc", "s", "counter", {"n": n}, expected_version=current.version, due=float(n))
                break
            except VersionConflict:
                conflicts += 1
    await kv.close()
    return {"conflicts": conflicts}


async def open_all(file, me, _):
    barrier()
    store = SQLiteStore(file)
    await store.open()
    durability = store.durability()
    await durability.start()
    await store.set("proc", str(me), {"me": me})
    await store.append_message({"direction": "in", "chat_id": "c", "content": {"text": str(me)}, "at": me})
    await durability.kv.put("open", "s", str(me), {"me": me}, expected_version=0)
    await durability.stop()
    await store.close()
    return {}


async def claim(file, me, count):
    durability = SQLiteStore(file).durability()
    await durability.start()
    barrier()
    won = []
    for i in range(count):
        rec = await durability.inbox_claim(
            "claims", f"m{i}", owner=f"p{me}", incarnation="boot", now=1000.0, lease_ms=60000.0, recover=False
        )
        if rec is not None:
            won.append(i)
    await durability.stop()
    return won


async def crash(file, me, count):
    kv = SQLiteKv(file)
    store = SQLiteStore(file)
    for i in range(count):
        await kv.put("crash", "s", f"k{i:03d}", {"i": i}, expected_version=0, due=float(i))
        await store.set("crash", f"k{i:03d}", i)
    print("result " + json.dumps({"acknowledged": count}), flush=True)
    os._exit(3)  # die at once: no close, no checkpoint, no atexit


MODES = {"race": race, "increment": increment, "open": open_all, "claim": claim, "crash": crash}
mode, file, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
result = asyncio.run(MODES[mode](file, me, n))
print("result " + json.dumps(result), flush=True)
"""


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REFERENCE_IMPL), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Worker processes started by a test; at teardown any still running is killed (by
    its own handle) and every pipe is closed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


def run_workers(
    procs: list[subprocess.Popen[str]], mode: str, file: Path, count: int, n: int, *, barriers: int = 1
) -> list[tuple[int, Any]]:
    """Start ``count`` interpreters running ``WORKER`` in ``mode`` and pass them through
    ``barriers`` barriers: at each, every worker reports "ready" and waits until all
    have, then all get "go" on stdin at once. Returns each worker's
    ``(exit code, result)``."""
    for me in range(count):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, mode, str(file), str(me), str(n)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_worker_env(),
            )
        )
    for passage in range(barriers):
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                _, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
                pytest.fail(f"worker failed before barrier {passage}: {line!r}\n{err}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
    results: list[tuple[int, Any]] = []
    for proc in procs:
        out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
        lines = [line for line in out.splitlines() if line.startswith("result ")]
        assert lines, f"worker printed no result (exit {proc.returncode}):\n{out}\n{err}"
        results.append((proc.returncode, json.loads(lines[-1][len("result "):])))
    return results


@pytest.mark.spec("REPL-4", "BACK-7")
def test_processes_racing_cas_have_exactly_one_winner_per_round(db: Path, procs: list[subprocess.Popen[str]]) -> None:
    """REPL-4: 4 processes x 50 rounds race CAS writes on the same key with the same
    ``expected_version``, all released together by a barrier at every round: exactly one
    winner per round — for the replace of the shared key, for a create of a fresh key,
    and for the final delete — every other attempt a ``VersionConflict``, and the stored
    values are the winners'."""
    workers, rounds = 4, 50
    results = [result for code, result in run_workers(procs, "race", db, workers, rounds, barriers=rounds + 1) if code == 0]
    assert len(results) == workers

    def winners(kind: str, r: int) -> list[int]:
        return [me for me, result in enumerate(results) if r in result["wins"][kind]]

    for r in range(rounds):
        assert len(winners("replace", r)) == 1, f"replace round {r}: winners {winners('replace', r)}"
    for r in range(rounds + 1):
        assert len(winners("create", r)) == 1, f"create round {r}: winners {winners('create', r)}"
    assert len(winners("delete", rounds)) == 1
    assert sum(result["lost"] for result in results) == (workers - 1) * (2 * rounds + 2)

    async def check() -> None:
        kv = SQLiteKv(db)
        assert await kv.get("race", "s", "k") is None  # deleted by the last round's winner
        for r in range(rounds + 1):
            assert await kv.get("race", "s", f"c{r}") == Versioned({"by": winners("create", r)[0]}, 1)
        created = await kv.range("race", "s", "due", upto=INF, limit=1000)
        assert created == [(float(r), f"c{r}") for r in range(rounds + 1)]
        await kv.close()

    run(check)


@pytest.mark.spec("REPL-4", "BACK-7")
def test_processes_incrementing_with_cas_lose_no_update(db: Path, procs: list[subprocess.Popen[str]]) -> None:
    """REPL-4: N processes each make M CAS increments of one counter, retrying on
    conflict; the counter ends at exactly N*M, at version N*M."""
    workers, times = 4, 50
    results = run_workers(procs, "increment", db, workers, times, barriers=times // 10)
    assert [code for code, _ in results] == [0] * workers

    async def check() -> None:
        kv = SQLiteKv(db)
        assert await kv.get("inc", "s", "counter") == Versioned({"n": workers * times}, workers * times)
        assert await kv.range("inc", "s", "due", upto=INF, limit=10) == [(float(workers * times), "counter")]
        await kv.close()

    run(check)


@pytest.mark.spec("BACK-1")
def test_processes_opening_a_fresh_file_at_once_do_not_fail(db: Path, procs: list[subprocess.Popen[str]]) -> None:
    """BACK-1: several processes opening the same new file at the same moment all
    succeed; the schema exists once; everyone's writes are there."""
    workers = 6
    results = run_workers(procs, "open", db, workers, 0)
    assert [code for code, _ in results] == [0] * workers
    assert STORE_TABLES | {DURABLE_TABLE} <= tables(db)

    async def check() -> None:
        store, kv = SQLiteStore(db), SQLiteKv(db)
        for me in range(workers):
            assert await store.get("proc", str(me)) == {"me": me}
            assert await kv.get("open", "s", str(me)) == Versioned({"me": me}, 1)
        assert sorted(e["at"] for e in await store.messages("c")) == list(range(workers))
        await store.close()
        await kv.close()

    run(check)


@pytest.mark.spec("REPL-1", "REPL-4")
def test_processes_claiming_the_same_records_never_share_one(db: Path, procs: list[subprocess.Popen[str]]) -> None:
    """REPL-1 over SQLite (REPL-4): 4 processes claim the same 40 pending inbox records
    through ``store.durability()``; each record is leased to exactly one of them."""
    workers, count = 4, 40

    async def setup() -> None:
        durability = SQLiteStore(db).durability()
        await durability.start()
        for i in range(count):
            await durability.inbox_journal("claims", InboxRecord(id=f"m{i}", chat_id="c", state="pending", next_at=0.0))
        await durability.stop()

    run(setup)
    results = run_workers(procs, "claim", db, workers, count)
    assert [code for code, _ in results] == [0] * workers
    owners = {i: [me for me, (_, won) in enumerate(results) if i in won] for i in range(count)}
    assert all(len(claimers) == 1 for claimers in owners.values()), owners

    async def check() -> None:
        durability = SQLiteStore(db).durability()
        await durability.start()
        for i, [me] in owners.items():
            rec = await durability.inbox_get("claims", f"m{i}")
            assert rec is not None
            assert (rec.state, rec.owner, rec.token, rec.attempts) == ("leased", f"p{me}", 1, 1)
        await durability.stop()

    run(check)


@pytest.mark.spec("BACK-1")
def test_acknowledged_writes_survive_a_killed_process(db: Path, procs: list[subprocess.Popen[str]]) -> None:
    """BACK table, "survives a crash": a process that dies (``os._exit``, no close, no
    checkpoint) right after its writes returned leaves every one of them readable."""
    count = 25
    [(code, result)] = run_workers(procs, "crash", db, 1, count, barriers=0)
    assert code == 3 and result == {"acknowledged": count}

    async def check() -> None:
        kv, store = SQLiteKv(db), SQLiteStore(db)
        assert [(k, v.value, v.version) for k, v in await kv.scan("crash", "s", limit=1000)] == [
            (f"k{i:03d}", {"i": i}, 1) for i in range(count)
        ]
        assert await kv.range("crash", "s", "due", upto=INF, limit=1000) == [(float(i), f"k{i:03d}") for i in range(count)]
        for i in range(count):
            assert await store.get("crash", f"k{i:03d}") == i
        await kv.close()
        await store.close()

    run(check)



# ----------------------------------------------------------------------------------------
# LEASE-3: two live processes on one file with the default instance_id (issue 12)
# ----------------------------------------------------------------------------------------

BOT_WORKER = r"""
import asyncio, json, sys
from botmesh.core import Bot, InboundEvent, VirtualClock
from botmesh.core.testing import MockProvider
from botmesh.sqlite_store import SQLiteStore

role, file = sys.argv[1], sys.argv[2]


async def main():
    # Both processes read the same virtual time: a lease is only expired if someone
    # moves a clock, and nobody does.
    clock = VirtualClock()
    store = SQLiteStore(file=file)
    bot = Bot(MockProvider(), store, {"backend": store.durability()}, bot_id="b", connection_id="c", clock=clock)
    runs = []

    @bot.otherwise
    async def handler(ctx):
        runs.append(ctx.event.id)
        if role == "first":
            print("running", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # held until the test lets it finish
        await ctx.reply(f"{role}:{ctx.text}")

    await bot.start()
    await clock.settle()  # the first sweep pass (the recovery pass of LEASE-4) is over
    if role == "first":
        await bot.provider.deliver(InboundEvent(id="m1", chat_id="c1", text="hi"))
    d = bot.durability
    record = await d.inbox.get("m1")
    print("result " + json.dumps({
        "instance_id": d.instance_id, "runs": runs, "texts": bot.provider.texts(),
        "stale_leases": d.metrics()["stale_leases"], "inbound_replayed": d.metrics()["inbound_replayed"],
        "m1": None if record is None else [record.state, record.owner, record.token],
    }), flush=True)
    await bot.stop()
    await store.close()


asyncio.run(main())
"""


@pytest.mark.spec("LEASE-3", "LEASE-5", "REPL-1", "REPL-4")
def test_two_processes_with_the_default_instance_id_never_take_each_others_leases(
        db: Path, procs: list[subprocess.Popen[str]]) -> None:
    """LEASE-3 (issue 12): SQLite serves the processes of one host, so two bots on one
    file with the default ``instance_id`` are two real processes with the same
    ``<hostname>/<bot_id>/<connection_id>``. The first is inside a handler when the
    second starts: the second's recovery pass must not take the first's lease for a dead
    incarnation's (that ran the handler twice and counted a stale lease). The default id
    gets a per-boot suffix on SQLite as on the shared backends: two distinct owners, one
    run of the handler, its completion accepted."""
    import socket

    def spawn(role: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", BOT_WORKER, role, str(db)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_worker_env())
        procs.append(proc)
        return proc

    def result(proc: subprocess.Popen[str], out: str, err: str) -> dict[str, Any]:
        lines = [line for line in out.splitlines() if line.startswith("result ")]
        assert proc.returncode == 0 and lines, f"worker exited {proc.returncode}:\n{out}\n{err}"
        return dict(json.loads(lines[-1][len("result "):]))

    first = spawn("first")
    assert first.stdout is not None and first.stdin is not None
    line = first.stdout.readline()
    if line.strip() != "running":
        out, err = first.communicate(timeout=WORKER_TIMEOUT_S)
        pytest.fail(f"the first process never reached its handler: {line!r}\n{out}\n{err}")
    second = spawn("second")  # starts, runs its first sweep pass and stops, the first still in its handler
    second_result = result(second, *second.communicate(timeout=WORKER_TIMEOUT_S))
    first.stdin.write("go\n")
    first.stdin.flush()
    first_result = result(first, *first.communicate(timeout=WORKER_TIMEOUT_S))

    assert second_result["runs"] == [] and second_result["inbound_replayed"] == 0, (first_result, second_result)
    assert first_result["runs"] == ["m1"] and first_result["stale_leases"] == 0, first_result
    assert first_result["texts"] == ["first:hi"] and second_result["texts"] == []
    base = f"{socket.gethostname()}/b/c/"
    ids = [first_result["instance_id"], second_result["instance_id"]]
    assert all(i.startswith(base) and len(i) > len(base) for i in ids) and ids[0] != ids[1], ids
    assert first_result["m1"] == ["done", ids[0], 1]


@pytest.mark.spec("LEASE-3")
def test_default_instance_id_gets_a_per_boot_suffix_an_explicit_one_is_kept(db: Path) -> None:
    """LEASE-3: on SQLite the default ``instance_id`` is
    ``<hostname>/<bot_id>/<connection_id>/<8 hex digits>``, new for every bot; an explicit
    one is used as given."""
    import re
    import socket

    from botmesh.core import Bot
    from botmesh.core.testing import MockProvider

    def bot(**options: Any) -> Bot:
        store = SQLiteStore(file=db)
        return Bot(MockProvider(), store, {"backend": store.durability(), **options}, bot_id="b", connection_id="c")

    a, b = bot(), bot()
    assert a.durability is not None and b.durability is not None
    pattern = re.escape(f"{socket.gethostname()}/b/c/") + r"[0-9a-f]{8}"
    assert re.fullmatch(pattern, a.durability.instance_id), a.durability.instance_id
    assert re.fullmatch(pattern, b.durability.instance_id), b.durability.instance_id
    assert a.durability.instance_id != b.durability.instance_id
    explicit = bot(instance_id="bot-1")
    assert explicit.durability is not None and explicit.durability.instance_id == "bot-1"
