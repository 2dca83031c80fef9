"""``KvDurability``'s known versions (issue 16): a transition of a record this instance
wrote last itself, while it holds a lease, or has just read, is written without reading
it (again) first — and
still never loses another writer's update, never declines on what it only remembered,
and never stores what a caller changed in its own objects afterwards.

"Another writer" is a second ``KvDurability`` over the same kv (another process), or a
raw ``put`` on the kv. Async code runs through ``asyncio.run`` inside plain tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from botmesh.core.errors import BackendUnavailableError, VersionConflict
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryDurability, MemoryKv
from botmesh.core.records import InboxRecord, OutboxRecord, _container_names, _Record
from botmesh.core.spi import Versioned

T = TypeVar("T")
spec = pytest.mark.spec
SCOPE = "s"
NOW = 1_000_000.0
LEASE = 30_000.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class CountingKv(MemoryKv):
    """A MemoryKv that counts its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    async def get(self, scope: str, space: str, key: str) -> Versioned | None:
        self.gets += 1
        return await super().get(scope, space, key)


def leased_inbox(id: str = "in-1", owner: str = "a", token: int = 1) -> InboxRecord:
    return InboxRecord(
        id=id, chat_id="c", event={"id": id, "chat_id": "c", "text": "hi", "data": {"n": [1]}},
        state="leased", attempts=1, token=token, owner=owner, incarnation="inc-" + owner,
        lease_until=NOW + LEASE, claimed_at=NOW, created_at=NOW, updated_at=NOW,
    )


def sending_outbox(key: str = "in-1:1", owner: str = "a") -> OutboxRecord:
    return OutboxRecord(
        key=key, chat_id="c", content={"text": "ok", "extra": {"n": [1]}}, fingerprint="fp",
        state="sending", attempts=1, token=1, owner=owner, incarnation="inc-" + owner,
        lease_until=NOW + LEASE, claimed_at=NOW, created_at=NOW, updated_at=NOW, seq=1,
    )


Make = Callable[[MemoryKv], KvDurability]


@pytest.fixture(params=["KvDurability", "MemoryDurability"])
def make(request: pytest.FixtureRequest) -> Make:
    """Both ways a durability writes over a MemoryKv: ``KvDurability`` (``kv.put``, the
    known copy made apart) and ``MemoryDurability`` (``put_owned``: the record's
    ``private_json`` kept by the kv and shared with the known versions, issue 16)."""
    if request.param == "KvDurability":
        return KvDurability

    def memory(kv: MemoryKv) -> KvDurability:
        d = MemoryDurability(kv)
        owned = type(kv).put is MemoryKv.put
        assert (d._put_owned is not None) == owned, f"{type(kv).__name__}: put_owned used {not owned}"
        return d

    return memory


async def raw_change(kv: MemoryKv, space: str, key: str, **changes: Any) -> int:
    """Another writer: read, change fields, CAS on the version read."""
    found = await kv.get(SCOPE, space, key)
    assert found is not None
    return await kv.put(SCOPE, space, key, {**found.value, **changes}, expected_version=found.version)


@spec("BACK-7")
def test_the_message_path_writes_without_reading(make: Make) -> None:
    """A journal write then the transition of the same record (the inbound's
    completion, the send's ``mark_sent``): no read in between — the reason the known
    versions exist. Every write still lands as a CAS (the versions count them)."""

    async def body() -> None:
        kv = CountingKv()
        d = make(kv)
        _, created = await d.inbox_journal(SCOPE, leased_inbox())
        assert created
        _, created = await d.outbox_journal(SCOPE, sending_outbox())
        assert created
        assert await d.outbox_mark_sent(SCOPE, "in-1:1", token=1, message_id="m1", now=NOW + 1, expires_at=None)
        assert await d.inbox_complete(SCOPE, "in-1", token=1, now=NOW + 2, expires_at=None)
        assert kv.gets == 0, f"the transitions read {kv.gets} times although this instance wrote the records last"
        inbox = await kv.get(SCOPE, "inbox", "in-1")
        outbox = await kv.get(SCOPE, "outbox", "in-1:1")
        assert inbox is not None and (inbox.version, inbox.value["state"]) == (2, "done")
        assert outbox is not None and (outbox.version, outbox.value["state"], outbox.value["message_id"]) == (2, "sent", "m1")

    run(body())


class ReportingKv(CountingKv):
    """A CountingKv whose failed compare-and-set reports the record it found
    (``VersionConflict.current``), as the server kvs do."""

    async def put(self, scope: str, space: str, key: str, value: dict[str, Any], *, expected_version: int,
                  due: float | None = None, expires: float | None = None) -> int:
        try:
            return await super().put(scope, space, key, value, expected_version=expected_version, due=due,
                                     expires=expires)
        except VersionConflict as conflict:
            current = await super().get(scope, space, key)
            self.gets -= 1  # the kv's own look, in the same call: not a read of the caller's
            raise VersionConflict.at(space, key, expected_version, conflict.found, current) from None


