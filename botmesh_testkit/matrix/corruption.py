"""The corruption loop: damaged files between two incarnations (issue 13, BACK-5).

For a backend whose storage is files in its workdir (``file``, ``file+log``, ``sqlite``,
a factory that takes the workdir): a short journal workload is written through the
backend's own API in two incarnations (the first one ended by the harness's ``reopen()``:
a simulated death for the file backends, a close for SQLite, whose data then sits in its
database file while the second incarnation's is in its write-ahead log), and after
every acknowledged write the journals it answers and the bytes of its files are kept.
The files as they stand after the last write (the backend still open, as a crash leaves
them; SQLite's ``-shm`` left out: the first connection rebuilds it from the ``-wal``)
are the **image**. Then, ``variants`` times, a copy of the image gets one seeded
:class:`~botmesh_testkit.crash.damage.Damage` (truncation, bit flip, zeroed 512-byte
sector or 4 KiB page, swapped blocks; any file of the image, the ``-wal`` included) and
a new incarnation is opened on it. Each variant is then:

* **refused** — opening or reading raised the project's own error
  (:class:`botmesh.core.errors.BotmeshError`: ``JournalCorruptError`` ...);
* **intact** — it answers exactly the journals acknowledged last;
* **torn** — it answers exactly an earlier acknowledged state that a torn write could
  leave, and the damage is of the kind a torn write looks like: the file is appended to
  (the state's bytes of it are a prefix of the image's, or it was restarted by the write
  the cut falls in) and either it was **truncated**
  (no format tells a file cut at a record boundary from a shorter journal: the longest
  acknowledged prefix that survives is the state expected), or the damage lies entirely
  in the bytes of the **last** write to that file (a damaged final record looks like a
  write torn by a power cut, which a backend must trim to open after one: the state
  before that write is expected). Counted, not failed;
* **altered** — anything else it answers: an acknowledged record missing or changed, a
  record never written. Fails BACK-5;
* **foreign** — it raised something not of the project's error tree (a ``KeyError``,
  ``sqlite3.DatabaseError``, ``UnicodeDecodeError`` ...): a damaged journal must be
  refused with an error naming the file. Fails BACK-5;
* **unnamed** — refused with the project's error, whose message names none of the
  backend's files (BACK-5: "rejected at open with an error naming the file"). Fails it.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

from botmesh.core.backend import DurabilityBackend
from botmesh.core.errors import BotmeshError
from botmesh.core.records import InboxRecord, OutboxRecord

from ..backends.base import BackendHarness
from ..backends.registry import resolve
from ..checker.journal import Journal, read_journal
from ..crash.damage import KINDS, Damage, draw

SCOPE = "corruption"
"""The journals' scope."""

MESSAGES = 6
"""Inbound messages of the workload (each: journaled, its reply journaled and marked
sent, the inbound completed: four writes), half in each incarnation."""

FILLER = "".join(chr(0x61 + (7 * n) % 26) for n in range(1500))
"""Part of each inbound record's content: records of about 1.6 KB spread the
journals over several pages of an SQLite file (the first incarnation's in the database
file, the second's in its write-ahead log), so damage reaches both."""

SKIPPED_SUFFIXES = ("-shm",)
"""Files of the image left out: SQLite's shared-memory index, rebuilt from the ``-wal``
by the first connection (a crash leaves a stale one, which SQLite ignores likewise)."""

UNDAMAGED_SUFFIXES = (".lock",)
"""Files copied but never damaged: lock files (a process id, not journal data; a damaged
one names another process, which says nothing of the journal's integrity)."""

IDS = ("BACK-5",)
"""What an altered or foreign variant breaks: a journal that cannot be read back is
rejected at open with an error naming the file, never applied in part."""

OUTCOMES = ("refused", "intact", "torn", "altered", "foreign", "unnamed")


@dataclass(frozen=True)
class State:
    """What the backend acknowledged after one write: its journals and its files."""

    journal: Journal
    files: dict[str, bytes]


@dataclass
class Variant:
    """One damaged copy of the image and how the backend handled it."""

    n: int
    damage: Damage
    outcome: str = ""
    detail: str = ""


