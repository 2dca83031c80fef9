"""Kill loops whose channel splits texts into parts (OUT-12, OUT-13), issue 12: the
delivery ledger names the part in flight for every delivery — also the first part of a
record that a restarted bot splits only after claiming it — so the loop of the issue
(``text_limit=6``) is clean, and a part really lost is still caught; the kill command
line's ``--text-limit``, the reproduce command that carries it, and the profiles' kill
loops that run with one (``kill_text_limit``)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import shlex
from pathlib import Path
from typing import Any

import pytest

from botmesh.core.clock import RealClock
from botmesh.core.content import part_key, split_text
from botmesh.core.kv_durability import KvDurability
from botmesh.core.records import OutboxRecord
from botmesh.sqlite_store import SQLiteKv
from botmesh_testkit import kill
from botmesh_testkit.backends.base import SQLiteSpec
from botmesh_testkit.kill import Delivery, KillLoop, judge, replies
from botmesh_testkit.kill.childproc import ChildConfig, LedgerProvider, MarkedBackend, _Markers
from botmesh_testkit.kill.parent import durability_options
from botmesh_testkit.kill.spec import SCOPE, build_backend
from botmesh_testkit.matrix.profiles import ProfileError, load_profile

pytest_plugins = ["pytester"]

spec = pytest.mark.spec


def _ledger(path: Path) -> list[Delivery]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        out.append(Delivery(d["key"], d["chat"], d["text"], d["name"], d["n"], d["pid"], d["t"]))
    return out


async def _split_after_claim(tmp: Path, text: str, limit: int) -> tuple[list[Delivery], list[OutboxRecord], list[Any]]:
    """In one process, what a restarted child does with a send its predecessor journaled
    whole and died before splitting: the send is made again under its key (a replayed
    handler), the record is claimed *then* split (OUT-13), and its parts go out. The
    child's own backend wrapper and ledger channel are the ones under test."""
    built = await build_backend(SQLiteSpec(str(tmp / "bot.db")))
    ours, theirs = multiprocessing.Pipe()
    markers = _Markers(ours, None)
    sending: dict[str, tuple[str, Any]] = {}
    cfg = ChildConfig(name="bot", n=2, instance_id="i", spec=SQLiteSpec(str(tmp / "bot.db")), handler=None, setup=None,
                      durability={}, ledger_path=str(tmp / "ledger.jsonl"), log_path=str(tmp / "log"),
                      workdir=str(tmp), text_limit=limit)
    backend = MarkedBackend(built.backend, markers, sending)  # type: ignore[abstract]
    provider = LedgerProvider(cfg, markers, sending)
    from botmesh.core.bot import Bot

    options = durability_options("skip", 2000.0, 3_600_000.0, 5, 5, None)  # no second sweep pass in this test
    options.update(backend=backend, instance_id="i")
    bot = Bot(provider, built.store, options, clock=RealClock(), rng=random.Random(0))
    d = bot.durability
    assert d is not None
    first_pass = asyncio.Event()
    inner_sweep = d.sweep

    async def sweep() -> None:
        await inner_sweep()
        first_pass.set()

    d.sweep = sweep  # type: ignore[method-assign]
    await bot.start()
    try:
        await asyncio.wait_for(first_pass.wait(), 30)
        # the predecessor's state: journaled whole (pending, over the limit), never split
        whole = OutboxRecord(key="K", chat_id="c1", content={"text": text}, fingerprint="f", rule="explicit",
                             state="pending", next_at=0.0, created_at=0.0, updated_at=0.0)
        assert (await built.backend.outbox_journal(SCOPE, whole))[1]
        result = await bot.send("c1", text, idempotency_key="K")
        assert result.key == "K" and len(result.message_ids) == len(split_text(text, limit)), result
        outbox = list(await built.backend.outbox_list(SCOPE, limit=100))
    finally:
        await bot.stop()
        if built.close is not None:
            await built.close()
    seen = []
    while theirs.poll():
        seen.append(theirs.recv())
    return _ledger(tmp / "ledger.jsonl"), outbox, seen


@spec("OUT-1", "OUT-12", "OUT-13", "TEST-4")
def test_the_ledger_names_the_first_part_of_a_record_split_after_its_claim(tmp_path: Path) -> None:
    text = "msg 2/reply 1"
    ledger, outbox, seen = asyncio.run(_split_after_claim(tmp_path, text, 6))
    parts = split_text(text, 6)
    assert [d.text for d in ledger] == parts, ledger
    # every part under its own key, the first under the record's: nothing unattributed
    assert [d.key for d in ledger] == [part_key("K", i) for i in range(1, len(parts) + 1)], ledger
    sends = [m for m in seen if m[0] == "mk" and m[3] == "provider.send" and m[2] == "after"]
    assert [m[4] for m in sends] == [d.key for d in ledger]
    # the claim came before the split: the path the issue's false alarm took
    ops = [(m[3], m[4]) for m in seen if m[0] == "mk" and m[2] == "after" and m[4] == "K"]
    assert ops.index(("outbox.claim", "K")) < ops.index(("outbox.split", "K")), ops
    violations, _ = judge(policy="skip", max_attempts=5, messages={}, acked=[], inbox=[], outbox=outbox,
                          ledger=ledger, events=[], incarnations=[], text_limit=6)
    assert violations == [], violations