@spec("INB-4", "OUT-2", "BACK-7")
def test_a_journal_write_of_an_existing_record_returns_what_the_conflict_reported(make: Make) -> None:
    """A journal write that finds the key taken (a redelivery, a send journaled again)
    returns the stored record, not the one given: from the ``VersionConflict``'s
    ``current`` when the kv reports it (no read), else from a read."""

    async def body() -> None:
        for kv, reads in ((ReportingKv(), 0), (CountingKv(), 1)):
            d, other = make(kv), make(kv)
            stored = leased_inbox(owner="b")
            await other.inbox_journal(SCOPE, stored)
            found, created = await d.inbox_journal(SCOPE, leased_inbox(owner="a"))
            assert not created and found.owner == "b" and found.to_json() == stored.to_json()
            assert kv.gets == reads, (type(kv).__name__, kv.gets)
            found.event["text"] = "changed"  # the caller's own copy
            again = await kv.get(SCOPE, "inbox", "in-1")
            assert again is not None and again.value["event"]["text"] == "hi"

    run(body())


class ScanCountingKv(MemoryKv):
    """A MemoryKv that counts its scan calls."""

    def __init__(self) -> None:
        super().__init__()
        self.scans = 0

    async def scan(self, scope: str, space: str, *, after: str | None = None, limit: int = 100) -> list[Any]:
        self.scans += 1
        return await super().scan(scope, space, after=after, limit=limit)


