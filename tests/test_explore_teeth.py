"""Explore finds issue 12's engine bug classes by itself: each test plants one bug again
(a ``conftest.py`` that patches the reference engine back to the broken behaviour, as a
user's broken implementation would be), runs the explore part through pytester as users
run it, within the smoke budget, under a fixed seed, and checks that it fails naming the
right requirement id — and that the story it wrote, replayed as a scenario with the bug
still planted, fails the same way.

Covered here: MEDIA-3/MEDIA-5 (a pre-feature or tampered stored reference killing the
message; a download error escaping ``load_media_of``), OUT-15 (unjournalable content raising inside ``ctx.reply``), OUT-10 (the
``before("send")`` hooks run once per concurrent enqueue of one key), OUT-9 (a deferred
split send's error naming the part's key), OPS-3 (a purge that cannot keep up), the
sweep's timing (OUT-7/RETRY-1: a slow replay holding up a due retry; INB-3: one
unreadable record stopping the pass), LEASE-3 (two live processes on one SQLite file
with the default ``instance_id`` sharing it: explore's replica,
:mod:`botmesh_testkit.explore.replicas`) and BACK-7 (a compare-and-set racy between
processes: explore's burst of real processes). OUT-12 is in ``tests/test_explore.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

NAN_RAISES = '''
import botmesh.core.engine as engine


async def _bypass(self, chat_id, content, why, *, hooks_done=False):
    # the bug of issue 12 (OUT-15): json's own error escapes from ctx.reply
    raise ValueError("Out of range float values are not JSON compliant")


engine.DurabilityRuntime._bypass = _bypass
'''

NO_KEY_LOCK = '''
import contextlib

import botmesh.core.keylocks as keylocks


@contextlib.asynccontextmanager
async def hold(self, key):
    # the bug of issue 12 (OUT-10): concurrent enqueues of one key each run the hooks
    yield


keylocks.KeyLocks.hold = hold
'''

PART_KEY_IN_ERRORS = '''
import botmesh.core.errors as errors


def _names_the_part(cls):
    init = cls.__init__

    def __init__(self, key, *args, part_key=None, **kwargs):
        # the bug of issue 12 (OUT-9): the error carries the part's key, not the send's
        init(self, part_key if part_key is not None else key, *args, part_key=part_key, **kwargs)

    cls.__init__ = __init__


_names_the_part(errors.SendDeferredError)
_names_the_part(errors.SendFailedError)
'''


OLD_REHYDRATE = '''
import botmesh.core.engine as engine
import botmesh.core.media as media
from botmesh.core.host import ReplayedMedia


def rehydrate(provider, journaled):
    # the bug of issue 12 (MEDIA-3, MEDIA-5): a bare token or a durable entry whose data is
    # not an object makes the replay raise, and the message is retried into the DLQ
    if journaled is None:
        return None
    if "raw" in journaled:
        return ReplayedMedia(ref=journaled["raw"])
    if journaled.get("not_durable"):
        return ReplayedMedia(reason="not-durable")
    stored = journaled.get("durable")
    ref = provider.rehydrate_media_ref({"v": stored.get("v"), "data": stored.get("data")}, None)
    return ReplayedMedia(ref=ref)


media.rehydrate = engine.rehydrate = rehydrate  # the engine imports it by name
'''

DOWNLOAD_ERROR_ESCAPES = '''
import botmesh.core.media as media
from botmesh.core.provider import MediaUnavailableError, ProviderError


async def load_media_of(ctx, *, throw_on_error=False):
    # the bug of issue 12 (MEDIA-3): a download failing with anything but a ProviderError
    # propagates out of load_media_of
    replayed = ctx.replayed_media
    if replayed is not None and replayed.reason is not None:
        if throw_on_error:
            raise MediaUnavailableError(replayed.reason, replayed.detail)
        return None
    ref = replayed.ref if replayed is not None else ctx.event.media
    if ref is None:
        return None
    try:
        return await ctx.bot.provider.download_media(ref)
    except ProviderError as exc:
        if throw_on_error:
            if isinstance(exc, MediaUnavailableError):
                raise
            raise MediaUnavailableError("rehydrate-failed", str(exc)) from exc
        return None


media.load_media_of = load_media_of
'''


SHARED_DEFAULT_ID = '''
import socket
import uuid

import botmesh.core.engine as engine
import botmesh.core.sweep as sweep


def default_instance_id(bot_id, connection_id, capabilities):
    # the bug of issue 12 (LEASE-3): the per-boot suffix only on a shared server backend,
    # not on one that several processes of a host use (SQLite): two of them share the id
    base = f"{socket.gethostname()}/{bot_id}/{connection_id}"
    return f"{base}/{uuid.uuid4().hex[:8]}" if capabilities.shared else base


sweep.default_instance_id = engine.default_instance_id = default_instance_id  # the engine imports it by name
'''


OLD_PURGE = '''
import botmesh.core.sweep as sweep


async def run(self, backend, scope, now, retention_ms):
    # the bug of issue 12 (OPS-3): at most 500 records per journal and purge period (a
    # minute): above about 8 messages a second sustained, the journals grow without bound
    if retention_ms <= 0 or now() < self.next_at:
        return
    self.next_at = now() + min(60_000.0, retention_ms)
    await backend.inbox_purge(scope, now=now(), limit=500)
    await backend.outbox_purge(scope, now=now(), limit=500)


sweep.Purger.run = run
'''

SERIAL_SWEEP = '''
import math

import botmesh.core.engine as engine

_sweep = engine.DurabilityRuntime.sweep


async def sweep(self):
    # the bug of issue 12: the pass replays the due inbound records itself, one after the
    # other, and only then delivers the due sends: a slow replayed handler holds them up
    recover = not self._recovered
    upto = math.inf if recover else self._now()
    for id in await self.backend.inbox_due(self.scope, upto=upto, limit=100):
        if id not in self._local_inbound and id not in self._replays:
            try:
                await self._replay_due(id, recover)
            except Exception as exc:
                await self._replay_failed(id, recover, exc)
    await _sweep(self)


engine.DurabilityRuntime.sweep = sweep
'''

BRITTLE_SWEEP = '''
import math

import botmesh.core.engine as engine
from botmesh.core.keylocks import acquire_waiting


async def sweep(self):
    # the bug of issue 12: the pass reads each due record before handing it on, and the
    # first exception ends the pass: every record due behind it waits
    recover = not self._recovered
    upto = math.inf if recover else self._now()
    b, scope = self.backend, self.scope
    for id in await b.inbox_due(scope, upto=upto, limit=100):
        if id not in self._local_inbound and id not in self._replays:
            if await b.inbox_get(scope, id) is not None:
                self._replays.add(id, recover=recover)
    keys = await b.outbox_due(scope, upto=upto, limit=100)
    records = [r for r in [await b.outbox_get(scope, k) for k in keys] if r is not None]
    records.sort(key=lambda r: (r.created_at, r.seq, r.part, r.key))
    for rec in records:
        lock = self._chat_lock(rec.chat_id)
        if lock.locked():
            continue
        await acquire_waiting(self.clock, lock)
        try:
            await self._deliver(rec, recover=recover)
        finally:
            lock.release()
    self._recovered = True
    await self._purger.run(b, scope, self._now, self.config.retention_ms)


engine.DurabilityRuntime.sweep = sweep
'''


def _caught_and_replayed(pytester: pytest.Pytester, plant: str, spec_id: str, examples: int,
                         seed: int, backend: str = "memory") -> str:
    """Run explore on ``backend`` with ``plant`` as conftest; the failure must name
    ``spec_id``, and its story, replayed as a scenario, must fail naming it too. Returns
    the story's text."""
    pytester.makeconftest(plant)
    result = pytester.runpytest_subprocess("-p", "no:benchmark", f"--botmesh-backend={backend}", "--botmesh-parts=explore",
                                           f"--botmesh-explore-examples={examples}", f"--botmesh-seed={seed}",
                                           timeout=600)
    out = result.stdout.str()
    assert result.ret == 1, out[-3000:]
    result.stdout.fnmatch_lines([f"*violated [[]*{spec_id}*[]]*", f"*BROKEN*{spec_id}*"])
    replay = re.search(r"replay it: pytest (--botmesh-backend=\S+) --botmesh-parts=scenarios --botmesh-scenarios=(\S+) "
                       r"-k (\S+)", out)
    assert replay, out[-3000:]
    folder, name = Path(replay.group(2)), replay.group(3)
    story = (folder / f"{name}.py").read_text(encoding="utf-8")
    again = pytester.runpytest_subprocess("-p", "no:benchmark", replay.group(1), "--botmesh-parts=scenarios",
                                          f"--botmesh-scenarios={folder}", "-k", name, timeout=300)
    assert again.ret == 1, again.stdout.str()[-3000:]
    again.stdout.fnmatch_lines([f"*FAILED*{spec_id}*"])
    return story


