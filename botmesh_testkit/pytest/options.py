"""The values of the plugin's options and ini keys, read in one place (the options are
declared in :func:`botmesh_testkit.plugin.pytest_addoption`)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

PARTS = ("suite", "scenarios", "matrix", "explore", "kills", "powercuts", "corruption")
"""The parts of a certification, in the order they are reported."""

DEFAULT_BACKEND = "sqlite"
DEFAULT_CELL_TIMEOUT = 120.0
DEFAULT_MATRIX = "smoke"


def usage(option: str, message: str) -> pytest.UsageError:
    """A usage error naming the option (or ini key) at fault."""
    return pytest.UsageError(f"{option}: {message}")


def parts(config: pytest.Config) -> tuple[str, ...]:
    """``--botmesh-parts``, validated (default: every part)."""
    raw = config.getoption("--botmesh-parts")
    if not raw:
        return PARTS
    chosen = tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        raise usage("--botmesh-parts", f"{raw!r}: choose from {', '.join(PARTS)}")
    return chosen


def selected(config: pytest.Config) -> list[str]:
    """The backends given with ``--botmesh-backend``."""
    return list(config.getoption("--botmesh-backend") or [])


def default_backends(config: pytest.Config) -> list[str]:
    """``--botmesh-backend``, else the ini ``botmesh_backend``, else ``sqlite``."""
    return selected(config) or list(config.getini("botmesh_backend")) or [DEFAULT_BACKEND]


def scenario_dirs(config: pytest.Config) -> list[Path]:
    """``--botmesh-scenarios`` then the ini ``botmesh_scenarios``."""
    given = [Path(p) for p in config.getoption("--botmesh-scenarios") or []]
    return given + [Path(p) for p in config.getini("botmesh_scenarios")]


def matrix_name(config: pytest.Config) -> str:
    """``--botmesh-matrix``, else the ini ``botmesh_matrix``."""
    return str(config.getoption("--botmesh-matrix") or config.getini("botmesh_matrix"))


def cell_budget(config: pytest.Config) -> float:
    """Real seconds one crash cell may take (``--botmesh-cell-timeout`` / ini)."""
    given = config.getoption("--botmesh-cell-timeout")
    return float(given if given is not None else config.getini("botmesh_cell_timeout"))


def explore_budget(config: pytest.Config) -> tuple[int, float]:
    """Stories per backend and real seconds of the ``explore`` part:
    ``--botmesh-explore-examples`` / ``--botmesh-explore-seconds``, else the profile's
    ``explore_examples`` / ``explore_seconds``."""
    from ..matrix.profiles import load_profile

    profile = load_profile(matrix_name(config))
    examples = config.getoption("--botmesh-explore-examples")
    seconds = config.getoption("--botmesh-explore-seconds")
    return (int(examples) if examples is not None else profile.explore_examples,
            float(seconds) if seconds is not None else profile.explore_seconds)


def require_powercuts(config: pytest.Config) -> bool:
    """Whether a machine that cannot mount the power-cut file system is an error
    (``--botmesh-require-powercuts``, or ``--botmesh-require-services`` as .ci/run sets)
    rather than one skip per backend."""
    return bool(config.getoption("--botmesh-require-powercuts") or config.getoption("--botmesh-require-services"))


def rerun_base(config: pytest.Config, seed: int) -> str:
    """``pytest --botmesh-backend=... --botmesh-seed=N``: the start of every reproduce
    command the plugin prints."""
    words = ["pytest"] + [f"--botmesh-backend={shlex.quote(b)}" for b in selected(config)]
    return " ".join(words + [f"--botmesh-seed={seed}"])