@spec("BACK-7", "OPS-2")
def test_a_listing_stops_at_a_short_page_and_pages_through_full_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing a journal: one scan when it holds less than a page (a short page is the
    last: BACK-7's scan returns min(limit, the records after)); with more, every record
    in key order, one scan per full page plus the short (or empty) last one."""
    import botmesh.core.kv_durability as engine

    async def body() -> None:
        kv = ScanCountingKv()
        d = KvDurability(kv)
        for n in range(5):
            await d.inbox_journal(SCOPE, leased_inbox(id=f"in-{n}"))
        assert [r.id for r in await d.inbox_list(SCOPE)] == [f"in-{n}" for n in range(5)]
        assert kv.scans == 1
        for page, scans in ((2, 3), (5, 2), (1, 6)):
            monkeypatch.setattr(engine, "_SCAN_PAGE", page)
            kv.scans = 0
            assert [r.id for r in await d.inbox_list(SCOPE)] == [f"in-{n}" for n in range(5)], page
            assert kv.scans == scans, (page, kv.scans)

    run(body())


@spec("BACK-7", "LEASE-2")
def test_a_stale_known_version_is_retried_from_a_fresh_read_and_keeps_the_other_update(make: Make) -> None:
    """Another writer changed the record after this instance's last write (a field this
    instance's transition keeps): the write from the known version fails its CAS and is
    done again from a fresh read — the other writer's field survives (no lost update)."""

    async def body() -> None:
        kv = CountingKv()
        d = make(kv)
        await d.inbox_journal(SCOPE, leased_inbox())
        await raw_change(kv, "inbox", "in-1", note="written by another process", lease_until=NOW + 2 * LEASE)
        gets = kv.gets
        assert await d.inbox_complete(SCOPE, "in-1", token=1, now=NOW + 5, expires_at=None)
        assert kv.gets == gets + 1, "the conflicting write must be computed again from one fresh read"
        found = await kv.get(SCOPE, "inbox", "in-1")
        assert found is not None
        assert found.version == 3, f"journal, the other writer, the completion: version 3, got {found.version}"
        assert found.value["state"] == "done"
        assert found.value["note"] == "written by another process", f"the other writer's update was lost: {found.value}"

    run(body())


@spec("LEASE-2")
def test_an_owner_whose_lease_was_taken_over_cannot_complete_with_its_known_version(make: Make) -> None:
    """Instance A journals (and knows) the record; its lease expires and instance B takes
    it over with a larger token. A's completion from its known version is refused —
    the CAS fails, the fresh read shows B's token — and B's lease stands."""

    async def body() -> None:
        kv = MemoryKv()
        a, b = make(kv), make(kv)
        await a.inbox_journal(SCOPE, leased_inbox(owner="a"))
        taken = await b.inbox_claim(SCOPE, "in-1", owner="b", incarnation="inc-b", now=NOW + LEASE + 1,
                                    lease_ms=LEASE, recover=False)
        assert taken is not None and taken.token == 2
        assert not await a.inbox_complete(SCOPE, "in-1", token=1, now=NOW + LEASE + 2, expires_at=None)
        assert not await a.inbox_heartbeat(SCOPE, "in-1", token=1, lease_until=NOW + 5 * LEASE)
        found = await kv.get(SCOPE, "inbox", "in-1")
        assert found is not None
        assert (found.value["state"], found.value["owner"], found.value["token"]) == ("leased", "b", 2)
        assert found.value["lease_until"] == NOW + 2 * LEASE + 1, "A's stale heartbeat must not extend B's lease"
        assert await b.inbox_complete(SCOPE, "in-1", token=2, now=NOW + LEASE + 3, expires_at=None)

    run(body())


@spec("OUT-14", "OPS-2")
def test_a_transition_that_declines_on_the_known_record_asks_the_store(make: Make) -> None:
    """What this instance remembers says ``sending`` (a retry declines on that); another
    writer has marked the send ``failed`` meanwhile. ``outbox_retry`` must see the
    ``failed`` record — a decline is never answered from memory alone."""

    async def body() -> None:
        kv = MemoryKv()
        d = make(kv)
        await d.outbox_journal(SCOPE, sending_outbox())
        await raw_change(kv, "outbox", "in-1:1", state="failed", lease_until=None, next_at=NOW + 10)
        assert await d.outbox_retry(SCOPE, "in-1:1", now=NOW + 20)
        found = await kv.get(SCOPE, "outbox", "in-1:1")
        assert found is not None and (found.version, found.value["state"], found.value["attempts"]) == (3, "pending", 0)

    run(body())


@spec("LEASE-2")
def test_concurrent_transitions_from_known_versions_have_one_winner(make: Make) -> None:
    """A (the owner, knowing its record) kills the record while B claims it after the
    lease ran out, both at once: exactly one of them wins, whichever goes first, and
    the record shows that one's write."""

    async def body(a_first: bool) -> tuple[bool, bool, dict[str, Any]]:
        kv = MemoryKv()
        a, b = make(kv), make(kv)
        await a.inbox_journal(SCOPE, leased_inbox(owner="a"))
        kill = a.inbox_kill(SCOPE, "in-1", token=1, now=NOW + LEASE + 1, error="boom")
        claim = b.inbox_claim(SCOPE, "in-1", owner="b", incarnation="inc-b", now=NOW + LEASE + 1,
                              lease_ms=LEASE, recover=False)
        if a_first:
            killed, claimed = await asyncio.gather(kill, claim)
        else:
            claimed, killed = await asyncio.gather(claim, kill)
        found = await kv.get(SCOPE, "inbox", "in-1")
        assert found is not None
        return bool(killed), claimed is not None, found.value

    for a_first in (True, False):
        killed, claimed, value = run(body(a_first))
        assert killed != claimed, f"exactly one must win (A first: {a_first}); killed {killed}, claimed {claimed}"
        assert value["state"] == ("dead" if killed else "leased"), value


@spec("BACK-7")
def test_what_a_caller_changes_in_its_records_afterwards_is_never_written(make: Make) -> None:
    """Values stored are copies, known versions included: the caller mutates the record
    it journaled and the record a claim returned (nested dicts too); the next
    transitions, written from the known versions, store the journaled contents."""

    async def body() -> None:
        kv = CountingKv()
        d = make(kv)
        mine = leased_inbox()
        stored, _ = await d.inbox_journal(SCOPE, mine)
        mine.event["text"] = "changed by the caller"
        mine.event["data"]["n"].append(2)
        mine.chat_id = "other"
        assert await d.inbox_heartbeat(SCOPE, "in-1", token=1, lease_until=NOW + 2 * LEASE)
        assert await d.inbox_complete(SCOPE, "in-1", token=1, now=NOW + 5, expires_at=None)
        found = await kv.get(SCOPE, "inbox", "in-1")
        assert found is not None
        assert found.value["event"] == {"id": "in-1", "chat_id": "c", "text": "hi", "data": {"n": [1]}}, found.value
        assert found.value["chat_id"] == "c"

        out = sending_outbox()
        out.state, out.owner, out.token, out.lease_until = "failed", None, 1, None
        out.next_at = NOW
        await d.outbox_journal(SCOPE, out)
        claim = await d.outbox_claim(SCOPE, out.key, owner="a", incarnation="inc-a", now=NOW + 1, lease_ms=LEASE,
                                     recover=False)
        assert claim is not None
        rec, previous = claim
        assert previous == "failed"
        rec.content["text"] = "changed by the caller"
        rec.content["extra"]["n"].append(2)
        gets = kv.gets
        assert await d.outbox_mark_sent(SCOPE, out.key, token=rec.token, message_id="m", now=NOW + 2, expires_at=None)
        assert kv.gets == gets, "mark_sent after this instance's own claim needs no read"
        sent = await kv.get(SCOPE, "outbox", out.key)
        assert sent is not None
        assert sent.value["content"] == {"text": "ok", "extra": {"n": [1]}}, sent.value
        assert sent.value["state"] == "sent"

    run(body())


@spec("BACK-7")
def test_a_record_deleted_behind_the_known_version_is_not_written_back(make: Make) -> None:
    """The known record is deleted by another writer (an operator's discard in another
    process): the transition from the known version fails its CAS (the record is gone)
    and reports the record absent instead of creating it again."""

    async def body() -> None:
        kv = MemoryKv()
        a, b = make(kv), make(kv)
        await a.outbox_journal(SCOPE, sending_outbox())
        assert await b.outbox_discard(SCOPE, "in-1:1")
        assert not await a.outbox_mark_sent(SCOPE, "in-1:1", token=1, message_id="m", now=NOW + 1, expires_at=None)
        assert await kv.get(SCOPE, "outbox", "in-1:1") is None

    run(body())


@spec("BACK-7")
def test_check_json_object_copies_as_a_json_round_trip_does() -> None:
    """``spi.check_json_object`` (how every kv and the known versions copy a value):
    its structural copy of plain values gives exactly what ``json.loads`` of the encoded
    text gives, shares no container with its argument, and everything else (tuples,
    subclasses, non-``str`` keys, NaN, cycles, deep nesting) converts or fails as JSON
    does."""
    import enum
    import json
    import math
    from collections import OrderedDict

    from botmesh.core.spi import check_json_object, encode_json_object

    def round_trip(value: Any) -> Any:
        return json.loads(encode_json_object(value))

    class Level(enum.IntEnum):
        HIGH = 3

    class Text(str):
        pass

    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(150):  # deeper than the structural copy goes: JSON's round trip
        inner["x"] = {}
        inner = inner["x"]
    plain: dict[str, Any] = {
        "s": "caf\u00e9 \ud83d", "i": -(2**70), "f": -0.0, "big": 1e300, "b": True, "n": None,
        "l": [1, [2.5, {"k": []}], "x"], "d": {"e": {}}, "deep": deep,
    }
    others: list[dict[Any, Any]] = [
        {"t": (1, 2)}, {1: "int key", None: 0, 2.5: "float key", False: "bool"}, {"e": Level.HIGH},
        {"s": Text("sub")}, OrderedDict(a=1), {"l": [(1,), Text("x")]},
    ]
    for value in [plain, *others]:
        copied = check_json_object(value)
        assert copied == round_trip(value), f"check_json_object({value!r}) = {copied!r}, not JSON's round trip"
        assert json.dumps(copied) == json.dumps(round_trip(value)), f"{value!r}: types differ from JSON's"
        assert type(copied) is dict
    copied = check_json_object(plain)
    copied["l"][1][1]["k"].append(1)
    copied["d"]["e"]["new"] = 1
    assert plain["l"][1][1]["k"] == [] and plain["d"]["e"] == {}, "the copy shares a container with its argument"
    assert type(copied["l"][1][0]) is float and math.copysign(1.0, copied["f"]) == -1.0

    cycle: dict[str, Any] = {}
    cycle["self"] = cycle
    for bad, error in [({"x": math.nan}, ValueError), ({"x": [math.inf]}, ValueError), (cycle, ValueError),
                       ({"x": {1, 2}}, TypeError), ({"x": b"bytes"}, TypeError), ([1], TypeError), ("{}", TypeError)]:
        with pytest.raises(error):
            check_json_object(bad)
        with pytest.raises(error):
            round_trip(bad)

    async def body() -> None:
        kv = MemoryKv()
        given: dict[str, Any] = {"n": [1], "d": {"x": 1}}
        await kv.put(SCOPE, "inbox", "k", given, expected_version=0)
        given["n"].append(2)
        given["d"]["x"] = 2
        found = await kv.get(SCOPE, "inbox", "k")
        assert found == Versioned({"n": [1], "d": {"x": 1}}, 1), f"the kv must keep what was written, got {found!r}"
        assert found is not None
        found.value["n"].append(3)
        again = await kv.get(SCOPE, "inbox", "k")
        assert again == Versioned({"n": [1], "d": {"x": 1}}, 1), f"a read's value must be a copy, got {again!r}"

    run(body())


@spec("BACK-7")
def test_a_record_is_stored_as_its_fields_in_order_then_its_extra_fields() -> None:
    """``to_json`` (every journal write): the declared fields in their order, then the
    unknown fields a newer version wrote (``extra``) — whether the record was made,
    read back or copied — and never an attribute set on the object that is no field."""
    from botmesh.core.records import _field_names

    made = sending_outbox()
    made.extra = {"newer": {"n": 1}}
    names = list(_field_names(OutboxRecord))
    read = OutboxRecord.from_json(made.to_json())
    for rec in (made, read, read.copy(state="sent"), OutboxRecord.from_json(sending_outbox().to_json())):
        value = rec.to_json()
        expected = names + (["newer"] if rec.extra else [])
        assert list(value) == expected, f"{rec!r}: stored keys {list(value)}, expected {expected}"
    odd = leased_inbox()
    odd.not_a_field = 1  # type: ignore[attr-defined]
    value = odd.to_json()
    assert "not_a_field" not in value and list(value) == list(_field_names(InboxRecord)), list(value)
    assert InboxRecord.from_json(value) == leased_inbox()


@dataclass
class _Probe(_Record):
    """A record class of the test's own: one field that may hold a list, scalars beside it."""

    name: str = ""
    tags: list[str] | None = None
    n: int | None = None
    ratio: float = 0.0


def _shared_containers(a: Any, b: Any) -> list[str]:
    """The paths at which ``a`` and ``b`` hold the very same dict or list object."""
    found: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, (dict, list)) and x is y:
            found.append(path or "(top)")
        if isinstance(x, dict) and isinstance(y, dict):
            for k in x.keys() & y.keys():
                walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, list) and isinstance(y, list):
            for i, (u, v) in enumerate(zip(x, y, strict=False)):
                walk(u, v, f"{path}[{i}]")

    walk(a, b, "")
    return found


