"""What explore's model raises when a story breaks it (its own module: the model's parts
in :mod:`.story`, :mod:`.replicas` and :mod:`.processes` all raise it)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ExploreViolation"]


class ExploreViolation(AssertionError):
    """What the model requires did not hold: ``ids`` are the requirement ids broken."""

    def __init__(self, ids: Sequence[str], message: str) -> None:
        super().__init__(f"[{', '.join(ids)}] {message}")
        self.ids = tuple(ids)
        self.message = message
