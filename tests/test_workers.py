"""The worker-process harness (:mod:`botmesh_testkit.kill.workers`): real processes,
started together, seeded, each one's result or error back in the parent, bounded, and
none left behind; a third party's ``module:factory`` and a pickled kv factory are built
in each worker. The workloads are module-level functions: each worker imports this
module (by reference, as dill pickles them)."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from botmesh.sqlite_store import SQLiteKv

from botmesh_testkit.backends.base import FactorySpec, SQLiteSpec
from botmesh_testkit.kill import HarnessError
from botmesh_testkit.kill.workers import Worker, run_workers


async def rendezvous(w: Worker) -> dict[str, Any]:
    """Phase 1: append this worker's line to a shared file; barrier; phase 2: read it."""
    path = w.params["file"]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{w.index}\n")
    await w.barrier()
    with open(path, encoding="utf-8") as f:
        seen = sorted(int(line) for line in f.read().split())
    return {"index": w.index, "pid": os.getpid(), "seen": seen, "draws": [w.rng.random() for _ in range(3)],
            "params": w.params["tag"], "processes": w.processes}


async def fail_one(w: Worker) -> int:
    """Worker 1 raises; the others wait at a barrier that it never reaches."""
    if w.index == 1:
        raise ValueError("planted failure in worker 1")
    await w.barrier()
    return w.index


async def die_one(w: Worker) -> int:
    """Worker 0 is SIGKILLed; the others wait at a barrier."""
    if w.index == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    await w.barrier()
    return w.index


async def hang_one(w: Worker) -> int:
    """Worker 0 never ends."""
    if w.index == 0:
        threading.Event().wait()
    return w.index


async def kv_round_trip(w: Worker) -> list[Any]:
    """Each worker writes its own key through the kv it built, then reads every key."""
    assert w.kv is not None
    scope = w.params["scope"]
    await w.kv.put(scope, "inbox", f"from-{w.index}", {"pid": os.getpid()}, expected_version=0)
    await w.barrier()
    return [(key, found.value["pid"]) for key, found in await w.kv.scan(scope, "inbox", after=None, limit=100)]


async def backend_kind(w: Worker) -> list[str]:
    """The types a worker built from its spec."""
    assert w.backend is not None
    return [type(w.backend).__name__, type(w.kv).__name__]