@spec("BACK-7")
def test_the_known_copy_of_a_record_equals_a_full_copy_and_shares_nothing() -> None:
    """The copy the engine keeps of each record it wrote (``json_copy``, issue 16: the top
    level copied as it is, only the fields that may hold a container copied deep) is equal
    to :func:`check_json_object`'s full copy and shares no dict or list with the value it
    copies — for plain records, records with extra fields a newer version wrote, a
    container holding what JSON converts (a tuple), and a field typed as a list."""
    from botmesh.core.spi import check_json_object

    inbox, outbox = leased_inbox(), sending_outbox()
    newer = sending_outbox()
    newer.extra = {"newer": {"n": [1, {"deep": True}]}}
    odd = leased_inbox()
    odd.event = {"id": "in-1", "pair": (1, 2), "data": {"n": [1]}}  # a tuple: JSON makes it a list
    cases: list[tuple[type[_Record], dict[str, Any]]] = [
        (InboxRecord, inbox.to_json()), (OutboxRecord, outbox.to_json()), (OutboxRecord, newer.to_json()),
        (InboxRecord, odd.to_json()), (_Probe, _Probe(name="p", tags=["a", "b"], n=3).to_json()),
        (_Probe, _Probe(name="q").to_json()),
    ]
    for cls, value in cases:
        copied = cls.json_copy(value)
        assert copied == check_json_object(value), (cls.__name__, copied)
        assert not _shared_containers(copied, value), (cls.__name__, _shared_containers(copied, value))
    assert InboxRecord.json_copy(odd.to_json())["event"]["pair"] == [1, 2]
    # which fields may hold a container is read from the annotations: a new field typed
    # as a list or dict is copied deep without anyone listing it
    assert _container_names(InboxRecord) == ("event",)
    assert _container_names(OutboxRecord) == ("content",)
    assert _container_names(_Probe) == ("tags",)


