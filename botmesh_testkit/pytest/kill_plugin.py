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
is a :class:`~botmesh_testkit.backends.base.KillSpec` (or its tuple form,
``("sqlite", path)``, ``("factory", "pkg.mod:make", arg)`` ...) or a backend name
(``"file"``, ``"file+log"``, ``"sqlite"``, ``"pkg.mod:factory"`` ... any name
:func:`~botmesh_testkit.backends.registry.resolve` accepts whose storage a child
process can reach): its harness's storage in the loop's directory under ``tmp_path``,
released at teardown (a server backend's table or keys dropped).
Options come from the keyword arguments, then from the ``botmesh_kill(**options)``
marker, then the defaults (seed 0); ``$BOTMESH_KILL_SEED``, when set, replaces the seed
of every loop (to explore other schedules, or replay the one a report printed). At
teardown every child still alive is killed and the fixture fails the test if one of
them is still there (psutil).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # the plugin imports nothing of botmesh until a test asks for the fixture
    from ..backends.base import BackendHarness
    from ..kill.loop import KillLoop
    from ..kill.spec import BackendSpec

MARKER = "botmesh_kill"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**options): defaults for the botmesh_kill_loop fixture (kills, messages, seed, on_ambiguous ...)",
    )


@pytest.fixture
def botmesh_kill_loop(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., KillLoop]]:
    """``botmesh_kill_loop(backend, handler=None, **options) -> KillLoop`` (see the
    module docstring)."""
    from ..backends.registry import resolve
    from ..kill.loop import KillLoop
    from ..kill.spec import run_sync, spec_for

    loops: list[KillLoop] = []
    named: list[tuple[str, str]] = []  # (backend name, workdir) of the loops built from a name
    marker = request.node.get_closest_marker(MARKER)
    defaults: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    env_seed = os.environ.get("BOTMESH_KILL_SEED")

    def make(backend: BackendSpec | str = "sqlite", handler: Callable[[Any], Awaitable[Any]] | None = None,
             **options: Any) -> KillLoop:
        merged = {**defaults, **options}
        if env_seed is not None:
            merged["seed"] = int(env_seed)
        merged.setdefault("seed", 0)
        workdir = tmp_path / f"kill-{len(loops) + 1}"
        workdir.mkdir()
        merged.setdefault("workdir", str(workdir))
        if isinstance(backend, str):
            spec: BackendSpec = spec_for(backend, str(workdir))
            named.append((backend, str(workdir)))
        else:
            spec = backend
        loop = KillLoop(spec, handler, **merged)
        loops.append(loop)
        return loop

    yield make
    stray: list[int] = []
    for loop in loops:
        loop.cleanup()
        stray += loop.stray_pids()
    for name, workdir in named:  # what the children left on a server (a table, keys)
        run_sync(partial(_release, resolve(name)(workdir)))
    if stray:
        pytest.fail(f"botmesh_kill_loop: child processes still alive after the test: {stray}")


async def _release(harness: BackendHarness) -> None:
    await harness.close()
