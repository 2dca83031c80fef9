"""The plugin's fixtures for one's own tests: ``botmesh_harness``, ``botmesh_world`` and
``botmesh_bot`` (the kill-loop fixture is in :mod:`.kill_plugin`). Registered by the
plugin at configure time; every import of ``botmesh`` happens when a fixture runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .options import default_backends

if TYPE_CHECKING:
    from botmesh.core.bot import Bot
    from botmesh.core.provider import Provider

    from ..backends.base import BackendHarness
    from ..crash.world import World


@pytest.fixture
def botmesh_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackendHarness]:
    """A fresh harness of the first selected backend (``--botmesh-backend``, else the ini
    ``botmesh_backend``, else ``sqlite``)."""
    from ..backends.registry import resolve

    harness = resolve(default_backends(request.config)[0])(str(tmp_path))
    yield harness
    asyncio.run(harness.close())


@pytest.fixture
def botmesh_world(botmesh_harness: BackendHarness) -> Callable[..., World]:
    """``botmesh_world(setup=..., **options)`` -> a World on ``botmesh_harness``."""
    from ..crash.world import World

    def make(**kwargs: Any) -> World:
        return World(botmesh_harness, **kwargs)

    return make


@pytest.fixture
def botmesh_bot(botmesh_harness: BackendHarness) -> Callable[..., Awaitable[Bot]]:
    """``await botmesh_bot(setup=None, provider=None, **durability)`` -> a started
    :class:`~botmesh.core.bot.Bot` on ``botmesh_harness`` (a
    :class:`~botmesh.core.testing.MockProvider` unless ``provider`` is given). The first
    call opens the backend; each later call abandons the previous bot as a dead process
    and reopens it, as a restart would. ``durability`` options go into ``durability=``
    (``instance_id`` defaults to ``"i1"``, the same for every call)."""
    from botmesh.core.bot import Bot
    from botmesh.core.testing import MockProvider

    bots: list[Bot] = []

    async def make(setup: Callable[[Bot], object] | None = None, provider: Provider | None = None,
                   **durability: Any) -> Bot:
        if bots:
            await bots[-1].abandon()
            backend, store = await botmesh_harness.reopen()
        else:
            backend, store = await botmesh_harness.open()
        options = {"backend": backend, "instance_id": "i1", **durability}
        bot = Bot(provider or MockProvider(), store, durability=options)
        if setup is not None:
            setup(bot)
        bots.append(bot)
        await bot.start()
        return bot

    return make
