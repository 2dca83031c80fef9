"""The fault rules of the power-cut file system's server: ``fail`` (the n-th matching
operation returns an errno, once) and ``hold`` (the n-th matching operation waits until
it is released, or is cancelled by a power cut or an unmount), the operation counters,
and the *generation* that a power cut bumps so that an operation which started before
it never lands after it. Pure Python and thread-safe; the server (:mod:`.fuse_server`)
calls :meth:`FaultRules.gate` at the entry of every operation it passes through."""

from __future__ import annotations

import errno
import fnmatch
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAULT_OPS", "FaultRules"]

FAULT_OPS: tuple[str, ...] = (
    "read", "write", "fsync", "fsyncdir", "open", "create", "truncate", "rename", "unlink", "mkdir", "rmdir",
    "link",
)
"""The operations ``fail`` and ``hold`` can match (``"*"`` matches each). ``"open"`` also
matches ``"create"`` (an open that creates the file); ``"fsync"`` is a file's fsync or
fdatasync, ``"fsyncdir"`` a directory's. A ``write(2)`` that starts inside a page and
crosses its end reaches the file system as two writes, split at the page boundary (the
kernel's write-through path): each counts. A rule may name several operations joined by
``|`` (``"write|truncate|rename"``): the n-th operation of any of them is the one."""


@dataclass
class _Rule:
    id: int
    action: str  # "fail" | "hold"
    op: str
    glob: str
    nth: int
    errno: int
    seen: int = 0

    def matches(self, op: str, paths: tuple[str, ...]) -> bool:
        ops = self.op.split("|")
        if "*" not in ops and op not in ops and not ("open" in ops and op == "create"):
            return False
        return any(fnmatch.fnmatchcase(p, self.glob) for p in paths)


@dataclass
class _Held:
    rule: int
    op: str
    path: str
    pid: int
    released: bool = False
    cancelled: bool = False

    def public(self) -> dict[str, Any]:
        return {"rule": self.rule, "op": self.op, "path": self.path, "pid": self.pid}


class FaultRules:
    """The rules, the counters and the generation, under one condition variable.
    ``caller_pid`` tells the pid of the process making the current operation."""

    def __init__(self, caller_pid: Callable[[], int]) -> None:
        self._caller_pid = caller_pid
        self._cond = threading.Condition()
        self._rules: list[_Rule] = []
        self._next_rule = 1
        self._held: list[_Held] = []
        self._counts: Counter[str] = Counter()
        self._faults: list[dict[str, Any]] = []
        self._holds: list[dict[str, Any]] = []
        self._stopping = False
        self.generation = 0
        """Bumped by every power cut (:meth:`cut`)."""

    def gate(self, op: str, *paths: str) -> tuple[int, int]:
        """Count the operation and apply the rules: returns the generation it started in
        and the errno to fail with (0: none). A held operation waits here, and raises
        ``OSError(EIO)`` when a cut or an unmount cancels it."""
        with self._cond:
            self._counts[op] += 1
            gen = self.generation
            for rule in self._rules:
                if not rule.matches(op, paths):
                    continue
                rule.seen += 1
                if rule.seen != rule.nth:
                    continue
                self._rules.remove(rule)
                pid = self._caller_pid()
                if rule.action == "fail":
                    self._faults.append({"rule": rule.id, "op": op, "path": paths[0], "pid": pid,
                                         "errno": errno.errorcode.get(rule.errno, str(rule.errno))})
                    return gen, rule.errno
                held = _Held(rule.id, op, paths[0], pid)
                self._held.append(held)
                self._holds.append(held.public())
                self._cond.notify_all()
                while not (held.released or held.cancelled) and self.generation == gen and not self._stopping:
                    self._cond.wait()
                self._held.remove(held)
                if not held.released:
                    raise OSError(errno.EIO, "held operation cancelled (a cancel, a power cut or the unmount)")
                return gen, 0
        return gen, 0

    def add(self, action: str, op: str, path_glob: str, nth: int, code: int) -> int:
        """A new ``"fail"`` or ``"hold"`` rule; returns its id."""
        if action not in ("fail", "hold"):
            raise ValueError(f"unknown rule action {action!r}")
        if op != "*" and (not op or any(o not in FAULT_OPS for o in op.split("|"))):
            raise ValueError(f"unknown operation {op!r}: one of {', '.join(FAULT_OPS)}, several joined by '|', "
                             "or '*'")
        if nth < 1:
            raise ValueError(f"nth must be >= 1, got {nth}")
        if action == "fail" and code not in errno.errorcode:
            raise ValueError(f"unknown errno {code}")
        with self._cond:
            rule = _Rule(self._next_rule, action, op, path_glob, nth, code)
            self._next_rule += 1
            self._rules.append(rule)
        return rule.id

    def wait_held(self, timeout: float, count: int = 1) -> list[dict[str, Any]]:
        """Wait until ``count`` operations are held; ``TimeoutError`` after ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._held) >= count, timeout):
                raise TimeoutError(f"no operation held within {timeout} s (rules waiting: "
                                   f"{[(r.action, r.op, r.glob, r.nth, r.seen) for r in self._rules]})")
            return [h.public() for h in self._held]

    def release(self, rule: int | None) -> int:
        """Let the held operations of ``rule`` (all: ``None``) go on; a named rule that
        has not fired yet is dropped. Returns how many went on."""
        with self._cond:
            released = 0
            for held in self._held:
                if rule is None or held.rule == rule:
                    held.released = True
                    released += 1
            if rule is not None:
                self._rules = [r for r in self._rules if r.id != rule]
            self._cond.notify_all()
        return released

    def cancel(self, rule: int | None) -> int:
        """Answer the held operations of ``rule`` (all: ``None``) with ``EIO`` without
        doing them, and without a power cut: the process that made them was killed, so
        the operation never lands while everything before it stays (the page cache of a
        machine that kept its power). A named rule that has not fired yet is dropped.
        Returns how many were cancelled."""
        with self._cond:
            cancelled = 0
            for held in self._held:
                if (rule is None or held.rule == rule) and not held.released:
                    held.cancelled = True
                    cancelled += 1
            if rule is not None:
                self._rules = [r for r in self._rules if r.id != rule]
            self._cond.notify_all()
        return cancelled

    def clear(self) -> int:
        """Drop every rule and release every held operation."""
        with self._cond:
            self._rules.clear()
        return self.release(None)

    def cut(self) -> None:
        """A power cut: a new generation; held operations are cancelled."""
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def stop(self) -> None:
        """Unmounting: held operations are cancelled, and any held later too."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Counters and logs, for ``stats``."""
        with self._cond:
            return {"ops": dict(self._counts), "faults": list(self._faults), "holds": list(self._holds),
                    "held": [h.public() for h in self._held], "rules": len(self._rules)}