@spec("BACK-7")
def test_a_private_json_is_the_full_copy_of_to_json_and_shares_nothing_with_the_record() -> None:
    """``private_json`` (what MemoryDurability hands ``MemoryKv.put_owned``, which keeps
    it without a copy: issue 16) is exactly ``check_json_object(record.to_json())`` — the
    same dict, in the same key order, or the same error — and shares no dict or list with
    the record: plain records, extra fields a newer version wrote, JSON conversions (a
    tuple), a field typed as a list or holding None, a scalar field holding a container or
    a float subclass, floats too large to add up, NaN and infinity, a set."""
    import math

    from botmesh.core.spi import check_json_object

    class Ratio(float):
        pass

    def with_(rec: _Record, **attrs: Any) -> _Record:
        for name, value in attrs.items():
            setattr(rec, name, value)
        return rec

    newer = with_(sending_outbox(), extra={"newer": {"n": [1, {"deep": True}]}, "expires_at": NOW})
    good: list[_Record] = [
        leased_inbox(), sending_outbox(), newer,
        with_(leased_inbox(), event={"id": "in-1", "pair": (1, 2), "data": {"n": [1]}}),
        _Probe(name="p", tags=["a", "b"], n=3), _Probe(name="q"),
        with_(leased_inbox(), error=("a", "tuple")), with_(leased_inbox(), error={"a": [1]}),
        with_(leased_inbox(), lease_until=Ratio(1.5)), with_(leased_inbox(), lease_until=1e308, claimed_at=1e308),
        with_(leased_inbox(), attempts=True, token=2**70, lease_until=-0.0),
        with_(sending_outbox(), content=[1, 2]),
        # extra fields holding scalars only (a transition's expires_at), or one not
        # plain: a float subclass, a tuple, a nested dict, a bool, a huge int, None
        with_(leased_inbox(), extra={"expires_at": NOW, "note": "x", "n": 2**70, "ok": False, "gone": None}),
        with_(leased_inbox(), extra={"expires_at": Ratio(2.5)}), with_(leased_inbox(), extra={"pair": (1, 2)}),
        with_(leased_inbox(), extra={1: "a key that is not text"}),
        with_(sending_outbox(), extra={"expires_at": NOW, "more": {"k": [1]}}),
    ]
    for rec in good:
        full = check_json_object(rec.to_json())
        private = rec.private_json()
        assert private == full and list(private) == list(full), (rec, private)
        assert json_text(private) == json_text(full), (rec, private)
        assert not _shared_containers(private, rec.__dict__), (rec, _shared_containers(private, rec.__dict__))
        assert not _shared_containers(private, rec.extra), rec
    bad: list[tuple[_Record, type[Exception]]] = [
        (with_(leased_inbox(), lease_until=math.nan), ValueError), (with_(sending_outbox(), updated_at=-math.inf), ValueError),
        (with_(leased_inbox(), attempts=math.inf), ValueError), (with_(leased_inbox(), error={1, 2}), TypeError),
        (with_(leased_inbox(), event={"data": {"x": math.nan}}), ValueError),
        (with_(sending_outbox(), extra={"newer": {1, 2}}), TypeError),
        (with_(leased_inbox(), extra={"expires_at": math.nan}), ValueError),
        (with_(leased_inbox(), extra={"expires_at": -math.inf}), ValueError),
        (with_(leased_inbox(), extra={"n": b"bytes"}), TypeError),
    ]
    for rec, error in bad:
        with pytest.raises(error):
            check_json_object(rec.to_json())
        with pytest.raises(error):
            rec.private_json()
    # base: a container the new record took over unchanged from the record it was made
    # from is handed on as it is (the caller owns it); a replaced one is copied
    base = leased_inbox()
    done = base.copy(state="done")
    private = done.private_json(base)
    assert private == check_json_object(done.to_json()) and private["event"] is base.event
    moved = base.copy(event={"id": "in-1", "data": {"n": [2]}})
    private = moved.private_json(base)
    assert private["event"] == moved.event and not _shared_containers(private, moved.__dict__)


