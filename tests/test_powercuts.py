"""The ``powercuts`` part has teeth: run through the plugin as users run it (pytester, a
subprocess), the power-cut loop — the kill loop with the backend's storage on the FUSE
file system that loses every unsynced write, a power cut at every kill — refuses
backends that acknowledge writes they did not make durable, and certifies the ones that
do (GUAR-1, GUAR-2, INB-1, OUT-1: an acknowledged inbound or journaled send survives).

A SIGKILL leaves the page cache intact, so every backend below passes the kill loops;
only the power cut tells them apart.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import require_fuse

pytest_plugins = ["pytester"]

RUN = ("-p", "no:cacheprovider", "-p", "no:benchmark")
PROFILE = """description = "power cuts only"
workloads = ["one-send"]
policies = ["skip"]
kills = 0
kill_messages = 12
power_cuts = 12
"""

BACKENDS = '''
import json
import os

from botmesh.core import Capabilities, MemoryKv
from botmesh.core.file_backend import FileKv
from botmesh.sqlite_store import SQLiteKv


class ClaimsDurable(FileKv):
    """A FileKv without fsync that claims to survive a crash anyway."""

    capabilities = Capabilities(survives_crash=True)


def file_log_nofsync(workdir):
    return ClaimsDurable(os.path.join(workdir, "j.json"), append_log=True, fsync=False)


def file_snapshot_nofsync(workdir):
    return ClaimsDurable(os.path.join(workdir, "j.json"), append_log=False, fsync=False)


def file_log(workdir):
    return FileKv(os.path.join(workdir, "j.json"), append_log=True, fsync=True)


def file_snapshot(workdir):
    return FileKv(os.path.join(workdir, "j.json"), append_log=False, fsync=True)


def file_log_compacting(workdir):
    return FileKv(os.path.join(workdir, "j.json"), append_log=True, fsync=True, compact_every=3)


class Synchronous(SQLiteKv):
    """SQLiteKv whose connection runs with another PRAGMA synchronous."""

    level = "FULL"

    def _open_locked(self):
        conn = super()._open_locked()
        conn.execute(f"PRAGMA synchronous = {self.level}")
        return conn


class SyncOff(Synchronous):
    level = "OFF"


class SyncNormal(Synchronous):
    level = "NORMAL"


def sqlite_off(workdir):
    return SyncOff(os.path.join(workdir, "bot.db"))


def sqlite_normal(workdir):
    return SyncNormal(os.path.join(workdir, "bot.db"))


class SnapshotKv(MemoryKv):
    """A MemoryKv that saves its whole state to one file after every write, in one of
    several ways of (not) making it durable."""

    capabilities = Capabilities(survives_crash=True)
    how = "durable"

    def __init__(self, path):
        super().__init__()
        self.path = path
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for scope, space, key, value, version, due, expires in json.load(f):
                    self._space(scope, space)[key] = (value, version, due, expires)

    def _save(self):
        rows = [[scope, space, key, *entry] for (scope, space), records in self._data.items()
                for key, entry in records.items()]
        data = json.dumps(rows).encode()
        folder = os.path.dirname(self.path)
        if self.how == "in-place":  # no fsync at all
            with open(self.path, "wb") as f:
                f.write(data)
            return
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            if self.how != "rename-unsynced":
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if self.how != "no-dir-fsync":
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def put(self, *args, **kwargs):
        version = await super().put(*args, **kwargs)
        self._save()
        return version

    async def delete(self, *args, **kwargs):
        await super().delete(*args, **kwargs)
        self._save()


def snapshot(how):
    cls = type(f"Snapshot_{how}", (SnapshotKv,), {"how": how})
    return lambda workdir: cls(os.path.join(workdir, "state.json"))


snapshot_in_place = snapshot("in-place")
snapshot_rename_unsynced = snapshot("rename-unsynced")
snapshot_no_dir_fsync = snapshot("no-dir-fsync")
snapshot_durable = snapshot("durable")
'''


def _certify(pytester: pytest.Pytester, backend: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    pytester.makepyfile(pcbackends=BACKENDS)
    pytester.makefile(".toml", pc=PROFILE)
    result = pytester.runpytest_subprocess(*RUN, f"--botmesh-backend={backend}", "--botmesh-parts=powercuts",
                                           "--botmesh-matrix=pc.toml", "--botmesh-seed=3", "--botmesh-report=r.json",
                                           "--botmesh-require-powercuts")
    report = json.loads((pytester.path / "r.json").read_text(encoding="utf-8"))
    (entry,) = report["backends"]
    return result, entry


@pytest.fixture(autouse=True)
def _fuse() -> None:
    require_fuse()


@pytest.mark.spec("GUAR-1", "GUAR-2", "INB-1", "OUT-1")
@pytest.mark.parametrize("factory", [
    "file_log_nofsync",          # FileKv append log, fsync=False, claiming survives_crash
    "file_snapshot_nofsync",     # FileKv snapshot, fsync=False, claiming survives_crash
    "sqlite_off",                # SQLite, PRAGMA synchronous=OFF
    "sqlite_normal",             # SQLite WAL, PRAGMA synchronous=NORMAL
    "snapshot_in_place",         # a kv that writes with no fsync at all
    "snapshot_rename_unsynced",  # renames a new file into place without fsyncing it first
    "snapshot_no_dir_fsync",     # fsyncs its file, never the directory it renamed it into
])
def test_a_backend_that_acknowledges_unsynced_writes_is_not_certified(pytester: pytest.Pytester,
                                                                      factory: str) -> None:
    result, entry = _certify(pytester, f"pcbackends:{factory}")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert entry["verdict"] == "not certified", entry
    assert entry["parts"]["powercuts"]["failed"] == 1, entry["parts"]
    assert "power-cut loop on " in out and "pcbackends:" in out, out[-3000:]
    # what broke is named by requirement id, with the command that reruns the loop
    assert set(entry["broken"]) & {"GUAR-1", "GUAR-2", "INB-1", "INB-2", "INB-3", "OUT-1", "OUT-2", "OUT-14"}, entry
    assert "rerun: pytest --botmesh-backend=pcbackends:" in out and "--botmesh-parts=powercuts" in out


@pytest.mark.spec("GUAR-1", "GUAR-2", "INB-1", "OUT-1")
@pytest.mark.parametrize("backend", ["sqlite", "pcbackends:file_log", "pcbackends:file_snapshot",
                                     "pcbackends:file_log_compacting", "pcbackends:snapshot_durable"])
def test_a_backend_that_syncs_what_it_acknowledges_survives_every_power_cut(pytester: pytest.Pytester,
                                                                             backend: str) -> None:
    result, entry = _certify(pytester, backend)
    out = result.stdout.str()
    assert result.ret == 0, out[-4000:]
    assert entry["parts"]["powercuts"] == {"passed": 1, "failed": 0, "skipped": 0}, entry["parts"]
    result.stdout.fnmatch_lines(["*power-cut loop on *: passed*", "*power cuts: 12 (drop 4, subset 4, torn 4)*"])
