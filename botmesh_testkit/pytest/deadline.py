"""Real-time budgets for what can hang: each item of the conformance suite
(``--botmesh-item-timeout``, default the profile's ``item_timeout``: 120 s at smoke) and
each workload's crash-free dry run at collection (``--botmesh-dry-run-timeout``, default
20 s).

The budget is enforced with ``SIGALRM`` (``setitimer``) in the main thread: when it runs
out, the handler raises :class:`BudgetExceeded` into whatever Python code the main thread
is running — a Hypothesis example, an event loop spinning on a broken kv, a blocking wait
— and keeps raising it once a second until the budgeted code has returned, so that
code that swallows the first one (a background task of an event loop) cannot hold the
item. ``BudgetExceeded`` derives from ``BaseException``: Hypothesis does not take it for a
failing example (no shrinking of a timeout), and ``except Exception`` in the code under
test does not swallow it. Where no alarm can be set (not the main thread, no
``setitimer`` on the platform, or another plugin such as pytest-timeout owns ``SIGALRM``)
the budget is not enforced; the asyncio-level budgets of the matrix cells still apply.

The item fails with one line naming the budget and the option, plus the command that
reproduces it (the plugin's ``reproduce:`` section)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

from .options import matrix_name
from .results import part_of

DEFAULT_DRY_RUN_TIMEOUT = 20.0
"""Real seconds a workload's crash-free dry run may take at collection."""

_START = pytest.StashKey[float]()
_BUDGET = pytest.StashKey[float]()


class BudgetExceeded(BaseException):
    """The real-time budget of an item (or of a dry run) ran out; the message says which
    budget and which option sets it."""


def item_budget(config: pytest.Config) -> float:
    """Real seconds one suite item may take: ``--botmesh-item-timeout``, else the
    profile's ``item_timeout`` (read once per run)."""
    if _BUDGET not in config.stash:
        given = config.getoption("--botmesh-item-timeout")
        if given is not None:
            config.stash[_BUDGET] = float(given)
        else:
            from ..matrix.profiles import load_profile

            config.stash[_BUDGET] = load_profile(matrix_name(config)).item_timeout
    return config.stash[_BUDGET]


def dry_run_budget(config: pytest.Config) -> float:
    """Real seconds one workload's dry run may take: ``--botmesh-dry-run-timeout``
    (default 20), and never more than a cell's budget (the dry run is a cell without a
    crash)."""
    from .options import cell_budget

    given = config.getoption("--botmesh-dry-run-timeout")
    return min(float(given) if given is not None else DEFAULT_DRY_RUN_TIMEOUT, cell_budget(config))


def validate(config: pytest.Config) -> None:
    """Refuse a budget that is not a positive number of seconds, naming the option."""
    from .options import usage

    for option in ("--botmesh-item-timeout", "--botmesh-dry-run-timeout"):
        value = config.getoption(option)
        if value is not None and not 0 < value < float("inf"):
            raise usage(option, f"{value:g} must be > 0 seconds")


def can_alarm() -> bool:
    """Whether a budget can be enforced here: the main thread, ``setitimer`` available,
    and ``SIGALRM`` not taken by someone else."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return False
    return signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)


@contextmanager
def alarm(seconds: float, message: str) -> Generator[bool, None, None]:
    """Run the body with a budget of ``seconds`` real seconds: past it,
    :class:`BudgetExceeded` (``message``) is raised in the main thread, and again every
    second until the body has returned. Yields whether the budget is enforced (see
    :func:`can_alarm`)."""
    if not can_alarm():
        yield False
        return
    armed = [True]

    def _ring(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            raise BudgetExceeded(message)

    previous = signal.signal(signal.SIGALRM, _ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001), 1.0)
    try:
        yield True
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _budgeted(item: pytest.Item) -> bool:
    return part_of(item.nodeid) == "suite"


def _message(item: pytest.Item, budget: float) -> str:
    return (f"{item.nodeid}: did not finish within its real-time budget of {budget:g} s "
            "(--botmesh-item-timeout, or --item-timeout of botmesh-testkit run; default the matrix profile's "
            "item_timeout). A backend that hangs, "
            "or answers so that its caller never stops (an unsorted range(), a scan() that does not advance), "
            "keeps the item busy until the budget runs out.")


TEARDOWN_GRACE = 10.0
"""Real seconds a budgeted item's teardown has at least, also after its call ran out of
budget (closing what the test opened is not the backend's hang)."""


@contextmanager
def _phase(item: pytest.Item, grace: float = 0.0) -> Generator[None, None, None]:
    """One phase (setup, call, teardown) of a budgeted item, within what is left of the
    item's budget (counted from the start of its setup), or ``grace`` seconds if more."""
    budget = item_budget(item.config)
    start = item.stash.setdefault(_START, time.monotonic())
    left = max(budget - (time.monotonic() - start), min(grace, budget))
    with alarm(left, _message(item, budget)):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    if not _budgeted(item):
        return (yield)
    item.stash[_START] = time.monotonic()
    with _phase(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    if not _budgeted(item):
        return (yield)
    with _phase(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not _budgeted(item):
        return (yield)
    with _phase(item, grace=TEARDOWN_GRACE):
        return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A budget that ran out is reported as its one-line message, not as the traceback of
    wherever the alarm happened to land."""
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, BudgetExceeded):
        report.longrepr = str(call.excinfo.value)
    return report