def json_text(value: Any) -> str:
    import json

    return json.dumps(value)


@spec("BACK-7")
def test_a_record_a_transition_returns_from_a_known_version_is_the_callers_own(make: Make) -> None:
    """A transition from a known version (a recovery claim after this instance wrote
    the record) returns a record the caller may change at will: neither what the kv
    stores nor the next transition (again from a known version) sees it — also when the
    known value is the very dict the kv keeps (MemoryDurability)."""

    async def body() -> None:
        kv = CountingKv()
        d = make(kv)
        await d.inbox_journal(SCOPE, leased_inbox())
        again = await d.inbox_claim(SCOPE, "in-1", owner="a", incarnation="inc-a2", now=NOW + 1, lease_ms=LEASE,
                                    recover=True)
        assert again is not None and again.token == 2
        again.event["text"] = "changed by the caller"
        again.event["data"]["n"].append(9)
        found = await kv.get(SCOPE, "inbox", "in-1")
        assert found is not None and found.value["event"] == leased_inbox().event, found.value
        gets = kv.gets
        assert await d.inbox_complete(SCOPE, "in-1", token=2, now=NOW + 2, expires_at=None)
        assert kv.gets == gets, "the completion after this instance's own claim needs no read"
        done = await kv.get(SCOPE, "inbox", "in-1")
        assert done is not None and done.value["event"] == leased_inbox().event and done.value["state"] == "done"

        await d.outbox_journal(SCOPE, sending_outbox())
        claimed = await d.outbox_claim(SCOPE, "in-1:1", owner="a", incarnation="inc-a2", now=NOW + 1, lease_ms=LEASE,
                                       recover=True)
        assert claimed is not None
        claimed[0].content["extra"]["n"].append(9)
        assert await d.outbox_mark_sent(SCOPE, "in-1:1", token=2, message_id="m", now=NOW + 2, expires_at=None)
        sent = await kv.get(SCOPE, "outbox", "in-1:1")
        assert sent is not None and sent.value["content"] == sending_outbox().content, sent.value
        assert kv.gets == gets + 2, "the two reads of the test's own, no read of the durability's"

    run(body())


@spec("BACK-7")
def test_a_record_that_is_no_json_object_is_refused_alike_and_nothing_is_stored(make: Make) -> None:
    """A journal write of a record holding NaN, an infinity or a set fails with the
    error ``kv.put`` gives (ValueError / TypeError), with either write path, and the key
    stays empty."""
    import math

    async def body() -> None:
        kv = MemoryKv()
        d = make(kv)
        for n, (attrs, error) in enumerate([({"lease_until": math.nan}, ValueError),
                                            ({"created_at": math.inf}, ValueError),
                                            ({"event": {"data": {1, 2}}}, TypeError)]):
            rec = leased_inbox(id=f"in-{n}")
            for name, value in attrs.items():
                setattr(rec, name, value)
            with pytest.raises(error):
                await d.inbox_journal(SCOPE, rec)
            assert await kv.get(SCOPE, "inbox", f"in-{n}") is None

    run(body())


