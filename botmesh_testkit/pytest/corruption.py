"""The ``corruption`` part's items (:mod:`botmesh_testkit.matrix.corruption`): one per
backend whose storage is files in its workdir, damaging ``corruption_variants`` copies of
them (profile key); a server backend has none (not applicable, which its verdict says)."""

from __future__ import annotations

import asyncio
import shlex
import tempfile
from typing import Any

import pytest

from .items import CellFailed, ReportingItem
from .options import matrix_name, rerun_base


class CorruptionItem(ReportingItem):
    """The corruption loop on one backend: ``variants`` damaged copies of its files, each
    opened by a new incarnation that must refuse it or answer what was acknowledged."""

    def __init__(self, *, backend: str, variants: int, seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from ..matrix.corruption import IDS

        self.backend = backend
        self.variants = variants
        self.seed = seed
        self.add_marker(pytest.mark.spec(*IDS))
        self.user_properties.append(("botmesh_backend", backend))

    def runtest(self) -> None:
        from ..matrix.corruption import IDS, corruption_loop

        with tempfile.TemporaryDirectory(prefix="botmesh-corruption-") as tmp:
            run = asyncio.run(corruption_loop(self.backend, variants=self.variants, seed=self.seed, workdir=tmp))
        if isinstance(run, str):
            pytest.skip(run)
        self.user_properties.append(("botmesh_kill_report", [run.summary()]))
        if not run.passed:
            self.user_properties.append(("botmesh_violated", IDS))
            raise CellFailed(run.report() + f"\n  rerun: {rerun_base(self.config, self.seed)} --botmesh-parts=corruption "
                                            f"--botmesh-matrix={matrix_name(self.config)} "
                                            f"-k {shlex.quote(f'{self.backend}/')}")

    def reportinfo(self) -> tuple[str, int, str]:
        return "botmesh-corruption", 0, self.name


def files_in_workdir(backend: str) -> bool:
    """Whether ``backend``'s storage is files under the harness's workdir (``file``,
    ``file+log``, ``sqlite``, a factory taking the workdir): the corruption part applies.
    A server backend's storage is the server's (not applicable)."""
    from ..backends.registry import resolve
    from ..kill.powercut import storage_on_workdir

    with tempfile.TemporaryDirectory(prefix="botmesh-probe-") as tmp:
        try:
            return storage_on_workdir(resolve(backend)(tmp).kill_spec(), tmp)
        except Exception:  # a harness that cannot even describe its storage: nothing to damage
            return False


def corruption_items(session: pytest.Session, config: pytest.Config, backends: list[str],
                     seed: int) -> list[pytest.Item]:
    """One corruption item per backend with files in its workdir (none when the profile's
    ``corruption_variants`` is 0)."""
    from ..matrix.profiles import load_profile

    variants = load_profile(matrix_name(config)).corruption_variants
    if not variants:
        return []
    items: list[pytest.Item] = []
    for backend in backends:
        if files_in_workdir(backend):
            name = f"botmesh-corruption::{backend}/{variants}-variants"
            items.append(CorruptionItem.from_parent(session, name=name, nodeid=name, backend=backend,
                                                    variants=variants, seed=seed))
    return items
