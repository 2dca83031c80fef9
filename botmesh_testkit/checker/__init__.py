"""Where guarantees are checked: :class:`~.violation.Violation` (a broken requirement,
named by its ids), the delivery and order rules in one copy (:mod:`.rules`), the crash
matrix's history check (:mod:`.history`) and the kill loops' judge (:mod:`.judge`)."""

from .rules import delivery_violation, order_streams, order_violations
from .violation import Violation

__all__ = ["Violation", "delivery_violation", "order_streams", "order_violations"]
