"""THE catalogue of crash points: every name a crash can be armed at, the spec ids each
one exercises, and which of them count as steps of a workload.

The points are the durability backend interface's write operations
(:data:`botmesh.core.backend.WRITE_OPS`: each is one atomic step, so a death lands
before or after it, never inside) plus the provider's send. Everything in the testkit
that names a crash point — ``crashable``, ``CrashableProvider``, the crash matrix, the
kill loops' markers, ``botmesh-testkit points`` — takes it from here.
"""

from __future__ import annotations

from botmesh.core.backend import READ_OPS, WRITE_OPS

PROVIDER_SEND = "provider.send"
"""The provider's send: *before* it the channel never saw the message; *after* it the
channel accepted it and the process died before the answer came back."""

POINTS: tuple[str, ...] = (*WRITE_OPS, PROVIDER_SEND)
"""Every crash point, in the interface's order, the provider's send last."""

WRITES: dict[str, str] = dict(WRITE_OPS)
"""Crash point -> method of the durability backend interface, for the write operations."""

READS: dict[str, str] = dict(READ_OPS)
"""Operation name -> method, for the read operations (never crash points)."""

POINT_SPEC: dict[str, tuple[str, ...]] = {
    "inbox.journal": ("INB-1", "INB-4", "INB-8", "GUAR-1", "GUAR-2"),
    "inbox.claim": ("INB-3", "INB-7", "LEASE-2", "LEASE-4", "GUAR-7"),
    "inbox.heartbeat": ("LEASE-1", "REPL-3"),
    "inbox.complete": ("INB-2", "GUAR-4", "LEASE-2"),
    "inbox.retry_later": ("INB-5", "RETRY-1"),
    "inbox.kill": ("INB-5", "INB-7", "GUAR-7", "OPS-1"),
    "inbox.replay": ("OPS-2",),
    "inbox.purge": ("OPS-3",),
    "outbox.journal": ("OUT-1", "OUT-3", "OUT-10", "OUT-12", "GUAR-2"),
    "outbox.claim": ("OUT-7", "OUT-14", "LEASE-2", "LEASE-4"),
    "outbox.heartbeat": ("LEASE-1",),
    "outbox.mark_sent": ("OUT-1", "OUT-2", "GUAR-3", "GUAR-4"),
    "outbox.mark_failed": ("OUT-7", "OUT-9", "RETRY-1"),
    "outbox.mark_dead": ("OUT-7", "OUT-8", "OUT-12", "OPS-1"),
    "outbox.mark_unknown": ("OUT-14", "GUAR-3"),
    "outbox.split": ("OUT-12", "OUT-13"),
    "outbox.retry": ("OPS-2",),
    "outbox.discard": ("OPS-2",),
    "outbox.purge": ("OPS-3",),
    PROVIDER_SEND: ("OUT-1", "OUT-6", "OUT-14", "GUAR-3"),
}
"""The spec ids each crash point exercises."""

HANDLER = "handler"
"""Not a crash point: the kill loops' marker around a handler run."""

COUNTED: frozenset[str] = frozenset(
    op for op in POINTS if not op.endswith((".heartbeat", ".purge"))) | {HANDLER}
"""The points (and the handler marker) that count as steps of a workload in a real
child process: heartbeats and purges run on timers, so counting them would make "the
n-th step" depend on timing."""


def crash_points() -> list[str]:
    """Every named crash point: the backend's write operations, then the provider's
    send."""
    return list(POINTS)


def spec_ids(point: str) -> tuple[str, ...]:
    """The spec ids crash point ``point`` exercises (none for a random point ``*``)."""
    return POINT_SPEC.get(point, ())


def check_point(point: str) -> None:
    """Raise ``ValueError`` naming the known points unless ``point`` is one."""
    if point not in POINTS:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(POINTS)}")