@pytest.mark.spec("OUT-15", "TEST-4")
def test_explore_finds_unjournalable_content_raising_in_reply(pytester: pytest.Pytester) -> None:
    story = _caught_and_replayed(pytester, NAN_RAISES, "OUT-15", examples=40, seed=2)
    assert "reply_nan(" in story, story


@pytest.mark.spec("OUT-10", "TEST-4")
def test_explore_finds_hooks_run_once_per_concurrent_enqueue(pytester: pytest.Pytester) -> None:
    story = _caught_and_replayed(pytester, NO_KEY_LOCK, "OUT-10", examples=40, seed=2)
    assert "enqueue(" in story, story


@pytest.mark.spec("OUT-9", "TEST-4")
def test_explore_finds_a_deferred_split_send_naming_its_part_key(pytester: pytest.Pytester) -> None:
    story = _caught_and_replayed(pytester, PART_KEY_IN_ERRORS, "OUT-9", examples=40, seed=9)
    assert "skip=" in story, story  # a fault that lets part 1 pass and defers a later part


@pytest.mark.spec("MEDIA-3", "MEDIA-5", "INB-7", "TEST-4")
def test_explore_finds_a_bad_stored_media_reference_killing_the_message(pytester: pytest.Pytester) -> None:
    story = _caught_and_replayed(pytester, OLD_REHYDRATE, "MEDIA-3", examples=40, seed=2)
    assert re.search(r"media='(legacy|tampered)'", story), story


