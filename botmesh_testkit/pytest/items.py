"""The plugin's own test items: a crash-matrix cell, a failed dry run standing for a
workload's cells, a kill loop, a backend whose server could not be provisioned; and the
functions that build the items of each part."""

from __future__ import annotations

import asyncio
import os
import shlex
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest

from .options import cell_budget, matrix_name, rerun_base

if TYPE_CHECKING:
    from ..matrix.cells import Cell, Oracle, Outcome
    from ..matrix.shared import SharedPrefixes


class CellFailed(Exception):
    """A crash cell broke a guarantee; the message is the cell's report."""


class ReportingItem(pytest.Item):
    """An item of the plugin whose failure is its own report (:class:`CellFailed`: the
    violated ids, what happened, the command that reproduces it) rather than a
    traceback; anything else is shown as pytest shows it."""

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))


class MatrixCellItem(ReportingItem):
    """One crash-matrix cell as a test item. What the report's grid shows of it is
    :meth:`cell_record`, attached to its test report by the plugin."""

    def __init__(self, *, cell: Cell, oracle: Oracle, seed: int, power_cuts: bool = False, seq: int = 0,
                 group: list[Cell] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.group = group if group is not None else [cell]
        """The cells of its backend, workload and policy (those that can share its prefix,
        ``--botmesh-shared-prefix``)."""
        self.oracle = oracle
        self.seed = seed
        self.outcome: Outcome | None = None
        from ..crash.points import spec_ids
        from ..matrix.workloads import WORKLOADS

        ids = set(WORKLOADS[cell.workload].spec_ids) | set(spec_ids(cell.point))
        if power_cuts:  # its crash states are recovered too (matrix.powercut_states)
            ids.add("BACK-6")
        self.add_marker(pytest.mark.spec(*sorted(ids)))
        self.seq = seq
        self.user_properties.append(("botmesh_backend", cell.backend))

    def cell_record(self) -> dict[str, Any]:
        """The cell for the report: its coordinates (``seq``: its place among its
        backend's cells, so the grid keeps the dry run's order under xdist too) and,
        once it ran, what running it gave (:func:`cell_run_record`)."""
        cell = self.cell
        record: dict[str, Any] = {"id": cell.id, "workload": cell.workload, "policy": cell.policy,
                                  "at": f"{cell.when}:{cell.point}#{cell.nth}", "seq": self.seq}
        if self.outcome is not None:
            record.update(cell_run_record(self.outcome))
        return record

    def runtest(self) -> None:
        from ..matrix.run import run_cell

        from ..matrix.coverage_file import active
        from ..matrix.scratch import scratch_dir

        budget = cell_budget(self.config)
        measure = bool(self.config.getoption("--botmesh-recovery-coverage")) or active() is not None
        with scratch_dir("botmesh-cell-") as tmp:
            try:
                if self.config.getoption("--botmesh-shared-prefix"):
                    self.outcome = shared_prefixes(self.config).outcome(self.cell, self.seed, self.oracle, self.group,
                                                                        budget, measure_recovery=measure)
                else:
                    self.outcome = asyncio.run(asyncio.wait_for(
                        run_cell(self.cell, self.seed, self.oracle, tmp, measure_recovery=measure), budget))
            except TimeoutError:
                raise CellFailed(
                    f"cell {self.cell.id}: did not finish within its real-time budget of {budget:g} s "
                    "(--botmesh-cell-timeout). A backend that acknowledges updates without storing them, or "
                    "never settles a record, keeps the recovery loop busy until the budget runs out.\n"
                    f"  reproduce: {self.cell.command(self.seed)}") from None
        if self.outcome.recovery_lines is not None or self.outcome.recovery_note is not None:
            from ..matrix.coverage import record_of

            self.user_properties.append(("botmesh_recovery", record_of(self.outcome)))
        if self.outcome.power_cut_states is not None:
            self.user_properties.append(("botmesh_powercut_states",
                                         (self.outcome.power_cut_states, self.outcome.power_cut_failed)))
        self.ihook.pytest_botmesh_cell_finished(cell=self.cell, outcome=self.outcome)
        if not self.outcome.passed:
            raise CellFailed(self.outcome.report(self.seed))

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-matrix", 0, f"crash cell {self.cell.id}"


_SHARED_PREFIXES = pytest.StashKey["SharedPrefixes"]()


def shared_prefixes(config: pytest.Config) -> SharedPrefixes:
    """The session's :class:`~botmesh_testkit.matrix.shared.SharedPrefixes` (made on first
    use; its paused copies ended when the session ends)."""
    found = config.stash.get(_SHARED_PREFIXES, None)
    if found is None:
        from ..matrix.shared import SharedPrefixes

        found = config.stash[_SHARED_PREFIXES] = SharedPrefixes()
        config.add_cleanup(found.close)
    return found


def cell_run_record(outcome: Outcome) -> dict[str, Any]:
    """What running a cell gave, for the report's grid, kept small: the history as
    :func:`~botmesh_testkit.matrix.cells.compress` writes it, empty lists left out."""
    from ..matrix.cells import compress

    record: dict[str, Any] = {"crash": outcome.crash_point, "history": compress(outcome.history),
                              "deliveries": [list(d) for d in outcome.deliveries],
                              "seconds": round(outcome.seconds, 3)}
    if outcome.violations:
        record["violations"] = [str(v) for v in outcome.violations]
    if outcome.ambiguous:
        record["ambiguous"] = list(outcome.ambiguous)
    if outcome.power_cut_states is not None:  # [recovered, distinct in the window, broke a guarantee]
        record["power_cut_states"] = [outcome.power_cut_states, outcome.power_cut_window, outcome.power_cut_failed]
    return record


class BrokenDryRunItem(ReportingItem):
    """Stands for the cells of a workload whose crash-free dry run failed (in the
    report's grid: one cell across the workload's row)."""

    def __init__(self, *, backend: str, workload: str, message: str, reproduce: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message
        self.reproduce = reproduce
        self.add_marker(pytest.mark.spec("TEST-4"))
        self.backend = backend
        self.workload = workload
        self.user_properties.append(("botmesh_backend", backend))

    def cell_record(self) -> dict[str, Any]:
        """The workload's row of the report's grid: one failed cell, before its others."""
        return {"id": f"{self.backend}/{self.workload}/dry-run", "workload": self.workload, "policy": "*",
                "at": "dry-run", "seq": -1}

    def runtest(self) -> None:
        raise CellFailed(self.message)

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-matrix", 0, self.name


class KillLoopItem(ReportingItem):
    """A real kill loop (:class:`~botmesh_testkit.kill.KillLoop`) on one backend and
    policy: ``kills`` SIGKILLs of a child process running the bot, whose channel splits
    texts over ``text_limit`` characters (None: no limit)."""

    def __init__(self, *, backend: str, policy: str, kills: int, messages: int, seed: int,
                 text_limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.policy = policy
        self.kills = kills
        self.messages = messages
        self.seed = seed
        self.text_limit = text_limit
        self.add_marker(pytest.mark.spec("GUAR-1", "GUAR-2", "GUAR-3", "GUAR-4", "INB-2", "INB-7", "OUT-2", "OUT-14",
                                         "LEASE-2", "LEASE-4", "TEST-3"))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        from ..backends.registry import resolve
        from ..kill import KillLoop

        with tempfile.TemporaryDirectory(prefix="botmesh-kills-") as tmp:
            harness = resolve(self.backend)(tmp)
            try:
                asyncio.run(harness.open())  # a factory harness learns its capabilities here
                spec, caps = harness.kill_spec(), harness.capabilities
            finally:
                asyncio.run(harness.close())  # the storage is the children's now (file locks ...)
            if not caps.survives_crash:
                pytest.skip(f"capability not claimed: survives_crash (backend {self.backend})")
            if spec is None:
                pytest.skip(f"backend {self.backend}: a child process cannot reach its storage")
            try:
                result = KillLoop(spec, kills=self.kills, messages=self.messages, seed=self.seed,
                                  on_ambiguous=self.policy, text_limit=self.text_limit,
                                  workdir=os.path.join(tmp, "loop")).run()
            finally:
                asyncio.run(resolve(self.backend)(tmp).close())  # drop what the children left (tables, keys)
        self.user_properties.append(("botmesh_kill_report", result.report().splitlines()[0:5]))
        if not result.passed:
            ids = sorted(result.violated_ids)
            self.user_properties.append(("botmesh_violated", tuple(ids)))
            matrix = matrix_name(self.config)
            raise CellFailed(result.report() + f"\n  rerun: {rerun_base(self.config, self.seed)} --botmesh-parts=kills "
                                               f"--botmesh-matrix={matrix} "
                                               f"-k {shlex.quote(f'{self.backend}/{self.policy}/')}")

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-kills", 0, self.name


class PowerCutItem(ReportingItem):
    """A power-cut loop (:mod:`botmesh_testkit.kill.powercut`) on one backend and policy:
    ``cuts`` SIGKILLs of a child process, each followed by a power cut of the FUSE file
    system its storage is on."""

    def __init__(self, *, backend: str, policy: str, cuts: int, messages: int, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.policy = policy
        self.cuts = cuts
        self.messages = messages
        self.seed = seed
        self.add_marker(pytest.mark.spec("GUAR-1", "GUAR-2", "GUAR-3", "GUAR-4", "INB-1", "INB-2", "OUT-1", "OUT-2",
                                         "OUT-14", "LEASE-2", "TEST-3"))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        from ..kill.powercut import PowerCutHarnessError, power_cut_loop, probe_claims
        from ..kill.spec import HarnessError

        from ..kill.powercut_server import SERVER_KINDS, power_cut_server_loop

        if self.backend not in SERVER_KINDS and not probe_claims(self.backend):
            pytest.skip(f"capability not claimed: survives_crash (backend {self.backend})")
        with tempfile.TemporaryDirectory(prefix="botmesh-powercuts-") as tmp:
            try:
                if self.backend in SERVER_KINDS:  # a private server whose data directory is on the mount
                    kind: Literal["postgres", "redis"] = "postgres" if self.backend == "postgres" else "redis"
                    run: Any = power_cut_server_loop(kind, cuts=self.cuts, messages=self.messages,
                                                     seed=self.seed, policy=self.policy, workdir=tmp)
                else:
                    run = power_cut_loop(self.backend, cuts=self.cuts, messages=self.messages, seed=self.seed,
                                         policy=self.policy, workdir=tmp)
            except PowerCutHarnessError as exc:
                self.user_properties.append(("botmesh_violated", ()))  # the harness's fault, not the backend's
                raise CellFailed(f"power-cut loop on {self.backend}: {exc} (a failure of the testkit's file system, "
                                 "not a violation by the backend)") from None
            except HarnessError as exc:
                # a child that dies at once after a power cut: the backend cannot open what the cut left
                ids = ("GUAR-1", "INB-3", "OUT-1")
                self.user_properties.append(("botmesh_violated", ids))
                raise CellFailed(f"power-cut loop on {self.backend}, on_ambiguous={self.policy}, seed {self.seed}: "
                                 f"FAILED\n  violated [{', '.join(ids)}] the backend does not start on what a power "
                                 f"cut left of its storage: {str(exc)[-1500:]}\n"
                                 f"  rerun: {rerun_base(self.config, self.seed)} --botmesh-parts=powercuts "
                                 f"--botmesh-matrix={matrix_name(self.config)} "
                                 f"-k {shlex.quote(f'{self.backend}/{self.policy}/')}") from None
        if isinstance(run, str):
            pytest.skip(run)
        self.user_properties.append(("botmesh_kill_report", run.report().splitlines()[0:3]))
        if not run.passed:
            self.user_properties.append(("botmesh_violated", tuple(sorted(run.result.violated_ids))))
            raise CellFailed(run.report() + f"\n  rerun: {rerun_base(self.config, self.seed)} --botmesh-parts=powercuts "
                                            f"--botmesh-matrix={matrix_name(self.config)} "
                                            f"-k {shlex.quote(f'{self.backend}/{self.policy}/')}")

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-powercuts", 0, self.name


class HeldOpsItem(ReportingItem):
    """The held-operation sweep (:mod:`botmesh_testkit.kill.held`) on one backend: the bot
    SIGKILLed while its n-th write, truncate or rename is held, for ``points`` values of
    n, each followed by a process death only or a power cut, restarted and judged."""

    def __init__(self, *, backend: str, policy: str, points: int, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.policy = policy
        self.points = points
        self.seed = seed
        self.add_marker(pytest.mark.spec("GUAR-1", "GUAR-2", "GUAR-3", "GUAR-4", "INB-1", "INB-2", "OUT-1", "OUT-2",
                                         "OUT-14", "LEASE-2", "TEST-3"))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        from ..kill.held import held_op_sweep
        from ..kill.powercut import PowerCutHarnessError, probe_claims
        from ..kill.spec import HarnessError

        if not probe_claims(self.backend):
            pytest.skip(f"capability not claimed: survives_crash (backend {self.backend})")
        rerun = (f"  rerun: {rerun_base(self.config, self.seed)} --botmesh-parts=powercuts "
                 f"--botmesh-matrix={matrix_name(self.config)} -k {shlex.quote(f'{self.backend}/{self.points}-held-ops')}")
        with tempfile.TemporaryDirectory(prefix="botmesh-heldops-") as tmp:
            try:
                run = held_op_sweep(self.backend, points=self.points, seed=self.seed, policy=self.policy, workdir=tmp)
            except PowerCutHarnessError as exc:
                self.user_properties.append(("botmesh_violated", ()))  # the harness's fault, not the backend's
                raise CellFailed(f"held-operation sweep on {self.backend}: {exc} (a failure of the testkit's file "
                                 "system, not a violation by the backend)") from None
            except HarnessError as exc:
                ids = ("GUAR-1", "INB-3", "OUT-1")
                self.user_properties.append(("botmesh_violated", ids))
                raise CellFailed(f"held-operation sweep on {self.backend}, seed {self.seed}: FAILED\n  violated "
                                 f"[{', '.join(ids)}] the backend does not start on what a death left of its "
                                 f"storage: {str(exc)[-1500:]}\n{rerun}") from None
        if isinstance(run, str):
            pytest.skip(run)
        self.user_properties.append(("botmesh_kill_report", run.report().splitlines()[0:2]))
        if not run.passed:
            self.user_properties.append(("botmesh_violated", tuple(sorted(run.violated_ids))))
            raise CellFailed(run.report() + "\n" + rerun)

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-powercuts", 0, self.name


class IoErrorItem(ReportingItem):
    """The I/O-error loop (:mod:`botmesh_testkit.matrix.io_errors`) on one backend: each
    file-system operation of a short workload fails once, in turn."""

    def __init__(self, *, backend: str, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.seed = seed
        self.add_marker(pytest.mark.spec("INB-8", "INB-2", "INB-3", "GUAR-1", "GUAR-2", "OUT-1", "OUT-2"))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        from ..matrix.io_errors import io_error_loop

        with tempfile.TemporaryDirectory(prefix="botmesh-ioerrors-") as tmp:
            run = asyncio.run(io_error_loop(self.backend, seed=self.seed, workdir=tmp))
        if isinstance(run, str):
            pytest.skip(run)
        self.user_properties.append(("botmesh_kill_report", run.report().splitlines()[0:2]))
        if not run.passed:
            self.user_properties.append(("botmesh_violated", tuple(run.violated_ids())))
            raise CellFailed(run.report() + f"\n  rerun: {rerun_base(self.config, self.seed)} --botmesh-parts=powercuts "
                                            f"--botmesh-matrix={matrix_name(self.config)} "
                                            f"-k {shlex.quote(f'{self.backend}/io-errors')}")

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-powercuts", 0, self.name


class ExploreItem(ReportingItem):
    """The explore part on one backend (:mod:`botmesh_testkit.explore.machine`): up to
    ``examples`` generated stories within about ``seconds``. A failing story, shrunk, is
    written as a scenario file (into the pytest cache's ``d/botmesh-explore/stories``, else a
    temporary folder, printed) that replays it with ``--botmesh-scenarios`` — the story of
    each kind of failure found, each in a file of its own with its own command; the stories
    Hypothesis found failing are kept in ``d/botmesh-explore/<backend>`` and replayed first
    by the next run."""

    def __init__(self, *, backend: str, examples: int, seconds: float, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from ..explore.machine import IDS

        self.backend = backend
        self.examples = examples
        self.seconds = seconds
        self.seed = seed
        self.add_marker(pytest.mark.spec(*IDS))
        self.user_properties.append(("botmesh_backend", backend))

    def _cache(self, *names: str) -> Path | None:
        cache = getattr(self.config, "cache", None)
        if cache is None:
            return None
        folder = Path(cache.mkdir("botmesh-explore"))
        for name in names:
            folder = folder / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def runtest(self) -> None:
        import re

        from ..backends.registry import resolve
        from ..explore.machine import ExploreFailure, explore, render_story

        with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
            crashes = bool(resolve(self.backend)(tmp).capabilities.survives_crash)
        slug = re.sub(r"[^0-9A-Za-z._-]", "_", self.backend)
        run = explore(self.backend, examples=self.examples, seconds=self.seconds, seed=self.seed,
                      database=self._cache(slug), crashes=crashes)
        self.user_properties.append(("botmesh_kill_report", [run.summary()]))
        # the run, structured, for ``botmesh-testkit explore`` (which prints it its own way)
        record: dict[str, Any] = {"summary": run.summary(), "examples": run.examples, "steps": run.steps,
                                  "seconds": round(run.seconds, 3), "notes": list(run.notes)}
        if run.failure is None:
            self.user_properties.append(("botmesh_explore", record))
            return
        failure = run.failure
        self.user_properties.append(("botmesh_violated", tuple(sorted({i for f in (failure, *run.others) for i in f.ids}))))
        folder = self._cache("stories") or Path(tempfile.mkdtemp(prefix="botmesh-explore-stories-"))

        def written(found: ExploreFailure, kind: int) -> dict[str, Any]:
            """``found``'s story as a scenario file of its own; what to say about it."""
            name, text = render_story(self.backend, self.seed, found, kind)
            path = folder / f"{name}.py"
            path.write_text(text, encoding="utf-8")
            ids = f"[{', '.join(found.ids)}] " if found.ids else ""
            return {"violated": f"violated {ids}{found.message}", "story": str(path),
                    "story_lines": list(found.lines),
                    "shape": f"shrunk; on_ambiguous={found.policy}, text_limit={found.text_limit}",
                    "replay": (f"pytest --botmesh-backend={shlex.quote(self.backend)} --botmesh-parts=scenarios "
                               f"--botmesh-scenarios={shlex.quote(str(folder))} -k {name}")}

        first = written(failure, 1)
        also = [written(other, k) for k, other in enumerate(run.others, start=2)]
        record.update(first, also=also)
        self.user_properties.append(("botmesh_explore", record))
        lines = [run.summary(), f"  {first['violated']}", *(f"  note: {n}" for n in run.notes),
                 f"  the story ({first['shape']}), written to {first['story']}:"]
        lines += [f"    {line}" for line in failure.lines]
        lines.append(f"  replay it: {first['replay']}")
        for other in also:  # each other kind found, with its own shrunk story and replay
            lines.append(f"  also found, another kind: {other['violated']}")
            lines.append(f"    its story ({other['shape']}, {len(other['story_lines'])} steps), "
                         f"written to {other['story']}")
            lines.append(f"    replay it: {other['replay']}")
        base = rerun_base(self.config, self.seed)
        lines.append(f"  rerun explore: {base} --botmesh-parts=explore --botmesh-matrix={matrix_name(self.config)}")
        raise CellFailed("\n".join(lines))

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-explore", 0, self.name


class ServiceSkipItem(pytest.Item):
    """Stands for the items of a backend whose server could not be provisioned (or of a
    part that cannot run on this machine: ``backend`` names whose part it counts in)."""

    def __init__(self, *, reason: str, backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reason = reason
        if backend is not None:
            self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        pytest.skip(self.reason)

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-services", 0, self.name


def matrix_items(session: pytest.Session, config: pytest.Config, backend: str, seed: int) -> list[pytest.Item]:
    """The crash cells of ``backend`` (one item each), drawn from each workload's dry run."""
    from ..matrix.cells import Cell, draw_cells
    from ..matrix.profiles import load_profile
    from ..matrix.run import oracle
    from ..matrix.scratch import scratch_dir

    profile = load_profile(matrix_name(config))
    only = Cell.parse(config.getoption("--botmesh-cell")) if config.getoption("--botmesh-cell") else None
    if only is not None and only.backend != backend:
        return []
    power_cuts = power_cut_states_apply(backend)
    items: list[pytest.Item] = []
    for workload in profile.workloads:
        if only is not None and only.workload != workload:
            continue
        from .deadline import BudgetExceeded, alarm, dry_run_budget

        budget = dry_run_budget(config)
        late = (f"did not finish within its real-time budget of {budget:g} s (--botmesh-dry-run-timeout, at most "
                "--botmesh-cell-timeout): a backend that hangs or makes the engine spin")
        try:
            with scratch_dir("botmesh-oracle-") as tmp, alarm(budget + 1, late):
                truth = asyncio.run(asyncio.wait_for(oracle(backend, workload, seed, tmp), budget))
        except (Exception, BudgetExceeded) as exc:  # the backend cannot even run the workload without a crash
            hung = isinstance(exc, (TimeoutError, BudgetExceeded))
            reason = late if hung else f"raised {exc!r}"
            # a backend that hangs in one dry run hangs in the next: one item, not a budget per workload
            rest = [w for w in profile.workloads[profile.workloads.index(workload) + 1:]
                    if only is None or only.workload == w] if hung else []
            untried = (f"; the dry runs of its other workloads ({', '.join(rest)}) were not tried" if rest else "")
            name = f"botmesh-matrix::{backend}/{workload}/dry-run"
            rerun = f"botmesh-testkit run --backend {shlex.quote(backend)} --seed {seed} --parts matrix"
            items.append(BrokenDryRunItem.from_parent(
                session, name=name, nodeid=name, backend=backend, workload=workload, reproduce=rerun,
                message=f"the crash-free dry run of workload {workload!r} on {backend} {reason}; its crash cells "
                        f"cannot be drawn{untried}. Reproduce: {rerun}"))
            if hung:
                break
            continue
        cells = draw_cells(backend, workload, truth, profile.policies, profile.random_per_workload, seed)
        if only is not None:
            cells = [only]
        groups: dict[str, list[Cell]] = {}
        for cell in cells:
            groups.setdefault(cell.policy, []).append(cell)
        for cell in cells:
            items.append(MatrixCellItem.from_parent(session, name=f"botmesh-matrix::{cell.id}",
                                                    nodeid=f"botmesh-matrix::{cell.id}", cell=cell, oracle=truth,
                                                    seed=seed, power_cuts=power_cuts, seq=len(items),
                                                    group=groups[cell.policy]))
    return items


def power_cut_states_apply(backend: str) -> bool:
    """Whether ``backend``'s crashed cells also recover from power-cut crash states
    (:mod:`botmesh_testkit.matrix.powercut_states`): its harness does its file I/O
    through ``botmesh.core.fileio`` and it claims ``survives_crash`` (as known before it
    opens: a factory's claims are learnt at open, and such a harness takes no
    ``FileIO``)."""
    from ..backends.registry import resolve
    from ..matrix.powercut_states import recording_io

    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        harness = resolve(backend)(tmp)
        return recording_io(harness, tmp) is not None and harness.capabilities.survives_crash


def explore_items(session: pytest.Session, config: pytest.Config, backends: list[str], seed: int) -> list[pytest.Item]:
    """The explore part: one item per backend (none when the budget is 0 stories)."""
    from .options import explore_budget

    examples, seconds = explore_budget(config)
    if not examples:
        return []
    items: list[pytest.Item] = []
    for backend in backends:
        name = f"botmesh-explore::{backend}/{examples}-stories"
        items.append(ExploreItem.from_parent(session, name=name, nodeid=name, backend=backend, examples=examples,
                                             seconds=seconds, seed=seed))
    return items


def kill_items(session: pytest.Session, config: pytest.Config, backends: list[str], seed: int) -> list[pytest.Item]:
    """The profile's kill loops: one item per backend and policy, each with the
    profile's channel text limit (``kill_text_limit``)."""
    from ..matrix.profiles import load_profile

    profile = load_profile(matrix_name(config))
    if not profile.kills:
        return []
    items: list[pytest.Item] = []
    for backend in backends:
        if backend == "memory":
            continue  # nothing of it outlives a process: no kill loop to run
        for policy in profile.policies:
            name = f"botmesh-kills::{backend}/{policy}/{profile.kills}-kills"
            items.append(KillLoopItem.from_parent(session, name=name, nodeid=name, backend=backend, policy=policy,
                                                  kills=profile.kills, messages=profile.kill_messages, seed=seed,
                                                  text_limit=profile.kill_text_limit or None))
    return items


def scenario_items(session: pytest.Session, folder: Path, backends: list[str], label: str, rerun: str,
                   seed: int) -> list[pytest.Item]:
    """The scenarios of the files of ``folder``, on each backend."""
    from ..scenario.collect import ScenarioFile, scenario_files

    items: list[pytest.Item] = []
    for path in scenario_files(folder):
        node = ScenarioFile.from_parent(session, path=path, nodeid=f"botmesh-scenarios/{label}/{path.name}",
                                        backends=backends, rerun=rerun, seed=seed)
        items.extend(session.genitems(node))
    return items


def suite_items(session: pytest.Session) -> list[pytest.Item]:
    """The conformance suites, parametrized over the selected backends."""
    from ..conformance import _certify

    path = Path(_certify.__file__)
    module = pytest.Module.from_parent(session, path=path, nodeid="botmesh-conformance")
    return list(session.genitems(module))


def powercut_items(session: pytest.Session, config: pytest.Config, backends: list[str], seed: int) -> list[pytest.Item]:
    """The profile's power-cut loops (one item per backend whose storage is in its
    workdir, or on a private server, and policy), held-operation sweeps and I/O-error
    loops (one each per embedded backend). When this machine cannot mount the file system
    — no ``/dev/fuse``, no binding or libfuse, or the mount itself refused (tried once,
    here: a container without ``CAP_SYS_ADMIN``) — the part is one skip per backend
    saying why, or a usage error under ``--botmesh-require-powercuts`` /
    ``--botmesh-require-services``. Trying the mount also unmounts the power-cut mounts
    a killed run left behind."""
    from ..matrix.profiles import load_profile
    from .options import require_powercuts, usage

    from ..kill.powercut_server import SERVER_KINDS

    profile = load_profile(matrix_name(config))
    targets = [b for b in backends if powercuts_apply(b)]
    if not (profile.power_cuts or profile.held_ops or profile.io_errors) or not targets:
        return []
    from ..crash.fs.mount import mount_refused_reason

    reason = mount_refused_reason()  # also unmounts what killed runs left behind
    if reason is not None:
        if require_powercuts(config):
            raise usage("--botmesh-parts=powercuts", f"the power-cut file system cannot be mounted here: {reason}")
        return [ServiceSkipItem.from_parent(session, name=f"botmesh-powercuts::{b}", nodeid=f"botmesh-powercuts::{b}",
                                            reason=f"power cuts cannot run here: {reason}", backend=b)
                for b in targets]
    items: list[pytest.Item] = []
    for backend in targets:
        for policy in profile.policies if profile.power_cuts else ():
            name = f"botmesh-powercuts::{backend}/{policy}/{profile.power_cuts}-cuts"
            items.append(PowerCutItem.from_parent(session, name=name, nodeid=name, backend=backend, policy=policy,
                                                  cuts=profile.power_cuts, messages=profile.kill_messages, seed=seed))
        if profile.held_ops and backend not in SERVER_KINDS:  # the bot's own process writes the storage
            name = f"botmesh-powercuts::{backend}/{profile.held_ops}-held-ops"
            items.append(HeldOpsItem.from_parent(session, name=name, nodeid=name, backend=backend,
                                                 policy=profile.policies[0], points=profile.held_ops, seed=seed))
        if profile.io_errors and backend not in SERVER_KINDS:  # the I/O-error loop runs in-process on files
            name = f"botmesh-powercuts::{backend}/io-errors"
            items.append(IoErrorItem.from_parent(session, name=name, nodeid=name, backend=backend, seed=seed))
    return items


def powercuts_apply(backend: str) -> bool:
    """Whether the power-cut loop reaches ``backend``'s storage: it lives in the
    harness's workdir (a file system mounted there holds it), or it is ``postgres`` /
    ``redis`` and this machine has the server's binaries (a private server is started with
    its data directory on the mount)."""
    from ..backends.registry import resolve
    from ..kill.powercut import storage_on_workdir
    from ..kill.powercut_server import SERVER_KINDS, server_unavailable_reason

    if backend in SERVER_KINDS:
        return server_unavailable_reason(backend) is None

    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        try:
            return storage_on_workdir(resolve(backend)(tmp).kill_spec(), tmp)
        except Exception:  # a harness that cannot even describe its storage: no power cuts to run
            return False


def reproduce_command(item: pytest.Item, base: str, config: pytest.Config) -> str | None:
    """The shell command that reruns ``item`` alone, as printed beside its failure, kept in
    the JUnit properties and in the reports. ``base`` is :func:`~.options.rerun_base`.

    A suite item's node id (``botmesh-conformance::TestDurableKv::test_x[backend]``) is
    not a path pytest accepts, so the command selects it with ``-k`` on its class and
    name; the parts without a command of their own likewise."""
    from .results import part_of

    part = part_of(item.nodeid)
    cell = getattr(item, "cell", None)
    if part == "matrix" and cell is not None:
        return str(cell.command(int(getattr(item, "seed", 0))))
    if part == "matrix" and isinstance(item, BrokenDryRunItem):
        return item.reproduce
    if part == "scenarios":
        rerun = getattr(item.parent, "rerun", None)
        return f"{rerun} -k {shlex.quote(item.name)}" if rerun else None
    if part not in ("suite", "explore", "kills", "powercuts", "corruption"):
        return None
    profile = matrix_name(config)
    words = [base, f"--botmesh-parts={part}"]
    if profile != "smoke":
        words.append(f"--botmesh-matrix={shlex.quote(profile)}")
    if part == "suite":
        cls = item.getparent(pytest.Class)
        expr = f"{cls.name} and {item.name}" if cls is not None else item.name
    else:
        expr = item.name
    words.append(f"-k {shlex.quote(expr)}")
    return " ".join(words)
