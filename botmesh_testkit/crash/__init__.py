"""Where faults are injected: the one catalogue of crash points (:mod:`.points`), the
crashable backend wrapper (:mod:`.wrapper`) and provider (:mod:`.provider`) built on one
interception mechanism (:mod:`.intercept`), and the crash :class:`World` (:mod:`.world`)."""

from .points import POINT_SPEC, POINTS, PROVIDER_SEND, crash_points, spec_ids
from .provider import ChannelProvider, CrashableProvider
from .world import World
from .wrapper import CrashableBackend, crashable

__all__ = ["POINTS", "POINT_SPEC", "PROVIDER_SEND", "ChannelProvider", "CrashableBackend", "CrashableProvider",
           "World", "crash_points", "crashable", "spec_ids"]