@spec("BACK-7", "BACK-4")
def test_the_file_journal_keeps_its_records_as_private_copies(tmp_path: Any) -> None:
    """FileDurability writes its records as MemoryDurability does (``FileKv.put_owned``:
    the checked private copy kept in memory, issue 16): what the caller changes in the
    record it journaled or in a record a claim returned is neither read back nor written
    — in memory and in the file read again after a reopen."""
    from botmesh.core.file_backend import FileDurability

    path = str(tmp_path / "journal.json")

    async def body() -> None:
        d = await FileDurability.open(path, append_log=True, fsync=False)
        assert d._put_owned is not None
        mine = leased_inbox()
        await d.inbox_journal(SCOPE, mine)
        mine.event["data"]["n"].append(2)
        again = await d.inbox_claim(SCOPE, "in-1", owner="a", incarnation="inc-a2", now=NOW + 1, lease_ms=LEASE,
                                    recover=True)
        assert again is not None and again.event == leased_inbox().event
        again.event["text"] = "changed by the caller"
        assert await d.inbox_complete(SCOPE, "in-1", token=2, now=NOW + 2, expires_at=None)
        found = await d.inbox_get(SCOPE, "in-1")
        assert found is not None and found.event == leased_inbox().event and found.state == "done", found
        await d.close()
        reopened = await FileDurability.open(path, append_log=True, fsync=False)
        try:
            read = await reopened.inbox_get(SCOPE, "in-1")
            assert read is not None and read.to_json() == found.to_json(), (read, found)
        finally:
            await reopened.close()

    run(body())


class CutKv(CountingKv):
    """A MemoryKv counting its reads whose next ``cuts`` writes raise
    ``BackendUnavailableError`` — after landing (the answer lost: outcome unknown) or,
    with ``lost``, without landing."""

    def __init__(self, *, lost: bool = False) -> None:
        super().__init__()
        self.cuts = 0
        self.lost = lost

    async def put_owned(self, scope: str, space: str, key: str, value: dict[str, Any], *, expected_version: int,
                        due: float | None = None, expires: float | None = None) -> int:
        if self.cuts:
            self.cuts -= 1
            if not self.lost:
                await super().put_owned(scope, space, key, value, expected_version=expected_version, due=due,
                                        expires=expires)
            raise BackendUnavailableError(f"{space}/{key}: connection lost before the answer")
        return await super().put_owned(scope, space, key, value, expected_version=expected_version, due=due,
                                       expires=expires)


@spec("BACK-7", "INB-4", "OUT-2")
def test_a_write_whose_answer_was_lost_is_read_back_by_key(make: Make) -> None:
    """A create and a transition whose CAS raised ``BackendUnavailableError`` after it
    landed succeed: the write is read back by key (one read each) and found there. When
    the write did not land, the error is raised and nothing is stored or known."""

    async def body() -> None:
        kv = CutKv()
        d = make(kv)
        kv.cuts = 1
        record, created = await d.inbox_journal(SCOPE, leased_inbox())
        assert created and record.state == "leased" and kv.gets == 1
        kv.cuts = 1
        assert await d.inbox_complete(SCOPE, "in-1", token=1, now=NOW + 1, expires_at=None)
        assert kv.gets == 2, f"{kv.gets} reads for the two cut writes (one read back each)"
        found = await kv.get(SCOPE, "inbox", "in-1")
        assert found is not None and found.version == 2 and found.value["state"] == "done", found

        lost = CutKv(lost=True)
        d = make(lost)
        lost.cuts = 1
        with pytest.raises(BackendUnavailableError):
            await d.outbox_journal(SCOPE, sending_outbox())
        assert await lost.get(SCOPE, "outbox", "in-1:1") is None
        await d.outbox_journal(SCOPE, sending_outbox())
        lost.cuts = 1
        with pytest.raises(BackendUnavailableError):
            await d.outbox_mark_sent(SCOPE, "in-1:1", token=1, message_id="m-1", now=NOW + 1, expires_at=None)
        assert d._known == {}, "a write of unknown outcome left a known version"
        still = await lost.get(SCOPE, "outbox", "in-1:1")
        assert still is not None and still.version == 1 and still.value["state"] == "sending", still

    run(body())


def dead_owner_send(key: str = "in-1:1") -> OutboxRecord:
    """A send another process left ``sending`` when it died: its lease long expired."""
    rec = sending_outbox(key, owner="b")
    rec.lease_until = NOW - 1
    return rec


