"""``botmesh.core``: the Bot runtime and the durability engine."""

from .backend import WRITE_OPS, DurabilityBackend
from .bot import Bot, Context
from .clock import Clock, RealClock, VirtualClock
from .config import DurabilityConfig, parse_duration
from .engine import METRIC_KEYS, SendResult
from .errors import (
    BackendUnavailableError,
    BotmeshError,
    ConfigError,
    DurabilityError,
    InvalidArgumentError,
    InvalidKeyError,
    JournalCorruptError,
    JournalLockedError,
    KvContractError,
    SendDeferredError,
    SendFailedError,
    VersionConflict,
)
from .flows import Flow
from .kv_durability import KvDurability
from .media import load_media_of
from .memory import MemoryDurability, MemoryKv
from .provider import (
    InboundEvent,
    MediaUnavailableError,
    OutsideSessionWindowError,
    PayloadTooLargeError,
    Provider,
    ProviderError,
    RateLimitedError,
    RecipientUnreachableError,
    UnsupportedContentError,
)
from .records import InboxRecord, OutboxRecord
from .spi import Capabilities, DurableKv
from .store import MemoryStore, Store


def __getattr__(name: str) -> object:
    # FileDurability lives in its own module (all file I/O goes through fileio); import it lazily
    if name == "FileDurability":
        from .file_backend import FileDurability

        return FileDurability
    raise AttributeError(name)


__all__ = [
    "METRIC_KEYS", "WRITE_OPS", "BackendUnavailableError", "Bot", "BotmeshError", "Capabilities", "Clock",
    "ConfigError", "Context", "DurabilityBackend", "DurabilityConfig", "DurabilityError", "DurableKv",
    "FileDurability", "Flow", "InboundEvent", "InboxRecord", "InvalidArgumentError", "InvalidKeyError",
    "JournalCorruptError", "JournalLockedError",
    "KvContractError", "KvDurability", "MediaUnavailableError", "MemoryDurability", "MemoryKv", "MemoryStore", "OutboxRecord",
    "OutsideSessionWindowError", "PayloadTooLargeError", "Provider", "ProviderError", "RateLimitedError",
    "RealClock", "RecipientUnreachableError", "SendDeferredError", "SendFailedError", "SendResult", "Store",
    "UnsupportedContentError", "VersionConflict", "VirtualClock", "load_media_of", "parse_duration",
]
