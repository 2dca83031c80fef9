"""``--botmesh-backend=pkg.module:factory`` from the folder that holds ``pkg``.

``python -m pytest`` puts the current directory on ``sys.path``; the ``pytest`` command
does not, so a backend module next to the user's tests could not be imported by one and
could by the other. The plugin makes both behave alike: when a backend is given as a
``pkg.module:factory`` path (on the command line or in the ini ``botmesh_backend``), the
folder pytest was started from is *appended* to ``sys.path`` before the path is
resolved — appended, so that it never hides an installed package or the standard
library. Child processes (kill loops, power cuts, multi-process items) inherit it."""

from __future__ import annotations

import sys

import pytest


def invocation_dir_on_path(config: pytest.Config) -> str | None:
    """Append the invocation folder to ``sys.path`` when a backend is a
    ``pkg.module:factory`` path; return the folder appended (None: nothing done)."""
    names = [*(config.getoption("--botmesh-backend") or []), *config.getini("botmesh_backend")]
    if not any(":" in str(name) for name in names):
        return None
    folder = str(config.invocation_params.dir)
    if folder in sys.path:
        return None
    sys.path.append(folder)
    return folder
