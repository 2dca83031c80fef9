"""``botmesh-testkit explore`` (issue 12): the explore part alone from a shell — a
headline per backend, a planted backend bug caught with its story file and the command
that replays it (which fails the same way), exit status 0/1/2, bad values refused naming
the option as typed; and ``botmesh-testkit run --explore-seconds``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from botmesh_testkit.cli import main
from botmesh_testkit.explore.machine import IDS

LOSES_INBOUND = '''
from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv

_STORES = {}


class LosesInbound(KvDurability):
    """Acknowledges the journal write of an inbound message without making it: the
    channel is told the message is safe, and it is gone."""

    async def inbox_journal(self, scope, record):
        return record, True


def make(workdir):
    return LosesInbound(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)
'''

HEADLINE = r"^ *explore on {backend}, seed {seed}: (\d+) stories, (\d+) steps in ([\d.]+) s{cut}: {outcome}$"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it (``python -m`` finds a module of the current
    directory, as the README says)."""
    return subprocess.run([sys.executable, "-m", "botmesh_testkit.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900)


def headline(out: str, backend: str, seed: int | str, outcome: str, cut: str = "") -> re.Match[str]:
    found = re.search(HEADLINE.format(backend=re.escape(backend), seed=seed, outcome=outcome, cut=re.escape(cut)),
                      out, re.M)
    assert found, out
    return found


@pytest.mark.spec(*IDS)
def test_explore_prints_a_headline_per_backend_and_exits_0(tmp_path: Path) -> None:
    run = cli("explore", "--backend", "memory", "--backend", "sqlite", "--seed", "3", "--examples", "5",
              "--seconds", "300", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("botmesh-testkit explore: backend(s) memory, sqlite; up to 5 stories per backend, none started "
                        "after 300 s; seed 3"), lines[0]
    for backend in ("memory", "sqlite"):
        stories, steps, _ = headline(run.stdout, backend, 3, "passed").groups()
        assert int(stories) >= 5 and int(steps) > int(stories)
    assert lines[-1] == "explore passed on memory, sqlite"
    assert "botmesh durability report" not in run.stdout  # pytest's own output is not the command's


def test_explore_draws_a_seed_and_prints_it(tmp_path: Path) -> None:
    run = cli("explore", "--backend", "memory", "--examples", "1", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    seed = re.search(r"; seed (\d+)$", run.stdout.splitlines()[0])
    assert seed, run.stdout
    headline(run.stdout, "memory", seed.group(1), "passed")


@pytest.mark.slow
@pytest.mark.spec("GUAR-1", "INB-1", "INB-2", "TEST-4")
def test_explore_catches_a_planted_backend_and_prints_a_story_that_replays(tmp_path: Path) -> None:
    """A third party's backend (``module:factory``) that loses what it acknowledged: the
    command fails (1) naming the ids, prints the shrunk story, the file it is in and the
    pytest command that replays it; that command fails the same way. The sound backend
    beside it passes."""
    (tmp_path / "thirdparty.py").write_text(LOSES_INBOUND, encoding="utf-8")
    run = cli("explore", "--backend", "thirdparty:make", "--backend", "memory", "--seed", "1", "--examples", "40",
              cwd=tmp_path)
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    headline(out, "thirdparty:make", 1, "FAILED")
    headline(out, "memory", 1, "passed")
    violated = re.search(r"^  violated \[([^\]]+)\] (.*)$", out, re.M)
    assert violated and "INB-1" in violated.group(1).split(", "), out
    assert "was acknowledged and ended 'missing'" in violated.group(2), out
    story = re.search(r"^  story file: (.+)$", out, re.M)
    assert story, out
    text = Path(story.group(1)).read_text(encoding="utf-8")
    assert re.search(r"x\.(receive|left_pending)\(", text) and "@scenario(" in text, text
    assert re.search(r"^    await x\.(receive|left_pending)\(", out, re.M), out  # the story, printed
    replay = re.search(r"^  replay it: (pytest .+)$", out, re.M)
    assert replay, out
    argv = shlex.split(replay.group(1))
    assert argv[0] == "pytest" and "--botmesh-backend=thirdparty:make" in argv
    again = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv[1:]], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 1, again.stdout[-3000:]
    assert "was acknowledged and ended 'missing'" in again.stdout, again.stdout[-3000:]
    assert "1 failed" in again.stdout, again.stdout[-3000:]
    assert out.splitlines()[-1] == ("explore FAILED on thirdparty:make; rerun: botmesh-testkit explore --backend "
                                    "thirdparty:make --backend memory --seed 1 --examples 40 --seconds 60")


@pytest.mark.parametrize(("argv", "message"), [
    (["explore", "--examples", "0"], "argument --examples: '0' must be >= 1"),
    (["explore", "--examples", "many"], "argument --examples: 'many' is not a whole number"),
    (["explore", "--seconds", "-1"], "argument --seconds: '-1' must be a number of seconds > 0"),
    (["explore", "--seconds", "inf"], "argument --seconds: 'inf' must be a number of seconds > 0"),
    (["explore", "--seconds", "soon"], "argument --seconds: 'soon' is not a number of seconds"),
    (["explore", "--exam", "3"], "unrecognized arguments: --exam 3"),  # no abbreviation: the error names what was typed
    (["run", "--explore-seconds", "0"], "argument --explore-seconds: '0' must be a number of seconds > 0"),
    (["run", "--explore-examples", "-1"], "argument --explore-examples: '-1' must be >= 0"),
])
def test_bad_values_are_refused_naming_the_option_as_typed(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                           message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unknown_backend_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--backend", "nosuch"]) == 2
    captured = capsys.readouterr()
    assert "--backend 'nosuch' is not a known backend" in captured.err
    assert "exploring" not in captured.out


def test_the_help_documents_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["explore", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for option in ("--backend NAME", "--seed SEED", "--examples N", "--seconds S", "--require-services"):
        assert option in out, out
    assert "Exit status 0 when every backend passed" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "explore" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--explore-seconds S" in capsys.readouterr().out


@pytest.mark.spec("TEST-4")
def test_run_passes_explore_seconds_to_the_explore_part(tmp_path: Path) -> None:
    """A budget that runs out during the first chunk of stories (the budget is checked
    between chunks of ten): the explore part starts no second chunk, and says so."""
    run = cli("run", "--backend", "memory", "--seed", "2", "--parts", "explore", "--explore-examples", "30",
              "--explore-seconds", "0.000001", cwd=tmp_path)
    out: Any = run.stdout
    assert run.returncode == 0, out + run.stderr
    stories, _, _ = headline(out, "memory", 2, "passed", cut=" (stopped by the time budget)").groups()
    assert 0 < int(stories) < 30, out


@pytest.mark.spec("TEST-4")
def test_the_command_prints_every_kind_found_with_its_story_file_and_replay() -> None:
    """What ``botmesh-testkit explore`` prints of a failed backend's record: the first
    kind's story, file and replay, then each other kind found with its own file and
    replay command (the record as ``ExploreItem`` attaches it)."""
    import io
    from types import SimpleNamespace

    from botmesh_testkit.cli import _ExploreCollector

    def kind(tag: str, ids: str) -> dict[str, Any]:
        return {"violated": f"violated {ids}broken {tag}", "story": f"/s/explore_{tag}.py",
                "story_lines": [f"await x.receive('{tag}')"], "shape": "shrunk; on_ambiguous=skip, text_limit=None",
                "replay": f"pytest --botmesh-backend=memory -k explore_{tag}"}

    record = {"summary": "explore on memory, seed 5: 3 stories, 9 steps in 0.1 s: FAILED", "notes": [],
              **kind("first", "[INB-3] "), "also": [kind("second", "[OUT-7] "), kind("third", "")]}
    out = io.StringIO()
    report = SimpleNamespace(user_properties=[("botmesh_backend", "memory"), ("botmesh_explore", record)],
                             nodeid="botmesh-explore::memory/40-stories", when="call", outcome="failed")
    _ExploreCollector(out).pytest_runtest_logreport(report)
    assert out.getvalue().splitlines()[-6:] == [
        "  also found, another kind: violated [OUT-7] broken second",
        "    its story (shrunk; on_ambiguous=skip, text_limit=None, 1 steps): /s/explore_second.py",
        "    replay it: pytest --botmesh-backend=memory -k explore_second",
        "  also found, another kind: violated broken third",
        "    its story (shrunk; on_ambiguous=skip, text_limit=None, 1 steps): /s/explore_third.py",
        "    replay it: pytest --botmesh-backend=memory -k explore_third",
    ], out.getvalue()