@spec("OUT-1", "OUT-12", "OUT-13", "OUT-14", "GUAR-4", "TEST-4")
def test_the_issue_loop_with_a_text_limit_has_no_false_violation(tmp_path: Path) -> None:
    """Issue 12's call: every reply split into three parts under ten SIGKILLs."""
    db = str(tmp_path / "bot.db")
    loop = KillLoop(("sqlite", db), replies(2), messages=10, kills=10, seed=2, text_limit=6,
                    workdir=str(tmp_path / "w"))
    result = loop.run()
    report = result.report()
    print(report)
    assert result.violations == [], report
    assert report.startswith("kill loop on sqlite, on_ambiguous=skip, text_limit=6, seed 2: passed"), report
    assert result.run is not None
    ledger = result.run.ledger()
    assert ledger and all(d.key is not None for d in ledger), [d for d in ledger if d.key is None]
    splits = [m for i in result.run.incarnations for m in i.markers if m.op == "outbox.split" and m.when == "after"]
    assert splits, "no send was split"
    assert len(result.kills) == 10


class LosesFirstParts(KvDurability):
    """A planted loss: the claim of the first part of a split send (its second part is
    journaled already) marks it sent without handing it out — the outbox says sent, the
    channel never sees it."""

    async def outbox_claim(self, scope: str, key: str, **kwargs: Any) -> Any:
        rec = await self.outbox_get(scope, key)
        if rec is not None and rec.part == 1 and rec.state in ("pending", "failed") \
                and await self.outbox_get(scope, part_key(key, 2)) is not None:
            claimed = await super().outbox_claim(scope, key, **kwargs)
            if claimed is not None:
                await self.outbox_mark_sent(scope, key, token=claimed[0].token, message_id="never-sent",
                                            now=kwargs["now"], expires_at=None)
            return None
        return await super().outbox_claim(scope, key, **kwargs)


def loses_first_parts(path: str) -> LosesFirstParts:
    return LosesFirstParts(SQLiteKv(path), own_kv=True, name="loses-first-parts")


@spec("OUT-1", "GUAR-4", "GUAR-2", "OUT-12", "TEST-4")
def test_a_part_really_lost_is_still_caught(tmp_path: Path) -> None:
    loop = KillLoop(("factory", loses_first_parts, str(tmp_path / "bot.db")), replies(1), messages=6, kills=3, seed=2,
                    text_limit=6, workdir=str(tmp_path / "w"))
    result = loop.run()
    report = result.report()
    print(report)
    assert not result.passed
    lost = [v for v in result.violations if "is recorded sent but never reached the channel" in str(v)]
    assert lost and {"OUT-1", "GUAR-4"} <= set(lost[0].ids), report
    assert all(":1'" in str(v) for v in lost), lost  # the first parts, not the parts after them
    # the run without kills delivered them: the (chat, text) count is short as well
    assert any("GUAR-2" in v.ids and "'msg '" in str(v) for v in result.violations), report
    # the reproduce line (a factory: the KillLoop call) keeps the text limit
    assert "text_limit=6" in result.reproduce and "loses_first_parts" in result.reproduce, result.reproduce


