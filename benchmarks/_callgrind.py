"""The CPU instructions a child process executes, counted by valgrind's callgrind: the
deterministic figure of ``engine_cost.py --callgrind`` and ``crash_cells.py
--callgrind``."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

_TOTAL = re.compile(r"(?:summary|totals):\s+(\d+)")


def instructions(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` under ``valgrind --tool=callgrind`` with ``env`` (its output
    discarded) and return the instructions it executed. ``RuntimeError`` with the end
    of its stderr when it fails, or when callgrind wrote no total."""
    with tempfile.TemporaryDirectory(prefix="botmesh-callgrind-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} ... under callgrind exited {proc.returncode}: "
                               f"{proc.stderr.strip()[-300:]}")
        with open(out, encoding="utf-8") as f:
            for line in f:
                m = _TOTAL.match(line)
                if m:
                    return int(m.group(1))
    raise RuntimeError(f"{' '.join(argv[:3])} ...: no instruction total in the callgrind output")
