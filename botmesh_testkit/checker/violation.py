"""A broken guarantee."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Violation:
    """One guarantee a run broke: ``ids`` are the requirement ids of the spec it violates
    (``("OUT-2", "GUAR-4")``), ``message`` says what happened in terms of the run (which
    message, how often delivered, what was expected)."""

    ids: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"[{', '.join(self.ids)}] {self.message}"