@pytest.mark.spec("MEDIA-3", "TEST-4")
def test_explore_finds_a_download_error_escaping_load_media_of(pytester: pytest.Pytester) -> None:
    story = _caught_and_replayed(pytester, DOWNLOAD_ERROR_ESCAPES, "MEDIA-3", examples=40, seed=2)
    assert "media='broken'" in story, story


@pytest.mark.spec("LEASE-3", "LEASE-1", "REPL-1", "TEST-4")
def test_explore_finds_two_sqlite_processes_sharing_the_default_instance_id(pytester: pytest.Pytester) -> None:
    """A replica booting while the bot holds a lease (a handler's, or a slow replay's of
    a record left pending), both on the default instance_id: without the per-boot suffix
    on SQLite its recovery pass takes the live lease and runs the handler a second time."""
    story = _caught_and_replayed(pytester, SHARED_DEFAULT_ID, "LEASE-3", examples=40, seed=2, backend="sqlite")
    # the replica boots on the default id while the bot holds a lease (a handler's or a slow replay's)
    assert "default_id=True" in story and re.search(r"x\.replica\(None, during=\d+\)", story), story


MAX_REPLAYS = 3
"""How often a story whose failure needs a race between processes may be replayed before
it counts as not failing the same way (the race shows in practically every burst)."""