@dataclass
class CorruptionRun:
    """The loop's result (see the module docstring)."""

    backend: str
    files: dict[str, int]
    """The image's files and their sizes."""
    records: int
    writes: int
    variants: list[Variant] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> Counter[str]:
        return Counter(v.outcome for v in self.variants)

    @property
    def failed(self) -> list[Variant]:
        return [v for v in self.variants if v.outcome in ("altered", "foreign", "unnamed")]

    @property
    def passed(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """The verdict line: how many variants, how each was handled."""
        c = self.counts
        unnamed = f", {c['unnamed']} refused without naming the file" if c["unnamed"] else ""
        return (f"corruption: {len(self.variants)} damaged variants of {self.backend}'s files: {c['refused']} refused, "
                f"{c['intact']} intact, {c['torn']} torn tail, {c['altered']} altered, {c['foreign']} foreign error"
                f"{unnamed} ({self.seconds:.1f} s)")

    def report(self) -> str:
        kinds = Counter(v.damage.kind for v in self.variants)
        lines = [f"corruption loop on {self.backend}: {'passed' if self.passed else 'FAILED'}",
                 f"  {self.summary()}",
                 f"  image: {self.records} acknowledged records after {self.writes} writes in "
                 + ", ".join(f"{name} ({size} bytes)" for name, size in sorted(self.files.items())),
                 "  damage: " + ", ".join(f"{k} {kinds[k]}" for k in KINDS if kinds[k])]
        for v in self.failed[:8]:
            lines.append(f"  variant #{v.n} ({v.damage.describe()}): {v.outcome.upper()} — violated "
                         f"[{', '.join(IDS)}] {v.detail}")
        if len(self.failed) > 8:
            lines.append(f"  ... and {len(self.failed) - 8} more")
        return "\n".join(lines)


def _image(workdir: str) -> dict[str, bytes]:
    """The backend's files under ``workdir`` (relative path -> bytes)."""
    files: dict[str, bytes] = {}
    for root, _, names in os.walk(workdir):
        for name in names:
            if name.endswith(SKIPPED_SUFFIXES):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, workdir)] = f.read()
    return files


async def _workload(harness: BackendHarness) -> list[State]:
    """Write the journals (two incarnations) and keep each acknowledged state."""
    states: list[State] = []
    backend, _ = await harness.open()
    await backend.start()
    states.append(State(await read_journal(backend, SCOPE), _image(harness.workdir)))
    now = 1_000.0
    for i in range(MESSAGES):
        if i == MESSAGES // 2:  # the first incarnation dies; the second one opens what it left
            backend, _ = await harness.reopen()
            await backend.start()
        now += 10.0
        for step in _writes(backend, i, now):
            await step
            states.append(State(await read_journal(backend, SCOPE), _image(harness.workdir)))
    return states


def _writes(backend: DurabilityBackend, i: int, now: float) -> Iterator[Awaitable[Any]]:
    """The four writes of message ``i``, in order (each awaited before the next is made)."""
    mid, key = f"m{i}", f"reply-{i}"
    yield backend.inbox_journal(SCOPE, InboxRecord(
        id=mid, chat_id=f"c{i % 2}", event={"text": f"hello {i}", "n": i, "note": FILLER}, state="leased",
        attempts=1, token=1, owner="bot", incarnation="i1", lease_until=now + 30.0, claimed_at=now, created_at=now,
        updated_at=now))
    yield backend.outbox_journal(SCOPE, OutboxRecord(
        key=key, chat_id=f"c{i % 2}", content={"text": f"hello {i}/reply"}, fingerprint=f"fp{i}", inbound_id=mid,
        state="sending", attempts=1, token=1, owner="bot", incarnation="i1", lease_until=now + 30.0,
        claimed_at=now, created_at=now, updated_at=now))
    yield backend.outbox_mark_sent(SCOPE, key, token=1, message_id=f"x{i}", now=now + 1.0, expires_at=None)
    yield backend.inbox_complete(SCOPE, mid, token=1, now=now + 2.0, expires_at=None)


def expected_torn(states: list[State], damage: Damage) -> Journal | None:
    """The earlier acknowledged state a torn write could leave for ``damage`` (see the
    module docstring), or None when only the last state is acceptable.

    The file's current run of appends starts at the last write that did not append to it
    (``start``: a log restarted, a snapshot rewritten); from there on each state's bytes
    of the file are a prefix of the image's. A truncation to ``n`` bytes may leave the
    latest of those states no longer than ``n`` — or, cut inside the run's first write,
    the state before it (when later writes appended to it: a log, not a snapshot
    rewritten at every write). Other damage may leave the state before the last write
    to the file when it lies wholly in that write's bytes, appended."""
    data = [s.files.get(damage.file, b"") for s in states]
    start = max((n for n in range(1, len(data)) if not data[n].startswith(data[n - 1])), default=0)
    last = max((n for n in range(1, len(data)) if data[n] != data[n - 1]), default=0)
    if damage.kind == "truncate":
        fits = [n for n in range(start, len(data)) if len(data[n]) <= damage.start]
        if fits:
            return states[fits[-1]].journal
        return states[start - 1].journal if 0 < start < last else None
    if last > start and damage.first_byte >= len(data[last - 1]):
        return states[last - 1].journal
    return None


