"""``SharedFileEventJournal`` between real processes (issue 15; EVENTS-4, REPL-1, REPL-4).

The cross-process mutex is an exclusive ``flock(2)`` on ``<file>.mutex`` (the docstring of
:mod:`botmesh.events.journal`): the kernel releases it the moment its holder dies, and
nothing ever breaks it while the holder lives. So:

* 4 processes claiming concurrently get every record once; fencing tokens grow across
  processes (no two claims ever share a token);
* a holder SIGKILLed: the mutex is free at once (an operation waiting for it completes,
  although ``stale_lock_ms`` is far longer than the test);
* a holder SIGSTOPped: the others wait and never take the mutex; past ``stale_lock_ms``
  their operation fails with ``BackendUnavailableError`` naming the holder's pid, which
  is still alive (never killed); once it resumes and lets go, they proceed;
* three processes racing for a mutex freed by a killed holder never hold it together:
  every compare-and-set increment they acknowledged is counted (the original library's
  stale-lock breaking could lose one here).

Children are plain ``python -c`` processes driven over pipes: each prints ``ready`` and
waits for a line before it starts, so all start together."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from botmesh.core.errors import BackendUnavailableError
from botmesh.events import EventJournalKv, SharedFileEventJournal

spec = pytest.mark.spec
T0 = 1_000_000.0

CHILD = r"""
import asyncio, json, os, sys
from botmesh.core.errors import VersionConflict
from botmesh.events import EventJournalKv, SharedFileEventJournal

async def main():
    mode, path = sys.argv[1], sys.argv[2]
    log = sys.argv[3] == "log"
    if mode == "incr":
        kv = EventJournalKv.on_file(path, shared=True, append_log=log)
        await kv.open()
    else:
        j = await SharedFileEventJournal.open(path, append_log=log, stale_lock_ms=600_000)
    print("ready", flush=True)
    sys.stdin.readline()
    out = []
    if mode == "hold":
        await j._acquire()           # hold the journal's own mutex, as a writer does
        print("holding", flush=True)
        sys.stdin.readline()
        j._release()
        print("released", flush=True)
        sys.stdin.readline()
    elif mode == "claim":
        while True:
            rec = await j.claim(f"p{os.getpid()}", 60_000, now=1_000_000.0)
            if rec is None:
                break
            assert await j.complete(rec.id, rec.lease.token, now=1_000_001.0)
            out.append([rec.id, rec.lease.token])
    elif mode == "rounds":
        for r in range(int(sys.argv[4])):
            now = 1_000_000.0 + 10.0 * r
            rec = await j.claim(f"p{os.getpid()}", 5.0, now=now)
            if rec is not None:
                out.append([now, rec.lease.token])
    elif mode == "incr":
        wins = 0
        for _ in range(int(sys.argv[4])):
            while True:
                got = await kv.get("s", "outbox", "counter")
                try:
                    await kv.put("s", "outbox", "counter", {"n": got.value["n"] + 1}, expected_version=got.version)
                    wins += 1
                    break
                except VersionConflict:
                    continue
        out = [wins]
    print(json.dumps(out), flush=True)