@pytest.mark.spec("BACK-7", "REPL-1", "REPL-4", "TEST-4")
def test_explore_finds_a_kv_whose_compare_and_set_is_not_atomic_across_processes(pytester: pytest.Pytester) -> None:
    """A third party's kv that claims multi_process but checks the version and writes in
    two statements (``CheckThenWriteKv`` of ``tests/test_multi_process_teeth.py``: atomic
    within one process, racy between processes): explore's bursts of real processes
    meet the race as lost updates (``x.processes('cas')``: BACK-7), as one inbound
    record created twice (``x.processes('journal')``, a create being a CAS at version 0:
    INB-4) or as one record claimed by two processes (``claims-*``: REPL-1) — which one a
    run meets first is the operating system's timing, so any is the report; its story,
    replayed as a scenario, fails the same way
    (replayed up to :data:`MAX_REPLAYS` times: a race is the operating system's, the
    check of its outcome is not)."""
    import inspect

    from test_multi_process_teeth import _HEADER, CheckThenWriteKv

    pytester.makepyfile(third_party_kvs=_HEADER + "\n\n" + inspect.getsource(CheckThenWriteKv)
                        + "\n\ndef make_racy(workdir):\n    return CheckThenWriteKv(os.path.join(workdir, 'racy.db'))\n")
    result = pytester.runpytest_subprocess("-p", "no:benchmark", "--botmesh-backend=third_party_kvs:make_racy",
                                           "--botmesh-parts=explore", "--botmesh-explore-examples=40",
                                           "--botmesh-seed=2", timeout=600)
    out = result.stdout.str()
    assert result.ret == 1, out[-3000:]
    headline = re.search(r"violated \[([^\]]+)\] 4 processes at once \((cas|journal|claims-inbox|claims-outbox), "
                         r"seed \d+\): (.*)", out)
    assert headline, out[-3000:]
    ids, workload, said = headline.group(1).split(", "), headline.group(2), headline.group(3)
    # what each workload's race breaks (the claims: two processes holding one record)
    expected = {"cas": ("BACK-7", "won"), "journal": ("INB-4", "created it"),
                "claims-inbox": ("REPL-1", "claimed"), "claims-outbox": ("REPL-1", "claimed")}[workload]
    assert expected[0] in ids and expected[1] in said, headline.group(0)
    spec_id = ids[0]
    result.stdout.fnmatch_lines([f"*BROKEN*{spec_id}*"])
    replay = re.search(r"replay it: pytest (--botmesh-backend=\S+) --botmesh-parts=scenarios --botmesh-scenarios=(\S+) "
                       r"-k (\S+)", out)
    assert replay, out[-3000:]
    folder, name = Path(replay.group(2)), replay.group(3)
    assert f"x.processes('{workload}'" in (folder / f"{name}.py").read_text(encoding="utf-8")
    for _ in range(MAX_REPLAYS):
        again = pytester.runpytest_subprocess("-p", "no:benchmark", replay.group(1), "--botmesh-parts=scenarios",
                                              f"--botmesh-scenarios={folder}", "-k", name, timeout=300)
        if again.ret == 1:
            break
    assert again.ret == 1, again.stdout.str()[-3000:]
    again.stdout.fnmatch_lines([f"*FAILED*{spec_id}*"])


@pytest.mark.spec("OPS-3", "TEST-4")
def test_explore_finds_purging_that_cannot_keep_up(pytester: pytest.Pytester) -> None:
    """Issue 12, class 4: a purge of at most 500 records per journal and minute. A story
    with volumes bursts 600 messages at 20 a second to a bot whose retention is a
    minute: its inbox still holds records long past their retention."""
    story = _caught_and_replayed(pytester, OLD_PURGE, "OPS-3", examples=40, seed=3)
    assert "x.burst(600, 20)" in story, story


@pytest.mark.spec("OUT-7", "RETRY-1", "TEST-4")
def test_explore_finds_a_sweep_held_up_by_a_slow_replay(pytester: pytest.Pytester) -> None:
    """Issue 12, class 5: a sweep that runs each due replay itself before the due sends.
    A replayed handler that takes five minutes (``slow``) holds up a send the channel
    rate-limited: its retry comes minutes after it was due."""
    story = _caught_and_replayed(pytester, SERIAL_SWEEP, "OUT-7", examples=40, seed=3)
    assert "slow(300000)" in story and "x.fault(" in story, story


@pytest.mark.spec("INB-3", "TEST-4")
def test_explore_finds_a_sweep_pass_that_one_record_aborts(pytester: pytest.Pytester) -> None:
    """Issue 12, class 5: a sweep pass that ends at the first record whose processing
    raises. A record the journal cannot read for five minutes (``unreadable``) keeps
    another record left pending from being replayed all that time (INB-3). While it
    shrinks, the run may also meet a failed send's due retry held up (OUT-7, RETRY-1) —
    whether it does depends on how far shrinking gets in its time bound. The failure
    reported is the kind found first (INB-3 at this seed), another kind listed after it
    with a story file of its own; before, the kind replayed last was reported, and CI
    saw OUT-7 twice."""
    story = _caught_and_replayed(pytester, BRITTLE_SWEEP, "INB-3", examples=40, seed=7)
    assert "unreadable=300000" in story, story
