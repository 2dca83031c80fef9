"""The shipped DurableKv conformance suite (BACK-7) bound to the built-in kvs, exactly as
a third party binds it: MemoryKv (the reference itself), FileKv (snapshot only, and with
the append log) and SQLiteKv."""

from __future__ import annotations

from pathlib import Path

import pytest
from botmesh.core.file_backend import FileKv
from botmesh.core.memory import MemoryKv
from botmesh.sqlite_store import SQLiteKv

from botmesh_testkit.conformance.kv import DurableKvConformance, KvFactory


class TestMemoryKv(DurableKvConformance):
    @pytest.fixture
    def kv_factory(self) -> KvFactory:
        # Each instance is its own storage: MemoryKv claims no survives_crash, so the
        # suite never opens two instances expecting the same data.
        return MemoryKv


class TestFileKv(DurableKvConformance):
    @pytest.fixture
    def kv_factory(self, tmp_path: Path) -> KvFactory:
        return lambda: FileKv(tmp_path / "journal.json")


class TestFileKvAppendLog(DurableKvConformance):
    @pytest.fixture
    def kv_factory(self, tmp_path: Path) -> KvFactory:
        return lambda: FileKv(tmp_path / "journal.json", append_log=True)


class TestSQLiteKv(DurableKvConformance):
    @pytest.fixture
    def kv_factory(self, tmp_path: Path) -> KvFactory:
        return lambda: SQLiteKv(tmp_path / "bot.db")
