"""The outcome of a kill loop or a replica scenario: each kill (:class:`KillInfo`), the
counts, the violations and how each duplicate and loss was accounted for
(:class:`KillResult`, with its report)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..checker.judge import Accounting
from ..checker.violation import Violation

if TYPE_CHECKING:
    from .parent import Run


@dataclass
class KillInfo:
    """One kill: of incarnation ``n``, how (``mode``), where it landed (``point``), what
    was planned, and how long the next child took to be ready and to recover."""

    n: int
    mode: str
    """``marker`` (frozen at its n-th marker), ``delay`` (after a random delay), ``idle``
    (the planned point was never reached: killed with nothing in flight)."""
    point: str
    planned: str
    kill_to_ready_ms: float | None = None
    kill_to_recovered_ms: float | None = None


@dataclass
class KillResult:
    """The outcome of a kill loop (or of a replica scenario, from
    :meth:`~botmesh_testkit.kill.Replicas.finish`)."""

    backend: str
    policy: str
    seed: int
    params: dict[str, Any]
    kills: list[KillInfo]
    self_deaths: int
    incarnations: int
    messages: int
    acked: int
    feeds: int
    deliveries: int
    distinct_keys: int
    inbox_states: dict[str, int]
    outbox_states: dict[str, int]
    violations: list[Violation]
    accounting: Accounting
    seconds: float
    kill_phase_seconds: float
    reproduce: str
    events: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run: Run | None = field(default=None, repr=False)
    """The :class:`~botmesh_testkit.kill.parent.Run` with every incarnation, marker and
    event (for custom checks)."""
    label: str = "kill loop"

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def violated_ids(self) -> set[str]:
        return {i for v in self.violations for i in v.ids}

    def ready_ms(self) -> list[float]:
        return [k.kill_to_ready_ms for k in self.kills if k.kill_to_ready_ms is not None]

    def recovered_ms(self) -> list[float]:
        return [k.kill_to_recovered_ms for k in self.kills if k.kill_to_recovered_ms is not None]

    def report(self) -> str:
        points = Counter(f"{k.mode}: {k.point}" for k in self.kills)
        # how the duplicates and losses of a passing run were accounted for (a failing run
        # lists each one that was not, under "violated")
        dups, losses = self.accounting.duplicate_count, self.accounting.loss_count
        dups_why = " (each covered by a durability:ambiguous event, OUT-14 resend)" if dups and self.passed else ""
        losses_why = (" (each an outbox 'unknown' record after a durability:ambiguous event, OUT-14 skip)"
                      if losses and self.passed else "")
        modes = Counter(k.mode for k in self.kills)
        lines = [
            f"{self.label} on {self.backend}, on_ambiguous={self.policy}"
            f"{f', text_limit={limit}' if (limit := self.params.get('text_limit')) is not None else ''}, seed {self.seed}: "
            f"{'passed' if self.passed else f'FAILED, {len(self.violations)} violation(s)'} ({self.seconds:.1f} s)",
            f"  kills: {len(self.kills)} ({', '.join(f'{m} {c}' for m, c in sorted(modes.items())) or 'none'}); "
            f"self-deaths: {self.self_deaths}; incarnations: {self.incarnations}",
            f"  messages: {self.messages}, acknowledged {self.acked}, fed {self.feeds}x "
            f"({self.feeds - self.messages} redeliveries)",
            f"  inbox: {dict(sorted(self.inbox_states.items()))}; outbox: {dict(sorted(self.outbox_states.items()))}",
            f"  deliveries: {self.deliveries} of {self.distinct_keys} keys; duplicates: "
            f"{dups}{dups_why}; losses: {losses}{losses_why}" if self.passed else
            f"  deliveries: {self.deliveries} of {self.distinct_keys} keys; accounted for: {dups} duplicate(s), "
            f"{losses} loss(es); NOT accounted for: {len(self.violations)} violation(s), listed below",
        ]
        if self.events:
            lines.append("  events: " + ", ".join(f"{k} {v}" for k, v in sorted(self.events.items())))
        ready, rec = self.ready_ms(), self.recovered_ms()
        if ready:
            lines.append(f"  kill -> ready median {statistics.median(ready):.0f} ms; kill -> recovered (first sweep "
                         f"done) median {statistics.median(rec) if rec else float('nan'):.0f} ms")
        for d in self.accounting.duplicates:
            lines.append(f"  duplicate: {d}")
        for d in self.accounting.losses:
            lines.append(f"  loss: {d}")
        for d in self.accounting.dead_inbound:
            lines.append(f"  dead: {d}")
        amb_only = [a for a in self.accounting.ambiguous]
        if amb_only:
            lines.append(f"  ambiguous sends: {len(amb_only)}")
            lines.extend(f"    {a}" for a in amb_only[:20])
            if len(amb_only) > 20:
                lines.append(f"    ... and {len(amb_only) - 20} more")
        if points:
            lines.append("  kill points: " + "; ".join(f"{p} x{c}" if c > 1 else p for p, c in points.most_common()))
        lines.extend(f"  note: {n}" for n in self.notes)
        for v in self.violations:
            lines.append(f"  violated {v}")
        if not self.passed:
            lines.append(f"  violated ids: {', '.join(sorted(self.violated_ids))}")
            lines.append(f"  seed: {self.seed}")
            lines.append(f"  reproduce: {self.reproduce}")
        return "\n".join(lines)

    def assert_ok(self) -> KillResult:
        """Raise ``AssertionError`` with the report when a guarantee was broken."""
        if not self.passed:
            raise AssertionError(self.report())
        return self