@spec("OUT-12", "OUT-13", "TEST-4")
def test_the_printed_reproduce_command_carries_the_text_limit(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    loop = KillLoop(("sqlite", str(tmp_path / "x.db")), replies(2), kills=2, messages=12, seed=4, text_limit=13)
    printed = loop.reproduce().split("  (or pytest ")[0]
    argv = shlex.split(printed)
    assert argv[:3] == ["python", "-m", "botmesh_testkit.kill"] and "--text-limit" in argv, printed
    # run it: the loop it starts has the same channel
    assert kill.main([*argv[3:], "--workdir", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert "kill loop on sqlite, on_ambiguous=skip, text_limit=13, seed 4: passed" in out, out
    assert "loop on sqlite, on_ambiguous=skip, seed 4" not in out
    # without a limit, none is printed (the command stays what it was)
    plain = KillLoop(("sqlite", str(tmp_path / "y.db")), replies(2), kills=2, messages=12, seed=4)
    assert "--text-limit" not in plain.reproduce() and "text_limit" not in plain._kw


@pytest.mark.parametrize("raw", ["0", "-3", "x", "1.5"])
def test_the_command_line_refuses_a_bad_text_limit(raw: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        kill.main(["--text-limit", raw, "--workdir", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --text-limit: a whole number of characters >= 1, got {raw!r}" in err, err
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"text_limit must be a whole number of characters >= 1.*got 0"):
        KillLoop(("sqlite", "x.db"), text_limit=0)


@spec("OUT-12", "OUT-13", "TEST-3")
def test_a_profile_kill_text_limit_runs_the_kill_loops_with_a_splitting_channel(pytester: pytest.Pytester) -> None:
    pytester.makefile(".toml", tiny='workloads = ["one-send"]\npolicies = ["resend"]\nkills = 3\nkill_messages = 12\n'
                                    'kill_text_limit = 13\n')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--botmesh-backend=sqlite", "--botmesh-parts=kills",
                                           "--botmesh-matrix=tiny.toml", "--botmesh-seed=2", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*botmesh-kills::sqlite/resend/3-kills PASSED*",
                                 "*kill loop on sqlite, on_ambiguous=resend, text_limit=13, seed 2: passed*"])
    pytester.makefile(".toml", bad="kills = 1\nkill_text_limit = -1\n")
    bad = pytester.runpytest_subprocess("--botmesh-backend=sqlite", "--botmesh-matrix=bad.toml")
    bad.stderr.fnmatch_lines(["*--botmesh-matrix: bad.toml: kill_text_limit must be an integer >= 0, got -1*"])


def test_the_shipped_profiles_kill_loops_split_some_replies_and_not_others() -> None:
    """The built-in handler replies ``msg <i>/reply <n>``: the profiles' limit must split
    some of those replies under the kills, and leave others whole."""
    for name in ("smoke", "full"):
        profile = load_profile(name)
        limit = profile.kill_text_limit
        assert profile.kills and limit >= 1, name
        texts = [f"msg {i}/reply 1" for i in range(1, profile.kill_messages + 1)]
        split = [t for t in texts if len(split_text(t, limit)) > 1]
        assert split and len(split) < len(texts), (name, limit)


def test_a_bad_kill_text_limit_in_a_profile_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text('kill_text_limit = "13"\n', encoding="utf-8")
    with pytest.raises(ProfileError, match=r"p.toml: kill_text_limit must be an integer >= 0, got '13'"):
        load_profile(str(bad))


@spec("OUT-14", "OUT-12", "OUT-13", "GUAR-2")
def test_a_record_left_unknown_before_its_split_stands_for_its_unjournaled_parts() -> None:
    """Under ``skip``, a record claimed whole and killed before its split is resolved
    ``unknown``: the parts of its text never journaled on their own are never sent, one
    ambiguity covering them all; a part journaled on its own is judged by its record,
    and a loss beyond what the ambiguity covers is still a violation."""
    from collections import Counter

    from botmesh_testkit.kill import Event, KillOracle

    text = "msg 8/reply 2"
    parts = split_text(text, 6)  # 'msg ', '8/repl', 'y 2'
    amb = Event(3, "durability:ambiguous", {"key": "m8:2", "chat_id": "c2"}, 1.0)
    whole = OutboxRecord(key="m8:2", chat_id="c2", content={"text": text}, state="unknown")
    oracle = KillOracle(Counter({("c2", p): 1 for p in parts}), {"m8": "done"}, 10.0, 5.0)

    def run(outbox: list[OutboxRecord], ledger: list[Delivery], limit: int | None) -> list[Any]:
        violations, _ = judge(policy="skip", max_attempts=5, messages={}, acked=[], inbox=[], outbox=outbox,
                              ledger=ledger, events=[amb], incarnations=[], oracle=oracle, text_limit=limit)
        return violations

    assert run([whole], [], 6) == []
    # without the channel's limit the judge cannot tell: each part is a loss
    assert {str(v).split(")")[0] for v in run([whole], [], None)} >= {"[GUAR-2, OUT-1] ('c2', '8/repl'"}
    # part 2 journaled on its own and delivered: only parts 1 and 3 are the ambiguity's
    second = OutboxRecord(key=part_key("m8:2", 2), chat_id="c2", content={"text": parts[1]}, state="sent", part=2,
                          previous_part="m8:2")
    got = [Delivery(second.key, "c2", parts[1], "bot", 3, 1, 1.0)]
    assert run([whole, second], got, 6) == []
    # ... and when it was not delivered, that is a loss no ambiguity covers
    lost = run([whole, second], [], 6)
    assert any("is recorded sent but never reached the channel" in str(v) for v in lost), lost
    assert any("('c2', '8/repl') delivered 0x, expected 1 (0 ambiguous)" in str(v) for v in lost), lost
