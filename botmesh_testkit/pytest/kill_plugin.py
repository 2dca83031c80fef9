"""pytest support for real-process kill tests (:mod:`botmesh_testkit.kill`): the fixture
``botmesh_kill_loop`` and the marker ``botmesh_kill``.

The main plugin (:mod:`botmesh_testkit.plugin`) registers it. Example::

    import pytest

    async def handler(ctx):                     # runs in the child; closures are fine
        await ctx.reply(f"echo {ctx.text}")

    @pytest.mark.botmesh_kill(kills=20, messages=40)
    def test_my_backend_survives_sigkill(botmesh_kill_loop):
        loop = botmesh_kill_loop("sqlite", handler, on_ambiguous="resend")
        loop.run().assert_ok()                  # the report names violated ids and the seed

``botmesh_kill_loop(backend, handler=None, **options)`` returns a
:class:`~botmesh_testkit.kill.KillLoop` working in the test's ``tmp_path``. ``backend``
is a spec tuple (``("sqlite", path)``, ``("factory", "pkg.mod:make", arg)`` ...) or a
short name — ``"file"``, ``"file+log"``, ``"sqlite"`` — given a file in ``tmp_path``.
Options come from the keyword arguments, then from the ``botmesh_kill(**options)``
marker, then the defaults (seed 0); ``$BOTMESH_KILL_SEED``, when set, replaces the seed
of every loop (to explore other schedules, or replay the one a report printed). At
teardown every child still alive is killed and the
fixture fails the test if one of them is still there (psutil).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

MARKER = "botmesh_kill"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**options): defaults for the botmesh_kill_loop fixture (kills, messages, seed, on_ambiguous ...)",
    )


def _spec(backend: Any, tmp: str) -> tuple[Any, ...]:
    if isinstance(backend, tuple):
        return backend
    if backend == "sqlite":
        return ("sqlite", os.path.join(tmp, "bot.db"))
    if backend in ("file", "file+log"):
        return ("file", os.path.join(tmp, "journal.json"), backend == "file+log")
    raise ValueError(f"botmesh_kill_loop: backend {backend!r}: use 'file', 'file+log', 'sqlite' or a spec tuple")


@pytest.fixture
def botmesh_kill_loop(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """``botmesh_kill_loop(backend, handler=None, **options) -> KillLoop`` (see the
    module docstring)."""
    from ..kill import KillLoop

    loops: list[KillLoop] = []
    marker = request.node.get_closest_marker(MARKER)
    defaults: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    env_seed = os.environ.get("BOTMESH_KILL_SEED")

    def make(backend: Any = "sqlite", handler: Any = None, **options: Any) -> KillLoop:
        merged = {**defaults, **options}
        if env_seed is not None:
            merged["seed"] = int(env_seed)
        merged.setdefault("seed", 0)
        workdir = tmp_path / f"kill-{len(loops) + 1}"
        workdir.mkdir()
        merged.setdefault("workdir", str(workdir))
        loop = KillLoop(_spec(backend, str(workdir)), handler, **merged)
        loops.append(loop)
        return loop

    yield make
    stray: list[int] = []
    for loop in loops:
        loop.cleanup()
        stray += loop.stray_pids()
    if stray:
        pytest.fail(f"botmesh_kill_loop: child processes still alive after the test: {stray}")