def _diff(expected: Journal, got: Journal) -> str:
    problems: list[str] = []
    for name, before, after in (("inbound", expected.inbox, got.inbox), ("send", expected.outbox, got.outbox)):
        for key in sorted(before):
            if key not in after:
                problems.append(f"{name} {key!r} missing")
            elif after[key] != before[key]:
                fields = sorted(f for f in set(before[key]) | set(after[key]) if before[key].get(f) != after[key].get(f))
                problems.append(f"{name} {key!r} changed: " + ", ".join(
                    f"{f} {before[key].get(f)!r} -> {after[key].get(f)!r}" for f in fields[:3]))
        problems += [f"{name} {key!r} never written" for key in sorted(set(after) - set(before))]
    return f"opened without an error: {len(problems)} record(s) not as acknowledged: " + "; ".join(problems[:4]) + (
        f"; and {len(problems) - 4} more" if len(problems) > 4 else "")


def _names_a_file(exc: BaseException, workdir: str, files: dict[str, bytes]) -> bool:
    """Whether the error's message (or its ``file`` detail) names the storage: a path
    under ``workdir`` or a file's name."""
    text = f"{exc} {getattr(exc, 'details', {}).get('file', '')}"
    return workdir in text or any(os.path.basename(name) in text for name in files)


async def _judge(backend: str, states: list[State], variant: Variant, workdir: str) -> None:
    """Open a new incarnation on ``workdir`` (the damaged copy) and classify it."""
    harness = resolve(backend)(workdir)
    try:
        opened, _ = await harness.open()
        await opened.start()
        got = await read_journal(opened, SCOPE)
    except BotmeshError as exc:
        variant.outcome, variant.detail = "refused", f"{type(exc).__name__}: {exc}"
        if not _names_a_file(exc, workdir, states[-1].files):
            variant.outcome = "unnamed"
            variant.detail = f"refused with {variant.detail} — the error names none of the backend's files"
        return
    except Exception as exc:
        variant.outcome = "foreign"
        variant.detail = (f"refused with {type(exc).__name__}: {exc} — not the project's error type "
                          "(botmesh.core.errors: JournalCorruptError naming the file)")
        return
    finally:
        try:
            await harness.close()
        except Exception:  # what is left of a failed open: nothing more to learn from it
            pass
    if got == states[-1].journal:
        variant.outcome = "intact"
        return
    torn = expected_torn(states, variant.damage)
    if torn is not None and got == torn:
        variant.outcome = "torn"
        return
    variant.outcome = "altered"
    variant.detail = _diff(states[-1].journal, got) + (
        "" if torn is None else " (nor as the earlier acknowledged state a torn final write would leave)")


async def corruption_loop(backend: str, *, variants: int, seed: int, workdir: str) -> CorruptionRun | str:
    """Damage ``variants`` copies of ``backend``'s files and judge each reopening (see the
    module docstring). Returns the run, or why it does not apply (no files in the
    workdir)."""
    started = time.monotonic()
    base = os.path.join(workdir, "image")
    os.makedirs(base)
    harness = resolve(backend)(base)
    try:
        states = await _workload(harness)
    finally:
        await harness.close()
    image = states[-1].files
    targets = sorted(name for name, data in image.items() if data and not name.endswith(UNDAMAGED_SUFFIXES))
    if not targets:
        return f"backend {backend}: its storage wrote no file in the workdir (a server backend: not applicable)"
    run = CorruptionRun(backend, {name: len(data) for name, data in image.items()}, states[-1].journal.records,
                        len(states) - 1)
    rng = random.Random(f"{seed}/{backend}/corruption")
    n = 0
    while len(run.variants) < variants and n < variants * 4:
        kind = KINDS[n % len(KINDS)]
        name = rng.choice(targets)
        n += 1
        damage = draw(rng, name, image[name], kind)
        if damage is None:
            continue
        variant = Variant(len(run.variants) + 1, damage)
        copy = tempfile.mkdtemp(prefix="variant-", dir=workdir)
        try:
            for rel, data in image.items():
                path = os.path.join(copy, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(damage.apply(data) if rel == name else data)
            await _judge(backend, states, variant, copy)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        run.variants.append(variant)
    run.seconds = time.monotonic() - started
    return run