def _children_gone(run_pids: list[int | None]) -> None:
    alive = [pid for pid in run_pids if pid is not None and psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"worker processes left behind: {alive}"


@pytest.mark.spec("REPL-4")
def test_workers_are_real_processes_started_together_and_seeded(tmp_path: Path) -> None:
    """Four distinct processes (none of them this one); each sees every other's phase-1
    line after the barrier; each has its own seeded rng, the same across runs with one
    seed and different with another; results come back in worker order."""
    spec = SQLiteSpec(str(tmp_path / "w.db"))

    def once(seed: int, name: str) -> list[dict[str, Any]]:
        run = run_workers(spec, rendezvous, processes=4, seed=seed, params={"file": str(tmp_path / name), "tag": "x"},
                          timeout=60)
        assert run.failures == [], run.describe_failures()
        _children_gone([o.pid for o in run.outcomes])
        return list(run.values)

    first = once(7, "a.txt")
    assert [v["index"] for v in first] == [0, 1, 2, 3]
    assert len({v["pid"] for v in first}) == 4 and os.getpid() not in {v["pid"] for v in first}
    assert all(v["seen"] == [0, 1, 2, 3] for v in first), first
    assert all(v["params"] == "x" and v["processes"] == 4 for v in first)
    again = once(7, "b.txt")
    assert [v["draws"] for v in again] == [v["draws"] for v in first]
    assert len({tuple(v["draws"]) for v in first}) == 4  # each worker its own stream
    other = once(8, "c.txt")
    assert [v["draws"] for v in other] != [v["draws"] for v in first]


@pytest.mark.spec("REPL-4")
def test_a_failing_worker_is_reported_and_the_others_are_released(tmp_path: Path) -> None:
    """A workload's exception comes back as the stage, type, message and traceback; the
    others, waiting at a barrier it never reaches, are released at once (their barrier
    breaks) rather than at the timeout."""
    run = run_workers(SQLiteSpec(str(tmp_path / "w.db")), fail_one, processes=3, timeout=60)
    by = {o.index: o for o in run.outcomes}
    assert by[1].error == "workload: ValueError: planted failure in worker 1"
    assert by[1].traceback is not None and "planted failure" in by[1].traceback and "fail_one" in by[1].traceback
    for i in (0, 2):
        assert by[i].error is not None and "BrokenBarrierError" in by[i].error, by[i]
    assert not any(o.timed_out for o in run.outcomes)
    assert run.first_error().startswith("worker 0: workload: BrokenBarrierError")
    assert "planted failure in worker 1" in run.describe_failures()
    _children_gone([o.pid for o in run.outcomes])


@pytest.mark.spec("REPL-4")
def test_a_worker_that_dies_is_reported(tmp_path: Path) -> None:
    """A worker killed by a signal ends without a result: reported so, with its exit
    code, and the barrier it left broken for the others."""
    run = run_workers(SQLiteSpec(str(tmp_path / "w.db")), die_one, processes=3, timeout=60)
    dead = run.outcomes[0]
    assert dead.error is not None and "without a result" in dead.error and dead.exitcode == -signal.SIGKILL, dead
    assert all(o.error is not None and "BrokenBarrierError" in o.error for o in run.outcomes[1:]), run.outcomes
    _children_gone([o.pid for o in run.outcomes])


@pytest.mark.spec("REPL-4")
def test_a_hanging_worker_is_killed_at_the_timeout(tmp_path: Path) -> None:
    """A worker that never ends is SIGKILLed after ``timeout`` and reported as timed out;
    the others' results are kept; no process is left."""
    run = run_workers(SQLiteSpec(str(tmp_path / "w.db")), hang_one, processes=2, timeout=3)
    hung, fine = run.outcomes
    assert hung.timed_out and hung.error == "did not finish within 3 s (killed)" and hung.exitcode == -signal.SIGKILL
    assert fine.ok and fine.value == 1
    _children_gone([o.pid for o in run.outcomes])


def test_an_unpicklable_workload_is_a_harness_error(tmp_path: Path) -> None:
    numbers = (i for i in range(3))  # a generator: dill cannot pickle it

    async def uses_a_generator(w: Worker) -> int:
        return next(numbers)

    with pytest.raises(HarnessError, match="must be picklable with dill"):
        run_workers(SQLiteSpec(str(tmp_path / "w.db")), uses_a_generator, processes=2)
    with pytest.raises(ValueError, match="processes must be at least 1"):
        run_workers(SQLiteSpec(str(tmp_path / "w.db")), rendezvous, processes=0)


@pytest.mark.spec("REPL-4")
def test_a_pickled_kv_factory_gives_each_worker_its_own_kv_on_one_storage(tmp_path: Path) -> None:
    """A zero-argument callable (the kv suite's ``kv_factory``) is called in each worker,
    which opens the kv; all four write to one SQLite file and each reads all four."""
    path = str(tmp_path / "kv.db")
    run = run_workers(lambda: SQLiteKv(path), kv_round_trip, processes=4, params={"scope": "s"}, timeout=60)
    assert run.failures == [], run.describe_failures()
    pids = [o.pid for o in run.outcomes]
    expected = sorted((f"from-{i}", pids[i]) for i in range(4))
    assert all(sorted(tuple(x) for x in v) == expected for v in run.values), (run.values, expected)


@pytest.mark.spec("REPL-4")
def test_a_third_party_module_factory_is_built_in_each_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``FactorySpec("module:factory", (workdir,))`` whose module is importable only
    through this process's ``sys.path`` (a test directory, as pytest inserts it) is
    built in each worker: the parent's ``sys.path`` goes with it."""
    pkg = tmp_path / "elsewhere"
    pkg.mkdir()
    (pkg / "my_backend_for_workers.py").write_text(textwrap.dedent("""\
        import os

        from botmesh.core.kv_durability import KvDurability
        from botmesh.sqlite_store import SQLiteKv


        class MyDurability(KvDurability):
            pass


        def make(workdir):
            return MyDurability(SQLiteKv(os.path.join(workdir, "mine.db")))
        """), encoding="utf-8")
    monkeypatch.syspath_prepend(str(pkg))
    run = run_workers(FactorySpec("my_backend_for_workers:make", (str(tmp_path),)), backend_kind, processes=2,
                      timeout=60)
    assert run.failures == [], run.describe_failures()
    assert run.values == [["MyDurability", "SQLiteKv"]] * 2