asyncio.run(main())
"""


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


class Child:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=child_env(), text=True)
        try:
            assert self.readline() == "ready"
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"child {self.pid} exited ({self.proc.wait()}) before answering")
        return line.strip()

    def send(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def result(self) -> Any:
        out = json.loads(self.readline())
        assert self.proc.wait(timeout=60) == 0
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def children() -> Any:
    made: list[Child] = []

    def start(*args: str) -> Child:
        c = Child(*args)
        made.append(c)
        return c

    yield start
    for c in made:
        if c.proc.poll() is None:
            os.kill(c.pid, signal.SIGCONT)
        c.kill()


@spec("EVENTS-4", "REPL-1", "REPL-4")
@pytest.mark.parametrize("log", ["snap", "log"])
async def test_four_processes_claim_every_record_exactly_once(tmp_path: Path, log: str, children: Any) -> None:
    path = str(tmp_path / "j")
    j = await SharedFileEventJournal.open(path, append_log=log == "log")
    ids = [(await j.append("job", {"i": i}, id=f"r{i:02d}", now=T0)).id for i in range(40)]
    procs = [children("claim", path, log) for _ in range(4)]
    for p in procs:
        p.send()
    claimed = [(rid, token, p.pid) for p in procs for rid, token in p.result()]
    counts = Counter(rid for rid, _, _ in claimed)
    assert sorted(counts) == ids and set(counts.values()) == {1}, counts  # each exactly once
    assert {token for _, token, _ in claimed} == {1}
    assert {r.state for r in await j.list()} == {"done"}
    print(f"claims per process: {Counter(pid for _, _, pid in claimed)}")
    await j.close()


@spec("EVENTS-4", "LEASE-2", "REPL-1")
async def test_fencing_tokens_grow_across_processes(tmp_path: Path, children: Any) -> None:
    """4 processes claim one record in 30 rounds, the lease of each round expiring before
    the next: each round's claim has exactly one possible winner, and the tokens of all
    wins, in round order, are 1, 2, 3 ... without a gap or a repeat."""
    path = str(tmp_path / "j")
    j = await SharedFileEventJournal.open(path)
    await j.append("job", id="one", now=T0 - 1)
    procs = [children("rounds", path, "snap", "30") for _ in range(4)]
    for p in procs:
        p.send()
    wins = sorted((now, token) for p in procs for now, token in p.result())
    nows = [now for now, _ in wins]
    assert len(set(nows)) == len(nows), f"two processes won the same round: {wins}"
    assert [token for _, token in wins] == list(range(1, len(wins) + 1)), wins
    final = await j.get("one")
    assert final is not None and final.token == len(wins) and final.attempts == len(wins)
    await j.close()


@spec("EVENTS-4")
async def test_a_killed_holder_releases_the_mutex_at_once(tmp_path: Path, children: Any) -> None:
    path = str(tmp_path / "j")
    j = await SharedFileEventJournal.open(path, stale_lock_ms=600_000)
    holder = children("hold", path, "snap")
    holder.send()
    assert holder.readline() == "holding"
    waiting = asyncio.ensure_future(j.append("t", 1))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # it waits for the live holder
    os.kill(holder.pid, signal.SIGKILL)
    holder.proc.wait()
    rec = await asyncio.wait_for(waiting, 60)  # far below stale_lock_ms: freed by the kernel
    assert (await j.get(rec.id)) is not None
    await j.close()


@spec("EVENTS-4")
async def test_a_stopped_holder_is_waited_for_and_never_broken(tmp_path: Path, children: Any) -> None:
    path = str(tmp_path / "j")
    j = await SharedFileEventJournal.open(path, stale_lock_ms=300)
    await j.append("t", 0, id="before")
    holder = children("hold", path, "snap")
    holder.send()
    assert holder.readline() == "holding"
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailableError) as caught:
            await j.append("t", 1, id="during")
        assert f"held by live process {holder.pid}" in str(caught.value)
        assert psutil.Process(holder.pid).status() == psutil.STATUS_STOPPED  # alive, not killed
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    holder.send()  # let go
    assert holder.readline() == "released"
    await j.append("t", 2, id="after")
    assert sorted(r.id for r in await j.list()) == ["after", "before"]  # "during" was never written
    holder.send()
    holder.result()
    await j.close()


@spec("EVENTS-4", "REPL-1", "BACK-7")
@pytest.mark.parametrize("log", ["snap", "log"])
async def test_three_processes_racing_for_a_dead_holders_mutex_lose_no_write(tmp_path: Path, log: str,
                                                                           children: Any) -> None:
    """The race the original library admits (several processes breaking one stale mutex
    can hold it together for an instant and lose a write): a holder dies while three
    processes wait for the mutex; they then race for it, each making 25 compare-and-set
    increments of one counter. Every acknowledged increment is in the final count: they
    never held it together (a kernel lock has one holder)."""
    path = str(tmp_path / "j")
    kv = EventJournalKv.on_file(path, shared=True, append_log=log == "log")
    await kv.open()
    await kv.put("s", "outbox", "counter", {"n": 0}, expected_version=0)
    racers = [children("incr", path, log, "25") for _ in range(3)]  # opened, waiting for "go"
    holder = children("hold", path, log)
    holder.send()
    assert holder.readline() == "holding"
    for r in racers:
        r.send()
    await asyncio.sleep(0.3)  # all three are waiting on the held mutex
    os.kill(holder.pid, signal.SIGKILL)
    wins = sum(r.result()[0] for r in racers)
    final = await kv.get("s", "outbox", "counter")
    assert wins == 75
    assert final is not None and final.value == {"n": 75} and final.version == 76
    await kv.close()
