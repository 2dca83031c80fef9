#!/usr/bin/env python3
"""The explore part's pace per backend, and how long it takes to catch a planted bug.

Part 1, the pace (``--parts rate``). For each backend, ``explore()``
(``botmesh_testkit.explore.machine``, the function the plugin's explore item calls) runs
``--examples`` stories with ``--seed`` and no time budget, in this process, one backend
after the other. Twice per backend that claims ``survives_crash``:

* **as certified**: with the crash and restart rules, as the explore item runs it (the
  rules are on when the backend's harness claims ``survives_crash``, as the item decides);
* **like memory**: without them. ``memory`` does not claim ``survives_crash``, so its
  stories have no crash or restart; without those rules every backend draws *the same
  stories* from the same seed (the steps column shows it), which makes the memory
  backend's rate a like-for-like baseline, measured in the same run: "x memory" is a
  backend's steps/s in those stories divided by memory's.

A story is one Hypothesis example of the state machine (up to 25 steps, then the final
check ``x.finish()``); a step is one rule (a receive with its drawn plan, a redelivery,
a fault, a crash armed, a restart, virtual time passing, the final check). Figures:
stories (Hypothesis may run a few more than asked), steps, wall seconds, stories/s,
steps per story and steps/s. One untimed two-story run on memory goes first (the first
``explore()`` of a process pays one-time costs).

Part 2, planted bugs (``--parts bugs``): ``KvDurability`` over ``MemoryKv``, given to
explore as a ``module:factory`` backend as a third party's would be, with one bug each:
``forgets-sent`` acknowledges ``outbox_mark_sent`` without writing it (the send is made
again once its lease runs out: GUAR-3, OUT-2, OUT-14), ``loses-inbound`` acknowledges
``inbox_journal`` without writing it (INB-1, GUAR-1). Each is explored once, with up to
``--bug-examples`` stories and shrinking bounded as the plugin bounds it
(``--no-shrink`` turns shrinking off): the time to the first failure, the story it was
found in, then the time until the shrunk story is ready, its steps, and the stories run
in all (shrinking replays the failing story over and over: a failing story is much
slower than a passing one — its sends are made again and again in virtual time).

``explore()`` reports when the first failure was seen only as a story number, so the
time to it is taken by a subclass of the run's private recorder
(``botmesh_testkit.explore.machine._Recorder``) that notes the moment its
``found_after`` is first set; if a later version drops that class, the column says
``-`` and the rest still runs. (Turning shrinking off does not measure it: Hypothesis
still replays the failing story several times before it reports, ~10x the time to find
it here.)

Baseline of part 2, measured in the same run: the same ``KvDurability`` over
``MemoryKv`` without a bug ("sound twin"), ``--examples`` stories: "at the twin's pace"
is the first failing story's number divided by the twin's stories/s — how long those
stories take when nothing fails, so the difference is what finding the failure costs.

``postgres`` and ``redis`` run when ``resolve(name)`` works and a server answers (a URL
in ``BOTMESH_POSTGRES_URL`` / ``BOTMESH_REDIS_URL``, else a private server provisioned
by ``botmesh_testkit.servers``); otherwise the row says ``skipped: <reason>``.

Usage::

    python benchmarks/explore.py [--examples N] [--seed N] [--backends NAME ...] [--json PATH]

Needs only botmesh and botmesh_testkit (``pip install -e '.[dev]'``: Hypothesis);
temporary files go in ``tempfile`` directories and are deleted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from botmesh.core.kv_durability import KvDurability
from botmesh.core.memory import MemoryKv
from botmesh_testkit.backends import SERVICE_BACKENDS, resolve
from botmesh_testkit.explore import machine
from botmesh_testkit.explore.machine import ExploreRun, explore

import _against

DEFAULT_BACKENDS = ["memory", "file", "file+log", "sqlite", "postgres", "redis"]
PARTS = ("rate", "bugs")
NO_BUDGET = 1e9
"""``seconds`` given to ``explore()``: the example count alone ends a run."""


# --------------------------------------------------------------------------------------
# the planted bugs (module:factory backends, as a third party's)
# --------------------------------------------------------------------------------------
_STORES: dict[str, MemoryKv] = {}
"""One MemoryKv per story's workdir: a restart's new instance finds the same storage."""


class ForgetsSent(KvDurability):
    """Acknowledges ``outbox_mark_sent`` without writing it."""

    async def outbox_mark_sent(self, scope: str, key: str, **kwargs: Any) -> bool:
        return True


class LosesInbound(KvDurability):
    """Acknowledges ``inbox_journal`` without writing it."""

    async def inbox_journal(self, scope: str, record: Any) -> Any:
        return record, True


def sound_twin(workdir: str) -> KvDurability:
    """The baseline: the same kv durability without a bug."""
    return KvDurability(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)


def forgets_sent(workdir: str) -> KvDurability:
    return ForgetsSent(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)


def loses_inbound(workdir: str) -> KvDurability:
    return LosesInbound(_STORES.setdefault(workdir, MemoryKv()), own_kv=False)


BUGS: dict[str, Callable[[str], KvDurability]] = {"forgets-sent": forgets_sent, "loses-inbound": loses_inbound}


def factory_name(fn: Callable[..., Any]) -> str:
    """``module:function`` of a factory of this script, as explore resolves it."""
    return f"{fn.__module__}:{fn.__name__}"


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prepare_backend(name: str, cleanups: list[Callable[[], Any]]) -> str | None:
    """None when ``name`` can be used, else why not. For ``postgres``/``redis`` a server
    is made sure of (a URL from the environment, else a private one) and its URL exported
    the way the pytest plugin does."""
    try:
        resolve(name)
    except Exception as exc:  # unknown name, driver missing
        return f"resolve({name!r}) failed: {one_line(exc)}"
    if name not in SERVICE_BACKENDS:
        return None
    from botmesh_testkit import servers

    try:
        if name == "postgres":
            pg = servers.provision_postgres(os.environ.get(servers.POSTGRES_URL_ENV))
            cleanups.append(pg.close)
            os.environ[servers.POSTGRES_URL_ENV] = pg.new_database(servers.namespace_hint("bench"))
        else:
            rd = servers.provision_redis(os.environ.get(servers.REDIS_URL_ENV))
            cleanups.append(rd.close)
            os.environ[servers.REDIS_URL_ENV] = rd.url
            os.environ[servers.REDIS_PREFIX_ENV] = rd.new_prefix(servers.namespace_hint("bench"))
    except Exception as exc:
        return f"no {name} server: {one_line(exc)}"
    return None


def claims_crashes(name: str) -> bool:
    """Whether the explore item gives ``name`` the crash and restart rules (it asks the
    harness, unopened, whether it claims ``survives_crash``)."""
    with tempfile.TemporaryDirectory(prefix="botmesh-bench-probe-") as tmp:
        return bool(resolve(name)(tmp).capabilities.survives_crash)


_FIRST_FAILURE: list[float] = []
"""Seconds from the start of an ``explore()`` run to its first failure, appended by the
timed recorder (see the module docstring)."""


def install_failure_timer() -> bool:
    """Make ``explore()`` note when it first sees a failure (False: it cannot here)."""
    base = getattr(machine, "_Recorder", None)
    if base is None or "found_after" not in vars(base()):
        return False

    class TimedRecorder(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            object.__setattr__(self, "_started", time.monotonic())
            super().__init__()

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "found_after" and value is not None and self.__dict__.get("found_after") is None:
                _FIRST_FAILURE.append(time.monotonic() - self.__dict__["_started"])
            super().__setattr__(name, value)

    machine._Recorder = TimedRecorder  # type: ignore[misc]
    return True


def figures(run: ExploreRun) -> dict[str, Any]:
    seconds = max(run.seconds, 1e-9)
    return {"stories": run.examples, "steps": run.steps, "seconds": round(run.seconds, 3),
            "stories_per_s": run.examples / seconds, "steps_per_story": run.steps / max(1, run.examples),
            "steps_per_s": run.steps / seconds, "passed": run.passed,
            "failure": None if run.failure is None else f"[{', '.join(run.failure.ids)}] {run.failure.message}"}


def first_failing_story(run: ExploreRun) -> int | None:
    for note in run.notes:
        if note.startswith("first failing story: example "):
            return int(note.split("example ", 1)[1].split(";", 1)[0])
    return None


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align, strict=True)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


# --------------------------------------------------------------------------------------
# the runs
# --------------------------------------------------------------------------------------
def bench_rate(backends: list[str], args: argparse.Namespace, out: Any) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    cleanups: list[Callable[[], Any]] = []
    try:
        for backend in backends:
            reason = prepare_backend(backend, cleanups)
            if reason is not None:
                entries[backend] = {"skipped": reason}
                print(f"  {backend:<9} skipped: {reason}", file=out, flush=True)
                continue
            crashes = claims_crashes(backend)
            entry: dict[str, Any] = {"crash_rules": crashes}
            try:
                entry["certified"] = figures(explore(backend, examples=args.examples, seconds=NO_BUDGET,
                                                     seed=args.seed, crashes=crashes))
                entry["like_memory"] = (figures(explore(backend, examples=args.examples, seconds=NO_BUDGET,
                                                        seed=args.seed, crashes=False))
                                        if crashes else entry["certified"])
            except Exception as exc:
                if backend not in SERVICE_BACKENDS:
                    raise
                entries[backend] = {"skipped": f"explore failed to run: {one_line(exc)}"}
                print(f"  {backend:<9} skipped: {entries[backend]['skipped']}", file=out, flush=True)
                continue
            entries[backend] = entry
            c, m = entry["certified"], entry["like_memory"]
            print(f"  {backend:<9} {c['stories']} stories, {c['steps']} steps in {c['seconds']:.1f} s"
                  f"{' (crash rules on)' if crashes else ''}; like memory {m['steps']} steps in {m['seconds']:.1f} s"
                  + ("" if c["passed"] and m["passed"] else f"; FAILED: {c['failure'] or m['failure']}"),
                  file=out, flush=True)
    finally:
        for close in reversed(cleanups):
            try:
                close()
            except Exception as exc:  # a server that does not stop cleanly must not hide the results
                print(f"warning: cleanup failed: {one_line(exc)}", file=sys.stderr)
    return entries


def bench_bugs(args: argparse.Namespace, out: Any) -> dict[str, Any]:
    twin = factory_name(sound_twin)
    base = explore(twin, examples=args.examples, seconds=NO_BUDGET, seed=args.seed, crashes=claims_crashes(twin))
    entries: dict[str, Any] = {"sound twin": {"backend": twin, **figures(base)}}
    twin_rate = entries["sound twin"]["stories_per_s"]
    print(f"  {'sound twin':<13} {base.examples} stories in {base.seconds:.1f} s ({fmt_rate(twin_rate)} stories/s)",
          file=out, flush=True)
    timed = install_failure_timer()
    for label, fn in BUGS.items():
        name = factory_name(fn)
        crashes = claims_crashes(name)
        _FIRST_FAILURE.clear()
        kw: dict[str, Any] = {"shrink_seconds": 0} if args.no_shrink else {}
        run = explore(name, examples=args.bug_examples, seconds=NO_BUDGET, seed=args.seed, crashes=crashes, **kw)
        found = first_failing_story(run)
        entry: dict[str, Any] = {
            "backend": name, "crash_rules": crashes, "found": run.failure is not None,
            "ids": list(run.failure.ids) if run.failure else [], "first_failing_story": found,
            "to_first_failure_s": round(_FIRST_FAILURE[0], 3) if timed and _FIRST_FAILURE else None,
            "at_twin_pace_s": None if found is None or not twin_rate else found / twin_rate,
            "shrunk": not args.no_shrink, "to_story_s": round(run.seconds, 3),
            "story_steps": len(run.failure.lines) if run.failure else None, "stories_in_all": run.examples,
        }
        entries[label] = entry
        first = entry["to_first_failure_s"]
        print(f"  {label:<13} " + (f"first failure in story {found}"
                                  + (f" after {first:.2f} s" if first is not None else "")
                                  + f"; {'shrunk ' if entry['shrunk'] else ''}story ({entry['story_steps']} steps) "
                                  f"after {run.seconds:.1f} s, {run.examples} stories in all"
                                  if entry["found"] else f"NOT FOUND in {run.examples} stories"), file=out, flush=True)
    return entries


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for ``--against``: per backend stories/s and steps/s; per bug the time to it."""
    out: dict[str, Any] = {}
    for backend, e in results.get("rate", {}).items():
        if "skipped" in e:
            out[f"{backend}: stories/s"] = f"skipped: {str(e['skipped'])[:60]}"
            continue
        out[f"{backend}: stories/s"] = e["certified"]["stories_per_s"]
        out[f"{backend}: steps/s"] = e["certified"]["steps_per_s"]
    for label, e in results.get("bugs", {}).items():
        if label == "sound twin":
            out["sound twin: stories/s"] = e["stories_per_s"]
        else:
            out[f"bug {label}: s to first failure"] = e["to_first_failure_s"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | int:
    args = parse_args(argv)
    if args.against:
        return _against.compare(__file__, args, argv)
    out = sys.stdout
    now = _dt.datetime.now(_dt.UTC)
    machine: dict[str, Any] = {
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "loadavg_start": list(os.getloadavg()),
    }
    import hypothesis

    print("botmesh explore: stories per second per backend, time to a planted bug", file=out)
    print("======================================================================", file=out)
    print(f"date:     {now.isoformat(timespec='seconds')}", file=out)
    print(f"machine:  {machine['platform']}, {machine['cpu_count']} CPUs, {machine['python']}, "
          f"Hypothesis {hypothesis.__version__}", file=out)
    print(f"load:     {' '.join(f'{x:.2f}' for x in machine['loadavg_start'])} (1, 5, 15 min) at the start", file=out)
    print(f"stories:  seed {args.seed}, {args.examples} per backend (planted bugs: up to {args.bug_examples}), "
          "no time budget, one backend after the other in this process", file=out)
    print("baseline: memory, same run: every backend also runs without the crash rules, i.e. the very stories memory "
          "runs; planted bugs: the same kv durability without the bug (sound twin)", file=out)
    print(file=out)
    results: dict[str, Any] = {"date": now.isoformat(timespec="seconds"), "machine": machine,
                               "params": {"seed": args.seed, "examples": args.examples,
                                          "bug_examples": args.bug_examples, "parts": list(args.parts)}}
    # untimed: the first explore() of a process pays Hypothesis's and the engine's one-time costs
    explore("memory", examples=2, seconds=NO_BUDGET, seed=args.seed, crashes=False)
    started = time.perf_counter()
    if "rate" in args.parts:
        print("running the backends:", file=out, flush=True)
        results["rate"] = bench_rate(args.backends, args, out)
        print(file=out)
    if "bugs" in args.parts:
        print("running the planted bugs:", file=out, flush=True)
        results["bugs"] = bench_bugs(args, out)
        print(file=out)
    machine["loadavg_end"] = list(os.getloadavg())
    results["total_seconds"] = time.perf_counter() - started

    rate = results.get("rate", {})
    memory = rate.get("memory", {}).get("like_memory")
    if rate:
        print("Explore pace per backend (stories = Hypothesis examples of the state machine; steps = rules run, the "
              "final check included)", file=out)
        rows = []
        for backend, e in rate.items():
            if "skipped" in e:
                continue
            c, m = e["certified"], e["like_memory"]
            ratio = f"{m['steps_per_s'] / memory['steps_per_s']:.2f}" if memory and memory["steps_per_s"] else "-"
            rows.append([backend, "yes" if e["crash_rules"] else "no", str(c["stories"]), str(c["steps"]),
                         f"{c['steps_per_story']:.1f}", f"{c['seconds']:.1f}", fmt_rate(c["stories_per_s"]),
                         fmt_rate(c["steps_per_s"]), str(m["steps"]), fmt_rate(m["stories_per_s"]),
                         fmt_rate(m["steps_per_s"]), ratio])
        if rows:
            print(table(["backend", "crash rules", "stories", "steps", "steps/story", "seconds", "stories/s",
                         "steps/s", "| like memory: steps", "stories/s", "steps/s", "x memory"], rows,
                        "llrrrrrrrrrr"), file=out)
        for backend, e in rate.items():
            if "skipped" in e:
                print(f"{backend}: skipped: {e['skipped']}", file=out)
        print(file=out)
    bugs = results.get("bugs")
    if bugs:
        twin = bugs["sound twin"]
        print(f"Planted bugs (baseline: the sound twin, {twin['stories']} stories in {twin['seconds']:.1f} s, "
              f"{fmt_rate(twin['stories_per_s'])} stories/s)", file=out)
        rows = []
        for label, e in bugs.items():
            if label == "sound twin":
                continue
            first, pace = e["to_first_failure_s"], e["at_twin_pace_s"]
            rows.append([label, ", ".join(e["ids"]) or "-", str(e["first_failing_story"] or "-"),
                         "-" if first is None else f"{first:.2f}", "-" if pace is None else f"{pace:.2f}",
                         f"{e['to_story_s']:.1f}", str(e["story_steps"] or "-"), str(e["stories_in_all"])])
        story = "shrunk story" if any(e.get("shrunk") for e in bugs.values()) else "story (not shrunk)"
        print(table(["bug", "ids", "found in story", "to first failure s", "at twin's pace s", f"to {story} s",
                     "its steps", "stories in all"], rows, "llrrrrrr"), file=out)
        print(file=out)
    print(f"Total time {results['total_seconds']:.1f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}.", file=out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    _against.emit(args, headline(results))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, metavar="NAME",
                   help=f"backends to measure (default: {' '.join(DEFAULT_BACKENDS)})")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: rate, bugs (default: both)")
    p.add_argument("--seed", type=int, default=20261204, help="seed of the stories (default 20261204)")
    p.add_argument("--examples", type=int, default=40, help="stories per backend (default 40, the smoke profile's)")
    p.add_argument("--bug-examples", type=int, default=200,
                   help="stories at most per planted bug before giving up (default 200)")
    p.add_argument("--no-shrink", action="store_true",
                   help="planted bugs: do not shrink the failing story (the time to the first failure is measured "
                        "either way)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    _against.add_options(p)
    args = p.parse_args(argv)
    args.parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    if not args.parts or any(x not in PARTS for x in args.parts):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    for name in ("examples", "bug_examples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


if __name__ == "__main__":
    code = main()
    sys.exit(code if isinstance(code, int) else 0)