@spec("OUT-14", "LEASE-4", "BACK-7")
def test_a_send_just_read_is_claimed_without_reading_it_again(make: Make) -> None:
    """The sweep reads each due send (``outbox_get``), then claims it: the claim writes
    from the version that read gave, with no second read (issue 16: one round trip less
    per due send on a server). The same for an inbound record a journal write found
    already there (a redelivery) and then claims. Every write is still a CAS."""

    async def body() -> None:
        kv = CountingKv()
        other, d = make(kv), make(kv)
        await other.outbox_journal(SCOPE, dead_owner_send())
        rec = await d.outbox_get(SCOPE, "in-1:1")
        assert rec is not None and kv.gets == 1
        claim = await d.outbox_claim(SCOPE, "in-1:1", owner="a", incarnation="inc-a", now=NOW, lease_ms=LEASE,
                                     recover=False)
        assert claim is not None and claim[1] == "sending" and claim[0].owner == "a" and claim[0].token == 2
        assert kv.gets == 1, f"the claim read the send again ({kv.gets} reads)"
        found = await kv.get(SCOPE, "outbox", "in-1:1")
        assert found is not None and (found.version, found.value["owner"]) == (2, "a")

        stored = leased_inbox(owner="b")
        stored.lease_until = NOW - 1
        await other.inbox_journal(SCOPE, stored)
        gets = kv.gets
        again, created = await d.inbox_journal(SCOPE, leased_inbox(owner="a"))
        assert not created and again.owner == "b" and kv.gets == gets + 1  # the conflict's read
        taken = await d.inbox_claim(SCOPE, "in-1", owner="a", incarnation="inc-a", now=NOW, lease_ms=LEASE,
                                    recover=False)
        assert taken is not None and (taken.owner, taken.token) == ("a", 2)
        assert kv.gets == gets + 1, "the claim read the record the journal write had just found"

    run(body())


@spec("OUT-14", "LEASE-2", "BACK-7")
def test_a_read_overtaken_by_another_writer_is_claimed_from_a_fresh_read(make: Make) -> None:
    """Between the read and the claim another process claimed the send itself: the
    claim from the version read fails its CAS, is decided again from a fresh read, and
    declines — the other owner's lease stands (one winner). A decline on what was read
    is asked of the store too: the send the read showed under a live lease was marked
    ``failed`` meanwhile, and the retry sees it."""

    async def body() -> None:
        kv = CountingKv()
        other, d = make(kv), make(kv)
        await other.outbox_journal(SCOPE, dead_owner_send())
        assert await d.outbox_get(SCOPE, "in-1:1") is not None
        won = await other.outbox_claim(SCOPE, "in-1:1", owner="b2", incarnation="inc-b2", now=NOW, lease_ms=LEASE,
                                       recover=False)
        assert won is not None
        gets = kv.gets
        assert await d.outbox_claim(SCOPE, "in-1:1", owner="a", incarnation="inc-a", now=NOW + 1, lease_ms=LEASE,
                                    recover=False) is None
        assert kv.gets == gets + 1, "the overtaken claim must be decided on one fresh read"
        found = await kv.get(SCOPE, "outbox", "in-1:1")
        assert found is not None and (found.version, found.value["owner"], found.value["token"]) == (2, "b2", 2)

        live = sending_outbox("in-2:1", owner="b")
        await other.outbox_journal(SCOPE, live)
        assert await d.outbox_get(SCOPE, "in-2:1") is not None  # sending, under a live lease
        await raw_change(kv, "outbox", "in-2:1", state="failed", lease_until=None, next_at=NOW + 10)
        assert await d.outbox_retry(SCOPE, "in-2:1", now=NOW + 20)
        retried = await kv.get(SCOPE, "outbox", "in-2:1")
        assert retried is not None and (retried.version, retried.value["state"]) == (3, "pending")

    run(body())


@spec("BACK-7")
def test_what_a_caller_changes_in_a_record_it_read_is_never_written(make: Make) -> None:
    """The record ``outbox_get`` / ``inbox_get`` returned is the caller's: changing it
    (nested dicts too) changes nothing the next transition writes from that read."""

    async def body() -> None:
        kv = CountingKv()
        other, d = make(kv), make(kv)
        await other.outbox_journal(SCOPE, dead_owner_send())
        rec = await d.outbox_get(SCOPE, "in-1:1")
        assert rec is not None
        rec.content["text"] = "changed by the caller"
        rec.content["extra"]["n"].append(2)
        rec.chat_id = "other"
        assert await d.outbox_claim(SCOPE, "in-1:1", owner="a", incarnation="inc-a", now=NOW, lease_ms=LEASE,
                                    recover=False) is not None
        found = await kv.get(SCOPE, "outbox", "in-1:1")
        assert found is not None
        assert found.value["content"] == {"text": "ok", "extra": {"n": [1]}} and found.value["chat_id"] == "c"

        stored = leased_inbox(owner="b")
        stored.lease_until = NOW - 1
        await other.inbox_journal(SCOPE, stored)
        got = await d.inbox_get(SCOPE, "in-1")
        assert got is not None
        got.event["data"]["n"].append(2)
        assert await d.inbox_claim(SCOPE, "in-1", owner="a", incarnation="inc-a", now=NOW, lease_ms=LEASE,
                                   recover=False) is not None
        claimed = await kv.get(SCOPE, "inbox", "in-1")
        assert claimed is not None and claimed.value["event"]["data"] == {"n": [1]}, claimed.value

    run(body())
