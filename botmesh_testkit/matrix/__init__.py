"""The crash matrix (TEST-4): plain data and cell drawing (:mod:`.cells`), the workloads
(:mod:`.workloads`), the profiles of ``matrices/`` (:mod:`.profiles`), running cells
(:mod:`.run`) and coverage of the engine's recovery code per crash point
(:mod:`.coverage`). The history check is :mod:`botmesh_testkit.checker.history`."""

from .cells import POLICIES, Cell, MatrixResult, Oracle, Outcome, cells_for, compress, draw_cells, random_cells
from .run import oracle, run_cell, run_matrix

__all__ = ["POLICIES", "Cell", "MatrixResult", "Oracle", "Outcome", "cells_for", "compress", "draw_cells", "oracle",
           "random_cells", "run_cell", "run_matrix"]
